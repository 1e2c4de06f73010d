"""`blockspec train`: train DFlash and DSpark drafters against a frozen target.

One step, per batch of sequences [b, S]:

1. The frozen target runs cache-free over the clean sequences and returns, in the same pass, the
   drafter's tap features (``target_layer_ids``) and its final hidden states (next-token
   distributions, computed only where a loss needs them).
2. Up to ``num_anchors`` random anchors p per sequence are drawn among loss positions (p and p+1
   both supervised). Each anchor gets a block ``[x_p, MASK x (B-1)]`` at positions p..p+B-1; all
   blocks of a sequence are one query sequence of length N*B.
3. Every draft layer attends over ``[context K/V of all S positions | all N*B block K/V]`` with one
   dense mask: a block's queries see context positions strictly before its anchor and the whole
   block bidirectionally, nothing of other blocks. Context K/V come from the fused features through
   each layer's own k/v projection, k-norm and RoPE, exactly as ``append_context`` computes them at
   inference, so the trained function is the one ``block_hidden`` runs (tested).
4. Draft slot j (0-based; DFlash block row j+1, DSpark row j) predicts the token at p+j+1. Its
   weight is exp(-j/gamma) times the contiguous valid prefix (labels inside the sequence and
   supervised). DFlash: cross-entropy. DSpark: 0.1 CE + 0.9 L1(p_draft, p_target) + 1.0
   BCE(confidence, 1 - L1/2) with the Markov head teacher-forced (previous token = the true token,
   x_0 = the anchor); the BCE target is detached, its features are not (DeepSpec).

Exported drafters use the drafter module's own writers (z-lab DFlash, DeepSpec DSpark).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import json
import math
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Literal, get_args, get_type_hints

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from blockspec.assets import embedded
from blockspec.config import ConfigError, ModelConfig, drafter_kind, drafter_method, output_dir
from blockspec.models.kv_cache import dense_causal_meta
from blockspec.models.llama import CausalLM
from blockspec.models.loader import load_target, resolve_device
from blockspec.drafters import (
    DFlashDraft,
    DSparkDraft,
    DSparkHeads,
    DraftModel,
    DrafterConfig,
    build_target_layer_ids,
    load_drafter,
    save_dflash,
    save_dspark,
)
from blockspec.drafters.config import MARKOV_HEAD_TYPES
from blockspec.drafters.formats import ACCEPTANCE_FILE, write_recorded_acceptance
from blockspec.train.data import Batches, DataError, Example, collate, load_examples, split_examples, text_files

Method = Literal["dflash", "dspark"]
Labels = Literal["data", "target"]
MarkovHeadType = Literal[MARKOV_HEAD_TYPES]
METHODS: tuple[str, ...] = get_args(Method)


# ================================================================ shared optimisation
def make_optimizer(model: nn.Module, lr: float, weight_decay: float, betas: tuple[float, float] = (0.9, 0.95)
                   ) -> torch.optim.AdamW:
    """AdamW over trainable parameters; weight decay only on matrices that are not embeddings."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 and "embed" not in name and "markov_w1" not in name else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=betas)


CHECKPOINT_VERSION = 1
CHECKPOINT_WEIGHTS, CHECKPOINT_STATE = "drafter.safetensors", "trainer_state.pt"
DEFAULT_TARGET_FEATURES = 3


