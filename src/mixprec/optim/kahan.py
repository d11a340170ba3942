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

    Under ``torch.compile`` the rounding is computed on the bits (bfloat16): Inductor drops a
    float32 -> low precision -> float32 round trip unless
    ``torch._inductor.config.emulate_precision_casts`` is set, which would leave ``comp`` at 0.

    Raises:
        RuntimeError: compiling a float16 write without ``emulate_precision_casts``.
    """
    if torch.compiler.is_compiling():
        rounded = _rounded_for_compiler(target, param.dtype)
        param.copy_(rounded)  # exact
        comp.copy_(target - rounded)
        return
    param.copy_(target)
    comp.copy_(target - param.to(torch.float32))


def _rounded_for_compiler(target: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``target`` rounded to ``dtype`` (nearest even), as float32, in a form Inductor keeps."""
    import torch._inductor.config as inductor_config

    if getattr(inductor_config, "emulate_precision_casts", False):
        return target.to(dtype).to(torch.float32)
    if dtype != torch.bfloat16:
        raise RuntimeError(
            f"compensation='kahan' on {dtype} parameters under torch.compile: Inductor drops the "
            "rounding the Kahan buffer measures. Set torch._inductor.config.emulate_precision_casts "
            "= True, or use fused=True / the default (mixprec's kernel, which the graph calls as is)"
        )
    bits = target.view(torch.int32)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).view(torch.float32)
    return torch.where(torch.isnan(target), target, rounded)
