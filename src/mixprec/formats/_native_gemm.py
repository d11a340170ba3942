"""Block-scaled GEMMs on the tensor cores built for them, and what a device lacks for them.

Every GEMM here is ``A @ B.t()`` with the contracted dimension last in both operands, cast by
:func:`mixprec.formats._blocks.quantize` (fp8 blocks: ``(q, deq)``) or
:func:`mixprec.formats._fp4.quantize` (:class:`~mixprec.formats._fp4.Fp4Tensor`), exactly as
the emulation casts them; only the multiplication moves to torch's scaled GEMM:

* **blockwise** (DeepSeek-V3: ``1x128`` tiles, ``128x128`` blocks, float32 scales):
  ``F.scaled_mm`` with ``BlockWise1x128`` / ``BlockWise128x128``, scales "outer-dim-major"
  (a tile's scales ``[rows, K/128]`` with stride ``[1, rows]``; a block's ``[round_up(K/128, 4),
  rows/128]`` with stride ``[1, round_up(K/128, 4)]``). torch runs it on sm90 only.
* **mxfp8** (``1x32``, E8M0): ``F.scaled_mm`` with ``BlockWise1x32``, scales in sm100's
  ``SWIZZLE_32_4_4`` layout (:mod:`mixprec.formats._swizzle`). sm100 and newer.
* **mxfp4** (``1x32``, E8M0, e2m1 packed two per byte as ``torch.float4_e2m1fn_x2``):
  ``torch._scaled_mm`` with swizzled scales, as torchao calls it (torch 2.13's ``F.scaled_mm``
  meta check counts an fp4 operand's K in packed bytes for 1x32 scales: it asks half the scales).
* **nvfp4** (``1x16``, e4m3 scales, the fp32 tensor scale): ``F.scaled_mm`` with
  ``[BlockWise1x16, TensorWise]`` (the two-level scaling: swizzled block scales and the tensor
  scale). A ``16x16`` weight block is 16 rows of ``1x16`` blocks sharing one scale: its scale
  is repeated over its rows, which dequantizes to the same values.

Padding: the contracted dimension is zero-padded to the kernels' multiple (128 for blockwise,
32 for MX and NVFP4: 16 bytes of packed fp4) with zero codes and zero-byte scales (their
products are zeros); the rows of A and B need no data padding (the swizzle pads the scales to
whole 128x4 tiles). So the result has the unpadded shape, and the emulation of the same call
(scales unswizzled, operands dequantized) is the emulation of the unpadded GEMM bit for bit.
The block-scaled kernels write bfloat16: the result is cast to the output dtype after.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F

from mixprec.formats._recipe import Cast, Float8Recipe
from mixprec.formats._swizzle import to_blocked

__all__ = ["gemm_kind", "missing", "block_mm", "fp4_mm", "NEEDS", "note_emulated"]

#: what each kind of GEMM needs of the device: (lowest capability, first capability past it or
#: None, in words)
NEEDS: dict[str, tuple[tuple[int, int], tuple[int, int] | None, str]] = {
    "tensorwise": ((8, 9), None, "compute capability 8.9 or newer (sm89)"),
    "rowwise": ((8, 9), None, "compute capability 8.9 or newer (sm89)"),
    "blockwise": ((9, 0), (10, 0), "compute capability 9.x (sm90: torch runs DeepSeek's 1x128/128x128 "
                                   "scaling on Hopper only)"),
    "mxfp8": ((10, 0), None, "compute capability 10.0 or newer (sm100)"),
    "mxfp4": ((10, 0), None, "compute capability 10.0 or newer (sm100)"),
    "nvfp4": ((10, 0), None, "compute capability 10.0 or newer (sm100)"),
}
#: blockwise pairs torch has kernels for: (A's block, B's block)
_BLOCKWISE_PAIRS = {((1, 128), (1, 128)), ((1, 128), (128, 128)), ((128, 128), (1, 128))}
#: what the contracted dimension is padded to, per kind
_K_MULTIPLE = {"blockwise": 128, "mxfp8": 32, "mxfp4": 32, "nvfp4": 32}
_SCALED_MM_MULTIPLE = 16

_log = logging.getLogger("mixprec")
#: (recipe, reason) pairs already said: a process-wide warn-once set, as every warning's
_SAID: set[tuple[str, str]] = set()


def gemm_kind(a: Cast, b: Cast) -> str | None:
    """The kind of native GEMM two operand casts make (a key of :data:`NEEDS`), or None: high
    precision, or blocks no torch kernel takes (e.g. ``128x128`` on both sides)."""
    if not a.is_fp8:
        return None
    if a.block is None:
        return "tensorwise" if a.granularity == b.granularity == "tensor" else "rowwise"
    if a.is_fp4:
        return "mxfp4" if a.scale_format == "e8m0" else "nvfp4"
    if a.scale_format == "e8m0":
        return "mxfp8"
    return "blockwise" if (a.block, b.block) in _BLOCKWISE_PAIRS else None


def missing(recipe: Float8Recipe, input: torch.Tensor, weight: torch.Tensor) -> str | None:
    """What the device, the torch build or the shapes lack for every fp8 GEMM of ``recipe`` to
    run on torch's scaled GEMM (in words, for an error or a note), or None when nothing is."""
    if not input.is_cuda:
        kinds = [gemm_kind(a, b) for a, b in recipe.gemms().values() if a.is_fp8]
        words = next((NEEDS[k][2] for k in kinds if k is not None), "a scaled GEMM")
        return f"a CUDA device of {words} (the input is on {input.device.type})"
    if torch.version.hip is not None:
        return "NVIDIA's scaled GEMMs (this torch build is for ROCm)"
    capability = torch.cuda.get_device_capability(input.device)
    for name, (a, b) in recipe.gemms().items():
        if not a.is_fp8:
            continue
        kind = gemm_kind(a, b)
        if kind is None:
            return f"a torch kernel for the {name} GEMM's blocks ({a.granularity}, {b.granularity})"
        low, past, words = NEEDS[kind]
        if capability < low or (past is not None and capability >= past):
            return f"{words} for {kind} GEMMs; this device has {capability[0]}.{capability[1]}"
        if kind in ("tensorwise", "rowwise") and recipe.fp4:
            return (f"a scaled GEMM for the {name} GEMM's tensor/row fp8 casts inside an fp4 recipe "
                    f"(mixprec's fp4 path emulates them)")
        if kind in ("mxfp8", "mxfp4", "nvfp4", "blockwise") and not hasattr(F, "scaled_mm"):
            return f"torch.nn.functional.scaled_mm (torch {torch.__version__} has none)"
        if kind in ("mxfp4", "nvfp4") and not hasattr(torch, "float4_e2m1fn_x2"):
            return f"torch.float4_e2m1fn_x2 (torch {torch.__version__} has none)"
    if not recipe.blocked:  # tensor/row fp8: torch._scaled_mm, unpadded (as torchao's default)
        tokens = input.numel() // max(input.shape[-1], 1)
        if any(d % _SCALED_MM_MULTIPLE for d in (tokens, *weight.shape)):
            return (f"every GEMM dimension a multiple of 16 (tokens, out, in = {tokens}, {weight.shape[0]}, "
                    f"{weight.shape[1]})")
    return None


