"""The demo report's fp8 figure: per fp8 layer and operand, amax and underflow over training, and
the guard's fallbacks or the controller's decision count (drawn when a mode with fp8 layers ran,
e.g. ``mixprec-fp8``; the decisions themselves are marked on the loss figure).

The data is what the training loop recorded (``ModeResult.fp8``, see
:func:`mixprec.demo.train.run_mode`): every ``every`` steps of the guard or controller, the worst
value of each statistic over the window. matplotlib is imported by :func:`plot` only.

Example:
    >>> from mixprec.demo.results import DemoResult
    >>> from mixprec.demo.settings import Settings
    >>> figure_spec(DemoResult(Settings.for_size("tiny", steps=1), "cpu", {}, [])) is None
    True
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from mixprec.demo.results import DemoResult, fp8_summary

__all__ = ["figure_spec", "plot"]

_OPERANDS = ("input", "weight", "grad_output")
_FORMATS = {"tensorwise": ("e4m3", "e4m3", "e5m2"), "rowwise": ("e4m3", "e4m3", "e4m3"),
            "rowwise_with_gw_hp": ("e4m3", "e4m3", "e4m3")}


def _percent(x: float) -> str:
    return f"{x:.3%}" if x < 0.01 else f"{x:.1%}"


def _rule(thresholds: dict[str, Any]) -> str:
    """The guard's thresholds in words, e.g. "an operand's underflow exceeds 5% (dotted red line)
    or an operand has an inf/NaN"."""
    parts = []
    if thresholds.get("max_underflow") is not None:
        parts.append(f"an operand's underflow exceeds {thresholds['max_underflow']:.4g} (dotted red line)")
    if thresholds.get("max_nonfinite") is not None:
        count = thresholds["max_nonfinite"]
        parts.append("an operand has an inf/NaN" if count == 0 else f"an operand has more than {count:g} inf/NaN")
    if thresholds.get("max_saturated") is not None:
        parts.append(f"more than {thresholds['max_saturated']:.4g} of an operand lies beyond the previous amax")
    if thresholds.get("min_sqnr_db") is not None:
        parts.append(f"the sampled output SQNR falls below {thresholds['min_sqnr_db']:g} dB")
    return " or ".join(parts) if parts else "never (every threshold off)"


def figure_spec(result: DemoResult) -> dict[str, Any] | None:
    """The fp8 figure's file name, title, data (the first seed's series of every fp8 mode, and
    :func:`~mixprec.demo.results.fp8_summary` over every seed) and caption; None when no mode
    of ``result`` ran fp8 layers."""
    summary = fp8_summary(result)
    if not summary:
        return None
    series = {m.mode: m.fp8 for m in result.modes if m.fp8}
    seeds = len(result.seeds)
    seed = f" (seed {result.seeds[0]}" + (f"; fallbacks and decisions over {seeds} seeds)" if seeds > 1 else ")")
    every = next(iter(summary.values()))["every"]
    guarded = [e for e in summary.values() if e["judge"] == "guard"]
    limits = guarded[0]["thresholds"] if guarded else next(iter(summary.values()))["thresholds"]
    rule = (f"The guard moves a layer back to bf16 when {_rule(limits)}; a vertical line in the layer's colour "
            "marks a fallback, a cross the underflow that caused it. " if guarded else
            f"The controller moves a layer up its ladder when its forecast underflow exceeds "
            f"{limits['max_underflow']:.4g} (dotted red line) or it has an inf/NaN, and back down when the "
            "format below is safe again. ")
    guard = []
    for name, entry in summary.items():
        falls = entry["fallbacks"]
        worst = entry["worst_underflow"]
        worst_text = (f"; its worst underflow was {_percent(worst['value'])} ({worst['layer']} {worst['operand']}, "
                      f"window ending at step {worst['step']})" if worst else "")
        if entry["judge"] == "controller":
            n = len(entry["decisions"])
            over = f" over {seeds} seeds" if seeds > 1 else ""
            guard.append(f"{name}: the controller made {n} decision{'' if n == 1 else 's'}{over} (triangles on the "
                         f"loss curve), in fp8 {entry['fp8_fraction']:.1%} of layer-steps{worst_text}")
        elif falls:
            names = ", ".join(f"{f['layer']} at step {f['step']} ({f['operand']} {f['statistic']} {f['value']:.4g}"
                              + (f", seed {f['seed']}" if seeds > 1 else "") + ")" for f in falls)
            guard.append(f"{name}: the guard moved {names} back to bf16{worst_text}")
        else:
            guard.append(f"{name}: no layer fell back{' over ' + str(seeds) + ' seeds' if seeds > 1 else ''}"
                         f"{worst_text}")
    caption = (
        f"fp8 statistics of the Linear layers each fp8 mode runs in fp8{seed}, the first and the last "
        f"Linear staying in bf16: every {every} steps, the worst value over the window of the absolute "
        "maximum of the input, the weight and the gradient of the output (the scale is the format's "
        "largest value over it, per tensor or per row), and of the fraction of nonzero values the "
        "scaled cast flushed to zero. " + rule + "; ".join(guard) + "."
    )
    return {
        "name": "fp8",
        "file": "fp8.png",
        "title": "fp8 statistics per layer and operand",
        "data": {"series": series, "summary": summary},
        "caption": caption,
    }


