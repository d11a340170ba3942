"""Kahan-compensated writes of a float32 result into a low-precision parameter.

A low-precision parameter ``p`` with a compensation buffer ``c`` (same dtype as ``p``) represents
the float32 value ``p + c``: ``c`` holds the part of the last update that rounding ``p`` dropped.
The next update starts from ``p + c`` in float32, so small updates accumulate in ``c`` until they
are large enough to move ``p``, instead of being lost. ``c`` is at most half a gap of ``p`` in
magnitude, so the low-precision dtype represents it with its usual relative precision.
"""

from __future__ import annotations

import torch

__all__ = ["compensated_value", "kahan_write_"]


def compensated_value(param: torch.Tensor, comp: torch.Tensor | None) -> torch.Tensor:
    """The float32 value a parameter stands for: ``param + comp`` (a new tensor)."""
    value = param.detach().to(torch.float32, copy=True)
    if comp is not None:
        value.add_(comp)
    return value


def kahan_write_(param: torch.Tensor, comp: torch.Tensor, target: torch.Tensor) -> None:
    """Set ``param`` to ``target`` (float32) rounded to nearest, and ``comp`` to what was lost.

    Afterwards ``param + comp == target`` up to ``comp``'s own rounding (relative ``2**-8`` of a
    value already below half a gap of ``param`` for bfloat16). Used both by the optimizers' step
    and to seed the buffer from an fp32 checkpoint.
    """
    param.copy_(target)
    comp.copy_(target - param.to(torch.float32))
