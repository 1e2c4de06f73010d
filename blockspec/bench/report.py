"""A bench result's figures and text: each run against plain decoding at its point, the floor of a step,
the headline checks, the one-line summaries, the markdown page and the files a run writes.

`harness` measures and hands its result record here; nothing here runs an engine.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from blockspec.bench.drafts import NO_DRAFTS_WHY, drafted, drafting_share
from blockspec.bench.ksweep import sweep_lines
from blockspec.bench.plots import title, write_plots
from blockspec.bench.points import input_cell, point, point_name
from blockspec.bench.timing import spread
from blockspec.bench.tp_report import tp_header, tp_sections

SYNTHETIC_NOTE = ("SYNTHETIC ACCEPTANCE: speculative runs draw their accepted counts from a set profile; their "
                  "timings are real, their output tokens are NOT the target's")
NO_DRAFTS = NO_DRAFTS_WHY + "; --speculative-config '{\"adaptive_draft_length\": false}' pins the draft length"

def compare_to_plain(runs: list[dict[str, Any]]) -> None:
    """Add each run's ratios to blockspec plain decoding at the same point (prompt length, batch and
    temperature): the median of the rounds' ratios and their min-max where the two were timed in interleaved
    rounds, else the ratio of the medians (peers, timed apart)."""
    plain = {point(r): r for r in runs if r["method"] == "plain"}
    for r in runs:
        p = plain.get(point(r))
        if r["method"] == "plain" or p is None or r["status"] != "ok":
            continue
        vs: dict[str, Any] = {}
        same_length = r["output_len"] == p["output_len"]  # else prefill weighs differently: decode rates only
        for key in ("output_tok_s", "decode_tok_s"):
            if key == "output_tok_s" and not same_length:
                vs[f"{key}_ratio"] = None
            elif "rounds" in r and len(r["rounds"][key]) == len(p["rounds"][key]):
                ratios = [a / b for a, b in zip(r["rounds"][key], p["rounds"][key]) if b]
                vs[f"{key}_ratio"] = spread(ratios)["median"] if ratios else None
                vs[f"{key}_ratio_range"] = [min(ratios), max(ratios)] if ratios else None
            else:
                vs[f"{key}_ratio"] = r[key]["median"] / p[key]["median"] if p[key]["median"] else None
        steps, plain_steps = r.get("steps_by_draft_length"), p["steps_by_draft_length"]
        drafted_k = [k for k in steps or {} if int(k)]
        if drafted_k and "0" in plain_steps:  # the longest drafted step against a plain step
            k = max(drafted_k, key=int)
            vs["step_ratio"] = steps[k]["ms_median"] / plain_steps["0"]["ms_median"]
            vs["step_ratio_draft_length"] = int(k)
        if "memory_gb_total" in r:
            vs["memory_overhead_gb"] = r["memory_gb_total"] - p["memory_gb_total"]
        r["vs_plain"] = vs


def verdict(run: dict[str, Any]) -> str:
    """A speculative run against plain: no drafts, faster or slower (every round agreeing), or within the
    rounds' spread."""
    if not drafted(run):
        return "no drafts"
    low, high = run["vs_plain"].get("output_tok_s_ratio_range") or [run["vs_plain"]["output_tok_s_ratio"]] * 2
    return "faster" if low > 1 else "slower" if high < 1 else "within the rounds' spread"


def step_floor(model: dict[str, Any], floor: dict[str, Any], batch: int, k: int, context: float,
               drafter: dict[str, float] | None = None) -> tuple[float, str]:
    """The least time of a decode step of `batch` requests verifying k drafts each at `context` keys, and
    what bounds each part. The parts run one after the other, so their times add: the target's products
    over batch x (k + 1) rows and its attention (each request's K/V read once), then with k > 0 and
    `drafter`'s terms (`arch.draft_step_terms`) the draft's products and attention; each part takes the
    longer of its bytes at the copy bandwidth and its FLOPs at the measured product rate."""
    bandwidth, rate = floor["copy_bandwidth_TBps"] * 1e12, floor["matmul_TFLOPs"] * 1e12
    rows = batch * (k + 1)
    parts = [("products", model["weight_bytes_per_step_gb"] * 1e9, rows * model["row_gflops"] * 1e9),
             ("attention", batch * context * model.get("kv_bytes_per_token", 0.0),
              rows * model["attention_flops_per_key"] * context)]
    if k and drafter:
        d = drafter
        # block rows past those holding the k drafts skip the last layer after its qkv projection
        skipped = d["block_rows"] - min(d["block_rows"], k + d["draft_row_offset"])
        parts += [("draft products", (d["weight_bytes_gb"] + d["head_bytes_gb"]) * 1e9,
                   batch * (d["block_rows"] * d["layer_gflops_per_row"] - skipped * d["trimmed_gflops_per_row"]
                            + d["fc_gflops_per_row"] + k * d["head_gflops_per_row"]) * 1e9),
                  ("draft attention", batch * context * d["kv_bytes_per_token"],
                   batch * (d["block_rows"] - skipped / d["layers"]) * d["attention_flops_per_key"] * context)]
    parts = [(name, reads / bandwidth, flops / rate) for name, reads, flops in parts if reads or flops]
    bound = ", ".join(f"{name} {'compute' if flops > reads else 'bandwidth'}" for name, reads, flops in parts)
    return sum(max(reads, flops) for _, reads, flops in parts), bound


