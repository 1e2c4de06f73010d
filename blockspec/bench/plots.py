"""PNG plots of a bench report: the speedup over plain decoding by batch size (the one to read first),
output throughput by method, and per-position acceptance.

One colour per method and one line style per temperature in every plot (and, where a sweep has several
prompt lengths, one marker per length, named in the legend). Every title says what was
measured: target, dtype, device, prompt and output lengths, and real or synthetic acceptance; synthetic
reports lead the title (and the PNG's Title metadata) with the label, so a figure cannot leave the report
without it.
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path
from typing import Any

from blockspec.bench.drafts import drafted, drafting_share

COLORS = {"plain": "black", "dflash": "tab:blue", "dspark": "tab:orange", "hf-generate": "tab:green",
          "hf-assisted": "tab:purple"}
LINE_STYLES = ("-", "--", ":", "-.")
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")


def title(result: dict[str, Any]) -> str:
    """What was measured, in one line: target, dtype, device, prompt and output lengths, and whether the
    acceptance is real or synthetic (then first, in capitals)."""
    m = result["model"]
    runs = [r for r in result["runs"] if r["status"] == "ok" and "prompt_tokens_mean" in r]
    lengths = _lengths(result)
    prompt = sum(r["prompt_tokens_mean"] for r in runs) / len(runs) if runs else float("nan")
    ranks = result.get("tensor_parallel_size", 1)
    text = (f"{m['target']} ({m['dtype']}) on {result['device']}{f', TP={ranks}' if ranks > 1 else ''}: "
            f"{'/'.join(map(str, lengths)) if lengths else format(prompt, '.0f')}-token prompts, "
            f"{result['config']['output_len']} output tokens")
    if result["synthetic"]:
        return f"SYNTHETIC ACCEPTANCE {result['synthetic_acceptance']['profile']}: {text}"
    return f"{text}, real acceptance"


def _lengths(result: dict[str, Any]) -> list[int]:
    """The random prompts' lengths of the sweep (none for prompts from a file or set)."""
    return sorted({r["input_len"] for r in result["runs"] if r.get("input_len")})


def _style(result: dict[str, Any], run: dict[str, Any]) -> dict[str, Any]:
    """The run's method colour, temperature line style and prompt-length marker."""
    temps = sorted({r["temperature"] for r in result["runs"]})
    lengths = _lengths(result) or [None]
    return {"color": COLORS.get(run["method"], "tab:gray"),
            "linestyle": LINE_STYLES[temps.index(run["temperature"]) % len(LINE_STYLES)],
            "marker": MARKERS[lengths.index(run.get("input_len")) % len(MARKERS)]}


def _label(result: dict[str, Any], run: dict[str, Any]) -> str:
    """"dflash, T=0.0", with the prompt length where the sweep has several."""
    several = len(_lengths(result)) > 1
    return f"{run['method']}, T={run['temperature']}" + (f", {run['input_len']}-token prompts" if several else "")


def _batch_axis(ax: Any, batches: list[int]) -> None:
    """A log-2 axis of batch sizes ticked with the sizes themselves, as plain numbers."""
    from matplotlib.ticker import FixedLocator, NullLocator

    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(FixedLocator(sorted(set(batches))))
    ax.xaxis.set_major_formatter(lambda value, _: f"{value:g}")
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xlabel("batch size (concurrent requests)")


