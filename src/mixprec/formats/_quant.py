"""Casting to fp8 with current scaling, the emulated and the hardware GEMM, the cast statistics.

Numerics follow torchao 0.18 exactly (``float8_utils.amax_to_scale``, ``to_fp8_saturated``, the
emulated ``float8_mm``): the scale is ``finfo.max / max(amax, 1e-12)`` in float64, cast to
float32, optionally rounded down to a power of 2; the cast is ``clamp(x.float() * scale)`` to
the format's range, then ``.to(fp8)``; the emulated GEMM is ``mm(a.float() / sa, b.float() / sb)``.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from mixprec.formats._accumulate import tensor_core_mm
from mixprec.formats._blocks import EPS, amax_to_scale, fp8_values, quantize
from mixprec.formats._fp4 import _KERNEL_DTYPES, _PLAIN, _kernels
from mixprec.formats._recipe import Cast

__all__ = ["EPS", "cast_to_fp8", "cast_stats", "dequantize", "fold_cast_stats", "gemm", "STAT_NAMES"]

#: operands of more elements than this have their fractions measured on a strided sample.
SAMPLE = 1 << 14
#: columns of a layer's statistics, per operand.
STAT_NAMES = ("amax", "saturated", "underflow", "nonfinite")


def cast_to_fp8(x: torch.Tensor, cast: Cast, row_dim: int, pow2: bool, amax: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Cast ``x`` with a current scale: returns ``(q, scale, amax)``.

    ``amax``: a tensor-granularity cast's amax when it is not ``x``'s own (FSDP2's fp8
    all-gather casts a shard with the amax all-reduced over the shards).

    ``row_dim`` is the dimension reduced for a row scale (the GEMM's contracted one); the scale
    keeps it as size 1 so that ``q.float() / scale`` dequantizes by broadcasting. A block cast
    (``cast.block``) contracts the last dimension (``row_dim`` must be -1) and returns the
    per-block dequantization factors and amaxes of :func:`mixprec.formats._blocks.quantize` instead
    (``q`` keeps ``x``'s shape).
    """
    if cast.block is not None:
        return _cast_blocks(x, cast, row_dim, pow2)
    dtype = cast.dtype
    native = _native_cast(x, cast, row_dim, pow2, amax)
    if native is not None:
        return native
    if amax is None:
        amax = torch.max(torch.abs(x)) if cast.granularity == "tensor" else \
            torch.amax(torch.abs(x), dim=row_dim, keepdim=True)
    scale = amax_to_scale(amax, dtype, pow2)
    x_scaled = x.to(torch.float32) * scale
    fmax = torch.finfo(dtype).max
    q = x_scaled.clamp_(min=-fmax, max=fmax).to(dtype)  # in place: x_scaled is ours
    return q, scale, amax


#: the fp8 dtypes the C++ casts write
_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def _native_cast(x: torch.Tensor, cast: Cast, row_dim: int, pow2: bool, amax: torch.Tensor | None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """:func:`cast_to_fp8` by mixprec's C++ kernel (``csrc/fp8_kernel.cpp``, the same bits) where it
    serves: a plain CPU operand the fp4 casts' kernels would take (:func:`~mixprec.formats._fp4._kernels`:
    not traced, no gradient to record), scaled per tensor or per row over its last dimension
    (contiguous), or over the first of a 2-D transposed one (a weight as ``W.t()``), an amax given
    in its dtype, whose scales are finite (a NaN amax's are not); else None (torch's ops serve)."""
    if (torch.compiler.is_compiling() or cast.dtype not in _FP8_DTYPES or x.dtype not in _KERNEL_DTYPES
            or x.dim() == 0):  # (traced code first: it reads no layout)
        return None
    if amax is not None and (type(amax) not in _PLAIN or amax.device.type != "cpu" or amax.dtype != x.dtype):
        return None
    last = row_dim in (-1, x.dim() - 1)
    if last and x.is_contiguous():
        transposed = False
    elif x.dim() == 2 and (row_dim in (0, -2) or cast.granularity == "tensor") and x.t().is_contiguous():
        transposed = True
    else:
        return None
    ops = _kernels(x)
    if ops is None:
        return None
    rows = cast.granularity != "tensor"
    x2 = x.t() if transposed else x.reshape(-1, x.shape[-1])
    given = None if amax is None else amax.detach().reshape(-1)
    q, scale, found, done = ops.fp8_cast(x2.detach(), cast.dtype, rows, given, pow2)
    if not done:  # (a scale not finite: torch's ops)
        return None
    if transposed:  # (a row of scales, (1, N), with torch's contiguous strides)
        q, scale, found = q.t(), scale.reshape(scale.shape[::-1]), found.reshape(found.shape[::-1])
    else:
        q = q.reshape(x.shape)
        if rows:
            scale, found = scale.reshape(*x.shape[:-1], 1), found.reshape(*x.shape[:-1], 1)
    return q, scale, found if amax is None else amax


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``fp8_values(q) / scale`` (float32) for the 2-D fp8 ``q`` of :func:`cast_to_fp8` and its
    scale (one, one per row or one per column): mixprec's C++ kernel on CPU (the same bits, one
    pass), torch's ops elsewhere, traced, and with ``MIXPREC_NATIVE_KERNELS=0``."""
    if (not torch.compiler.is_compiling() and q.dim() == 2 and q.dtype in _FP8_DTYPES and type(scale) in _PLAIN
            and scale.dtype == torch.float32 and scale.device.type == "cpu"
            and (scale.numel() == 1 or (scale.dim() == 2 and scale.shape in ((q.shape[0], 1), (1, q.shape[1]))))):
        ops = _kernels(q)
        if ops is not None:
            return ops.fp8_dequantize(q, scale)
    return fp8_values(q) / scale


