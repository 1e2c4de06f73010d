"""The fixed-K sweep (`--k-sweep`): a check on the engine's draft-length policy.

At every point each speculative method also runs at each fixed draft length K (num_speculative_tokens = K,
adaptive_draft_length off) in the same interleaved rounds as its policy run, so a drift of the machine
falls on all of them alike. The report gives each K's output and decode tok/s, the best fixed K (highest
median decode tok/s) and the policy's decode tok/s over that K's: the median of the rounds' ratios, as
'vs plain' is, with their min-max. The policy passes a point when it lands within TOLERANCE of the best
fixed K (above it passes too); a K above a drafter's block runs as the block's size.
"""

from __future__ import annotations

from typing import Any

from blockspec.bench.drafts import drafting_share
from blockspec.bench.points import input_cell, point_name
from blockspec.bench.timing import spread
from blockspec.speculative.policy import PolicyView, batch_bucket

TOLERANCE = 0.05  # the policy's decode tok/s may trail the best fixed K's by at most this share


def clip(requested: tuple[int, ...], capacity: int) -> list[int]:
    """The Ks a drafter with `capacity` draft slots runs: each requested K, capped at `capacity`, once."""
    return sorted({min(k, capacity) for k in requested})


def clip_note(method: str, requested: tuple[int, ...], capacity: int) -> str | None:
    """What `clip` changed for `method`, naming the range its block allows; None when nothing."""
    above = [k for k in requested if k > capacity]
    if not above:
        return None
    return (f"{method}: its block holds {capacity} drafts (K in 1-{capacity}); K={', '.join(map(str, above))} "
            f"run as K={capacity}")


def within(ratio: float | None) -> bool:
    """Whether the policy passes a point, given its decode tok/s over the best fixed K's."""
    return ratio is not None and ratio >= 1 - TOLERANCE


def verdict(ratio: float | None) -> str:
    """The policy's verdict at a point, from its decode tok/s over the best fixed K's."""
    if ratio is None:
        return "n/a: no decode steps"
    return f"within {100 * TOLERANCE:g} %" if within(ratio) else f"misses by {100 * (1 - ratio):.1f} %"


def policy_record(view: PolicyView) -> dict[str, Any]:
    """What a policy run's record keeps of the policy's beliefs at its end: step ms per "bucket:K" and
    expected tokens a step per K (`PolicyView`)."""
    return {"step_ms": {f"{b}:{k}": 1e3 * s for (b, k), s in sorted(view.step_seconds.items())},
            "expected_tokens": {str(k): e for k, e in sorted(view.expected_tokens.items())}}