def add_step_floors(runs: list[dict[str, Any]], model: dict[str, Any], floor: dict[str, Any] | str) -> None:
    """Each run's step times by draft length get the floor of a step verifying K drafts for as many
    requests as those steps decoded on average (`step_floor`, at the run's mean context, with its
    drafter's work where the model record has it): a draft length taken only while a batch fills or
    drains is priced at the requests it ran with, not the whole batch."""
    if not isinstance(floor, dict) or "matmul_TFLOPs" not in floor:
        return
    for run in runs:
        if run.get("status") != "ok":
            continue
        context = run["prompt_tokens_mean"] + run["output_len"] / 2
        drafter = model.get("drafter_terms", {}).get(run["method"])
        for k, entry in run.get("steps_by_draft_length", {}).items():
            requests = max(1, round(entry.get("requests_mean", run["batch"])))
            seconds, bound = step_floor(model, floor, requests, int(k), context, drafter)
            entry["floor_ms"], entry["floor_bound"] = 1e3 * seconds, bound


def checks(result: dict[str, Any]) -> dict[str, Any]:
    """The headline figures, taken from the runs: plain decode against the bandwidth floor at batch 1, each
    method's batch-1 T = 0 step and speedup (at its shortest prompts), and its speedup at every point with
    the rounds' spread."""
    runs = [r for r in result["runs"] if r["status"] == "ok"]
    spec = [r for r in runs if r["method"] in ("dflash", "dspark") and "vs_plain" in r]
    out: dict[str, Any] = {}
    plain1 = next((r for r in runs if r["method"] == "plain" and r["batch"] == 1 and r["temperature"] == 0), None)
    if plain1 and isinstance(result["floor"], dict):
        out["plain_batch1_floor_ratio"] = plain1["decode_tok_s"]["median"] / result["floor"]["tok_s_batch1"]
    batch1: dict[str, dict[str, Any]] = {}
    for r in spec:  # a method's first run at batch 1, T = 0: the runs go by prompt length, shortest first
        if r["batch"] == 1 and r["temperature"] == 0:
            batch1.setdefault(r["method"], r)
    out["batch1_T0"] = {m: {"input_len": r.get("input_len"), "step_over_plain": r["vs_plain"].get("step_ratio"),
                            "draft_length": r["vs_plain"].get("step_ratio_draft_length"),
                            "speedup": r["vs_plain"]["output_tok_s_ratio"] if drafted(r) else None,
                            "mean_acceptance_length": r["acceptance"]["mean_acceptance_length"]}
                        for m, r in batch1.items()}
    out["vs_plain"] = {method: [{"input_len": r.get("input_len"), "batch": r["batch"],
                                 "temperature": r["temperature"], "verdict": verdict(r),
                                 "speedup": r["vs_plain"]["output_tok_s_ratio"],
                                 "range": r["vs_plain"].get("output_tok_s_ratio_range"),
                                 "decode_speedup": r["vs_plain"].get("decode_tok_s_ratio")}
                                for r in spec if r["method"] == method]
                       for method in sorted({r["method"] for r in spec})}
    out["memory_overhead_gb"] = {f"{r['method']} {point_name(r)}": r["vs_plain"].get("memory_overhead_gb", "n/a")
                                 for r in spec}
    return out


# ---------------------------------------------------------------------------------------------- report
def _f(x: Any, fmt: str = ".1f") -> str:
    return format(x, fmt) if isinstance(x, (int, float)) else "n/a"


def _prompts(check: dict[str, Any]) -> str:
    """", 512-token prompts" where a check's run had random prompts of one length."""
    return f", {check['input_len']}-token prompts" if check.get("input_len") else ""


