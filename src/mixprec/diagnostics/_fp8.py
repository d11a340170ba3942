"""The fp8 side of the diagnostics: the "after scaling" view of :func:`collect_ranges`.

An fp8 recipe with current scaling multiplies each tensor (or row) by ``finfo(fp8).max / amax``
before the cast, so judging raw values against the fp8 range (the unscaled view) says nothing
about fp8 training. The counts here use :func:`mixprec.fp8`'s own cast, so they are what
``mixprec.fp8.LayerState`` records for the same tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mixprec.fp8 import Cast, as_recipe
from mixprec.fp8.internals import cast_to_fp8

__all__ = ["FP8_FORMATS", "Fp8Scaled", "fp8_casts", "fp8_counts"]

#: The fp8 formats of the "after scaling" view.
FP8_FORMATS = ("float8_e4m3fn", "float8_e5m2")
# fp8 byte: exponent bits (all zero on zero and subnormals); sign bit excluded from the zero test
_EXPONENT_BITS = {"float8_e4m3fn": 0x78, "float8_e5m2": 0x7C}


@dataclass(frozen=True)
class Fp8Scaled:
    """The fp8 "after scaling" view: what an fp8 cast with current scaling does to the values.

    Each tensor (``granularity="tensor"``) or each row over its last dimension (``"row"``) is
    multiplied by the scale an fp8 recipe computes from it, ``finfo(fp8).max / amax`` (rounded
    down to a power of 2 when ``pow2_scales``), then cast, exactly as :func:`mixprec.fp8.linear`
    does (the same code). Nothing saturates by construction: the amax maps to the format's max.
    The amax is taken over the finite values (inf/NaN are counted in ``RangeStats.nonfinite``;
    a real cast with a non-finite amax would flush every value).

    Attributes:
        recipe: the :class:`mixprec.fp8.Float8Recipe` name whose cast of this operand is used.
        granularity, pow2_scales: that cast's scale.
        count: values judged (a module's "weight" view judges only its matrices, the GEMM
            operands, not biases or norm weights).
        underflow: per fp8 format name, the fraction of ``count`` values, non-zero, that the
            scaled cast flushes to zero (what ``mixprec.fp8.LayerState`` records as underflow).
        subnormal: per fp8 format name, the fraction that lands on a subnormal.
    """

    recipe: str
    granularity: str
    pow2_scales: bool
    count: int
    underflow: dict[str, float]
    subnormal: dict[str, float]

    @property
    def view(self) -> str:
        """One line naming the view, e.g. ``"after a per-tensor scale finfo.max/amax (tensorwise)"``."""
        pow2 = ", rounded down to a power of 2" if self.pow2_scales else ""
        return f"after a per-{self.granularity} scale finfo.max/amax{pow2} ({self.recipe})"


def fp8_counts(a: torch.Tensor, cast: Any, pow2: bool) -> torch.Tensor:
    """``[flushed, subnormal]`` per fp8 format of the non-negative float32 values ``a``, each
    tensor or row (``cast.granularity``) scaled as :func:`mixprec.fp8.linear` scales it."""
    a = a.reshape(-1) if cast.granularity == "tensor" or a.dim() == 0 else a
    zeros = torch.count_nonzero(a == 0)
    out = []
    for name in FP8_FORMATS:
        q, _, _ = cast_to_fp8(a, Cast(name.removeprefix("float8_"), cast.granularity), -1, pow2)
        bits = q.view(torch.uint8)
        zero_q = torch.count_nonzero((bits & 0x7F) == 0)  # sign bit aside
        below_normal = torch.count_nonzero((bits & _EXPONENT_BITS[name]) == 0)  # zero or subnormal
        out += [zero_q - zeros, below_normal - zero_q]
    return torch.stack(out)


def fp8_casts(recipe: Any) -> dict[str, tuple[str, Any, bool]]:
    """Per kind, ``(recipe name, Cast, pow2_scales)`` of the fp8 operand it stands for: a module's
    output is the next layer's ``input``, its gradient that layer's ``grad_output``."""
    if recipe is None:
        return {}
    r = as_recipe(recipe)
    if r.fp4:
        raise ValueError(f"collect_ranges: fp8_recipe={r.name!r} is an fp4 recipe; the after-scaling view counts "
                         f"fp8 casts only (e4m3fn, e5m2). Pass an fp8 recipe (e.g. 'tensorwise'), or measure fp4 "
                         f"layers with mixprec.audit(..., fp8='auto-fp4') or a Controller with fp4 rungs")
    operands = {"activation": r.input, "grad": r.grad_output, "weight": r.weight}
    return {kind: (r.name, cast, r.pow2_scales) for kind, cast in operands.items() if cast.is_fp8}
