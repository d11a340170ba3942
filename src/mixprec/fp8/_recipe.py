"""Float8 recipes: per GEMM operand, the fp8 format and the scale granularity."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Literal

import torch

__all__ = ["Cast", "Float8Recipe", "FORMATS", "RECIPE_NAMES"]

Format = Literal["e4m3fn", "e5m2", "none"]
Granularity = Literal["tensor", "row", "1x32", "1x128", "128x128"]

#: format name -> torch dtype ("none": the GEMM runs in the high-precision dtype).
FORMATS: dict[str, torch.dtype | None] = {
    "e4m3fn": torch.float8_e4m3fn,
    "e5m2": torch.float8_e5m2,
    "none": None,
}
#: block granularities: (rows, cols) of the operand as the GEMM reads it (cols: contracted).
BLOCKS: dict[str, tuple[int, int]] = {"1x32": (1, 32), "1x128": (1, 128), "128x128": (128, 128)}
_GRANULARITIES = ("tensor", "row", *BLOCKS)
RECIPE_NAMES = ("tensorwise", "rowwise", "rowwise_with_gw_hp", "mxfp8", "blockwise")
#: what ``torch._scaled_mm`` needs of every feature dimension
_MULTIPLE = 16


@dataclass(frozen=True)
class Cast:
    """How one operand enters one GEMM.

    ``format``: ``"e4m3fn"``, ``"e5m2"`` or ``"none"`` (high precision, no cast).
    ``granularity``: ``"tensor"`` (one scale) or ``"row"`` (one scale per row of the operand as
    the GEMM reads it, taken over the contracted dimension: torchao's "axiswise"), or a block of
    that operand, ``"ROWSxCOLS"`` with COLS along the contracted dimension: ``"1x32"`` (OCP MX:
    an E8M0 power-of-2 scale per 32 elements, rounded up as torchao's RCEIL), ``"1x128"`` and
    ``"128x128"`` (DeepSeek-V3's tiles and blocks, float32 scales).

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
            raise ValueError(f"Cast.granularity must be one of {', '.join(map(repr, _GRANULARITIES))}, "
                             f"got {self.granularity!r}{hint}")
        if self.block is not None and not self.is_fp8:
            raise ValueError(f"Cast: a {self.granularity!r} block needs an fp8 format, got format='none'")

    @property
    def dtype(self) -> torch.dtype | None:
        """The fp8 dtype, or None for high precision."""
        return FORMATS[self.format]

    @property
    def is_fp8(self) -> bool:
        return self.format != "none"

    @property
    def block(self) -> tuple[int, int] | None:
        """``(rows, cols)`` of a block granularity (cols along the contracted dimension), else None."""
        return BLOCKS.get(self.granularity)

    @property
    def scale_format(self) -> str:
        """``"e8m0"`` for MX blocks (``"1x32"``), else ``"float32"``."""
        return "e8m0" if self.granularity == "1x32" else "float32"


_HP = Cast("none")


@dataclass(frozen=True)
class Float8Recipe:
    """Which operands of a linear layer's three GEMMs are cast to fp8, and how.

    The GEMMs of ``y = x W^T``: ``output = x @ W^T``, ``grad_input = grad_output @ W`` and
    ``grad_weight = grad_output^T @ x``. Each field names an operand in one GEMM. Scales are
    current (dynamic): ``finfo(fp8).max / max(amax, 1e-12)`` from the tensor being cast, rounded
    down to a power of 2 when ``pow2_scales``; a block granularity (``mxfp8``, ``blockwise``)
    takes one scale per block (see :mod:`mixprec.fp8._blocks`). ``save_fp8``: save the fp8
    input and weight (with their scales) for backward instead of the high-precision tensors;
    allowed only where the backward GEMMs use the very same casts (tensor granularity, same
    format), so the result is bitwise the same as re-casting.

    Raises ValueError when a GEMM mixes an fp8 operand with a high-precision one, when
    ``save_fp8`` is asked where backward needs a different cast, or for blocks mixed with
    tensor/row casts, unequal block lengths along a GEMM's contracted dimension, MX blocks
    mixed with float32-scaled ones, MX blocks without ``pow2_scales``.

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
        self._check_blocks()
        if self.save_fp8 and not self.can_save_fp8:
            raise ValueError("Float8Recipe.save_fp8=True needs the backward GEMMs to reuse the forward casts "
                             "(input == input_for_grad_weight and weight == weight_for_grad_input, fp8 with "
                             "'tensor' granularity); pass save_fp8=False for this recipe")

    def _check_blocks(self) -> None:
        casts = [getattr(self, f.name) for f in dataclasses.fields(self)[:6]]
        if not any(c.block for c in casts):
            return
        if not all(c.block for c in casts if c.is_fp8):
            raise ValueError("Float8Recipe: block granularities ('1x32', '1x128', '128x128') cannot be mixed with "
                             "'tensor' or 'row' ones in one recipe; give every fp8 operand a block")
        for gemm, (a, b) in self.gemms().items():
            if a.is_fp8 and a.block[1] != b.block[1]:
                raise ValueError(f"Float8Recipe: the {gemm} GEMM's operands have blocks of {a.block[1]} and "
                                 f"{b.block[1]} along the contracted dimension ({a.granularity}, {b.granularity}); "
                                 f"they must be equal")
        e8m0 = {c.scale_format == "e8m0" for c in casts if c.is_fp8}
        if len(e8m0) > 1:
            raise ValueError("Float8Recipe: MX blocks ('1x32', E8M0 scales) cannot be mixed with float32-scaled "
                             "blocks ('1x128', '128x128') in one recipe")
        if e8m0 == {True} and not self.pow2_scales:
            raise ValueError("Float8Recipe: MX blocks ('1x32') have E8M0 scales, powers of 2 by construction; "
                             "pass pow2_scales=True")

    @property
    def blocked(self) -> bool:
        """Whether the recipe scales by blocks (``mxfp8``, ``blockwise``)."""
        return any(c.block for c, _ in self.gemms().values())

    @property
    def multiple(self) -> int:
        """What every feature dimension of a layer must be a multiple of for this recipe: 16
        (``torch._scaled_mm``), and every block side."""
        sides = [side for pair in self.gemms().values() for c in pair if c.block for side in c.block]
        return math.lcm(_MULTIPLE, *sides)

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
    def mxfp8(cls) -> Float8Recipe:
        """OCP MX v1.0 MXFP8: e4m3fn elements in blocks of 32 along the contracted dimension of
        every GEMM (forward and both backward GEMMs, as torchao's emulated MXFP8 training), one
        E8M0 scale per block rounded up (RCEIL, torchao's default)."""
        mx = Cast("e4m3fn", "1x32")
        return cls(mx, mx, mx, mx, mx, mx, pow2_scales=True, save_fp8=False, name="mxfp8")

    @classmethod
    def blockwise(cls) -> Float8Recipe:
        """DeepSeek-V3 (section 3.3): e4m3fn everywhere, float32 scales per 1x128 tile of the
        activations and grad_output (along the contracted dimension of each GEMM: per token in
        forward, per channel over 128 tokens for grad_weight) and per 128x128 block of the weight."""
        tile, block = Cast("e4m3fn", "1x128"), Cast("e4m3fn", "128x128")
        return cls(tile, block, tile, block, tile, tile, save_fp8=False, name="blockwise")

    @classmethod
    def from_name(cls, name: str) -> Float8Recipe:
        """``"tensorwise"``, ``"rowwise"``, ``"rowwise_with_gw_hp"`` (torchao's recipe names),
        ``"mxfp8"`` or ``"blockwise"``."""
        if name not in RECIPE_NAMES:
            raise ValueError(f"unknown fp8 recipe {name!r}; expected one of {', '.join(RECIPE_NAMES)}")
        return getattr(cls, name)()
