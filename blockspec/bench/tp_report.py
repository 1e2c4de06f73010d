"""What a tensor-parallel bench adds to the report: each rank's step figures beside rank 0's timings, and
TP = N against TP = 1 per method and point (prompt length, batch and temperature).

Rank 0 times the passes; the other ranks run the same steps in lockstep, so a rank slower than rank 0
(its drafter, its share of the weights, its all-reduces) shows in its own step time, recorded here with
the drafter's share of each rank's timed step phases (the engine's draft / verify / rest split). The
comparison with TP = 1 gives the ratios the tensor-parallel targets are stated in: plain decoding's
tok/s at TP = N over TP = 1, and speculation's speedup over plain at each TP.
"""

from __future__ import annotations

from typing import Any

from blockspec.bench.drafts import drafted
from blockspec.bench.points import RunKey, input_cell, point

COMPARE_NOTE = ("TP = 1 ran in the same call, in the calling process, before TP = N; the two are timed one after "
                "the other (each interleaves its own methods), so a drift of the machine between them falls on "
                "the TP ratios")

# why a synthetic run's tokens may differ between TP sizes where real acceptance's cannot
SYNTHETIC_TOKENS = ("a synthetic run's tokens are its drafts up to drawn counts, and the draws follow the draft "
                    "lengths an adaptive policy picks from each run's own clock: they are TP=1's only with a fixed "
                    "draft length")


def _key(run: dict[str, Any]) -> RunKey:
    return run["method"], *point(run)


def draft_share(run: dict[str, Any]) -> float | None:
    """The drafter's share of a run's timed step phases (draft / all of them; a chained step, draft and
    verify in one graph, counts in the whole only); None untimed."""
    split = run.get("time_split_s_per_pass") or {}
    total = sum(split.values())
    return split.get("draft", 0.0) / total if total > 0 else None


def rank_figures(runs: list[dict[str, Any]]) -> list[dict[str, Any] | None]:
    """One rank's figures of each run, in run order (every rank runs the same sweep): its median decode
    step time and the drafter's share of its step phases."""
    return [{"step_ms": r["step_ms"]["median"], "draft_share": draft_share(r)} if r["status"] == "ok" else None
            for r in runs]


def add_rank_figures(runs: list[dict[str, Any]], per_rank: list[list[dict[str, Any] | None]]) -> None:
    """Add every rank's figures (`per_rank[r]`: rank r's `rank_figures`) to rank 0's runs, with the most
    of any rank: the ranks wait for each other at every all-reduce, so the slowest sets the pace."""
    for i, run in enumerate(runs):
        figures = [rank[i] for rank in per_rank]
        if any(f is None for f in figures):
            continue
        steps = [f["step_ms"] for f in figures]
        shares = [f["draft_share"] for f in figures]
        known = [s for s in shares if s is not None]
        run["ranks"] = {"step_ms": steps, "step_ms_max": max(steps), "draft_share": shares,
                        "draft_share_max": max(known) if known else None}


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _speedup(run: dict[str, Any]) -> float | None:
    """A speculative run's output tok/s over plain's (median of the rounds' ratios); None for plain or a
    run that never drafted."""
    return run.get("vs_plain", {}).get("output_tok_s_ratio") if drafted(run) else None


def compare_tp(result: dict[str, Any], one: dict[str, Any], tokens_match: dict[RunKey, float]) -> dict[str, Any]:
    """TP = N's runs (`result`) against TP = 1's (`one`) at the same method and point: the
    output and decode tok/s ratios, each speculative run's speedup over plain at both sizes and their
    ratio (speculation's gain kept under TP), and `tokens_match` (the share of each output equal to TP =
    1's before the first difference)."""
    base = {_key(r): r for r in one["runs"] if r["status"] == "ok"}
    rows = []
    for r in result["runs"]:
        b = base.get(_key(r))
        if b is None or r["status"] != "ok":
            continue
        tp1_speedup, tp_speedup = _speedup(b), _speedup(r)
        rows.append({
            "method": r["method"], "input_len": r.get("input_len"), "prompt_tokens_mean": r.get("prompt_tokens_mean"),
            "batch": r["batch"], "temperature": r["temperature"], "synthetic": r["synthetic"],
            "tp1_output_tok_s": b["output_tok_s"]["median"], "tp_output_tok_s": r["output_tok_s"]["median"],
            "tp_over_tp1": _ratio(r["output_tok_s"]["median"], b["output_tok_s"]["median"]),
            "tp_over_tp1_decode": _ratio(r["decode_tok_s"]["median"], b["decode_tok_s"]["median"]),
            "tp1_vs_plain": tp1_speedup, "tp_vs_plain": tp_speedup, "vs_plain_kept": _ratio(tp_speedup, tp1_speedup),
            "tokens_match_tp1": tokens_match.get(_key(r)),
        })
    return {"tensor_parallel_size": result["tensor_parallel_size"], "note": COMPARE_NOTE, "rows": rows,
            "tp1": {k: one[k] for k in ("model", "floor", "runs", "checks")}}


