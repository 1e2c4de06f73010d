"""`blockspec bench`: plain vs DFlash vs DSpark (and transformers peers) on the same weights and device.

One run sweeps methods x prompt lengths (random-token prompts) x batch sizes (concurrency: requests
decoded together) x temperatures. At each point every method's engine is warmed up (CUDA graphs captured,
kernels compiled), then the methods are timed in `repeats` rounds of one pass each, interleaved (plain,
DFlash, DSpark, then the next round in a rotated order): a pass's speed drifts with the host and the
device, by tens of per cent on a small model, and a drift must fall on every method alike. What is alive is
frozen out of the garbage collector's walks over the timed rounds, as a serving process freezes what it
loaded: a full collection walks every tracked object, so unfrozen, a pass beside more engines pays for their
objects, and a host-bound pass's time follows when a collection falls in it. A speculative
row's speedup is the median of its rounds' ratios to the plain pass of the same round, with their min and
max. Token ids go in and come out (no detokenisation is timed). A point's engines take turns, so their
KV caches share one store (`SharedKVStore`, every engine with the pages its largest member needs): the
point holds one engine's KV memory. A run's memory is what it would hold alone, counted from its objects
(the target's and drafter's weights, their KV caches) plus the most one of its passes allocated on top
(GPU).

Presets (`--preset`) fill what the user did not set: `default` is the embedded model pair on held-out code
(real acceptance); `concurrency` and `long-context` are the serving workloads compared with peer engines,
on random weights of `--arch` with synthetic acceptance 6.5 (geometric over the drafter's whole block),
T = 0 and 3 rounds: `concurrency` 512-token prompts and 1024 output tokens at 1, 4, 8, 16, 32 and 64
requests in flight (4 x c requests, a finished one's slot refilled, as serving benches hold concurrency);
`long-context` 8192- and 32768-token prompts and 256 output tokens at 1 and 16.

With `k_sweep` (`--k-sweep 2,4,8,15`) every speculative method also runs at each fixed draft length K in
the same interleaved rounds, and the report checks the draft-length policy against the best fixed K
(`ksweep`). With `trace_policy` (`--trace-policy`) each speculative engine's policy records what it saw
and chose over the timed passes (policy_trace.json): where its estimates come from, step by step; and,
apart, over the warm-up pass, whose choices (a park, a settled K) the timed passes start from.

With `synthetic_acceptance` the speculative runs use SyntheticProposer (real draft and verify
forwards, drawn acceptance): their tokens are not the target's, and the report says so everywhere.

With `tensor_parallel_size` N > 1 the sweep runs on N rank processes: each builds the same seeded target
(or loads the checkpoint) and keeps its shard, builds the same engines (KV pages the fewest any rank
allows, rank 0's draft-length decisions) and runs the same passes in lockstep; rank 0 times them and
the report adds every rank's step figures (`tp_report`). With `compare_tp1` TP = 1 runs first, in this
process, and the report compares the two.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import hashlib
import itertools
import math
import platform
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from functools import partial
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np
import torch

from blockspec.bench.arch import (ARCHS, available_memory, draft_step_terms, get_arch, param_bytes, random_drafter,
                                  random_target, row_flops, step_bytes, weight_bytes)
from blockspec.models.quant import is_quantized, quantize_model
from blockspec.bench.expert_union import ROUTING_MODELS, set_routing
from blockspec.bench.drafts import StepLog, acceptance
from blockspec.bench.ksweep import clip, clip_note, policy_record, sweep_line, sweep_point, sweep_report
from blockspec.bench.points import Point, RunKey, point
from blockspec.bench.report import (SYNTHETIC_NOTE, add_step_floors, checks, compare_to_plain, markdown, summary_line,
                                   write_outputs)
from blockspec.bench.tp_report import add_rank_figures, compare_tp, rank_figures
from blockspec.bench.timing import (
    allocated_bytes,
    collector_frozen,
    copy_bandwidth,
    free_memory,
    matmul_rate,
    peak_allocated_bytes,
    reset_peak_memory,
    spread,
    synchronize,
)
from blockspec.assets import embedded
from blockspec.inputs import read_prompts_file
from blockspec.config import ConfigError, EngineConfig, SpeculativeConfig, output_dir
from blockspec.engine.engine import Engine
from blockspec.engine.memory import cache_extent
from blockspec.models.cpu_linear import PackedProduct
from blockspec.models.kv_cache import PageTable, SharedKVStore, kv_storage_dtype
from blockspec.models.llama import CausalLM
from blockspec.sampling_params import SamplingParams
from blockspec.speculative.synthetic import AcceptanceProfile, SyntheticProposer

METHODS = ("plain", "dflash", "dspark")
# the workload fields a preset fills where the user left them unset (None), and their values without one
BASE_WORKLOAD: dict[str, Any] = {"batch_sizes": (1,), "temperatures": (0.0,), "input_len": (512,), "output_len": 256,
                                 "repeats": 3, "waves": 1}
# --preset NAME on random weights of --arch: the serving workloads compared with peer engines
WORKLOADS: dict[str, dict[str, Any]] = {
    # concurrency held as a serving bench holds it: 4 x c requests, at most c in flight, a finished request's slot
    # taken by the next (one wave would be a static batch, as long as its slowest request)
    "concurrency": {"methods": METHODS, "input_len": (512,), "output_len": 1024, "batch_sizes": (1, 4, 8, 16, 32, 64),
                    "waves": 4, "temperatures": (0.0,), "repeats": 3, "synthetic_acceptance": "6.5"},
    "long-context": {"methods": METHODS, "input_len": (8192, 32768), "output_len": 256, "batch_sizes": (1, 16),
                     "temperatures": (0.0,), "repeats": 3, "synthetic_acceptance": "6.5"},
}
# --preset NAME: "default" names the embedded model pair, the others a workload
PRESETS = ("default", *WORKLOADS)
BUILTIN_PROMPTS = (
    "Write a Python function that returns the n-th Fibonacci number iteratively, with a docstring and tests.",
    "Explain step by step how to compute 17 * 23 - 144 / 12, then give the final answer.",
    "Write a short story (about 200 words) about a lighthouse keeper who finds a message in a bottle.",
    "Summarize the main causes of the French Revolution in five bullet points.",
    "Translate into French: 'The meeting has been moved to Thursday afternoon because of the holiday.'",
    "What is the difference between a process and a thread? Answer for a junior programmer.",
    "A train leaves at 9:40 and arrives at 13:05. How long is the journey? Show your reasoning.",
    "Write a SQL query that returns the ten customers with the highest total order value in 2024.",
    "List the planets of the solar system with one interesting fact about each.",
    "Implement binary search in C and explain its time complexity.",
    "Give three arguments for and three against remote work, then a balanced conclusion.",
    "Prove that the sum of the first n odd numbers is n squared.",
)


@dataclass
class BenchConfig:
    """Everything one benchmark run needs; validated before any model is built."""

    random_weights: bool = False
    arch: str = "qwen3-8b"  # --random-weights shape: qwen3-8b | tiny
    model: str | None = None  # a real target (HF directory or hub id)
    dflash_model: str | None = None
    dspark_model: str | None = None
    # the BASE_WORKLOAD fields (batch_sizes, temperatures, input_len, output_len, repeats, waves) are None only until
    # __post_init__ fills them: None is "not given", so a preset's value, else the base one
    methods: tuple[str, ...] | None = None  # None: the preset's, else plain + every drafter available
    batch_sizes: tuple[int, ...] | None = None
    temperatures: tuple[float, ...] | None = None
    preset: str | None = None  # one of PRESETS: "default" names the embedded pair, the others a workload (WORKLOADS)
    prompts: str | None = None  # a jsonl ("prompt" or "prompt_token_ids") or text file | "builtin" | "heldout" | None: random tokens
    input_len: tuple[int, ...] | None = None  # random-token prompt lengths: one point each
    output_len: int | None = None
    waves: int | None = None  # requests per point = batch x waves (finished slots are refilled: continuous batching)
    repeats: int | None = None
    k_sweep: tuple[int, ...] = ()  # fixed draft lengths each speculative method also runs at (ksweep)
    trace_policy: bool = False  # record each speculative engine's draft-length policy over the timed passes
    num_speculative_tokens: int | None = None
    speculative_config: dict[str, Any] = field(default_factory=dict)  # extra SpeculativeConfig fields
    synthetic_acceptance: str | None = None
    synthetic_seed: int = 0
    peers: tuple[str, ...] = ()
    peer_assistant: str | None = None
    peer_batch_sizes: tuple[int, ...] | None = None  # None: batch_sizes
    peer_temperatures: tuple[float, ...] = (0.0,)
    peer_output_len: int | None = None  # None: output_len (transformers eager is slow: keep this short)
    chat_template: bool = True  # apply the tokenizer's chat template to text prompts
    dspark_block_size: int | None = None  # random weights: None = the arch's (7 for qwen3-8b)
    device: str = "auto"
    dtype: str = "auto"
    quantization: str | None = None  # "fp8": the target's decoder weights in FP8, per channel (drafters stay in dtype)
    moe_routing: str = "own"  # random MoE targets: the routing model of bench.expert_union (own, uniform, local)
    kv_cache_dtype: str = "auto"  # "fp8": the target's and the drafters' KV caches in e4m3
    seed: int = 0
    max_prefill_tokens: int = 4096
    attention_backend: str = "auto"
    tensor_parallel_size: int = 1  # N > 1: N rank processes (one GPU each, or gloo on the CPU), rank 0 timing
    compare_tp1: bool = False  # with N > 1: TP = 1 in this process first, and the report compares them
    command: str | None = None
    # the workload fields the caller set (set at construction, kept by dataclasses.replace)
    _given: frozenset[str] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        """Fill the workload fields left unset (None) from the workload preset, else BASE_WORKLOAD: a preset
        gives what the user did not set, whatever value the user set (a default's too) wins. A preset's
        synthetic acceptance applies only where a speculative method runs."""
        fill = {**BASE_WORKLOAD, **WORKLOADS.get(self.preset or "", {})}
        profile = fill.pop("synthetic_acceptance", None)
        if self._given is None:
            self._given = frozenset(name for name in fill if getattr(self, name) is not None)
        for name, value in fill.items():
            if getattr(self, name) is None:
                setattr(self, name, value)
        if self.synthetic_acceptance is None and set(self.methods or ()) - {"plain"}:
            self.synthetic_acceptance = profile

    def apply_preset(self) -> None:
        """Fill in the models and prompts `preset` names: "default" is the embedded target with its DFlash
        and DSpark drafters in float32 (unless --dtype says otherwise), on openings of held-out stdlib
        functions as plain text (the code model's own input), so its acceptance is real; a workload
        preset runs random weights of --arch on random-token prompts (its workload is filled at
        construction). Without a preset, a model flag given as 'default' names the embedded pair's model."""
        from blockspec.demo import default_pair

        if self.preset is None:
            self.model, self.dflash_model, self.dspark_model = (
                None if name is None else embedded(name, part)
                for name, part in ((self.model, "target"), (self.dflash_model, "dflash"), (self.dspark_model, "dspark")))
            return
        if self.preset not in PRESETS:
            raise ConfigError(f"--preset {self.preset!r} unknown; allowed: {', '.join(PRESETS)}")
        if self.preset in WORKLOADS:
            if self.model or self.dflash_model or self.dspark_model or self.prompts:
                raise ConfigError(f"--preset {self.preset} runs random weights of --arch on random-token prompts: "
                                  "leave out --model, --dflash-model, --dspark-model and --prompts")
            self.random_weights = True
            return
        if self.random_weights or self.model or self.dflash_model or self.dspark_model:
            raise ConfigError(f"--preset {self.preset} names the models itself: leave out --random-weights, --model, "
                              "--dflash-model and --dspark-model")
        base, _ = default_pair()
        self.model, self.dflash_model, self.dspark_model = (str(base / d) for d in ("target", "dflash", "dspark"))
        self.prompts = self.prompts or "heldout"
        self.chat_template = False
        # float32 on every device, as the demo: in bf16 a verify's multi-row products round unlike a plain
        # step's one-row ones, and this small model's near-tied greedy tokens flip (outputs then differ)
        self.dtype = "float32" if self.dtype == "auto" else self.dtype

    def validate(self) -> None:
        from blockspec.bench.peers import PEERS

        if self.random_weights == (self.model is not None):
            raise ConfigError("give exactly one of --random-weights (with --arch) or --model")
        if self.methods is not None and not self.methods:
            raise ConfigError(f"--methods is empty; give a comma list of {', '.join(METHODS)}")
        if not isinstance(self.speculative_config, dict):
            raise ConfigError(f"--speculative-config must be a JSON object of speculative_config fields, got "
                              f"{self.speculative_config!r}")
        if self.dspark_block_size is not None and self.dspark_block_size < 1:
            raise ConfigError(f"--dspark-block-size must be an integer >= 1, got {self.dspark_block_size}")
        if self.moe_routing not in ROUTING_MODELS:
            raise ConfigError(f"--moe-routing {self.moe_routing!r} unknown; allowed: {', '.join(ROUTING_MODELS)}")
        if self.moe_routing != "own" and not (self.random_weights and get_arch(self.arch).target.is_moe):
            raise ConfigError(f"--moe-routing {self.moe_routing} models the routing of a random mixture-of-experts "
                              "target: it needs --random-weights and an MoE --arch ("
                              + ", ".join(name for name, a in ARCHS.items() if a.target.is_moe) + ")")
        if self.moe_routing != "own" and self.synthetic_acceptance is None and self.selected_methods() != ("plain",):
            raise ConfigError(f"--moe-routing {self.moe_routing} routes a verify step's rows unlike decode steps, so "
                              "speculative tokens are not plain decoding's: give --synthetic-acceptance")
        if self.random_weights:
            get_arch(self.arch)
            if self.dflash_model or self.dspark_model:
                raise ConfigError("--random-weights builds its drafters in memory; --dflash-model / --dspark-model "
                                  "need a real --model")
        for m in self.selected_methods():
            if m not in METHODS:
                raise ConfigError(f"method {m!r} unknown; allowed: {', '.join(METHODS)}")
            if not self.random_weights and m != "plain" and getattr(self, f"{m}_model") is None:
                raise ConfigError(f"method {m} needs --{m}-model DIR (or use --random-weights)")
        self._validate_workload()
        if self.synthetic_acceptance is not None:
            profile = AcceptanceProfile(self.synthetic_acceptance)  # parses or raises
            if self.random_weights and profile.is_mean_length:  # a mean length each drafter's block can reach
                arch = get_arch(self.arch)
                blocks = {"dflash": arch.dflash, "dspark": arch.dspark(self.dspark_block_size)}
                for m in set(self.selected_methods()) & set(blocks):
                    profile.rates(blocks[m].num_draft_slots)
            if self.selected_methods() == ("plain",):
                raise ConfigError("--synthetic-acceptance applies to speculative methods (dflash, dspark); "
                                  "none is selected")
        self._validate_k_sweep()
        self._validate_trace()
        bad = sorted(set(self.peers) - set(PEERS))
        if bad:
            raise ConfigError(f"peers {bad} unknown; allowed: {', '.join(PEERS)}")
        if self.prompts in ("builtin", "heldout") and self.random_weights:
            raise ConfigError(f"--prompts {self.prompts} is text and needs the model's tokenizer; with "
                              "--random-weights use random-token prompts (--input-len) or a jsonl with "
                              "prompt_token_ids")
        self._validate_ranks()

    def _validate_workload(self) -> None:
        """The workload's lists and counts, each error naming its flag; options that would change nothing
        (given where they do not apply) are refused, not ignored."""
        for flag, values in (("--batch-sizes", self.batch_sizes), ("--input-len", self.input_len),
                             ("--peer-batch-sizes", self.peer_batch_sizes or (1,))):
            if not values or any(not isinstance(v, int) or isinstance(v, bool) or v < 1 for v in values):
                raise ConfigError(f"{flag} must be integers >= 1, got {values!r}")
        for flag, values in (("--temperatures", self.temperatures), ("--peer-temperatures", self.peer_temperatures)):
            if not values or any(not math.isfinite(t) or t < 0 for t in values):
                raise ConfigError(f"{flag} must be numbers >= 0, got {values!r}")
        for flag, values in (("--batch-sizes", self.batch_sizes), ("--input-len", self.input_len),
                             ("--temperatures", self.temperatures)):
            twice = sorted({v for v in values if values.count(v) > 1})
            if twice:  # a point run twice: its report rows and its plain baseline would be ambiguous
                raise ConfigError(f"{flag} names {', '.join(map(str, twice))} more than once")
        for flag, value, least in (("--output-len", self.output_len, 2), ("--repeats", self.repeats, 1),
                                   ("--waves", self.waves, 1), ("--peer-output-len", self.peer_output_len, 1)):
            if value is not None and value < least:
                raise ConfigError(f"{flag} must be >= {least}, got {value}")
        peer_flags = [flag for flag, given in (
            ("--peer-assistant", self.peer_assistant is not None), ("--peer-batch-sizes", self.peer_batch_sizes),
            ("--peer-output-len", self.peer_output_len is not None),
            ("--peer-temperatures", self.peer_temperatures != (0.0,))) if given]
        if peer_flags and not self.peers:
            raise ConfigError(f"{', '.join(peer_flags)} set(s) the peers' runs: give --peers too")
        if "input_len" in self._given and self.prompts is not None:
            raise ConfigError("--input-len sets the length of random-token prompts; --prompts (and --preset default) "
                              "bring their own")
        if self.dspark_block_size is not None and not self.random_weights:
            raise ConfigError("--dspark-block-size shapes the random DSpark drafter of --random-weights; a real "
                              "drafter's block is its own")

    def _validate_k_sweep(self) -> None:
        """The fixed-K sweep compares speculative runs at fixed draft lengths with the adaptive policy: it
        needs a speculative method and the policy on (a K above a drafter's block is clipped when it is built)."""
        if not self.k_sweep:
            return
        if any(not isinstance(k, int) or isinstance(k, bool) or k < 1 for k in self.k_sweep):
            raise ConfigError(f"--k-sweep takes draft lengths K >= 1, got {self.k_sweep!r}")
        if self.selected_methods() == ("plain",):
            raise ConfigError("--k-sweep runs speculative methods (dflash, dspark) at fixed draft lengths; none is "
                              "selected")
        if self.speculative_config.get("adaptive_draft_length") is False:
            raise ConfigError("--k-sweep checks the adaptive draft-length policy against fixed draft lengths: leave "
                              "adaptive_draft_length on")

    def _validate_trace(self) -> None:
        if self.trace_policy and self.selected_methods() == ("plain",):
            raise ConfigError("--trace-policy records the draft-length policy of speculative methods (dflash, "
                              "dspark); none is selected")

    def _validate_ranks(self) -> None:
        """The tensor-parallel options: shapes that split, no more ranks than GPUs, no peers
        (transformers runs the whole target in one process), checked before any rank process starts."""
        from blockspec.parallel.tp import check_ranks, target_for_ranks

        n = self.tensor_parallel_size
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ConfigError(f"--tensor-parallel-size must be an integer >= 1, got {n!r}")
        if self.compare_tp1 and n == 1:
            raise ConfigError("--compare-tp1 compares a tensor-parallel run with TP = 1: give "
                              "--tensor-parallel-size N > 1")
        if n == 1:
            return
        if self.peers:
            raise ConfigError(f"--peers run the whole target in this process: leave them out with "
                              f"--tensor-parallel-size {n}")
        if self.random_weights:
            check_ranks(get_arch(self.arch).target, n, self.device)
        else:
            target_for_ranks(self.model, n, self.device)

    def selected_methods(self) -> tuple[str, ...]:
        if self.methods is not None:
            return tuple(sorted(set(self.methods), key=lambda m: METHODS.index(m) if m in METHODS else 99))
        have = [m for m in ("dflash", "dspark") if self.random_weights or getattr(self, f"{m}_model")]
        return ("plain", *have)

    @property
    def synthetic(self) -> bool:
        return self.synthetic_acceptance is not None

    @property
    def prompt_count(self) -> int:
        """Prompts a point needs: batch x waves for the engines, and each peer batch's."""
        return max(max(self.batch_sizes) * self.waves, *(self.peer_batch_sizes or (1,)))


@dataclass(frozen=True)
class Rank:
    """This process's place among tensor-parallel ranks: it holds shard `rank` of `world_size` of the
    target, and its engines take the KV pages the fewest any rank allows and rank 0's draft-length
    decisions, agreed over `control` (the ranks' gloo group for host values; None: the default group)."""

    rank: int
    world_size: int
    control: Any = None


@dataclass
class Setup:
    """The loaded target, the prompts by length (None: from a file or set), the positions the longest
    request needs, and how to build each drafter (only when its runs start)."""

    target: CausalLM
    device: torch.device
    eos_ids: list[int]
    prompts: dict[int | None, list[list[int]]]
    max_len: int
    hf_dir: Path | None
    make_drafter: Callable[[str], Any]
    drafter_source: dict[str, str]
    description: dict[str, Any]


# ---------------------------------------------------------------------------------------------- setup
def _tokenize(text: str, tokenizer: Any, chat: bool) -> list[int]:
    if chat and getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True)
        return list(ids if isinstance(ids, list) else ids["input_ids"])
    return tokenizer.encode(text)


def load_prompts(cfg: BenchConfig, tokenizer: Any, vocab_size: int, count: int) -> dict[int | None, list[list[int]]]:
    """`count` prompts as token ids: random tokens (seeded) of each input length, keyed by it; or, under
    None, from a jsonl file or a built-in set."""
    if cfg.prompts is None:
        g = torch.Generator().manual_seed(cfg.seed)
        return {n: [torch.randint(0, vocab_size, (n,), generator=g).tolist() for _ in range(count)]
                for n in cfg.input_len}
    if cfg.prompts == "builtin":
        items: list[Any] = list(BUILTIN_PROMPTS)
    elif cfg.prompts == "heldout":
        from blockspec.demo import heldout_prompts

        items = heldout_prompts(count)
    else:
        if not Path(cfg.prompts).is_file():
            raise FileNotFoundError(f"--prompts {cfg.prompts}: no such file (a jsonl, a text file, 'builtin' or "
                                    "'heldout')")
        items = read_prompts_file(cfg.prompts, "--prompts")
    out = []
    for i, item in enumerate(items):
        if isinstance(item, dict):
            ids = item["prompt_token_ids"]
            if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
                raise ConfigError(f"--prompts {cfg.prompts}: prompt {i}'s prompt_token_ids must be a list of ints")
            out.append(ids)
        else:
            if tokenizer is None:
                raise ConfigError(f"prompt {i} is text but the model has no tokenizer; give prompt_token_ids")
            out.append(_tokenize(item, tokenizer, cfg.chat_template))
    if not out:
        raise ConfigError(f"{cfg.prompts}: no prompts")
    return {None: [out[i % len(out)] for i in range(count)]}


def check_positions(max_len: int, positions: Any, model: str) -> None:
    """A request may not run past the positions the target was trained on (`context_len`'s margin aside)."""
    if isinstance(positions, int) and max_len - 8 > positions:
        raise ConfigError(f"the prompts and --output-len need {max_len - 8} positions; {model} has {positions} "
                          "(max_position_embeddings)")


def context_len(prompts: list[list[int]], output_len: int) -> int:
    """Positions a request of `prompts` needs at most: the longest prompt, the output and a margin."""
    return max(map(len, prompts)) + output_len + 8


def _describe(dcfg: Any, heads: Any) -> str:
    text = f"block {dcfg.block_size}, {dcfg.num_layers} layers, taps {list(dcfg.target_layer_ids)}"
    return text + (f", Markov rank {heads.markov_rank} + confidence head" if heads is not None else "")


def _quantized(cfg: BenchConfig, target: Any = None) -> str:
    """What the report's dtype adds for FP8 weights (the target's, the drafters') and an FP8 KV cache."""
    weights = ", fp8 weights" if cfg.quantization or (target is not None and is_quantized(target)) else ""
    drafters = ", fp8 drafters" if cfg.speculative_config.get("quantization") else ""
    return weights + drafters + (", fp8 KV cache" if cfg.kv_cache_dtype != "auto" else "")


def prepare(cfg: BenchConfig, device: torch.device, rank: Rank | None = None) -> Setup:
    """Build (random weights) or load (checkpoints) the target, the prompts, and the drafter factories;
    a tensor-parallel rank keeps its shard of the target (the drafters stay whole)."""
    return (_prepare_random if cfg.random_weights else _prepare_checkpoints)(cfg, device, rank)


def _prepare_random(cfg: BenchConfig, device: torch.device, rank: Rank | None) -> Setup:
    from blockspec.models.loader import resolve_dtype
    from blockspec.parallel.tp import shard_model

    arch = get_arch(cfg.arch)
    dtype = resolve_dtype(cfg.dtype, "bfloat16", device)
    prompts = load_prompts(cfg, None, arch.target.vocab_size, cfg.prompt_count)
    max_len = context_len([p for group in prompts.values() for p in group], cfg.output_len)
    check_positions(max_len, arch.target.max_position_embeddings, f"--arch {cfg.arch}")
    if device.type == "cpu":  # the host's memory is the limit: refused by name, not killed without a word
        need, free, name = weight_bytes(arch.target, dtype), available_memory(), str(dtype).removeprefix("torch.")
        if free is not None and need > 0.8 * free:
            raise ConfigError(f"--arch {cfg.arch}: its random {name} weights take {need / 2**30:.1f} GiB, more than "
                              f"this host's {free / 2**30:.1f} GiB available can hold beside the run; on the CPU use "
                              "a small --arch (tiny), or a GPU")
    target = random_target(arch.target, max_len + 64, device, dtype, arch.init_std, cfg.seed)
    if rank is not None:  # every rank builds the same seeded weights and keeps its slices
        shard_model(target, rank.rank, rank.world_size)
    if cfg.quantization:
        quantize_model(target, cfg.quantization)  # on the device, layer by layer
    set_routing(target, cfg.moe_routing)
    shapes = {"dflash": (arch.dflash, None, 1), "dspark": (arch.dspark(cfg.dspark_block_size), arch.dspark_heads, 2)}

    def make_drafter(method: str) -> Any:
        dcfg, heads, seed = shapes[method]
        return random_drafter(dcfg, device, dtype, arch.init_std, cfg.seed + seed, heads)

    source = f"random weights, {arch.name} shape" + (f", {cfg.moe_routing} routing" if arch.target.is_moe else "")
    drafters = {m: f"{source}: {_describe(*shapes[m][:2])}" for m in cfg.selected_methods() if m != "plain"}
    return Setup(target, device, list(arch.target.eos_token_ids), prompts, max_len, None, make_drafter,
                 {m: f"random-{arch.name}-{m}" for m in shapes},
                 {"target": source, "dtype": str(dtype).replace("torch.", "") + _quantized(cfg), "drafters": drafters})


def _prepare_checkpoints(cfg: BenchConfig, device: torch.device, rank: Rank | None) -> Setup:
    from blockspec.engine.build import generation_eos_ids, load_tokenizer
    from blockspec.models.loader import load_target, read_json, resolve_model_dir
    from blockspec.drafters import load_drafter
    from blockspec.parallel.tp import shard_loader

    model_dir = resolve_model_dir(cfg.model)
    tokenizer = load_tokenizer(model_dir)
    raw = read_json(model_dir / "config.json")
    vocab = int(raw["vocab_size"])
    prompts = load_prompts(cfg, tokenizer, vocab, cfg.prompt_count)
    max_len = context_len([p for group in prompts.values() for p in group], cfg.output_len)
    check_positions(max_len, raw.get("max_position_embeddings"), cfg.model)
    load = load_target if rank is None else shard_loader(rank.rank, rank.world_size)
    target, model_dir = load(model_dir, cfg.dtype, device, max_len + 64, cfg.quantization)
    weight = target.embed_tokens.weight
    sources = {m: getattr(cfg, f"{m}_model") for m in ("dflash", "dspark") if getattr(cfg, f"{m}_model")}

    def load(method: str) -> Any:
        return load_drafter(method, sources[method], weight.device, weight.dtype)

    return Setup(target, device, generation_eos_ids(model_dir, target.config.eos_token_ids, tokenizer), prompts,
                 max_len, model_dir, load, sources,
                 {"target": str(cfg.model), "dtype": str(weight.dtype).replace("torch.", "") + _quantized(cfg, target),
                  "drafters": sources})


def _spec(cfg: BenchConfig, setup: Setup, method: str, fixed_k: int | None) -> tuple[SpeculativeConfig | None, Any]:
    """A method's speculative config (None for plain) and proposer class (None: the engine's own); with
    `fixed_k` it verifies K drafts at every step (the draft-length policy off)."""
    if method == "plain":
        return None, None
    values = {"method": method, "model": setup.drafter_source[method], **cfg.speculative_config}
    if cfg.num_speculative_tokens is not None:
        values["num_speculative_tokens"] = cfg.num_speculative_tokens
    if fixed_k is not None:  # no choice to make: the policy's draft lengths (which may exceed K) do not apply
        values.update(num_speculative_tokens=fixed_k, adaptive_draft_length=False, draft_length_candidates=None)
    proposer = partial(SyntheticProposer, profile=AcceptanceProfile(cfg.synthetic_acceptance),
                       seed=cfg.synthetic_seed) if cfg.synthetic else None
    return SpeculativeConfig.from_user(values), proposer


def _engine_config(cfg: BenchConfig, batch: int, max_len: int, num_kv_pages: int | None = None) -> EngineConfig:
    return EngineConfig(max_model_len=max_len, max_num_seqs=batch, max_prefill_tokens=cfg.max_prefill_tokens,
                        seed=cfg.seed, attention_backend=cfg.attention_backend, kv_cache_dtype=cfg.kv_cache_dtype,
                        num_kv_pages=num_kv_pages)


def point_pages(cfg: BenchConfig, setup: Setup, keys: list[tuple[str, int | None]], drafters: dict[str, Any],
                batch: int, max_len: int) -> int:
    """KV pages every engine of a point gets: the most any of them needs for `batch` requests of `max_len`
    positions (speculative ones reach past it by their drafts), so their caches have one shape and share
    one `SharedKVStore`."""
    base = _engine_config(cfg, batch, max_len)
    return max(batch * PageTable.columns_for(cache_extent(base, _spec(cfg, setup, m, k)[0], drafters.get(m))[1],
                                             base.kv_page_size) for m, k in keys)


def check_point_memory(cfg: BenchConfig, setup: Setup, drafters: dict[str, Any], pages: int, what: str) -> None:
    """Refuses, with the numbers, a point whose shared KV store cannot fit in the GPU's free memory (the
    store's pools: the target's, and the largest drafter's), before any engine allocates."""
    if setup.device.type != "cuda":
        return
    kv = kv_storage_dtype(cfg.kv_cache_dtype, setup.target.embed_tokens.weight.dtype)
    size = EngineConfig.kv_page_size
    per_page = setup.target.page_bytes(size, kv) + max((d.page_bytes(size, kv) for d in drafters.values()), default=0)
    need, free = (pages + 1) * per_page, torch.cuda.mem_get_info(setup.device)[0]
    if need > 0.9 * free:
        raise ConfigError(f"{what}: the KV caches need {need / 1e9:.1f} GB ({pages} pages of {per_page / 1e6:.2f} MB) "
                          f"and {free / 1e9:.1f} GB of the GPU is free; take a smaller --batch-sizes or --input-len, "
                          "or --kv-cache-dtype fp8")


def build_engine(cfg: BenchConfig, setup: Setup, method: str, drafter: Any, batch: int,
                 rank: Rank | None = None, *, max_len: int | None = None, fixed_k: int | None = None,
                 num_kv_pages: int | None = None) -> Engine:
    """One method's engine at one batch size for requests of `max_len` positions (None: the longest any
    point needs), warmed up; `fixed_k` and `num_kv_pages` as in `_spec` and EngineConfig. On a
    tensor-parallel rank its KV pages and draft-length decisions are the ones every rank takes."""
    from blockspec.engine.build import agree_on_draft_length, agreed_pages
    from blockspec.parallel.tp import fewest, rank0_decides

    spec, proposer = _spec(cfg, setup, method, fixed_k)
    engine_cfg = _engine_config(cfg, batch, max_len or setup.max_len, num_kv_pages)
    if rank is not None:
        engine_cfg = agreed_pages(engine_cfg, setup.target, drafter, spec, partial(fewest, group=rank.control))
    engine = Engine(setup.target, None, engine_cfg, spec, drafter, setup.eos_ids, proposer_cls=proposer)
    if rank is not None:
        agree_on_draft_length(engine, rank0_decides(rank.control))
    engine.warmup()  # graph captures and compilation before anything is timed, as a server does at start-up
    engine.spec_totals = StepLog()  # the same counters, plus what each step drafted
    return engine


# ---------------------------------------------------------------------------------------------- measure
@dataclass
class Pass:
    """One timed pass over a point's requests."""

    wall_s: float
    tokens: int
    decode_s: float
    decode_tokens: int
    step_s: dict[int, list[float]]  # decode step times by the step's draft length (0: plain step)
    step_rows: dict[int, list[int]]  # the requests each of those steps decoded, in the same order
    drafts: list[tuple[int, int]]  # (drafts, accepted) per request per speculative step
    ttft_s: list[float]
    tpot_s: list[float]
    outputs: list[list[int]]
    preemptions: int = 0  # requests the engine preempted (its KV pool ran short): their prefill ran again
    # times of the steps that admitted or prefilled (any decode they ran beside included): a speculative
    # engine's requests finish, and are replaced, one at a time, so it meets an arrival every few steps
    prefill_s: list[float] = field(default_factory=list)


_ids = itertools.count()


def drive(engine: Engine, prompts: list[list[int]], params: list[SamplingParams]) -> Pass:
    """Submit all requests at once and step the engine to completion, timing each step.

    Steps that admit or prefill are excluded from the decode figures (TPOT, decode tok/s, step time);
    the wall time covers everything from submission to the last token. A step is timed as its
    `step()` call, which ends once the tokens it commits are read back: the device is not synced
    between steps, since the engine launches the next step before it commits this one, as it does
    serving (a sync there would idle the GPU for every step's host work and price it in). A call that
    commits nothing (a pipelined plain step's first launch) is priced in the next call that commits,
    so the per-draft-length step times are each step's launch-to-commit cost, not a launch alone.
    """
    dev = engine.device
    log: StepLog = engine.spec_totals
    preempted = engine.num_preemptions
    synchronize(dev)
    t0 = time.perf_counter()
    reqs = [engine.add_request(f"bench-{next(_ids)}", None, p, sp)[0] for p, sp in zip(prompts, params)]
    decode_s, decode_tokens, launched_s = 0.0, 0, 0.0
    step_s: dict[int, list[float]] = {}
    step_rows: dict[int, list[int]] = {}
    drafts: list[tuple[int, int]] = []
    prefill_s: list[float] = []
    while engine.has_unfinished():
        prefill = bool(engine.waiting and engine.pages.num_free_slots) or any(
            r.num_cached < r.prefill_len for r in engine.running)
        n0, rows, ts = engine.num_generated, len(engine.running), time.perf_counter()
        engine.step()
        dt = time.perf_counter() - ts
        step = log.drain()
        drafts += step  # acceptance counts every verified draft, in a prefill step too (as the engine's stats)
        if prefill:
            launched_s = 0.0  # what a launch-only call started, a prefill step commits
            prefill_s.append(dt)
            continue
        decode_s += dt
        decode_tokens += engine.num_generated - n0
        launched_s += dt
        if engine.num_generated > n0 or step:
            k = max((n for n, _ in step), default=0)
            step_s.setdefault(k, []).append(launched_s)
            step_rows.setdefault(k, []).append(rows)
            launched_s = 0.0
    synchronize(dev)  # a step launched ahead for requests that then stopped is still the pass's work
    wall = time.perf_counter() - t0
    failed = [r.error for r in reqs if r.error]
    if failed:
        raise RuntimeError(f"bench: {len(failed)} request(s) failed: {failed[0]}")
    return Pass(wall, sum(len(r.output_ids) for r in reqs), decode_s, decode_tokens, step_s, step_rows, drafts,
                [r.first_token_time - r.arrival_time for r in reqs],
                [(r.finish_time - r.first_token_time) / (len(r.output_ids) - 1) for r in reqs if len(r.output_ids) > 1],
                [list(r.output_ids) for r in reqs], engine.num_preemptions - preempted, prefill_s)


def measure_point(engines: dict[Hashable, Engine], prompts: list[list[int]], params: list[SamplingParams],
                  repeats: int, held: dict[Hashable, float], trace: bool = False
                  ) -> dict[Hashable, tuple[dict[str, Any], list[list[int]]]]:
    """Each engine's warm-up pass, then `repeats` rounds of one timed pass per engine (a method, or a
    method at a fixed draft length), interleaved, the order rotated each round (see the module docstring).
    `held`: GB each engine holds besides its passes (weights, KV caches). Returns each engine's run record,
    with its per-round figures under "rounds", and the output tokens of its last pass; with `trace`, a
    speculative engine's record holds what its draft-length policy saw and chose in the timed passes
    under "policy_trace" (`DraftLengthPolicy.trace`), and over its warm-up pass under "policy_trace_warmup"."""
    device = next(iter(engines.values())).device
    warmup_traces = {}
    for key, engine in engines.items():
        traced = trace and engine.proposer is not None
        if traced:
            engine.policy.trace = []
        drive(engine, prompts, params)  # CUDA graphs captured, kernels compiled, the draft policy primed
        if traced:
            warmup_traces[key], engine.policy.trace = engine.policy.trace, []
    before = {key: dict(e.timer.totals) for key, e in engines.items()}
    passes: dict[Hashable, list[Pass]] = {key: [] for key in engines}
    transient = dict.fromkeys(engines, 0)
    order = list(engines)
    with collector_frozen():  # every engine's objects out of the collector's walks: a pass pays for its own
        for r in range(repeats):
            for key in order[r % len(order):] + order[: r % len(order)]:
                reset_peak_memory(device)
                start = allocated_bytes(device)
                passes[key].append(drive(engines[key], prompts, params))
                transient[key] = max(transient[key], peak_allocated_bytes(device) - start)
    out = {}
    for key, engine in engines.items():
        run = summarize(engine, passes[key], prompts, before[key])
        run["memory_gb_total"] = held[key] + transient[key] / 1e9
        if trace and engine.proposer is not None:
            run["policy_trace"], engine.policy.trace = engine.policy.trace, None
            run["policy_trace_warmup"] = warmup_traces[key]
        out[key] = (run, passes[key][-1].outputs)
    return out


def summarize(engine: Engine, passes: list[Pass], prompts: list[list[int]], before: dict[str, float]
              ) -> dict[str, Any]:
    """One method's run record from its timed passes; `before`: the engine's time split before them."""
    ttft = [t for p in passes for t in p.ttft_s]
    tpot = [t for p in passes for t in p.tpot_s]
    step_s: dict[int, list[float]] = {}
    step_rows: dict[int, list[int]] = {}
    for p in passes:
        for k, times in p.step_s.items():
            step_s.setdefault(k, []).extend(times)
            step_rows.setdefault(k, []).extend(p.step_rows[k])
    rounds = {"output_tok_s": [p.tokens / p.wall_s for p in passes],
              "decode_tok_s": [p.decode_tokens / p.decode_s if p.decode_s > 0 else 0.0 for p in passes]}
    run: dict[str, Any] = {
        "status": "ok",
        "num_requests": len(prompts),
        "prompt_tokens_mean": sum(map(len, prompts)) / len(prompts),
        "output_tok_s": spread(rounds["output_tok_s"]),
        "decode_tok_s": spread(rounds["decode_tok_s"]),
        "rounds": rounds,
        "step_ms": spread([1e3 * p.decode_s / sum(map(len, p.step_s.values())) for p in passes if p.step_s]
                          or [0.0]),
        "steps_by_draft_length": {str(k): {"steps": len(v), "ms_median": 1e3 * spread(v)["median"],
                                           "requests_mean": sum(step_rows[k]) / len(v)}
                                  for k, v in sorted(step_s.items())},
        "tpot_ms": {"p50": 1e3 * float(np.percentile(tpot, 50)), "p90": 1e3 * float(np.percentile(tpot, 90))}
        if tpot else None,
        "ttft_ms": {"p50": 1e3 * float(np.percentile(ttft, 50)), "p90": 1e3 * float(np.percentile(ttft, 90))},
        "prefill_steps": {"steps": sum(len(p.prefill_s) for p in passes) / len(passes),
                          "ms_median": 1e3 * spread([t for p in passes for t in p.prefill_s] or [0.0])["median"],
                          "share": spread([sum(p.prefill_s) / p.wall_s for p in passes])["median"]},
        "preemptions": sum(p.preemptions for p in passes),
        "time_split_s_per_pass": {k[:-2]: (v - before.get(k, 0.0)) / len(passes)
                                  for k, v in engine.timer.totals.items()},
    }
    if engine.proposer is not None:
        drafts = [x for p in passes for x in p.drafts]
        run["acceptance"] = acceptance(drafts, engine.proposer.num_speculative_tokens)
        if engine.policy.adaptive:
            run["policy_view"] = policy_record(engine.policy.view())
        if isinstance(engine.proposer, SyntheticProposer):
            prop = engine.proposer
            run["acceptance"]["synthetic_rates"] = prop.rates
            # the profile's expectation for the draft lengths the engine actually chose
            run["acceptance"]["expected_length"] = sum(prop.expected_length(d) for d, _ in drafts) / len(drafts) \
                if drafts else None
    return run


def prefix_match(a: list[list[int]], b: list[list[int]]) -> float:
    """Mean fraction of each output that agrees token for token before the first difference."""
    fracs = []
    for x, y in zip(a, b):
        n = next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), min(len(x), len(y)))
        fracs.append(n / max(len(x), len(y), 1))
    return sum(fracs) / len(fracs)


