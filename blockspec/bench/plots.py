"""PNG plots of a bench report: output tok/s against batch size per method, and per-position acceptance.

Synthetic-acceptance reports carry the label in every plot title (and in the PNG's Title metadata), so
a figure cannot leave the report without it.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any


def _titled(result: dict[str, Any], text: str) -> str:
    if result["synthetic"]:
        return f"SYNTHETIC ACCEPTANCE ({result['synthetic_acceptance']['profile']}): {text}"
    return text


def write_plots(result: dict[str, Any], out: Path) -> dict[str, Path]:
    """Write the plots next to the JSON; without matplotlib, warn and write none (the numbers are in the JSON)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        warnings.warn("matplotlib is not installed: no plots written (pip install matplotlib)", stacklevel=2)
        return {}
    runs = [r for r in result["runs"] if r["status"] == "ok"]
    paths = {}

    fig, ax = plt.subplots(figsize=(7, 4.5))
    series: dict[tuple[str, float], list[tuple[int, float, float, float]]] = {}
    for r in runs:
        o = r["output_tok_s"]
        series.setdefault((r["method"], r["temperature"]), []).append((r["batch"], o["median"], o["min"], o["max"]))
    for (method, temp), pts in sorted(series.items()):
        pts.sort()
        xs, med = [p[0] for p in pts], [p[1] for p in pts]
        err = [[p[1] - p[2] for p in pts], [p[3] - p[1] for p in pts]]
        ax.errorbar(xs, med, yerr=err, marker="o", capsize=3, label=f"{method}, T={temp}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch size (concurrent requests)")
    ax.set_ylabel("output tokens / s (median, min-max)")
    heading = _titled(result, f"throughput vs batch, {result['device']}")
    ax.set_title(heading, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths["plot_throughput"] = out / "tok_s_vs_batch.png"
    fig.savefig(paths["plot_throughput"], dpi=120, metadata={"Title": heading})
    plt.close(fig)

    acc = [r for r in runs if r.get("acceptance") and r["acceptance"]["per_position"]]
    if acc:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for r in acc:
            per = [float("nan") if x is None else x for x in r["acceptance"]["per_position"]]
            ax.plot(range(1, len(per) + 1), per, marker=".",
                    label=f"{r['method']}, batch {r['batch']}, T={r['temperature']}")
        ax.set_xlabel("draft position")
        ax.set_ylabel("share of steps drafting it that accepted it")
        ax.set_ylim(0, 1.02)
        heading = _titled(result, "per-position acceptance")
        ax.set_title(heading, fontsize=9)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        paths["plot_acceptance"] = out / "per_position_acceptance.png"
        fig.savefig(paths["plot_acceptance"], dpi=120, metadata={"Title": heading})
        plt.close(fig)
    return paths
