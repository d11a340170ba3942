"""The Controller's measurements of a cast on a sample of an operand (:func:`measure`), and of a
layer's range under fp16 (:func:`record_range`): device tensors in, device windows updated in
place, no host sync. Pure of any record: the probe (:mod:`mixprec.control._ladder`) says what
to measure and where to keep it."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from mixprec.formats._blocks import amax_to_scale
from mixprec.formats._fp4 import quantize
from mixprec.formats._hadamard import hadamard, hadamard_of
from mixprec.formats._quant import cast_to_fp8
from mixprec.formats._state import record_cast

__all__ = ["abs_max", "measure", "record", "record_range", "sampled_cast"]


def record_range(buf: torch.Tensor, x: torch.Tensor, out: torch.Tensor) -> None:
    """``buf`` (the range row) = max(``buf``, [amax of x, amax of out]). No host sync."""
    amax = torch.stack([x.detach().abs().amax().float(), out.detach().abs().amax().float()])
    torch.maximum(buf, amax, out=buf)


def measure(window: torch.Tensor, operand: int, x: torch.Tensor, cast: Any, pow2: bool, sample: int,
            hadamard_seed: int | None = None, gate: torch.Tensor | None = None,
            amax: torch.Tensor | None = None) -> None:
    """Accumulate into row ``operand`` of ``window`` (a window: :func:`~mixprec.formats._state.record_cast`) the statistics ``cast`` would
    have on ``x``, measured on about ``sample`` elements (:func:`sampled_cast`). ``gate`` (a
    0-d bool device tensor): the window keeps the measurement only where it is set (compiled
    code: no branch, no guard). ``amax``: ``x``'s largest magnitude when the caller has it (one
    pass over ``x``, the only part of a measurement that grows with ``x``, shared by the GEMMs
    that read it). No host sync."""
    cast_sample = sampled_cast(x, cast, pow2, sample, hadamard_seed, amax)
    if cast_sample is not None:
        record(window, operand, cast_sample, gate)


def sampled_cast(x: torch.Tensor, cast: Any, pow2: bool, sample: int, hadamard_seed: int | None = None,
                 amax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``(rows, q, amax)``: ``cast`` applied to about ``sample`` elements of ``x`` (None: ``x``
    is empty), what :func:`record` folds into a window. The sample is evenly strided whole rows
    (a row or block cast along the last dimension is exact on them), or for a 2-D block cast
    (NVFP4's 16x16 weight blocks, 128x128) evenly strided whole bands of block rows (every row
    when the rows do not fill whole bands); cast with the whole tensor's amax for a tensor cast
    and NVFP4's tensor scale (after a Hadamard transform, with the transformed sample's:
    transforming the whole tensor is the cost the sample saves). An e2m1 cast is fp4's own
    (:func:`~mixprec.formats._fp4.quantize`), rounded to nearest (a stochastically rounded cast
    flushes a value below the smallest step only sometimes: this counts it flushed), after the
    random Hadamard transform of ``hadamard_seed`` along the last dimension when given (NVFP4's
    weight-gradient operands: the GEMM casts the transformed rows, whose outliers are spread
    over their block). The statistics of a cast do not depend on the order of the elements, so
    a 2-D square block cast of ``x.t()`` measures as one of ``x``. No host sync."""
    x2 = x.detach().reshape(-1, x.shape[-1]) if x.dim() else x.detach().reshape(1, 1)
    if x2.numel() == 0:
        return None
    band = cast.block[0] if cast.block is not None else 1  # rows a block spans
    cols = max(x2.shape[1], 1)
    bands = 0 if x2.shape[0] % band else x2.shape[0] // band  # (a partial band, zero-padded: every row)
    stride = max(1, bands // -(-sample // (band * cols)))  # in bands
    if stride == 1:
        rows = x2
    elif band == 1:
        rows = x2[::stride]
    else:
        rows = x2.reshape(bands, band, cols)[::stride].reshape(-1, cols)
    amax = abs_max(x2) if amax is None else amax
    if cast.is_fp4:
        if hadamard_seed is not None:  # the tensor scale of the sampled rows' transform (the whole one's costs a pass)
            rows = hadamard(rows, hadamard_of(hadamard_seed, rows))
            q = quantize(rows.contiguous(), cast).magnitudes()
        elif stride > 1:  # + a band holding the tensor's amax: NVFP4's tensor scale is the whole tensor's
            extra = F.pad(amax.reshape(1, 1), (0, x2.shape[1] - 1, 0, band - 1))
            q = quantize(torch.cat([rows, extra]), cast).magnitudes()[:rows.shape[0]]
        else:
            q = quantize(rows.contiguous(), cast).magnitudes()
    elif cast.granularity == "tensor":
        fmax = torch.finfo(cast.dtype).max
        q = (rows.to(torch.float32) * amax_to_scale(amax, cast.dtype, pow2)).clamp_(min=-fmax, max=fmax).to(cast.dtype)
    else:
        q, _, _ = cast_to_fp8(rows, cast, -1, pow2)
    return rows, q, amax


def record(window: torch.Tensor, operand: int, cast_sample: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
           gate: torch.Tensor | None = None) -> None:
    """Fold a :func:`sampled_cast` into row ``operand`` of ``window`` (kept where ``gate`` is set). No host sync."""
    rows, q, amax = cast_sample
    if gate is None:
        record_cast(window, operand, rows, q, amax)
        return
    kept = window.clone()
    record_cast(kept, operand, rows, q, amax)
    window.copy_(torch.where(gate, kept, window))


def abs_max(x: torch.Tensor) -> torch.Tensor:
    """The largest magnitude in ``x`` (NaN if it holds one), in one pass without a copy of ``x``."""
    low, high = torch.aminmax(x)
    return torch.maximum(high, -low)
