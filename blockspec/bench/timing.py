"""Measurement primitives: CUDA-event timing, the copy bandwidth that sets decode floors, device syncs,
peak memory, and the summary statistics every report uses."""

from __future__ import annotations

import contextlib
import gc
import json
import statistics
import time
from collections.abc import Callable, Iterator

import torch


def event_seconds(fn: Callable[[], object]) -> float:
    """Seconds of device time from before to after fn's work on the current stream (CUDA events)."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / 1000


def cuda_time(fn: Callable[[], object], iters: int, repeats: int) -> tuple[float, float, float]:
    """Median, min and max seconds per call over `repeats` runs of `iters` calls (after warm-up)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()

    def run() -> None:
        for _ in range(iters):
            fn()
    samples = [event_seconds(run) / iters for _ in range(repeats)]
    return statistics.median(samples), min(samples), max(samples)


def graph_seconds(calls: list[Callable[[], object]], replays: int = 20) -> list[float]:
    """Seconds per call of each of `replays` replays of the calls captured as one CUDA graph (after a
    warm-up call each outside the capture, for compilation and autotuning): no launch gaps, as in a
    graphed engine step."""
    for fn in calls:
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in calls:
            fn()
    graph.replay()
    torch.cuda.synchronize()
    return [event_seconds(graph.replay) / len(calls) for _ in range(replays)]


def copy_bandwidth(nbytes: int = 4 << 30) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting read + write."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    med, _, _ = cuda_time(lambda: dst.copy_(src), iters=10, repeats=10)
    return 2 * nbytes / med  # the buffers are freed on return


def wall_seconds(fn: Callable[[], object]) -> float:
    """Host wall time of fn (CPU work, which finishes when fn returns)."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def cpu_read_bandwidth(repeats: int = 5) -> float:
    """Bytes per second of one pass over a 512 MB fp32 tensor (the best of `repeats`): a CPU floor's rate."""
    x = torch.ones(128 << 20)
    x.sum()
    return x.numel() * 4 / min(wall_seconds(x.sum) for _ in range(repeats))


def matmul_rate(dtype: torch.dtype, n: int = 8192) -> float:
    """Dense product rate in FLOP/s of an n x n by n x n product in `dtype` on the GPU: the ceiling of the
    products a many-row verify step is made of (the compute floor's rate)."""
    a = torch.randn(n, n, dtype=dtype, device="cuda")
    b = torch.randn(n, n, dtype=dtype, device="cuda")
    med, _, _ = cuda_time(lambda: a @ b, iters=10, repeats=5)
    return 2 * n**3 / med  # the operands are freed on return


def synchronize(device: torch.device) -> None:
    """Wait for the device, so a host clock read after it covers all queued work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_gb(device: torch.device) -> dict[str, float | str]:
    """Peak allocated and reserved GPU memory since the last reset (GB); 'n/a' off the GPU."""
    if device.type != "cuda":
        return {"peak_allocated_gb": "n/a", "peak_reserved_gb": "n/a"}
    return {"peak_allocated_gb": torch.cuda.max_memory_allocated(device) / 1e9,
            "peak_reserved_gb": torch.cuda.max_memory_reserved(device) / 1e9}


def allocated_bytes(device: torch.device) -> int:
    """Bytes the caching allocator hands out on the device now (0 off the GPU)."""
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def peak_allocated_bytes(device: torch.device) -> int:
    """The most bytes allocated on the device since the last `reset_peak_memory` (0 off the GPU)."""
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0


def free_memory(device: torch.device) -> None:
    """Return freed blocks to the device, so the next run's peak starts from what is really held."""
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()


FREEZE_COLLECTOR = True  # `collector_frozen` freezes; an A/B of the bench itself turns it off


@contextlib.contextmanager
def collector_frozen() -> Iterator[None]:
    """What is alive on entry (models, engines, their graphs and warm-up leftovers) kept out of the garbage
    collector's reach for the block, as a serving process keeps what it loaded: a full collection walks every
    tracked object, so a pass timed beside more engines would pay for their objects in its collections."""
    if not FREEZE_COLLECTOR:
        yield
        return
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def spread(values: list[float]) -> dict[str, float]:
    """Median, min and max of repeated measurements."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def kernel_record(bandwidth: float, **fields: object) -> dict:
    """The JSON record a kernel benchmark fills: date, GPU, torch, the measured copy bandwidth (bytes/s
    in, TB/s recorded), `fields`, then its runs (see `add_run`)."""
    return {"date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "copy_bandwidth_TBps": bandwidth / 1e12, **fields, "runs": []}


def add_run(record: dict, run: dict) -> None:
    """Append one measured case to `record`, print it as a JSON line (progress on long sweeps), and
    hand freed device memory back before the next case allocates its own."""
    record["runs"].append(run)
    print(json.dumps(run), flush=True)
    free_memory(torch.device("cuda"))