class CosineSchedule:
    """Linear warm-up over warmup_frac of the planned steps, then cosine decay to min_ratio x each group's lr:
    transformers' ``get_cosine_with_min_lr_schedule_with_warmup``, rebuilt at the current step whenever the
    plan's length changes (a time budget fixes it after a few steps; a resume may extend it).

    With w warm-up steps of T, step s trains at lr x s / w while s < w (0 at step 0), then at
    lr x (m + (1 - m) (1 + cos(pi (s - w) / (T - w))) / 2).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, warmup_frac: float, min_ratio: float) -> None:
        self.optimizer = optimizer
        self.warmup_frac = warmup_frac
        self.min_ratio = min_ratio
        self.total: int | None = None
        self.scheduler: torch.optim.lr_scheduler.LambdaLR | None = None

    def plan(self, total: int, step: int) -> None:
        """Schedule over `total` steps, positioned so that the next optimiser step is `step`."""
        if total == self.total and self.scheduler is not None:
            return
        from transformers import get_cosine_with_min_lr_schedule_with_warmup

        self.total = total
        self.scheduler = get_cosine_with_min_lr_schedule_with_warmup(
            self.optimizer, int(self.warmup_frac * total), total, min_lr_rate=self.min_ratio, last_epoch=step - 1)

    def lr(self) -> float:
        """The learning rate of the next step (the first parameter group's)."""
        return self.optimizer.param_groups[0]["lr"]

    def step(self) -> None:
        self.scheduler.step()

    def state_dict(self) -> dict[str, Any]:
        return {"total": self.total, "scheduler": self.scheduler.state_dict() if self.scheduler else None}

    def load_state_dict(self, state: dict[str, Any], step: int) -> None:
        if state["total"] is not None:
            self.plan(state["total"], step)
            self.scheduler.load_state_dict(state["scheduler"])


class StepBudget:
    """How many optimiser steps a run gets: a step cap, a wall-clock cap, or both.

    With a wall-clock cap the step time is measured over the first steps (after a short warm-up
    that absorbs kernel autotuning) and the total is fixed from it, so the cosine schedule still
    ends where training ends. The hard deadline is checked every step as a guard.
    """

    CALIB_START, CALIB_END = 3, 13

    def __init__(self, max_steps: int | None, max_seconds: float | None, start_step: int = 0) -> None:
        if max_steps is None and max_seconds is None:
            raise ConfigError("training needs max_steps, a time budget (max_minutes), or both")
        self.max_steps = max_steps
        self.max_seconds = max_seconds
        self.t0 = time.monotonic()
        self.start_step = start_step
        self.total = max_steps or 10**9
        self.calibrated = max_seconds is None
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


def autocast(device: torch.device, frozen_dtype: torch.dtype = torch.float32) -> contextlib.AbstractContextManager[Any]:
    """bf16 autocast on CUDA (fp32 master weights). On CPU plain fp32, unless a frozen half-precision
    target is involved: then autocast to its dtype so fp32 drafter rows can meet its LM head."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    if frozen_dtype != torch.float32:
        return torch.autocast("cpu", dtype=frozen_dtype)
    return contextlib.nullcontext()


def progress_bar(total: int | None, desc: str, enabled: bool) -> Any:
    """A tqdm bar, or None when disabled."""
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, dynamic_ncols=True, mininterval=0.5)


# ================================================================ configuration
def option(default: Any, help: str) -> Any:
    """A dataclass field whose `help` becomes its `blockspec train` flag's help text (HfArgumentParser)."""
    return field(default=default, metadata={"help": help})


MAX_BLOCK_SIZE = 256  # block lengths past this draft nothing a verify could take (the references use 8-16)

RESUME_KEEPS = ("lr", "weight_decay", "warmup_frac", "min_lr_ratio", "batch_size", "seed", "max_len", "num_anchors")
"""Training options a resumed run cannot change: its optimiser, schedule, data order and batches are restored."""


@dataclass
class DrafterTrainConfig:
    """Everything a drafter training run needs besides the target and the data; each field is a
    `blockspec train` flag.

    Shape fields left as None copy the target's (hidden size, heads, MLP width). Loss weights
    left as None take the method's published values: DFlash CE only with gamma 7/5/4 for block
    16/10/8; DSpark 0.1 CE + 0.9 L1 + 1.0 BCE with gamma 4.
    """

    method: Method = option("dflash", "drafter family")
    init_from: str | None = option(None, "fine-tune this drafter checkpoint (default: none, a new drafter)")
    num_layers: int = option(2, "draft decoder layers")
    block_size: int | None = option(None, "block length: DFlash's anchor and the positions drafted after it, "
                                          "DSpark's drafted positions (None: 16 for dflash, 7 for dspark)")
    target_layer_ids: list[int] | None = option(None, "target layers whose outputs the drafter reads "
                                                      "(None: z-lab's uniform choice)")
    num_target_features: int | None = option(None, "how many target layers to tap when target_layer_ids is None, "
                                                   "at most all but the target's last (None: 3, or as many as "
                                                   "layers 1..L-2 of a smaller target hold)")
    intermediate_size: int | None = option(None, "drafter MLP width (None: the target's; the hidden size is the "
                                                 "target's, whose embedding and LM head the drafter shares)")
    num_heads: int | None = option(None, "attention heads (None: the target's)")
    num_kv_heads: int | None = option(None, "key/value heads (None: the target's, at most num_heads)")
    head_dim: int | None = option(None, "per-head width (None: the target's, or hidden_size / num_heads)")
    mask_token_id: int | None = option(None, "embedding row of the block's MASK positions (None: the tokenizer's "
                                             "mask token, else the first row past the tokenizer)")
    markov_rank: int = option(64, "dspark: rank of the Markov head (0: none)")
    markov_head_type: MarkovHeadType = option("vanilla", "dspark: Markov head variant")
    confidence_head: bool = option(True, "dspark: train the confidence head")
    # data
    max_len: int = option(512, "tokens per training sequence at most")
    batch_size: int = option(8, "sequences per optimiser step")
    num_anchors: int = option(512, "blocks (random anchors) per sequence at most")
    eval_frac: float = option(0.02, "share of the data held out for evaluation when --eval-data is not given")
    labels: Labels = option(
        "data", "what each draft position learns: the data's token, or the target's greedy token given the data "
                "prefix (what greedy verification accepts)")
    # loss
    loss_decay_gamma: float | None = option(None, "position weight exp(-j / gamma) (None: the method's value)")
    ce_alpha: float | None = option(None, "cross-entropy weight (None: 1.0 dflash, 0.1 dspark)")
    l1_alpha: float | None = option(None, "L1 distance to the target distribution (None: 0.9 dspark, 0 dflash)")
    kl_alpha: float = option(0.0, "KL divergence from the target distribution to the drafter's (distillation of "
                                  "the target's whole next-token distribution, beside the labels)")
    conf_alpha: float | None = option(None, "dspark: confidence-head BCE weight (None: 1.0 with the head)")
    # optimisation
    lr: float = option(6e-4, "peak learning rate (AdamW)")
    warmup_frac: float = option(0.04, "share of the steps spent warming the learning rate up from 0")
    min_lr_ratio: float = option(0.0, "final learning rate as a share of the peak (cosine decay)")
    weight_decay: float = option(0.0, "AdamW weight decay on matrices (not embeddings)")
    grad_clip: float = option(1.0, "gradient norm clip")
    max_steps: int | None = option(1000, "stop after this many optimiser steps in all (a resume counts the "
                                         "checkpoint's)")
    max_minutes: float | None = option(None, "stop after this many minutes of this run (the step count is "
                                             "fixed from the first steps' speed; default: none, "
                                             "max_steps alone)")
    eval_every: int = option(0, "evaluate on the held-out data every N steps (0: only at the end)")
    eval_batches: int = option(8, "held-out batches per evaluation")
    checkpoint_dir: str | None = option(None, "directory for the checkpoint (drafter.safetensors and "
                                              "trainer_state.pt); --resume continues from it (default: none, "
                                              "no checkpoint)")
    checkpoint_every: int = option(0, "save a checkpoint every N steps (0: only at the end)")
    resume: bool = option(False, "continue from the checkpoint in --checkpoint-dir, or start a new run there when "
                                 "it holds none (a checkpoint is never overwritten by a new run)")
    seed: int = option(0, "seed of the data order, anchors and initial weights")
    device: str = option("auto", "auto | cpu | cuda | cuda:N")
    target_dtype: Literal["auto", "float32", "bfloat16", "float16"] = option(
        "auto", "dtype the frozen target is loaded in (auto: the checkpoint's on GPU, float32 on CPU)")
    progress: bool = option(True, "show a progress bar")
    # optional regeneration of responses by the target (blockspec's engine)
    regenerate: bool = option(False, "replace each example's supervised part by the target's own continuation")
    regen_temperature: float = option(0.0, "temperature of the regenerated continuations")
    regen_prompt_tokens: int = option(64, "prompt length for regenerating fully supervised text chunks")
    regen_max_new_tokens: int | None = option(None, "regenerated tokens per example at most (None: up to max_len)")
    # the export's recorded acceptance
    acceptance_prompts: int = option(16, "held-out prompts on which the exported drafter's greedy acceptance is "
                                         "measured through the engine, whole block verified, and written beside "
                                         "it as acceptance.json (where the draft-length policy starts); 0: none")

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ConfigError(f"method {self.method!r} not supported; allowed: {METHODS}")
        if self.block_size is None:
            self.block_size = 16 if self.method == "dflash" else 7
        min_block = 2 if self.method == "dflash" else 1
        if self.block_size < min_block:
            raise ConfigError(f"block_size must be >= {min_block} for {self.method}, got {self.block_size}")
        if self.loss_decay_gamma is None:
            b = self.block_size
            self.loss_decay_gamma = 4.0 if self.method == "dspark" else (7.0 if b >= 16 else 5.0 if b >= 10 else 4.0)
        dspark = self.method == "dspark"
        self.ce_alpha = self.ce_alpha if self.ce_alpha is not None else (0.1 if dspark else 1.0)
        self.l1_alpha = self.l1_alpha if self.l1_alpha is not None else (0.9 if dspark else 0.0)
        has_conf = dspark and self.confidence_head
        self.conf_alpha = self.conf_alpha if self.conf_alpha is not None else (1.0 if has_conf else 0.0)
        for name in ("ce_alpha", "l1_alpha", "conf_alpha", "kl_alpha"):
            if not getattr(self, name) >= 0:
                raise ConfigError(f"{name} must be a number >= 0, got {getattr(self, name)!r}")
        if not self.ce_alpha + self.l1_alpha + self.kl_alpha > 0:  # else nothing trains the drafts
            raise ConfigError("ce_alpha, l1_alpha and kl_alpha are all 0: no loss trains the drafts; give one > 0")
        if self.target_layer_ids is not None:
            self.target_layer_ids = [int(i) for i in self.target_layer_ids]
        if self.labels not in get_args(Labels):
            raise ConfigError(f"labels {self.labels!r} not supported; allowed: {', '.join(get_args(Labels))}")
        if self.resume and not self.checkpoint_dir:
            raise ConfigError("--resume needs --checkpoint-dir: the directory of the checkpoint to continue")
        if self.num_anchors < 1 or self.batch_size < 1 or self.max_len < 2:
            raise ConfigError("num_anchors, batch_size must be >= 1 and max_len >= 2")
        # each optimisation number in its range (a gamma of 0 trained on NaN losses, max_steps 0 never stopped)
        for name, ok, allowed in (
                ("lr", lambda v: 0 < v < math.inf, "a number > 0"),
                ("loss_decay_gamma", lambda v: 0 < v < math.inf, "a number > 0"),
                ("warmup_frac", lambda v: 0 <= v < 1, "in [0, 1)"),
                ("min_lr_ratio", lambda v: 0 <= v <= 1, "in [0, 1]"),
                ("weight_decay", lambda v: 0 <= v < math.inf, "a number >= 0"),
                ("grad_clip", lambda v: 0 < v < math.inf, "a number > 0"),
                ("eval_frac", lambda v: 0 <= v < 1, "in [0, 1)"),
                ("max_steps", lambda v: v is None or v >= 1, "an integer >= 1, or None with max_minutes"),
                ("max_minutes", lambda v: v is None or 0 < v < math.inf, "a number > 0, or None"),
                ("num_target_features", lambda v: v is None or v >= 1, "an integer >= 1, or None"),
                ("num_layers", lambda v: v >= 1, "an integer >= 1"),
                ("block_size", lambda v: v <= MAX_BLOCK_SIZE, f"at most {MAX_BLOCK_SIZE}"),
                *((name, lambda v: v is None or v >= 1, "an integer >= 1, or None (the target's)")
                  for name in ("intermediate_size", "num_heads", "num_kv_heads", "head_dim")),
                ("eval_batches", lambda v: v >= 1, "an integer >= 1"),
                ("eval_every", lambda v: v >= 0, "an integer >= 0 (0: only at the end)"),
                ("checkpoint_every", lambda v: v >= 0, "an integer >= 0 (0: only at the end)"),
                ("regen_max_new_tokens", lambda v: v is None or v >= 1, "an integer >= 1, or None"),
                ("acceptance_prompts", lambda v: v >= 0, "an integer >= 0 (0: none)")):
            value = getattr(self, name)
            if not ok(value):
                raise ConfigError(f"--{name.replace('_', '-')} must be {allowed}, got {value!r}")


def default_target_layer_ids(num_target_layers: int, n: int) -> tuple[int, ...]:
    """n taps, for 1 <= n <= max_target_features(L): z-lab's uniform taps between layer 1 and L-3; spread over
    [1, L-2] when those collide (small targets); every layer but the last when n is L-1.

    The last layer is never tapped: its HF hidden state is post-norm (DeepSpec refuses it). A one-layer
    target has no other, so its one tap is that layer.
    """
    last = num_target_layers - 1
    if n >= last:
        return tuple(range(max(1, last)))
    ids = sorted(set(build_target_layer_ids(num_target_layers, n)))
    if len(ids) < n:
        ids = sorted({round(1 + i * (last - 2) / (n - 1)) for i in range(n)})
    return tuple(ids)


def max_target_features(num_target_layers: int) -> int:
    """How many layers a drafter can tap: all but the last."""
    return max(1, num_target_layers - 1)


def target_taps(cfg: DrafterTrainConfig, num_target_layers: int) -> tuple[int, ...]:
    """The target layers the drafter reads: cfg.target_layer_ids, else num_target_features default taps
    (None: DEFAULT_TARGET_FEATURES, or as many as layers 1..L-2 hold: z-lab's taps start past the embedding
    layer). A count the target cannot give is refused: lowered, the drafter would read fewer layers than
    asked for."""
    if cfg.target_layer_ids:
        return tuple(cfg.target_layer_ids)
    most = max_target_features(num_target_layers)
    n = cfg.num_target_features
    if n is None:
        n = min(DEFAULT_TARGET_FEATURES, max(1, num_target_layers - 2))
    elif n > most:
        raise ConfigError(f"--num-target-features must be an integer in [1, {most}] for this target "
                          f"({num_target_layers} layers, the last never tapped), got {n}")
    return default_target_layer_ids(num_target_layers, n)


def resolve_mask_token_id(cfg: DrafterTrainConfig, tokenizer: Any, target_cfg: ModelConfig) -> int:
    """The config's id, else the tokenizer's mask token, else the first embedding row past the tokenizer
    (the Qwen3 convention: 151669 is the first padded, unused row)."""
    if cfg.mask_token_id is not None:
        mask = cfg.mask_token_id
    elif tokenizer is not None and getattr(tokenizer, "mask_token_id", None) is not None:
        mask = tokenizer.mask_token_id
    elif tokenizer is not None and len(tokenizer) < target_cfg.vocab_size:
        mask = len(tokenizer)
    else:
        raise ConfigError("mask_token_id: give one (a row of the target embedding), or a tokenizer with a mask "
                          "token or with fewer tokens than the target's embedding rows")
    if not 0 <= mask < target_cfg.vocab_size:
        raise ConfigError(f"mask_token_id {mask} outside the target embedding [0, {target_cfg.vocab_size})")
    return mask


def check_init_shape(cfg: DrafterTrainConfig, drafter: DraftModel) -> None:
    """--init-from fine-tunes a checkpoint as it is: a shape option set away from its default (or a block size
    away from the method's) that the checkpoint does not have is refused by name, not silently ignored."""
    c = drafter.config
    held: dict[str, Any] = {name: getattr(c, name) for name in (
        "num_layers", "block_size", "intermediate_size", "num_heads", "num_kv_heads", "head_dim",
        "mask_token_id")}
    held["target_layer_ids"] = list(c.target_layer_ids)
    held["num_target_features"] = len(c.target_layer_ids)
    if isinstance(drafter, DSparkDraft):
        h = drafter.heads
        held.update(markov_rank=h.markov_rank, markov_head_type=h.markov_head_type or "vanilla",
                    confidence_head=h.enable_confidence_head)
    defaults = {f.name: f.default for f in dataclasses.fields(DrafterTrainConfig)}
    defaults["block_size"] = DrafterTrainConfig(method=cfg.method).block_size
    clashes = [f"--{name.replace('_', '-')} {getattr(cfg, name)} (the checkpoint's: {value})"
               for name, value in held.items()
               if getattr(cfg, name) not in (None, defaults[name]) and getattr(cfg, name) != value]
    if clashes:
        raise ConfigError(f"--init-from {cfg.init_from} fixes the drafter's shape; drop or match "
                          + ", ".join(clashes))


def build_drafter(cfg: DrafterTrainConfig, target_cfg: ModelConfig, mask_token_id: int, seed: int = 0) -> DraftModel:
    """A freshly initialised drafter (HF-style N(0, 0.02) init) sharing the target's embedding and LM head."""
    taps = target_taps(cfg, target_cfg.num_hidden_layers)
    hidden = target_cfg.hidden_size  # the drafter shares the target's embedding and LM head
    heads = cfg.num_heads or target_cfg.num_attention_heads
    # not given: the target's, cut to a divisor of the heads (each key/value head serves a group of them)
    kv_heads = cfg.num_kv_heads or math.gcd(heads, min(target_cfg.num_key_value_heads, heads))
    if heads % kv_heads:
        raise ConfigError(f"--num-kv-heads {kv_heads} must divide --num-heads {heads} (each key/value head serves a "
                          "group of query heads)")
    if cfg.num_heads is not None and cfg.head_dim is None and hidden % heads:
        raise ConfigError(f"--num-heads {heads} must divide the hidden size {hidden}, or give --head-dim")
    dcfg = DrafterConfig(
        hidden_size=hidden,
        intermediate_size=cfg.intermediate_size or target_cfg.intermediate_size,
        num_layers=cfg.num_layers, num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=cfg.head_dim or (target_cfg.head_dim if cfg.num_heads is None else hidden // heads),
        vocab_size=target_cfg.vocab_size, block_size=cfg.block_size, mask_token_id=mask_token_id,
        target_layer_ids=tuple(taps), target_hidden_size=target_cfg.hidden_size,
        rms_norm_eps=target_cfg.rms_norm_eps, rope=target_cfg.rope,
        max_position_embeddings=target_cfg.max_position_embeddings,
        anchor_first=cfg.method == "dspark", num_target_layers=target_cfg.num_hidden_layers, torch_dtype="bfloat16",
    )
    if cfg.method == "dspark":
        heads_cfg = DSparkHeads(cfg.markov_rank, cfg.markov_head_type if cfg.markov_rank > 0 else None,
                                cfg.confidence_head, cfg.confidence_head and cfg.markov_rank > 0, cfg.num_anchors)
        model: DraftModel = DSparkDraft(dcfg, heads_cfg)
    else:
        model = DFlashDraft(dcfg)
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if "norm" in name and p.dim() == 1:
            nn.init.ones_(p)
        elif p.dim() >= 2:
            nn.init.normal_(p, 0.0, 0.02, generator=gen)
        else:
            nn.init.zeros_(p)
    return model


# ================================================================ batch construction
def sample_anchors(loss_mask: Tensor, num_anchors: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """Up to num_anchors distinct anchors per row among positions p with loss_mask[p] and loss_mask[p+1].

    Returns (anchors [b, N] sorted ascending, valid [b, N]); N = min(num_anchors, most candidates in a
    row), so every row has the same block count and rows with fewer candidates get dummy blocks.
    """
    cand = (loss_mask[:, :-1] > 0) & (loss_mask[:, 1:] > 0)
    b, n_pos = cand.shape
    n = max(1, min(num_anchors, int(cand.sum(1).max()) if n_pos else 0))
    keys = torch.rand(b, max(n_pos, 1), generator=generator)
    if n_pos:
        keys = torch.where(cand, keys, keys + 2.0)  # invalid positions sort last
    idx = keys.topk(n, dim=1, largest=False).indices.sort(dim=1).values
    valid = cand.gather(1, idx) if n_pos else torch.zeros(b, n, dtype=torch.bool)
    return idx, valid


def block_attention_masks(dcfg: DrafterConfig, anchors: Tensor, seq_len: int) -> list[Tensor]:
    """Per draft layer, the [b, 1, N*B, S + N*B] bool mask (True = attend) of the training forward.

    Keys are [context 0..S-1 | block 0 | ... | block N-1]. A query of block n sees context keys
    strictly before anchor n and the keys of block n, under the same per-layer causal and window
    rules ``DraftModel._block_masks`` applies at inference.
    """
    bsz, n = anchors.shape
    blk = dcfg.block_size
    dev = anchors.device
    q_anchor = anchors.repeat_interleave(blk, dim=1)  # [b, NB]
    ctx_k = torch.arange(seq_len, device=dev)[None, None, :]
    ctx_base = ctx_k < q_anchor[:, :, None]  # [b, NB, S]
    slot = torch.arange(blk, device=dev).repeat(n)  # slot within the block, per query/key
    which = torch.arange(n * blk, device=dev) // blk
    same = which[:, None] == which[None, :]
    diff = slot[:, None] - slot[None, :]  # q_slot - k_slot (= q_pos - k_pos inside a block)
    q_pos = (q_anchor + slot[None, :])[:, :, None]
    out, cache = [], {}
    for lt, causal in zip(dcfg.layer_types, dcfg.causal):
        window = dcfg.sliding_window if lt == "sliding_attention" else None
        key = (causal, window)
        if key not in cache:
            ctx, own = ctx_base, same
            if causal:
                own = own & (diff >= 0)
            if window is not None:
                if dcfg.window_mode == "query":
                    ctx = ctx & (q_pos - ctx_k < window)
                    own = own & (diff < window)
                    if not causal:
                        own = own & (-diff < window)
                else:  # speculators: context within `window` before the anchor; the block in full
                    ctx = ctx & (ctx_k >= q_anchor[:, :, None] - window)
            cache[key] = torch.cat([ctx, own[None].expand(bsz, -1, -1)], dim=-1).unsqueeze(1)
        out.append(cache[key])
    return out


def train_block_hidden(drafter: DraftModel, input_ids: Tensor, features: Tensor, anchors: Tensor,
                       embed: Any) -> Tensor:
    """Final-normed drafter hidden states [b, N, B, H] for all blocks of all sequences in one forward.

    The same modules and formulas as inference: context K/V from ``DraftModel.context_kv`` on the fused
    features at positions 0..S-1, block rows through the draft layers at positions p..p+B-1.
    """
    bsz, seq = input_ids.shape
    n = anchors.shape[1]
    blk = drafter.block_size
    dev = input_ids.device
    ctx = drafter.hidden_norm(drafter.fc(features.to(drafter.dtype)))
    cos_c, sin_c = drafter._rope(torch.arange(seq, device=dev).expand(bsz, seq), seq + blk)
    positions = (anchors[:, :, None] + torch.arange(blk, device=dev)).reshape(bsz, n * blk)
    cos_b, sin_b = drafter._rope(positions, seq + blk)
    ids = torch.full((bsz, n, blk), drafter.mask_token_id, dtype=torch.int64, device=dev)
    ids[:, :, 0] = input_ids.gather(1, anchors)
    x = drafter.embed_block(ids.view(bsz, n * blk), embed)
    masks = block_attention_masks(drafter.config, anchors, seq)
    k, v = drafter.context_kv(ctx, cos_c, sin_c)
    room = k.new_empty(*k.shape[1:3], x.shape[1], k.shape[-1])  # the block rows' own K/V go here
    for i, layer in enumerate(drafter.layers):
        x = layer(x, cos_b, sin_b, torch.cat([k[i], room], dim=2), torch.cat([v[i], room], dim=2), masks[i])
    return drafter.norm(x).view(bsz, n, blk, -1)


@torch.no_grad()
def target_forward(target: CausalLM, input_ids: Tensor, taps: Sequence[int]) -> tuple[Tensor, Tensor]:
    """(final hidden [b, S, H], tap features [b, S, n*H]) of the frozen target, cache-free."""
    bsz, seq = input_ids.shape
    c = target.config
    meta = dense_causal_meta(bsz, seq, input_ids.device, c.sliding_window, c.layer_types)
    hidden, feats = target(input_ids, meta, None, taps)
    return hidden, feats


def markov_latents(drafter: DSparkDraft, slot_h: Tensor, prev: Tensor) -> Tensor:
    """Teacher-forced Markov latents [b, N, K, r] (the vector W2 maps to the bias); rnn is unrolled over K."""
    head = drafter.markov_head
    if head.head_type != "rnn":
        return head.latent(slot_h, prev, None)[0]
    bsz, n, k, hid = slot_h.shape
    state = None
    out = []
    for j in range(k):
        latent, state = head.latent(slot_h[:, :, j].reshape(bsz * n, hid), prev[:, :, j].reshape(-1), state)
        out.append(latent.view(bsz, n, -1))
    return torch.stack(out, dim=2)


@dataclass
class StepOutput:
    loss: Tensor
    parts: dict[str, float]
    match: Tensor  # [b, N, K] 1 where the greedy draft equals the target's greedy token (valid prefix only)
    valid: Tensor  # [b, N, K] contiguous valid prefix


def drafter_loss(drafter: DraftModel, target: CausalLM, input_ids: Tensor, loss_mask: Tensor, anchors: Tensor,
                 anchor_valid: Tensor, cfg: DrafterTrainConfig) -> StepOutput:
    """Loss and greedy-match statistics of one batch (see the module docstring for the definitions)."""
    bsz, seq = input_ids.shape
    dev = input_ids.device
    k = drafter.num_draft_slots
    final, feats = target_forward(target, input_ids, drafter.target_layer_ids)
    hidden = train_block_hidden(drafter, input_ids, feats, anchors, target.embed)  # [b, N, B, H]
    n = anchors.shape[1]
    slot_h = drafter.slot_hidden(hidden.flatten(0, 1)).view(bsz, n, k, -1)

    j = torch.arange(k, device=dev)
    label_pos = anchors[:, :, None] + j + 1  # [b, N, K]
    inside = label_pos < seq
    label_pos_c = label_pos.clamp(max=seq - 1)
    supervised = loss_mask.gather(1, label_pos_c.reshape(bsz, -1)).view_as(label_pos) > 0
    valid = (inside & supervised & anchor_valid[:, :, None]).long().cumprod(dim=-1).bool()
    decay = torch.exp(-j.float() / cfg.loss_decay_gamma)
    weight = valid.float() * decay

    bi, ni, ji = valid.nonzero(as_tuple=True)
    w = weight[bi, ni, ji]
    h_sel = slot_h[bi, ni, ji]
    prev_pos = label_pos_c[bi, ni, ji] - 1  # = anchor + j: the teacher-forced previous token / target row
    with torch.no_grad():
        tgt_logits = target.compute_logits(final[bi, prev_pos])
    labels = input_ids[bi, label_pos_c[bi, ni, ji]] if cfg.labels == "data" else tgt_logits.argmax(-1)
    logits = drafter.logits(h_sel, target)
    conf_logit = None
    if isinstance(drafter, DSparkDraft):
        prev_ids = input_ids[bi, prev_pos]
        if drafter.markov_head is not None:
            prev_full = input_ids.gather(1, (label_pos_c - 1).reshape(bsz, -1)).view_as(label_pos)
            latent = markov_latents(drafter, slot_h, prev_full)[bi, ni, ji]
            bias = drafter.markov_head.markov_w2(latent).float()
            logits = logits + (bias * drafter.config.logit_scale if drafter.config.logit_scale != 1.0 else bias)
        if drafter.confidence_head is not None and cfg.conf_alpha:
            conf_logit = drafter.confidence(h_sel, prev_ids, logits=True)

    denom = w.sum().clamp(min=1e-6)
    log_pd = F.log_softmax(logits, dim=-1)
    ce = -log_pd.gather(1, labels[:, None]).squeeze(1)
    loss = cfg.ce_alpha * (ce * w).sum() / denom
    parts = {"ce": float((ce.detach() * w).sum() / denom)}
    if cfg.kl_alpha:
        log_pt = F.log_softmax(tgt_logits.float(), dim=-1)
        kl = (log_pt.exp() * (log_pt - log_pd.float())).sum(-1)
        loss = loss + cfg.kl_alpha * (kl * w).sum() / denom
        parts["kl"] = float((kl.detach() * w).sum() / denom)
    if cfg.l1_alpha or conf_logit is not None:
        l1 = (log_pd.exp() - F.softmax(tgt_logits, dim=-1)).abs().sum(-1)
        if cfg.l1_alpha:
            loss = loss + cfg.l1_alpha * (l1 * w).sum() / denom
        parts["l1"] = float((l1.detach() * w).sum() / denom)
        if conf_logit is not None:
            c_star = (1.0 - 0.5 * l1.detach()).clamp(0.0, 1.0)
            bce = F.binary_cross_entropy_with_logits(conf_logit, c_star, reduction="none")
            loss = loss + cfg.conf_alpha * (bce * w).sum() / denom
            parts["bce"] = float((bce.detach() * w).sum() / denom)
    match = torch.zeros(bsz, n, k, dtype=torch.bool, device=dev)
    match[bi, ni, ji] = logits.detach().argmax(-1) == tgt_logits.argmax(-1)
    return StepOutput(loss, parts, match, valid)


class AcceptanceMeter:
    """Greedy acceptance estimates from teacher-forced blocks: per-position match rate and expected length.

    acc@j = P(draft j == target greedy token | position j supervised); tau = 1 + E[accepted prefix]
    over valid blocks, the bonus token included (the "fixed ground truth" estimate; real decoding
    conditions on the drafts and is measured by ``greedy_acceptance``).
    """

    def __init__(self, k: int) -> None:
        self.hits = torch.zeros(k, dtype=torch.float64)
        self.counts = torch.zeros(k, dtype=torch.float64)
        self.prefix_sum = 0.0
        self.blocks = 0

    def add(self, match: Tensor, valid: Tensor) -> None:
        m, v = match.cpu(), valid.cpu()
        self.hits += (m & v).flatten(0, 1).sum(0).double()
        self.counts += v.flatten(0, 1).sum(0).double()
        blocks = v[..., 0]
        self.prefix_sum += float((m & v).long().cumprod(-1).sum(-1)[blocks].sum())
        self.blocks += int(blocks.sum())

    def per_position(self) -> list[float]:
        return [round(float(h / c), 4) if c else 0.0 for h, c in zip(self.hits, self.counts)]

    def tau(self) -> float:
        return round(1.0 + self.prefix_sum / max(1, self.blocks), 4)


# ================================================================ trainer
@dataclass
class TrainResult:
    drafter: DraftModel
    metrics: dict[str, Any]
    export_dir: Path | None = None
    history: list[dict[str, Any]] = field(default_factory=list)


def resume_point(cfg: DrafterTrainConfig) -> Path | None:
    """The checkpoint directory a run continues from, or None for a new run. --resume continues a checkpoint
    and starts a new run where --checkpoint-dir holds none yet (one command both starts and restarts a run);
    a checkpoint without --resume, or one that lacks a file, is refused: a new run would overwrite it."""
    if not cfg.checkpoint_dir:
        return None
    ckpt = Path(cfg.checkpoint_dir)
    files = (CHECKPOINT_WEIGHTS, CHECKPOINT_STATE)
    present = [name for name in files if (ckpt / name).exists()]
    if not present:
        return None
    if not cfg.resume:
        raise ConfigError(f"--checkpoint-dir {ckpt} holds a checkpoint ({', '.join(present)}): pass --resume to "
                          "continue it, or give another directory")
    missing = [name for name in files if name not in present]
    if missing:
        raise ConfigError(f"--resume: {ckpt} has {present[0]} but no {missing[0]}, so it cannot be resumed; "
                          "remove it or resume from another checkpoint")
    return ckpt


class DrafterTrainer:
    """Holds the frozen target, the drafter, the optimiser and the data stream; one `step` = one update."""

    def __init__(self, target: CausalLM, train: list[Example], cfg: DrafterTrainConfig, mask_token_id: int,
                 pad_id: int, heldout: list[Example] | None = None, drafter: DraftModel | None = None,
                 batches: Any = None) -> None:
        """`batches`: a source of (ids, loss_mask) batches with state_dict / load_state_dict, read instead of
        `train` (the flagship's regenerated rows stream from pieces)."""
        self.cfg = cfg
        self.device = resolve_device(cfg.device)
        self.target = target.to(self.device).eval().requires_grad_(False)
        self.target_dtype = target.embed_tokens.weight.dtype
        self.pad_id = pad_id
        self.train_examples = [e for e in train if len(e.input_ids) >= 2]
        self.heldout = heldout or []
        self.drafter = drafter or build_drafter(cfg, target.config, mask_token_id, cfg.seed)
        self.drafter.cast(self.device, torch.float32)
        self.drafter.train().requires_grad_(True)
        for frozen in (self.drafter.embed_tokens, self.drafter.lm_head):  # copies of the target's: frozen
            if frozen is not None:
                frozen.requires_grad_(False)
        self.drafter.check_target(target.config)
        self.opt = make_optimizer(self.drafter, cfg.lr, cfg.weight_decay)
        self.schedule = CosineSchedule(self.opt, cfg.warmup_frac, cfg.min_lr_ratio)
        self.batches = batches if batches is not None else Batches(self.train_examples, cfg.batch_size, pad_id,
                                                                   cfg.seed)
        self.anchor_gen = torch.Generator().manual_seed(cfg.seed + 17)
        self.step_num = 0
        self.meter = AcceptanceMeter(self.drafter.num_draft_slots)
        self.history: list[dict[str, Any]] = []

    # ------------------------------------------------------------ one update
    def step(self, total: int) -> StepOutput:
        cfg = self.cfg
        ids, mask = next(self.batches)
        anchors, valid = sample_anchors(mask, cfg.num_anchors, self.anchor_gen)
        ids, mask, anchors, valid = (t.to(self.device, non_blocking=True) for t in (ids, mask, anchors, valid))
        self.schedule.plan(total, self.step_num)
        lr = self.schedule.lr()
        with autocast(self.device, self.target_dtype):
            out = drafter_loss(self.drafter, self.target, ids, mask, anchors, valid, cfg)
        self.opt.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), cfg.grad_clip)
        self.opt.step()
        self.schedule.step()
        self.step_num += 1
        out.parts["lr"] = lr
        return out

    @torch.no_grad()
    def evaluate(self, examples: list[Example] | None = None, max_batches: int | None = None) -> dict[str, Any]:
        """Mean loss parts and greedy acceptance estimates on held-out examples (fixed anchors)."""
        examples = self.heldout if examples is None else examples
        if not examples:
            return {}
        gen = torch.Generator().manual_seed(self.cfg.seed + 99)
        meter = AcceptanceMeter(self.drafter.num_draft_slots)
        sums: dict[str, float] = {}
        n = 0
        self.drafter.eval()
        bs = self.cfg.batch_size
        limit = max_batches or self.cfg.eval_batches
        for i in range(0, len(examples), bs):
            if n >= limit:
                break
            ids, mask = collate(examples[i : i + bs], self.pad_id)
            anchors, valid = sample_anchors(mask, self.cfg.num_anchors, gen)
            ids, mask, anchors, valid = (t.to(self.device) for t in (ids, mask, anchors, valid))
            with autocast(self.device, self.target_dtype):
                out = drafter_loss(self.drafter, self.target, ids, mask, anchors, valid, self.cfg)
            sums["loss"] = sums.get("loss", 0.0) + float(out.loss)
            for key, value in out.parts.items():
                sums[key] = sums.get(key, 0.0) + value
            meter.add(out.match, out.valid)
            n += 1
        self.drafter.train()
        res: dict[str, Any] = {key: round(v / max(n, 1), 4) for key, v in sums.items()}
        res["acc_per_position"] = meter.per_position()
        res["tau_estimate"] = meter.tau()
        return res

    # ------------------------------------------------------------ checkpoints
    def checkpoint_state(self) -> dict[str, Any]:
        """Everything but the weights, in types `torch.load(..., weights_only=True)` reads: optimiser,
        schedule, data order, anchor and global RNG states, and the configs that must match on resume."""
        d = self.drafter
        return {
            "format_version": CHECKPOINT_VERSION, "step": self.step_num,
            "train_config": dataclasses.asdict(self.cfg), "drafter_config": dataclasses.asdict(d.config),
            "heads": dataclasses.asdict(d.heads) if isinstance(d, DSparkDraft) else None,
            "optimizer": self.opt.state_dict(), "schedule": self.schedule.state_dict(),
            "batches": self.batches.state_dict(), "anchor_gen": self.anchor_gen.get_state(),
            "rng": {"python": random.getstate(), "torch": torch.get_rng_state(),
                    "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None},
        }

    def save_checkpoint(self, directory: str | Path) -> Path:
        """The drafter's weights (drafter.safetensors) and the trainer's state (trainer_state.pt) in
        `directory`, each written whole before it replaces the last; both carry the step, so a save
        cut between the two files is detected on load."""
        from safetensors.torch import save_model

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        weights, state = directory / CHECKPOINT_WEIGHTS, directory / CHECKPOINT_STATE
        save_model(self.drafter, str(weights.with_suffix(".tmp")),
                   metadata={"step": str(self.step_num), "format_version": str(CHECKPOINT_VERSION)})
        weights.with_suffix(".tmp").replace(weights)
        torch.save(self.checkpoint_state(), state.with_suffix(".tmp"))
        state.with_suffix(".tmp").replace(state)
        return directory

    def load_checkpoint(self, directory: str | Path) -> None:
        """Restore drafter, optimiser, schedule, data position, anchor and global RNG: the next step is
        the one that the interrupted run would have taken."""
        from safetensors import safe_open
        from safetensors.torch import load_model

        directory = Path(directory)
        weights, state_path = directory / CHECKPOINT_WEIGHTS, directory / CHECKPOINT_STATE
        try:  # a truncated or foreign file is named in one line, not a reader's traceback
            state = torch.load(state_path, map_location="cpu", weights_only=True)
        except Exception as exc:
            raise ConfigError(f"{state_path}: not a readable training state ({type(exc).__name__}); remove the "
                              "checkpoint or resume from another") from None
        self.check_state(state, state_path)
        try:
            with safe_open(str(weights), "pt") as f:
                saved_step = (f.metadata() or {}).get("step")
        except Exception as exc:
            raise ConfigError(f"{weights}: not a readable safetensors file ({type(exc).__name__}); remove the "
                              "checkpoint or resume from another") from None
        if saved_step != str(state["step"]):
            raise ConfigError(f"{directory}: {CHECKPOINT_WEIGHTS} is from step {saved_step}, {CHECKPOINT_STATE} "
                              f"from step {state['step']} (a save was cut short)")
        load_model(self.drafter, str(weights), device=str(self.device))
        self.restore_state(state)

    def check_state(self, state: dict[str, Any], where: str | Path) -> None:
        """Refuse a `checkpoint_state()` dict of another format version or drafter shape."""
        if state.get("format_version") != CHECKPOINT_VERSION:
            raise ConfigError(f"{where}: checkpoint format {state.get('format_version')!r}, this blockspec "
                              f"reads format {CHECKPOINT_VERSION}")
        if state["drafter_config"] != dataclasses.asdict(self.drafter.config):
            raise ConfigError(f"{where}: checkpoint drafter shape differs from this run's configuration")
        saved = state.get("train_config") or {}
        changed = [f"--{k.replace('_', '-')} {saved[k]!r} (this run: {getattr(self.cfg, k)!r})" for k in RESUME_KEEPS
                   if k in saved and saved[k] != getattr(self.cfg, k)]
        if changed:  # the restored optimiser, schedule and data order would silently keep the checkpoint's
            raise ConfigError(f"{where}: a resumed run keeps its checkpoint's {'; '.join(changed)}: give the same "
                              "values, or start a new run in another --checkpoint-dir")

    def restore_state(self, state: dict[str, Any]) -> None:
        """Optimiser, step, schedule, data position, anchor and global RNG from a `checkpoint_state()` dict (the
        drafter's weights are loaded apart)."""
        self.opt.load_state_dict(state["optimizer"])
        self.step_num = int(state["step"])
        self.schedule.load_state_dict(state["schedule"], self.step_num)
        self.batches.load_state_dict(state["batches"])
        self.anchor_gen.set_state(state["anchor_gen"])
        random.setstate(state["rng"]["python"])
        torch.set_rng_state(state["rng"]["torch"])
        if state["rng"]["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["rng"]["cuda"])

    # ------------------------------------------------------------ loop
    def fit(self) -> dict[str, Any]:
        """Train until the step or time budget is spent (a resume continues from the checkpoint's step
        up to max_steps in all); save the checkpoint; return the metrics."""
        cfg = self.cfg
        ckpt = Path(cfg.checkpoint_dir) if cfg.checkpoint_dir else None
        resume = resume_point(cfg)
        if resume is not None:
            self.load_checkpoint(resume)
            if cfg.max_steps is not None and self.step_num >= cfg.max_steps:
                raise ConfigError(f"--resume: the checkpoint in {ckpt} is at step {self.step_num} and --max-steps is "
                                  f"{cfg.max_steps}: nothing left to train (raise --max-steps)")
        resumed_from = self.step_num
        budget = StepBudget(cfg.max_steps, cfg.max_minutes * 60 if cfg.max_minutes else None, self.step_num)
        bar = progress_bar(budget.total if budget.calibrated else None, f"train {cfg.method}", cfg.progress)
        if bar is not None:
            bar.update(self.step_num)
        history = self.history
        last: dict[str, float] = {}
        self.meter = AcceptanceMeter(self.drafter.num_draft_slots)
        while not budget.done(self.step_num):
            out = self.step(budget.total)
            budget.after_step(self.step_num)
            self.meter.add(out.match, out.valid)
            last = {"loss": float(out.loss.detach()), **out.parts}
            if self.step_num % 10 == 0 or self.step_num == 1:
                history.append({"step": self.step_num, **{k: round(v, 5) for k, v in last.items()}})
                if bar is not None:
                    if budget.calibrated and bar.total != budget.total:
                        bar.total = budget.total
                    acc = self.meter.per_position()
                    bar.set_postfix(loss=f"{last['loss']:.3f}", tau=f"{self.meter.tau():.2f}",
                                    acc="/".join(f"{a:.2f}" for a in acc[:4]))
                self.meter = AcceptanceMeter(self.drafter.num_draft_slots)
            if bar is not None:
                bar.update(1)
            if cfg.eval_every and self.step_num % cfg.eval_every == 0 and self.heldout:
                history.append({"step": self.step_num, "eval": self.evaluate()})
            if ckpt is not None and cfg.checkpoint_every and self.step_num % cfg.checkpoint_every == 0:
                self.save_checkpoint(ckpt)
        if bar is not None:
            bar.close()
        if ckpt is not None:
            self.save_checkpoint(ckpt)
        metrics: dict[str, Any] = {"steps": self.step_num, "steps_this_run": self.step_num - resumed_from,
                                   "resumed_from_step": resumed_from, "seconds": round(budget.elapsed(), 1),
                                   "final_train": {k: round(v, 5) for k, v in last.items()}}
        if self.heldout:
            metrics["heldout"] = self.evaluate()
        return metrics

    def export(self, out_dir: str | Path, dtype: torch.dtype = torch.bfloat16) -> Path:
        """The drafter in its source format (new drafters: z-lab DFlash / DeepSpec DSpark), weights in `dtype`.

        DeepSpec and speculators files carry copies of the target's embedding and LM head, as the
        released checkpoints do; they are separate copies because a tied target's embedding and head
        share storage, which safetensors refuses.
        """
        model = copy.deepcopy(self.drafter).cast("cpu", dtype).eval()
        # a drafter exported here before leaves its measured acceptance, which the engine would read as this
        # one's (and refuse where the block differs): this export measures its own, or has none
        (Path(out_dir) / ACCEPTANCE_FILE).unlink(missing_ok=True)
        t = self.target
        vocab = SimpleNamespace(embed_tokens=SimpleNamespace(weight=t.embed_tokens.weight.detach().clone()),
                                lm_head=SimpleNamespace(weight=t.lm_head.weight.detach().clone()))
        speculators = model.source_format == "speculators"
        if isinstance(model, DSparkDraft):
            return save_dspark(model, out_dir, format="speculators" if speculators else "deepspec", target=vocab)
        return save_dflash(model, out_dir, format="speculators" if speculators else "zlab", target=vocab)


# ================================================================ regeneration
def prompt_cut(ex: Example, cfg: DrafterTrainConfig) -> int:
    """How many of an example's tokens prompt the target: those before its first supervised token, or the
    first regen_prompt_tokens of a fully supervised text chunk; at least 1, leaving 2 of max_len to generate."""
    first = ex.loss_mask.index(1) if 1 in ex.loss_mask else len(ex.input_ids)
    cut = first if first > 0 else min(cfg.regen_prompt_tokens, len(ex.input_ids) - 1)
    return max(1, min(cut, cfg.max_len - 2))


def regenerate_examples(target_dir: str | Path, examples: list[Example], cfg: DrafterTrainConfig,
                        device: str = "auto") -> list[Example]:
    """Replace each example's supervised part by the target's own continuation (blockspec's engine).

    The prompt is everything before the first supervised token (or the first regen_prompt_tokens
    tokens of a fully supervised text chunk); the generated tokens become the supervised part.
    """
    from blockspec.llm import LLM
    from blockspec.sampling_params import SamplingParams

    llm = LLM(str(target_dir), device=device, max_model_len=cfg.max_len, seed=cfg.seed,
              max_num_seqs=min(64, max(1, len(examples))))
    prompts, params = [], []
    for ex in examples:
        cut = prompt_cut(ex, cfg)
        room = cfg.max_len - cut
        new = min(room, cfg.regen_max_new_tokens or room)
        prompts.append({"prompt_token_ids": list(ex.input_ids[:cut])})
        params.append(SamplingParams(temperature=cfg.regen_temperature, max_tokens=new, seed=cfg.seed))
    outs = llm.generate(prompts, params, use_tqdm=cfg.progress)
    result = []
    for prompt, out in zip(prompts, outs):
        gen = list(out.outputs[0].token_ids)
        if len(gen) >= 2:
            ids = prompt["prompt_token_ids"] + gen
            result.append(Example(ids, [0] * len(prompt["prompt_token_ids"]) + [1] * len(gen)))
    return result


# ================================================================ acceptance
@torch.no_grad()
def greedy_acceptance(target: CausalLM, drafter: DraftModel, prompts: list[list[int]], max_new_tokens: int,
                      eos_ids: Sequence[int] = (), num_draft: int | None = None) -> dict[str, Any]:
    """Real greedy speculative decoding with the model-level functions, one prompt at a time.

    A simple reference (the target re-scores the whole sequence cache-free each step) that needs
    only ``append_context`` / ``block_hidden``; it also checks that the output equals plain greedy
    decoding. Returns mean acceptance length (bonus included) and per-position acceptance counts.
    """
    dev = next(target.parameters()).device
    drafter.bind_target(target)  # a drafter without a head of its own drafts through the target's
    k = min(num_draft or drafter.num_draft_slots, drafter.num_draft_slots)
    taps = drafter.target_layer_ids
    eos = set(eos_ids)
    steps = accepted = 0
    per_pos = [0] * k
    identical = True
    for prompt in prompts:
        seq = list(prompt)
        limit = len(prompt) + max_new_tokens
        cache = drafter.new_cache(1, limit + drafter.block_size + 2, dev)
        hidden, feats = target_forward(target, torch.tensor([seq], device=dev), taps)
        drafter.append_context(cache, [0], [0], [len(seq)], feats)
        anchor = int(target.compute_logits(hidden[:, -1]).argmax(-1))
        reference = _plain_greedy(target, prompt, max_new_tokens, eos)
        done = False
        while len(seq) < limit and not done:
            ctx = len(seq)
            anchor_t = torch.tensor([anchor], device=dev)
            block = drafter.block_hidden(cache, [0], [ctx], anchor_t, target.embed)
            drafts = drafter.greedy_drafts(drafter.slot_hidden(block, k), anchor_t)[0][0].tolist()
            hidden, feats = target_forward(target, torch.tensor([seq + [anchor] + drafts], device=dev), taps)
            preds = target.compute_logits(hidden[0, ctx:]).argmax(-1).tolist()
            a = 0
            while a < k and drafts[a] == preds[a]:
                a += 1
            steps += 1
            accepted += a
            for i in range(a):
                per_pos[i] += 1
            new = [anchor] + drafts[:a]
            drafter.append_context(cache, [0], [ctx], [a + 1], feats[:, ctx : ctx + a + 1])
            seq.extend(new)
            anchor = preds[a]
            done = any(t in eos for t in new)
        out = seq[len(prompt):limit]
        if eos and any(t in eos for t in out):
            out = out[: next(i for i, t in enumerate(out) if t in eos) + 1]
        identical &= out == reference
    return {
        "mean_acceptance_length": round(1 + accepted / max(1, steps), 4),
        "num_drafts": steps,
        "num_accepted_tokens_per_pos": per_pos,
        "acceptance_rate_per_pos": [round(c / max(1, steps), 4) for c in per_pos],
        "num_speculative_tokens": k,
        "matches_plain_greedy": identical,
        "path": "model-level reference loop",
    }


def _plain_greedy(target: CausalLM, prompt: list[int], max_new_tokens: int, eos: set[int]) -> list[int]:
    """Greedy continuation by re-scoring the whole sequence (reference for the equality check)."""
    dev = next(target.parameters()).device
    seq = list(prompt)
    for _ in range(max_new_tokens):
        c = target.config
        meta = dense_causal_meta(1, len(seq), dev, c.sliding_window, c.layer_types)
        hidden, _ = target(torch.tensor([seq], device=dev), meta, None)
        seq.append(int(target.compute_logits(hidden[:, -1]).argmax(-1)))
        if seq[-1] in eos:
            break
    return seq[len(prompt):]


def engine_acceptance(target_dir: str | Path, method: str, drafter_dir: str | Path, prompts: list[list[int]],
                      max_new_tokens: int, device: str = "auto",
                      spec_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Greedy acceptance measured through blockspec's engine (``LLM`` with a speculative_config, plus
    `spec_options`: ``{"adaptive_draft_length": False}`` verifies the drafter's whole block every step)."""
    from blockspec.llm import LLM
    from blockspec.sampling_params import SamplingParams

    llm = LLM(str(target_dir), device=device, seed=0,
              speculative_config={"method": method, "model": str(drafter_dir), **(spec_options or {})})
    llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0.0, max_tokens=max_new_tokens),
                 use_tqdm=False)
    m = llm.get_stats()
    drafts = max(1, m.get("num_drafts", 0))
    return {
        "mean_acceptance_length": round(m["mean_acceptance_length"], 4),
        "num_drafts": m.get("num_drafts", 0),
        "num_accepted_tokens_per_pos": m.get("num_accepted_tokens_per_pos", []),
        "acceptance_rate_per_pos": [round(c / drafts, 4) for c in m.get("num_accepted_tokens_per_pos", [])],
        "path": "blockspec engine",
    }


# ================================================================ entry points
def train_drafter(
    target: str | Path | CausalLM,
    data: str | Path | list[Example],
    cfg: DrafterTrainConfig,
    tokenizer: Any = None,
    eval_data: str | Path | list[Example] | None = None,
    out_dir: str | Path | None = None,
) -> TrainResult:
    """Train a DFlash or DSpark drafter for `target` on `data`; export it to `out_dir` when given.

    target: a HF directory / hub id (loaded with blockspec's loader; its tokenizer is used when
    `tokenizer` is None) or a loaded CausalLM. data: a .jsonl of records, text/source files (a
    file, directory or glob) or ready Examples. Held-out data defaults to a seeded eval_frac split.
    """
    device = resolve_device(cfg.device)
    target_dir = None
    if not isinstance(target, CausalLM):
        target, target_dir = load_target(target, cfg.target_dtype, device, max_positions=cfg.max_len + 64)
        if tokenizer is None:
            from blockspec.engine.build import load_tokenizer

            tokenizer = load_tokenizer(target_dir)
    if cfg.max_len > target.config.max_position_embeddings:  # positions the target never learned
        raise ConfigError(f"--max-len {cfg.max_len} exceeds the target's max_position_embeddings "
                          f"({target.config.max_position_embeddings})")
    if not isinstance(data, list) or (eval_data is not None and not isinstance(eval_data, list)):
        if tokenizer is None:
            raise ConfigError("a tokenizer is needed to read text/jsonl data and the target directory has none "
                              "(blockspec train --tokenizer DIR; train_drafter(tokenizer=...))")
        if len(tokenizer) > target.config.vocab_size:  # its ids past the embedding would fail deep in a forward
            raise ConfigError(f"the tokenizer has {len(tokenizer)} tokens and the target's embedding "
                              f"{target.config.vocab_size} rows: it is not the target's tokenizer")
    examples = data if isinstance(data, list) else load_examples(data, tokenizer, cfg.max_len)
    if eval_data is None:
        examples, heldout = split_examples(examples, cfg.eval_frac, cfg.seed)
    else:
        heldout = eval_data if isinstance(eval_data, list) else load_examples(eval_data, tokenizer, cfg.max_len)
    if cfg.regenerate:
        if target_dir is None:
            raise ConfigError("regenerate=True needs the target as a directory (the engine loads it)")
        examples = regenerate_examples(target_dir, examples, cfg, str(device))
    pad_id = tokenizer.pad_token_id if tokenizer is not None and tokenizer.pad_token_id is not None else 0
    drafter = None
    if cfg.init_from:
        drafter = load_drafter(cfg.method, cfg.init_from, device="cpu", dtype=torch.float32)
        check_init_shape(cfg, drafter)
        mask_id = drafter.mask_token_id
    else:
        mask_id = resolve_mask_token_id(cfg, tokenizer, target.config)
    trainer = DrafterTrainer(target, examples, cfg, mask_id, pad_id, heldout, drafter)
    metrics = trainer.fit()
    metrics["train_examples"] = len(trainer.train_examples)
    metrics["heldout_examples"] = len(heldout)
    metrics["params"] = sum(p.numel() for p in trainer.drafter.parameters())
    export = trainer.export(out_dir) if out_dir is not None else None
    trainer.drafter.eval().requires_grad_(False)
    if export is not None and target_dir is not None and heldout and cfg.acceptance_prompts:
        metrics["engine_acceptance"] = record_acceptance(target_dir, export, heldout, cfg, str(device))
    return TrainResult(trainer.drafter, metrics, export, trainer.history)


def record_acceptance(target_dir: Path, export: Path, heldout: list[Example], cfg: DrafterTrainConfig,
                      device: str) -> dict[str, Any]:
    """The exported drafter's greedy acceptance through the engine on the first held-out examples' prompts,
    every step verifying the whole block, written as its acceptance.json (`read_recorded_acceptance`)."""
    prompts = [ex.input_ids[:prompt_cut(ex, cfg)] for ex in heldout[:cfg.acceptance_prompts]]
    new_tokens = max(1, min(64, cfg.max_len - max(map(len, prompts))))
    result = engine_acceptance(target_dir, cfg.method, export, prompts, new_tokens, device,
                               {"adaptive_draft_length": False})
    if result["num_drafts"]:
        write_recorded_acceptance(export, result["acceptance_rate_per_pos"],
                                  f"greedy, whole block verified, {result['num_drafts']} drafts on "
                                  f"{len(prompts)} held-out prompts (blockspec train)")
    return result


def build_arg_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """Arguments of `blockspec train`: the run's paths, then one flag per DrafterTrainConfig field, made by
    transformers' HfArgumentParser from the field's type (Literal types give the choices) and its help."""
    from transformers import HfArgumentParser

    from blockspec.cli_options import HelpFormatter

    p = parser or argparse.ArgumentParser(prog="blockspec train", description="Train a DFlash or DSpark drafter.")
    p.formatter_class = HelpFormatter
    run = p.add_argument_group("run")
    run.add_argument("--target", required=True, help="target: Hugging Face directory, hub id or 'default' (the "
                                                     "embedded one)")
    run.add_argument("--data", required=True, help="training data: a .jsonl of {prompt, response}, {messages} or "
                                                   "{text} records, or text files (a file, a directory or a glob)")
    run.add_argument("--eval-data", default=None, help="held-out data, as --data (default: an --eval-frac split)")
    run.add_argument("--out", required=True, help="directory the trained drafter is exported to")
    run.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the target's)")
    group = p.add_argument_group("training")
    hints = get_type_hints(DrafterTrainConfig)
    for f in dataclasses.fields(DrafterTrainConfig):
        resolved = copy.copy(f)  # HfArgumentParser reads (and rewrites) the field's type: a copy keeps the class's
        resolved.type = hints[f.name]
        HfArgumentParser._parse_dataclass_field(group, resolved)
        negation = group._group_actions[-1]  # a field true by default also gets --no_<field>, with its help as is
        if isinstance(negation, argparse._StoreFalseAction):
            negation.help = f"turn --{f.name.replace('_', '-')} off ({f.metadata['help']}; default: on)"
    return p


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli(build_arg_parser().parse_args(argv))


def check_export_dir(out: str, target: str) -> None:
    """--out must not be the target's directory, nor hold another model (the export writes config.json and
    model.safetensors over theirs); a drafter exported there before may be replaced."""
    if not out:
        raise ConfigError("--out: give the directory the trained drafter is exported to")
    path, config = Path(out), Path(out) / "config.json"
    if Path(target).is_dir() and path.resolve() == Path(target).resolve():
        raise ConfigError(f"--out {out} is the target's directory: the export would overwrite the target")
    if config.is_file():
        try:
            held = json.loads(config.read_text())
        except (json.JSONDecodeError, OSError):
            held = {"architectures": ["an unreadable config.json"]}
        if not isinstance(held, dict) or not drafter_kind(held):
            names = held.get("architectures") if isinstance(held, dict) else None
            raise ConfigError(f"--out {out} holds a model ({', '.join(map(str, names or ['unnamed']))}) that the "
                              "export would overwrite; give a new directory")


def run_cli(args: argparse.Namespace) -> int:
    """`blockspec train`: train, export, and write the metrics next to the exported drafter."""
    for flag, spec in (("--data", args.data), ("--eval-data", args.eval_data)):
        if spec is not None:  # before the target loads: a wrong path fails at once, naming the flag
            try:
                text_files(spec)
            except DataError as exc:
                raise DataError(f"{flag} {exc}") from None
    fields = {f.name for f in dataclasses.fields(DrafterTrainConfig)}
    given = {k: v for k, v in vars(args).items() if k in fields}
    if given.get("init_from"):  # 'default': the embedded drafter of --method, as elsewhere
        given["init_from"] = embedded(given["init_from"], given.get("method") or "dflash")
    cfg = DrafterTrainConfig(**given)
    if cfg.init_from and (family := drafter_method(cfg.init_from)) not in (None, cfg.method):
        raise ConfigError(f"--init-from {cfg.init_from} is a {family} drafter: give --method {family}")
    check_export_dir(args.out, embedded(args.target))
    output_dir(args.out, "--out")  # before the training: its export and checkpoints must have somewhere to go
    if cfg.checkpoint_dir:
        output_dir(cfg.checkpoint_dir, "--checkpoint-dir")
        if resume_point(cfg) is None and cfg.resume:  # refuses, before any work, a checkpoint a run would overwrite
            print(f"--resume: no checkpoint in {cfg.checkpoint_dir} yet; starting a new run", file=sys.stderr)
    tokenizer = None
    if args.tokenizer:
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"--tokenizer {args.tokenizer}: not a tokenizer directory or hub id "
                              f"({str(exc).splitlines()[0]})") from None
    result = train_drafter(embedded(args.target), args.data, cfg, tokenizer, args.eval_data, args.out)
    (Path(args.out) / "train_metrics.json").write_text(json.dumps(result.metrics, indent=2) + "\n")
    print(json.dumps(result.metrics, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
