"""benchmarks/kernel_sass.py: a kernel compiled for sm_90 on a machine without a GPU, read as SASS per loop.
Run as a user runs it (a subprocess without TRITON_INTERPRET); its readings are the ones RESULTS gives: for
FP8 decode attention, V's e4m3 tile reaches the P.V product through single-byte shared-memory loads unless
staged in fp16, where a bf16 tile is transposed by ldmatrix; for the one-row FP8 product, one conversion
per pair and one per value beside each multiply-add."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[1] / "benchmarks" / "kernel_sass.py"


def tool_output(*args: str) -> str:
    """What the tool prints for these arguments, run as a user runs it (without TRITON_INTERPRET)."""
    pytest.importorskip("triton.backends.nvidia.compiler")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(TOOL), *args], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def main_loop(*args: str, issuing: str = "HMMA") -> dict[str, int]:
    """The opcodes of the kernel's one loop that issues `issuing` instructions (by default tensor-core
    products: the attention's key loop)."""
    stdout = tool_output(*args, "--top", "1000")
    loops = [dict((op, int(n)) for op, n in re.findall(r"(\S+):(\d+)", line))
             for line in stdout.splitlines() if line.startswith("   ")]
    found = [ops for ops in loops if any(op.startswith(issuing) for op in ops)]
    assert len(found) == 1, stdout
    return found[0]


def resources(*args: str) -> tuple[int, int]:
    """(registers, bytes of spills) a thread of the kernel holds, from the tool's first line."""
    stdout = tool_output(*args)
    found = re.search(r"(\d+) registers and (\d+) bytes of spills", stdout)
    assert found, stdout
    return int(found.group(1)), int(found.group(2))


def test_one_row_glu_stream_of_fp8_spills_at_sixteen_rows_of_each_half_not_at_four():
    """gate_up with its GLU epilogue at one row, K runs of 8 in tiles of 1024 (`skinny_linear` streams half
    of block_n gate rows and as many up rows): at 4 + 4 rows a thread holds what the plain product of 8 rows
    does and spills nothing; at 16 + 16 its two [16, 1024] fp32 accumulators overflow the registers."""
    glu = ("--preset", "linear-one-row-fp8", "--set", "GLU=true", "PROLOGUE=3", "SUMS_BLOCK=16", "BLOCK_K=1024",
           "VEC_K=8")
    four = resources(*glu, "BLOCK_N=4")
    plain = resources("--preset", "linear-one-row-fp8", "--set", "BLOCK_N=8", "BLOCK_K=1024", "VEC_K=8")
    assert four[1] == 0 and four[0] <= plain[0] + 8 <= 128
    assert resources(*glu, "BLOCK_N=16")[1] > 0


def test_fp8_attention_loads_v_by_the_byte_and_bf16_by_ldmatrix():
    fp8 = main_loop("--preset", "attention-decode-fp8", "--set", "BLOCK_N=64")
    bf16 = main_loop("--preset", "attention-decode-bf16")
    assert fp8.get("LDS.U8", 0) >= 64 and fp8.get("F2FP.F16.E4M3.UNPACK_B", 0) > 0
    assert "LDS.U8" not in bf16 and "LDSM.16.MT88.4" in bf16 and "F2FP.F16.E4M3.UNPACK_B" not in bf16


def test_staged_fp8_v_is_transposed_by_ldmatrix_in_fp16():
    """`AttentionTiles.fp8_v_staged` (V_STAGED): V converted where loaded, then transposed in fp16; no byte
    loads left, and fewer instructions an iteration than the 8-bit transpose."""
    fp8 = main_loop("--preset", "attention-decode-fp8", "--set", "BLOCK_N=64")
    staged = main_loop("--preset", "attention-decode-fp8", "--set", "BLOCK_N=64", "V_STAGED=true")
    assert "LDS.U8" not in staged and "LDSM.16.MT88.4" in staged
    assert staged["F2FP.F16.E4M3.UNPACK_B"] == fp8["F2FP.F16.E4M3.UNPACK_B"]  # each value converted once
    assert sum(staged.values()) < 0.8 * sum(fp8.values())


