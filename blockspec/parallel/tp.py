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

import dataclasses
import os
import pickle
import shutil
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

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
from blockspec.engine.build import EngineSetup, TargetLoader, build_engine
from blockspec.engine.engine import Engine
from blockspec.engine.loop import OfflineRunner, Stop, serve_engine
from blockspec.inputs import ModelInputs
from blockspec.models.layers import GatedMLP
from blockspec.models.llama import Attention, CausalLM
from blockspec.models.moe import SparseMoE
from blockspec.models.quant import is_quantized
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


def _part(t: Tensor, rank: int, world_size: int, dim: int = 0) -> Tensor:
    """This rank's equal slice of `t` along `dim`, copied so the full tensor can be freed."""
    return t.chunk(world_size, dim=dim)[rank].clone()


def _shard_attention(attn: Attention, rank: int, world_size: int, group: ProcessGroup) -> None:
    """Column-parallel fused qkv (this rank's heads of each of q, k, v), row-parallel o_proj; the head
    counts become local. Q/K norms are per head (weight [head_dim]) and stay as they are."""
    qkv = attn.qkv_proj
    pieces = [qkv.weight.split([attn.q_size, attn.kv_size, attn.kv_size])]
    if qkv.bias is not None:
        pieces.append(qkv.bias.split([attn.q_size, attn.kv_size, attn.kv_size]))
    local = [torch.cat([_part(p, rank, world_size) for p in parts]) for parts in pieces]
    attn.heads //= world_size
    attn.kv_heads //= world_size
    attn.q_size = attn.heads * attn.head_dim
    attn.kv_size = attn.kv_heads * attn.head_dim
    qkv.weight = nn.Parameter(local[0], requires_grad=False)
    qkv.bias = nn.Parameter(local[1], requires_grad=False) if len(local) > 1 else None
    qkv.out_features = local[0].shape[0]
    o = attn.o_proj
    attn.o_proj = RowParallelLinear(_part(o.weight, rank, world_size, dim=1), o.bias, group)


def _shard_mlp(mlp: GatedMLP, rank: int, world_size: int, group: ProcessGroup) -> None:
    """Column-parallel gate_up (this rank's units of gate and of up), row-parallel down_proj."""
    gu = mlp.gate_up_proj
    split = lambda t: torch.cat([_part(h, rank, world_size) for h in t.chunk(2)])
    gu.weight = nn.Parameter(split(gu.weight), requires_grad=False)
    if gu.bias is not None:
        gu.bias = nn.Parameter(split(gu.bias), requires_grad=False)
    gu.out_features = gu.weight.shape[0]
    mlp.inter //= world_size
    down = mlp.down_proj
    mlp.down_proj = RowParallelLinear(_part(down.weight, rank, world_size, dim=1), down.bias, group)


def _shard_moe(moe: SparseMoE, rank: int, world_size: int, group: ProcessGroup) -> None:
    """Every rank holds every expert with its slice of the expert width (gate and up rows, down
    columns), and the router whole, so each rank routes alike; the shared expert is split the same
    way. The block's output is then a partial sum: one all_reduce, as for the dense MLP."""
    experts = moe.experts
    gate, up = experts.gate_up_proj.chunk(2, dim=1)
    experts.gate_up_proj = nn.Parameter(torch.cat([_part(gate, rank, world_size, 1), _part(up, rank, world_size, 1)],
                                                  dim=1), requires_grad=False)
    experts.down_proj = nn.Parameter(_part(experts.down_proj, rank, world_size, dim=2), requires_grad=False)
    moe.inter //= world_size
    shared = moe.shared_expert
    if shared is not None:  # column-parallel gate_up, row-parallel down without its own reduction
        gu = shared.gate_up_proj
        gu.weight = nn.Parameter(torch.cat([_part(h, rank, world_size) for h in gu.weight.chunk(2)]),
                                 requires_grad=False)
        gu.out_features = gu.weight.shape[0]
        shared.inter //= world_size
        shared.down_proj.weight = nn.Parameter(_part(shared.down_proj.weight, rank, world_size, dim=1),
                                               requires_grad=False)
        shared.down_proj.in_features = shared.inter
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
    if world_size > 1 and is_quantized(model):
        raise ConfigError("tensor_parallel_size > 1 with FP8 weights is not supported yet")
    if not 0 <= rank < world_size:
        raise ConfigError(f"rank {rank} outside [0, {world_size})")
    if world_size == 1:
        return model
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
    return build_engine(model, args, load=shard_loader(rank, world_size),
                        fewest_pages=lambda mine: fewest(mine, control), agree=rank0_decides(control))


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


def rank0_decides(group: ProcessGroup) -> Callable[[int], int]:
    """An `Engine.agree` for ranks in lockstep: every rank passes its own decision and gets rank 0's."""
    box = torch.zeros(1, dtype=torch.int64)

    def agree(decision: int) -> int:
        box[0] = int(decision)
        dist.broadcast(box, src=0, group=group)
        return int(box[0])

    return agree


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


