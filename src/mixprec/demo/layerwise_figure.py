"""The demo report's per-layer scaling figure: each cut point's factor over training (drawn when a
mode with ``GradScaler(per_layer=True)`` ran, i.e. ``mixprec-fp16-layerwise``).

The data is what the training loop recorded (``ModeResult.layer_scales``, see
:func:`mixprec.demo.train.run_mode`): ``{cut point: its factor after each step}``, powers of two.
matplotlib is imported by :func:`plot` only.

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

from mixprec.demo.results import DemoResult

__all__ = ["figure_spec", "plot"]


def _binades(factor: float) -> str:
    return f"2^{int(math.log2(factor))}"


def figure_spec(result: DemoResult) -> dict[str, Any] | None:
    """The figure's spec (name, file, title, data, caption) for the first seed's per-layer modes,
    or ``None`` when none ran."""
    layered = [m for m in (result.modes if result.runs else []) if m.layer_scales]
    if not layered:
        return None
    lines = []
    for m in layered:
        final = {cut: series[-1] for cut, series in m.layer_scales.items()}
        low, high = min(final, key=final.get), max(final, key=final.get)
        lines.append(f"{m.mode}: after {len(next(iter(m.layer_scales.values())))} steps the factors run from "
                     f"{_binades(final[low])} ({low}) to {_binades(final[high])} ({high})")
    return {
        "name": "layer_scales",
        "file": "layer_scales.png",
        "title": "Per-layer scaling: factor of each cut point",
        "data": {m.mode: m.layer_scales for m in layered},
        "caption": (
            f"Seed {layered[0].seed}: the power of two each cut point (the output of a transformer block) multiplies the "
            "gradient crossing it by, on top of the loss scale, after each step (log scale); a "
            "parameter's gradient carries the loss scale times the factors of the cut points above "
            "it. " + "; ".join(lines) + "."
        ),
    }


def plot(spec: dict[str, Any], path: Path) -> None:
    """Draws ``spec`` (from :func:`figure_spec`) into the PNG ``path``; needs matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5), dpi=100)
    styles = ("-", "--", ":", "-.")
    for i, (mode, series) in enumerate(spec["data"].items()):
        for j, (cut, factors) in enumerate(series.items()):
            ax.step(range(1, len(factors) + 1), factors, where="post", linewidth=1.4,
                    color=plt.get_cmap("viridis")(j / max(1, len(series) - 1)), linestyle=styles[i % 4],
                    label=cut if len(spec["data"]) == 1 else f"{mode} {cut}")
    ax.set_yscale("log", base=2)
    ax.set(xlabel="step", ylabel="cut point's factor", title=spec["title"])
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
