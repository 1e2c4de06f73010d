"""Triton kernels compiled for sm_90 (H100 / H200) on a machine without a GPU: Triton's LLVM, its bundled
ptxas and nvdisasm give the PTX and SASS the device would run. The tests check launch order in the PTX
(tests/test_dependent_launch.py); `benchmarks/kernel_sass.py` counts what a kernel's loops issue before
device time is spent on it. Run with TRITON_INTERPRET unset: the interpreter replaces the language these
compile."""

from __future__ import annotations

import collections
import os
import re
import subprocess
import tempfile

from blockspec.kernels import triton


def source(fn, signature: dict[str, str], constexprs: dict[str, object], aligned: bool = False,
           divisible: tuple[str, ...] = ()):
    """The ASTSource of `fn` (a `@triton.jit` function): `signature` maps arguments to Triton types ("*bf16",
    "fp32"); a constexpr argument not in `constexprs` takes its default, any other argument in neither is an
    i32. `aligned` marks pointers and `stride*` arguments divisible by 16, as a launch with aligned tensors
    specialises them (vector loads follow), and `divisible` the integer arguments named (a launch
    specialises every integer divisible by 16 that it may: offsets computed from them stay aligned, so the
    loads they address pipeline)."""
    from triton.compiler import ASTSource

    names = fn.arg_names
    constexprs = {**{p.name: p.default for p in fn.params if p.is_constexpr and p.has_default}, **constexprs}
    kinds = {n: signature.get(n, "constexpr" if n in constexprs else "i32") for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names
             if aligned and (kinds[n].startswith("*") or n.startswith("stride")) or n in divisible}
    return ASTSource(fn=fn, signature=kinds, constexprs={(names.index(n),): v for n, v in constexprs.items()},
                     attrs=attrs)


def compile_sm90(fn, signature: dict[str, str], constexprs: dict[str, object], options: dict | None = None,
                 aligned: bool = False, divisible: tuple[str, ...] = ()):
    """`fn` compiled for sm_90 (`source`'s arguments; `options` as a launch takes them: num_warps,
    num_stages, launch_pdl): the CompiledKernel, whose `asm` holds "ptx" and "cubin" and whose
    `metadata.shared` the shared memory a program takes."""
    if triton is None:
        raise RuntimeError("compiling for sm_90 needs the triton package (pip install triton)")
    from triton.backends.compiler import GPUTarget

    return triton.compile(source(fn, signature, constexprs, aligned, divisible), target=GPUTarget("cuda", 90, 32),
                          options=options or {})


def _cubin_tool(kernel, tool: str, *args: str) -> str:
    """The output of one of the CUDA binary tools Triton bundles, run on the kernel's cubin."""
    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", tool)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(kernel.asm["cubin"])
        cubin.flush()
        return subprocess.run([path, *args, cubin.name], capture_output=True, text=True, check=True).stdout


def sass(kernel) -> str:
    """The SASS of a compiled kernel, through nvdisasm."""
    return _cubin_tool(kernel, "nvdisasm", "-c")


def resources(kernel) -> dict[str, int]:
    """What a thread of the kernel holds (cuobjdump): REG registers (so how many programs an SM runs at
    once), STACK bytes spilled to local memory, and the rest of its resource line."""
    line = next(line for line in _cubin_tool(kernel, "cuobjdump", "--dump-resource-usage").splitlines()
                if "REG:" in line)
    return {name: int(value) for name, value in re.findall(r"([A-Z]+(?:\[\d+\])?):(\d+)", line)}


_INSTRUCTION = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Z0-9_]+)*)")
_LABEL = re.compile(r"^\s*\.(L_x_\d+):")
_BACK_BRANCH = re.compile(r"\bBRA\s+`?\(?\.(L_x_\d+)")


def opcodes(lines: list[str]) -> collections.Counter:
    """Instructions by opcode with their modifiers (LDS.U8, HMMA.16816.F32, ...)."""
    return collections.Counter(m.group(1) for line in lines if (m := _INSTRUCTION.search(line)))


def loops(sass_text: str) -> list[tuple[str, collections.Counter]]:
    """Each loop of the SASS (a label and the backward branch to it) with its body's opcodes: what one
    iteration issues per thread."""
    lines = sass_text.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := _LABEL.match(line))}
    found = []
    for i, line in enumerate(lines):
        m = _BACK_BRANCH.search(line)
        if m and labels.get(m.group(1), i) < i:
            found.append((m.group(1), opcodes(lines[labels[m.group(1)]:i + 1])))
    return found