def _rank_main(rank: int, world_size: int, init_file: str, conn: Connection | None, model: str,
               args: EngineArgs, num_threads: int) -> None:
    """One rank: join the group, build its engine, then serve broadcast calls until "close"."""
    torch.set_num_threads(num_threads)
    device, control = join_group(rank, world_size, init_file, args.device)
    args = dataclasses.replace(args, device=device)
    try:
        try:
            setup: EngineSetup | None = rank_engine(rank, world_size, control, model, args)
            reply: tuple[str, Any] = ("ok", setup.inputs)
        except Exception as exc:  # noqa: BLE001  every rank fails alike (same config, same weights); rank 0 reports it
            setup, reply = None, ("err", portable(exc))
        if conn is not None:
            conn.send(reply)
        if setup is None:
            return
        runner = OfflineRunner(setup.engine)
        calls: dict[str, Callable[..., Any]] = {
            "run": runner.run,
            "metrics": setup.engine.metrics,
            "reset_prefix_cache": setup.engine.reset_prefix_cache,
            # every rank runs the server's engine loop until it stops
            "serve": lambda: _serve(setup.engine, setup.inputs, control, conn),
        }
        while True:
            msg: list[Any] = [_next_call(conn) if conn is not None else None]
            dist.broadcast_object_list(msg, src=0, group=control)
            name, args, kwargs = msg[0]
            if name == "close":
                return
            if rank and "use_tqdm" in kwargs:
                kwargs = {**kwargs, "use_tqdm": False}
            try:
                reply = ("ok", calls[name](*args, **kwargs))
            except Exception as exc:  # noqa: BLE001  every rank raises alike
                reply = ("err", portable(exc))
            if conn is not None:
                conn.send(reply)
    finally:
        dist.destroy_process_group()


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
    """The user's next call; "close" when the user's process has gone, so no rank waits forever."""
    try:
        return conn.recv()
    except EOFError:
        return "close", (), {}


def portable(exc: Exception) -> Exception:
    """The exception itself when it pickles, else a RuntimeError carrying its traceback."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001  any pickling failure
        return RuntimeError("".join(traceback.format_exception(exc)))


def check_ranks(cfg: ModelConfig, world_size: int, device: str | torch.device, fp8: bool) -> None:
    """Raise ConfigError, before any rank is spawned, when `world_size` ranks cannot run this target:
    shapes that do not split, FP8 weights (`fp8`: their scales are not sharded), fewer GPUs than ranks."""
    check_shardable(cfg, world_size)
    if world_size > 1 and fp8:
        raise ConfigError("tensor_parallel_size > 1 with FP8 weights (an FP8 checkpoint or quantization='fp8') "
                          "is not supported yet: the ranks would need the scales sharded with the weights")
    if resolve_device(device).type == "cuda" and torch.cuda.device_count() < world_size:
        raise ConfigError(f"tensor_parallel_size={world_size} needs that many GPUs; "
                          f"{torch.cuda.device_count()} visible")


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
        for rank in range(world_size):
            p = ctx.Process(target=main, daemon=True,
                            args=(rank, world_size, os.path.join(self._dir, "store"), child if rank == 0 else None,
                                  *args))
            p.start()
            self._procs.append(p)
        child.close()

    def reply(self, timeout_s: float | None = None) -> Any:
        """Wait for rank 0's answer, failing fast if any rank process dies instead."""
        status, value = self.receive(timeout_s)
        if status == "err":
            raise value
        return value

    def receive(self, timeout_s: float | None = None) -> Any:
        """Rank 0's next message, failing fast if any rank process dies instead."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self._conn.poll(0.1):
            # A rank other than 0 may end cleanly before rank 0's answer lands (a sweep's last gather,
            # a setup error every rank hit): only a crash fails; and an answer sent just before its
            # sender exited is still read (the poll below), whatever the exit code.
            dead = [i for i, p in enumerate(self._procs) if p.exitcode is not None and (i == 0 or p.exitcode)]
            if dead and not self._conn.poll(0):
                raise RuntimeError(f"tensor-parallel rank(s) {dead} exited (codes "
                                   f"{[self._procs[i].exitcode for i in dead]})")
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"tensor-parallel ranks gave no answer in {timeout_s:.0f} s")
        try:
            return self._conn.recv()
        except EOFError:
            raise RuntimeError("tensor-parallel rank 0 closed its pipe without answering (it exited)") from None

    def close(self) -> None:
        """Stop the ranks (a "close" call first, which ranks serving calls obey; then by force) and remove
        the rendezvous file."""
        if not self._procs:
            return
        if all(p.is_alive() for p in self._procs):
            try:
                self._conn.send(("close", (), {}))
            except (BrokenPipeError, OSError):
                pass
        for p in self._procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
        self._procs = []
        self._conn.close()
        shutil.rmtree(self._dir, ignore_errors=True)


class RankGroup(RankProcesses):
    """The rank processes of a tensor-parallel LLM (one GPU each, or CPU with gloo): rank 0 receives
    each call from the user's process over a pipe and broadcasts it to the other ranks, so all of
    them run the same engine steps in lockstep, and rank 0 sends the result back."""

    def __init__(self, model: str | os.PathLike[str], args: EngineArgs, world_size: int,
                 num_threads: int | None = None, startup_timeout_s: float = 600.0) -> None:
        """num_threads: torch threads per rank; default: this process's, shared
        out so the ranks do not oversubscribe the CPU."""
        model_dir = resolve_model_dir(model, **args.hub(args.revision))
        config = read_json(model_dir / "config.json")
        check_ranks(ModelConfig.from_hf(config, str(model_dir / "config.json")), world_size, args.device,
                    fp8=bool(args.quantization) or "quantization_config" in config)  # before spawning anything
        num_threads = num_threads or max(1, torch.get_num_threads() // world_size)
        super().__init__(_rank_main, world_size, (str(model_dir), args, num_threads))
        try:
            self.inputs: ModelInputs = self.reply(startup_timeout_s)
        except BaseException:
            self.close()
            raise

    def call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """Run `name` ("run": OfflineRunner.run, "metrics": Engine.metrics) on every rank in lockstep;
        rank 0's result."""
        if not self._procs:
            raise RuntimeError("the tensor-parallel ranks are closed")
        self._conn.send((name, args, kwargs))
        return self.reply()

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
