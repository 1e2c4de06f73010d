"""Which is closer to float64 at one row: the FP8 expert kernel or the bf16-dequantized reference?"""
import sys, torch
sys.path.insert(0, "tests")
import test_triton_moe as T
from blockspec.kernels import fp8, moe as K
from blockspec.models import moe as M
for rows in (1, 16):
    for block in ((128, 128), None):
        dtype, E, k = torch.bfloat16, 128, 8
        x = T.rand(rows, 2048, dtype=dtype)
        gate_up, down = T.experts(E, 2048, 768, dtype)
        ub, db = block or (1, 2048), block or (1, 768)
        (gu, gs), (dw, ds) = T.fp8_experts(gate_up, ub), T.fp8_experts(down, db)
        logits = T.rand(rows, E, dtype=dtype, seed=4)
        w, ids = M.route(logits, k, True)
        d64 = [torch.stack([fp8.dequantize_reference(q[e], s[e], b, torch.float64) for e in range(E)]) for q, s, b in ((gu, gs, ub), (dw, ds, db))]
        d16 = [torch.stack([fp8.dequantize_reference(q[e], s[e], b, dtype) for e in range(E)]) for q, s, b in ((gu, gs, ub), (dw, ds, db))]
        exact = M.experts_reference(x.double(), *d64, w.to(dtype).double(), ids)
        ref16 = M.experts_reference(x, *d16, w.to(dtype), ids)
        got = T.fused(x, gu, dw, logits, k, True, scales=K.ExpertScales(gs, ds, ub, db))
        sc = exact.abs().max().item()
        print(rows, block, f"scale {sc:.3f} kernel err mean {(got.double()-exact).abs().mean().item()/sc:.2e} max {(got.double()-exact).abs().max().item()/sc:.2e}; bf16 ref err mean {(ref16.double()-exact).abs().mean().item()/sc:.2e} max {(ref16.double()-exact).abs().max().item()/sc:.2e}", flush=True)