def _memory(engine: Engine, drafter: Any) -> dict[str, float]:
    """GB a run holds, counted from its objects: the target's weights and KV cache, the drafter's and
    the target taps it holds for its next draft, on the CPU the LM heads' packed copies
    (`cpu_linear.PackedProduct`), and on a GPU what each kind of graph added to the graphs' shared memory
    pool (`Engine.graph_bytes`: "graphs_target", "graphs_draft", "graphs_step"; the intermediates and
    outputs the captures made, not the static input buffers, which sit in the allocator's common pool)."""
    out = {"target_weights": param_bytes(engine.model) / 1e9, "target_kv": engine.runner.cache.bytes / 1e9}
    if engine.proposer is not None:
        out["drafter_weights"] = param_bytes(drafter) / 1e9
        out["draft_kv"] = engine.context.cache.bytes / 1e9
        pending = engine.context.pending
        out["draft_pending"] = pending.numel() * pending.element_size() / 1e9
    products = [engine.model.head_product] + ([drafter.head_product] if engine.proposer is not None else [])
    copies = sum(p.nbytes for p in products if isinstance(p, PackedProduct))
    if copies:
        out["head_copies"] = copies / 1e9
    out.update({f"graphs_{kind}": n / 1e9 for kind, n in engine.graph_bytes.items()})
    return out