def test_one_row_fp8_down_reads_its_input_without_shared_memory():
    """down at one row with SwiGLU in the prologue, on FP8_ONE_TILES (K runs of 8): the SwiGLU'd input
    reaches the weight's layout in registers, so its K loop holds no barrier and no shared-memory access,
    and still converts each weight once; the same product with K runs of 16 shuffles through shared
    memory every K tile."""
    runs = main_loop("--preset", "linear-one-row-fp8-down", issuing="FFMA")
    assert 2 * runs["F2FP.F16.E4M3.UNPACK_B"] == runs["HADD2.F32"] == runs["FFMA"]
    assert not [op for op in runs if op.startswith(("BAR", "LDS", "STS", "LDL", "STL"))]
    sixteen = main_loop("--preset", "linear-one-row-fp8-down", "--set", "VEC_K=0", issuing="FFMA")
    assert [op for op in sixteen if op.startswith("BAR")] and [op for op in sixteen if op.startswith(("LDS", "STS"))]


def test_the_tool_refuses_the_interpreter():
    done = subprocess.run([sys.executable, str(TOOL), "--preset", "attention-decode-bf16"], capture_output=True,
                          text=True, timeout=600, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert done.returncode != 0 and "TRITON_INTERPRET" in done.stderr


def test_one_row_fp8_product_converts_each_weight_once():
    """The one-row FP8 product as a decode step launches it (`skinny_config`'s tiles): each e4m3 pair to fp16
    in one instruction, each value to fp32 in one add, one multiply-add a weight; no register spills and
    no per-value conversion instruction (F2F), which is what RESULTS' account of its speed rests on."""
    fp8 = main_loop("--preset", "linear-one-row-fp8", issuing="FFMA")
    assert 2 * fp8["F2FP.F16.E4M3.UNPACK_B"] == fp8["HADD2.F32"] == fp8["FFMA"]
    assert not [op for op in fp8 if op.startswith(("LDL", "STL", "F2F."))]
    bf16 = main_loop("--preset", "linear-one-row-bf16", issuing="FFMA")
    assert "F2FP.F16.E4M3.UNPACK_B" not in bf16 and "HADD2.F32" not in bf16


def test_multirow_fp8_weights_stream_by_async_copies_once_sizes_are_divisible():
    """`_multirow_linear` at 144 rows over an FP8 gate_up (the verify batch of 16 requests): with the sizes
    divisible by 16, as a launch specialises them (the preset marks them), weight and rows reach shared
    memory by 16-byte async copies, and each e4m3 pair is converted once (to fp16, each value then to fp32,
    each pair packed to bf16) for the tensor cores; compiled without that knowledge the tiles load byte by
    byte, so a reading of this kernel must mark them."""
    preset = main_loop("--preset", "linear-multirow-fp8-glu", issuing="HGMMA")
    assert preset.get("LDGSTS.E.BYPASS.128", 0) > 0 and "LDG.E.U8" not in preset
    assert 2 * preset["F2FP.F16.E4M3.UNPACK_B"] == preset["HADD2.F32"] == 2 * preset["F2FP.BF16.F32.PACK_AB"]
    signature = ('{"X": "*bf16", "W": "*fp8e4nv", "Bias": "*bf16", "WScale": "*fp32", "Out": "*bf16", '
                 '"Part": "*fp32"}')
    bare = main_loop("--kernel", "blockspec.kernels.ops:_multirow_linear", "--signature", signature, "--set",
                     "ROWS_A=128", "ROWS_B=16", "HAS_B=true", "BLOCK_N=64", "BLOCK_K=64", "SPLIT=1", "GLU=true",
                     "HAS_BIAS=false", "WSCALE=1", "SCALE_BR=1", "SCALE_BC=4096", "EVEN_K=true", "PDL=true",
                     "--options", "num_warps=4", "num_stages=4", issuing="HGMMA")
    assert bare.get("LDG.E.U8", 0) > 0
