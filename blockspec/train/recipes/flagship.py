"""The flagship embedded pair of issue #25, in stages that fit GPU calls of 10 minutes and 64 MiB each way.

    python -m blockspec.train.recipes.flagship shapes              # CPU: step times, sizes, device estimate
    python -m blockspec.train.recipes.flagship recut --corpus out/corpus --out out/flagship/corpus
    python -m blockspec.train.recipes.flagship prompts --corpus out/flagship/corpus --out out/flagship/prompts
    python -m blockspec.train.recipes.flagship target --pieces DIR --state DIR --minutes M [--export DIR] --out DIR
    python -m blockspec.train.recipes.flagship regen --target DIR --prompts DIR --state FILE --minutes M --out DIR
    python -m blockspec.train.recipes.flagship drafter --method dflash|dspark --target DIR --rows DIR --state DIR
                                                        --minutes M --out DIR
    python -m blockspec.train.recipes.flagship export-target | export-drafter | ship | collect | carry ...
    python -m blockspec.train.recipes.flagship continue-drafter --method M --state DIR --regen-metrics FILE

README
======

What the device allows, and what follows
----------------------------------------
A call carries the working tree (46.4 MiB, 31.4 MiB of it the embedded pair) and the paths it
names, 64 MiB in all; it returns at most 8 files of at most 16 MiB, 64 MiB together, two folders
deep; the machine stays warm 30 s after a call; a session has about 30 device minutes. Hence:

* A state (`blockspec.train.state`) is safetensors shards of at most 16 MiB plus ``state.json``,
  in groups: ``model`` (fp32 weights), ``optimizer`` (AdamW moments), ``run`` (configuration, corpus
  plan, schedule, data position, history) for the target; ``drafter``, ``optimizer``, ``trainer``,
  ``run``, ``best`` for a drafter. A call ships the groups it is told to (``--ship``).
* Within a lease every stage works in ``DEV`` = ``/tmp/flagship`` on the machine: each call's
  script copies what it carried under ``out/flagship`` into DEV (never over what is there) and runs
  against DEV. A call that only carries files ("stash") is how inputs larger than one call's room
  get there. The target's full state (40 MB of weights, 81 MB of moments) cannot travel in one
  call: training calls return the weights and the run (exact), the moments stay in DEV.
* A stage cut by a lost machine continues in a new lease from the returned weights (stash them,
  then call the stage again): the resume is exact in weights, schedule and data order, with fresh
  AdamW moments, and says ``exact_resume: false``. For an exact resume, ``ship`` the ``optimizer``
  group out in parts (``90-ship.sh``) before the lease ends and stash it back (``91-stash-state.sh``).

The pair (numbers from ``shapes`` on the project's 2-core CPU, 2 threads, random weights, engine, batch 1)
-----------------------------------------------------------------------------------------------------
=================  ======  ==========  ========  ========  ==========  =============  ==========  ===================
shape              params  fp32 bytes  step      floor     step/floor  assets (bf16)  tree after  FP8 target: both
=================  ======  ==========  ========  ========  ==========  =============  ==========  ===================
h256 l6 i1024 *    10.1 M   40.4 MB     8.58 ms  1.59 ms   5.4          32.9 MB        46.1 MiB   27.0 MB,  40.8 MiB
h256 l4 i1536       9.7 M   38.8 MB     6.75 ms  1.53 ms   4.4          32.1 MB        45.4 MiB   26.3 MB,  40.2 MiB
h256 l8 i768       10.5 M   42.0 MB    10.59 ms  1.65 ms   6.4          33.6 MB        46.9 MiB   27.4 MB,  41.2 MiB
h320 l8 i1280      17.5 M   70.2 MB    12.06 ms  2.76 ms   4.4          51.9 MB        64.3 MiB   39.6 MB,  52.9 MiB
h384 l6 i1536      19.3 M   77.1 MB    10.38 ms  3.03 ms   3.4          60.0 MB        72.0 MiB   47.0 MB,  59.9 MiB
h384 l8 i1536      23.6 M   94.4 MB    13.81 ms  3.72 ms   3.7          68.6 MB        80.3 MiB   51.4 MB,  64.1 MiB
h512 l8 i2048      39.9 M  159.4 MB    16.61 ms  6.27 ms   2.6         114.4 MB       123.9 MiB   83.0 MB,  94.2 MiB
=================  ======  ==========  ========  ========  ==========  =============  ==========  ===================

step: one plain decode step through the engine, (t(80 tokens) - t(16 tokens)) / 64, best of 5;
floor: the step's fp32 weight bytes at the read bandwidth of one pass over a 512 MB tensor (25.4 GB/s
on that host; `benchmarks/data/flagship/cpu_2026-12-05b/shapes.json`). tree after: the files a call
carries besides the pair (14.8 MiB, counted in disk blocks as the device tool counts them) plus the
pair. The device's 64 MiB a call, not the flagship issue's 120 MB, caps the pair, since tracked
assets travel with every call of the project and a call needs room for what it carries (a 20 MiB
corpus piece while training; a few MiB of kernels caches or wheels afterwards). The assets column
ships both drafters without an embedding or head: DeepSpec DSpark files carry copies of the
target's (2 x 16384 x hidden x 2 bytes, 16.8 MB at hidden 256), which the shipped DSpark leaves to the
target (`blockspec.drafters.strip_target_copies` in ``assemble``; `restore_target_copies` writes the
reference file back). Even so, with a bf16 target only the 10 M shapes leave a call room to carry a corpus
piece. The last column ships the target as its FP8 checkpoint (``assemble --fp8-target``, `blockspec
quantize`: the decoder products in e4m3 with a scale per 128 x 128 block; embeddings, norms and the
drafters bf16, with `drafters_for`'s taps: two of a 4-layer target), with the tree's other files at 15.1 MiB
(2026-12-05): the 17.5 M shape then leaves 11 MiB to carry. On the shipped 10.1 M target the FP8 twin (20.2 -> 14.3 MB) drafts as well with the bf16-trained
DSpark (acceptance length 4.06 against 3.97 on 8 held-out prompts; CPU speed the same, each FP8 layer
computing with its dequantized weight there). ``FLAGSHIP_SHAPE=NAME`` (e.g. h320-l8-i1280) runs every stage
for another candidate, its drafters 3 x its hidden wide with z-lab's uniform taps ([1, 2, 4, 5] of 8 layers).
A target whose fp32 weights are more than a call returns (h320-l8-i1280: 66.9 MiB; the target command refuses to
start one told to return them) trains with ``FLAGSHIP_TARGET_SHIP=run``: weights and moments stay in DEV, so the
target stage runs within one lease, and the call that ends it returns the bf16 export (16 MiB shards) as target/;
locally, the tokenizer goes beside it (``cp out/flagship/corpus/tokenizer/* out/flagship/target/``) in place of
``local.sh export-target``.
Chosen (*):
Qwen3, hidden 256, 6 layers, MLP 1024, 4 heads / 2 KV heads of 64, vocab 16384 (the corpus
tokenizer), tied, 10.1 M parameters. Assets: target 20.2 MB; DFlash (2 layers, MLP 768, block 16,
taps from layers 1-4; z-lab format, no embedding) 3.7 MB; DSpark (2 layers, MLP 768, block 8, Markov
head rank 64, confidence head, the same taps) 7.9 MB; tokenizer 1.1 MB: 32.9 MB (the asset column
prices every candidate's drafters at 3 x hidden MLPs).

The calls
---------
Scripts in ``scripts/flagship`` (they travel with the tree); each names in its
header what it carries (the ``carry`` list to pass; training loads no grammar, so no wheels),
what it runs and what it returns. Locally, once: ``bash
scripts/flagship/local.sh prepare``: the train pieces re-cut to at most 20 MiB (4 pieces, the
largest 19.6 MiB), and 64,000 prompts of 64 tokens (3.2 MiB). After every call: ``local.sh collect FILES_AT``.
Beside the whole tree (46.4 MiB) a 19.6 MiB piece does not fit: move ``blockspec/assets/default`` out of the
working tree for the calls that carry pieces or train (the stages work in DEV, not on the shipped pair; the
tree is then 15.1 MiB) and back before any other call.
Run every call with timeout_s 600. The drafters' early stopping decodes 24 held-out openings that
are not among the demo's prompts (`drafter_stage.selection_prompt_ids`).

Session 1: target pretraining and regeneration.

====  ===========================================  ==========================================  ============================
call  carries (besides the tree and the scripts)   runs                                        returns
====  ===========================================  ==========================================  ============================
01    manifest, tokenizer, validation piece,       stash; device versions                      -
      train piece 0
02    train piece 1                                stash                                       -
03    train piece 2                                stash                                       -
04    train piece 3                                stash                                       -
05    -                                            target slice, 8 min; export into DEV        weights, run, metrics
06    -                                            target slice, 8 min (repeat while           weights, run, metrics
                                                   ``stop`` is not ``done``)
07    prompts                                      regeneration, 8 min                         regen pieces, state, metrics
08    -                                            regeneration, 8 min, while under 20 M       regen pieces, state, metrics
====  ===========================================  ==========================================  ============================

Then locally: ``local.sh export-target`` (out/flagship/target, one bf16 file).

Session 2: drafters (in session 1 instead, without 11-12, when its time allows).

====  ===========================================  ==========================================  ============================
call  carries                                      runs                                        returns
====  ===========================================  ==========================================  ============================
11    out/flagship/target                          stash                                       -
12    out/flagship/regen (20 MiB at most)          stash                                       -
13    -                                            DFlash slice, 8 min, evaluations 2.5 min    drafter state, metrics
14    -                                            DFlash again, until ``stopped``             drafter state, metrics
15    -                                            DSpark slice, 8 min                         drafter state, metrics
16    -                                            DSpark again, until ``stopped``             drafter state, metrics
====  ===========================================  ==========================================  ============================

Then locally: ``local.sh export-drafters`` (z-lab DFlash, DeepSpec DSpark from each state's best),
and ``python -m blockspec.train.recipes.flagship assemble``: the exports with their model cards and
metrics.json into ``blockspec/assets/default`` (``--states dflash=DIR``: a drafter exported from a state
not named ``dflash-state``).

Longer drafter runs, once the pair is shipped (the target is then the shipped one): 20 and 21 carry
the two regenerated pieces (about 20 MiB each; one a call beside the 46 MiB tree) and 21 starts a DFlash run of
``FLAGSHIP_EPOCHS`` (default 10) in a new state; 22 a
DSpark run of 8 epochs (repeat it until its metrics say ``stopped``); 23 runs the demo and the bench
preset on the device. 24 (after 20, instead of 21) trains a drafter on from the shipped one
(``--init``: its weights, a fresh optimiser and schedule; ``FLAGSHIP_METHODS``: default dflash, or
"dflash dspark", both in one call; ``FLAGSHIP_LAYERS`` above the shipped depth grows it, the added
layers starting as the identity, so the run starts from the shipped drafts; ``flagship drafter --taps``
reads more target layers, their ``fc`` columns starting at zero, ``--labels target`` learns the
target's greedy tokens instead of the rows', and ``--ce-alpha / --l1-alpha / --kl-alpha`` reweigh the
loss); locally ``flagship
continue-drafter`` then puts a continued run's best into the shipped pair, its card and metrics.json beside the first run's record.
Rows the shipped drafters never saw: ``flagship prompts --seed 1`` into ``out/flagship/prompts-seed1``,
then 07 and 08 with ``FLAGSHIP_PROMPTS=prompts-seed1`` (07 carries that folder; with no exported target
in DEV they continue the shipped one), then 24 for each drafter in the same lease.

Device minutes, measured (H200, 2026-12-01)
-------------------------------------------
Calls 01-04 took 0.2-0.6 min each, the first with the machine's start; the target's 3 epochs 6.7
min of steps at 1.01 M tokens/s (the CPU-based estimate said 8.0); regeneration 36.8-43.8 k tokens/s
(5.0 min for the first 10.9 M tokens, 4.1 min for the next 10.9 M: the estimate assumed twice that
rate); DFlash 2 epochs 73 s of steps, DSpark 124 s, plus 10-25 s for the evaluation and save. Session 1
and the drafters fit one session of 30 minutes: 28.9 minutes in 10 calls.
The 17.5 M candidate (``FLAGSHIP_SHAPE=h320-l8-i1280``) on an H100 (2026-12-05): the target's 3 epochs 10.7 min of
steps at 640 k tokens/s, regeneration 24.1 k tokens/s (20 M tokens: 14 min).
``FLAGSHIP_SMOKE=1 FLAGSHIP_MINUTES=0.1 OUT=... FLAGSHIP_DEV=...`` runs the same scripts on a CPU
at toy sizes, to check a change before it spends device time.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, get_args

import numpy as np
import torch

from blockspec.train.corpus import MIB, load_piece, write_split_pieces
from blockspec.train.data import DataError
from blockspec.train.drafter_stage import DrafterStageConfig, drafter_slice, export_best
from blockspec.models.fp8_export import BLOCK
from blockspec.train.recipes.flagship_cards import assemble, continue_drafter
from blockspec.train.pretrain import (
    PretrainConfig,
    heldout_examples,
    pretrain_slice,
    resume_run,
)
from blockspec.train.regen import RegenConfig, make_prompts, regen_slice
from blockspec.train.state import MAX_FILE_BYTES, read_index, state_files
from blockspec.train.stream import manifest_plan
from blockspec.train.target_lm import TargetShape, save_hf_target
from blockspec.train.trainer import Labels, default_target_layer_ids

RETURN_FILES, RETURN_BYTES = 8, 64 * MIB  # what one device call returns at most

SHAPE = TargetShape(vocab_size=16384, hidden_size=256, intermediate_size=1024, num_layers=6, num_heads=4,
                    num_kv_heads=2, head_dim=64, max_position_embeddings=2048)
PRETRAIN = PretrainConfig(shape=SHAPE, seq_len=1024, batch_size=64, lr=2e-3, min_lr_ratio=0.1, warmup_frac=0.02,
                          weight_decay=0.1, epochs=3.0, eval_windows=256, eval_batch_size=16)
PROMPT_TOKENS, PROMPT_COUNT = 64, 64_000
REGEN = RegenConfig(new_tokens=448, temperatures=(0.0, 0.7), batch_size=512, chunk_prompts=4096)
# the pair's shapes and budgets (the module docstring says why these)
DRAFTER_COMMON = dict(num_layers=2, max_len=512, batch_size=64, lr=2e-3, warmup_frac=0.04, min_lr_ratio=0.05,
                      labels="data", seed=0)
DRAFTER_TAPS = 4  # target layers a drafter reads (z-lab's uniform taps, `default_target_layer_ids`)


def drafters_for(shape: TargetShape) -> dict[str, DrafterStageConfig]:
    """Both drafters of a target shape: MLPs 3 x its hidden wide, DRAFTER_TAPS taps ([1, 2, 3, 4] of 6 layers)."""
    common = dict(DRAFTER_COMMON, intermediate_size=3 * shape.hidden_size,
                  target_layer_ids=list(default_target_layer_ids(shape.num_layers, DRAFTER_TAPS)))
    return {
        "dflash": DrafterStageConfig(train=dict(method="dflash", block_size=16, num_anchors=64, **common),
                                     epochs=2.0, eval_minutes=2.5),
        "dspark": DrafterStageConfig(train=dict(method="dspark", block_size=8, num_anchors=128, markov_rank=64,
                                                markov_head_type="vanilla", confidence_head=True, **common),
                                     epochs=2.0, eval_minutes=2.5),
    }


DRAFTERS = drafters_for(SHAPE)


@dataclasses.dataclass(frozen=True)
class Plan:
    """What the stage commands run with: the flagship's settings, or (FLAGSHIP_SMOKE=1) the same stages at toy
    sizes, so the call scripts can be run through on a CPU before they spend device time."""

    pretrain: PretrainConfig
    regen: RegenConfig
    drafters: dict[str, DrafterStageConfig]
    prompt_tokens: int
    prompt_count: int


FULL = Plan(PRETRAIN, REGEN, DRAFTERS, PROMPT_TOKENS, PROMPT_COUNT)
_SMOKE_SHAPE = dataclasses.replace(SHAPE, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
                                   num_kv_heads=1, head_dim=16, max_position_embeddings=512)
_SMOKE_DRAFTER = dict(num_layers=1, max_len=64, batch_size=4, lr=2e-3, seed=0)
SMOKE = Plan(
    dataclasses.replace(PRETRAIN, shape=_SMOKE_SHAPE, seq_len=128, batch_size=4, eval_windows=4, eval_batch_size=4),
    dataclasses.replace(REGEN, new_tokens=32, batch_size=8, chunk_prompts=16, max_piece_bytes=1 << 16),
    {"dflash": DrafterStageConfig(train=dict(method="dflash", block_size=16, num_anchors=4, **_SMOKE_DRAFTER),
                                  eval_every_steps=4, eval_prompts=2, eval_new_tokens=16),
     "dspark": DrafterStageConfig(train=dict(method="dspark", block_size=8, num_anchors=4, markov_rank=8,
                                             **_SMOKE_DRAFTER), eval_every_steps=4, eval_prompts=2,
                                  eval_new_tokens=16)},
    32, 96)


def active_plan() -> Plan:
    """FLAGSHIP_SMOKE=1: the toy plan; FLAGSHIP_SHAPE=NAME: the full plan for another of the CANDIDATES (the
    target, and drafters widened and tapped to fit it); else FULL."""
    if os.environ.get("FLAGSHIP_SMOKE") == "1":
        return SMOKE
    name = os.environ.get("FLAGSHIP_SHAPE")
    if not name:
        return FULL
    if name not in CANDIDATES:
        raise DataError(f"FLAGSHIP_SHAPE={name!r} is not a candidate; candidates: {', '.join(CANDIDATES)}")
    shape = CANDIDATES[name]
    return dataclasses.replace(FULL, pretrain=dataclasses.replace(PRETRAIN, shape=shape), drafters=drafters_for(shape))


# ---------------------------------------------------------------- sizes and step times (CPU)
CANDIDATES = {
    "h256-l6-i1024": SHAPE,
    "h256-l4-i1536": dataclasses.replace(SHAPE, intermediate_size=1536, num_layers=4),
    "h256-l8-i768": dataclasses.replace(SHAPE, intermediate_size=768, num_layers=8),
    "h320-l8-i1280": dataclasses.replace(SHAPE, hidden_size=320, intermediate_size=1280, num_layers=8, head_dim=80),
    "h384-l6-i1536": dataclasses.replace(SHAPE, hidden_size=384, intermediate_size=1536, num_layers=6, num_heads=6),
    "h384-l8-i1536": dataclasses.replace(SHAPE, hidden_size=384, intermediate_size=1536, num_layers=8, num_heads=6),
    "h512-l8-i2048": dataclasses.replace(SHAPE, hidden_size=512, intermediate_size=2048, num_layers=8, num_heads=8,
                                         num_kv_heads=4),
}


def asset_bytes(shape: TargetShape, tokenizer_bytes: int, fp8_target: bool = False) -> dict[str, int]:
    """bf16 bytes of what the pair ships: the target, the z-lab DFlash and the DeepSpec DSpark (neither with an
    embedding or head: the shipped DSpark leaves its copies to the target), the tokenizer; the drafters' MLPs
    3 x hidden wide. `fp8_target`: the target's decoder products in e4m3 with an fp32 scale per 128 x 128 block
    (`assemble --fp8-target`)."""
    from blockspec.train.trainer import build_drafter

    cfg = shape.model_config(0)
    target = _meta_target(shape)
    params = sum(p.numel() for p in target.parameters()) - shape.vocab_size * shape.hidden_size * (
        not shape.tie_word_embeddings)
    sizes = {"target": 2 * params}
    if fp8_target:
        products = [m.weight.shape for layer in target.layers for block in (layer.self_attn, layer.mlp)
                    for m in block.children() if isinstance(m, torch.nn.Linear)]
        b = BLOCK  # 2 bytes a weight -> 1, plus an fp32 scale a block
        sizes["target"] -= sum(n * k - 4 * -(-n // b) * -(-k // b) for n, k in products)
    for name, stage in drafters_for(shape).items():
        train = stage.train_config("cpu")
        drafter = build_drafter(train, cfg, mask_token_id=2)
        sizes[name] = 2 * sum(p.numel() for p in drafter.parameters())
    sizes["tokenizer"] = tokenizer_bytes
    sizes["total"] = sum(sizes.values())
    return sizes


def _meta_target(shape: TargetShape) -> torch.nn.Module:
    from blockspec.models.llama import CausalLM

    with torch.device("meta"):
        return CausalLM(shape.model_config(0))


def disk_bytes(path: Path) -> int:
    """A file's size as the device tool counts it against a call's 64 MiB: the disk blocks it holds (each small file
    takes a whole block, about 2 MiB over the tree's 865 files), never less than its length."""
    st = path.stat()
    return max(st.st_size, st.st_blocks * 512)


def tree_bytes(exclude: str | None = "blockspec/assets/default/") -> int:
    """Bytes of the files a call carries (tracked and untracked-not-ignored), without those under `exclude` (by
    default the old embedded pair)."""
    import subprocess

    names = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], capture_output=True, check=True,
                           text=True).stdout.split("\0")
    return sum(disk_bytes(Path(n)) for n in names if n and Path(n).is_file() and not (exclude and n.startswith(exclude)))


