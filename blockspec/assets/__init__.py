"""The assets the package ships: the embedded default pair (a Qwen3 code target and its DFlash and DSpark
drafters, each a Hugging Face directory under `default/`), which every command and `LLM` name `default`."""

from __future__ import annotations

from pathlib import Path

PAIR = Path(__file__).parent / "default"


def embedded(name: str, part: str = "target") -> str:
    """'default' names the embedded pair's `part` (its target, or its dflash or dspark drafter); any other
    name is a directory or hub id, as given."""
    return str(PAIR / part) if name == "default" else name