def note_emulated(recipe: Float8Recipe, reason: str, on_gpu: bool) -> None:
    """Say once per recipe and reason, on the ``mixprec`` logger, that the layer runs emulated
    (a warning on a GPU, where it costs speed; information elsewhere). The reason's details in
    parentheses (a shape) do not make it another: varying token counts are said once."""
    key = (recipe.name, reason.split(" (", 1)[0])
    if key in _SAID:
        return
    _SAID.add(key)
    level = logging.WARNING if on_gpu else logging.INFO
    _log.log(level, "fp8: the %r recipe runs emulated (dequantized, then a high-precision GEMM): "
                    "torch's scaled GEMM needs %s", recipe.name, reason)


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _pad_cols(t: torch.Tensor, cols: int) -> torch.Tensor:
    """``t`` (2-D) zero-padded on the right to ``cols`` columns (zero bytes for 1-byte dtypes,
    which ``F.pad`` refuses)."""
    extra = cols - t.shape[1]
    if extra <= 0:
        return t
    if t.element_size() == 1 and t.dtype != torch.uint8:
        return F.pad(t.view(torch.uint8), (0, extra)).view(t.dtype)
    return F.pad(t, (0, extra))


def _e8m0(deq: torch.Tensor) -> torch.Tensor:
    """E8M0 scales (``torch.float8_e8m0fnu``) of the float32 powers of 2 ``deq`` (NaN: 255),
    exactly (``frexp`` reads subnormal powers of 2 too)."""
    exponent = torch.frexp(deq).exponent + 126
    return torch.where(torch.isnan(deq), 255, exponent).to(torch.uint8).view(torch.float8_e8m0fnu)


def _outer_major(s: torch.Tensor) -> torch.Tensor:
    """``s`` (2-D) with stride ``[1, rows]`` (column-major), the layout blockwise scales take; a
    dimension of size 1 too (``t().contiguous().t()`` would keep a row's stride there)."""
    return s.t().contiguous().as_strided(s.shape, (1, s.shape[0]))