def decode_step_seconds(target_dir: Path, short: int = 16, long: int = 80, repeats: int = 5) -> float:
    """One batch-1 plain decode step through the engine on the CPU: (t(long) - t(short)) / (long - short), each
    the best of `repeats`, so the prompt's prefill cancels."""
    from blockspec.llm import LLM
    from blockspec.sampling_params import SamplingParams

    llm = LLM(str(target_dir), device="cpu", seed=0, max_num_seqs=1)
    prompt = [{"prompt_token_ids": list(range(100, 164))}]

    def best(n: int) -> float:
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        llm.generate(prompt, params, use_tqdm=False)
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            llm.generate(prompt, params, use_tqdm=False)
            times.append(time.perf_counter() - t)
        return min(times)

    return (best(long) - best(short)) / (long - short)


def train_step_seconds(shape: TargetShape, seq_len: int, batch: int, repeats: int = 3) -> float:
    """One fp32 pretraining step (forward, backward, AdamW) on the CPU, the best of `repeats` after one warm-up."""
    from blockspec.train.target_lm import lm_step, new_target
    from blockspec.train.trainer import CosineSchedule, make_optimizer

    model = new_target(shape.model_config(0)).train()
    opt = make_optimizer(model, 1e-3, 0.1)
    schedule = CosineSchedule(opt, 0.0, 0.1)
    schedule.plan(1000, 0)
    ids = torch.randint(0, shape.vocab_size, (batch, seq_len + 1))
    times = []
    for i in range(repeats + 1):
        t = time.perf_counter()
        lm_step(model, opt, schedule, ids, torch.ones_like(ids), 1.0)
        if i:
            times.append(time.perf_counter() - t)
    return min(times)


