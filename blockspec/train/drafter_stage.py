"""Staged drafter training on the target's regenerated rows, with held-out early stopping through the engine.

Each GPU call trains one slice of a DFlash or DSpark drafter with `trainer.DrafterTrainer` (random
anchors, position-decayed loss, the references' objectives) on the regenerated pieces, from a saved
state (`state.py`; groups ``drafter``: fp32 weights, ``optimizer``: AdamW moments, ``trainer``:
schedule, data position, anchor and RNG states, ``run``: the stage's configuration, evaluations and
best step, ``best``: the best drafter's weights in bf16) to the next. At every evaluation the drafter
is exported and its greedy acceptance length measured through blockspec's engine on openings of
held-out stdlib functions (json, asyncio, email; not the ones the demo and its test decode), the
whole block verified every step; the best weights are kept, and the run stops after `patience`
evaluations without a gain of `min_gain`, or at its planned steps. A new run may start from another
run's exported drafter (`init`: its weights, fresh optimiser moments and schedule; a deeper plan's
added layers start as the identity). A state without its ``optimizer`` shards resumes with fresh
AdamW moments and says so. `export_best` writes the best
drafter in its reference format (z-lab DFlash, DeepSpec DSpark) on any machine, from the state and
the target.
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from blockspec.drafters.formats import write_recorded_acceptance
from blockspec.models.loader import load_target, resolve_device
from blockspec.train.data import DataError
from blockspec.train.state import MAX_FILE_BYTES, has_state, load_state, save_state
from blockspec.train.stream import RowBatches, load_rows
from blockspec.train.trainer import (
    DrafterTrainConfig,
    DrafterTrainer,
    engine_acceptance,
    resolve_mask_token_id,
)

WHOLE_BLOCK = {"adaptive_draft_length": False}


@dataclass
class DrafterStageConfig:
    """The drafter's training configuration and the stage's plan; fixed by the first slice."""

    train: dict[str, Any] = field(default_factory=dict)  # DrafterTrainConfig fields
    epochs: float = 1.0
    eval_minutes: float = 2.0
    eval_every_steps: int = 0  # evaluate every N steps instead of every eval_minutes (0: by time)
    patience: int = 3
    min_gain: float = 0.02
    eval_prompts: int = 24
    eval_new_tokens: int = 128
    init: str | None = None  # a drafter export (its reference format) whose weights a new run starts from

    def train_config(self, device: str) -> DrafterTrainConfig:
        return DrafterTrainConfig(**{**self.train, "device": device, "progress": False})


# the demo and tests/test_default_pair pick their prompts among the first limit x 8 openings (limit <= 64):
# early stopping selects on openings after those, so the figures reported on the demo's prompts are not
# the ones the drafter was chosen by
SELECTION_SKIP = 512


def selection_prompt_ids(tokenizer: Any, count: int) -> list[list[int]]:
    """`count` openings of held-out stdlib functions (json, asyncio, email) outside the demo's, spread evenly,
    as token ids."""
    from blockspec.demo import heldout_openings

    pool = heldout_openings()[SELECTION_SKIP:]
    if len(pool) < count:
        raise DataError(f"{len(pool)} held-out openings after the demo's {SELECTION_SKIP}, {count} wanted")
    chosen = pool[:: len(pool) // count][:count]
    return [tokenizer.encode(p, add_special_tokens=False) for p in chosen]


@dataclass
class Stage:
    """A drafter run in memory: the trainer, the plan and its evaluations."""

    cfg: DrafterStageConfig
    trainer: DrafterTrainer
    total: int
    evals: list[dict[str, Any]] = field(default_factory=list)
    best: dict[str, Any] | None = None  # {"step", "acceptance"}
    best_weights: dict[str, torch.Tensor] | None = None
    stopped: str | None = None
    history: list[dict[str, Any]] = field(default_factory=list)
    exact_resume: bool = True


def open_stage(target: Any, tokenizer: Any, rows_dir: Path, state_dir: Path, cfg: DrafterStageConfig | None,
               device: torch.device) -> Stage:
    """The stage saved in `state_dir`, or a new one from `cfg` (its step count fixed from the rows and epochs)."""
    state = load_state(state_dir) if has_state(state_dir) else None
    if state is None and cfg is None:
        raise DataError(f"{state_dir}: no state to resume and no configuration for a new drafter")
    if state is not None:
        cfg = DrafterStageConfig(**state["run"]["config"])
    train_cfg = cfg.train_config(str(device))
    rows = load_rows(rows_dir)
    batches = RowBatches(rows, train_cfg.batch_size, train_cfg.seed)
    total = state["run"]["total"] if state else max(1, round(cfg.epochs * len(batches) / batches.batch_size))
    train_cfg.max_steps = total
    mask_id = state["run"]["mask_token_id"] if state else resolve_mask_token_id(train_cfg, tokenizer, target.config)
    trainer = DrafterTrainer(target, [], train_cfg, mask_id, rows.pad_id, batches=batches)
    if state is None and cfg.init is not None:
        trainer.drafter.load_state_dict(init_weights(Path(cfg.init), trainer.drafter, train_cfg.method, mask_id))
    stage = Stage(cfg, trainer, total)
    if state is not None:
        trainer.check_state(state["trainer"], state_dir)
        trainer.drafter.load_state_dict(state["drafter"])
        optimizer = state.get("optimizer")
        if optimizer is None:  # the moments stayed on another machine: fresh ones, the schedule continuing
            for group in trainer.opt.param_groups:
                group.setdefault("initial_lr", group["lr"])
            optimizer = trainer.opt.state_dict()
            stage.exact_resume = False
        trainer.restore_state(state["trainer"] | {"optimizer": optimizer})
        run = state["run"]
        stage.evals, stage.best, stage.stopped, stage.history = run["evals"], run["best"], run["stopped"], run["history"]
        stage.best_weights = state.get("best")
    return stage


# the products that end a decoder layer's two residual branches: zeroed, a layer adds nothing to its input
RESIDUAL_OUTPUTS = ("self_attn.o_proj.weight", "self_attn.o_proj.bias", "mlp.down_proj.weight", "mlp.down_proj.bias")


def init_weights(export: Path, drafter: Any, method: str, mask_id: int) -> dict[str, torch.Tensor]:
    """The weights of a drafter export for a new run's drafter (float32): another run's best, trained on
    with a fresh optimiser and schedule. Its shape and mask token must be the plan's, except that the plan
    may be deeper or read more target layers: the layers past the export's keep their own initialization
    with their residual branches' last products zeroed, and the new taps' columns of ``fc`` start at zero,
    so the run starts from the export's drafts exactly and trains what was added from there."""
    from blockspec.drafters import load_drafter

    loaded = load_drafter(method, export, device="cpu", dtype="float32")
    if loaded.config.mask_token_id != mask_id:
        raise DataError(f"{export}: mask_token_id {loaded.config.mask_token_id}, the run's is {mask_id}")
    theirs, ours = loaded.state_dict(), drafter.state_dict()
    depth = loaded.config.num_layers
    out = {}
    for name, t in ours.items():
        parts = name.split(".", 2)
        if parts[0] == "layers" and int(parts[1]) >= depth:  # a layer the export lacks
            out[name] = torch.zeros_like(t) if parts[2] in RESIDUAL_OUTPUTS else t
            continue
        if name == "fc.weight" and name in theirs:
            out[name] = tap_columns(theirs[name], list(loaded.config.target_layer_ids),
                                    list(drafter.config.target_layer_ids), export)
            continue
        if name not in theirs or theirs[name].shape != t.shape:
            got = tuple(theirs[name].shape) if name in theirs else "missing"
            raise DataError(f"{export}: {name} is {got}, the planned drafter's is {tuple(t.shape)} "
                            "(the plan's shape must be the export's, or deeper)")
        out[name] = theirs[name]
    return out


