"""What a Triton kernel issues on sm_90, without a GPU: the kernel compiled offline (`kernels.sm90`, pointers
and strides aligned as a launch specialises them), its SASS's instruction count, shared memory, and per loop
the opcodes one iteration issues per thread. A kernel change can be read here before device time is spent
on it; timings still come from the GPU. The SASS is this machine's Triton's (the device may run another).

    python benchmarks/kernel_sass.py --preset attention-decode-fp8
    python benchmarks/kernel_sass.py --preset attention-decode-fp8 --set BLOCK_N=64 --options num_stages=2
    python benchmarks/kernel_sass.py --preset linear-one-row-fp8
    python benchmarks/kernel_sass.py --preset linear-one-row-fp8-down
    python benchmarks/kernel_sass.py --preset linear-multirow-fp8-glu
    python benchmarks/kernel_sass.py --kernel blockspec.kernels.ops:_rms_norm --signature '{"X": "*bf16", ...}' \
        --set BLOCK=1024 --dump rms.sass
"""

from __future__ import annotations

import argparse
import importlib
import json
import os

_ATTENTION_SIGNATURE = {"Q": "*bf16", "K": "*{kv}", "V": "*{kv}", "Out": "*bf16", "Table": "*i32", "Slots": "*i32",
                        "Lo": "*i32", "Hi": "*i32", "Counters": "*i32", "PartAcc": "*fp32", "PartMax": "*fp32",
                        "PartSum": "*fp32", "scale_log2": "fp32", "v_scale": "fp32"}
# decode blocks of 16 rows at Qwen3-8B's heads (32 query, 8 KV, head_dim 128), pages of 64, as the engine
# launches them at 16 requests (no per-key page lookups); the FP8 cache's key tile and fp16 dots
_ATTENTION_DECODE = {"KV_HEADS": 8, "GROUP": 4, "HEAD_DIM": 128, "BLOCK_D": 128, "BLOCK_M": 16, "MIN_TILES": 1,
                     "LONG_TILES": 8, "MAX_USED": 264, "MERGE_UNROLL": 4, "IEEE": False, "PAGE": 64, "PER_KEY": False,
                     "PDL": True}
ATTENTION_LAUNCH = {"num_warps": 4, "num_stages": 3, "launch_pdl": True}  # block_attention's (AttentionTiles)


Preset = tuple[str, dict[str, str], dict[str, object], dict[str, object], tuple[str, ...]]


def one_row_linear(weight: str, n: int = 6144, k: int = 4096, prologue: int = 0) -> Preset:
    """`_skinny_linear` as a decode step launches one of Qwen3-8B's products at one bf16 row (by default
    qkv, 4096 -> 6144, no fused prologue; prologue 2: SwiGLU, as down takes it), with the tiles
    `ops.skinny_config` picks for the weight's dtype; "fp8e4nv" weights take per-channel scales (WSCALE 1).
    The sizes are marked divisible by 16, as the launch specialises them."""
    from blockspec.kernels.ops import skinny_config

    fp8 = weight == "fp8e4nv"
    cfg = skinny_config(1, n, k, prologue, fp8=fp8)
    signature = {"X": "*bf16", "W": f"*{weight}", "Bias": "*bf16", "NormW": "*bf16", "Res": "*bf16", "Out": "*bf16",
                 "Sums": "*fp32", "Scaled": "*bf16", "WScale": "*fp32", "eps": "fp32"}
    constexprs = {"PROLOGUE": prologue, "GLU": False, "HAS_BIAS": False, "HAS_RES": False, "EMIT": False,
                  "SUMS_BLOCK": 1, "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k,
                  "EVEN_K": True, "IEEE": False, "WSCALE": 1 if fp8 else 0, "SCALE_BR": 1, "SCALE_BC": k if fp8 else 1,
                  "PDL": True, "VEC_K": cfg.vec_k}
    launch = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages, "launch_pdl": True}
    return "blockspec.kernels.ops:_skinny_linear", signature, constexprs, launch, ("n", "k")