def drafter_step_seconds(method: str, batch: int, repeats: int = 3) -> float:
    """One fp32 drafter training step on the CPU (the frozen target's forward, the blocks, AdamW) over rows of the
    plan's length, the best of `repeats` after one warm-up."""
    from blockspec.train.stream import RowBatches, Rows
    from blockspec.train.target_lm import new_target
    from blockspec.train.trainer import DrafterTrainer

    cfg = DRAFTERS[method].train_config("cpu")
    target = new_target(SHAPE.model_config(0))
    tokens = np.random.default_rng(0).integers(5, SHAPE.vocab_size, (batch, cfg.max_len)).astype(np.uint16)
    rows = RowBatches(Rows(tokens, PROMPT_TOKENS, 1), batch, 0)
    trainer = DrafterTrainer(target, [], cfg, 2, 1, batches=rows)
    times = []
    for i in range(repeats + 1):
        t = time.perf_counter()
        trainer.step(100)
        if i:
            times.append(time.perf_counter() - t)
    return min(times)


def train_flops_per_token(shape: TargetShape, seq_len: int) -> float:
    """6 x the matrix parameters a token passes (layers and LM head) + 12 x layers x seq_len x attention width / 2
    (causal attention's scores and mix, forward and backward)."""
    model = _meta_target(shape)
    matrix = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2 and "embed" not in n)
    if shape.tie_word_embeddings:
        matrix += shape.vocab_size * shape.hidden_size
    attention = 6 * shape.num_layers * seq_len * shape.num_heads * shape.head_dim
    return 6 * matrix + attention


