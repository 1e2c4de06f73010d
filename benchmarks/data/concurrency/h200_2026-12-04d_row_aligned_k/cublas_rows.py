"""cuBLAS bf16 products of the Qwen3-8B shapes over a verify batch's rows: is the time per row lumpy?"""
import statistics, torch, torch.nn.functional as F
from blockspec.bench.timing import graph_seconds, matmul_rate
torch.manual_seed(0)
rate = matmul_rate(torch.bfloat16)
print(f"matmul rate {rate/1e12:.1f} TFLOP/s")
shapes = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 24576), "down": (12288, 4096), "head": (4096, 151936)}
weights = {n: [torch.randn(o, i, dtype=torch.bfloat16, device="cuda") * 0.02 for _ in range(1 if n == "head" else 4)]
           for n, (i, o) in shapes.items()}
rows_list = [int(r) for r in "192 224 240 256 272 279 288 304 320 336 352 368 384 400 416 448 480 512".split()]
res = {}
for rows in rows_list:
    line = []
    tot = 0.0
    for n, (i, o) in shapes.items():
        x = torch.randn(rows, i, dtype=torch.bfloat16, device="cuda")
        calls = [lambda w=w, x=x: F.linear(x, w) for w in weights[n]] * (1 if n == "head" else 2)
        t = statistics.median(graph_seconds(calls, 15))
        res[(rows, n)] = t
        if n != "head":
            tot += t
        line.append(f"{n} {t*1e6:7.1f} us ({2*rows*i*o/t/1e12:5.0f} TF/s)")
    print(f"rows {rows:4d}: layer {tot*1e6:7.1f} us ({tot*1e6/rows:5.3f} us/row) | " + " | ".join(line), flush=True)
