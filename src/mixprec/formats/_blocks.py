"""Block-scaled fp8 casts and their emulated GEMM.

Two kinds of block (see :class:`~mixprec.fp8.Cast`):

* ``"1x32"``: OCP MX v1.0 (MXFP8): 32 consecutive elements along the contracted dimension share
  one E8M0 scale (a power of 2), rounded up as torchao's RCEIL (``2**ceil(log2(amax / fmax))``,
  NVIDIA's ``cvt.rp`` rounding). Numerics follow torchao 0.18's ``mx_formats.mx_tensor.to_mx``
  and its emulated GEMM line by line: the operands are dequantized in their own dtype
  (``q.to(dtype) * 2**e``) and multiplied in that dtype.
* ``"1x128"`` / ``"128x128"``: DeepSeek-V3 (section 3.3): one float32 scale per 1x128 tile or
  128x128 block, ``finfo.max / max(amax, 1e-12)`` in float64 as torchao's blockwise helpers
  (``torch_blockwise_scale_act_quant_lhs``, ``torch_blockwise_scale_weight_quant``); the
  emulated GEMM dequantizes with the reciprocal scales in float32 (what the hardware GEMM
  multiplies by) and multiplies in float32.

A block that runs past the end of a dimension holds the remaining elements (zero padding does
not change a block's amax); the layer selection keeps layers whose features are not multiples
of the block in the compute dtype, so only the token dimension can end in a partial block.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mixprec.formats._accumulate import tensor_core_mm
from mixprec.formats._recipe import Cast

__all__ = ["quantize", "dequantize", "fp8_values", "per_block", "gemm_dtype", "block_gemm", "amax_to_scale", "E8M0_BIAS", "EPS"]

E8M0_BIAS = 127
#: the smallest amax a float32 scale is computed from (torchao's ``EPS``).
EPS = 1e-12
#: e4m3 tensors of at least this many elements convert on CPU through float16's bits (:func:`fp8_values`)
_BITS_CONVERSION = 1 << 14


def fp8_values(q: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q.to(dtype)`` for an fp8 ``q``, bitwise. PyTorch converts e4m3 to float32 on CPU one
    element at a time (about 3 ns each, 5x its e5m2 conversion): a large e4m3 tensor on CPU is
    converted instead through float16's bits (its 7 low bits become float16's exponent and
    mantissa, exact for normal and subnormal codes alike, times 2**8; the NaN codes set
    float16's exponent), vectorized, 3x faster. Other devices, dtypes and sizes: ``q.to(dtype)``.

    Example:
        >>> codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).repeat(64)
        >>> torch.equal(fp8_values(codes).nan_to_num(7.0), codes.float().nan_to_num(7.0))
        True
    """
    if q.dtype != torch.float8_e4m3fn or q.device.type != "cpu" or q.numel() < _BITS_CONVERSION \
            or dtype not in (torch.float32, torch.bfloat16):
        return q.to(dtype)
    b = q.view(torch.uint8).to(torch.int16)
    low = b & 0x7F
    # float16 bits: sign, then e4m3's exponent and mantissa shifted into float16's; 0x7F (NaN): exponent all ones
    bits = (low << 7) | ((low + 1) >> 7) * 0x7E00 | ((b & 0x80) << 8)
    out = bits.view(torch.float16).float().mul_(256.0)
    return out if dtype == torch.float32 else out.to(dtype)


def amax_to_scale(amax: torch.Tensor, dtype: torch.dtype, pow2: bool) -> torch.Tensor:
    """torchao's ``amax_to_scale``: ``finfo(dtype).max / max(amax, EPS)`` in float64, cast to
    float32, rounded down to a power of 2 with ``pow2``. (Here, below :mod:`._quant`, because
    both the tensor and the float32 block casts use it.)"""
    amax = amax.to(torch.float64)
    scale = (torch.finfo(dtype).max / torch.clamp(amax, min=EPS)).to(torch.float32)
    if pow2:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    return scale


