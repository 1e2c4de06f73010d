"""Where a pass's engine steps go: every step of an `LLM.generate` over the embedded pair timed, with the requests it
prefilled and decoded and the speculative steps it launched (K, chained or not), grouped by kind.

At 16 in flight a speculative engine's requests finish, and are replaced, one at a time, so it meets an arrival
every few steps; the bench leaves those steps out of its decode figures. This shows what they cost beside the
drafting steps. With `--split`, the wall time of the calls a step makes (schedule, prefill, the first token's
sampling, decode, ...) summed over the pass; with `--profile`, a further pass under cProfile (the device waits show
as the calls that read results back); with `--timeline` (CUDA), a further pass under the torch profiler: by kind
of step, the device time of the work each step launched and the device's idle time while it ran on the host (a step
whose device sits idle waits on the host), and the pass's Chrome trace.

    PYTHONPATH=. python benchmarks/step_trace.py --methods plain,dspark --temperatures 0,0.7 --out step_trace
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import cProfile
import gc
import gzip
import io
import json
import pstats
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from blockspec.demo import default_pair, heldout_prompts
from blockspec.llm import LLM
from blockspec.sampling_params import SamplingParams


STEP_MARK = "engine step "  # the profiler range each step of a marked pass runs in, then its index


def patch(obj: Any, name: str, value: Any) -> Callable[[], None]:
    """Set obj.name on the instance; returns what undoes it (the instance's own value back, or none, so the
    class's method shows again and the instance holds no bound method of itself)."""
    had, old = name in vars(obj), vars(obj).get(name)
    setattr(obj, name, value)
    return lambda: setattr(obj, name, old) if had else delattr(obj, name)


def wrap(obj: Any, name: str, before: Callable[..., None]) -> Callable[[], None]:
    """Call `before` with obj.name's arguments ahead of it; returns what undoes it."""
    orig = getattr(obj, name)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        before(*args, **kwargs)
        return orig(*args, **kwargs)

    return patch(obj, name, wrapped)


def timed(obj: Any, name: str, label: str, totals: dict[str, list[float]]) -> Callable[[], None]:
    """Add obj.name's wall time and calls to totals[label]; returns what undoes it."""
    orig = getattr(obj, name)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        out = orig(*args, **kwargs)
        totals[label][0] += time.perf_counter() - t0
        totals[label][1] += 1
        return out

    return patch(obj, name, wrapped)


def traced_pass(llm: LLM, prompts: list[str], params: SamplingParams, split: bool, marks: bool = False
                ) -> tuple[float, int, list[dict[str, Any]], dict[str, list[float]]]:
    """One timed pass: wall seconds, tokens, each step's record, and with `split` the calls' totals. `marks`:
    each step runs inside a profiler range named "engine step <i>" (what `device_idle` reads)."""
    eng = llm.engine
    steps: list[dict[str, Any]] = []
    cur: dict[str, Any] = {}
    undo = [wrap(eng, "_prefill", lambda reqs: cur.__setitem__("prefill", cur.get("prefill", 0) + len(reqs))),
            wrap(eng, "_decode", lambda reqs: cur.__setitem__("decode", len(reqs))),
            wrap(eng, "_launch_spec", lambda reqs, k, *a, after=None, **kw: cur.setdefault("launch", []).append(
                (len(reqs), k, after is not None)))]
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    if split:
        undo += [timed(eng, n, n, totals) for n in ("_schedule", "_prefill", "_decode", "_append")]
        undo += [timed(eng.sampling, "sample", "first tokens (sampling.sample)", totals),
                 timed(eng.runner, "forward", "prefill forward (runner.forward)", totals),
                 timed(eng.pages, "sync", "pages.sync", totals)]
    step = eng._step

    def one_step() -> Any:
        cur.clear()
        t0 = time.perf_counter()
        with torch.profiler.record_function(f"{STEP_MARK}{len(steps)}") if marks else contextlib.nullcontext():
            out = step()
        cur["ms"] = 1e3 * (time.perf_counter() - t0)
        steps.append(dict(cur))
        return out

    undo.append(patch(eng, "_step", one_step))
    gc.collect()
    gc.freeze()  # as the bench times its rounds: what is alive stays out of the collector's walks
    try:
        sync(llm)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        sync(llm)
        wall = time.perf_counter() - t0
    finally:
        gc.unfreeze()
        for u in reversed(undo):
            u()
    return wall, sum(len(o.outputs[0].token_ids) for o in outs), steps, totals


DEVICE_WORK = ("kernel", "gpu_memcpy", "gpu_memset")  # a Chrome trace's device events (not its ranges projected there)


def trace_kernels(events: list[dict[str, Any]]) -> tuple[list[tuple[float, float, int | None]],
                                                          dict[int, tuple[float, float]]]:
    """From a Chrome trace's events (us): each kernel, copy and set on the device with the step whose host range holds
    the call that launched it (a graph replay's kernels are the replay's), and each marked step's host range."""
    steps = {int(e["name"][len(STEP_MARK):]): (e["ts"], e["ts"] + e["dur"]) for e in events
             if e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith(STEP_MARK)}
    launched = {e["args"]["correlation"]: e["ts"] for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    order = sorted(steps.items(), key=lambda kv: kv[1][0])
    starts = [r[0] for _, r in order]

    def owner(t: float | None) -> int | None:  # the step whose host range holds t
        j = bisect.bisect_right(starts, t) - 1 if t is not None else -1
        return order[j][0] if j >= 0 and t <= order[j][1][1] else None

    kernels = [(e["ts"], e["ts"] + e["dur"], owner(launched.get(e.get("args", {}).get("correlation"))))
               for e in events if e.get("cat") in DEVICE_WORK]
    return kernels, steps


def device_idle(kernels: list[tuple[float, float, int | None]], steps: dict[int, tuple[float, float]],
                min_gap: float = 5.0) -> dict[int, dict[str, float]]:
    """Per step: the device time of the work it launched (the union of those kernels' intervals: it may run in a
    later step's range) and the device's idle time while the step ran on the host (gaps of at least `min_gap` us
    between any kernels, clipped to the step's host range): a step whose device sits idle waits on the host. Under
    the profiler the host runs slower (a step about twice its unprofiled time), so this idle time bounds the
    unprofiled pass's from above."""
    out = {i: {"busy_us": 0.0, "idle_us": 0.0, "gaps": 0} for i in steps}
    mine: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for a, b, i in kernels:
        if i in out:
            mine[i].append((a, b))
    for i, spans in mine.items():
        end = None
        for a, b in sorted(spans):
            out[i]["busy_us"] += max(0.0, b - max(a, end if end is not None else a))
            end = b if end is None else max(end, b)
    gaps, end = [], None
    for a, b, _ in sorted(kernels):
        if end is not None and a - end >= min_gap:
            gaps.append((end, a))
        end = b if end is None else max(end, b)
    for i, (lo, hi) in steps.items():
        for g0, g1 in gaps[max(0, bisect.bisect_right(gaps, (lo,)) - 1):]:  # from the gap open at lo, if any
            if g0 >= hi:
                break
            if min(hi, g1) > max(lo, g0):
                out[i]["idle_us"] += min(hi, g1) - max(lo, g0)
                out[i]["gaps"] += 1
    return out


def timeline(llm: LLM, prompts: list[str], params: SamplingParams, out: Path, name: str) -> list[str]:
    """A pass under the torch profiler: by kind of step, the device time of what it launched and the device's idle
    time while it ran, and the pass's Chrome trace."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        _, _, steps, _ = traced_pass(llm, prompts, params, split=False, marks=True)
    trace = out / f"timeline_{name.replace(' ', '_')}.json"
    prof.export_chrome_trace(str(trace))
    events = json.loads(trace.read_text())["traceEvents"]
    with open(trace, "rb") as src, gzip.open(f"{trace}.gz", "wb") as dst:
        dst.write(src.read())
    trace.unlink()
    kernels, ranges = trace_kernels(events)
    idle = device_idle(kernels, ranges)
    by: dict[str, list[dict[str, float]]] = defaultdict(list)
    for i, step in enumerate(steps):
        if i in idle:
            by[kind(step)].append(idle[i])
    lines = [f"{name} timeline: {len(kernels)} kernels over {len(ranges)} steps"]
    for k, rows in sorted(by.items(), key=lambda kv: -sum(r["idle_us"] + r["busy_us"] for r in kv[1]))[:25]:
        n = len(rows)
        lines.append(f"    {k}: {n} steps, device time of its launches {sum(r['busy_us'] for r in rows) / n / 1e3:.3f} "
                     f"ms, device idle while it ran {sum(r['idle_us'] for r in rows) / n / 1e3:.3f} ms in "
                     f"{sum(r['gaps'] for r in rows) / n:.1f} gaps a step")
    return lines


def sync(llm: LLM) -> None:
    if llm.engine.device.type == "cuda":
        torch.cuda.synchronize()


def kind(step: dict[str, Any]) -> str:
    """"prefill+decode15 launch16K8c": the step's prefill, its decode's requests, its launches (c: chained)."""
    return (("prefill+" if step.get("prefill") else "") + f"decode{step.get('decode', 0)}"
            + "".join(f" launch{n}K{k}{'c' if c else ''}" for n, k, c in step.get("launch", [])))


def report(name: str, wall: float, tokens: int, steps: list[dict[str, Any]], totals: dict[str, list[float]]) -> list[str]:
    pre = [s for s in steps if s.get("prefill")]
    dec = [s for s in steps if not s.get("prefill") and s.get("decode")]
    lines = [f"{name}: {tokens} tokens in {1e3 * wall:.1f} ms = {tokens / wall:,.0f} tok/s; {len(steps)} steps, "
             f"{len(pre)} with a prefill ({sum(s['ms'] for s in pre):.1f} ms); decode-only steps {len(dec)}, mean "
             f"{sum(s['decode'] for s in dec) / max(len(dec), 1):.2f} requests, {sum(s['ms'] for s in dec):.1f} ms"]
    by: dict[str, list[float]] = defaultdict(list)
    for s in steps:
        by[kind(s)].append(s["ms"])
    for k, ms in sorted(by.items(), key=lambda kv: -sum(kv[1]))[:25]:
        lines.append(f"    {k}: {len(ms)} steps, {sum(ms):.1f} ms, {sum(ms) / len(ms):.3f} ms each")
    for label, (seconds, calls) in sorted(totals.items(), key=lambda kv: -kv[1][0]):
        lines.append(f"    [split] {label}: {1e3 * seconds:.1f} ms over {calls} calls")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--methods", default="plain,dspark", help="plain, dflash, dspark (comma-separated)")
    ap.add_argument("--temperatures", default="0")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--in-flight", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--split", action="store_true", help="time the calls each step makes")
    ap.add_argument("--profile", action="store_true", help="a further pass under cProfile")
    ap.add_argument("--timeline", action="store_true", help="a further pass under the torch profiler (CUDA)")
    ap.add_argument("--spec-options", type=json.loads, default={},
                    help='speculative_config fields as JSON, e.g. \'{"adaptive_draft_length": false}\' (a fixed K)')
    ap.add_argument("--out", default="step_trace")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    base, _ = default_pair()
    prompts = heldout_prompts(args.requests)
    lines = []
    for method in args.methods.split(","):
        spec = None if method == "plain" else {"method": method, "model": str(base / method), **args.spec_options}
        llm = LLM(str(base / "target"), device=args.device, dtype="float32", seed=0, max_num_seqs=args.in_flight,
                  speculative_config=spec)
        for temp in (float(t) for t in args.temperatures.split(",")):
            params = SamplingParams(temperature=temp, max_tokens=args.max_tokens, ignore_eos=True)
            for _ in range(2):  # graphs captured, kernels compiled, the draft-length policy settled
                llm.generate(prompts, params, use_tqdm=False)
            wall, tokens, steps, totals = traced_pass(llm, prompts, params, args.split)
            run = report(f"{method} T={temp}", wall, tokens, steps, totals)
            lines += run
            print(run[0], flush=True)
            (out / f"steps_{method}_T{temp}.json").write_text(json.dumps(steps))
            if args.timeline and llm.engine.device.type == "cuda":
                run = timeline(llm, prompts, params, out, f"{method} T={temp}")
                lines += run
                print("\n".join(run), flush=True)
            if args.profile:
                prof = cProfile.Profile()
                prof.enable()
                llm.generate(prompts, params, use_tqdm=False)
                sync(llm)
                prof.disable()
                buf = io.StringIO()
                stats = pstats.Stats(prof, stream=buf)
                stats.sort_stats("tottime").print_stats(45)
                stats.sort_stats("cumulative").print_callees("_prefill")
                (out / f"profile_{method}_T{temp}.txt").write_text(buf.getvalue())
        del llm
        gc.collect()
    (out / "step_trace.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