def summary_line(run: dict[str, Any]) -> str:
    head = f"{run['method']:>11} {point_name(run):<22}"
    if run["status"] != "ok":
        return f"{head} n/a: {run['reason']}"
    acc = run.get("acceptance")
    return (f"{head} {run['output_tok_s']['median']:9.1f} tok/s  decode {run['decode_tok_s']['median']:9.1f} tok/s"
            + ((f"  acc.len {_f(acc['mean_acceptance_length'], '.2f')}" if drafted(run) else "  no drafts")
               if acc else "")
            + (f"  preempted {run['preemptions']}x" if run.get("preemptions") else "")
            + ("  [synthetic]" if run["synthetic"] else ""))


def decode_ratio_at_expectation(run: dict[str, Any]) -> float | None:
    """A synthetic run's decode ratio to plain had its draws hit the profile's expectation for the draft lengths
    it chose: decode tok/s is tokens a step over step time, so the measured ratio times expected / drawn
    acceptance length, step times as measured. Two methods' draws differ by luck; this compares their steps."""
    acc, vs = run.get("acceptance") or {}, run.get("vs_plain", {})
    expected, drawn, ratio = acc.get("expected_length"), acc.get("mean_acceptance_length"), vs.get("decode_tok_s_ratio")
    if not (expected and drawn and ratio):
        return None
    return ratio * expected / drawn


def speedup_cell(run: dict[str, Any], rate: str = "output") -> str:
    """A vs-plain cell of `rate` ("output" or "decode" tok/s): "no drafts", or the speedup with the rounds'
    min-max, in bold when every round was slower, marked when the rounds fall on both sides of 1. An
    output ratio that cannot be taken (outputs of other lengths) falls back to the decode one, so marked."""
    vs = run.get("vs_plain", {})
    if run.get("acceptance") and not drafted(run):
        return "no drafts"
    ratio, what = vs.get(f"{rate}_tok_s_ratio"), ""
    if ratio is None and rate == "output" and vs.get("decode_tok_s_ratio") is not None:
        ratio, what, rate = vs["decode_tok_s_ratio"], " decode", "decode"
    if ratio is None:
        return ""
    span = vs.get(f"{rate}_tok_s_ratio_range")
    text = f"{ratio:.2f}x{what}" + (f" [{span[0]:.2f}-{span[1]:.2f}]" if span else "")
    if (span[1] if span else ratio) < 1:
        return f"**{text} (slower)**"
    return f"{text} (within spread)" if span and span[0] <= 1 else text


def occupancy(entry: dict[str, Any], batch: int) -> str:
    """" at 9.5 requests" where a draft length's steps decoded fewer requests than the batch on average."""
    mean = entry.get("requests_mean")
    if mean is None or mean >= batch - 0.05:
        return ""
    return f" at {mean:.3g} request{'' if f'{mean:.3g}' == '1' else 's'}"


def requests_note(cfg: dict[str, Any]) -> str:
    """How a point's requests arrive: one static batch, or waves of them refilling finished slots."""
    waves = cfg.get("waves") or 1
    if waves == 1:
        return "a point's requests run as one static batch (it lasts as long as its slowest request)"
    return (f"{waves} x batch requests a point, at most batch in flight, a finished request's slot taken by the next "
            "(steps that admit or prefill are left out of the decode figures)")