def plot(spec: dict[str, Any], path: Path) -> None:
    """Draw ``spec`` (from :func:`figure_spec`) into ``path``: one column per operand, amax
    (log) above and underflow below, one colour per layer and one line style per fp8 mode,
    crosses at fallbacks."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    series = spec["data"]["series"]
    layers = list(dict.fromkeys(layer for run in series.values() for layer in run["layers"]))
    cmap = plt.get_cmap("tab10" if len(layers) <= 10 else "viridis")
    colors = {layer: cmap(i % 10 if len(layers) <= 10 else i / max(1, len(layers) - 1))
              for i, layer in enumerate(layers)}
    styles = {mode: ("-", "--", ":", "-.")[i % 4] for i, mode in enumerate(series)}
    from matplotlib.ticker import FixedLocator, FuncFormatter

    fig, axes = plt.subplots(2, len(_OPERANDS), figsize=(12, 6.5), dpi=100, sharex=True)
    threshold = next(iter(series.values()))["thresholds"]["max_underflow"]
    highest = max([v for run in series.values() for ops in run["layers"].values() for st in ops.values()
                   for v in st["underflow"]] + [threshold or 0.0, 1e-3])
    for j, operand in enumerate(_OPERANDS):
        amax_ax, under_ax = axes[0][j], axes[1][j]
        for mode, run in series.items():
            steps = run["steps"]
            fmt = _FORMATS.get(run["recipe"], ("", "", ""))[j]
            fell = {f["layer"]: f["step"] for f in run["fallbacks"]}
            for layer, operands in run["layers"].items():
                # after its fallback a layer runs in bf16 and records nothing: the line stops
                shown = [step <= fell.get(layer, math.inf) for step in steps]
                stats = {k: [v if keep else math.nan for v, keep in zip(vs, shown)]
                         for k, vs in operands[operand].items()}
                style = {"color": colors[layer], "linestyle": styles[mode], "linewidth": 1.2}
                amax_ax.plot(steps, stats["amax"], **style)
                under_ax.plot(steps, stats["underflow"], **style)
            amax_ax.set_title(f"{operand}" + (f" ({fmt} for {run['recipe']})" if len(series) == 1 and fmt else ""),
                              fontsize=10)
            # a fallback: a vertical line in the layer's colour in its operand's column (in every
            # column for the output SQNR), and a cross at the underflow that caused it
            for fall in run["fallbacks"]:
                if fall["operand"] not in (operand, "output"):
                    continue
                color = colors.get(fall["layer"], "red")
                for ax in (amax_ax, under_ax):
                    ax.axvline(fall["step"], color=color, linestyle=styles[mode], linewidth=0.8, alpha=0.7)
                if fall["statistic"] == "underflow":
                    under_ax.scatter([fall["step"]], [fall["value"]], marker="x", s=80, color=color)
        amax_ax.set_yscale("log")
        # linear below 0.01%, logarithmic above: zero, rare flushes and the threshold all visible
        under_ax.set_yscale("symlog", linthresh=1e-4)
        under_ax.set_ylim(0, min(1.0, 2 * highest))
        under_ax.yaxis.set_major_locator(FixedLocator([0, 1e-4, 1e-3, 1e-2, 1e-1, 1.0]))
        under_ax.yaxis.set_minor_locator(FixedLocator([]))
        under_ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v * 100:g}%"))
        if threshold is not None:
            under_ax.axhline(threshold, color="red", linestyle=":", linewidth=1)
        under_ax.set_xlabel("step")
        for ax in (amax_ax, under_ax):
            ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("amax (window max)")
    axes[1][0].set_ylabel("underflow (fraction, window max)")
    handles = [Line2D([], [], color=colors[layer], label=layer) for layer in layers]
    handles += [Line2D([], [], color="gray", linestyle=styles[mode], label=mode) for mode in series]
    fig.legend(handles=handles, fontsize=8, loc="center left", bbox_to_anchor=(0.86, 0.5), borderaxespad=0)
    fig.suptitle(spec["title"])
    fig.tight_layout(rect=(0, 0, 0.85, 1))
    fig.savefig(path)
    plt.close(fig)
