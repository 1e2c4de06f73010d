"""benchmarks/kernel_sass.py: a kernel compiled for sm_90 on a machine without a GPU, read as SASS per loop.
Run as a user runs it (a subprocess without TRITON_INTERPRET); its reading of the attention kernel is the
one RESULTS gives for FP8 decode: V's e4m3 tile reaches the P.V product through single-byte shared-memory
loads, where a bf16 tile is transposed by ldmatrix."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[1] / "benchmarks" / "kernel_sass.py"


def main_loop(*args: str) -> dict[str, int]:
    """The opcodes of the kernel's loop that issues tensor-core products (the attention's key loop)."""
    pytest.importorskip("triton.backends.nvidia.compiler")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(TOOL), *args, "--top", "1000"], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    loops = [dict((op, int(n)) for op, n in re.findall(r"(\S+):(\d+)", line))
             for line in done.stdout.splitlines() if line.startswith("   ")]
    hmma = [ops for ops in loops if any(op.startswith("HMMA") for op in ops)]
    assert len(hmma) == 1, done.stdout
    return hmma[0]


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


def test_the_tool_refuses_the_interpreter():
    done = subprocess.run([sys.executable, str(TOOL), "--preset", "attention-decode-bf16"], capture_output=True,
                          text=True, timeout=600, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert done.returncode != 0 and "TRITON_INTERPRET" in done.stderr