# ---------------------------------------------------------------------------------------------- run
def source_digest(root: Path | None = None) -> str:
    """The first 12 hex digits of a sha256 over the Python sources under `root` (the blockspec package by
    default; paths and bytes): which code ran, where git's metadata is missing or older than the files (a
    tree copied to another machine)."""
    root = root or Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:12]


def source_commit(package: Path = Path(__file__).resolve().parents[1]) -> str | None:
    """The commit of the blockspec checkout `package` (this code's) is in (`git describe --dirty`), or None: an
    install (a package inside some other repository, say a project's ignored .venv, is not that repository's code)."""

    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", *args], check=False, cwd=package, capture_output=True, text=True, timeout=5)
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout.strip() or None if out.returncode == 0 else None

    top = git("rev-parse", "--show-toplevel")
    if top is None or Path(top).resolve() != package.parent:
        return None
    return git("describe", "--always", "--dirty")


def _environment(cfg: BenchConfig, device: torch.device) -> dict[str, Any]:
    import transformers

    cpu = platform.processor() or platform.machine()
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({cpu})",
        "device_type": device.type,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "git_commit": source_commit(),
        "source_digest": source_digest(),
        "command": cfg.command or " ".join(sys.argv),
    }


def run_bench(cfg: BenchConfig, log: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """Run the whole sweep and return the report (JSON-serialisable); `log` receives one line per point.

    With tensor_parallel_size N > 1 the sweep runs on N rank processes in lockstep, rank 0 timing it;
    with compare_tp1, TP = 1 runs in this process first and the report compares the two per run."""
    from blockspec.models.loader import resolve_device

    cfg.apply_preset()
    cfg.validate()
    device = resolve_device(cfg.device)
    if cfg.tensor_parallel_size == 1:
        return measure_sweep(cfg, device, log)[0]
    one = None
    if cfg.compare_tp1:
        log("TP=1, in this process:")
        one = measure_sweep(dataclasses.replace(cfg, tensor_parallel_size=1, compare_tp1=False), device, log)
        free_memory(device)  # its weights and caches are gone; the ranks' rank 0 shares this GPU
    log(f"TP={cfg.tensor_parallel_size}, on {cfg.tensor_parallel_size} rank processes:")
    result, outputs = _on_ranks(cfg, log)
    if one is not None:
        matches = {key: prefix_match(outputs[key], one[1][key]) for key in outputs if key in one[1]}
        result["compare_tp1"] = compare_tp(result, one[0], matches)
    return result


def measure_sweep(cfg: BenchConfig, device: torch.device, log: Callable[[str], None], rank: Rank | None = None
                  ) -> tuple[dict[str, Any], dict[RunKey, list[list[int]]]]:
    """This process's sweep (a tensor-parallel rank's with `rank`): the report, and the output tokens of
    each method's last pass at each point. A point's engines (with `k_sweep`, the fixed-K ones too) are
    built for its prompts and timed together."""
    result: dict[str, Any] = {"benchmark": "blockspec bench", "synthetic": cfg.synthetic,
                              "synthetic_acceptance": None, **_environment(cfg, device),
                              "config": {k: v for k, v in dataclasses.asdict(cfg).items() if k != "_given"},
                              "tensor_parallel_size": rank.world_size if rank is not None else 1}
    if cfg.synthetic:
        result["synthetic_acceptance"] = {"profile": cfg.synthetic_acceptance, "seed": cfg.synthetic_seed,
                                          "note": SYNTHETIC_NOTE}
    bandwidth = copy_bandwidth() if device.type == "cuda" else None  # before the models: needs 4 GB free
    setup = prepare(cfg, device, rank)
    products, per_key = row_flops(setup.target)
    kv, page = kv_storage_dtype(cfg.kv_cache_dtype, setup.target.embed_tokens.weight.dtype), EngineConfig.kv_page_size
    model = dict(setup.description, target_gb=param_bytes(setup.target) / 1e9,
                 weight_bytes_per_step_gb=step_bytes(setup.target) / 1e9, row_gflops=products / 1e9,
                 attention_flops_per_key=per_key, kv_bytes_per_token=setup.target.page_bytes(page, kv) / page)
    result["model"] = model
    result["floor"] = "n/a (GPU only)"
    if bandwidth:
        floor_s = step_bytes(setup.target) / bandwidth
        result["floor"] = {"copy_bandwidth_TBps": bandwidth / 1e12, "step_ms_batch1": 1e3 * floor_s,
                           "tok_s_batch1": 1 / floor_s,
                           "matmul_TFLOPs": matmul_rate(setup.target.embed_tokens.weight.dtype) / 1e12}
    methods = cfg.selected_methods()
    drafters = {m: setup.make_drafter(m) for m in methods if m != "plain"}
    # what a drafter's step reads and computes (the step floors'), beside its description under "drafters"
    model["drafter_terms"] = {m: dict(draft_step_terms(d, setup.target),
                                      kv_bytes_per_token=d.page_bytes(page, kv) / page) for m, d in drafters.items()}
    capacities = {m: d.num_draft_slots for m, d in drafters.items()} if cfg.k_sweep else {}
    for method, capacity in capacities.items():
        if note := clip_note(method, cfg.k_sweep, capacity):
            log(note)
    # an engine per method (k None: its draft-length policy), and per method and fixed K of the sweep
    keys = [(m, None) for m in methods] + [(m, k) for m, c in capacities.items() for k in clip(cfg.k_sweep, c)]
    runs: list[dict[str, Any]] = []
    sweep: list[dict[str, Any]] = []
    traces: list[dict[str, Any]] = []
    plain_outputs: dict[Point, list[list[int]]] = {}
    last_outputs: dict[RunKey, list[list[int]]] = {}
    for input_len, prompts in setup.prompts.items():
        for batch in cfg.batch_sizes:
            n = batch * cfg.waves
            max_len = context_len(prompts[:n], cfg.output_len)
            # the point's engines take turns, so their KV caches share one store of one shape
            pages = point_pages(cfg, setup, keys, drafters, batch, max_len)
            check_point_memory(cfg, setup, drafters, pages, f"{'in' + str(input_len) + ' ' if input_len else ''}b{batch}")
            store, engines = SharedKVStore(), {}
            for m, k in keys:
                with store.engine():
                    engines[(m, k)] = build_engine(cfg, setup, m, drafters.get(m), batch, rank, max_len=max_len,
                                                   fixed_k=k, num_kv_pages=pages)
            memory = {key: _memory(engine, drafters.get(key[0])) for key, engine in engines.items()}
            held = {key: sum(parts.values()) for key, parts in memory.items()}
            for temp in cfg.temperatures:
                params = [SamplingParams(temperature=temp, top_p=1.0, top_k=0, max_tokens=cfg.output_len,
                                         ignore_eos=True, seed=cfg.seed + i) for i in range(n)]
                measured = measure_point(engines, prompts[:n], params, cfg.repeats, held, cfg.trace_policy)
                at = (input_len, batch, temp)
                policy: dict[str, dict[str, Any]] = {}
                fixed: dict[str, list[dict[str, Any]]] = {}
                for (method, k), (run, outputs) in measured.items():
                    if "policy_trace" in run:
                        traces.append({"method": method, "fixed_k": k, "input_len": input_len, "batch": batch,
                                       "temperature": temp, "events": run.pop("policy_trace"),
                                       "warmup_events": run.pop("policy_trace_warmup")})
                    run = {"method": method, "input_len": input_len, "batch": batch, "temperature": temp,
                           "synthetic": cfg.synthetic and method != "plain", "output_len": cfg.output_len, **run,
                           "memory_gb": memory[(method, k)]}
                    if k is not None:
                        fixed.setdefault(method, []).append({**run, "fixed_k": k})
                        continue
                    last_outputs[(method, *at)] = outputs
                    if method == "plain":
                        plain_outputs[at] = outputs
                    elif at in plain_outputs and not run["synthetic"]:
                        run["prefix_match_plain"] = prefix_match(outputs, plain_outputs[at])
                    policy[method] = run
                    runs.append(run)
                    log(summary_line(run))
                for method, group in fixed.items():
                    sweep.append(sweep_point(policy[method], group))
                    log(sweep_line(sweep[-1]))
            del engines, store  # the next point's memory check must see this one's caches freed
            free_memory(device)
    del drafters
    free_memory(device)
    if cfg.peers:
        runs += run_peers(cfg, setup, plain_outputs, log)
    compare_to_plain(runs)
    add_step_floors(runs, result["model"], result["floor"])
    result["runs"] = runs
    result["checks"] = checks(result)
    if capacities:
        result["k_sweep"] = sweep_report(cfg.k_sweep, capacities, sweep)
    if cfg.trace_policy:
        result["policy_traces"] = traces
    return result, last_outputs


def _on_ranks(cfg: BenchConfig, log: Callable[[str], None]
              ) -> tuple[dict[str, Any], dict[RunKey, list[list[int]]]]:
    """The sweep on `cfg.tensor_parallel_size` spawned ranks: rank 0's report, with every rank's step
    figures, and its output tokens; rank 0's log lines come through here as they are written."""
    from blockspec.parallel.tp import RankProcesses

    n = cfg.tensor_parallel_size
    ranks = RankProcesses(_sweep_rank, n, (cfg, max(1, torch.get_num_threads() // n)))
    try:
        while (message := ranks.receive())[0] == "log":
            log(message[1])
    finally:
        ranks.close()
    status, value = message
    if status == "err":
        raise value
    return value


def _sweep_rank(rank: int, world_size: int, init_file: str, conn: Connection | None, cfg: BenchConfig,
                num_threads: int) -> None:
    """One rank of a tensor-parallel sweep: its shard of the same target (seeded or loaded), the same
    engines and passes as every other rank, in lockstep (the model's collectives keep them there). Rank 0
    sends its log lines, then its report with every rank's step figures, or the error."""
    import torch.distributed as dist

    from blockspec.models.loader import resolve_device
    from blockspec.parallel.tp import join_group, portable

    torch.set_num_threads(num_threads)
    device, control = join_group(rank, world_size, init_file, cfg.device)
    send = conn.send if conn is not None else lambda message: None
    try:
        result, outputs = measure_sweep(cfg, resolve_device(device), lambda line: send(("log", line)),
                                        Rank(rank, world_size, control))
        figures: list[Any] | None = [None] * world_size if rank == 0 else None
        dist.gather_object(rank_figures(result["runs"]), figures, dst=0, group=control)
        if figures is not None:
            add_rank_figures(result["runs"], figures)
        send(("ok", (result, outputs)))
    except Exception as exc:  # noqa: BLE001  rank 0 reports it; another rank's traceback goes to stderr
        send(("err", portable(exc)))
        if rank:
            raise
    finally:
        dist.destroy_process_group()


def run_peers(cfg: BenchConfig, setup: Setup, plain_outputs: dict[Point, list[list[int]]],
              log: Callable[[str], None]) -> list[dict[str, Any]]:
    """transformers generate (and assisted generation where it applies) on the very same weights."""
    from blockspec.bench.peers import (
        ASSISTED_BATCH_ONE,
        ASSISTED_NEEDS_DRAFT,
        ASSISTED_NEEDS_REAL,
        hf_twin,
        load_assistant,
        measure_generate,
    )

    hf = hf_twin(setup.target, setup.hf_dir)
    weight = setup.target.embed_tokens.weight
    assistant = load_assistant(cfg.peer_assistant, weight.device, weight.dtype, setup.target.config.vocab_size) \
        if cfg.peer_assistant else None
    max_new = cfg.peer_output_len or cfg.output_len
    no_assistant = ASSISTED_NEEDS_REAL if cfg.random_weights else ASSISTED_NEEDS_DRAFT
    runs = []
    for (input_len, group), batch in itertools.product(setup.prompts.items(), cfg.peer_batch_sizes or cfg.batch_sizes):
        prompts = group[:batch]
        for temp in cfg.peer_temperatures:
            for name, helper in (("hf-generate", None), ("hf-assisted", assistant)):
                base = {"method": name, "input_len": input_len, "batch": batch, "temperature": temp,
                        "synthetic": False, "output_len": max_new}
                reason = None
                if name == "hf-assisted":
                    reason = no_assistant if helper is None else ASSISTED_BATCH_ONE if batch > 1 else None
                if reason:
                    run = {**base, "status": "n/a", "reason": reason}
                else:
                    stats, outputs = measure_generate(hf, prompts, temp, max_new, cfg.repeats, cfg.seed, helper)
                    run = {**base, **stats}
                    plain = plain_outputs.get(point(run))
                    if temp == 0 and plain is not None:
                        run["prefix_match_plain"] = prefix_match(outputs, [o[:max_new] for o in plain])
                runs.append(run)
                log(summary_line(run))
            free_memory(setup.device)
    del hf
    return runs


# ---------------------------------------------------------------------------------------------- CLI
BENCH_EXAMPLES = """examples:
  # the embedded default pair (a small code model and its drafters) on held-out stdlib code: real acceptance
  blockspec bench --preset default --batch-sizes 1,4
  # the serving workloads compared with peer engines (Qwen3-8B shapes, random weights, synthetic acceptance 6.5),
  # with the draft-length policy checked against fixed draft lengths
  blockspec bench --preset concurrency --k-sweep 2,4,8,15 --out out/conc
  blockspec bench --preset long-context --k-sweep 2,4,8,15 --out out/long
  # the same workload shape on the CPU, small: a preset's fields give way to the options given
  blockspec bench --preset concurrency --arch tiny --device cpu --batch-sizes 1,4 --output-len 32 --input-len 16
  # real shapes without downloads: Qwen3-8B target + DFlash b16 + DSpark b7 drafters, random bf16 weights
  blockspec bench --random-weights --arch qwen3-8b --batch-sizes 1,4,16,64 --temperatures 0,0.7 \\
      --synthetic-acceptance 6.5 --peers transformers --peer-output-len 32
  # two GPUs: TP = 2 against TP = 1 in one call
  blockspec bench --random-weights --arch qwen3-8b -tp 2 --compare-tp1 --batch-sizes 1,4,16,64 \\
      --temperatures 0,0.7 --synthetic-acceptance 6.5
  # a real target and drafters on a prompt file
  blockspec bench --model Qwen/Qwen3-8B --dflash-model z-lab/Qwen3-8B-DFlash-b16 --prompts prompts.jsonl
  # CPU smoke test
  blockspec bench --random-weights --arch tiny --batch-sizes 1,2 --output-len 32 --input-len 16
"""


def _list(kind: type) -> Callable[[str], tuple[Any, ...]]:
    def parse(text: str) -> tuple[Any, ...]:
        try:
            return tuple(kind(x) for x in text.split(",") if x.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated {kind.__name__}s, got {text!r}") from None

    return parse


def add_bench_parser(sub: Any) -> None:
    """`blockspec bench`: the subcommand and its options (dispatched through args.func)."""
    from blockspec.cli_options import HelpFormatter, json_object

    p = sub.add_parser("bench", help="plain vs DFlash vs DSpark speed (and transformers peers): JSON, markdown, plots",
                       description=__doc__, epilog=BENCH_EXAMPLES, formatter_class=HelpFormatter)
    m = p.add_argument_group("models")
    m.add_argument("--preset", default=None, choices=PRESETS,
                   help="default: the embedded target with its DFlash and DSpark drafters, on openings of held-out "
                        "stdlib functions (real acceptance); replaces --model and the drafter flags. concurrency: "
                        "random weights of --arch, plain,dflash,dspark, 512-token prompts, 1024 output tokens, "
                        "concurrency 1,4,8,16,32,64 with 4 waves, T=0, synthetic acceptance 6.5, 3 rounds. "
                        "long-context: the same with 8192- and 32768-token prompts, 256 output tokens, concurrency "
                        "1,16 (one wave). A workload preset fills only the options not given (e.g. --batch-sizes "
                        "1,4 or --arch tiny win) and refuses --model, the drafter flags and --prompts")
    m.add_argument("--random-weights", action="store_true", help="build random weights of --arch in memory")
    m.add_argument("--arch", default="qwen3-8b", help="random-weights shape: " + " | ".join(ARCHS) + " (default qwen3-8b)")
    m.add_argument("--model", default=None, help="a real target: HF directory, hub id or 'default' (the embedded one)")
    m.add_argument("--dflash-model", default=None, help="DFlash drafter directory, hub id or 'default' (real target)")
    m.add_argument("--dspark-model", default=None, help="DSpark drafter directory, hub id or 'default' (real target)")
    m.add_argument("--dspark-block-size", type=int, default=None, help="random-weights DSpark block (default: arch's)")
    m.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    m.add_argument("--dtype", default="auto", help="auto (bf16 on GPU, fp32 on CPU) | bfloat16 | float16 | float32")
    m.add_argument("--attention-backend", default="auto", choices=["auto", "triton", "sdpa"],
                   help="auto: the Triton kernel on CUDA when triton is installed, else SDPA")
    m.add_argument("--quantization", default=None, choices=["fp8"],
                   help="fp8: the target's decoder weights quantized to FP8 (per-channel scales) at load, random "
                        "weights on the device; drafters stay in --dtype (default: none)")
    m.add_argument("--moe-routing", default="own", choices=list(ROUTING_MODELS),
                   help="random mixture-of-experts targets: own (the random model's routing, whose rows of one "
                        "request mostly share experts: a best case), uniform (each verified row routes "
                        "independently: the worst case) or local (rows correlated within a request) (default: own)")
    m.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3"],
                   help="the KV caches (target's and drafters'): auto (the model's dtype) or fp8 (e4m3)")
    m.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="split the target over N rank processes (one GPU each; gloo ranks on the CPU), run in "
                        "lockstep; rank 0 times, and the report adds each rank's step time and drafter share")
    m.add_argument("--compare-tp1", action="store_true",
                   help="with --tensor-parallel-size N > 1: run TP = 1 in this process first and report TP = N "
                        "against it per method and batch (plain tok/s ratio, speculation's speedup at each TP)")
    w = p.add_argument_group("workload")
    w.add_argument("--methods", type=_list(str), default=None, help="comma list of plain,dflash,dspark "
                   "(default: plain and every drafter available)")
    w.add_argument("--batch-sizes", "--concurrency", dest="batch_sizes", type=_list(int), default=None,
                   help="comma list of concurrent requests per point, e.g. 1,4,16,64 (default 1, or the preset's)")
    w.add_argument("--temperatures", type=_list(float), default=None,
                   help="comma list, e.g. 0,0.7 (default 0, or the preset's)")
    w.add_argument("--prompts", default=None, help="a .jsonl with 'prompt' or 'prompt_token_ids' a line, a text "
                   "file (a prompt a line), 'builtin' (chat "
                   "questions) or 'heldout' (openings of stdlib functions no embedded model saw) (default: "
                   "random-token prompts of --input-len)")
    w.add_argument("--input-len", type=_list(int), default=None,
                   help="random prompt length(s), comma list: each length is its own point, e.g. 8192,32768 "
                        "(default 512, or the preset's)")
    w.add_argument("--output-len", type=int, default=None,
                   help="tokens generated per request, EOS ignored (default 256, or the preset's)")
    w.add_argument("--waves", type=int, default=None,
                   help="requests per point = batch x waves, at most batch in flight, a finished request's slot "
                        "refilled (default 1: a static batch; the concurrency preset's 4)")
    w.add_argument("--repeats", type=int, default=None, help="timed rounds per point after the warm-up, each running "
                   "every method once (default 3, or the preset's)")
    w.add_argument("--no-chat-template", dest="chat_template", action="store_false",
                   help="tokenize text prompts as they are (default: with the tokenizer's chat template)")
    w.add_argument("--max-prefill-tokens", type=int, default=4096, help="prompt tokens one step prefills at most")
    w.add_argument("--seed", type=int, default=0, help="seed of the random prompts, weights and sampling")
    s = p.add_argument_group("speculation")
    s.add_argument("--num-speculative-tokens", type=int, default=None,
                   help="drafts verified per step at most (default: the drafter's draft positions)")
    s.add_argument("--k-sweep", type=_list(int), default=(), metavar="K,K,...",
                   help="comma list of fixed draft lengths, e.g. 2,4,8,15: at every point each speculative method "
                        "also runs at each K (num_speculative_tokens K, adaptive_draft_length off) in the same "
                        "interleaved rounds; the report gives each K's output and decode tok/s, the best K, and "
                        "the policy's decode tok/s over the best K's ('within 5 %%' or 'misses by X %%'); a K above "
                        "a drafter's block runs as the block's size (default: no sweep)")
    s.add_argument("--trace-policy", action="store_true",
                   help="record what each speculative engine's draft-length policy saw and chose over the timed "
                        "passes (every step time with its batch and K, every acceptance, every choice), and apart "
                        "over the warm-up pass they start from, in policy_trace.json beside bench.json")
    s.add_argument("--speculative-config", type=json_object, default={},
                   help="extra speculative_config fields as JSON, e.g. '{\"max_batch_for_speculation\": 16}'")
    s.add_argument("--synthetic-acceptance", default=None, metavar="PROFILE",
                   help="benchmark-only: accepted counts drawn from per-position rates ('0.9,0.85,0.8') or a "
                        "mean acceptance length of the drafter's whole block ('6.5', geometric; a step verifying "
                        "fewer drafts keeps the first rates); output tokens are then NOT the target's and the "
                        "report is labelled synthetic (default: none, the drafter's real acceptance)")
    s.add_argument("--synthetic-seed", type=int, default=0, help="seed of the synthetic acceptance draws")
    q = p.add_argument_group("peers (same weights, same device)")
    q.add_argument("--peers", type=_list(str), default=(), help="comma list: transformers (default: none)")
    q.add_argument("--peer-assistant", default=None, help="draft model directory for transformers assisted "
                   "generation (same tokenizer as the target; default: none)")
    q.add_argument("--peer-batch-sizes", type=_list(int), default=None, help="default: --batch-sizes")
    q.add_argument("--peer-temperatures", type=_list(float), default=(0.0,), help="default: 0")
    q.add_argument("--peer-output-len", type=int, default=None, help="default: --output-len")
    o = p.add_argument_group("output")
    o.add_argument("--out", default="bench-results", help="directory for bench.json, bench.md and the plots")
    o.add_argument("--no-plots", dest="plots", action="store_false", help="write no PNG plots (default: write them)")
    p.set_defaults(func=cmd_bench)


def cmd_bench(args: argparse.Namespace) -> int:
    names = {f.name for f in dataclasses.fields(BenchConfig)}
    values = {k: v for k, v in vars(args).items() if k in names and k != "command"}  # "command": the subparser
    cfg = BenchConfig(**values, command=shlex.join(["blockspec", *sys.argv[1:]]))
    output_dir(args.out, "--out")  # before the sweep, which a bad path would otherwise lose at its end
    result = run_bench(cfg, log=lambda line: print(line, file=sys.stderr, flush=True))
    paths = write_outputs(result, args.out, plots=args.plots)
    print(markdown(result))
    print("wrote " + ", ".join(str(p) for p in paths.values()), file=sys.stderr)
    return 0
