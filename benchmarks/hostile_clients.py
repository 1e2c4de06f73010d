"""What hostile input costs the other clients of `blockspec serve`, loopback only.

Each scenario runs R rounds; in each round victims (a greedy and a seeded sampled completion, streamed)
run beside a burst of bad requests, while a prober asks /health every 20 ms. Reported per scenario:
the /health latency (p50 / p99 / max), the victims' end-to-end latency (median, and its ratio to the
quiet scenario's), what the bad requests got (status counts), and whether every victim's tokens equal
the quiet scenario's. The scenarios are those of the server-hardening issue: a 10 MB prompt, a chat
template with a 15,000 x 15,000 loop (refused by default; rendered in a worker thread where the
operator trusts request templates), seeds and logit biases out of range, JSON nested 100,000 deep.

  python benchmarks/hostile_clients.py --model blockspec/assets/default/target --out DIR
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from load_test import start_server

# 225 M empty iterations, then the conversation (so a server that trusts it renders a real prompt)
LOOP = ("{% for i in range(15000) %}{% for j in range(15000) %}{% endfor %}{% endfor %}"
        "{% for m in messages %}{{ m['content'] }}{% endfor %}")
SCENARIOS: dict[str, list[tuple[str, bytes]]] = {
    "quiet": [],
    "10 MB prompt x4": [("completions", json.dumps({"prompt": "x" * 10_000_000, "max_tokens": 4}).encode())] * 4,
    "template loop x4": [("chat/completions", json.dumps({
        "messages": [{"role": "user", "content": "hi"}], "chat_template": LOOP, "max_tokens": 4}).encode())] * 4,
    "out-of-range values x32": [("completions", json.dumps(body).encode()) for body in (
        {"prompt": "x", "temperature": 0.5, "seed": 2**63}, {"prompt": "x", "seed": 2**64},
        {"prompt": "x", "logit_bias": {"-1": 100}}, {"prompt": "x", "logit_bias": {"5": 1e39}},
        {"prompt": "x", "n": True}, {"prompt": "x", "max_tokens": True}, {"prompt": "abc \ud800 def"},
        {"prompt": "x", "stop": 123})] * 4,
    "JSON nested 100,000 deep x4": [("completions", b"[" * 100_000 + b"]" * 100_000)] * 4,
}
VICTIMS = [{"prompt": "def parse(text):", "temperature": 0, "max_tokens": 64, "ignore_eos": True},
           {"prompt": "class Queue:", "temperature": 0.7, "seed": 5, "max_tokens": 64, "ignore_eos": True}]


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def round_(url: str, model: str, bad: list[tuple[str, bytes]]) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        stop = asyncio.Event()
        health: list[float] = []

        async def probe() -> None:
            while not stop.is_set():
                t0 = time.perf_counter()
                await client.get("/health")
                health.append(time.perf_counter() - t0)
                await asyncio.sleep(0.02)

        async def victim(body: dict[str, Any]) -> tuple[list[int], float]:
            t0 = time.perf_counter()
            ids: list[int] = []
            async with client.stream("POST", "/v1/completions", json={**body, "model": model, "stream": True,
                                                                      "return_token_ids": True}) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        ids += json.loads(line[6:])["choices"][0].get("token_ids") or []
            return ids, time.perf_counter() - t0

        async def hostile(route: str, body: bytes) -> int | str:
            """The status, or "closed" where the server answered before the upload ended (a 413 on
            Content-Length) and closed the connection under the client still sending."""
            try:
                r = await client.post(f"/v1/{route}", content=body, headers={"content-type": "application/json"})
            except httpx.TransportError:
                return "closed"
            return r.status_code

        prober = asyncio.create_task(probe())
        await asyncio.sleep(0.1)
        results = await asyncio.gather(*(victim(v) for v in VICTIMS), *(hostile(*b) for b in bad))
        stop.set()
        await prober
    victims = results[: len(VICTIMS)]
    return {"health_s": health, "victim_ids": [ids for ids, _ in victims],
            "victim_s": [s for _, s in victims], "statuses": results[len(VICTIMS):]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="target the server serves")
    p.add_argument("--device", default="cpu")
    p.add_argument("--rounds", type=int, default=5, help="rounds per scenario (default: %(default)s)")
    p.add_argument("--out", type=Path, default=None, help="folder for the raw JSON and the markdown table")
    args = p.parse_args(argv)
    serve = argparse.Namespace(model=args.model, model_name="bench", max_num_seqs=8, device=args.device,
                               engine_process=True, draft_model=None, speculative_config=None, max_model_len=None,
                               num_kv_pages=None, startup_timeout=600)
    rows, raw = [], {}
    for trusted in (False, True):
        proc, url = start_server(serve, ("--trust-request-chat-template",) if trusted else ())
        try:
            names = ["quiet", "template loop x4"] if trusted else list(SCENARIOS)
            for name in names:
                label = f"{name} (templates trusted)" if trusted else name
                rounds = [asyncio.run(round_(url, "bench", SCENARIOS[name])) for _ in range(args.rounds)]
                raw[label] = rounds
                health = [h for r in rounds for h in r["health_s"]]
                victim = [s for r in rounds for s in r["victim_s"]]
                rows.append({"scenario": label, "health_p50_ms": 1e3 * statistics.median(health),
                             "health_p99_ms": 1e3 * pct(health, 0.99), "health_max_ms": 1e3 * max(health),
                             "victim_p50_s": statistics.median(victim),
                             "statuses": dict(Counter(s for r in rounds for s in r["statuses"])),
                             "victim_ids": rounds[0]["victim_ids"],
                             "victims_identical": all(r["victim_ids"] == rounds[0]["victim_ids"] for r in rounds)})
        finally:
            proc.terminate()
            proc.wait(60)
    quiet = rows[0]
    lines = ["| scenario | /health p50 / p99 / max (ms) | victim e2e p50 (s) | vs quiet | bad requests got | "
             "victims' tokens = quiet's |", "|---|---|---|---|---|---|"]
    for row in rows:
        same = row["victims_identical"] and row["victim_ids"] == quiet["victim_ids"]
        lines.append(f"| {row['scenario']} | {row['health_p50_ms']:.1f} / {row['health_p99_ms']:.1f} / "
                     f"{row['health_max_ms']:.1f} | {row['victim_p50_s']:.3f} | "
                     f"{row['victim_p50_s'] / quiet['victim_p50_s']:.2f} | {row['statuses'] or '-'} | {same} |")
    table = "\n".join(lines)
    print(table)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "hostile_clients.md").write_text(table + "\n")
        (args.out / "hostile_clients.json").write_text(json.dumps({"rows": rows, "raw": raw}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