def _cast_blocks(x: torch.Tensor, cast: Cast, row_dim: int, pow2: bool
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if row_dim not in (-1, x.dim() - 1):
        raise ValueError(f"a {cast.granularity!r} block cast contracts the last dimension, got row_dim={row_dim} "
                         f"for shape {tuple(x.shape)}")
    q, deq, amax = quantize(x.reshape(-1, x.shape[-1]) if x.dim() else x.reshape(1, 1), cast, pow2)
    return q.reshape(x.shape), deq, amax


def cast_stats(x: torch.Tensor, q: torch.Tensor, amax: torch.Tensor, last_amax: torch.Tensor) -> torch.Tensor:
    """``[amax, saturated, underflow, nonfinite]`` of one cast, a float32 vector on x's device.

    saturated: fraction of the elements of x beyond ``last_amax`` (the amax of the previous
    cast of this operand, 0 for none): what a delayed scale (amax history, TE's default) would
    have clipped; a current scale clips nothing finite. underflow: fraction of the elements of
    x, nonzero, that the cast flushed to zero. nonfinite: number of inf/NaN elements. No sync.
    A cast whose amax is not finite (an overflow step a loss scaler skips) measures no saturation
    and no underflow (0): its scale flushed every finite element, which says nothing of the format;
    its nonfinite count (at least 1) is what ``max_nonfinite`` or the loss scaler judges.

    The amax is exact. Beyond :data:`SAMPLE` elements, the other three are measured on an evenly
    strided sample (odd stride) of about that many elements and the count is scaled up; a
    nonfinite value is still always seen (through the amax): the count is then at least 1.
    """
    n = x.numel()
    stride = max(1, n // SAMPLE) | 1
    xs, qs = x.reshape(-1)[::stride], q.reshape(-1)[::stride]
    m = max(xs.numel(), 1)
    absx = xs.abs()
    amax = amax.max().float()
    saturated = torch.count_nonzero(absx > last_amax) / m * (last_amax > 0)
    zeros_q = torch.count_nonzero((qs.view(torch.uint8) & 0x7F) == 0)
    flushed = (zeros_q - torch.count_nonzero(absx == 0)) / m
    measured = torch.isfinite(amax)  # a scale from a non-finite amax flushes everything: only count
    saturated, flushed = torch.where(measured, saturated, 0.0), torch.where(measured, flushed, 0.0)
    nonfinite = torch.maximum(torch.count_nonzero(~(absx < math.inf)) * stride, ~measured)
    return torch.stack([amax, saturated.float(), flushed.float(), nonfinite.float()])


def fold_cast_stats(row: torch.Tensor, x: torch.Tensor, q: torch.Tensor, amax: torch.Tensor) -> None:
    """Fold one cast of ``x`` (to ``q``, with ``amax``) into a window's ``row`` (``[amax, saturated,
    underflow, nonfinite, the previous cast's amax]``, float32), in place: each statistic the worst
    of the row's and :func:`cast_stats`'s (saturation judged against the row's previous amax; NaN
    where either is), the previous amax this cast's. On the CPU one pass of mixprec's C++ kernel
    (``csrc/stats_kernel.cpp``: the same bits but a NaN's payload), else torch's ops. No host sync.

    Example:
        >>> row = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0])
        >>> x = torch.tensor([0.0, 3.0])
        >>> fold_cast_stats(row, x, x.to(torch.float8_e4m3fn), x.abs().max())
        >>> row.tolist()
        [3.0, 0.5, 0.0, 0.0, 3.0]
    """
    x, amax = x.detach(), amax.detach()  # (statistics: no gradient)
    ops = _stats_kernels(row, x, q, amax)
    if ops is not None:
        ops.record_cast(row, x.contiguous(), q.contiguous(), amax.contiguous(), SAMPLE)
        torch.autograd.graph.increment_version(row)  # (an in-place write, as torch's copy_ counts it)
        return
    new = cast_stats(x, q, amax, row[-1])
    row.copy_(torch.cat([torch.maximum(row[:-1], new), new[:1]]))


def _stats_kernels(row: torch.Tensor, x: torch.Tensor, q: torch.Tensor, amax: torch.Tensor) -> Any | None:
    """``torch.ops.mixprec_native`` where its ``record_cast`` serves these operands (``x`` as the
    fp4 casts' kernels take an operand: :func:`~mixprec.formats._fp4._kernels`; the others plain CPU
    tensors of the dtypes and sizes it reads), else None: torch's ops serve. Traced code returns at
    once (reading the operands' layout inside a trace changed a compiled policy route's output:
    tests/fp8/test_tensor_parallel.py)."""
    if (torch.compiler.is_compiling() or any(type(t) not in _PLAIN or t.device.type != "cpu" for t in (row, q, amax))
            or row.dtype != torch.float32 or row.shape != (len(STAT_NAMES) + 1,) or not row.is_contiguous()
            or x.dtype not in _KERNEL_DTYPES or amax.dtype not in _KERNEL_DTYPES or q.element_size() != 1
            or q.numel() != x.numel() or amax.numel() == 0):
        return None
    return _kernels(x)


def gemm(a: torch.Tensor, sa: torch.Tensor | None, b: torch.Tensor, sb: torch.Tensor | None,
         out_dtype: torch.dtype, backend: str, fast_accum: bool) -> torch.Tensor:
    """``a @ b`` for 2-D operands, both fp8 (with their scales) or both high precision.
    ``backend``: ``"scaled_mm"`` (``torch._scaled_mm``), ``"emulate_tc"`` (float32 operands
    accumulated as an fp8 tensor core: :func:`~mixprec.formats._accumulate.tensor_core_mm`), else
    emulated in float32."""
    if sa is None or sb is None:
        return torch.mm(a, b)
    if backend == "emulate_tc":
        return tensor_core_mm(dequantize(a, sa), dequantize(b, sb)).to(out_dtype)
    if backend in ("emulate", "emulate_fp32"):  # both in float32
        return torch.mm(dequantize(a, sa), dequantize(b, sb)).to(out_dtype)
    return _scaled_mm(a, sa, b, sb, out_dtype, fast_accum)


def _scaled_mm(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor,
               out_dtype: torch.dtype, fast_accum: bool) -> torch.Tensor:
    # As torchao's addmm_float8_unwrapped: a row-major, b column-major, inverse scales, the rowwise
    # kernel only with fast accumulation, no fp32 output for rowwise.
    a = a.contiguous()
    b = b.t().contiguous().t()
    if sa.dim() < 2 and sb.dim() == 2:
        sa = sa.repeat(a.shape[0]).reshape(-1, 1)
    elif sa.dim() == 2 and sb.dim() < 2:
        sb = sb.repeat(b.shape[1]).reshape(1, -1)
    ia, ib = sa.reciprocal(), sb.reciprocal()
    rowwise = ia.shape == (a.shape[0], 1) and ib.shape == (1, b.shape[1])
    post = None
    if rowwise and not fast_accum:
        post = ia * ib
        ia = ib = ia.new_ones(())
    mm_dtype = torch.bfloat16 if rowwise and out_dtype in (torch.float16, torch.float32) else out_dtype
    out = torch._scaled_mm(a, b, scale_a=ia, scale_b=ib, out_dtype=mm_dtype, use_fast_accum=fast_accum)
    if post is not None:
        out.mul_(post)  # in place: stays in mm_dtype, as torchao's ``output *= post_inverse_scale``
    return out.to(out_dtype)
