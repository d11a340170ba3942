"""FP4 (e2m1) casts: the codec, MXFP4 and NVFP4 block scales, stochastic rounding.

* **e2m1**: 1 sign, 2 exponent, 1 mantissa bit; magnitudes ``0, 0.5, 1, 1.5, 2, 3, 4, 6``; no inf
  or NaN (a value beyond 6 saturates). A code is 4 bits, ``sign << 3 | magnitude index``; codes
  are stored two per byte, the even element in the low nibble (torchao's ``pack_uint4``).
  Round-to-nearest-even is bitwise torchao 0.18's ``f32_to_f4_unpacked`` on finite values (a NaN
  becomes 0 here; its block's scale makes it NaN again on dequantization, as torchao's).
* **MXFP4** (``Cast("e2m1", "1x32")``, OCP MX v1.0): 32 elements along the contracted dimension
  share an E8M0 scale, rounded up (RCEIL), bitwise torchao's ``MXTensor.to_mx(...,
  torch.float4_e2m1fn_x2, 32, ScaleCalculationMode.RCEIL)``; dequantized in the target dtype
  (``codes.to(dtype) * scale.to(dtype)``) as torchao's ``to_dtype``.
* **NVFP4** (``Cast("e2m1", "1x16")``, or ``"16x16"`` 2-D blocks for weights as Transformer
  Engine's recipe): an fp32 tensor scale ``amax / (448 * 6)`` and an e4m3 scale per block
  ``(block_amax / 6) / tensor_scale``, bitwise torchao's ``nvfp4_quantize`` with a per-tensor
  scale; dequantized as ``codes * (tensor_scale * block_scale)`` in float32, then cast.
  torchao clamps block scales at ``2**-6`` (e4m3's smallest normal, the default here);
  ``subnormal_scales=True`` lets them go down to e4m3's subnormals (Transformer Engine's
  formula; a block whose scale rounds to 0 becomes 0). An all-zero tensor (amax 0) gets a
  tensor scale of 1 and quantizes to zeros (torchao divides by zero there: NaN). A NaN or an
  infinity anywhere makes the tensor scale non-finite and the whole tensor NaN on
  dequantization, as torchao's and as a tensorwise fp8 cast: no block is rescaled silently.
* **Stochastic rounding**: between the two neighbouring e2m1 magnitudes ``lo <= m < hi``, up
  with probability ``(m - lo) / (hi - lo)`` (unbiased). The uniform draws come from a
  :class:`RoundingKey` ``(seed, step, stream)``: SplitMix64's stream from a state mixed from the
  key, computed in int64 torch ops (so ``torch.compile`` traces it, and a layer's ``step`` may
  be a device counter), or from a ``torch.Generator`` (:func:`rounding_generator`): either way
  reproducible, the same on every rank, the global RNG untouched.
On the CPU, :func:`quantize`, :meth:`Fp4Tensor.dequantize` and :meth:`Fp4Tensor.magnitudes` run
mixprec's C++ kernels (``csrc/fp4_kernel.cpp``: one pass over the operand each, where this
module's torch code makes about twenty; stochastic rounding's draws too, a :class:`RoundingKey`'s
in unsigned 64-bit arithmetic, a generator's as ``torch.rand`` draws them) and give the same
bits. The torch code below is their definition and serves wherever the kernels do not:
``MIXPREC_NATIVE_KERNELS=0`` or no compiler, other devices, tensor subclasses (FakeTensor,
DTensor), code being traced by ``torch.compile``, an operand that requires grad (under grad
mode), empty tensors, dequantizing to a dtype other than float32/bfloat16/float16, and casts whose
block multipliers or scales are not finite (a NaN or an infinity in the operand): there the sign
of a NaN depends on which operand of a multiply the hardware keeps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

from mixprec import _native
from mixprec.formats._blocks import _blocked, _e8m0, _e8m0_value, _unblocked, per_block
from mixprec.formats._recipe import Cast

__all__ = ["E2M1_MAX", "E2M1_VALUES", "Fp4Tensor", "encode_e2m1", "decode_e2m1", "pack", "unpack",
           "quantize", "RoundingKey", "rounding_generator"]

E2M1_MAX = 6.0
#: the value of each 4-bit code (index: the code).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_MAGNITUDES = E2M1_VALUES[:8]
_E4M3_MAX = 448.0
_E4M3_TINY = 2.0 ** -6  # torchao's E4M3_EPS: the smallest normal e4m3
_F32_MAX = torch.finfo(torch.float32).max
#: dtypes the kernels read (an operand) and write (dequantize)
_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_PLAIN = (torch.Tensor, torch.nn.Parameter)  # not a subclass with its own dispatch (FakeTensor, DTensor)


def _kernels(t: torch.Tensor) -> Any | None:
    """``torch.ops.mixprec_native`` if its fp4 kernels may serve ``t`` (see the module's
    docstring), else ``None``: the torch code serves."""
    if (type(t) not in _PLAIN or t.device.type != "cpu" or t.numel() == 0 or torch.compiler.is_compiling()
            or (t.requires_grad and torch.is_grad_enabled()) or not _native.enabled()):
        return None
    return _native.load()


#: The midpoints between neighbouring magnitudes, each with whether a tie there rounds up: a tie
#: goes to the even code (0, 1.0, 2.0, 4.0 are even; 0.5, 1.5, 3.0, 6.0 odd).
_MIDPOINTS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


def _count_passed(m: torch.Tensor, bounds: tuple[tuple[float, bool], ...]) -> torch.Tensor:
    """uint8: for each element, how many ``(b, inclusive)`` bounds it passes (``m >= b`` or ``m > b``);
    a comparison per bound, cheaper than ``torch.bucketize`` on CPU."""
    count = torch.zeros(m.shape, dtype=torch.uint8, device=m.device)
    for b, inclusive in bounds:
        count += (m >= b) if inclusive else (m > b)
    return count


def encode_e2m1(x: torch.Tensor, generator: torch.Generator | RoundingKey | None = None) -> torch.Tensor:
    """The 4-bit e2m1 codes (uint8, one per element) of the float32 ``x``, already scaled into
    ``[-6, 6]`` (beyond saturates). Round to nearest even, or with ``generator`` (a
    ``torch.Generator`` or a :class:`RoundingKey`: where the uniform draws come from) stochastic
    rounding (unbiased: the expected decoded value is ``x``).

    Example:
        >>> encode_e2m1(torch.tensor([0.25, 0.75, -2.5, 7.0])).tolist()
        [0, 2, 12, 7]
    """
    m = x.abs()
    if generator is None:
        mag = _count_passed(m, _MIDPOINTS)
    else:
        grid = torch.tensor(_MAGNITUDES, device=x.device)
        lo = _count_passed(m, tuple((g, True) for g in _MAGNITUDES[1:])).long()  # the largest grid point <= m
        lo_value = torch.take(grid, lo)
        step = torch.take(grid, (lo + 1).clamp_(max=len(grid) - 1)) - lo_value
        up = _uniform(generator, m.shape, x.device) * step < (m - lo_value)
        mag = lo.to(torch.uint8) + up
    return mag | (torch.signbit(x).to(torch.uint8) << 3)


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """The float32 values of 4-bit codes (uint8, one per element)."""
    return torch.take(torch.tensor(E2M1_VALUES, device=codes.device), codes.long())


def pack(codes: torch.Tensor) -> torch.Tensor:
    """Two 4-bit codes per byte along the last dimension (even length): element ``2i`` in the low
    nibble, ``2i + 1`` in the high one (torchao's ``pack_uint4``)."""
    pairs = codes.unflatten(-1, (-1, 2))
    return pairs.select(-1, 0) | (pairs.select(-1, 1) << 4)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`pack`: one code per byte, twice the last dimension."""
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(*packed.shape[:-1], -1)


@dataclass(frozen=True)
class Fp4Tensor:
    """A 2-D tensor cast to e2m1 by blocks (the contracted dimension last).

    ``codes``: uint8, two codes per byte, padded to whole blocks (``[R', C' / 2]``); ``scales``:
    one per block, E8M0 exponents (uint8, MXFP4) or ``float8_e4m3fn`` (NVFP4); ``tensor_scale``:
    NVFP4's float32 scalar (None for MXFP4); ``amax``: each block's max ``|x|`` (float32);
    ``shape``: the unpadded shape; ``cast``: the Cast it was made by.
    """

    codes: torch.Tensor
    scales: torch.Tensor
    tensor_scale: torch.Tensor | None
    amax: torch.Tensor
    shape: torch.Size
    cast: Cast

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The values in ``dtype``: MXFP4 multiplied in ``dtype`` (torchao's ``to_dtype``), NVFP4 in
        float32 then cast (torchao's ``NVFP4Tensor.dequantize``)."""
        rows, cols = self.cast.block
        ops = _kernels(self.codes) if dtype in _KERNEL_DTYPES else None
        if ops is not None:
            if self.tensor_scale is None:
                scale = _e8m0_value(self.scales).to(dtype).to(torch.float32)  # as the product's operand
                if bool(torch.isfinite(scale).all()):
                    return ops.fp4_decode(self.codes, scale, rows, cols, self.shape[0], self.shape[1], dtype)
            elif (type(self.tensor_scale) in _PLAIN and type(self.scales) in _PLAIN
                  and self.scales.dtype == torch.float8_e4m3fn and self.tensor_scale.device.type == "cpu"):
                values, finite = ops.fp4_nvfp4_decode(self.codes, self.scales.contiguous(),
                                                      self.tensor_scale.float(), rows, cols, *self.shape, dtype)
                if finite:  # (each block's scale the torch code's float32 product)
                    return values
        values = decode_e2m1(unpack(self.codes))
        vb = values.reshape(values.shape[0] // rows, rows, values.shape[1] // cols, cols)
        if self.tensor_scale is None:
            out = vb.to(dtype) * per_block(_e8m0_value(self.scales).to(dtype))
        else:
            scale = self.tensor_scale * self.scales.to(torch.float32)
            out = (vb * per_block(scale)).to(dtype)
        return _unblocked(out, self.shape)

    def magnitudes(self) -> torch.Tensor:
        """The magnitude index of each element's code (0: zero), unpadded: what the cast statistics
        count flushed values on."""
        ops = _kernels(self.codes)
        if ops is not None:
            return ops.fp4_magnitudes(self.codes, self.shape[0], self.shape[1])
        return _unblocked(unpack(self.codes).unsqueeze(0).unsqueeze(2) & 0x7, self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes held: codes, scales and the tensor scale."""
        ts = 0 if self.tensor_scale is None else self.tensor_scale.nbytes
        return self.codes.nbytes + self.scales.nbytes + ts


def quantize(x2: torch.Tensor, cast: Cast, *, subnormal_scales: bool = False,
             generator: torch.Generator | RoundingKey | None = None,
             reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> Fp4Tensor:
    """Cast the 2-D ``x2`` (contracted dimension last) to e2m1 by ``cast``'s blocks.

    ``"1x32"``: MXFP4 (E8M0 scales, RCEIL); ``"1x16"`` / ``"16x16"``: NVFP4 (fp32 tensor scale,
    e4m3 block scales, clamped at ``2**-6`` unless ``subnormal_scales``). ``generator`` (a
    ``torch.Generator`` or a :class:`RoundingKey`): round stochastically with its draws, one per
    element of the blocked, padded tensor in order (else to nearest even). A block running past the end of a dimension
    is zero-padded (zeros change no amax). ``reduce``: what makes NVFP4's tensor amax global (a
    tensor-parallel shard's all-reduce). Precondition: ``cast.format == "e2m1"``.

    Example:
        >>> t = quantize(torch.linspace(-1, 1, 64).reshape(2, 32), Cast("e2m1", "1x32"))
        >>> t.codes.shape, t.scales.shape, t.dequantize(torch.float32)[0, :3].tolist()
        (torch.Size([2, 16]), torch.Size([2, 1]), [-1.0, -1.0, -1.0])
    """
    rows, cols = cast.block
    ops = _kernels(x2)
    if ops is not None:
        x = (x2 if x2.dtype in _KERNEL_DTYPES else x2.to(torch.float32)).detach().contiguous()
        amax = ops.fp4_block_amax(x, rows, cols)
        if cast.scale_format == "e4m3":  # NVFP4's scales in one call (bitwise _block_scales)
            given = None if reduce is None else reduce(torch.max(amax))
            scales, tensor_scale, mul, finite = ops.fp4_nvfp4_scales(amax, given, subnormal_scales)
        else:
            scales, tensor_scale, mul = _block_scales(amax, cast, subnormal_scales, reduce)
            finite = bool(torch.isfinite(mul).all())
        if finite:  # else a NaN or an infinity: the torch code below
            rand = None if generator is None else _draws(ops, generator, (mul.shape[0], rows, mul.shape[1], cols))
            codes = ops.fp4_encode(x, mul, rows, cols, rand)
            return Fp4Tensor(codes, scales, tensor_scale, amax, x2.shape, cast)
    xb = _blocked(x2.to(torch.float32), rows, cols)
    amax = torch.amax(torch.abs(xb), dim=(1, 3))
    scales, tensor_scale, mul = _block_scales(amax, cast, subnormal_scales, reduce)
    xs = (xb * per_block(mul)).clamp_(-E2M1_MAX, E2M1_MAX)  # in place: the product is ours
    codes = encode_e2m1(xs, generator)
    codes = codes.reshape(codes.shape[0] * rows, -1)
    return Fp4Tensor(pack(codes), scales, tensor_scale, amax, x2.shape, cast)


def _draws(ops: Any, generator: torch.Generator | RoundingKey, shape: tuple[int, ...]) -> torch.Tensor:
    """The uniform draws :func:`encode_e2m1` makes (:func:`_uniform`) by the kernels: a
    :class:`RoundingKey`'s (integer arithmetic, about 20x its torch code), a ``torch.Generator``'s
    where the kernel's loop draws torch.rand's numbers (:func:`_draws_agree`; about 1.4x faster
    than torch's uniform kernel, which calls the generator out of line)."""
    if isinstance(generator, RoundingKey):
        if generator.window is not None:
            return generator.draws(shape, "cpu")
        return ops.fp4_key_draws(generator.host_state(), math.prod(shape))
    if _draws_agree(ops):
        return ops.fp4_uniform(math.prod(shape), generator)
    return _uniform(generator, shape, torch.device("cpu"))


def _draws_agree(ops: Any) -> bool:
    """Whether ``ops.fp4_uniform`` gives ``torch.rand``'s numbers and leaves the generator as it
    does (checked once per process on a few thousand draws: the same code, or another torch)."""
    if "draws" not in _checked:
        ours, theirs = torch.Generator().manual_seed(12345), torch.Generator().manual_seed(12345)
        agree = all(torch.equal(ops.fp4_uniform(n, ours), torch.rand(n, generator=theirs)) for n in (1, 2500, 33))
        _checked["draws"] = agree and torch.equal(ours.get_state(), theirs.get_state())
    return _checked["draws"]


_checked: dict[str, bool] = {}


def _block_scales(amax: torch.Tensor, cast: Cast, subnormal_scales: bool,
                  reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """``(scales, tensor_scale, mul)`` of the blocks whose max ``|x|`` is ``amax``: what
    :class:`Fp4Tensor` keeps, and each block's float32 multiplier into ``[-6, 6]``."""
    if cast.scale_format == "e8m0":
        scales, mul = _e8m0(amax, E2M1_MAX)
        return scales, None, mul
    tensor_amax = torch.max(amax) if amax.numel() else amax.new_zeros(())
    if reduce is not None:
        tensor_amax = reduce(tensor_amax)
    # (== 0, not <= 0: a NaN amax gives a NaN scale, the whole tensor NaN, as torchao's; a scale of 1
    # there rescaled every other block, clipping or flushing them without a sign)
    tensor_scale = torch.where(tensor_amax == 0, 1.0, tensor_amax / (_E4M3_MAX * E2M1_MAX))
    block = amax / E2M1_MAX / tensor_scale
    scales = torch.clamp(block, min=0.0 if subnormal_scales else _E4M3_TINY, max=_E4M3_MAX)
    scales = scales.to(torch.float8_e4m3fn)
    mul = (1.0 / tensor_scale) / scales.to(torch.float32)
    if subnormal_scales:  # a block scale of 0: TE's reciprocal is capped at float32's max
        mul = torch.clamp(mul, max=_F32_MAX)
    return scales, tensor_scale, mul


def rounding_generator(seed: int, step: int, stream: int, device: torch.device | str) -> torch.Generator:
    """A generator for stochastic rounding, seeded from ``(seed, step, stream)`` alone: the same
    draws on every rank and in every rerun; the global RNG is not touched. ``stream`` tells the
    casts of one step apart (e.g. grad_output for the input gradient and for the weight's).

    Example:
        >>> a = torch.rand(3, generator=rounding_generator(0, 5, 1, "cpu"))
        >>> torch.equal(a, torch.rand(3, generator=rounding_generator(0, 5, 1, "cpu")))
        True
    """
    key = 0
    for part in (seed, step, stream):
        key = _mix64(key ^ _mix64(part))
    g = torch.Generator(device=device)
    g.manual_seed(key >> 1)  # 63 bits; mixed, so that no (seed, step, stream) is a user's plain seed
    return g


@dataclass(frozen=True)
class RoundingKey:
    """Stochastic rounding's draws as a function of ``(seed, step, stream)`` and the element's
    index, without a generator: what :func:`quantize` takes from a layer, traceable by
    ``torch.compile(fullgraph=True)`` (int64 torch ops) and bitwise the same eager and compiled.
    ``step`` is a Python int or a 0-d int64 tensor (a layer's counter, read on the device: no
    host sync, no recompile as it advances).

    The draws are SplitMix64's output stream from the state ``mix(mix(mix(mix(seed)) ^ mix(step))
    ^ mix(stream))`` (``mix``: SplitMix64's step; the key :func:`rounding_generator` seeds with):
    output ``i`` gives two draws, its bits 8..31 and 40..63 as ``k / 2**24`` (24 bits: exact in
    float32, uniform on ``[0, 1)``), for elements ``i`` and ``i + ceil(n / 2)``.

    ``window``, ``((rows, cols), (row0, col0))``: the tensor drawn for is the block at ``(row0,
    col0)`` of a ``rows x cols`` one (padded to whole blocks), and takes that one's draws at its
    positions (a tensor-parallel shard draws what one process draws for its elements).

    Example:
        >>> a = RoundingKey(0, 5, 1).draws((3,), "cpu")
        >>> torch.equal(a, RoundingKey(0, torch.tensor(5), 1).draws((3,), "cpu"))
        True
    """

    seed: int
    step: int | torch.Tensor
    stream: int
    window: tuple[tuple[int, int], tuple[int, int]] | None = None

    def _state(self, device: torch.device | str) -> int | torch.Tensor:
        """SplitMix64's state the draws start from, as an int64 (a 0-d tensor on ``device`` when
        ``step`` is a tensor: int64 torch ops, traceable; else :meth:`host_state`)."""
        if isinstance(self.step, torch.Tensor):
            step = self.step.to(device=device, dtype=torch.int64, copy=True)
            state = _mix64_(_mix64_(step).bitwise_xor_(_signed(_mix64(_mix64(self.seed)))))
            return _mix64_(state.bitwise_xor_(_signed(_mix64(self.stream))))
        return self.host_state()

    def host_state(self) -> int:
        """:meth:`_state` as a Python int, in Python's integer arithmetic (bitwise the int64 torch ops):
        a tensor ``step`` read on the host (a host sync off the CPU: the CPU kernels' path, where
        reading a CPU tensor is a load, not a wait).

        Example:
            >>> key = RoundingKey(0, torch.tensor(5), 1)
            >>> key.host_state() == int(key._state("cpu"))  # (the int64 torch ops' state)
            True
        """
        step = int(self.step) if isinstance(self.step, torch.Tensor) else self.step
        return _signed(_mix64(_mix64(_mix64(_mix64(self.seed)) ^ _mix64(step)) ^ _mix64(self.stream)))

    def draws(self, shape: tuple[int, ...] | torch.Size, device: torch.device | str) -> torch.Tensor:
        """float32 uniform draws on ``[0, 1)`` of ``shape`` on ``device``, element by element in
        row-major order."""
        n = math.prod(shape)
        state = self._state(device)
        if self.window is not None:  # (shape: blocked as quantize's, [R/rows, rows, C/cols, cols])
            (rows, cols), (row0, col0) = self.window
            half = (rows * cols + 1) // 2
            r = torch.arange(row0, row0 + shape[0] * shape[1], dtype=torch.int64, device=device)
            c = torch.arange(col0, col0 + math.prod(shape[2:]), dtype=torch.int64, device=device)
            index = (r.unsqueeze(1) * cols + c).reshape(-1)
            high = index >= half
            z = _mix64_(torch.where(high, index - half, index).mul_(_signed(_GAMMA)).add_(state))
            bits = torch.where(high, z >> 40, z >> 8).bitwise_and_(_DRAW_MASK)
            return bits.to(torch.float32).mul_(2.0 ** -_DRAW_BITS).reshape(shape)
        half = (n + 1) // 2
        z = _mix64_(torch.arange(half, dtype=torch.int64, device=device).mul_(_signed(_GAMMA)).add_(state))
        bits = torch.cat([(z >> 8).bitwise_and_(_DRAW_MASK), (z >> 40).bitwise_and_(_DRAW_MASK)]).narrow(0, 0, n)
        return bits.to(torch.float32).mul_(2.0 ** -_DRAW_BITS).reshape(shape)


def _uniform(generator: torch.Generator | RoundingKey, shape: torch.Size, device: torch.device) -> torch.Tensor:
    """Stochastic rounding's uniform draws on ``[0, 1)`` (float32) from ``generator``."""
    if isinstance(generator, RoundingKey):
        return generator.draws(shape, device)
    return torch.rand(shape, generator=generator, device=device)


_MASK64 = 0xFFFFFFFFFFFFFFFF
_GAMMA, _MUL1, _MUL2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB  # SplitMix64's constants
_DRAW_BITS = 24
_DRAW_MASK = (1 << _DRAW_BITS) - 1


def _signed(z: int) -> int:
    """The int64 with the bits of the 64-bit unsigned ``z``."""
    return z - (1 << 64) if z >> 63 else z


def _mix64_(z: torch.Tensor) -> torch.Tensor:
    """:func:`_mix64` on an int64 tensor, in place (wrapping int64 arithmetic; ``>>`` is
    arithmetic in torch, so each shift is masked to be the logical one): bitwise ``_mix64`` of
    the same 64 bits."""
    z.add_(_signed(_GAMMA))
    z.bitwise_xor_((z >> 30).bitwise_and_((1 << 34) - 1)).mul_(_signed(_MUL1))
    z.bitwise_xor_((z >> 27).bitwise_and_((1 << 37) - 1)).mul_(_signed(_MUL2))
    return z.bitwise_xor_((z >> 31).bitwise_and_((1 << 33) - 1))


def _mix64(z: int) -> int:
    """SplitMix64's finalizer: a bijection of 64-bit integers that scatters neighbouring keys."""
    z = (z + _GAMMA) & _MASK64
    z = ((z ^ (z >> 30)) * _MUL1) & _MASK64
    z = ((z ^ (z >> 27)) * _MUL2) & _MASK64
    return z ^ (z >> 31)
