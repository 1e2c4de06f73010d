"""Load test for `blockspec serve`, bounded and loopback only.

For every concurrency level (default 1, 4, 16, 64), temperature (0 and 0.7) and speculation setting
(on, and off through the per-request `use_speculation: false` opt-out, on the same server), N
streaming requests with mixed prompt lengths go out through `level` concurrent clients. Reported per
cell: completed, errors, output tok/s (all output tokens / the cell's wall time), TTFT and TPOT
p50 / p90 / p99, and whether every output equals its twin from the other speculation setting
(same seed, so this holds at T > 0 too). Outputs are forced to max_tokens (ignore_eos), so both
settings do the same work.

  python benchmarks/load_test.py --model DIR --draft-model DIR       # starts `blockspec serve` itself
  python benchmarks/load_test.py --url http://127.0.0.1:8000 --model-name NAME   # a running server

Prompts are slices of the Python standard library's source (text), or with --token-vocab V random
token ids below V (for models without a tokenizer).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import socket
import statistics
import subprocess
import sys
import sysconfig
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families


@dataclass
class Outcome:
    ok: bool
    token_ids: list[int] = field(default_factory=list)
    ttft: float | None = None
    tpot: float | None = None
    error: str | None = None


@dataclass
class Cell:
    level: int
    temperature: float
    speculation: bool
    completed: int
    errors: int
    output_tokens: int
    wall_s: float
    tok_per_s: float
    ttft_ms: dict[str, float]
    tpot_ms: dict[str, float]
    mean_acceptance_length: float | None
    # share of the decode steps (after each request's first token) in which a request drafted:
    # how often the draft-length policy chose to speculate
    draft_step_share: float | None = None
    identical_to_twin: bool | None = None
    round: int = 0
    # server steps by the draft length the policy chose (/metrics, differenced over the cell; every
    # step the server ran meanwhile, the twin setting's opted-out requests included)
    policy_steps: dict[str, int] = field(default_factory=dict)
    preemptions: int = 0  # requests the server preempted for KV pages during the cell (/metrics)
    parked_joins: int = 0  # requests that joined a parked batch, so never fed the drafter (/metrics)


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    qs = statistics.quantiles(values, n=100, method="inclusive") if len(values) > 1 else [values[0]] * 99
    return {f"p{p}": round(qs[p - 1] * 1000, 2) for p in (50, 90, 99)}


def make_prompts(n: int, lengths: list[int], vocab: int | None, seed: int) -> list[str | list[int]]:
    """n prompts cycling through `lengths` (tokens for token-id prompts, characters for text)."""
    rng = random.Random(seed)
    if vocab is not None:
        return [[rng.randrange(2, vocab) for _ in range(lengths[i % len(lengths)])] for i in range(n)]
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:40]
    source = "\n".join(p.read_text(errors="replace") for p in files)
    out: list[str | list[int]] = []
    for i in range(n):
        start = rng.randrange(0, len(source) - max(lengths))
        out.append(source[start : start + lengths[i % len(lengths)]])
    return out


async def one_request(client: httpx.AsyncClient, body: dict[str, Any], timeout: float) -> tuple[Outcome, dict]:
    """One streamed completion; TTFT is the first chunk that carries tokens, TPOT the mean gap after it."""
    t0 = time.perf_counter()
    ids: list[int] = []
    t_first = None
    spec: dict = {}
    try:
        async with client.stream("POST", "/v1/completions", json=body, timeout=timeout) as r:
            if r.status_code != 200:
                return Outcome(False, error=f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}"), spec
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return Outcome(False, error=chunk["error"]["message"]), spec
                for choice in chunk["choices"]:
                    if choice.get("token_ids") and t_first is None:
                        t_first = time.perf_counter()
                    ids += choice.get("token_ids") or []
                spec = chunk.get("spec_decode") or spec
    except (httpx.HTTPError, TimeoutError) as exc:
        return Outcome(False, error=f"{type(exc).__name__}: {exc}"), spec
    t_end = time.perf_counter()
    if t_first is None:
        return Outcome(False, error="no tokens"), spec
    tpot = (t_end - t_first) / (len(ids) - 1) if len(ids) > 1 else None
    return Outcome(True, ids, t_first - t0, tpot), spec


async def drive(url: str, model: str, jobs: list[tuple[int, str | list[int]]], clients: int, temperature: float,
                speculation: bool, max_tokens: int, timeout: float) -> list[tuple[int, Outcome, dict]]:
    """`jobs` (request index, prompt) through `clients` concurrent streams of one event loop."""
    sem = asyncio.Semaphore(clients)
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=url, limits=limits) as client:
        async def job(i: int, prompt: str | list[int]) -> tuple[int, Outcome, dict]:
            body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": temperature,
                    "seed": i, "ignore_eos": True, "use_speculation": speculation, "return_token_ids": True,
                    "stream": True, "stream_options": {"include_usage": True}}
            async with sem:
                return (i, *await one_request(client, body, timeout))

        return await asyncio.gather(*(job(i, p) for i, p in jobs))


def drive_in_process(*args: Any) -> tuple[float, float, list[tuple[int, Outcome, dict]]]:
    """`drive` in a worker process: (start, end, results); perf_counter is one clock for all processes."""
    t0 = time.perf_counter()
    results = asyncio.run(drive(*args))
    return t0, time.perf_counter(), results


def run_cell(pool: ProcessPoolExecutor | None, processes: int, url: str, model: str, prompts: list, level: int, temperature: float,
             speculation: bool, max_tokens: int, timeout: float) -> tuple[Cell, list[Outcome]]:
    """One cell: the clients are spread over the pool's processes (one Python client saturates a core
    near 64 streams, and then measures itself, not the server), each process taking every P-th request."""
    shares = min(level, processes) if pool is not None else 1
    jobs = [[(i, p) for i, p in enumerate(prompts) if i % shares == j] for j in range(shares)]
    clients = [level // shares + (j < level % shares) for j in range(shares)]
    common = (url, model)
    tail = (temperature, speculation, max_tokens, timeout)
    if pool is None:
        parts = [drive_in_process(*common, jobs[0], clients[0], *tail)]
    else:
        parts = list(pool.map(drive_in_process, *zip(*[(*common, jobs[j], clients[j], *tail) for j in range(shares)])))
    wall = max(end for _, end, _ in parts) - min(start for start, _, _ in parts)
    results = sorted((r for _, _, rs in parts for r in rs), key=lambda r: r[0])
    outcomes = [o for _, o, _ in results]
    good = [o for o in outcomes if o.ok]
    drafts = sum(s.get("num_drafts", 0) for _, _, s in results)
    accepted = sum(s.get("num_accepted_tokens", 0) for _, _, s in results)
    tokens = sum(len(o.token_ids) for o in good)
    cell = Cell(level, temperature, speculation, len(good), len(outcomes) - len(good), tokens, round(wall, 3),
                round(tokens / wall, 1), percentiles([o.ttft for o in good if o.ttft is not None]),
                percentiles([o.tpot for o in good if o.tpot is not None]),
                round(1 + accepted / drafts, 3) if drafts else None)
    if speculation and good:  # every decode step is a draft step (1 + accepted tokens) or a plain one (1 token)
        plain_steps = tokens - len(good) - drafts - accepted
        cell.draft_step_share = round(drafts / max(1, drafts + plain_steps), 3)
    return cell, outcomes


def policy_steps(url: str) -> dict[str, int]:
    """The server's decode steps so far by the draft length its policy chose (empty without a drafter),
    under "preempted" the requests it preempted for KV pages, and under "parked" the requests that
    joined a parked batch."""
    text = httpx.get(f"{url}/metrics").text
    out = {}
    for s in (s for fam in text_string_to_metric_families(text) for s in fam.samples):
        if s.name == "blockspec:spec_decode_policy_steps_total":
            out[s.labels["draft_length"]] = int(s.value)
        elif s.name == "blockspec:num_preemptions_total":
            out["preempted"] = int(s.value)
        elif s.name == "blockspec:spec_decode_policy_parked_requests_total":
            out["parked"] = int(s.value)
    return out


def geomean_interval(values: list[float], resamples: int = 10_000, seed: int = 0) -> tuple[float, float, float]:
    """The geometric mean of on / off ratios and its 95 % percentile-bootstrap interval over rounds:
    the rounds of one setting spread by 15-20 % at a busy server, so a median of a few rounds cannot
    tell a loss of a few per cent from noise, and this interval says whether the rounds can."""
    logs = [math.log(v) for v in values]
    rng = random.Random(seed)
    means = sorted(statistics.fmean(rng.choices(logs, k=len(logs))) for _ in range(resamples))
    return (math.exp(statistics.fmean(logs)), math.exp(means[int(0.025 * resamples)]),
            math.exp(means[int(0.975 * resamples) - 1]))


def ratios(cells: list[Cell]) -> list[dict[str, Any]]:
    """Per (clients, T), then all cells pooled: each round's on / off output tok/s, their median, and
    their geometric mean with its bootstrap interval; the settings' median tok/s."""
    out = []
    pooled: list[float] = []
    for level, temp in dict.fromkeys((c.level, c.temperature) for c in cells):
        rounds = sorted({c.round for c in cells if (c.level, c.temperature) == (level, temp)})
        tok = {(c.round, c.speculation): c.tok_per_s for c in cells if (c.level, c.temperature) == (level, temp)}
        each = [tok[r, True] / tok[r, False] for r in rounds]
        pooled += each
        out.append({"level": level, "temperature": temp, "on_tok_s": statistics.median(tok[r, True] for r in rounds),
                    "off_tok_s": statistics.median(tok[r, False] for r in rounds),
                    "on_over_off": [round(x, 3) for x in each], "median_on_over_off": round(statistics.median(each), 3),
                    "geomean_on_over_off": [round(x, 3) for x in geomean_interval(each)]})
    if len(out) > 1:
        out.append({"level": "all", "temperature": "all", "on_tok_s": None, "off_tok_s": None,
                    "on_over_off": [], "median_on_over_off": round(statistics.median(pooled), 3),
                    "geomean_on_over_off": [round(x, 3) for x in geomean_interval(pooled)]})
    return out


