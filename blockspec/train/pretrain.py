"""Staged target pretraining: each call trains one slice, from a saved state to the next one.

The state (`state.py`) holds the fp32 weights (group ``model``), the AdamW moments (``optimizer``)
and the run (``run``: configuration, corpus plan, schedule, data position, history). The cosine
schedule's length is fixed when the run starts, from the corpus plan (epochs x batches per epoch),
so where the run is cut into slices changes nothing: two slices of two steps give the bits of one
run of four (tests/test_flagship.py). A slice ends at its time or step budget, or when the next batch
needs a piece that is not on hand (it then says which piece to carry next). A state whose
``optimizer`` shards were left behind resumes from its weights with fresh moments, and says so.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from blockspec.models.llama import CausalLM
from blockspec.models.loader import resolve_device
from blockspec.train.corpus import load_piece
from blockspec.train.data import (
    DataError,
    Example,
    read_texts,
    stdlib_split,
    text_examples,
)
from blockspec.train.state import MAX_FILE_BYTES, has_state, load_state, save_state
from blockspec.train.stream import (
    PieceInfo,
    WindowBatches,
    manifest_plan,
    window_examples,
)
from blockspec.train.target_lm import (
    TargetShape,
    lm_step,
    new_target,
    perplexity,
    save_hf_target,
)
from blockspec.train.trainer import CosineSchedule, make_optimizer


@dataclass
class PretrainConfig:
    """The run's shape and optimisation; fixed when the run starts (a resume takes the state's)."""

    shape: TargetShape = field(default_factory=TargetShape)
    seq_len: int = 1024
    batch_size: int = 64
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_frac: float = 0.02
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    epochs: float = 3.0
    seed: int = 0
    eval_windows: int = 256
    eval_batch_size: int = 16

    def total_steps(self, steps_per_epoch: int) -> int:
        return max(1, round(self.epochs * steps_per_epoch))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PretrainConfig:
        return cls(**{**d, "shape": TargetShape(**d["shape"])})


@dataclass
class Run:
    """A pretraining run in memory: model, optimiser, schedule, data stream and what it has done."""

    cfg: PretrainConfig
    model: CausalLM
    opt: torch.optim.Optimizer
    schedule: CosineSchedule
    stream: WindowBatches
    total: int
    step: int = 0
    pad_id: int = 1
    history: list[dict[str, Any]] = field(default_factory=list)
    exact_resume: bool = True


def start_run(cfg: PretrainConfig, plan: list[PieceInfo], pieces_dir: Path, eos_id: int, pad_id: int,
              device: torch.device) -> Run:
    """A fresh run: initial weights from cfg.seed, the schedule over the whole plan."""
    model = new_target(cfg.shape.model_config(eos_id), cfg.seed).to(device).train()
    opt = make_optimizer(model, cfg.lr, cfg.weight_decay)
    schedule = CosineSchedule(opt, cfg.warmup_frac, cfg.min_lr_ratio)
    stream = WindowBatches(plan, pieces_dir, cfg.seq_len, cfg.batch_size, cfg.seed)
    total = cfg.total_steps(stream.steps_per_epoch)
    schedule.plan(total, 0)
    return Run(cfg, model, opt, schedule, stream, total, pad_id=pad_id)


def resume_run(state_dir: Path, pieces_dir: Path, device: torch.device) -> Run:
    """The run saved in `state_dir`; without its optimizer shards, fresh AdamW moments (not an exact resume)."""
    state = load_state(state_dir)
    info = state["run"]
    cfg = PretrainConfig.from_dict(info["config"])
    plan = [PieceInfo(**p) for p in info["plan"]]
    model = new_target(cfg.shape.model_config(info["eos_id"]), cfg.seed)
    model.load_state_dict(state["model"])
    model.to(device).train()
    opt = make_optimizer(model, cfg.lr, cfg.weight_decay)
    exact = "optimizer" in state
    if exact:
        opt.load_state_dict(state["optimizer"])
    schedule = CosineSchedule(opt, cfg.warmup_frac, cfg.min_lr_ratio)
    step = int(info["step"])
    if exact:
        schedule.load_state_dict(info["schedule"], step)
    else:  # fresh moments: the schedule continues from the step, from the configured peak
        for group in opt.param_groups:
            group.setdefault("initial_lr", cfg.lr)
        schedule.plan(int(info["total"]), step)
    stream = WindowBatches(plan, pieces_dir, cfg.seq_len, cfg.batch_size, cfg.seed)
    stream.load_state_dict(info["position"])
    return Run(cfg, model, opt, schedule, stream, int(info["total"]), step, int(info["pad_id"]),
               list(info["history"]), exact)


def save_run(run: Run, state_dir: Path, max_file_bytes: int = MAX_FILE_BYTES) -> list[Path]:
    """The run as a state directory (every file at most max_file_bytes)."""
    info = {"config": dataclasses.asdict(run.cfg), "plan": [dataclasses.asdict(p) for p in run.stream.plan],
            "eos_id": run.model.config.eos_token_ids[0], "pad_id": run.pad_id, "step": run.step, "total": run.total,
            "schedule": run.schedule.state_dict(), "position": run.stream.state_dict(), "history": run.history}
    return save_state(state_dir, {"model": run.model.state_dict(), "optimizer": run.opt.state_dict(), "run": info},
                      max_file_bytes)


def train_slice(run: Run, seconds: float | None, max_steps: int | None) -> dict[str, Any]:
    """Train until the slice's time or step budget, the run's end, or a missing piece; returns what happened."""
    device = next(run.model.parameters()).device
    t0 = time.monotonic()
    first = run.step
    losses: list[float] = []
    stop = "budget"
    while True:
        if run.step >= run.total:
            stop = "done"
            break
        if (max_steps is not None and run.step - first >= max_steps) or (
                seconds is not None and time.monotonic() - t0 >= seconds):
            break
        if not run.stream.available():
            stop = "piece"
            break
        ids = next(run.stream).to(device, non_blocking=True)
        loss = lm_step(run.model, run.opt, run.schedule, ids, torch.ones_like(ids), run.cfg.grad_clip)
        run.step += 1
        if run.step % 10 == 0 or len(losses) < 10:
            losses.append(float(loss))
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds_used = time.monotonic() - t0
    steps = run.step - first
    tokens = steps * run.cfg.batch_size * run.cfg.seq_len
    return {"steps": steps, "from_step": first, "to_step": run.step, "total_steps": run.total, "stop": stop,
            "seconds": round(seconds_used, 1), "tokens": tokens,
            "tokens_per_s": round(tokens / seconds_used) if seconds_used > 0 else None,
            "last_losses": [round(x, 4) for x in losses[-5:]], "lr": run.schedule.lr(),
            "epoch": round(run.step / max(1, run.stream.steps_per_epoch), 3), "next_piece": run.stream.needed(),
            "exact_resume": run.exact_resume}


def validation_examples(path: Path, seq_len: int, count: int) -> list[Example]:
    """`count` windows spread over a validation piece."""
    return window_examples(load_piece(path), seq_len, count)


def heldout_examples(tokenizer: Any, seq_len: int, count: int) -> list[Example]:
    """Windows of the held-out stdlib packages (json, asyncio, email) of the running interpreter."""
    return text_examples(read_texts(stdlib_split().heldout), tokenizer, seq_len + 1)[:count]


def evaluate(run: Run, valid: list[Example], heldout: list[Example]) -> dict[str, float]:
    device = next(run.model.parameters()).device
    out = {}
    for name, examples in (("valid_perplexity", valid), ("heldout_perplexity", heldout)):
        if examples:
            ppl = perplexity(run.model, examples, run.pad_id, run.cfg.eval_batch_size, device)
            out[name] = round(ppl, 3) if math.isfinite(ppl) else ppl
    run.model.train()
    return out


def pretrain_slice(state_dir: Path, pieces_dir: Path, out_state: Path | None = None, *, cfg: PretrainConfig | None = None,
                   manifest: Path | None = None, tokenizer: Any = None, minutes: float | None = None,
                   max_steps: int | None = None, validation: Path | None = None,
                   heldout: list[Example] | None = None, export_dir: Path | None = None, device: str = "auto",
                   max_file_bytes: int = MAX_FILE_BYTES) -> dict[str, Any]:
    """One slice: resume from `state_dir` (or start, from cfg, the corpus manifest and the tokenizer), train,
    evaluate (perplexity on `validation` windows and on `heldout` examples), save.

    The new state goes to `out_state` (default: `state_dir`, replaced file by file with the index last);
    `export_dir` gets the target as a bf16 transformers checkpoint (with `tokenizer`) in shards a call can
    return.
    """
    dev = resolve_device(device)
    if has_state(state_dir):
        run = resume_run(state_dir, pieces_dir, dev)
    else:
        if cfg is None or manifest is None or tokenizer is None:
            raise DataError(f"{state_dir}: no state to resume; a new run needs a config, the corpus manifest and "
                            "the tokenizer")
        if len(tokenizer) != cfg.shape.vocab_size:
            raise DataError(f"the tokenizer has {len(tokenizer)} tokens, the target's vocab_size is "
                            f"{cfg.shape.vocab_size}")
        run = start_run(cfg, manifest_plan(manifest), pieces_dir, tokenizer.eos_token_id, tokenizer.pad_token_id,
                        dev)
    result = train_slice(run, minutes * 60 if minutes is not None else None, max_steps)
    t = time.monotonic()
    valid = validation_examples(validation, run.cfg.seq_len, run.cfg.eval_windows) if validation else []
    result.update(evaluate(run, valid, heldout or []))
    result["eval_seconds"] = round(time.monotonic() - t, 1)
    run.history.append(result)
    save_run(run, out_state or state_dir, max_file_bytes)
    if export_dir is not None:
        save_hf_target(run.model, export_dir, tokenizer, dtype="bfloat16", max_shard_bytes=max_file_bytes)
    return result
