"""Every cuBLASLt algorithm the heuristic offers for the engine's large-row products, timed against `F.linear`.

The verify and draft products of 32-64 requests (192-1,024 rows) run at 450-660 TFLOP/s under cuBLAS's first choice,
against about 790 for a large product: this measures how much of that a different cuBLASLt algorithm (tile, stages,
split-K) takes back, per shape, before any of it is built into the engine.

    python benchmarks/gemm_algos.py --rows 192,256,288,384,512 --out gemm_algos.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics

import torch
import torch.nn.functional as F

# cublasLt enums (cublasLt.h / library_types.h)
CUBLAS_COMPUTE_32F = 68
CUDA_R_32F, CUDA_R_16BF = 0, 14
DESC_TRANSA, DESC_TRANSB = 3, 4
OP_N, OP_T = 0, 1
PREF_MAX_WORKSPACE_BYTES = 1
CONFIG_ID, CONFIG_TILE_ID, CONFIG_SPLITK_NUM, CONFIG_STAGES_ID = 0, 1, 2, 6


class HeuristicResult(ctypes.Structure):
    _fields_ = [("algo", ctypes.c_uint64 * 8), ("workspace", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


def loaded_cublaslt() -> ctypes.CDLL:
    """The libcublasLt torch has loaded (a product first, so it is mapped), opened by its path."""
    a = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
    F.linear(a, a)
    torch.cuda.synchronize()
    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if "libcublasLt" in line}
    if not paths:
        raise RuntimeError("torch has not loaded libcublasLt")
    return ctypes.CDLL(sorted(paths)[0])


def check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"{what} returned cublasStatus {status}")


class LtProduct:
    """y[M, N] = x[M, K] @ w[N, K]^T in bf16 with fp32 accumulation through one cuBLASLt algorithm of the
    heuristic's list (torch's layout: column-major D[N, M] = op_T(w) op_N(x))."""

    def __init__(self, lib: ctypes.CDLL, m: int, n: int, k: int, workspace_bytes: int, count: int) -> None:
        self.lib = lib
        self.handle = ctypes.c_void_p()
        check(lib.cublasLtCreate(ctypes.byref(self.handle)), "cublasLtCreate")
        self.desc = ctypes.c_void_p()
        check(lib.cublasLtMatmulDescCreate(ctypes.byref(self.desc), CUBLAS_COMPUTE_32F, CUDA_R_32F), "DescCreate")
        for attr, op in ((DESC_TRANSA, OP_T), (DESC_TRANSB, OP_N)):
            v = ctypes.c_int32(op)
            check(lib.cublasLtMatmulDescSetAttribute(self.desc, attr, ctypes.byref(v), 4), "DescSetAttribute")
        self.a, self.b, self.c = (self._layout(k, n, k), self._layout(k, m, k), self._layout(n, m, n))
        pref = ctypes.c_void_p()
        check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "PreferenceCreate")
        ws = ctypes.c_uint64(workspace_bytes)
        check(lib.cublasLtMatmulPreferenceSetAttribute(pref, PREF_MAX_WORKSPACE_BYTES, ctypes.byref(ws), 8),
              "PreferenceSetAttribute")
        results = (HeuristicResult * count)()
        found = ctypes.c_int()
        check(lib.cublasLtMatmulAlgoGetHeuristic(self.handle, self.desc, self.a, self.b, self.c, self.c, pref, count,
                                                 results, ctypes.byref(found)), "AlgoGetHeuristic")
        self.results = [results[i] for i in range(found.value) if results[i].state == 0]
        self.workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device="cuda")
        self.alpha, self.beta = ctypes.c_float(1.0), ctypes.c_float(0.0)

    def _layout(self, rows: int, cols: int, ld: int) -> ctypes.c_void_p:
        layout = ctypes.c_void_p()
        check(self.lib.cublasLtMatrixLayoutCreate(ctypes.byref(layout), CUDA_R_16BF, ctypes.c_uint64(rows),
                                                  ctypes.c_uint64(cols), ctypes.c_int64(ld)), "LayoutCreate")
        return layout

    def config(self, i: int) -> dict[str, int]:
        out = {}
        for name, attr in (("id", CONFIG_ID), ("tile", CONFIG_TILE_ID), ("split_k", CONFIG_SPLITK_NUM),
                           ("stages", CONFIG_STAGES_ID)):
            v, written = ctypes.c_uint32(), ctypes.c_size_t()
            self.lib.cublasLtMatmulAlgoConfigGetAttribute(ctypes.byref(self.results[i].algo), attr, ctypes.byref(v),
                                                          4, ctypes.byref(written))
            out[name] = v.value
        out["waves"] = round(self.results[i].waves, 3)
        out["workspace"] = self.results[i].workspace
        return out

    def __call__(self, i: int, x: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> None:
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        check(self.lib.cublasLtMatmul(self.handle, self.desc, ctypes.byref(self.alpha), ctypes.c_void_p(w.data_ptr()),
                                      self.a, ctypes.c_void_p(x.data_ptr()), self.b, ctypes.byref(self.beta),
                                      ctypes.c_void_p(y.data_ptr()), self.c, ctypes.c_void_p(y.data_ptr()), self.c,
                                      ctypes.byref(self.results[i].algo), ctypes.c_void_p(self.workspace.data_ptr()),
                                      ctypes.c_size_t(self.results[i].workspace), stream), "cublasLtMatmul")


def time_us(fn, copies: int, reps: int, rounds: int) -> list[float]:
    """Per-call microseconds of `fn(j)` over rotating weight copies `j` (so L2 holds none of them), one median
    of `reps` calls per round, timed with CUDA events in a CUDA graph so that launch gaps do not count."""
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for j in range(copies):
            fn(j)
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(graph):
        for r in range(reps):
            fn(r % copies)
    out = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        graph.replay()
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) * 1e3 / reps)
    return out


SHAPES = {  # Qwen3-8B's target products (N, K); the drafter's layers have the same
    "qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="32,64,192,256,288,384,512,1024")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--algos", type=int, default=32)
    ap.add_argument("--workspace-mib", type=int, default=32)
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    lib = loaded_cublaslt()
    torch.manual_seed(0)
    report = []
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        copies = max(2, -(-200 * 2**20 // (n * k * 2)))
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5 for _ in range(copies)]
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            ref = F.linear(x.double(), ws[0].double())
            lt = LtProduct(lib, m, n, k, args.workspace_mib << 20, args.algos)
            flop = 2 * m * n * k
            row = {"shape": name, "m": m, "n": n, "k": k}
            for backend in ("cublas", "cublaslt"):
                torch.backends.cuda.preferred_blas_library(backend)
                t = time_us(lambda j: torch.mm(x, ws[j].t(), out=y), copies, args.reps, args.rounds)
                row[f"torch_{backend}_us"] = statistics.median(t)
            torch.backends.cuda.preferred_blas_library("cublas")
            algos = []
            for i in range(len(lt.results)):
                y.fill_(float("nan"))
                lt(i, x, ws[0], y)
                torch.cuda.synchronize()
                err = ((y.double() - ref).norm() / ref.norm()).item()
                t = time_us(lambda j, i=i: lt(i, x, ws[j], y), copies, args.reps, args.rounds)
                algos.append({"index": i, **lt.config(i), "us": statistics.median(t),
                              "spread_us": max(t) - min(t), "rel_err": err})
            row["algos"] = algos
            ok = [a for a in algos if a["rel_err"] < 1e-2]
            best = min(ok, key=lambda a: a["us"]) if ok else None
            row["best_lt_us"] = best["us"] if best else None
            row["best_lt_index"] = best["index"] if best else None
            base = row["torch_cublas_us"]
            print(f"{name:8s} m={m:5d}  torch {base:8.2f} us ({flop / base / 1e6:6.1f} TF/s)  "
                  f"lt-pref {row['torch_cublaslt_us']:8.2f}  lt[0] {algos[0]['us'] if algos else float('nan'):8.2f}  "
                  f"best lt {row['best_lt_us'] or float('nan'):8.2f} (#{row['best_lt_index']}, "
                  f"{flop / (row['best_lt_us'] or 1) / 1e6:6.1f} TF/s) of {len(algos)} algos", flush=True)
            report.append(row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