def _series(result: dict[str, Any], runs: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Runs grouped by their label (method, temperature and, where several, prompt length), each group
    sorted by batch size."""
    groups: dict[tuple[str, float, int], list[dict[str, Any]]] = {}
    for r in runs:
        groups.setdefault((r["method"], r["temperature"], r.get("input_len") or 0), []).append(r)
    return {_label(result, group[0]): sorted(group, key=lambda r: r["batch"]) for _, group in sorted(groups.items())}


def no_drafts(group: list[dict[str, Any]]) -> list[int]:
    """Batch sizes at which the speculative runs of `group` never drafted."""
    return [r["batch"] for r in group if r.get("acceptance") and not drafted(r)]


def speedup_figure(result: dict[str, Any]) -> tuple[Any, str]:
    """Output tok/s over plain decoding's at the same batch and temperature (median of the rounds' ratios,
    min-max bars); a point whose speculative run never drafted is an x on the plain line, listed under
    "no drafts" at its batch size, not given a speedup."""
    import matplotlib.pyplot as plt

    runs = [r for r in result["runs"] if r["status"] == "ok" and (r.get("vs_plain") or {}).get("output_tok_s_ratio")]
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    ax.axhline(1.0, color=COLORS["plain"], linewidth=1, label="plain decoding")
    for label, group in _series(result, runs).items():
        style = _style(result, group[0])
        shown = [r for r in group if drafted(r) or not r.get("acceptance")]
        if shown:
            ratios = [r["vs_plain"]["output_tok_s_ratio"] for r in shown]
            spans = [r["vs_plain"].get("output_tok_s_ratio_range") or [x, x] for r, x in zip(shown, ratios)]
            err = [[x - lo for x, (lo, _) in zip(ratios, spans)], [hi - x for x, (_, hi) in zip(ratios, spans)]]
            ax.errorbar([r["batch"] for r in shown], ratios, yerr=err, capsize=3, label=label, **style)
            for r, x in zip(shown, ratios):
                share = drafting_share(r)
                if share is not None and share < 0.5:  # mostly plain steps: the ratio is mostly plain vs plain
                    ax.annotate(f"{share:.0%} of steps drafted", (r["batch"], x), textcoords="offset points",
                                xytext=(5, 4), fontsize=7, color=style["color"])
        missing = no_drafts(group)
        if missing:
            ax.plot(missing, [1.0] * len(missing), marker="x", markersize=9, color=style["color"], linestyle="none")
    undrafted: dict[int, list[str]] = {}
    for label, group in _series(result, runs).items():
        for batch in no_drafts(group):
            undrafted.setdefault(batch, []).append(label)
    for batch, names in sorted(undrafted.items()):
        ax.annotate("no drafts:\n" + "\n".join(names), (batch, 1.0), textcoords="offset points", xytext=(5, -8),
                    va="top", fontsize=7)
    _batch_axis(ax, [r["batch"] for r in runs] or [1])
    ax.set_ylabel("speedup over plain decoding (x)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    return _finish(fig, ax, result, "speedup over plain decoding")


def throughput_figure(result: dict[str, Any]) -> tuple[Any, str]:
    """Output tok/s (median, min-max bars) against batch size, per method and temperature."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import LogLocator

    runs = [r for r in result["runs"] if r["status"] == "ok"]
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for label, group in _series(result, runs).items():
        med = [r["output_tok_s"]["median"] for r in group]
        err = [[x - r["output_tok_s"]["min"] for x, r in zip(med, group)],
               [r["output_tok_s"]["max"] - x for x, r in zip(med, group)]]
        missing = no_drafts(group)
        note = f" (no drafts at batch {', '.join(map(str, missing))})" if missing else ""
        ax.errorbar([r["batch"] for r in group], med, yerr=err, capsize=3, label=f"{label}{note}",
                    **_style(result, group[0]))
    _batch_axis(ax, [r["batch"] for r in runs] or [1])
    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(lambda value, _: f"{value:,.0f}")
    ax.yaxis.set_minor_formatter(lambda value, _: "")
    ax.set_ylabel("output tokens / s (median, min-max)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return _finish(fig, ax, result, "throughput by method")


def acceptance_figure(result: dict[str, Any]) -> tuple[Any, str] | None:
    """Per draft position, the share of the steps drafting it that accepted it; positions a run never
    drafted are left out of its line and marked with an x on the axis (a rejected draft is a 0, a
    position never drafted has no rate); runs that drafted nothing are listed, not drawn. Colour: method;
    line style: temperature; marker: batch size. None when no run is speculative."""
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    runs = [r for r in result["runs"] if r["status"] == "ok" and r.get("acceptance")]
    if not runs:
        return None
    batches = sorted({r["batch"] for r in runs})
    temps = sorted({r["temperature"] for r in result["runs"]})
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    never_drafted = False
    for r in (r for r in runs if drafted(r)):
        style = {**_style(result, r), "marker": MARKERS[batches.index(r["batch"]) % len(MARKERS)]}
        per = r["acceptance"]["per_position"]
        positions = range(1, len(per) + 1)
        ax.plot(positions, [float("nan") if x is None else x for x in per], markersize=4, **style)
        never = [i for i, x in zip(positions, per) if x is None]
        ax.plot(never, [0.0] * len(never), marker="x", linestyle="none", color=style["color"], clip_on=False)
        never_drafted = never_drafted or bool(never)
    methods = sorted({r["method"] for r in runs})
    legend = ([Line2D([], [], color=COLORS.get(m, "tab:gray"), label=m) for m in methods]
              + [Line2D([], [], color="gray", linestyle=LINE_STYLES[temps.index(t) % len(LINE_STYLES)], label=f"T={t}")
                 for t in sorted({r["temperature"] for r in runs})]
              + [Line2D([], [], color="gray", linestyle="none", marker=MARKERS[i % len(MARKERS)], label=f"batch {b}")
                 for i, b in enumerate(batches)])
    if never_drafted:
        legend.append(Line2D([], [], color="gray", linestyle="none", marker="x", label="never drafted"))
    ax.legend(handles=legend, fontsize=7, ncol=2)
    idle = [f"{r['method']} b{r['batch']} T={r['temperature']}" for r in runs if not drafted(r)]
    if idle:
        ax.text(0.01, 0.99, "no drafts: " + ", ".join(idle), transform=ax.transAxes, va="top", fontsize=7, wrap=True)
    ax.set_xlabel("draft position")
    ax.set_ylabel("share of the steps drafting it that accepted it")
    ax.set_ylim(0, 1.02)
    ax.grid(True, alpha=0.3)
    return _finish(fig, ax, result, "per-position acceptance")


def _finish(fig: Any, ax: Any, result: dict[str, Any], what: str) -> tuple[Any, str]:
    """Title the plot with what it shows and what was measured; returns the figure and that heading (the
    PNG's Title metadata)."""
    ax.set_title(f"{what}\n{textwrap.fill(title(result), 110)}", fontsize=8)
    fig.tight_layout()
    return fig, f"{title(result)} -- {what}"


def write_plots(result: dict[str, Any], out: Path) -> dict[str, Path]:
    """Write the plots next to the JSON; without matplotlib, warn and write none (the numbers are in the JSON)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print('warning: matplotlib is not installed: no plots written (pip install "blockspec[bench]")',
              file=sys.stderr)
        return {}
    paths = {}
    for key, name, make in (("plot_speedup", "speedup_vs_plain.png", speedup_figure),
                            ("plot_throughput", "tok_s_vs_batch.png", throughput_figure),
                            ("plot_acceptance", "per_position_acceptance.png", acceptance_figure)):
        made = make(result)
        if made is None:
            continue
        fig, heading = made
        paths[key] = out / name
        fig.savefig(paths[key], dpi=120, metadata={"Title": heading})
        plt.close(fig)
    return paths