def markdown(cells: list[Cell], title: str) -> str:
    rounds = len({c.round for c in cells})
    head = ("| clients | T | spec | completed | errors | out tok/s | TTFT p50/p90/p99 ms | TPOT p50/p90/p99 ms "
            "| accept len | draft steps | steps by K | joined parked | preempted | = twin |\n" + "|---" * 14 + "|\n")

    def trio(d: dict[str, float]) -> str:
        return " / ".join(f"{d[k]:.1f}" for k in ("p50", "p90", "p99")) if d else "-"

    rows = [f"| {c.level} | {c.temperature} | {'on' if c.speculation else 'off'}{f' ({c.round + 1})' if rounds > 1 else ''}"
            f" | {c.completed} | {c.errors} | "
            f"{c.tok_per_s} | {trio(c.ttft_ms)} | {trio(c.tpot_ms)} | {c.mean_acceptance_length or '-'} | "
            f"{'-' if c.draft_step_share is None else f'{100 * c.draft_step_share:.0f} %'} | "
            f"{' '.join(f'{k}:{n}' for k, n in c.policy_steps.items() if n) or '-'} | "
            f"{c.parked_joins if c.speculation else '-'} | {c.preemptions} | "
            f"{'-' if c.identical_to_twin is None else 'yes' if c.identical_to_twin else 'NO'} |" for c in cells]
    def tok(v: float | None) -> str:
        return "-" if v is None else f"{v:.1f}"

    summary = ["", "| clients | T | on tok/s (median) | off tok/s (median) | on / off by round | median on / off "
               "| geometric mean [95 % bootstrap] |", "|---|---|---|---|---|---|---|"]
    summary += [f"| {r['level']} | {r['temperature']} | {tok(r['on_tok_s'])} | {tok(r['off_tok_s'])} | "
                f"{', '.join(f'{x:.2f}' for x in r['on_over_off']) or '(pooled)'} | {r['median_on_over_off']:.2f} | "
                "{:.3f} [{:.3f}, {:.3f}] |".format(*r["geomean_on_over_off"]) for r in ratios(cells)]
    return f"### {title}\n\n{head}" + "\n".join(rows) + "\n" + "\n".join(summary) + "\n"


