"""The demo report's fp4 figure: per fp4 mode, the share of each linear layer's forward,
input-gradient and weight-gradient GEMMs run in fp4 over training, mean over the seeds (drawn
when an fp4 mode ran; :mod:`mixprec.demo.fp4`). matplotlib is imported by :func:`plot` only.

Example:
    >>> from mixprec.demo.results import DemoResult
    >>> from mixprec.demo.settings import Settings
    >>> figure_spec(DemoResult(Settings.for_size("tiny", steps=1), "cpu", {}, [])) is None
    True
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from mixprec.demo.flops import GEMM_WORDS, GEMMS, share
from mixprec.demo.fp4 import fp4_paragraph, fp4_summary
from mixprec.demo.results import DemoResult

__all__ = ["figure_spec", "plot"]


def figure_spec(result: DemoResult) -> dict[str, Any] | None:
    """The figure's spec (name, file, title, data, caption), or ``None`` when no fp4 mode ran.
    ``data``: ``{mode: {layer: {gemm: fp4 share}}}``, each the mean over the mode's seeds."""
    summary = fp4_summary(result)
    if not summary:
        return None
    data = {}
    for mode in summary["modes"]:
        runs = [r for r in result.of(mode) if r.gemms]
        layers = list(runs[0].gemms["layers"])
        data[mode] = {layer: {g: statistics.fmean(share(r.gemms, layer=layer, gemm=g) for r in runs) for g in GEMMS}
                      for layer in layers}
    return {
        "name": "fp4",
        "file": "fp4.png",
        "title": "Share of each linear layer's GEMMs run in fp4",
        "data": data,
        "caption": ("Per fp4 mode (columns: forward, input-gradient and weight-gradient GEMM of each linear "
                    "layer, rows), the share of the training steps that GEMM ran in fp4, mean over "
                    f"{_over(result)}; "
                    "the rest ran in fp8 or bf16. " + (fp4_paragraph(result) or "")),
    }


def _over(result: DemoResult) -> str:
    seeds = result.seeds
    return f"seed {seeds[0]}" if len(seeds) == 1 else f"the {len(seeds)} seeds ({', '.join(map(str, seeds))})"


def plot(spec: dict[str, Any], path: Path) -> None:
    """Draws ``spec`` (from :func:`figure_spec`) into the PNG ``path``; needs matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(spec["data"])
    layers = list(next(iter(spec["data"].values())))
    fig, axes = plt.subplots(1, len(modes), figsize=(3 + 2.6 * len(modes), 1.5 + 0.32 * len(layers)), dpi=100,
                             squeeze=False, sharey=True)
    for ax, mode in zip(axes[0], modes):
        grid = [[spec["data"][mode][layer][g] for g in GEMMS] for layer in layers]
        image = ax.imshow(grid, vmin=0.0, vmax=1.0, cmap="viridis", aspect="auto")
        for i, row in enumerate(grid):
            for j, value in enumerate(row):
                ax.text(j, i, f"{value:.0%}", ha="center", va="center", fontsize=7,
                        color="white" if value < 0.5 else "black")
        ax.set_xticks(range(len(GEMMS)), [GEMM_WORDS[g].replace(" ", "\n") for g in GEMMS], fontsize=7)
        ax.set_yticks(range(len(layers)), layers, fontsize=7)
        ax.set_title(mode, fontsize=9)
    fig.colorbar(image, ax=axes[0].tolist(), label="share of steps in fp4", shrink=0.8)
    fig.suptitle(spec["title"], fontsize=10)
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)