def tap_columns(fc: torch.Tensor, theirs: list[int], ours: list[int], export: Path) -> torch.Tensor:
    """The export's ``fc`` [hidden, len(theirs) * H] laid out for the plan's taps: each of its taps' columns
    where the plan reads that layer, zeros for the layers it adds."""
    missing = [i for i in theirs if i not in ours]
    if missing:
        raise DataError(f"{export}: reads target layers {theirs}; the plan's taps {ours} lack {missing} "
                        "(the plan may add taps, not drop them)")
    width = fc.shape[1] // len(theirs)
    out = fc.new_zeros(fc.shape[0], width * len(ours))
    for j, layer in enumerate(ours):
        if layer in theirs:
            i = theirs.index(layer)
            out[:, j * width:(j + 1) * width] = fc[:, i * width:(i + 1) * width]
    return out


def save_stage(stage: Stage, state_dir: Path, max_file_bytes: int = MAX_FILE_BYTES) -> list[Path]:
    """The stage as a state directory (every file at most max_file_bytes)."""
    t = stage.trainer
    rest = t.checkpoint_state()
    optimizer = rest.pop("optimizer")
    run = {"config": dataclasses.asdict(stage.cfg), "total": stage.total, "mask_token_id": t.drafter.mask_token_id,
           "method": t.cfg.method, "evals": stage.evals, "best": stage.best, "stopped": stage.stopped,
           "history": stage.history}
    obj = {"drafter": t.drafter.state_dict(), "optimizer": optimizer, "trainer": rest, "run": run}
    if stage.best_weights is not None:
        obj["best"] = stage.best_weights
    return save_state(state_dir, obj, max_file_bytes)


