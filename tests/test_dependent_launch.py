"""Programmatic dependent launch (`kernels.dependent_launch`): a kernel may start before the one before it
ends, so nothing it reads or writes may come before its `griddepcontrol.wait`. Checked in each kernel's
PTX for sm_90 (no GPU needed), and on a GPU bit for bit against plain launches."""

from __future__ import annotations

import re

import pytest
import torch

from blockspec import kernels
from factories import ptx_for_sm90

MEMORY = re.compile(r"\b(ld|st|atom|red)\.global|cp\.async")
BF16 = "*bf16"


def order(ptx: str) -> tuple[int | None, int | None, int, int]:
    """Line numbers of the trigger (launch_dependents), the wait, the first global memory access and the
    first global store."""
    lines = ptx.splitlines()

    def first(pattern: str) -> int | None:
        return next((i for i, line in enumerate(lines) if re.search(pattern, line)), None)

    return (first(r"griddepcontrol\.launch_dependents"), first(r"griddepcontrol\.wait"),
            first(MEMORY.pattern), first(r"\bst\.global"))


SKINNY = ({"X": BF16, "W": BF16, "Bias": BF16, "NormW": BF16, "Res": BF16, "Out": BF16, "Sums": "*fp32",
           "Scaled": BF16, "WScale": "*fp32", "eps": "fp32"},
          {"PROLOGUE": 1, "GLU": False, "HAS_BIAS": False, "HAS_RES": True, "EMIT": False, "SUMS_BLOCK": 1,
           "BLOCK_M": 1, "BLOCK_N": 8, "BLOCK_K": 512, "EVEN_K": True, "IEEE": False, "WSCALE": 0, "SCALE_BR": 1,
           "SCALE_BC": 1, "PDL": True})
QKV_STORE = ({**{n: BF16 for n in ("QKV", "QW", "KW", "QOut", "KCache", "VCache")}, "Cos": "*fp32", "Sin": "*fp32",
              "Table": "*i32", "Slots": "*i32", "WritePos": "*i32", "eps": "fp32", "k_inv": "fp32", "v_inv": "fp32"},
             {"Q_HEADS": 4, "KV_HEADS": 2, "HEAD_DIM": 128, "HALF_BLOCK": 64, "QK_NORM": True, "PAGE": 16,
              "HEADS": 2, "KV_FP8": False, "PDL": True})
ATTENTION = ({"Q": BF16, "K": BF16, "V": BF16, "Out": BF16, "Table": "*i32", "Slots": "*i32", "Lo": "*i32",
              "Hi": "*i32", "Counters": "*i32", "PartAcc": "*fp32", "PartMax": "*fp32", "PartSum": "*fp32",
              "scale_log2": "fp32", "v_scale": "fp32"},
             {"KV_HEADS": 8, "GROUP": 4, "HEAD_DIM": 128, "BLOCK_D": 128, "BLOCK_M": 16, "BLOCK_N": 64,
              "MIN_TILES": 1, "MAX_USED": 264, "MERGE_UNROLL": 4, "IEEE": False, "PAGE": 64, "PER_KEY": True,
              "F16_DOTS": False, "PDL": True})
MULTIROW = ({"X": BF16, "W": "*fp8e4nv", "Bias": BF16, "WScale": "*fp32", "Out": BF16, "Part": "*fp32"},
            {"ROWS_A": 128, "ROWS_B": 16, "HAS_B": True, "BLOCK_N": 64, "BLOCK_K": 64, "SPLIT": 1, "GLU": True,
             "HAS_BIAS": False, "WSCALE": 1, "SCALE_BR": 1, "SCALE_BC": 4096, "EVEN_K": True, "PDL": True})
MULTIROW_REDUCE = ({"Part": "*fp32", "Bias": BF16, "WScale": "*fp32", "Out": BF16},
                   {"SPLIT": 4, "BLOCK": 1024, "GLU": False, "HAS_BIAS": False, "WSCALE": 1, "PDL": True})