def start_server(args: argparse.Namespace, extra: tuple[str, ...] = ()) -> tuple[subprocess.Popen, str]:
    """`blockspec serve` (with `extra` flags) on a free loopback port; returns once /health answers 200."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "blockspec.cli", "serve", "--model", args.model, "--port", str(port),
           "--served-model-name", args.model_name, "--max-num-seqs", str(args.max_num_seqs), "--device", args.device,
           "--log-level", "warning", "--engine-process" if args.engine_process else "--no-engine-process"]
    for flag, value in (("--draft-model", args.draft_model), ("--speculative-config", args.speculative_config),
                        ("--max-model-len", args.max_model_len), ("--num-kv-pages", args.num_kv_pages),
                        ("--dtype", args.dtype)):
        if value is not None:
            cmd += [flag, str(value)]
    proc = subprocess.Popen(cmd + list(extra))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + args.startup_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with code {proc.returncode}")
        try:
            if httpx.get(f"{url}/health").status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.terminate()
    raise SystemExit(f"the server was not healthy within {args.startup_timeout} s")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default=None, help="a running server (default: start one with --model)")
    p.add_argument("--model", default=None, help="target for the server this script starts")
    p.add_argument("--draft-model", default=None)
    p.add_argument("--speculative-config", default=None, help="JSON, as `blockspec serve` takes it")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--num-kv-pages", type=int, default=None, help="as `blockspec serve` takes it (default: auto)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default=None, help="as `blockspec serve` takes it (default: its auto); twins are "
                   "equal only where the arithmetic is exact (float32): 16-bit rows round with the batch's shape")
    p.add_argument("--model-name", default="bench", help="served model name")
    p.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                   help="as `blockspec serve` takes it: the engine in a process of its own (default) or on a thread")
    p.add_argument("--levels", type=int, nargs="+", default=[1, 4, 16, 64], help="concurrent clients")
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7])
    p.add_argument("--requests", type=int, default=64, help="requests per cell (at least)")
    p.add_argument("--requests-per-client", type=int, default=0,
                   help="at least this many requests per client in a cell: at 64 clients, 64 requests are one "
                        "batch that starts and ends together, a cell a fraction of a second long")
    p.add_argument("--warmup-rounds", type=int, default=0,
                   help="untimed on / off rounds a cell runs first, so a server's draft-length policy has learnt "
                        "the workload (a fresh server explores: its first rounds price that in)")
    p.add_argument("--rounds", type=int, default=1,
                   help="on / off runs per cell, alternating which goes first; the summary takes medians and geometric "
                        "means with a bootstrap interval")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt-lengths", type=int, nargs="+", default=[16, 64, 256],
                   help="mixed prompt lengths (tokens with --token-vocab, else characters)")
    p.add_argument("--token-vocab", type=int, default=None, help="random token-id prompts below this id")
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--client-processes", type=int, default=max(1, min(8, (os.cpu_count() or 1) // 4)),
                   help="processes the clients are spread over (default: a quarter of the cores, at most 8)")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--out", type=Path, default=Path("load_test"), help="writes OUT.json and OUT.md")
    p.add_argument("--title", default=None)
    args = p.parse_args(argv)
    if (args.url is None) == (args.model is None):
        p.error("give exactly one of --url and --model")
    if args.rounds < 1 or args.warmup_rounds < 0:
        p.error(f"--rounds must be >= 1 and --warmup-rounds >= 0 (got {args.rounds}, {args.warmup_rounds})")
    proc, url = start_server(args) if args.url is None else (None, args.url)
    pool = ProcessPoolExecutor(args.client_processes) if args.client_processes > 1 else None
    try:
        count = {level: max(args.requests, args.requests_per_client * level) for level in args.levels}
        all_prompts = make_prompts(max(count.values()), args.prompt_lengths, args.token_vocab, seed=0)
        run_cell(pool, args.client_processes, url, args.model_name, all_prompts[:2], 2, 0.0, True, 8, args.request_timeout)  # warm-up
        cells: list[Cell] = []
        for level in args.levels:
            prompts = all_prompts[:count[level]]
            for temperature in args.temperatures:
                for rnd in range(-args.warmup_rounds, args.rounds):  # alternate the order: drift favours neither
                    order = (True, False) if rnd % 2 == 0 else (False, True)
                    pair = []
                    for spec in order:
                        before = policy_steps(url)
                        pair.append(run_cell(pool, args.client_processes, url, args.model_name, prompts, level,
                                             temperature, spec, args.max_tokens, args.request_timeout))
                        after = policy_steps(url)
                        steps = {k: n - before.get(k, 0) for k, n in sorted(after.items())}
                        pair[-1][0].preemptions = steps.pop("preempted", 0)
                        pair[-1][0].parked_joins = steps.pop("parked", 0)
                        pair[-1][0].policy_steps = steps
                    same = all(a.ok and b.ok and a.token_ids == b.token_ids for a, b in zip(pair[0][1], pair[1][1], strict=True))
                    if rnd < 0:  # a warm-up round: nothing of it is kept
                        print(f"clients {level:3d}  T {temperature}  warm-up round {rnd + args.warmup_rounds + 1}: "
                              f"on {pair[order.index(True)][0].tok_per_s:.1f}, off {pair[order.index(False)][0].tok_per_s:.1f} tok/s",
                              flush=True)
                        continue
                    for cell, outcomes in pair:
                        cell.identical_to_twin, cell.round = same, rnd
                        cells.append(cell)
                        errors = sorted({o.error for o in outcomes if o.error})
                        print(f"clients {level:3d}  T {temperature}  spec {'on ' if cell.speculation else 'off'}  "
                              f"round {rnd + 1}  {cell.completed}/{len(prompts)} ok  {cell.tok_per_s:8.1f} tok/s  "
                              f"TTFT {cell.ttft_ms}  TPOT {cell.tpot_ms}" + (f"  errors: {errors[:3]}" if errors else ""),
                              flush=True)
    finally:
        if pool is not None:
            pool.shutdown()
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    title = args.title or f"load test: {args.model or args.url}" + (
        f" (after {args.warmup_rounds} warm-up round(s) a cell)" if args.warmup_rounds else "")
    report = {"title": title, "date": time.strftime("%Y-%m-%d %H:%M"),
              "args": {k: str(v) for k, v in vars(args).items()}, "cells": [asdict(c) for c in cells],
              "summary": ratios(cells)}
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    table = markdown(cells, title)
    args.out.with_suffix(".md").write_text(table)
    print(table)
    return 0 if all(c.errors == 0 for c in cells) else 1


if __name__ == "__main__":
    sys.exit(main())
