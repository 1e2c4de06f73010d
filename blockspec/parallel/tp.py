"""Megatron-style tensor parallelism for the target model, on torch.distributed (NCCL on GPUs, gloo on CPU).

Each rank holds a slice of every projection: q/k/v heads and the MLP's intermediate units are split
column-wise, o_proj and down_proj row-wise (one all_reduce each; a mixture-of-experts MLP keeps every
expert on every rank with a slice of its width, and the router whole), and the vocabulary is split for
both the embedding (all_reduce of masked lookups) and the LM head (all_gather to full logits). The
hidden states between layers, the tapped features and the logits are therefore full-size and
identical on every rank, so the drafter runs replicated on each rank, and because sampling noise is
keyed by (seed, position), every rank draws the same tokens: the ranks never need to exchange tokens.
The one thing they must exchange is the adaptive draft-length policy's decisions, which come from each
process's own clock: every rank takes rank 0's (`Engine.agree`, one small broadcast on a CPU group).

`LLM(..., tensor_parallel_size=N)` spawns N rank processes (`RankGroup`); rank 0 receives each call
from the user's process over a pipe and broadcasts it to the other ranks, so all of them run the
same engine steps in lockstep, and rank 0 sends the result back.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pickle
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Iterator
from datetime import timedelta
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist

# Imported here, before any rank creates its group, because torch.distributed.nn.functional binds
# `group=group.WORLD` as default arguments when first imported: imported after init_process_group
# (torch._dynamo imports it, and a rank's first meta-device op, building the model, imports dynamo),
# it holds the default group for good, so destroy_process_group cannot free it. The gloo group's
# threads then outlive it into interpreter shutdown, where one dropping its last collective's tensors
# takes the GIL and dies: "terminate called without an active exception", SIGABRT at a rank's exit.
import torch.distributed.nn  # noqa: F401
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import Tensor, nn

from blockspec.config import ConfigError, EngineArgs, ModelConfig
from blockspec.engine.build import Agree, EngineSetup, TargetLoader, build_engine
from blockspec.engine.engine import Engine
from blockspec.engine.loop import Interrupted, OfflineRunner, Stop, serve_engine
from blockspec.errors import RanksParted
from blockspec.inputs import ModelInputs
from blockspec.models.layers import GatedMLP
from blockspec.models.llama import Attention, CausalLM
from blockspec.models.moe import SparseMoE
from blockspec.models.quant import Fp8Experts, Fp8Linear, Fp8Weight
from blockspec.models.loader import (
    load_target,
    read_json,
    resolve_device,
    resolve_dtype,
    resolve_model_dir,
)

ProcessGroup = Any  # torch.distributed.ProcessGroup (None = the default group)


# ---------------------------------------------------------------- parallel layers
class RowParallelLinear(nn.Module):
    """y = all_reduce(x_local @ W_local^T) + b: the input features are split across ranks; the bias is
    added once, after the sum, so it is not counted world_size times."""

    def __init__(self, weight: Tensor, bias: Tensor | None, group: ProcessGroup = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None
        self.group = group

    def forward(self, x: Tensor) -> Tensor:
        y = F.linear(x, self.weight)
        dist.all_reduce(y, group=self.group)
        return y + self.bias if self.bias is not None else y


class RowParallelFp8Linear(Fp8Linear):
    """`RowParallelLinear` over an e4m3 weight: this rank's input columns with their scales (the product as
    `Fp8Linear` computes it), summed over ranks, then the bias once."""

    def __init__(self, weight: Fp8Weight, bias: Tensor | None, group: ProcessGroup = None) -> None:
        super().__init__(weight.weight, weight.scale, weight.block)
        self.row_bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None
        self.group = group

    def forward(self, x: Tensor) -> Tensor:
        y = super().forward(x)
        dist.all_reduce(y, group=self.group)
        return y + self.row_bias if self.row_bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Rows [start, start + rows) of the embedding; ids outside them look up zeros and the all_reduce
    fills them in from the rank that owns them (exact: one non-zero term per entry)."""

    def __init__(self, weight: Tensor, start: int, rows: int, group: ProcessGroup = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)  # [rows_per_rank, H], zero-padded
        self.start = start
        self.rows = rows
        self.group = group

    def forward(self, ids: Tensor) -> Tensor:
        local = ids - self.start
        inside = (local >= 0) & (local < self.rows)
        out = F.embedding(torch.where(inside, local, torch.zeros_like(local)), self.weight)
        out = out.masked_fill(~inside.unsqueeze(-1), 0)
        dist.all_reduce(out, group=self.group)
        return out