def measure(stage: Stage, target_dir: Path, prompts: list[list[int]], device: torch.device) -> dict[str, Any]:
    """Greedy acceptance of the current drafter through the engine (whole block verified); keeps the best."""
    t = stage.trainer
    with tempfile.TemporaryDirectory() as tmp:
        exported = t.export(Path(tmp) / t.cfg.method)
        result = engine_acceptance(target_dir, t.cfg.method, exported, prompts, stage.cfg.eval_new_tokens,
                                   str(device), spec_options=WHOLE_BLOCK)
    entry = {"step": t.step_num, "acceptance": result["mean_acceptance_length"],
             "per_position": result["acceptance_rate_per_pos"], "drafts": result["num_drafts"]}
    stage.evals.append(entry)
    if stage.best is None or entry["acceptance"] > stage.best["acceptance"] + stage.cfg.min_gain:
        stage.best = {"step": entry["step"], "acceptance": entry["acceptance"]}
        stage.best_weights = {k: v.detach().to("cpu", torch.bfloat16).clone()
                              for k, v in t.drafter.state_dict().items()}
    elif sum(1 for e in stage.evals if e["step"] > stage.best["step"]) >= stage.cfg.patience:
        stage.stopped = f"no gain of {stage.cfg.min_gain} in {stage.cfg.patience} evaluations after step " \
                        f"{stage.best['step']}"
    return entry


def drafter_slice(target_dir: Path, rows_dir: Path, state_dir: Path, out_state: Path | None = None, *,
                  cfg: DrafterStageConfig | None = None, minutes: float | None = None, max_steps: int | None = None,
                  device: str = "auto", max_file_bytes: int = MAX_FILE_BYTES) -> dict[str, Any]:
    """One slice: resume (or start), train until the time or step budget, evaluating on the way and at the end,
    save the state to `out_state` (default: `state_dir`). Returns the slice's metrics."""
    from blockspec.engine.build import load_tokenizer

    dev = resolve_device(device)
    t0 = time.monotonic()
    target, _ = load_target(target_dir, "auto", dev)
    tokenizer = load_tokenizer(Path(target_dir))
    stage = open_stage(target, tokenizer, rows_dir, state_dir, cfg, dev)
    prompts = selection_prompt_ids(tokenizer, stage.cfg.eval_prompts)
    trainer = stage.trainer
    first = trainer.step_num
    last_eval_t, last_eval_step = time.monotonic(), first
    losses: list[float] = []
    train_seconds = 0.0
    while stage.stopped is None and trainer.step_num < stage.total:
        if (max_steps is not None and trainer.step_num - first >= max_steps) or (
                minutes is not None and time.monotonic() - t0 >= minutes * 60):
            break
        t_step = time.monotonic()
        out = trainer.step(stage.total)
        if trainer.step_num % 10 == 0 or len(losses) < 5:
            losses.append(float(out.loss.detach()))
        train_seconds += time.monotonic() - t_step
        every = stage.cfg.eval_every_steps
        due = (trainer.step_num - last_eval_step >= every) if every else (
            time.monotonic() - last_eval_t >= stage.cfg.eval_minutes * 60)
        if due:
            measure(stage, target_dir, prompts, dev)
            last_eval_t, last_eval_step = time.monotonic(), trainer.step_num
    if trainer.step_num >= stage.total and stage.stopped is None:
        stage.stopped = "planned steps done"
    if trainer.step_num > last_eval_step or not stage.evals:
        measure(stage, target_dir, prompts, dev)
    steps = trainer.step_num - first
    result = {"method": trainer.cfg.method, "steps": steps, "from_step": first, "to_step": trainer.step_num,
              "total_steps": stage.total, "train_seconds": round(train_seconds, 1),
              "seconds": round(time.monotonic() - t0, 1), "last_losses": [round(x, 4) for x in losses[-5:]],
              "evals": [e for e in stage.evals if e["step"] > first] or stage.evals[-1:], "best": stage.best,
              "stopped": stage.stopped, "exact_resume": stage.exact_resume}
    stage.history.append({k: v for k, v in result.items() if k != "evals"})
    save_stage(stage, out_state or state_dir, max_file_bytes)
    return result


def export_best(state_dir: Path, target_dir: Path, out_dir: Path, device: str = "cpu") -> Path:
    """The state's best drafter in its reference format (z-lab DFlash / DeepSpec DSpark), bf16, with the target's
    embedding and LM head copied where the format carries them."""
    state = load_state(state_dir, groups=["run", "best"])
    if "best" not in state:
        raise DataError(f"{state_dir}: no evaluated drafter yet (no 'best' weights)")
    run = state["run"]
    dev = resolve_device(device)
    target, _ = load_target(target_dir, "float32", dev)
    cfg = DrafterStageConfig(**run["config"]).train_config(str(dev))
    trainer = DrafterTrainer(target, [], cfg, run["mask_token_id"], 0, batches=iter(()))
    trainer.drafter.load_state_dict({k: v.float() for k, v in state["best"].items()})
    if out_dir.exists():
        shutil.rmtree(out_dir)
    exported = trainer.export(out_dir)
    best = next(e for e in run["evals"] if e["step"] == run["best"]["step"])
    write_recorded_acceptance(exported, best["per_position"],
                              f"greedy, whole block verified, {best['drafts']} drafts on held-out openings "
                              f"(train step {best['step']})")
    return exported