def _blockwise_scale(deq: torch.Tensor, block: tuple[int, int], k_blocks: int) -> torch.Tensor:
    """A blockwise operand's scales as ``F.scaled_mm`` takes them: a tile's ``[rows, K/128]``
    outer-dim-major; a 128x128 block's ``[round_up(K/128, 4), rows/128]`` outer-dim-major."""
    if block == (1, 128):
        return _outer_major(_pad_cols(deq, k_blocks))
    return _outer_major(_pad_cols(deq, _round_up(k_blocks, 4)).t())


def _scaling(name: str) -> Any:
    return getattr(F.ScalingType, name)


def block_mm(a: tuple[torch.Tensor, torch.Tensor], ca: Cast, b: tuple[torch.Tensor, torch.Tensor], cb: Cast,
             out_dtype: torch.dtype) -> torch.Tensor:
    """``a @ b.t()`` of two fp8 block casts ``(q, deq)`` (contracted dimension last) on torch's
    scaled GEMM: blockwise (sm90) or MXFP8 (sm100). Precondition: ``gemm_kind(ca, cb)`` is
    ``"blockwise"`` or ``"mxfp8"`` and the device has it (:func:`missing`)."""
    kind = gemm_kind(ca, cb)
    k = a[0].shape[1]
    kp = _round_up(k, _K_MULTIPLE[kind])
    qa, qb = _pad_cols(a[0], kp), _pad_cols(b[0], kp)
    if kind == "mxfp8":
        sa, sb = (to_blocked(_pad_cols(_e8m0(s), kp // 32)) for s in (a[1], b[1]))
        swizzle = F.SwizzleType.SWIZZLE_32_4_4
        out = F.scaled_mm(qa, qb.t(), sa, _scaling("BlockWise1x32"), sb, _scaling("BlockWise1x32"),
                          swizzle_a=swizzle, swizzle_b=swizzle, output_dtype=torch.bfloat16)
    else:
        names = {(1, 128): "BlockWise1x128", (128, 128): "BlockWise128x128"}
        sa = _blockwise_scale(a[1], ca.block, kp // 128)
        sb = _blockwise_scale(b[1], cb.block, kp // 128)
        out = F.scaled_mm(qa, qb.t(), sa, _scaling(names[ca.block]), sb, _scaling(names[cb.block]),
                          output_dtype=torch.bfloat16)
    return out.to(out_dtype)


def _fp4_operand(t: Any, kp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An :class:`Fp4Tensor` as the scaled GEMM reads it: the packed codes
    (``float4_e2m1fn_x2``, ``kp / 2`` bytes a row) and the swizzled 1x``cols`` block scales
    (a ``16x16`` block's scale repeated over its 16 rows)."""
    rows, cols = t.cast.block
    codes = _pad_cols(t.codes.narrow(0, 0, t.shape[0]), kp // 2).view(torch.float4_e2m1fn_x2)
    scales = t.scales if t.scales.dtype != torch.uint8 else t.scales.view(torch.float8_e8m0fnu)
    if rows > 1:
        scales = scales.unsqueeze(1).expand(scales.shape[0], rows, scales.shape[1]).reshape(-1, scales.shape[1])
    scales = scales.narrow(0, 0, t.shape[0])
    return codes, to_blocked(_pad_cols(scales, kp // cols))


def fp4_mm(a: Any, ca: Cast, b: Any, cb: Cast, out_dtype: torch.dtype) -> torch.Tensor:
    """``a @ b.t()`` of two e2m1 casts (:class:`~mixprec.formats._fp4.Fp4Tensor`) on torch's
    scaled GEMM: MXFP4 through ``torch._scaled_mm``, NVFP4 through ``F.scaled_mm``'s two-level
    scaling. Precondition: the device has it (:func:`missing`)."""
    kp = _round_up(a.shape[1], _K_MULTIPLE["nvfp4"])
    (qa, sa), (qb, sb) = _fp4_operand(a, kp), _fp4_operand(b, kp)
    if gemm_kind(ca, cb) == "mxfp4":
        out = torch._scaled_mm(qa, qb.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
    else:
        swizzle = [F.SwizzleType.SWIZZLE_32_4_4, F.SwizzleType.NO_SWIZZLE]
        two_level = [_scaling("BlockWise1x16"), _scaling("TensorWise")]
        out = F.scaled_mm(qa, qb.t(), [sa, a.tensor_scale], two_level, [sb, b.tensor_scale], two_level,
                          swizzle_a=swizzle, swizzle_b=swizzle, output_dtype=torch.bfloat16)
    return out.to(out_dtype)
