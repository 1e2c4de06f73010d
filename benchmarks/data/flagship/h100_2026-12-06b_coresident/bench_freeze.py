"""`blockspec bench ARGS` with the collector frozen over the timed rounds (the bench's default) or not:
python bench_freeze.py on|off ARGS..."""
import sys

from blockspec.bench import timing
from blockspec.cli import main

timing.FREEZE_COLLECTOR = sys.argv[1] == "on"
sys.exit(main(["bench", *sys.argv[2:]]))
