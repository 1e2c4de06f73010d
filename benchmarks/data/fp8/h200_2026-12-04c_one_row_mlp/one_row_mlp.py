"""Next session: the one-row FP8 MLP as a decode step could run it, two arrangements, CUDA graphs over enough weight
copies to defeat L2, interleaved rounds, median us a layer:
  A (shipped): gate_up with the RMSNorm in its prologue (bf16 'wide' tile), then down with SwiGLU in its prologue (vec 8)
  B: gate_up with the norm in its prologue and SwiGLU in its GLU epilogue (K runs of 8, 4 + 4 rows a program), then down
     plain (vec 8 'tall' tile)
Both equal the unfused ops' roundings; B is what GatedMLP would do at one row if it measures faster."""
import statistics

import torch

from blockspec.bench.timing import graph_seconds
from blockspec.kernels import fp8
from blockspec.kernels.ops import SkinnyConfig, skinny_linear

H, I = 4096, 12288
copies = 3
gu = [fp8.quantize_per_channel(torch.randn(2 * I, H, device="cuda", dtype=torch.bfloat16) * H**-0.5) for _ in range(copies)]
dn = [fp8.quantize_per_channel(torch.randn(H, I, device="cuda", dtype=torch.bfloat16) * I**-0.5) for _ in range(copies)]
x = torch.randn(1, H, device="cuda", dtype=torch.bfloat16)
res = torch.randn(1, H, device="cuda", dtype=torch.bfloat16)
nw = torch.rand(H, device="cuda", dtype=torch.bfloat16) + 0.5
glu_tiles = {"B 8/1024/4/3": SkinnyConfig(1, 8, 1024, 4, 3, vec_k=8), "B 8/1024/4/1": SkinnyConfig(1, 8, 1024, 4, 1, vec_k=8),
             "B 16/1024/4/3": SkinnyConfig(1, 16, 1024, 4, 3, vec_k=8), "B 8/512/2/3": SkinnyConfig(1, 8, 512, 2, 3, vec_k=8)}


def arm_a(i):
    (wg, sg), (wd, sd) = gu[i], dn[i]
    h = skinny_linear(x, wg, norm_weight=nw, eps=1e-6, weight_scale=sg, scale_block=(1, H))
    return skinny_linear(h, wd, swiglu=True, residual=res, weight_scale=sd, scale_block=(1, I))


def arm_b(i, cfg):
    (wg, sg), (wd, sd) = gu[i], dn[i]
    h = skinny_linear(x, wg, norm_weight=nw, eps=1e-6, glu=True, config=cfg, weight_scale=sg, scale_block=(1, H))
    return skinny_linear(h, wd, residual=res, weight_scale=sd, scale_block=(1, I))


want = arm_a(0)
arms = {"A shipped": [lambda i=i: arm_a(i) for i in range(copies)]}
for name, cfg in glu_tiles.items():
    got = arm_b(0, cfg)
    print(name, "max |B - A|", (got.float() - want.float()).abs().max().item(), flush=True)
    arms[name] = [lambda i=i, c=cfg: arm_b(i, c) for i in range(copies)]
times = {a: [] for a in arms}
for _ in range(5):
    for a, fns in arms.items():
        times[a] += graph_seconds(fns, replays=10)
floor = (2 * I * H + H * I) / 4.28e12 * 1e6
print(f"MLP floor {floor:.1f} us (FP8 bytes at 4.28 TB/s)")
for a, t in times.items():
    print(f"{a}: {statistics.median(t) * 1e6:.1f} us [{min(t) * 1e6:.1f}-{max(t) * 1e6:.1f}]")