def multirow_fp8_linear(rows: int = 144, n: int = 12288, k: int = 4096, glu: bool = True) -> Preset:
    """`_multirow_linear` as `fp8.fp8_linear` launches it for `rows` bf16 rows of a verify or draft batch
    over a per-channel e4m3 weight (by default Qwen3-8B's gate_up with SwiGLU in its epilogue: 2 x 12,288
    rows of 4,096), on `fp8.MULTIROW_TILES` and the stages `multirow_stages` gives them; the sizes are
    marked divisible by 16, as the launch specialises them."""
    from blockspec.kernels.fp8 import MULTIROW_TILES
    from blockspec.kernels.ops import MultirowConfig, multirow_stages, product_class, row_groups

    cfg = MultirowConfig(*MULTIROW_TILES[product_class(2 * n if glu else n, k)])
    group, rows_a, rows_b = row_groups(rows)
    signature = {"X": "*bf16", "W": "*fp8e4nv", "Bias": "*bf16", "WScale": "*fp32", "Out": "*bf16", "Part": "*fp32"}
    constexprs = {"ROWS_A": rows_a, "ROWS_B": max(rows_b, 16), "HAS_B": rows_b > 0, "BLOCK_N": cfg.block_n,
                  "BLOCK_K": cfg.block_k, "SPLIT": cfg.split, "GLU": glu, "HAS_BIAS": False, "WSCALE": 1,
                  "SCALE_BR": 1, "SCALE_BC": k, "EVEN_K": True, "PDL": True}
    stages = multirow_stages(cfg.num_stages, cfg.block_n, cfg.block_k, rows_a + rows_b, glu, 1, 2)
    launch = {"num_warps": cfg.num_warps, "num_stages": stages, "launch_pdl": True}
    return "blockspec.kernels.ops:_multirow_linear", signature, constexprs, launch, ("n", "k", "k_split")


PRESETS = {  # name -> (module:kernel, argument types, constexprs, launch options, integers divisible by 16)
    "attention-decode-bf16": ("blockspec.kernels.attention:_block_attention",
                              {n: t.format(kv="bf16") for n, t in _ATTENTION_SIGNATURE.items()},
                              {**_ATTENTION_DECODE, "BLOCK_N": 64, "F16_DOTS": False}, ATTENTION_LAUNCH, ()),
    "attention-decode-fp8": ("blockspec.kernels.attention:_block_attention",
                             {n: t.format(kv="fp8e4nv") for n, t in _ATTENTION_SIGNATURE.items()},
                             {**_ATTENTION_DECODE, "BLOCK_N": 128, "F16_DOTS": True}, ATTENTION_LAUNCH, ()),
    "linear-one-row-bf16": one_row_linear("bf16"),
    "linear-one-row-fp8": one_row_linear("fp8e4nv"),
    "linear-one-row-fp8-down": one_row_linear("fp8e4nv", 4096, 12288, prologue=2),
    "linear-multirow-fp8-glu": multirow_fp8_linear(),
}


def assignments(pairs: list[str]) -> dict[str, object]:
    """NAME=VALUE pairs, each value read as JSON (numbers, true / false) or else kept as a string."""
    out = {}
    for pair in pairs:
        name, _, value = pair.partition("=")
        try:
            out[name] = json.loads(value)
        except json.JSONDecodeError:
            out[name] = value
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=list(PRESETS), help="a kernel and the arguments the engine launches it with")
    ap.add_argument("--kernel", help="module:function of a @triton.jit kernel (instead of a preset)")
    ap.add_argument("--signature", default="{}", help="JSON: argument -> Triton type (others i32), over the preset's")
    ap.add_argument("--set", nargs="*", default=[], metavar="NAME=VALUE", help="constexpr arguments, over the preset's")
    ap.add_argument("--divisible", nargs="*", default=[], metavar="NAME",
                    help="integer arguments a launch would specialise as divisible by 16 (sizes such as n, k)")
    ap.add_argument("--options", nargs="*", default=[], metavar="NAME=VALUE",
                    help="launch options over the preset's (num_warps, num_stages, launch_pdl; without a preset "
                         f"{ATTENTION_LAUNCH})")
    ap.add_argument("--top", type=int, default=30, help="opcodes shown per loop")
    ap.add_argument("--dump", help="write the whole SASS here")
    args = ap.parse_args()
    if not args.preset and not args.kernel:
        ap.error("give --preset or --kernel")
    if os.environ.get("TRITON_INTERPRET") == "1":
        ap.error("unset TRITON_INTERPRET: the interpreter replaces the language this compiles")
    from blockspec.kernels import sm90

    target, signature, constexprs, launch, divisible = (PRESETS[args.preset] if args.preset else
                                                        (args.kernel, {}, {}, ATTENTION_LAUNCH, ()))
    module, _, name = (args.kernel or target).partition(":")
    kernel = sm90.compile_sm90(getattr(importlib.import_module(module), name),
                               {**signature, **json.loads(args.signature)}, {**constexprs, **assignments(args.set)},
                               {**launch, **assignments(args.options)}, aligned=True,
                               divisible=(*divisible, *args.divisible))
    text = sm90.sass(kernel)
    if args.dump:
        with open(args.dump, "w") as f:
            f.write(text)
    total = sum(sm90.opcodes(text.splitlines()).values())
    used = sm90.resources(kernel)
    print(f"{module}:{name}: {total} instructions, {kernel.metadata.shared} bytes of shared memory, "
          f"{used['REG']} registers and {used['STACK']} bytes of spills a thread")
    for label, ops in sm90.loops(text):
        print(f"loop {label}: {sum(ops.values())} instructions an iteration")
        print("   " + " ".join(f"{op}:{n}" for op, n in ops.most_common(args.top)))


if __name__ == "__main__":
    main()
