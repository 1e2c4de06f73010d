"""A run's point in a bench sweep: its prompt length, batch size (concurrency) and temperature.

Runs are matched by point (a speculative run with plain decoding's, TP = N with TP = 1, a fixed-K run with
the policy's) and named by it in the report. The prompt length is None for prompts from a file or a
built-in set, which form one point per batch and temperature.
"""

from __future__ import annotations

from typing import Any

Point = tuple[int | None, int, float]  # (input length, batch, temperature)
RunKey = tuple[str, int | None, int, float]  # (method, *point)


def point(run: dict[str, Any]) -> Point:
    return run.get("input_len"), run["batch"], run["temperature"]


def point_name(run: dict[str, Any]) -> str:
    """"in512 b16 T0.0": prompt length (where random prompts set it), batch, temperature."""
    prompt = f"in{run['input_len']} " if run.get("input_len") else ""
    return f"{prompt}b{run['batch']} T{run['temperature']}"


def input_cell(run: dict[str, Any]) -> str:
    """A table's prompt-length cell: the random prompts' length, else the run's mean prompt length."""
    if run.get("input_len"):
        return str(run["input_len"])
    mean = run.get("prompt_tokens_mean")
    return f"{mean:.0f}" if mean is not None else "n/a"
