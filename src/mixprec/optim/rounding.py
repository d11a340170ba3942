"""Rounding a float32 result into a low-precision tensor: to nearest, or stochastically.

Stochastic rounding picks one of the two representable neighbours of ``x`` with probability
proportional to the distance to the *other* one, so ``E[round(x)] == x``: an update far below the
weight's resolution still moves it in expectation, where round-to-nearest drops it every time.

Both methods work on the float32 bit pattern with integer arithmetic only (no host sync, same code
on every device):

* ``bfloat16`` is the top half of ``float32``: add a uniform random 16-bit integer to the bits and
  clear the low 16 bits. A carry into the kept bits happens with probability ``low_bits / 2**16``,
  the distance to the lower neighbour in units of the gap. Carries into the exponent are the
  right answer (the next binade), and the sign-magnitude layout makes the same rule round
  negative numbers away from zero with the right probability.
* ``float16`` keeps 10 of float32's 23 mantissa bits for normal numbers (``|x| >= 2**-14``): the
  same trick with 13 random bits. Below that, float16 is subnormal with a fixed gap of ``2**-24``:
  ``floor(|x| * 2**24 + u)`` with ``u = r / 2**13`` is exact in float32 there (``|x| * 2**24 <
  1024``). Above float16's largest finite value (65504) ``inf`` stands for the next neighbour
  (65536): a finite value there becomes ``inf`` with probability proportional to its distance from
  65504 (65514: 31% of the time), where rounding to nearest overflows only from 65520 up (bfloat16
  alike, above 3.3895e38). The code keeps this rather than saturating: unbiased where it is
  finite, and a weight that close to the top of the range has already lost its precision.

The random numbers are drawn one per element in ``dst``'s storage order (a channels-last weight:
channels-last order), the order mixprec's C++ optimizer kernel draws them in.

NaN stays NaN; ``inf`` stays ``inf``.
"""

from __future__ import annotations

import torch

__all__ = ["stochastic_round_", "round_into_"]

_F16_MIN_NORMAL = 2.0**-14
_F16_SUBNORMAL_GAP_INV = 2.0**24


def _check(dst: torch.Tensor, src: torch.Tensor) -> None:
    if src.dtype != torch.float32:
        raise TypeError(f"stochastic_round_ needs a float32 source, got {src.dtype}")
    if dst.shape != src.shape:
        raise ValueError(f"shape mismatch: dst {tuple(dst.shape)} vs src {tuple(src.shape)}")
    if dst.device != src.device:
        raise ValueError(f"device mismatch: dst on {dst.device}, src on {src.device}")


def stochastic_round_(
    dst: torch.Tensor, src: torch.Tensor, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Write ``src`` (float32) into ``dst`` rounded stochastically to ``dst.dtype``; return ``dst``.

    Each element becomes the representable neighbour above or below with probability
    proportional to closeness, so the result is unbiased. ``dst`` may be ``bfloat16``,
    ``float16`` (both rounded stochastically) or ``float32`` (plain copy).

    Args:
        dst: destination, same shape and device as ``src``; written in place (``src`` is never
            modified, and ``dst`` may alias nothing but itself).
        src: the float32 values to round.
        generator: source of randomness, on ``src``'s device (``None``: the device's default
            generator). Seeding it makes the rounding reproducible. One number per element is
            drawn, in ``dst``'s storage order.

    Raises:
        TypeError: ``src`` is not float32, or ``dst`` is not bf16/fp16/fp32.
        ValueError: shapes or devices differ.

    Example:
        >>> w = torch.ones(100_000, dtype=torch.bfloat16)
        >>> g = torch.Generator().manual_seed(0)
        >>> _ = stochastic_round_(w, torch.full((100_000,), 1.0 + 2**-12), generator=g)  # 1/32 of a bf16 gap
        >>> abs(w.float().mean().item() - (1.0 + 2**-12)) < 2e-5  # the mean kept (to nearest: all 1.0)
        True
    """
    _check(dst, src)
    if dst.dtype == torch.float32:
        return dst.copy_(src)
    if dst.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"stochastic rounding supports bfloat16/float16 targets, got {dst.dtype}")
    src = src.detach()
    drop = 16 if dst.dtype == torch.bfloat16 else 13
    # random_() without bounds fills int32 with 31 random bits, twice as fast as randint(0, 2**drop);
    # laid out as ``dst`` (a dense one: contiguous, channels-last), it fills them in dst's storage
    # order, the order mixprec's C++ kernel draws them in
    noise = torch.empty_like(dst, dtype=torch.int32, memory_format=torch.preserve_format).random_(generator=generator)
    noise.bitwise_and_((1 << drop) - 1)
    rounded = noise.add(src.view(torch.int32)).bitwise_and_(-(1 << drop)).view(torch.float32)
    if dst.dtype == torch.float16:
        # float16 subnormals: fixed gap 2**-24; all terms exact in float32.
        magnitude = torch.floor(
            src.abs() * _F16_SUBNORMAL_GAP_INV + noise.to(torch.float32) * (1.0 / (1 << drop))
        )
        subnormal = torch.copysign(magnitude / _F16_SUBNORMAL_GAP_INV, src)
        rounded = torch.where(src.abs() < _F16_MIN_NORMAL, subnormal, rounded)
    rounded.masked_fill_(torch.isnan(src), float("nan"))  # a NaN's low bits may carry it to inf
    return dst.copy_(rounded)  # exact: ``rounded`` is representable in dst.dtype (or +-inf)


def round_into_(
    dst: torch.Tensor,
    src: torch.Tensor,
    stochastic: bool,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Write float32 ``src`` into ``dst``: stochastically if asked and ``dst`` is low precision,
    else to nearest (``copy_``)."""
    if stochastic and dst.dtype in (torch.bfloat16, torch.float16):
        return stochastic_round_(dst, src, generator)
    return dst.copy_(src)
