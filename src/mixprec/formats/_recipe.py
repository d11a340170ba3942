"""Low-precision recipes: per GEMM operand, the format (fp8 or fp4) and the scale granularity."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Literal

import torch

__all__ = ["Cast", "Float8Recipe", "Recipe", "FORMATS", "RECIPE_NAMES", "UNIT_ROUNDOFF"]

Format = Literal["e4m3fn", "e5m2", "e2m1", "none"]
Granularity = Literal["tensor", "row", "1x16", "16x16", "1x32", "1x128", "128x128"]

#: format name -> torch dtype ("none": the GEMM runs in the high-precision dtype; "e2m1": fp4,
#: two codes per byte).
FORMATS: dict[str, torch.dtype | None] = {
    "e4m3fn": torch.float8_e4m3fn,
    "e5m2": torch.float8_e5m2,
    "e2m1": torch.float4_e2m1fn_x2,
    "none": None,
}
#: format name -> its unit roundoff (half the gap between 1 and the next value: ``2**-(mantissa bits + 1)``),
#: the relative error of rounding a value in its normal range
UNIT_ROUNDOFF: dict[str, float] = {"e4m3fn": 2.0 ** -4, "e5m2": 2.0 ** -3, "e2m1": 2.0 ** -2}
#: block granularities: (rows, cols) of the operand as the GEMM reads it (cols: contracted).
BLOCKS: dict[str, tuple[int, int]] = {"1x16": (1, 16), "16x16": (16, 16), "1x32": (1, 32), "1x128": (1, 128),
                                      "128x128": (128, 128)}
_GRANULARITIES = ("tensor", "row", *BLOCKS)
#: the blocks of fp4 casts ("1x32": MXFP4; "1x16", "16x16": NVFP4) and those only fp4 takes.
_FP4_BLOCKS, _NVFP4_BLOCKS = ("1x16", "16x16", "1x32"), ("1x16", "16x16")
RECIPE_NAMES = ("tensorwise", "rowwise", "rowwise_with_gw_hp", "mxfp8", "blockwise", "mxfp4", "nvfp4")
#: what ``torch._scaled_mm`` needs of every feature dimension
_MULTIPLE = 16


@dataclass(frozen=True)
class Cast:
    """How one operand enters one GEMM.

    ``format``: ``"e4m3fn"``, ``"e5m2"``, ``"e2m1"`` (fp4, blocks only) or ``"none"`` (high
    precision, no cast).
    ``granularity``: ``"tensor"`` (one scale) or ``"row"`` (one scale per row of the operand as
    the GEMM reads it, taken over the contracted dimension: torchao's "axiswise"), or a block of
    that operand, ``"ROWSxCOLS"`` with COLS along the contracted dimension: ``"1x32"`` (OCP MX:
    an E8M0 power-of-2 scale per 32 elements, rounded up as torchao's RCEIL), ``"1x128"`` and
    ``"128x128"`` (DeepSeek-V3's tiles and blocks, float32 scales). fp4 (``"e2m1"``) takes
    ``"1x32"`` (MXFP4: E8M0 scales) and NVFP4's ``"1x16"`` and ``"16x16"`` (e4m3 block scales under
    an fp32 tensor scale; ``"16x16"`` for weights, whose row and column casts then agree); see
    :mod:`mixprec.formats._fp4`.

    Example:
        >>> Cast("e5m2").dtype, Cast("e2m1", "1x16").unit_roundoff
        (torch.float8_e5m2, 0.25)
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
            raise ValueError(f"Cast: a {self.granularity!r} block needs an fp8 or fp4 format, got format='none'")
        if self.is_fp4 and self.granularity not in _FP4_BLOCKS:
            raise ValueError(f"Cast: fp4 ('e2m1') takes the blocks {', '.join(map(repr, _FP4_BLOCKS))}, "
                             f"got {self.granularity!r}")
        if self.granularity in _NVFP4_BLOCKS and not self.is_fp4:
            raise ValueError(f"Cast: the {self.granularity!r} block is NVFP4's: it needs format='e2m1', "
                             f"got {self.format!r}")

    @property
    def dtype(self) -> torch.dtype | None:
        """The low-precision dtype (``torch.float4_e2m1fn_x2`` for fp4), or None for high precision."""
        return FORMATS[self.format]

    @property
    def unit_roundoff(self) -> float | None:
        """The relative rounding error of the format's normal values (:data:`UNIT_ROUNDOFF`), or
        None for high precision (the GEMM's own dtype's)."""
        return UNIT_ROUNDOFF.get(self.format)

    @property
    def is_fp8(self) -> bool:
        """Whether the operand is cast at all (fp8 or fp4; ``format != "none"``)."""
        return self.format != "none"

    @property
    def is_fp4(self) -> bool:
        """Whether the operand is cast to fp4 (``"e2m1"``)."""
        return self.format == "e2m1"

    @property
    def block(self) -> tuple[int, int] | None:
        """``(rows, cols)`` of a block granularity (cols along the contracted dimension), else None."""
        return BLOCKS.get(self.granularity)

    @property
    def scale_format(self) -> str:
        """``"e8m0"`` for MX blocks (``"1x32"``), ``"e4m3"`` for NVFP4's (``"1x16"``, ``"16x16"``),
        else ``"float32"``."""
        if self.granularity == "1x32":
            return "e8m0"
        return "e4m3" if self.granularity in _NVFP4_BLOCKS else "float32"


_HP = Cast("none")


@dataclass(frozen=True)
class Float8Recipe:
    """Which operands of a linear layer's three GEMMs are cast to fp8 or fp4, and how
    (also named :data:`Recipe`).

    The GEMMs of ``y = x W^T``: ``output = x @ W^T``, ``grad_input = grad_output @ W`` and
    ``grad_weight = grad_output^T @ x``. Each field names an operand in one GEMM. Scales are
    current (dynamic): ``finfo(fp8).max / max(amax, 1e-12)`` from the tensor being cast, rounded
    down to a power of 2 when ``pow2_scales``; a block granularity (``mxfp8``, ``blockwise``)
    takes one scale per block (see :mod:`mixprec.formats._blocks`). ``save_fp8``: save the fp8
    input and weight (with their scales) for backward instead of the high-precision tensors;
    allowed only where the backward GEMMs use the very same casts (tensor granularity, same
    format), so the result is bitwise the same as re-casting.

    fp4 recipes (``mxfp4``, ``nvfp4``: an ``"e2m1"`` cast) run emulated, each GEMM on its own: its
    two operands are both e2m1 blocks, both fp8 blocks, both fp8 tensor/row casts or both high
    precision (so a recipe may be composed per GEMM from fp4 and fp8 ones). ``hadamard``: the
    grad_weight GEMM's e2m1 operands pass through a 16-point random Hadamard transform along
    its contracted dimension (the tokens) first; ``stochastic_rounding``: grad_output's e2m1
    casts round stochastically (seeded by ``seed`` and the layer's step count: the same on
    every rank); ``subnormal_scales``: NVFP4 block scales may be e4m3 subnormals (Transformer
    Engine's formula) instead of clamped at ``2**-6`` (torchao's, the default). These three
    touch only e2m1 casts. An fp4 recipe saves, for backward, the input as cast for the
    grad_weight GEMM (packed codes and scales: about 0.28x bf16's bytes), never in fp8 or high
    precision when that GEMM is fp4 (``save_fp8`` must be False).

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
    hadamard: bool = False
    stochastic_rounding: bool = False
    subnormal_scales: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self)[:6]:
            if not isinstance(getattr(self, field.name), Cast):
                raise ValueError(f"Float8Recipe.{field.name} must be a Cast, got {getattr(self, field.name)!r}")
        for field in ("hadamard", "stochastic_rounding", "subnormal_scales"):
            if not isinstance(getattr(self, field), bool):
                raise ValueError(f"Float8Recipe.{field} must be a bool, got {getattr(self, field)!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0:
            raise ValueError(f"Float8Recipe.seed must be an int >= 0, got {self.seed!r}")
        for gemm, (a, b) in self.gemms().items():
            if a.is_fp8 != b.is_fp8:
                raise ValueError(f"Float8Recipe: the {gemm} GEMM mixes an fp8 operand with a high-precision "
                                 f"one ({a.format} and {b.format}); make both fp8 or both 'none'")
        if self.fp4:
            self._check_fp4()
            return
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

    def _check_fp4(self) -> None:
        for gemm, (a, b) in self.gemms().items():
            if a.is_fp4 != b.is_fp4 or (a.block is None) != (b.block is None):
                raise ValueError(f"Float8Recipe: the {gemm} GEMM's operands are cast differently ({a.format} "
                                 f"{a.granularity!r} and {b.format} {b.granularity!r}); in an fp4 recipe both "
                                 f"operands of a GEMM are e2m1 blocks, fp8 blocks, fp8 tensor/row casts or 'none'")
            if a.block is not None and (a.block[1] != b.block[1] or a.scale_format != b.scale_format):
                raise ValueError(f"Float8Recipe: the {gemm} GEMM's blocks {a.granularity!r} and {b.granularity!r} "
                                 f"differ in length along the contracted dimension or in scale format; they must "
                                 f"agree")
            if a.block is not None and a.scale_format == "e8m0" and not a.is_fp4 and not self.pow2_scales:
                raise ValueError("Float8Recipe: MX blocks ('1x32') have E8M0 scales, powers of 2 by construction; "
                                 "pass pow2_scales=True")
        if self.save_fp8:
            raise ValueError("Float8Recipe: an fp4 recipe saves its own casts for backward; pass save_fp8=False")

    @property
    def fp4(self) -> bool:
        """Whether any operand is cast to fp4 (``"e2m1"``): the recipe runs the fp4 path."""
        return any(c.is_fp4 for pair in self.gemms().values() for c in pair)

    @property
    def blocked(self) -> bool:
        """Whether the recipe scales by blocks (``mxfp8``, ``blockwise``)."""
        return any(c.block for c, _ in self.gemms().values())

    @property
    def block_multiple(self) -> int:
        """What every feature dimension must be a multiple of for the recipe's blocks: every
        block side (1 without blocks)."""
        return math.lcm(1, *(side for pair in self.gemms().values() for c in pair if c.block for side in c.block))

    @property
    def multiple(self) -> int:
        """What every feature dimension of a layer must be a multiple of for this recipe: 16
        (``torch._scaled_mm``), and every block side."""
        return math.lcm(_MULTIPLE, self.block_multiple)

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
    def mxfp4(cls) -> Float8Recipe:
        """OCP MX v1.0 MXFP4: e2m1 elements in blocks of 32 along the contracted dimension of every
        GEMM, one E8M0 scale per block rounded up (RCEIL). The forward is bitwise torchao's
        ``MXFakeQuantizedLinear`` (``MXFakeQuantizeConfig()``); unlike that QAT layer (whose
        backward runs in high precision) both backward GEMMs run in MXFP4 too (replace their
        casts with ``Cast("none")`` for torchao's high-precision backward)."""
        mx = Cast("e2m1", "1x32")
        return cls(mx, mx, mx, mx, mx, mx, pow2_scales=True, save_fp8=False, name="mxfp4")

    @classmethod
    def nvfp4(cls, hadamard: bool = True, stochastic_rounding: bool = True,
              weight_block: tuple[int, int] = (16, 16)) -> Float8Recipe:
        """NVFP4 as Transformer Engine's recipe (and NVIDIA's NVFP4 pretraining report): e2m1
        elements in blocks of 16 along the contracted dimension with e4m3 block scales under an
        fp32 tensor scale (``amax / (448 * 6)``), all three GEMMs. Defaults, each switchable
        (TE's ``disable_rht``, ``disable_stochastic_rounding``, ``disable_2d_quantization``):
        ``weight_block=(16, 16)`` (2-D weight blocks: the weight's casts for the forward and the
        input-gradient GEMMs agree; ``(1, 16)`` casts it as the activations), ``hadamard``: a
        16-point random Hadamard transform on both operands of the weight-gradient GEMM,
        ``stochastic_rounding``: on grad_output's casts only. With ``hadamard=False,
        stochastic_rounding=False, weight_block=(1, 16)`` the forward is bitwise ``F.linear``
        over torchao's ``NVFP4Tensor.to_nvfp4(t, per_tensor_scale=...).dequantize(dtype)``.

        Example:
            >>> Float8Recipe.nvfp4().weight.granularity, Float8Recipe.nvfp4(weight_block=(1, 16)).weight.granularity
            ('16x16', '1x16')
        """
        if tuple(weight_block) not in ((16, 16), (1, 16)):
            raise ValueError(f"Float8Recipe.nvfp4: weight_block must be (16, 16) or (1, 16), got {weight_block!r}")
        row, w = Cast("e2m1", "1x16"), Cast("e2m1", "x".join(map(str, weight_block)))
        return cls(row, w, row, w, row, row, save_fp8=False, name="nvfp4", hadamard=hadamard,
                   stochastic_rounding=stochastic_rounding)

    @classmethod
    def from_name(cls, name: str) -> Float8Recipe:
        """``"tensorwise"``, ``"rowwise"``, ``"rowwise_with_gw_hp"`` (torchao's recipe names),
        ``"mxfp8"``, ``"blockwise"``, or fp4's ``"mxfp4"`` and ``"nvfp4"`` (their defaults)."""
        if name not in RECIPE_NAMES:
            raise ValueError(f"unknown fp8 recipe {name!r}; expected one of {', '.join(RECIPE_NAMES)}")
        return getattr(cls, name)()


#: the format-neutral name of :class:`Float8Recipe` (the recipes reach fp4 too).
Recipe = Float8Recipe