class VocabParallelLMHead(nn.Module):
    """Logits of this rank's vocabulary rows, all_gathered so every rank holds the full logits (and so
    samples exactly what the others sample)."""

    def __init__(self, weight: Tensor, vocab_size: int, world_size: int, group: ProcessGroup = None) -> None:
        super().__init__()
        self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=False)
        self.vocab_size = vocab_size
        self.world_size = world_size
        self.group = group

    def forward(self, hidden: Tensor) -> Tensor:
        local = F.linear(hidden, self.weight).contiguous()
        parts = [torch.empty_like(local) for _ in range(self.world_size)]
        dist.all_gather(parts, local, group=self.group)
        return torch.cat(parts, dim=-1)[..., : self.vocab_size]


# ---------------------------------------------------------------- sharding
def check_shardable(cfg: ModelConfig, world_size: int) -> None:
    """Raise ConfigError when `cfg` cannot be split over `world_size` ranks (before any work starts)."""
    if not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"tensor_parallel_size must be an integer >= 1, got {world_size!r}")
    if cfg.num_key_value_heads % world_size:
        raise ConfigError(f"tensor_parallel_size={world_size} does not divide num_key_value_heads "
                          f"({cfg.num_key_value_heads}); KV heads are split across ranks, not replicated")
    dense_layers = len(cfg.moe_layers) < cfg.num_hidden_layers
    if dense_layers and cfg.intermediate_size % world_size:
        raise ConfigError(f"tensor_parallel_size={world_size} does not divide intermediate_size "
                          f"({cfg.intermediate_size})")
    for name in ("moe_intermediate_size", "shared_expert_intermediate_size"):
        if cfg.is_moe and getattr(cfg, name) % world_size:
            raise ConfigError(f"tensor_parallel_size={world_size} does not divide {name} ({getattr(cfg, name)}); "
                              "every rank holds every expert with a slice of its width")


# FP8 weights (e4m3 with scales over (rows, columns) blocks, `models.quant`) shard with their scales; the helpers
# slice the last two dims, so a mixture's stacked experts [E, N, K] shard as a linear's [N, K] does.
def _per_row(w: Fp8Weight) -> Fp8Weight:
    """The same weight with each row its own scale row (blocks of one row)."""
    br, bc = w.block
    if br == 1:
        return w
    return Fp8Weight(w.weight, w.scale.repeat_interleave(br, dim=-2)[..., : w.weight.shape[-2], :], (1, bc))


