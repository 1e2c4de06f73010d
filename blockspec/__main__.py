"""`python -m blockspec ...` is the `blockspec` command (for environments where the script is not on PATH)."""

from blockspec.cli import main

raise SystemExit(main())