def _f(x: Any, fmt: str) -> str:
    return format(x, fmt) if isinstance(x, (int, float)) else "n/a"


def _times(x: float | None) -> str:
    return f"{x:.2f}x" if x is not None else "n/a"


def tp_header(result: dict[str, Any]) -> list[str]:
    """The report's header line for a tensor-parallel run (none at TP = 1)."""
    n = result.get("tensor_parallel_size", 1)
    if n == 1:
        return []
    return [f"- tensor parallel: {n} rank processes in lockstep; the timings are rank 0's; the target's size, "
            "bytes read per step, the floor and memory are one rank's (its shard, the drafters whole)"]


def tp_sections(result: dict[str, Any]) -> list[str]:
    """The report's tensor-parallel sections: every rank's step figures, then TP = N against TP = 1."""
    n = result.get("tensor_parallel_size", 1)
    lines: list[str] = []
    ranked = [r for r in result["runs"] if "ranks" in r]
    if ranked:
        lines += ["", f"Per rank (TP={n}): median decode step, and the drafter's share of the step phases the "
                      "engine timed (draft / verify / rest), rank 0's and the most of any rank:", "",
                  "| method | batch | T | input | step ms rank 0 | step ms max | drafter share rank 0 "
                  "| drafter share max |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in ranked:
            k = r["ranks"]
            lines.append(f"| {r['method']} | {r['batch']} | {r['temperature']} | {input_cell(r)} "
                         f"| {_f(k['step_ms'][0], '.2f')} "
                         f"| {_f(k['step_ms_max'], '.2f')} | {_f(k['draft_share'][0], '.0%')} "
                         f"| {_f(k['draft_share_max'], '.0%')} |")
    compare = result.get("compare_tp1")
    if compare:
        synthetic = any(row["synthetic"] for row in compare["rows"])
        lines += ["", f"TP={n} against TP=1 ({compare['note']}); 'vs plain': a speculative run's output tok/s over "
                      f"plain decoding's at that TP; 'kept': TP={n}'s speedup over TP=1's; 'tokens = TP=1': share of "
                      "each output equal to TP=1's before the first difference"
                      + (f" ({SYNTHETIC_TOKENS})" if synthetic else "") + ":", "",
                  f"| method | batch | T | input | TP=1 tok/s | TP={n} tok/s | TP={n} / TP=1 "
                  f"| decode TP={n} / TP=1 | vs plain TP=1 | vs plain TP={n} | kept | tokens = TP=1 |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for row in compare["rows"]:
            name = row["method"] + (" (synthetic)" if row["synthetic"] else "")
            spec = row["method"] != "plain"
            speedups = [(_times(row[k]) if row[k] is not None else "no drafts") if spec else ""
                        for k in ("tp1_vs_plain", "tp_vs_plain")]
            lines.append(
                f"| {name} | {row['batch']} | {row['temperature']} | {input_cell(row)} "
                f"| {_f(row['tp1_output_tok_s'], '.1f')} "
                f"| {_f(row['tp_output_tok_s'], '.1f')} | {_times(row['tp_over_tp1'])} "
                f"| {_times(row['tp_over_tp1_decode'])} | {speedups[0]} | {speedups[1]} "
                f"| {_f(row['vs_plain_kept'], '.2f') if row['vs_plain_kept'] is not None else ''} "
                f"| {_f(row['tokens_match_tp1'], '.0%')} |")
    return lines