MOE_INTS = {"Ids": "*i32", "Sorted": "*i32", "TileExpert": "*i32", "TileLo": "*i32", "TileHi": "*i32"}
MOE = [
    ("_moe_route", {"Logits": BF16, "Weights": BF16, "Ids": "*i32"},
     {"TOP_K": 8, "K_BLOCK": 8, "E_BLOCK": 128, "RENORM": True, "PDL": True}),
    ("_moe_align", MOE_INTS, {"BLOCK_M": 16, "E_BLOCK": 128, "CHUNK": 8, "PDL": True}),
    ("_moe_gate_up", {"X": BF16, "W": BF16, "Out": BF16, **MOE_INTS},
     {"TOP_K": 8, "BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 128, "EVEN_K": True, "IEEE": False, "ONE_ROW": True,
      "PDL": True}),
    ("_moe_down", {"H": BF16, "W": BF16, "RouteW": BF16, "Y": "*fp32", **MOE_INTS},
     {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "EVEN_K": True, "IEEE": False, "ONE_ROW": False, "PDL": True}),
    ("_moe_combine", {"Y": "*fp32", "Res": BF16, "Out": BF16}, {"TOP_K": 8, "HAS_RES": True, "BLOCK": 1024, "PDL": True}),
]


def test_every_kernel_waits_before_it_touches_memory():
    """Small kernels let the next one in at their start, then wait; the weight stream waits first and
    lets the next one in after its loop, before its stores; attention only waits. Negative control: the
    same stream compiled without PDL has no griddepcontrol at all."""
    # (module, kernel, signature, constexprs, expected order): "start", "stream", "wait only", "no PDL"
    cases = [("ops", "_rms_norm", {"X": BF16, "Res": BF16, "W": BF16, "Out": BF16, "ResOut": BF16, "eps": "fp32"},
              {"HAS_RES": True, "BLOCK": 4096, "PDL": True}, "start"),
             ("ops", "_silu_mul", {"GateUp": BF16, "Out": BF16}, {"BLOCK": 1024, "PDL": True}, "start"),
             ("ops", "_qkv_rope_store", *QKV_STORE, "start"),
             ("ops", "_skinny_linear", *SKINNY, "stream"),
             ("ops", "_skinny_linear", SKINNY[0], {**SKINNY[1], "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 256}, "stream"),
             ("ops", "_skinny_linear", SKINNY[0], {**SKINNY[1], "PDL": False}, "no PDL"),
             ("ops", "_multirow_linear", *MULTIROW, "stream"),
             ("ops", "_multirow_linear", MULTIROW[0], {**MULTIROW[1], "SPLIT": 4, "GLU": False}, "stream"),
             ("ops", "_multirow_reduce", *MULTIROW_REDUCE, "start"),
             ("attention", "_block_attention", *ATTENTION, "wait only"),
             *(("moe", *case, "start") for case in MOE)]
    for module in ("ops", "attention", "moe"):
        mine = [c for c in cases if c[0] == module]
        for (_, kernel, _, _, expected), ptx in zip(mine, ptx_for_sm90(f"blockspec.kernels.{module}",
                                                                         [c[1:4] for c in mine])):
            trigger, wait, access, store = order(ptx)
            if expected == "no PDL":
                assert "griddepcontrol" not in ptx, kernel
                continue
            assert wait is not None and access is not None and wait < access, kernel
            if expected == "stream":
                assert trigger is not None and access < trigger < store, kernel
            elif expected == "wait only":
                assert trigger is None, kernel
            else:
                assert trigger is not None and trigger < wait, kernel


def test_off_the_gpu_kernels_launch_plainly():
    assert kernels.dependent_launch(torch.zeros(2)) == {}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="needs a GPU of compute capability 9.0 or later")
@pytest.mark.parametrize("arch", ["tiny", "tiny-moe"])
def test_dependent_launch_changes_no_bits(monkeypatch, arch):
    """A bf16 decode graph launched with PDL gives the hidden states of plain launches bit for bit, in
    each of 30 replays: a kernel that touched memory before its wait would race with the one before."""
    from blockspec.bench.arch import get_arch, random_target
    from blockspec.models.runner import ModelRunner

    model = random_target(get_arch(arch).target, 256)
    model.attention_backend = "triton"
    ids = torch.randint(0, model.config.vocab_size, (2, 100), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    hidden = {}
    for on in (False, True):
        monkeypatch.setattr(kernels, "PDL", on)
        assert bool(kernels.dependent_launch(ids)) == on
        runner = ModelRunner(model, 2, 200)
        runner.forward_ids(ids, [100, 100], [0, 0], [0, 1])
        for _ in range(3):  # compile, capture, replay
            runner.forward_ids(ids[:, -1:], [1, 1], [100, 100], [0, 1])
        graph = list(runner.graphs.values())[-1]
        hidden[on] = graph.hidden.clone()
        for _ in range(30):
            graph.graph.replay()
            assert torch.equal(graph.hidden, hidden[on])
    assert torch.equal(hidden[True], hidden[False])