def _blocked(x2: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """``x2`` (2-D) as ``[R/rows, rows, C/cols, cols]``, zero-padded to whole blocks."""
    pr, pc = -x2.shape[0] % rows, -x2.shape[1] % cols
    if pr or pc:
        x2 = F.pad(x2, (0, pc, 0, pr))
    return x2.reshape(x2.shape[0] // rows, rows, x2.shape[1] // cols, cols)


def _unblocked(xb: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    out = xb.reshape(xb.shape[0] * xb.shape[1], xb.shape[2] * xb.shape[3])
    return out if out.shape == shape else out.narrow(0, 0, shape[0]).narrow(1, 0, shape[1]).contiguous()


def per_block(s: torch.Tensor) -> torch.Tensor:
    """Per-block values ``s`` (``[R/rows, C/cols]``) broadcast over :func:`_blocked`'s layout:
    ``s[:, None, :, None]``, through ``unsqueeze`` (no indexing: the block casts use aten ops
    only, which a fake CUDA tensor on a CPU-only build takes; indexing's binding is refused)."""
    return s.unsqueeze(1).unsqueeze(3)


def _e8m0(amax: torch.Tensor, fmax: float) -> tuple[torch.Tensor, torch.Tensor]:
    """torchao's ``_to_mx_rceil`` (eager path): the biased E8M0 exponent (uint8) and the float32
    multiplier of the cast (``2**(127 - e)``; 1 for ``e == 0``, the descale for NaN)."""
    descale = amax.to(torch.float32) / fmax
    exponent = torch.where(
        torch.isnan(descale), 255,
        torch.where(torch.isinf(descale), 254,
                    (torch.clamp(torch.ceil(torch.log2(descale)), min=-E8M0_BIAS, max=E8M0_BIAS)
                     + E8M0_BIAS).to(torch.uint8)))
    rcp = torch.where(exponent == 255, descale,
                      torch.where(exponent == 254, 2.0 ** -127,
                                  torch.where(exponent == 0, 1.0,
                                              torch.exp2(E8M0_BIAS - exponent.to(torch.float32)))))
    return exponent, rcp


def _e8m0_value(exponent: torch.Tensor) -> torch.Tensor:
    """``2**(e - 127)`` in float32, NaN for ``e == 255`` (torchao's ``get_fp_scale``)."""
    offset = exponent.to(torch.int16) - E8M0_BIAS
    s = torch.pow(torch.full_like(offset, 2.0, dtype=torch.float32), offset)
    return torch.where(exponent != 255, s, float("nan"))


def quantize(x2: torch.Tensor, cast: Cast, pow2: bool
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Cast the 2-D ``x2`` (contracted dimension last) by blocks: ``(q, deq, amax)``.

    ``q`` has ``x2``'s shape; ``deq`` (float32, one per block, ``[ceil(R/rows), ceil(C/cols)]``)
    is what a block's values are multiplied by to dequantize; ``amax`` is each block's max
    ``|x|``. ``pow2`` rounds float32 scales down to a power of 2 (E8M0 scales are powers of 2
    by construction). Precondition: ``cast.block`` is set.

    Example:
        >>> x = torch.ones(2, 64); x[0, 0] = 1e6
        >>> q, deq, amax = quantize(x, Cast("e4m3fn", "1x32"), True)
        >>> deq.shape, float(q[0, 1].float() * deq[0, 0]), float(q[1, 0].float() * deq[1, 0])
        (torch.Size([2, 2]), 0.0, 1.0)
    """
    rows, cols = cast.block
    dtype = cast.dtype
    fmax = torch.finfo(dtype).max
    xb = _blocked(x2, rows, cols)
    amax = torch.amax(torch.abs(xb), dim=(1, 3))
    if cast.scale_format == "e8m0":
        exponent, mul = _e8m0(amax, fmax)
        deq = _e8m0_value(exponent)
    else:
        mul = amax_to_scale(amax, dtype, pow2)
        deq = 1.0 / mul
    xs = xb.to(torch.float32) * per_block(mul)
    q = xs.clamp_(min=-fmax, max=fmax).to(dtype)  # in place: xs is ours
    return _unblocked(q, x2.shape), deq, amax


def dequantize(q: torch.Tensor, deq: torch.Tensor, cast: Cast, dtype: torch.dtype) -> torch.Tensor:
    """``q`` (2-D, as :func:`quantize` returned it) times its blocks' ``deq``, in ``dtype``."""
    rows, cols = cast.block
    qb = _blocked(fp8_values(q, dtype), rows, cols)
    return _unblocked(qb * per_block(deq.to(dtype)), q.shape)


def gemm_dtype(cast: Cast, dtype: torch.dtype, fp32: bool = False) -> torch.dtype:
    """The dtype the emulated GEMM dequantizes and multiplies in: the input's for E8M0 blocks
    (torchao's MX emulation; float32 for float16, which torchao's MX does not take), float32
    for float32-scaled blocks, and float32 for all with ``fp32`` (backend ``"emulate_fp32"``)."""
    return dtype if cast.scale_format == "e8m0" and dtype != torch.float16 and not fp32 else torch.float32


def block_gemm(a: tuple[torch.Tensor, torch.Tensor], ca: Cast, b: tuple[torch.Tensor, torch.Tensor],
               cb: Cast, out_dtype: torch.dtype, fp32: bool = False, tensor_core: bool = False) -> torch.Tensor:
    """``a @ b.t()`` for two block casts ``(q, deq)`` whose contracted dimension is the last one,
    emulated: both dequantized in :func:`gemm_dtype` (float32 with ``fp32`` or ``tensor_core``),
    multiplied there (``tensor_core``: accumulated as an fp8 tensor core,
    :func:`~mixprec.formats._accumulate.tensor_core_mm`), cast to ``out_dtype``.
    (``b`` transposed as a view, as torchao's emulated MX ``mm`` reads its right operand.)

    Example:
        >>> c = Cast("e4m3fn", "1x128")
        >>> a, b = torch.randn(4, 128), torch.randn(8, 128)
        >>> block_gemm(quantize(a, c, False)[:2], c, quantize(b, c, False)[:2], c, torch.bfloat16).shape
        torch.Size([4, 8])
    """
    dtype = gemm_dtype(ca, out_dtype, fp32 or tensor_core)
    mm = tensor_core_mm if tensor_core else torch.mm
    return mm(dequantize(a[0], a[1], ca, dtype), dequantize(b[0], b[1], cb, dtype).t()).to(out_dtype)
