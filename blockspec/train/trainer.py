"""Training loop pieces shared by the target LM and the drafters: optimiser, schedule, wall-clock budget."""

from __future__ import annotations

import contextlib
import math
import random
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn


# ---------------------------------------------------------------- shared optimisation
def make_optimizer(model: nn.Module, lr: float, weight_decay: float, betas: tuple[float, float] = (0.9, 0.95)
                   ) -> torch.optim.AdamW:
    """AdamW over trainable parameters; weight decay only on matrices that are not embeddings."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 and "embed" not in name else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=betas)


def cosine_lr(step: int, total: int, base: float, warmup_frac: float, min_ratio: float) -> float:
    """Linear warm-up over warmup_frac of `total`, then cosine down to min_ratio * base."""
    warmup = max(1, int(warmup_frac * total))
    if step < warmup:
        return base * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return base * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


class StepBudget:
    """How many optimiser steps a run gets: a step cap, a wall-clock cap, or both.

    With a wall-clock cap the step time is measured over the first steps (after a short warm-up
    that absorbs kernel autotuning) and the total is fixed from it, so the cosine schedule still
    ends where training ends. The hard deadline is checked every step as a guard.
    """

    CALIB_START, CALIB_END = 3, 13

    def __init__(self, max_steps: int | None, max_seconds: float | None, start_step: int = 0,
                 total: int | None = None) -> None:
        if max_steps is None and max_seconds is None:
            raise ValueError("give max_steps, a time budget, or both")
        self.max_steps = max_steps
        self.max_seconds = max_seconds
        self.t0 = time.monotonic()
        self.start_step = start_step
        self.total = total or max_steps or 10**9
        self.calibrated = total is not None or max_seconds is None
        self._t_calib: float | None = None

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def after_step(self, step: int) -> None:
        """Call with the number of steps done so far."""
        if self.calibrated:
            return
        done = step - self.start_step
        if done == self.CALIB_START:
            self._t_calib = time.monotonic()
        elif done == self.CALIB_END and self._t_calib is not None:
            per_step = (time.monotonic() - self._t_calib) / (self.CALIB_END - self.CALIB_START)
            left = max(0.0, self.max_seconds - self.elapsed())
            total = step + int(0.97 * left / max(per_step, 1e-6))
            self.total = min(total, self.max_steps) if self.max_steps else total
            self.calibrated = True

    def done(self, step: int) -> bool:
        if step >= self.total:
            return True
        return self.max_seconds is not None and self.elapsed() >= self.max_seconds


def autocast(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """bf16 autocast on CUDA (fp32 master weights); plain fp32 on CPU."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def progress_bar(total: int | None, desc: str, enabled: bool) -> Iterator[None] | Any:
    """A tqdm bar (or None when disabled) whose postfix carries the running loss and metrics."""
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, dynamic_ncols=True, mininterval=0.5)
