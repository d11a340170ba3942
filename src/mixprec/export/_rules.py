"""From a history of window amaxes to a static fp8 scale."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["ScaleRule", "E4M3_MAX", "check_finite_amax", "has_statistics", "static_scale"]

E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448


def static_scale(amax: torch.Tensor) -> torch.Tensor:
    """The dequantization scale (compressed-tensors' and vLLM's ``input_scale``, ``k_scale``):
    ``float32(max(amax, 1e-12) / 448)`` computed in float64, shape ``(1,)``."""
    return (amax.double().clamp(min=1e-12) / E4M3_MAX).float().reshape(1)


def has_statistics(history: torch.Tensor | None) -> bool:
    """Whether ``history`` holds a window amax other than 0 (an inf or NaN one too: it is refused by
    :func:`check_finite_amax`, not taken for no statistics)."""
    return history is not None and bool(history.ne(0).any())


def check_finite_amax(amax: torch.Tensor, what: str, source: str) -> None:
    """Refuse (ValueError naming ``what``, e.g. ``"the input of layer 'fc'"``) a 0-d ``amax`` (a
    :class:`ScaleRule`'s, from a history that :func:`has_statistics`) that is inf or NaN, where a static
    scale from it makes the served layer compute NaN (an ``input_global_scale`` of 0), or that is not
    positive: the rule's windows are all 0 (the layer ran only in older ones), and a scale from it
    (``1e-12 / 448``; NVFP4: an infinite ``input_global_scale``) would serve every input as 0 or NaN."""
    if not bool(torch.isfinite(amax)):
        raise ValueError(
            f"export: the amax of {what} is {float(amax)} ({source}): a window of it saw an inf or NaN "
            f"(a step a loss scaler skipped, or a diverged run), and a static scale from it would serve NaN; "
            f"record the statistics with mixprec.export.Recorder (it leaves such steps out) and pass stats=, "
            f"or choose a ScaleRule(windows=...) whose windows exclude it")
    if not bool(amax > 0):
        raise ValueError(
            f"export: the amax of {what} over the ScaleRule's windows is {float(amax)} ({source}): it ran in "
            f"none of them (its statistics are older), and a static scale from it would serve every input as 0 "
            f"or NaN; choose a ScaleRule(windows=...) that reaches its windows (None: all), or record batches "
            f"where it runs (mixprec.export.Recorder or calibrate)")


@dataclass(frozen=True)
class ScaleRule:
    """How a static scale comes from the per-window amaxes: the ``percentile`` (100: the max) of the
    last ``windows`` windows (None: all), times ``margin``; the scale is that amax / 448.

    Example:
        >>> ScaleRule(windows=2).amax(torch.tensor([4.0, 1.0, 2.0]))
        tensor(2.)
        >>> ScaleRule(margin=1.5).scale(torch.tensor([2.0, 4.0]))
        tensor([0.0134])
    """

    windows: int | None = 8
    percentile: float = 100.0
    margin: float = 1.0

    def __post_init__(self) -> None:
        if self.windows is not None and (not isinstance(self.windows, int) or self.windows < 1):
            raise ValueError(f"ScaleRule.windows must be an int >= 1 (the last N windows) or None (all), got {self.windows!r}")
        if not (isinstance(self.percentile, (int, float)) and 0 < self.percentile <= 100):
            raise ValueError(f"ScaleRule.percentile must be in (0, 100] (100: the max over the windows), got {self.percentile!r}")
        if not (isinstance(self.margin, (int, float)) and math.isfinite(self.margin) and self.margin > 0):
            raise ValueError(f"ScaleRule.margin must be a positive finite factor on the amax, got {self.margin!r}")

    def amax(self, history: torch.Tensor) -> torch.Tensor:
        """The rule's amax (before the margin) of a ``(windows,)`` history; ValueError when empty."""
        if history.numel() == 0:
            raise ValueError("ScaleRule: no window recorded")
        h = history.float().reshape(-1)
        if self.windows is not None:
            h = h[-self.windows:]
        if self.percentile == 100:
            return h.max()
        return torch.quantile(h.double(), self.percentile / 100).float()

    def scale(self, history: torch.Tensor) -> torch.Tensor:
        """``static_scale(amax(history) * margin)``, shape ``(1,)``, float32."""
        return static_scale(self.amax(history).double() * self.margin)

    def describe(self) -> str:
        which = "max" if self.percentile == 100 else f"p{self.percentile:g}"
        last = "all windows" if self.windows is None else f"the last {self.windows} windows"
        return f"{which} over {last} x {self.margin:g} / 448"