def markdown(result: dict[str, Any]) -> str:
    """The report as markdown: header, one row per run, per-position acceptance, the figures against plain."""
    lines = [f"# blockspec bench: {title(result)}", ""]
    if result["synthetic"]:
        profile = result["synthetic_acceptance"]
        lines += [f"**{SYNTHETIC_NOTE}.** Profile: `{profile['profile']}`, seed {profile['seed']}.", ""]
    m = result["model"]
    lines.append(f"- date {result['date']}, torch {result['torch']}, transformers {result['transformers']}, "
                 f"commit {result['git_commit'] or 'n/a'}, source digest {result.get('source_digest', 'n/a')}")
    lines.append(f"- command: `{result['command']}`")
    lines.append(f"- target: {m['target']} ({m['dtype']}, {m['target_gb']:.3g} GB; "
                 f"{m['weight_bytes_per_step_gb']:.3g} GB read per decode step)")
    for name, desc in m["drafters"].items():
        lines.append(f"- {name}: {desc}")
    lines += tp_header(result)
    floor = result["floor"]
    if isinstance(floor, dict):
        lines.append(f"- floor: {floor['tok_s_batch1']:.1f} tok/s at batch 1 ({floor['step_ms_batch1']:.2f} ms/step, "
                     f"copy bandwidth {floor['copy_bandwidth_TBps']:.2f} TB/s); products "
                     f"{_f(floor.get('matmul_TFLOPs'))} TFLOP/s measured in the target's dtype, a row "
                     f"{_f(result['model'].get('row_gflops'), '.3f')} GFLOP plus attention")
    else:
        lines.append(f"- floor: {floor}")
    cfg = result["config"]
    lines.append(f"- {cfg['repeats']} timed rounds after a warm-up, each running every method once (the order "
                 "rotated each round); figures are medians over the rounds (min-max in brackets); 'vs plain' is the "
                 "median of each round's ratio to that round's plain pass, of output tok/s (prefill included) and "
                 "of decode tok/s (TTFT excluded); output "
                 f"{cfg['output_len']} tokens per request; {requests_note(cfg)}; 'input': prompt tokens per request "
                 "(inN in the lists); "
                 "TPOT and step exclude prefill steps; 'steps drafting': "
                 "share of decode steps that verified drafts; 'tokens = plain': share of each output equal to plain "
                 "decoding's before the first difference; 'memory GB': weights and KV caches, plus on a GPU the most a "
                 "pass allocated on top")
    columns = ("method", "batch", "T", "input", "output tok/s", "decode tok/s", "vs plain", "decode vs plain",
               "steps drafting",
               "step ms", "TPOT p50/p90 ms", "TTFT p50/p90 ms", "acc. len", "memory GB", "spec +GB", "tokens = plain")
    lines += ["", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in result["runs"]:
        name = r["method"] + (" (synthetic)" if r["synthetic"] else "")
        if r["status"] != "ok":
            lines.append(f"| {name} | {r['batch']} | {r['temperature']} | {input_cell(r)} | n/a: {r['reason']} |"
                         + "|" * (len(columns) - 5))
            continue
        o, vs, acc = r["output_tok_s"], r.get("vs_plain", {}), r.get("acceptance")
        tpot = r.get("tpot_ms") or {}
        lines.append(
            f"| {name} | {r['batch']} | {r['temperature']} | {input_cell(r)} "
            f"| {o['median']:.1f} ({o['min']:.1f}-{o['max']:.1f}) "
            f"| {r['decode_tok_s']['median']:.1f} | {speedup_cell(r)} | {speedup_cell(r, 'decode')} "
            f"| {_f(drafting_share(r), '.0%') if acc else ''} "
            f"| {_f(r.get('step_ms', {}).get('median'), '.2f')} "
            f"| {_f(tpot.get('p50'), '.2f')} / {_f(tpot.get('p90'), '.2f')} "
            f"| {_f(r['ttft_ms']['p50'], '.1f')} / {_f(r['ttft_ms']['p90'], '.1f')} "
            f"| {_f(acc['mean_acceptance_length'], '.2f') if acc else ''} | {_f(r.get('memory_gb_total'), '.3g')} "
            f"| {_f(vs.get('memory_overhead_gb'), '+.3g') if 'memory_overhead_gb' in vs else ''} "
            f"| {_f(r.get('prefix_match_plain'), '.0%') if 'prefix_match_plain' in r else ''} |")
    preempted = [f"{r['method']} {point_name(r)} ({r['preemptions']}x)" for r in result["runs"] if r.get("preemptions")]
    if preempted:
        lines += ["", "**KV pool short: these runs preempted requests (their prefill ran again, and is in their "
                      "timings): " + ", ".join(preempted) + ".**"]
    admitting = [r for r in result["runs"] if r["status"] == "ok" and r.get("prefill_steps")]
    if admitting:
        lines += ["", ("Steps that admit or prefill (left out of the decode figures; any decode beside the prefill "
                       "included): steps a pass, median step time, share of the pass's time:"), ""]
        lines += [f"- {r['method']} {point_name(r)}: {r['prefill_steps']['steps']:.3g} x "
                  f"{r['prefill_steps']['ms_median']:.2f} ms, {r['prefill_steps']['share']:.0%}" for r in admitting]
    spec_runs = [r for r in result["runs"] if r.get("acceptance")]
    if any(not drafted(r) for r in spec_runs):
        lines += ["", f"{NO_DRAFTS}."]
    if spec_runs:
        k = max(len(r["acceptance"]["per_position"]) for r in spec_runs)
        lines += ["", ("Per-position acceptance (of the steps that drafted position i, the share that accepted "
                       "it; - = never drafted):"), "",
                  "| method | batch | T | input | " + " | ".join(f"p{i + 1}" for i in range(k)) + " |",
                  "|---|---|---|---|" + "---|" * k]
        for r in spec_runs:
            per = r["acceptance"]["per_position"]
            cells = " | ".join([_f(x, ".2f").replace("n/a", "-") for x in per] + [""] * (k - len(per)))
            name = r["method"] + (" (synthetic)" if r["synthetic"] else "")
            lines.append(f"| {name} | {r['batch']} | {r['temperature']} | {input_cell(r)} | {cells} |")
        lines += ["", ("Draft length the engine chose per decode step (0 = plain step): steps, median step time, "
                       "the requests those steps decoded on average where fewer than the batch (where measured, the "
                       "floor of a step of that many requests: the target's products over its verify rows and its "
                       "attention, then the draft's, each at the longer of its bytes (weights, K/V) at the copy "
                       "bandwidth and its FLOPs at the measured product rate):"), ""]
        for r in spec_runs:
            parts = [f"K={k}: {v['steps']} x {v['ms_median']:.2f} ms" + occupancy(v, r["batch"])
                     + (f" (floor {v['floor_ms']:.2f} ms, {v['floor_bound']})" if "floor_ms" in v else "")
                     for k, v in r["steps_by_draft_length"].items()]
            lines.append(f"- {r['method']} {point_name(r)}: " + "; ".join(parts))
        at_expectation = [(r, decode_ratio_at_expectation(r)) for r in spec_runs]
        if any(x is not None for _, x in at_expectation):
            lines += ["", ("Synthetic draws against the profile: acceptance length drawn / the profile's expectation "
                           "for the draft lengths chosen, and decode vs plain had the draws hit the expectation "
                           "(the measured ratio x expected / drawn, step times as measured; compare methods by "
                           "this, not by their draws):"), ""]
            lines += [f"- {r['method']} {point_name(r)}: {r['acceptance']['mean_acceptance_length']:.2f} / "
                      f"{r['acceptance']['expected_length']:.2f}; decode {x:.2f}x" for r, x in at_expectation
                      if x is not None]
        lines += ["", "What a speculative run holds, by part (GB; the graphs: what their captures added to the "
                      "allocator's reservation):", ""]
        lines += [f"- {r['method']} {point_name(r)}: " + ", ".join(f"{part.replace('_', ' ')} {gb:.3g}" for part, gb
                                                                 in r["memory_gb"].items()) for r in spec_runs]
    lines += ["", "Against plain decoding:", ""]
    c = result["checks"]
    if not any(r["method"] == "plain" for r in result["runs"]):
        lines.append("- no plain run (--methods leaves plain out): nothing to compare with")
    if "plain_batch1_floor_ratio" in c:
        lines.append(f"- plain decode at batch 1: {c['plain_batch1_floor_ratio']:.1%} of the bandwidth floor")
    for method, v in c["batch1_T0"].items():
        if v["speedup"] is None:
            lines.append(f"- {method} at batch 1, T=0{_prompts(v)}: no drafts")
            continue
        lines.append(f"- {method} at batch 1, T=0{_prompts(v)}: a step with {v['draft_length']} draft(s) takes "
                     f"{_f(v['step_over_plain'], '.2f')}x a plain step; end-to-end {v['speedup']:.2f}x plain at "
                     f"acceptance length {_f(v['mean_acceptance_length'], '.2f')}"
                     + (" (synthetic)" if result["synthetic"] else ""))
    for method, points in c["vs_plain"].items():
        pts = ", ".join(f"{point_name(p)} " + ("no drafts" if p["verdict"] == "no drafts" else
                        f"{_f(p['speedup'], '.2f')}x ({p['verdict']}; decode {_f(p.get('decode_speedup'), '.2f')}x)")
                        for p in points)
        lines.append(f"- {method}: {pts}")
    if "k_sweep" in result:
        lines += sweep_lines(result["k_sweep"])
    lines += tp_sections(result)
    return "\n".join(lines) + "\n"


def write_outputs(result: dict[str, Any], out_dir: str | Path, plots: bool = True) -> dict[str, Path]:
    """bench.json, bench.md, policy_trace.json (with --trace-policy) and (with matplotlib) the PNG plots;
    returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "bench.json", "markdown": out / "bench.md"}
    if "policy_traces" in result:
        result = dict(result)
        paths["policy_trace"] = out / "policy_trace.json"
        paths["policy_trace"].write_text(json.dumps(result.pop("policy_traces")) + "\n")
    paths["json"].write_text(json.dumps(result, indent=1) + "\n")
    paths["markdown"].write_text(markdown(result), encoding="utf-8")  # model paths may be any text
    if plots:
        paths.update(write_plots(result, out))
    return paths
