"""How an fp8 tensor core accumulates, emulated: the backend ``"emulate_tc"``.

DeepSeek-V3 (arXiv 2412.19437, section 3.3.2) measured that the fp8 GEMMs of NVIDIA H800 tensor
cores keep about 14 bits of the accumulator, well below float32, and that promoting the partial
sums to float32 registers every 128 elements of K (four WGMMAs) recovers float32-like accuracy
(cuBLAS does so when fast accumulation is off). This module's model of it:

* K is taken in **groups of 32** (one fp8 WGMMA's K): each group's dot products are exact enough
  to be computed in float32 (products of fp8 values are exact in float32);
* each group's sum is added to the tensor core's accumulator, which is then **truncated to 14
  significant bits** (13 stored mantissa bits; toward zero, as an aligned adder drops the bits
  shifted out);
* every **128 elements** of K the accumulator is added to a float32 sum and cleared.

So emulated training does not look better than the hardware would: the same casts, with an
accumulation as lossy as measured (on long K a relative error of order ``2**-13``, biased toward
zero, where float32 accumulation errs by about ``2**-24 * sqrt(K)``).
"""

from __future__ import annotations

import torch

__all__ = ["tensor_core_mm", "KEPT_BITS", "GROUP", "INTERVAL"]

#: significant bits the tensor core's accumulator keeps (DeepSeek-V3: "around 14 bits" on H800)
KEPT_BITS = 14
#: elements of K one MMA instruction sums (an fp8 WGMMA's K)
GROUP = 32
#: elements of K after which the partial sum is promoted to float32 (DeepSeek-V3's N_C = 128)
INTERVAL = 128
_DROP = (1 << (24 - KEPT_BITS)) - 1  # the low mantissa bits a float32 holds beyond KEPT_BITS


def _truncate(x: torch.Tensor) -> torch.Tensor:
    """``x`` (float32) with only :data:`KEPT_BITS` significant bits, rounded toward zero."""
    return (x.view(torch.int32) & ~_DROP).view(torch.float32)


def tensor_core_mm(a: torch.Tensor, b: torch.Tensor, interval: int = INTERVAL) -> torch.Tensor:
    """``a @ b`` (2-D, float32) accumulated as an fp8 tensor core does (see the module's
    docstring): groups of :data:`GROUP` elements of K, an accumulator of :data:`KEPT_BITS`
    bits, promoted to float32 every ``interval`` elements (a multiple of :data:`GROUP`; K itself:
    never promoted, as with fast accumulation). Float32 result.

    Example:
        >>> a, b = torch.ones(1, 4096), torch.full((4096, 1), 1 + 2 ** -14)
        >>> float(a.double() @ b.double()), float(tensor_core_mm(a, b))  # a group's 2**-9: beyond 14 bits
        (4096.25, 4096.0)
    """
    if interval % GROUP:
        raise ValueError(f"tensor_core_mm: the promotion interval must be a multiple of {GROUP}, got {interval}")
    a, b = a.to(torch.float32), b.to(torch.float32)
    k = a.shape[1]
    total = a.new_zeros(a.shape[0], b.shape[1])
    for start in range(0, k, interval):
        acc = torch.zeros_like(total)
        for g in range(start, min(start + interval, k), GROUP):
            width = min(GROUP, k - g)
            acc = _truncate(acc + torch.mm(a.narrow(1, g, width), b.narrow(0, g, width)))
        total += acc
    return total