def _fp8_rows(w: Fp8Weight, lo: int, hi: int) -> Fp8Weight:
    """Rows [lo, hi) with the scales that cover them: whole scale blocks where the slice starts and ends on
    block boundaries (or at the last row), else each row its own scale row."""
    br = w.block[0]
    if lo % br or (hi % br and hi != w.weight.shape[-2]):
        w = _per_row(w)
        br = 1
    return Fp8Weight(w.weight[..., lo:hi, :].clone(), w.scale[..., lo // br: -(-hi // br), :].clone(), w.block)


def _fp8_cat(parts: list[Fp8Weight]) -> Fp8Weight:
    """Row slices of one weight stacked along the rows, under their common blocks (one row each where the
    slices' blocks differ or one but the last ends inside a block)."""
    br = parts[0].block[0]
    if any(p.block != parts[0].block for p in parts) or any(p.weight.shape[-2] % br for p in parts[:-1]):
        parts = [_per_row(p) for p in parts]
    return Fp8Weight(torch.cat([p.weight for p in parts], dim=-2), torch.cat([p.scale for p in parts], dim=-2),
                     parts[0].block)


def _fp8_cols(w: Fp8Weight, lo: int, hi: int, what: str) -> Fp8Weight:
    """Input columns [lo, hi) (a row-parallel rank's share) with their scale blocks: per-channel scales span any
    slice; block scales need it to start and end on their boundaries."""
    br, bc = w.block
    k = w.weight.shape[-1]
    if bc >= k:
        return Fp8Weight(w.weight[..., lo:hi].clone(), w.scale.clone(), (br, hi - lo))
    _check_columns(what, k, bc, lo, hi)
    return Fp8Weight(w.weight[..., lo:hi].clone(), w.scale[..., lo // bc: -(-hi // bc)].clone(), w.block)


def _check_columns(what: str, k: int, bc: int, lo: int, hi: int) -> None:
    """ConfigError where columns [lo, hi) of k cut a scale block `bc` columns wide."""
    if bc < k and (lo % bc or (hi % bc and hi != k)):
        raise ConfigError(f"{what}: tensor parallelism splits its {k} input columns at {lo} and {hi}, inside its "
                          f"FP8 scale blocks of {bc} columns; choose a tensor_parallel_size that keeps each "
                          f"rank's {hi - lo} columns whole blocks")


def _check_fp8_columns(model: CausalLM, world_size: int) -> None:
    """Every row-parallel FP8 product's share of its input columns on every rank lies on its scale blocks'
    boundaries (checked before any weight is sharded)."""
    for layer in model.layers:
        mlp = layer.mlp
        parts = [("o_proj", layer.self_attn.o_proj), ("down_proj", getattr(mlp, "down_proj", None)),
                 ("shared_expert.down_proj", getattr(getattr(mlp, "shared_expert", None), "down_proj", None))]
        experts = getattr(mlp, "experts", None)
        if isinstance(experts, Fp8Experts):
            parts.append(("experts.down_proj", experts))
        for what, proj in parts:
            if isinstance(proj, (Fp8Linear, Fp8Experts)):
                k = proj.down_proj.shape[-1] if isinstance(proj, Fp8Experts) else proj.in_features
                bc = (proj.down_block if isinstance(proj, Fp8Experts) else proj.block)[1]
                for rank in range(world_size):
                    _check_columns(what, k, bc, *_rank_columns(k, rank, world_size))


def _column_parallel(proj: nn.Module, bounds: list[tuple[int, int]]) -> nn.Module:
    """`proj` (a linear, changed in place, or an Fp8Linear, replaced) restricted to the output rows of
    `bounds`, in order: this rank's heads of each of q, k, v, or its units of gate and of up."""
    bias = None if proj.bias is None else torch.cat([proj.bias[lo:hi] for lo, hi in bounds])
    if isinstance(proj, Fp8Linear):
        w = _fp8_cat([_fp8_rows(Fp8Weight(proj.weight, proj.weight_scale, proj.block), lo, hi) for lo, hi in bounds])
        return Fp8Linear(w.weight, w.scale, w.block, bias)
    proj.weight = nn.Parameter(torch.cat([proj.weight[lo:hi] for lo, hi in bounds]), requires_grad=False)
    proj.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None
    proj.out_features = proj.weight.shape[0]
    return proj


def _rank_columns(k: int, rank: int, world_size: int) -> tuple[int, int]:
    """This rank's equal share of k input columns."""
    return rank * k // world_size, (rank + 1) * k // world_size


def _row_parallel(proj: nn.Module, rank: int, world_size: int, group: ProcessGroup, what: str,
                  reduce: bool = True) -> nn.Module:
    """`proj` with this rank's share of the input columns, summed over ranks (`RowParallelLinear`); without
    `reduce`, unsummed (the block that holds it sums its output once)."""
    lo, hi = _rank_columns(proj.weight.shape[1], rank, world_size)
    if isinstance(proj, Fp8Linear):
        w = _fp8_cols(Fp8Weight(proj.weight, proj.weight_scale, proj.block), lo, hi, what)
        return RowParallelFp8Linear(w, proj.bias, group) if reduce else Fp8Linear(w.weight, w.scale, w.block, proj.bias)
    if reduce:
        return RowParallelLinear(proj.weight[:, lo:hi].clone(), proj.bias, group)
    proj.weight = nn.Parameter(proj.weight[:, lo:hi].clone(), requires_grad=False)
    proj.in_features = hi - lo
    return proj


def _rank_rows(sizes: list[int], rank: int, world_size: int) -> list[tuple[int, int]]:
    """This rank's equal share of each of consecutive parts of `sizes` rows, as (start, end) bounds."""
    bounds, start = [], 0
    for size in sizes:
        per = size // world_size
        bounds.append((start + rank * per, start + (rank + 1) * per))
        start += size
    return bounds


def _shard_attention(attn: Attention, rank: int, world_size: int, group: ProcessGroup) -> None:
    """Column-parallel fused qkv (this rank's heads of each of q, k, v), row-parallel o_proj; the head
    counts become local. Q/K norms are per head (weight [head_dim]) and stay as they are. FP8 weights
    shard with their scales."""
    attn.qkv_proj = _column_parallel(attn.qkv_proj, _rank_rows([attn.q_size, attn.kv_size, attn.kv_size], rank,
                                                               world_size))
    attn.heads //= world_size
    attn.kv_heads //= world_size
    attn.q_size = attn.heads * attn.head_dim
    attn.kv_size = attn.kv_heads * attn.head_dim
    attn.o_proj = _row_parallel(attn.o_proj, rank, world_size, group, "o_proj")


def _shard_mlp(mlp: GatedMLP, rank: int, world_size: int, group: ProcessGroup) -> None:
    """Column-parallel gate_up (this rank's units of gate and of up), row-parallel down_proj."""
    mlp.gate_up_proj = _column_parallel(mlp.gate_up_proj, _rank_rows([mlp.inter, mlp.inter], rank, world_size))
    mlp.inter //= world_size
    mlp.down_proj = _row_parallel(mlp.down_proj, rank, world_size, group, "down_proj")


def _shard_moe(moe: SparseMoE, rank: int, world_size: int, group: ProcessGroup) -> None:
    """Every rank holds every expert with its slice of the expert width (gate and up rows, down
    columns), and the router whole, so each rank routes alike; the shared expert is split the same
    way. The block's output is then a partial sum: one all_reduce, as for the dense MLP."""
    experts, rows = moe.experts, _rank_rows([moe.inter, moe.inter], rank, world_size)
    lo, hi = _rank_columns(moe.inter, rank, world_size)
    if isinstance(experts, Fp8Experts):
        gu = _fp8_cat([_fp8_rows(Fp8Weight(experts.gate_up_proj, experts.gate_up_scale, experts.gate_up_block), a, b)
                       for a, b in rows])
        dw = _fp8_cols(Fp8Weight(experts.down_proj, experts.down_scale, experts.down_block), lo, hi,
                       "experts.down_proj")
        moe.experts = Fp8Experts(gu.weight, gu.scale, dw.weight, dw.scale, gu.block, dw.block)
    else:
        experts.gate_up_proj = nn.Parameter(torch.cat([experts.gate_up_proj[:, a:b] for a, b in rows], dim=1),
                                            requires_grad=False)
        experts.down_proj = nn.Parameter(experts.down_proj[..., lo:hi].clone(), requires_grad=False)
    moe.inter //= world_size
    shared = moe.shared_expert
    if shared is not None:  # column-parallel gate_up, row-parallel down without its own reduction
        shared.gate_up_proj = _column_parallel(shared.gate_up_proj, _rank_rows([shared.inter] * 2, rank, world_size))
        shared.inter //= world_size
        shared.down_proj = _row_parallel(shared.down_proj, rank, world_size, group, "shared_expert.down_proj",
                                         reduce=False)
    moe.all_reduce = lambda t: dist.all_reduce(t, group=group)


def _vocab_rows(weight: Tensor, rank: int, world_size: int) -> tuple[Tensor, int, int]:
    """(this rank's rows zero-padded to ceil(V / world_size), first row, real row count)."""
    vocab = weight.shape[0]
    per = -(-vocab // world_size)
    start = min(rank * per, vocab)
    rows = min(per, vocab - start)
    local = weight.new_zeros(per, weight.shape[1])
    local[:rows] = weight[start : start + rows]
    return local, start, rows


def shard_model(model: CausalLM, rank: int, world_size: int, group: ProcessGroup = None) -> CausalLM:
    """Convert `model` in place to its tensor-parallel shard for `rank` (the config stays the full
    model's: vocab_size and head counts there describe the whole model; modules hold local counts).

    Call on every rank with the same full weights, after torch.distributed is initialised and before
    the KV cache is allocated (CausalLM.new_cache sizes it with the local KV heads)."""
    check_shardable(model.config, world_size)
    _check_fp8_columns(model, world_size)
    if not 0 <= rank < world_size:
        raise ConfigError(f"rank {rank} outside [0, {world_size})")
    if world_size == 1:
        return model
    if model.kv_scales is not None:  # per-head FP8 cache scales follow the rank's KV heads
        local = model.config.num_key_value_heads // world_size
        model.kv_scales = model.kv_scales.heads(rank * local, local)
    for layer in model.layers:
        _shard_attention(layer.self_attn, rank, world_size, group)
        if isinstance(layer.mlp, SparseMoE):
            _shard_moe(layer.mlp, rank, world_size, group)
        else:
            _shard_mlp(layer.mlp, rank, world_size, group)
    tied = model.lm_head.weight is model.embed_tokens.weight
    vocab = model.config.vocab_size
    emb, start, rows = _vocab_rows(model.embed_tokens.weight, rank, world_size)
    model.embed_tokens = VocabParallelEmbedding(emb, start, rows, group)
    head = model.embed_tokens.weight if tied else _vocab_rows(model.lm_head.weight, rank, world_size)[0]
    model.lm_head = VocabParallelLMHead(head, vocab, world_size, group)
    return model


# ---------------------------------------------------------------- ranks
def rank_engine(rank: int, world_size: int, control: ProcessGroup, model: str | os.PathLike[str],
                args: EngineArgs) -> EngineSetup:
    """One rank's engine: its shard of the target (`shard_loader`); its KV pages are the fewest any
    rank's memory allows, and its draft-length decisions rank 0's (`control`: a CPU group for host
    messages)."""
    # met only after a failed step, so never inside another collective; its timeout is how long the others may take
    faults = dist.new_group(backend="gloo", timeout=timedelta(seconds=FAILED_ALIKE_WAIT_S))
    setup = build_engine(model, args, load=shard_loader(rank, world_size),
                         fewest_pages=lambda mine: fewest(mine, control), agree=rank0_decides(control))
    setup.engine.check_failed_alike = failed_alike(rank, faults)
    return setup


def shard_loader(rank: int, world_size: int) -> TargetLoader:
    """A target loader that keeps this rank's shard: the full target is loaded on the CPU, sharded,
    and only the shard moved to the device, so no device ever holds the whole model."""

    def load(model_dir: Path, dtype: str | torch.dtype, device: torch.device, max_positions: int,
             quantization: str | None = None) -> tuple[CausalLM, Path]:
        cfg = ModelConfig.from_hf(read_json(model_dir / "config.json"), str(model_dir / "config.json"))
        check_shardable(cfg, world_size)
        torch_dtype = resolve_dtype(dtype, cfg.torch_dtype, device)
        target, model_dir = load_target(model_dir, torch_dtype, "cpu", max_positions=max_positions,
                                        quantization=quantization)
        shard_model(target, rank, world_size)
        return target.to(device), model_dir

    return load


def fewest(value: int, group: ProcessGroup | None) -> int:
    """The least of every rank's `value`, on every rank (a host all-reduce)."""
    least = torch.tensor([int(value)], dtype=torch.int64)
    dist.all_reduce(least, op=dist.ReduceOp.MIN, group=group)
    return int(least)


def rank0_decides(group: ProcessGroup) -> Agree:
    """An `Engine.agree` for ranks in lockstep: every rank passes its own decision (an int, or a list as long
    on every rank) and gets rank 0's."""

    def agree(decision: int | list[int]) -> int | list[int]:
        many = isinstance(decision, list)
        box = torch.tensor(decision if many else [int(decision)], dtype=torch.int64)
        dist.broadcast(box, src=0, group=group)
        return box.tolist() if many else int(box[0])

    return agree  # type: ignore[return-value]


# how long a rank whose step failed waits for the others to fail it too: ranks in lockstep reach the same failure
# a host's moment apart, while a rank whose step went on sits in the next collective and never comes
FAILED_ALIKE_WAIT_S = 60.0


def failed_alike(rank: int, group: ProcessGroup) -> Callable[[Exception], None]:
    """An `Engine.check_failed_alike` for ranks in lockstep: returns once every rank's step has failed (the same
    request's rows fail on each, so they recover alike), raises RanksParted when some rank's did not within
    FAILED_ALIKE_WAIT_S (its step went on, or its peer is gone): a rank recovering alone would pair its retry's
    collectives with the others' next step's. `group`: a gloo group of its own whose timeout is that wait."""

    def check(exc: Exception) -> None:
        try:
            dist.barrier(group=group)  # times out at the group's FAILED_ALIKE_WAIT_S
        except RuntimeError as barrier:
            raise RanksParted(f"tensor-parallel rank {rank}'s step failed ({_brief(exc)}), and not on every rank "
                              f"({_brief(barrier)}): the ranks no longer step in lockstep, so they "
                              "are closed; a new LLM starts them again") from exc

    return check


def _brief(exc: BaseException) -> str:
    """An exception on one line; gloo's ("[.../pair.cc:553] Connection closed by peer [...]. This is typically
    caused by ...") as its first sentence, without the source location or the advice."""
    lines = str(exc).strip().splitlines()
    text = lines[0] if lines else ""
    if (gloo := re.match(r"\[[^\]]*\.cc:\d+\]\s*", text)) is not None:
        text = text[gloo.end():].split(". ")[0]
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def join_group(rank: int, world_size: int, init_file: str, device: str | torch.device) -> tuple[str, ProcessGroup]:
    """Join the ranks' process group: NCCL on GPUs (rank r on cuda:r, NVLink multicast off), gloo on
    the CPU (over loopback). Returns this rank's device and the group for host messages."""
    cuda = resolve_device(device).type == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off (device README)
    elif Path("/sys/class/net/lo").exists():
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback only: the ranks share one host
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world_size, timeout=timedelta(minutes=10))
    # calls, server commands and policy decisions are host objects: under NCCL a broadcast of them
    # would go through a device tensor and sync the host every step, so they use a gloo group
    control = dist.new_group(backend="gloo") if cuda else None
    return str(device), control


# a run's ranks ask rank 0 every this many steps whether the user interrupted it (a host broadcast: rare
# enough to cost nothing a step, often enough that an interrupted run stops at once)
INTERRUPT_CHECK_STEPS = 16


# what rank 0 sends once it has taken a user's interrupt, after the reply of the call it stopped if any: the user's
# process reads up to it, so whether the interrupt stopped a run or came after its reply, no reply is left behind
INTERRUPT_SEEN = ("interrupt seen", None)


def _interrupt_check(conn: Connection | None, control: ProcessGroup | None) -> Callable[[int], bool]:
    """What OfflineRunner asks before each step: every INTERRUPT_CHECK_STEPS steps, rank 0 looks for the
    user's interrupt in its pipe (the only message sent while a call runs) and every rank learns the
    answer in the same broadcast, so all stop at the same step."""

    def interrupted(step: int) -> bool:
        if step % INTERRUPT_CHECK_STEPS:
            return False
        flag = [conn is not None and conn.poll(0)]
        dist.broadcast_object_list(flag, src=0, group=control)
        if flag[0] and conn is not None:
            _next_call(conn)  # the interrupt (or the user's process gone: the next call reads "close")
        return bool(flag[0])

    return interrupted


def _rank_main(rank: int, world_size: int, init_file: str, conn: Connection | None, model: str,
               args: EngineArgs, num_threads: int) -> None:
    """One rank: join the group, build its engine, then serve broadcast calls until "close". Ctrl-C is the
    user's process's to handle (it interrupts the call, `RankGroup.call`): a terminal sends it to the
    ranks too, which ignore it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(num_threads)
    device, control = join_group(rank, world_size, init_file, args.device)
    args = dataclasses.replace(args, device=device)
    try:
        try:
            setup: EngineSetup | None = rank_engine(rank, world_size, control, model, args)
            reply: tuple[str, Any] = ("ok", setup.inputs)
        except Exception as exc:  # noqa: BLE001  every rank fails alike (same config, same weights); rank 0 reports it
            setup, reply = None, ("err", portable(exc))
            if rank:  # unless only this one failed (its device's memory): then what rank 0 reports is its exit
                print(f"blockspec: tensor-parallel rank {rank} failed to start: {type(exc).__name__}: {exc}",
                      file=sys.stderr, flush=True)
        if conn is not None:
            conn.send(reply)
        if setup is None:
            return
        runner = OfflineRunner(setup.engine, _interrupt_check(conn, control))
        calls: dict[str, Callable[..., Any]] = {
            "run": runner.run,
            "metrics": setup.engine.metrics,
            "reset_prefix_cache": setup.engine.reset_prefix_cache,
            # every rank runs the server's engine loop until it stops
            "serve": lambda: _serve(setup.engine, setup.inputs, control, conn),
            "unreadable": _refuse_unreadable,
        }
        while True:
            msg: list[Any] = [_next_call(conn) if conn is not None else None]
            dist.broadcast_object_list(msg, src=0, group=control)
            name, args, kwargs = msg[0]
            if name == "close":
                return
            if name == "interrupt":  # for a call that ended before it arrived: nothing to stop
                if conn is not None:
                    conn.send(INTERRUPT_SEEN)
                continue
            if rank and "use_tqdm" in kwargs:
                kwargs = {**kwargs, "use_tqdm": False}
            try:
                reply = ("ok", calls[name](*args, **kwargs))
            except RanksParted as exc:  # the group is broken: report, and end without tearing it down
                _part(conn, exc)
            except Exception as exc:  # noqa: BLE001  every rank raises alike
                reply = ("err", portable(exc))
            if conn is not None:
                conn.send(reply)
                if reply[0] == "err" and isinstance(reply[1], Interrupted):  # the run the interrupt stopped
                    conn.send(INTERRUPT_SEEN)
    finally:
        dist.destroy_process_group()


PARTED_EXIT_CODE = 1  # a rank that ended for RanksParted (any other code: it died)


def _part(conn: Connection | None, exc: RanksParted) -> NoReturn:
    """End a rank whose group has parted: rank 0 sends the error as its call's reply; every rank prints it (the
    user's process names a rank that exits with an error) and exits without destroying the group, whose
    teardown could wait on a peer stuck in a collective."""
    print(f"blockspec: {exc}", file=sys.stderr, flush=True)
    if conn is not None:
        conn.send(("err", exc))
    os._exit(PARTED_EXIT_CODE)


SERVE_HEARTBEAT_S = 30.0  # an idle server's ranks still meet in a collective, far inside the group's timeout


def _serve(engine: Engine, inputs: ModelInputs, control: ProcessGroup, conn: Connection | None) -> None:
    """The server's engine loop on every rank in lockstep: rank 0 takes the commands waiting in its
    pipe (the engine process relays them from the front) and broadcasts them before every step, so
    each rank applies the same submissions and aborts and steps alike; only rank 0 reports."""

    def commands(block: bool) -> list[Any]:
        cmds: list[Any] = []
        if conn is not None:
            wait = SERVE_HEARTBEAT_S if block else 0.0
            try:
                while conn.poll(wait):
                    cmds.append(conn.recv())
                    wait = 0.0
            except EOFError:  # the engine process is gone: stop every rank
                cmds.append(Stop())
        msg: list[Any] = [cmds]
        dist.broadcast_object_list(msg, src=0, group=control)  # on the host: no device sync a step
        return msg[0]

    serve_engine(engine, inputs, commands, conn.send if conn is not None else lambda report: None)


def _next_call(conn: Connection) -> tuple[str, tuple[Any, ...], dict[str, Any]]:
    """The user's next call; "close" when the user's process has gone, so no rank waits forever; "unreadable"
    (answered with an error) for a call whose arguments pickled in the user's process but cannot be rebuilt
    here (a class defined in a notebook or `python -c`, which the ranks cannot import)."""
    try:
        return conn.recv()
    except EOFError:
        return "close", (), {}
    except Exception as exc:  # noqa: BLE001  whatever unpickling raises
        return "unreadable", (f"{type(exc).__name__}: {exc}",), {}


def _refuse_unreadable(reason: str) -> None:
    raise ConfigError(f"the call's arguments cannot be read by the tensor-parallel ranks ({reason}): pass "
                      "objects the ranks can import (a tqdm class from a module, not from __main__)")


def portable(exc: Exception) -> Exception:
    """The exception itself when it pickles, else a RuntimeError carrying its traceback."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001  any pickling failure
        return RuntimeError("".join(traceback.format_exception(exc)))


def target_for_ranks(model: str | os.PathLike[str], world_size: int, device: str | torch.device, **hub: Any) -> Path:
    """The target's directory (a hub id downloaded; `hub`: resolve_model_dir's revision, download_dir, token),
    once `check_ranks` has found that `world_size` ranks can run it."""
    model_dir = resolve_model_dir(model, **hub)
    path = model_dir / "config.json"
    check_ranks(ModelConfig.from_hf(read_json(path), str(path)), world_size, device)
    return model_dir


def check_ranks(cfg: ModelConfig, world_size: int, device: str | torch.device) -> None:
    """Raise ConfigError, before any rank is spawned, when `world_size` ranks cannot run this target:
    shapes that do not split, fewer GPUs than ranks. (FP8 scale blocks that a rank's share would cut are
    named when the ranks shard the weights.)"""
    check_shardable(cfg, world_size)
    if resolve_device(device).type == "cuda" and torch.cuda.device_count() < world_size:
        raise ConfigError(f"tensor_parallel_size={world_size} needs that many GPUs; "
                          f"{torch.cuda.device_count()} visible")


# how long rank 0 has to answer once another rank died, and the parted ranks to exit before a call's error names
# those that died
PARTED_EXIT_WAIT_S = 5.0


@contextlib.contextmanager
def _children_ignore_sigint() -> Iterator[None]:
    """Processes started inside ignore SIGINT from their first instruction: an ignored signal stays ignored across
    exec, and Python installs its KeyboardInterrupt handler only where SIGINT is at its default. A terminal sends
    Ctrl-C to the ranks too, and one landing while a rank's interpreter started and imported torch (seconds, before
    `_rank_main` ignores it) printed that rank's traceback. This process ignores it only while they start."""
    if threading.current_thread() is not threading.main_thread():  # only the main thread sets handlers
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous if previous is not None else signal.default_int_handler)


class RankProcesses:
    """`world_size` spawned processes, each running `main(rank, world_size, init_file, conn, *args)`
    (`init_file`: the group's rendezvous; `conn`: rank 0's end of a pipe to this process, None on
    the others); what rank 0 sends back is read here, failing fast when any rank dies instead."""

    def __init__(self, main: Callable[..., None], world_size: int, args: tuple[Any, ...]) -> None:
        self.world_size = world_size
        self._dir = tempfile.mkdtemp(prefix="blockspec-tp-")
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._procs = []
        # closed when this object is collected or the interpreter exits, if not before: no rank processes
        # or rendezvous directory outlive an LLM nobody closed
        self._closing = weakref.finalize(self, _stop_ranks, self._procs, self._conn, self._dir)
        with _children_ignore_sigint():
            for rank in range(world_size):
                p = ctx.Process(target=main, daemon=True,
                                args=(rank, world_size, os.path.join(self._dir, "store"),
                                      child if rank == 0 else None, *args))
                p.start()
                self._procs.append(p)
        child.close()

    def reply(self, timeout_s: float | None = None) -> Any:
        """Wait for rank 0's answer, failing fast if any rank process dies instead."""
        status, value = self.receive(timeout_s)
        if status == "err":
            raise value
        return value

    def _check_alive(self) -> None:
        """Raise, naming them, if rank 0 or a rank that crashed has exited. A rank other than 0 may end
        cleanly before rank 0's answer lands (a sweep's last gather, a setup error every rank hit)."""
        dead = [i for i, p in enumerate(self._procs) if p.exitcode is not None and (i == 0 or p.exitcode)]
        if dead:
            raise RuntimeError(f"tensor-parallel rank(s) {dead} exited (codes "
                               f"{[self._procs[i].exitcode for i in dead]})")

    def receive(self, timeout_s: float | None = None) -> Any:
        """Rank 0's next message, failing fast if any rank process dies instead. A rank other than 0 that died
        leaves rank 0 PARTED_EXIT_WAIT_S to answer first: its answer says what the death did to the call."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self._conn.poll(0.1):
            try:
                self._check_alive()
            except RuntimeError:
                if not self._conn.poll(PARTED_EXIT_WAIT_S if self._procs[0].exitcode is None else 0):
                    raise  # an answer sent just before its sender exited is still read
                break
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"tensor-parallel ranks gave no answer in {timeout_s:.0f} s")
        try:
            return self._conn.recv()
        except EOFError:
            raise RuntimeError("tensor-parallel rank 0 closed its pipe without answering (it exited)") from None

    def close(self) -> None:
        """Stop the ranks (a "close" call first, which ranks serving calls obey; then by force) and remove
        the rendezvous directory."""
        self._closing()


def _stop_ranks(procs: list[Any], conn: Connection, directory: str) -> None:
    """`RankProcesses.close`, on what it holds (a finalizer must not hold the object itself)."""
    if not procs:
        return
    if all(p.is_alive() for p in procs):
        try:
            conn.send(("close", (), {}))
        except (BrokenPipeError, OSError):
            pass
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
            p.join()
    procs.clear()
    conn.close()
    shutil.rmtree(directory, ignore_errors=True)


INTERRUPT_DRAIN_S = 60.0  # how long an interrupted call waits for its run to stop before the ranks are closed


class RankGroup(RankProcesses):
    """The rank processes of a tensor-parallel LLM (one GPU each, or CPU with gloo): rank 0 receives
    each call from the user's process over a pipe and broadcasts it to the other ranks, so all of
    them run the same engine steps in lockstep, and rank 0 sends the result back."""

    def __init__(self, model: str | os.PathLike[str], args: EngineArgs, world_size: int,
                 num_threads: int | None = None, startup_timeout_s: float = 600.0) -> None:
        """num_threads: torch threads per rank; default: this process's, shared
        out so the ranks do not oversubscribe the CPU."""
        model_dir = target_for_ranks(model, world_size, args.device, **args.hub(args.revision))  # before any spawn
        self._parted: str | None = None  # why the ranks were closed, when a step parted them
        num_threads = num_threads or max(1, torch.get_num_threads() // world_size)
        super().__init__(_rank_main, world_size, (str(model_dir), args, num_threads))
        try:
            self.inputs: ModelInputs = self.reply(startup_timeout_s)
        except BaseException:
            self.close()
            raise

    def call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """Run `name` ("run": OfflineRunner.run, "metrics": Engine.metrics) on every rank in lockstep;
        rank 0's result. Interrupted (Ctrl-C), the ranks stop the call's run and its reply is read and
        dropped before KeyboardInterrupt goes on, so the next call reads its own reply."""
        if self._parted is not None:
            raise RanksParted(f"this LLM's tensor-parallel ranks were closed when a step parted them ({self._parted})")
        if not self._procs:
            raise RuntimeError("the tensor-parallel ranks are closed")
        try:
            message = ForkingPickler.dumps((name, args, kwargs))  # as Connection.send pickles
        except (pickle.PicklingError, AttributeError, TypeError) as exc:
            raise ConfigError(f"the call's arguments cannot be sent to the tensor-parallel ranks: {exc}") from None
        self._check_alive()
        try:
            self._conn.send_bytes(message)
        except OSError:  # rank 0 died since the last call: name the ranks that exited
            self._check_alive()
            raise
        try:
            return self.reply()
        except KeyboardInterrupt:
            self._drop_reply()
            raise
        except RanksParted as exc:  # the ranks have exited or are stuck in a collective: close them all
            deadline = time.monotonic() + PARTED_EXIT_WAIT_S  # every rank that saw it exits: how each ended
            for p in self._procs:
                p.join(max(0.0, deadline - time.monotonic()))
            exited = {i: p.exitcode for i, p in enumerate(self._procs) if p.exitcode not in (None, PARTED_EXIT_CODE)}
            self._parted = str(exc) + (f"; rank(s) {list(exited)} died (exit codes {list(exited.values())})"
                                       if exited else "; each rank whose step failed printed why")
            self.close()
            raise RanksParted(self._parted) from None

    def _drop_reply(self, timeout_s: float = INTERRUPT_DRAIN_S) -> None:
        """After an interrupted call: ask the ranks to stop its run, and read its reply if it is still to come,
        up to rank 0's INTERRUPT_SEEN (the interrupt may have landed after the reply was read). If that does
        not come (another Ctrl-C, a rank stuck), the ranks are closed: a later call raises, never reads a
        stale reply."""
        deadline = time.monotonic() + timeout_s
        try:
            self._conn.send(("interrupt", (), {}))
            while self.receive(max(0.0, deadline - time.monotonic())) != INTERRUPT_SEEN:
                pass
        except BaseException:
            self.close()

    def serve(self, commands: Connection, reports: Connection) -> None:
        """Serve a server front's pipes (`blockspec serve`'s engine process): the ranks run the
        engine loop, rank 0 broadcasting the commands this process forwards to it, and its reports
        come back through here. Returns when the front sends Stop or goes away."""
        self._conn.send(("serve", (), {}))

        def forward() -> None:
            while True:
                try:
                    cmd = commands.recv()
                except (EOFError, OSError):
                    cmd = Stop()
                self._conn.send(cmd)
                if isinstance(cmd, Stop):
                    return

        threading.Thread(target=forward, name="blockspec-tp-commands", daemon=True).start()
        while not isinstance(report := self.receive(), tuple):  # the call's reply ends the serving
            reports.send(report)
        if report[0] == "err":
            raise report[1]