def beliefs(policy: dict[str, Any], fixed: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per fixed K: the policy's final estimates at the point's batch bucket (step ms, tokens a step)
    beside what the fixed run measured (its median whole-block step, its acceptance length), so a miss
    shows whether a step time or an acceptance estimate misled the choice; None where either has none."""
    view = policy.get("policy_view") or {}
    bucket = batch_bucket(policy["batch"])
    out = []
    for run in sorted(fixed, key=lambda r: r["fixed_k"]):
        k = run["fixed_k"]
        step = run["steps_by_draft_length"].get(str(k)) or {}
        out.append({"k": k, "believed_ms": view.get("step_ms", {}).get(f"{bucket}:{k}"),
                    "believed_tokens": view.get("expected_tokens", {}).get(str(k)),
                    "measured_ms": step.get("ms_median"),
                    "measured_tokens": (run.get("acceptance") or {}).get("mean_acceptance_length")})
    return out


def sweep_point(policy: dict[str, Any], fixed: list[dict[str, Any]]) -> dict[str, Any]:
    """The policy's run against the fixed-K runs (`fixed_k` set) of its method at its point: the best K,
    the policy's decode tok/s over that K's per round (median, min-max) and the verdict; the fixed runs
    are kept whole."""
    best = max(fixed, key=lambda r: r["decode_tok_s"]["median"])
    ratios = [a / b for a, b in zip(policy["rounds"]["decode_tok_s"], best["rounds"]["decode_tok_s"]) if b]
    ratio = spread(ratios)["median"] if ratios else None
    acc = policy.get("acceptance") or {}
    return {"method": policy["method"], "input_len": policy.get("input_len"), "batch": policy["batch"],
            "temperature": policy["temperature"], "synthetic": policy["synthetic"],
            "policy_output_tok_s": policy["output_tok_s"]["median"],
            "policy_decode_tok_s": policy["decode_tok_s"]["median"],
            "policy_mean_draft_length": acc.get("mean_draft_length"), "policy_drafting_share": drafting_share(policy),
            "policy_acceptance_length": acc.get("mean_acceptance_length"),
            "best_k": best["fixed_k"], "best_decode_tok_s": best["decode_tok_s"]["median"],
            "best_acceptance_length": (best.get("acceptance") or {}).get("mean_acceptance_length"),
            "policy_over_best": ratio, "policy_over_best_range": [min(ratios), max(ratios)] if ratios else None,
            "within": within(ratio), "verdict": verdict(ratio), "beliefs": beliefs(policy, fixed),
            "fixed": sorted(fixed, key=lambda r: r["fixed_k"])}


def sweep_report(requested: tuple[int, ...], capacities: dict[str, int], points: list[dict[str, Any]]
                 ) -> dict[str, Any]:
    """The report's `k_sweep`: what was asked, what each method ran, every point, and the verdict overall."""
    notes = [clip_note(m, requested, c) for m, c in capacities.items()]
    return {"requested": list(requested), "tolerance": TOLERANCE,
            "methods": {m: {"capacity": c, "k": clip(requested, c)} for m, c in capacities.items()},
            "notes": [n for n in notes if n], "points": points,
            "all_within": all(p["within"] for p in points)}


def _cell(x: float | None, fmt: str) -> str:
    return format(x, fmt) if x is not None else "n/a"


def _belief(b: dict[str, Any]) -> str:
    """One K of `beliefs`: believed and measured step ms, tokens a step and their ratio."""
    def part(ms: float | None, tokens: float | None) -> str:
        rate = _cell(tokens / ms, ".3f") if ms and tokens is not None else "n/a"
        return f"{_cell(ms, '.2f')} ms x {_cell(tokens, '.2f')} = {rate}"
    return (f"K={b['k']} believed {part(b['believed_ms'], b['believed_tokens'])}, "
            f"measured {part(b['measured_ms'], b['measured_tokens'])}")


def sweep_line(entry: dict[str, Any]) -> str:
    """A point's log line: each K's decode tok/s, the best K and the policy against it."""
    ks = ", ".join(f"K={r['fixed_k']} {r['decode_tok_s']['median']:.1f}" for r in entry["fixed"])
    return (f"{entry['method']:>11} {point_name(entry):<22} K sweep, decode tok/s: {ks}; policy "
            f"{entry['policy_decode_tok_s']:.1f}, {_cell(entry['policy_over_best'], '.2f')}x the best "
            f"(K={entry['best_k']}): {entry['verdict']}")


def sweep_lines(sweep: dict[str, Any]) -> list[str]:
    """The report's section: one row per method and point, a column per K (output / decode tok/s)."""
    ks = sorted({r["fixed_k"] for p in sweep["points"] for r in p["fixed"]})
    tol = f"{100 * sweep['tolerance']:g} %"
    lines = ["", f"Fixed-K sweep (`--k-sweep {','.join(map(str, sweep['requested']))}`): each speculative method "
                 "also ran at each fixed draft length K (adaptive_draft_length off) in the same interleaved rounds; "
                 "K cells: output / decode tok/s (medians over the rounds); 'policy K': the policy's mean draft "
                 "length over the steps that drafted (share of decode steps drafting); 'acc. len': the mean "
                 "acceptance length of the policy's run and of the best K's (with synthetic acceptance, runs "
                 "whose draft lengths differ draw differently: a gap here is luck of the draws, not the choice); "
                 "'policy / best K': the policy's decode tok/s over the best fixed K's, median of the rounds' "
                 f"ratios (min-max); the policy should land within {tol} of the best fixed K at every point:", "",
             "| method | batch | T | input | " + " | ".join(f"K={k}" for k in ks)
             + " | best K | policy decode tok/s | policy K | acc. len policy / best K | policy / best K | verdict |",
             "|---|---|---|---|" + "---|" * (len(ks) + 6)]
    for p in sweep["points"]:
        by_k = {r["fixed_k"]: r for r in p["fixed"]}
        cells = [f"{by_k[k]['output_tok_s']['median']:.1f} / {by_k[k]['decode_tok_s']['median']:.1f}"
                 if k in by_k else "" for k in ks]
        span = p["policy_over_best_range"]
        ratio = _cell(p["policy_over_best"], ".2f") + (f" [{span[0]:.2f}-{span[1]:.2f}]" if span else "")
        share = p["policy_drafting_share"]
        acc = " / ".join(_cell(p.get(f"{run}_acceptance_length"), ".2f") for run in ("policy", "best"))
        name = p["method"] + (" (synthetic)" if p["synthetic"] else "")
        lines.append(f"| {name} | {p['batch']} | {p['temperature']} | {input_cell(p)} | {' | '.join(cells)} "
                     f"| {p['best_k']} | {p['policy_decode_tok_s']:.1f} "
                     f"| {_cell(p['policy_mean_draft_length'], '.1f')} ({_cell(share, '.0%')}) "
                     f"| {acc} | {ratio} "
                     f"| {p['verdict'] if p['within'] else '**' + p['verdict'] + '**'} |")
    lines += [""] + [f"- {note}" for note in sweep["notes"]]
    lines += [(f"- {p['method']} {point_name(p)}, the policy's final estimates against the fixed runs (step ms x "
               "tokens a step = tokens per ms): ") + "; ".join(_belief(b) for b in p["beliefs"])
              for p in sweep["points"] if p.get("beliefs")]
    missed = [f"{p['method']} {point_name(p)} ({p['verdict']})" for p in sweep["points"] if not p["within"]]
    lines.append(f"- the policy within {tol} of the best fixed K at every point: "
                 + ("yes" if not missed else "no: " + "; ".join(missed)))
    return lines
