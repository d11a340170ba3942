"""Float8 recipes: per GEMM operand, the fp8 format and the scale granularity."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

import torch

__all__ = ["Cast", "Float8Recipe", "FORMATS", "RECIPE_NAMES"]

Format = Literal["e4m3fn", "e5m2", "none"]
Granularity = Literal["tensor", "row"]

#: format name -> torch dtype ("none": the GEMM runs in the high-precision dtype).
FORMATS: dict[str, torch.dtype | None] = {
    "e4m3fn": torch.float8_e4m3fn,
    "e5m2": torch.float8_e5m2,
    "none": None,
}
_GRANULARITIES = ("tensor", "row")
RECIPE_NAMES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")


@dataclass(frozen=True)
class Cast:
    """How one operand enters one GEMM.

    ``format``: ``"e4m3fn"``, ``"e5m2"`` or ``"none"`` (high precision, no cast).
    ``granularity``: ``"tensor"`` (one scale) or ``"row"`` (one scale per row of the operand as
    the GEMM reads it, taken over the contracted dimension: torchao's "axiswise").

    Example:
        >>> Cast("e5m2").dtype
        torch.float8_e5m2
    """

    format: Format = "e4m3fn"
    granularity: Granularity = "tensor"

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"Cast.format must be one of {sorted(FORMATS)}, got {self.format!r}")
        if self.granularity not in _GRANULARITIES:
            hint = " (torchao's 'axiswise' is 'row' here)" if self.granularity in ("axis", "axiswise") else ""
            raise ValueError(f"Cast.granularity must be 'tensor' or 'row', got {self.granularity!r}{hint}")

    @property
    def dtype(self) -> torch.dtype | None:
        """The fp8 dtype, or None for high precision."""
        return FORMATS[self.format]

    @property
    def is_fp8(self) -> bool:
        return self.format != "none"


_HP = Cast("none")


@dataclass(frozen=True)
class Float8Recipe:
    """Which operands of a linear layer's three GEMMs are cast to fp8, and how.

    The GEMMs of ``y = x W^T``: ``output = x @ W^T``, ``grad_input = grad_output @ W`` and
    ``grad_weight = grad_output^T @ x``. Each field names an operand in one GEMM. Scales are
    current (dynamic): ``finfo(fp8).max / max(amax, 1e-12)`` from the tensor being cast, rounded
    down to a power of 2 when ``pow2_scales``. ``save_fp8``: save the fp8 input and weight (with
    their scales) for backward instead of the high-precision tensors; allowed only where the
    backward GEMMs use the very same casts (tensor granularity, same format), so the result is
    bitwise the same as re-casting.

    Raises ValueError when a GEMM mixes an fp8 operand with a high-precision one, or when
    ``save_fp8`` is asked where backward needs a different cast.

    Example:
        >>> r = Float8Recipe.from_name("rowwise")
        >>> r.grad_output.format, r.pow2_scales
        ('e4m3fn', True)
        >>> dataclasses.replace(Float8Recipe.tensorwise(), save_fp8=False).save_fp8
        False
    """

    input: Cast = Cast("e4m3fn")
    weight: Cast = Cast("e4m3fn")
    grad_output: Cast = Cast("e5m2")
    weight_for_grad_input: Cast = Cast("e4m3fn")
    input_for_grad_weight: Cast = Cast("e4m3fn")
    grad_output_for_grad_weight: Cast = Cast("e5m2")
    pow2_scales: bool = False
    save_fp8: bool = True
    name: str = "tensorwise"

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self)[:6]:
            if not isinstance(getattr(self, field.name), Cast):
                raise ValueError(f"Float8Recipe.{field.name} must be a Cast, got {getattr(self, field.name)!r}")
        for gemm, (a, b) in self.gemms().items():
            if a.is_fp8 != b.is_fp8:
                raise ValueError(f"Float8Recipe: the {gemm} GEMM mixes an fp8 operand with a high-precision "
                                 f"one ({a.format} and {b.format}); make both fp8 or both 'none'")
        if self.save_fp8 and not self.can_save_fp8:
            raise ValueError("Float8Recipe.save_fp8=True needs the backward GEMMs to reuse the forward casts "
                             "(input == input_for_grad_weight and weight == weight_for_grad_input, fp8 with "
                             "'tensor' granularity); pass save_fp8=False for this recipe")

    def gemms(self) -> dict[str, tuple[Cast, Cast]]:
        """The three GEMMs and their (left, right) operand casts."""
        return {
            "output": (self.input, self.weight),
            "grad_input": (self.grad_output, self.weight_for_grad_input),
            "grad_weight": (self.grad_output_for_grad_weight, self.input_for_grad_weight),
        }

    @property
    def can_save_fp8(self) -> bool:
        """Whether backward can reuse the forward's fp8 input and weight bit for bit."""
        return all(fwd == bwd and fwd.is_fp8 and fwd.granularity == "tensor"
                   for fwd, bwd in ((self.input, self.input_for_grad_weight),
                                    (self.weight, self.weight_for_grad_input)))

    @classmethod
    def tensorwise(cls) -> Float8Recipe:
        """One scale per tensor; x and W in e4m3fn, grad_output in e5m2 (torchao's default)."""
        return cls()

    @classmethod
    def rowwise(cls) -> Float8Recipe:
        """One scale per row, e4m3fn everywhere (grads too), power-of-2 scales."""
        row = Cast("e4m3fn", "row")
        return cls(row, row, row, row, row, row, pow2_scales=True, save_fp8=False, name="rowwise")

    @classmethod
    def rowwise_with_gw_hp(cls) -> Float8Recipe:
        """Rowwise for output and grad_input (W tensorwise there), grad_weight in high precision."""
        row = Cast("e4m3fn", "row")
        return cls(row, row, row, Cast("e4m3fn", "tensor"), _HP, _HP,
                   pow2_scales=True, save_fp8=False, name="rowwise_with_gw_hp")

    @classmethod
    def from_name(cls, name: str) -> Float8Recipe:
        """``"tensorwise"``, ``"rowwise"`` or ``"rowwise_with_gw_hp"`` (torchao's recipe names)."""
        if name not in RECIPE_NAMES:
            raise ValueError(f"unknown fp8 recipe {name!r}; expected one of {', '.join(RECIPE_NAMES)}")
        return getattr(cls, name)()