def measure_shapes(tokenizer_dir: Path, names: list[str], threads: int | None) -> dict[str, Any]:
    """Plain decode step time against the weight-streaming floor, asset sizes and the projected tree, per shape."""
    from transformers import AutoTokenizer

    from blockspec.bench.arch import step_bytes
    from blockspec.bench.timing import cpu_read_bandwidth
    from blockspec.models.loader import load_target
    from blockspec.train.target_lm import new_target

    if threads:
        torch.set_num_threads(threads)
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    tok_bytes = (tokenizer_dir / "tokenizer.json").stat().st_size
    bandwidth = cpu_read_bandwidth()
    tree = tree_bytes()
    report: dict[str, Any] = {"threads": torch.get_num_threads(), "read_bandwidth_gb_s": round(bandwidth / 1e9, 1),
                              "tree_without_assets_mib": round(tree / MIB, 2), "shapes": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            shape = CANDIDATES[name]
            directory = save_hf_target(new_target(shape.model_config(tokenizer.eos_token_id)), Path(tmp) / name,
                                       tokenizer)
            model, _ = load_target(directory, "float32", "cpu")
            floor = step_bytes(model) / bandwidth
            step = decode_step_seconds(directory)
            assets = asset_bytes(shape, tok_bytes)
            fp8_assets = asset_bytes(shape, tok_bytes, fp8_target=True)
            report["shapes"][name] = {
                "params_m": round(sum(p.numel() for p in model.parameters()) / 1e6, 2),
                "step_bytes_fp32_mb": round(step_bytes(model) / 1e6, 1),
                "decode_ms": round(step * 1e3, 2), "decode_tok_s": round(1 / step, 1),
                "floor_ms": round(floor * 1e3, 2), "floor_tok_s": round(1 / floor, 1),
                "step_over_floor": round(step / floor, 2),
                "assets_mb": {k: round(v / 1e6, 1) for k, v in assets.items()},
                "tree_after_mib": round((tree + assets["total"]) / MIB, 1),
                "assets_fp8_target_mb": round(fp8_assets["total"] / 1e6, 1),
                "tree_after_fp8_target_mib": round((tree + fp8_assets["total"]) / MIB, 1)}
            print(json.dumps({name: report["shapes"][name]}), flush=True)
    return report


CORPUS_TRAIN_TOKENS = 136_657_430
REGEN_TOKENS = 23e6  # what the drafters train on: 20 M generated tokens and their prompts, about


def device_estimate(target_step_s: float, target_tokens: int, drafter_steps: dict[str, tuple[float, int]],
                    assumed_gpu_tflops: float = 60.0, assumed_decode_step_s: float = 6e-3) -> dict[str, Any]:
    """Device minutes of each stage's training, an estimate: the CPU's measured step times scaled by the ratio of
    an assumed H200 rate (a tenth of its bf16 peak) to the CPU's measured FLOP rate on the target's step; the
    regeneration from an assumed decode step time at batch 512 (a small model's step is host-bound there).
    Machine starts, transfers, evaluations and exports come on top (the plan adds them)."""
    flops = train_flops_per_token(SHAPE, PRETRAIN.seq_len)
    cpu_flops_s = flops * target_tokens / target_step_s
    ratio = assumed_gpu_tflops * 1e12 / cpu_flops_s
    target_s = PRETRAIN.epochs * CORPUS_TRAIN_TOKENS * target_step_s / target_tokens / ratio
    regen_s = 20e6 / (REGEN.batch_size / assumed_decode_step_s)
    drafters = {name: round(DRAFTERS[name].epochs * REGEN_TOKENS * step_s / tokens / ratio / 60, 1)
                for name, (step_s, tokens) in drafter_steps.items()}
    return {"train_flops_per_token": flops, "cpu_train_tflops": round(cpu_flops_s / 1e12, 4),
            "assumed_h200_tflops": assumed_gpu_tflops, "speed_ratio": round(ratio),
            "assumed_decode_step_ms_at_batch_512": assumed_decode_step_s * 1e3,
            "target_minutes": round(target_s / 60, 1), "regen_minutes_20m_tokens": round(regen_s / 60, 1),
            "drafter_minutes": drafters}


# ---------------------------------------------------------------- corpus re-cut and prompts (CPU)
def recut(corpus: Path, out: Path, max_piece_mib: float) -> dict[str, Any]:
    """The corpus's train pieces re-cut to at most max_piece_mib each (whole files, same token stream), with a
    manifest whose plan lists them; tokenizer and validation piece copied. Smaller pieces leave a call room."""
    manifest = json.loads((corpus / "manifest.json").read_text())
    tokens = np.concatenate([load_piece(corpus / "pieces" / p.file) for p in manifest_plan(corpus / "manifest.json")])
    tok = manifest["tokenizer"]
    pieces = out / "pieces"
    pieces.mkdir(parents=True, exist_ok=True)
    for stale in pieces.glob("train-*"):
        stale.unlink()
    sidecars = write_split_pieces(tokens, "train", pieces, tok["eos_id"], tok["vocab_size"], tok["sha256"],
                                  int(max_piece_mib * MIB), manifest["settings"]["xz_preset"])
    for p in manifest["splits"]["validation"]["pieces"]:
        for name in (p["file"], p["file"].removesuffix(".u16.xz") + ".json"):
            shutil.copy2(corpus / "pieces" / name, pieces / name)
    if (out / "tokenizer").exists():
        shutil.rmtree(out / "tokenizer")
    shutil.copytree(corpus / "tokenizer", out / "tokenizer")
    manifest["splits"]["train"]["pieces"] = sidecars
    manifest["recut"] = {"from": str(corpus), "max_piece_mib": max_piece_mib}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return {"pieces": [(s["file"], s["tokens"], s["bytes"]) for s in sidecars]}


def load_tokenizer_dir(path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


# ---------------------------------------------------------------- returning files
def ship(files: list[Path], out: Path, max_files: int = RETURN_FILES, max_bytes: int = RETURN_BYTES) -> list[Path]:
    """Copy `files` into `out`, refusing a set a call could not return (too many or too large)."""
    if len(files) > max_files or sum(f.stat().st_size for f in files) > max_bytes:
        raise DataError(f"{len(files)} files of {sum(f.stat().st_size for f in files) / MIB:.1f} MiB: a call returns "
                        f"at most {max_files} files of {max_bytes / MIB:.0f} MiB; ship fewer groups or use parts")
    out.mkdir(parents=True, exist_ok=True)
    copied = []
    for f in files:
        if f.stat().st_size > MAX_FILE_BYTES:
            raise DataError(f"{f}: {f.stat().st_size} bytes, over the 16 MiB a returned file may have")
        shutil.copy2(f, out / f.name)
        copied.append(out / f.name)
    return copied


def check_weights_return(shape: TargetShape) -> None:
    """Refuse, before any step, a target call told to return fp32 weights larger than a call returns."""
    fp32 = 4 * sum(p.numel() for p in _meta_target(shape).parameters())
    if fp32 > RETURN_BYTES - MIB:
        raise DataError(f"the target's fp32 weights are {fp32 / MIB:.1f} MiB, more than a call returns "
                        f"({RETURN_BYTES / MIB:.0f} MiB with the rest): ship 'run' only (FLAGSHIP_TARGET_SHIP=run); "
                        "the weights stay in the state directory and the last call returns the bf16 export")


def ship_parts(state_dir: Path, groups: list[str] | None, reserve_files: int = 1) -> list[list[Path]]:
    """The state's index and the groups' shards in parts a call can each return (the index in every part)."""
    files = state_files(state_dir, groups)
    index, shards = files[0], files[1:]
    parts: list[list[Path]] = [[]]
    size = index.stat().st_size
    for shard in shards:
        if len(parts[-1]) + 1 + reserve_files >= RETURN_FILES or size + shard.stat().st_size > RETURN_BYTES - MIB:
            parts.append([])
            size = index.stat().st_size
        parts[-1].append(shard)
        size += shard.stat().st_size
    return [[index, *p] for p in parts]


def collect(returned: Path, into: Path) -> list[str]:
    """Merge a call's returned files into the local run directory: top-level files go to ``metrics/`` (named with
    the time, so each call's stay), folders merge; a state folder then drops the shards its index no longer
    lists (a newer save replaced them)."""
    done = []
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for item in sorted(returned.iterdir()):
        if item.is_file():
            (into / "metrics").mkdir(parents=True, exist_ok=True)
            shutil.copy2(item, into / "metrics" / f"{stamp}-{item.name}")
            done.append(f"metrics/{stamp}-{item.name}")
            continue
        target = into / item.name
        target.mkdir(parents=True, exist_ok=True)
        for f in sorted(item.iterdir()):
            shutil.copy2(f, target / f.name)
            done.append(f"{item.name}/{f.name}")
        if (target / "state.json").is_file():
            listed = {f["file"] for f in read_index(target)["files"]}
            for stale in target.glob("*.safetensors"):
                if stale.name not in listed:
                    stale.unlink()
    return done


def carry_bytes(paths: list[Path]) -> dict[str, Any]:
    """What a call carrying `paths` sends: the working tree (tracked and untracked-not-ignored files) plus them."""
    tree = tree_bytes(exclude=None)
    extra = sum(disk_bytes(f) for p in paths for f in ([p] if p.is_file() else p.rglob("*")) if f.is_file())
    return {"tree_mib": round(tree / MIB, 2), "carried_mib": round(extra / MIB, 2),
            "total_mib": round((tree + extra) / MIB, 2), "fits_64_mib": tree + extra <= 64 * MIB}


def layer_ids(text: str) -> list[int]:
    """--taps: comma-separated target layer ids."""
    try:
        return [int(i) for i in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: want comma-separated layer ids, e.g. 0,1,2,3,4,5") from None


def write_metrics(out: Path | None, name: str, metrics: dict[str, Any]) -> None:
    print(json.dumps(metrics, indent=1, default=str))
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(json.dumps(metrics, indent=1, default=str) + "\n")


# ---------------------------------------------------------------- command line
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m blockspec.train.recipes.flagship",
                                description="Stages of the flagship embedded pair (see the module docstring).")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("shapes", help="CPU: decode step time vs the weight-streaming floor, asset sizes, estimate")
    s.add_argument("--tokenizer", type=Path, default=Path("out/corpus/tokenizer"))
    s.add_argument("--candidates", nargs="*", default=list(CANDIDATES), choices=list(CANDIDATES))
    s.add_argument("--threads", type=int, default=None)
    s.add_argument("--out", type=Path, default=None, help="directory for shapes.json")

    r = sub.add_parser("recut", help="CPU: re-cut the corpus's train pieces smaller, with a manifest")
    r.add_argument("--corpus", type=Path, default=Path("out/corpus"))
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--max-piece-mib", type=float, default=20.0)

    pr = sub.add_parser("prompts", help="CPU: regeneration prompts drawn from the train pieces")
    pr.add_argument("--corpus", type=Path, required=True, help="a corpus directory (manifest.json, tokenizer/, pieces/)")
    pr.add_argument("--out", type=Path, required=True)
    pr.add_argument("--count", type=int, default=None, help="default: the plan's (64,000)")
    pr.add_argument("--prompt-tokens", type=int, default=None, help="default: the plan's (64)")
    pr.add_argument("--seed", type=int, default=0)

    t = sub.add_parser("target", help="one slice of target pretraining")
    t.add_argument("--pieces", type=Path, required=True, help="directory holding the train piece(s) on hand")
    t.add_argument("--state", type=Path, required=True, help="state directory: resumed from, updated in place")
    t.add_argument("--out", type=Path, default=None, help="where metrics.json and the shipped groups go")
    t.add_argument("--ship", default="model,run", help="state groups copied to --out (comma-separated; '' none)")
    t.add_argument("--minutes", type=float, default=None)
    t.add_argument("--max-steps", type=int, default=None)
    t.add_argument("--manifest", type=Path, default=None, help="corpus manifest (a new run's plan; default: "
                                                                  "PIECES/../manifest.json)")
    t.add_argument("--tokenizer", type=Path, default=None, help="tokenizer directory (default: PIECES/../tokenizer)")
    t.add_argument("--validation", type=Path, default=None,
                   help="validation piece (default: PIECES/validation-00000.u16.xz when there)")
    t.add_argument("--export", type=Path, default=None, help="also write the target (bf16, HF, 16 MiB shards) here")
    t.add_argument("--epochs", type=float, default=None, help="a new run's epochs (default: the plan's)")
    t.add_argument("--device", default="auto")

    e = sub.add_parser("export-target", help="the target of a pretraining state as a bf16 HF checkpoint")
    e.add_argument("--state", type=Path, required=True)
    e.add_argument("--tokenizer", type=Path, required=True)
    e.add_argument("--out", type=Path, required=True)
    e.add_argument("--max-shard-mib", type=float, default=None, help="shard the weights (default: one file)")

    g = sub.add_parser("regen", help="one slice of regeneration")
    g.add_argument("--target", type=Path, required=True)
    g.add_argument("--prompts", type=Path, required=True, help="directory of the prompts piece")
    g.add_argument("--state", type=Path, default=None, help="regen_state.json to continue from (default: OUT's)")
    g.add_argument("--out", type=Path, required=True, help="this slice's pieces, the new state and metrics")
    g.add_argument("--minutes", type=float, default=None)
    g.add_argument("--max-prompts", type=int, default=None)
    g.add_argument("--device", default="auto")

    d = sub.add_parser("drafter", help="one slice of drafter training")
    d.add_argument("--method", choices=list(DRAFTERS), required=True)
    d.add_argument("--target", type=Path, required=True)
    d.add_argument("--rows", type=Path, required=True, help="directory of the regenerated pieces")
    d.add_argument("--state", type=Path, required=True, help="state directory: resumed from, updated in place")
    d.add_argument("--out", type=Path, default=None)
    d.add_argument("--ship", default="drafter,trainer,run,best")
    d.add_argument("--minutes", type=float, default=None)
    d.add_argument("--max-steps", type=int, default=None)
    d.add_argument("--epochs", type=float, default=None, help="passes over the rows (default: the plan's); "
                   "a state keeps the epochs it started with")
    d.add_argument("--layers", type=int, default=None, help="drafter decoder layers (default: the plan's); "
                   "a state keeps the shape it started with")
    d.add_argument("--taps", type=layer_ids, default=None,
                   help="target layers the drafter reads, comma-separated (default: the plan's); with --init, the "
                        "export's taps among them, the new ones starting with zero weight")
    d.add_argument("--labels", choices=get_args(Labels), default=None,
                   help="what each draft position learns (default: the plan's data labels)")
    for loss in ("ce", "l1", "kl"):
        d.add_argument(f"--{loss}-alpha", type=float, default=None,
                       help=f"weight of the {loss.upper()} term (default: the plan's; see `blockspec train --help`)")
    d.add_argument("--init", type=Path, default=None, help="a new run starts from this drafter export's weights "
                   "(e.g. the shipped one), with a fresh optimiser and schedule; with --layers above its depth "
                   "the added layers start as the identity")
    d.add_argument("--device", default="auto")

    x = sub.add_parser("export-drafter", help="the best drafter of a state in its reference format")
    x.add_argument("--state", type=Path, required=True)
    x.add_argument("--target", type=Path, required=True)
    x.add_argument("--out", type=Path, required=True)

    h = sub.add_parser("ship", help="copy part K of a state's groups to OUT (what one call can return)")
    h.add_argument("--state", type=Path, required=True)
    h.add_argument("--groups", default=None, help="comma-separated groups (default: all)")
    h.add_argument("--part", type=int, default=None, help="which part (default: print the parts)")
    h.add_argument("--out", type=Path, default=None)

    c = sub.add_parser("collect", help="merge a call's returned files into the local run directory")
    c.add_argument("returned", type=Path, help="the folder the call's files came back in")
    c.add_argument("--into", type=Path, default=Path("out/flagship"))

    cd = sub.add_parser("continue-drafter", help="replace a shipped drafter by the best of a run continued from it")
    cd.add_argument("--method", choices=sorted(DRAFTERS), required=True)
    cd.add_argument("--state", type=Path, required=True, help="the continued run's state (--init)")
    cd.add_argument("--regen-metrics", type=Path, required=True, help="regen_metrics.json of the rows it trained on")
    cd.add_argument("--pair", type=Path, default=Path("blockspec/assets/default"))

    a = sub.add_parser("assemble", help="the shipped pair (exports, cards, metrics.json) from a finished run")
    a.add_argument("--run", type=Path, default=Path("out/flagship"))
    a.add_argument("--out", type=Path, default=Path("blockspec/assets/default"))
    a.add_argument("--states", nargs="*", default=[], metavar="METHOD=DIR", type=method_state,
                   help="a drafter's state directory under --run, where not METHOD-state "
                        "(e.g. dflash=dflash-e10-state)")
    a.add_argument("--fp8-target", action="store_true",
                   help="ship the target as its FP8 checkpoint (`blockspec quantize`; the drafters stay bf16)")

    y = sub.add_parser("carry", help="the size of a call carrying these paths (with the working tree)")
    y.add_argument("paths", nargs="*", type=Path)

    args = p.parse_args(argv)
    try:
        return run_command(args)
    except DataError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def method_state(text: str) -> tuple[str, str]:
    method, sep, state = text.partition("=")
    if not sep or method not in DRAFTERS or not state:
        raise argparse.ArgumentTypeError(f"{text!r}: expected METHOD=DIR with METHOD one of {', '.join(DRAFTERS)}")
    return method, state


def groups_arg(text: str | None) -> list[str] | None:
    return None if text is None else [g for g in text.split(",") if g]


def run_command(args: argparse.Namespace) -> int:
    plan = active_plan()
    if args.command == "shapes":
        report = measure_shapes(args.tokenizer, args.candidates, args.threads)
        seq, batch = PRETRAIN.seq_len, 2
        step = train_step_seconds(SHAPE, seq, batch)
        drafters = {m: (drafter_step_seconds(m, batch), batch * DRAFTERS[m].train["max_len"]) for m in DRAFTERS}
        report["cpu_train_step_s"] = {"target": round(step, 3), "tokens": batch * seq,
                                      **{m: round(v[0], 3) for m, v in drafters.items()},
                                      "drafter_tokens": batch * DRAFTERS["dflash"].train["max_len"]}
        report["device_estimate"] = device_estimate(step, batch * seq, drafters)
        write_metrics(args.out, "shapes.json", report)
    elif args.command == "recut":
        write_metrics(None, "", recut(args.corpus, args.out, args.max_piece_mib))
    elif args.command == "prompts":
        manifest = json.loads((args.corpus / "manifest.json").read_text())
        pieces = [args.corpus / "pieces" / p.file for p in manifest_plan(args.corpus / "manifest.json")]
        sidecar = make_prompts(pieces, load_tokenizer_dir(args.corpus / "tokenizer"), args.count or plan.prompt_count,
                               args.prompt_tokens or plan.prompt_tokens, args.seed, args.out,
                               manifest["tokenizer"]["sha256"])
        write_metrics(None, "", {"file": sidecar["file"], "bytes": sidecar["bytes"], "tokens": sidecar["tokens"]})
    elif args.command == "target":
        root = args.pieces.parent
        tokenizer_dir = args.tokenizer or root / "tokenizer"
        tokenizer = load_tokenizer_dir(tokenizer_dir) if tokenizer_dir.is_dir() else None
        validation = args.validation or args.pieces / "validation-00000.u16.xz"
        cfg = dataclasses.replace(plan.pretrain, epochs=args.epochs) if args.epochs else plan.pretrain
        if args.out is not None and "model" in (groups_arg(args.ship) or []):
            check_weights_return(cfg.shape)
        heldout = heldout_examples(tokenizer, cfg.seq_len, cfg.eval_windows) if tokenizer is not None else None
        metrics = pretrain_slice(args.state, args.pieces, cfg=cfg, manifest=args.manifest or root / "manifest.json",
                                 tokenizer=tokenizer, minutes=args.minutes, max_steps=args.max_steps,
                                 validation=validation if validation.is_file() else None, heldout=heldout,
                                 export_dir=args.export, device=args.device)
        if args.out is not None and groups_arg(args.ship):
            ship(state_files(args.state, groups_arg(args.ship)), args.out / args.state.name, RETURN_FILES - 1)
        write_metrics(args.out, "target_metrics.json", metrics)
    elif args.command == "export-target":
        run = resume_run(args.state, args.state, torch.device("cpu"))
        tokenizer = load_tokenizer_dir(args.tokenizer)
        shard = int(args.max_shard_mib * MIB) if args.max_shard_mib else None
        save_hf_target(run.model, args.out, tokenizer, "bfloat16", max_shard_bytes=shard)
        write_metrics(None, "", {"step": run.step, "out": str(args.out), "history": run.history[-1:]})
    elif args.command == "regen":
        metrics = regen_slice(args.target, args.prompts, args.out, state_path=args.state, cfg=plan.regen,
                              minutes=args.minutes, max_prompts=args.max_prompts, device=args.device)
        write_metrics(args.out, "regen_metrics.json", metrics)
        files = [f for f in args.out.rglob("*") if f.is_file()]
        if len(files) > RETURN_FILES:  # each piece has a sidecar: more than 3 pieces do not come back in one call
            print(f"warning: {len(files)} files in {args.out}, more than a call returns; return the pieces in "
                  f"several calls", file=sys.stderr)
    elif args.command == "drafter":
        cfg = plan.drafters[args.method]
        cfg = dataclasses.replace(cfg, epochs=args.epochs) if args.epochs else cfg
        overrides = {"num_layers": args.layers, "target_layer_ids": args.taps, "labels": args.labels,
                     "ce_alpha": args.ce_alpha, "l1_alpha": args.l1_alpha, "kl_alpha": args.kl_alpha}
        cfg = dataclasses.replace(cfg, train=cfg.train | {k: v for k, v in overrides.items() if v is not None})
        cfg = dataclasses.replace(cfg, init=str(args.init)) if args.init else cfg
        metrics = drafter_slice(args.target, args.rows, args.state, cfg=cfg, minutes=args.minutes,
                                max_steps=args.max_steps, device=args.device)
        if args.out is not None and groups_arg(args.ship):
            ship(state_files(args.state, groups_arg(args.ship)), args.out / args.state.name, RETURN_FILES - 1)
        write_metrics(args.out, f"{args.method}_metrics.json", metrics)
    elif args.command == "export-drafter":
        exported = export_best(args.state, args.target, args.out)
        best = read_index(args.state)["state"]["run"]["best"]
        write_metrics(None, "", {"out": str(exported), "best": best})
    elif args.command == "collect":
        write_metrics(None, "", {"collected": collect(args.returned, args.into)})
    elif args.command == "continue-drafter":
        tokens = json.loads(args.regen_metrics.read_text())["total_generated_tokens"]
        write_metrics(None, "", continue_drafter(args.pair, args.method, args.state, tokens))
    elif args.command == "assemble":
        write_metrics(None, "", assemble(args.run, args.out, dict(args.states), args.fp8_target))
    elif args.command == "carry":
        write_metrics(None, "", carry_bytes(args.paths))
    elif args.command == "ship":
        parts = ship_parts(args.state, groups_arg(args.groups))
        if args.part is None or args.out is None:
            for i, part in enumerate(parts):
                print(i, " ".join(f.name for f in part))
        else:
            ship(parts[args.part], args.out / args.state.name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
