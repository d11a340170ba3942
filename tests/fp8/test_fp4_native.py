"""The fp4 casts' C++ kernels (``csrc/fp4_kernel.cpp``) against their definition, the torch code
of :mod:`mixprec.formats._fp4` (run with ``MIXPREC_NATIVE_KERNELS=0``): the same bits for codes,
scales, amaxes, magnitudes and dequantized values in float32/bfloat16/float16, over the cases
below (ties, saturation, subnormal and zero block scales, partial blocks, non-finite values,
stochastic rounding), and the torch code where the kernels must not serve.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from mixprec import fp8
from mixprec.formats import _fp4
from mixprec.formats._fp4 import Fp4Tensor, RoundingKey, quantize, rounding_generator

from _kernel_spy import KernelSpy, both

CASTS = {"mxfp4": fp8.Cast("e2m1", "1x32"), "nvfp4": fp8.Cast("e2m1", "1x16"), "nvfp4-2d": fp8.Cast("e2m1", "16x16")}
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_TIES = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _grid_and_ties(seed: int) -> torch.Tensor:
    """Every e2m1 magnitude and midpoint, both signs, in blocks whose amax is 6 (MXFP4 and
    NVFP4 scale them by exactly 1 or a power of 2): each value lands on its tie."""
    values = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, *_TIES, -0.0])
    x = values[torch.randint(0, len(values), (20, 64), generator=_gen(seed))]
    x[:, ::16] = 6.0
    return x * torch.where(torch.rand(20, 64, generator=_gen(seed + 1)) < 0.5, -1.0, 1.0)


def _spread(seed: int) -> torch.Tensor:
    """Blocks over many decades, a partial block in both dimensions."""
    x = torch.randn(37, 70, generator=_gen(seed))
    return x * torch.logspace(-30, 30, 37)[:, None]


def _subnormal_scales(seed: int) -> torch.Tensor:
    """One block 1e6 times the others': NVFP4's block scales below e4m3's smallest normal (and 0)."""
    x = torch.randn(16, 64, generator=_gen(seed)) * 1e-3
    x[0, :16] *= 1e9
    x[5, 16:32] *= 1e-6
    return x


def _saturating(seed: int) -> torch.Tensor:
    """Block amaxes whose e4m3 scale rounds down: x * multiplier beyond 6, clamped."""
    x = torch.rand(16, 32, generator=_gen(seed)) * 2 - 1
    x[:, ::16] = 6.0 * 1.0625 * 1.03
    x[:, 1::16] = -6.0 * 1.0625 * 1.03
    return x


def _huge(seed: int) -> torch.Tensor:
    return torch.randn(4, 48, generator=_gen(seed)) * 3e37


#: name -> operand (float32 unless it says otherwise)
OPERANDS: dict[str, Callable[[int], torch.Tensor]] = {
    "normal": lambda s: torch.randn(33, 96, generator=_gen(s)),
    "one row": lambda s: torch.randn(1, 16, generator=_gen(s)),
    "one element": lambda s: torch.randn(1, 1, generator=_gen(s)),
    "grid and ties": _grid_and_ties,
    "decades": _spread,
    "subnormal scales": _subnormal_scales,
    "saturating": _saturating,
    "huge": _huge,
    "zeros": lambda s: torch.zeros(17, 40),
    "negative zeros": lambda s: torch.full((3, 32), -0.0),
    "bfloat16": lambda s: torch.randn(18, 64, generator=_gen(s)).to(torch.bfloat16),
    "float16": lambda s: torch.randn(18, 48, generator=_gen(s)).to(torch.float16),
    "float64": lambda s: torch.randn(5, 40, generator=_gen(s)).double(),
    "transposed": lambda s: torch.randn(64, 24, generator=_gen(s)).t(),
}


def _bits(t: torch.Tensor | None) -> Any:
    """A tensor's dtype, shape and bytes (NaNs compared by their bits)."""
    if t is None:
        return None
    flat = t.detach().contiguous().reshape(-1)
    return t.dtype, tuple(t.shape), flat.view(torch.uint8).tolist() if flat.numel() else []


def _record(t: Fp4Tensor) -> dict[str, Any]:
    out = {name: _bits(getattr(t, name)) for name in ("codes", "scales", "tensor_scale", "amax")}
    out["shape"] = tuple(t.shape)
    out["magnitudes"] = _bits(t.magnitudes())
    for dtype in DTYPES:
        out[str(dtype)] = _bits(t.dequantize(dtype))
    return out


#: how a cast rounds: to nearest, or stochastically with draws from a torch.Generator, a
#: RoundingKey with a Python step, or one with a tensor step (a layer's device counter)
ROUNDINGS: dict[str, Callable[[int], Any]] = {
    "nearest": lambda seed: None,
    "generator": lambda seed: rounding_generator(seed, 3, 1, "cpu"),
    "key": lambda seed: RoundingKey(seed, 3, 1),
    "key, tensor step": lambda seed: RoundingKey(seed, torch.tensor(3), 1),
}


def _cast(x: torch.Tensor, cast: fp8.Cast, subnormal: bool, rounding: str, seed: int = 0) -> dict[str, Any]:
    return _record(quantize(x, cast, subnormal_scales=subnormal, generator=ROUNDINGS[rounding](seed)))


@pytest.mark.parametrize("rounding", list(ROUNDINGS)[:3])
@pytest.mark.parametrize("cast", list(CASTS), ids=list(CASTS))
@pytest.mark.parametrize("operand", list(OPERANDS), ids=list(OPERANDS))
def test_kernels_bitwise_the_torch_code(operand, cast, rounding, kernel_spy, monkeypatch):
    x = OPERANDS[operand](7)
    # MXFP4 dequantizes in the target dtype: a scale beyond float16's range is inf there, the torch code's
    decoded = len(DTYPES) - (cast == "mxfp4" and operand in ("decades", "huge", "subnormal scales"))
    for subnormal in (False, True):
        kernel_spy.calls.clear()
        ours, theirs = both(lambda: _cast(x, CASTS[cast], subnormal, rounding), monkeypatch)
        assert ours == theirs, (operand, cast, subnormal, rounding)
        decodes = kernel_spy.calls["fp4_decode"] + kernel_spy.calls["fp4_nvfp4_decode"]
        assert kernel_spy.calls["fp4_encode"] == 1 and decodes == decoded  # the kernels served
        assert kernel_spy.calls["fp4_nvfp4_scales"] == (cast != "mxfp4") and kernel_spy.calls["fp4_magnitudes"] == 1


def test_seeded_sweep_bitwise(kernel_spy, monkeypatch):
    """Random shapes (partial blocks), magnitudes and casts, rounded both ways."""
    g = _gen(11)
    for trial in range(40):
        rows, cols = (int(v) for v in torch.randint(1, 50, (2,), generator=g))
        x = torch.randn(rows, cols, generator=g) * float(torch.exp(torch.randn((), generator=g) * 4))
        cast = list(CASTS.values())[trial % 3]
        subnormal, rounding = bool(trial % 2), list(ROUNDINGS)[trial // 3 % 4]
        ours, theirs = both(lambda: _cast(x, cast, subnormal, rounding, seed=trial), monkeypatch)
        assert ours == theirs, (trial, rows, cols, cast, subnormal, rounding)
    assert kernel_spy.calls["fp4_encode"] == 40


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("cast", list(CASTS), ids=list(CASTS))
def test_non_finite_operands_take_the_torch_code(value, cast, kernel_spy, monkeypatch):
    """A NaN or an infinity makes a block multiplier (MXFP4 NaN, NVFP4 every block) non-finite:
    the cast is the torch code's (a NaN's sign there is the hardware's choice of operand)."""
    x = torch.randn(16, 64, generator=_gen(2))
    x[3, 5] = value
    if value != value:
        x[9, 40] = -value  # a NaN with its sign bit set
    ours, theirs = both(lambda: _cast(x, CASTS[cast], False, "key"), monkeypatch)
    assert ours == theirs
    assert kernel_spy.calls["fp4_block_amax"] == 1
    if value != value or cast != "mxfp4":
        assert kernel_spy.calls["fp4_encode"] == 0  # the multipliers were not all finite
    else:
        assert kernel_spy.calls["fp4_encode"] == 1  # MXFP4: an infinity's block multiplier is 2**-127


def test_dequantize_non_finite_scales_take_the_torch_code(kernel_spy, monkeypatch):
    t = quantize(torch.randn(4, 64, generator=_gen(4)), CASTS["mxfp4"])
    scales = t.scales.clone()
    scales[1, 0] = 255  # E8M0's NaN
    nan_scale = Fp4Tensor(t.codes, scales, None, t.amax, t.shape, t.cast)
    ours, theirs = both(lambda: [_bits(nan_scale.dequantize(d)) for d in DTYPES], monkeypatch)
    assert ours == theirs and kernel_spy.calls["fp4_decode"] == 0


def test_restored_operand_dequantizes_alike(kernel_spy, monkeypatch):
    """An Fp4Tensor as backward restores it (no amax) and a dtype the kernels do not write."""
    t = quantize(torch.randn(40, 32, generator=_gen(5)), CASTS["nvfp4-2d"])
    restored = Fp4Tensor(t.codes, t.scales, t.tensor_scale, t.scales.new_empty(0), t.shape, t.cast)
    ours, theirs = both(lambda: [_bits(restored.dequantize(d)) for d in (*DTYPES, torch.float64)], monkeypatch)
    assert ours == theirs and kernel_spy.calls["fp4_nvfp4_decode"] == len(DTYPES)


#: block amaxes (float32, 2-D) for the NVFP4 scales kernel: e4m3 roundings and ties, zeros,
#: decades past e4m3's range both ways, float32's extremes, non-finite values
AMAXES: dict[str, Callable[[], torch.Tensor]] = {
    "random": lambda: torch.rand(7, 9, generator=_gen(1)) * 10,
    "decades": lambda: torch.logspace(-38, 38, 60).reshape(6, 10),
    "e4m3 ties": lambda: (torch.arange(1, 97, dtype=torch.float32) * 0.0625 + 0.03125).reshape(8, 12) * 6,
    "all zero": lambda: torch.zeros(3, 4),
    "one zero": lambda: torch.tensor([[0.0, 1.0, 3e-9, 448.0 * 6]]),
    "subnormal floats": lambda: torch.tensor([[1e-45, 1e-40, 1.17e-38, 2.0]]),
    "float32 max": lambda: torch.tensor([[3.4e38, 1.0, 0.0]]),
    "infinity": lambda: torch.tensor([[1.0, float("inf"), 2.0]]),
    "nan": lambda: torch.tensor([[1.0, float("nan"), 2.0]]),
}


@pytest.mark.parametrize("amax", list(AMAXES), ids=list(AMAXES))
def test_nvfp4_scales_kernel_is_block_scales(amax, native_ops):
    """``fp4_nvfp4_scales``: the bits of ``_block_scales`` (scales, tensor scale, multipliers), and
    its flag whether every multiplier is finite, with and without subnormal scales and with a
    tensor amax given (a tensor-parallel all-reduce's, larger or smaller than the blocks'). Where
    the flag says not finite, the cast takes the torch code, and a NaN's sign and payload (which
    operand the hardware keeps) are not compared."""
    a, cast = AMAXES[amax](), CASTS["nvfp4"]
    for subnormal in (False, True):
        for given in (None, torch.tensor(5e3), torch.tensor(1e-3), torch.tensor(0.0)):
            reduce = None if given is None else (lambda t, g=given: g)
            ours = native_ops.fp4_nvfp4_scales(a, given, subnormal)
            theirs = _fp4._block_scales(a, cast, subnormal, reduce)
            bits = _bits if ours[3] else _bits_any_nan
            assert [bits(t) for t in ours[:3]] == [bits(t) for t in theirs], (amax, subnormal, given)
            assert ours[3] == bool(torch.isfinite(theirs[2]).all()), (amax, subnormal, given)


def _bits_any_nan(t: torch.Tensor) -> Any:
    """:func:`_bits` of ``t`` in float32 with every NaN made one NaN (sign and payload dropped)."""
    f = t.float()
    return _bits(torch.where(f.isnan(), torch.full_like(f, float("nan")), f))


def test_nvfp4_decode_kernel_refuses_non_finite_scales(native_ops, kernel_spy, monkeypatch):
    """A block scale whose product with the tensor scale is not finite (an infinite tensor scale,
    a NaN e4m3 scale): the kernel decodes nothing and says so; dequantize takes the torch code."""
    t = quantize(torch.randn(32, 64, generator=_gen(9)), CASTS["nvfp4"])
    nan_scales = t.scales.clone()
    nan_scales.view(torch.uint8)[2, 1] = 0x7F  # e4m3's NaN
    for scales, ts in ((t.scales, torch.tensor(float("inf"))), (nan_scales, t.tensor_scale)):
        values, finite = native_ops.fp4_nvfp4_decode(t.codes, scales, ts, 1, 16, 32, 64, torch.float32)
        assert not finite and values.numel() == 0
        odd = Fp4Tensor(t.codes, scales, ts, t.amax, t.shape, t.cast)
        kernel_spy.calls.clear()
        ours, theirs = both(lambda: [_bits(odd.dequantize(d)) for d in DTYPES], monkeypatch)
        assert ours == theirs and kernel_spy.calls["fp4_nvfp4_decode"] == len(DTYPES) and kernel_spy.calls["fp4_decode"] == 0


def test_nvfp4_cast_with_a_global_amax_is_the_torch_code(kernel_spy, monkeypatch):
    """A tensor-parallel shard's NVFP4 cast (``reduce``: its tensor amax made global) through the
    kernels: the torch code's bits, the reduce called once on the shard's own amax."""
    x = torch.randn(24, 64, generator=_gen(10))
    seen: list[float] = []

    def reduce(t: torch.Tensor) -> torch.Tensor:
        seen.append(float(t))
        return torch.maximum(t, torch.tensor(40.0))

    ours, theirs = both(lambda: _record(quantize(x, CASTS["nvfp4"], reduce=reduce)), monkeypatch)
    assert ours == theirs and kernel_spy.calls["fp4_nvfp4_scales"] == 1
    assert seen == [float(x.abs().max())] * 2


def test_uniform_draws_are_torch_rand(native_ops):
    for n in (0, 1, 623, 624, 625, 5000):
        ours, theirs = _gen(n), _gen(n)
        assert torch.equal(native_ops.fp4_uniform(n, ours), torch.rand(n, generator=theirs))
        assert torch.equal(ours.get_state(), theirs.get_state())
    assert _fp4._draws_agree(native_ops)


def test_key_draws_are_the_torch_code(native_ops):
    """A RoundingKey's draws: SplitMix64 in C++ against its int64 torch code, odd and even counts,
    states of both signs (as int64), Python and tensor steps."""
    keys = [RoundingKey(seed, step, stream) for seed, step, stream in
            ((0, 0, 0), (1, 5, 1), (2**40 + 3, 2**31, 7), (9, 123456789, 2), (3, 1, 0), (4, 1, 0),
             (5, -3, 1), (6, 2**62 + 1, 3))]
    assert {int(key._state("cpu")) < 0 for key in keys} == {True, False}
    for key in keys:
        for k in (key, RoundingKey(key.seed, torch.tensor(key.step), key.stream)):
            for n in (0, 1, 2, 3, 4097):
                assert torch.equal(native_ops.fp4_key_draws(int(k._state("cpu")), n), k.draws((n,), "cpu"))
            assert k.host_state() == int(k._state("cpu"))


def test_draws_by_torch_where_they_disagree(kernel_spy, monkeypatch):
    """Where the kernel's draws differed from torch.rand's, the cast draws with torch.rand."""
    x = torch.randn(16, 48, generator=_gen(6))
    monkeypatch.setitem(_fp4._checked, "draws", False)
    ours, theirs = both(lambda: _cast(x, CASTS["nvfp4"], False, "generator"), monkeypatch)
    assert ours == theirs and kernel_spy.calls["fp4_uniform"] == 0 and kernel_spy.calls["fp4_encode"] == 1


def _no_kernel(kernel_spy: KernelSpy, fn: Callable[[], Fp4Tensor]) -> Fp4Tensor:
    t = fn()
    t.magnitudes()
    t.dequantize(torch.float32)
    assert not kernel_spy.calls, kernel_spy.calls
    return t


def test_torch_code_where_the_kernels_must_not_serve(kernel_spy, monkeypatch):
    x = torch.randn(16, 32, generator=_gen(8))
    cast = CASTS["nvfp4"]
    with monkeypatch.context() as m:
        m.setenv("MIXPREC_NATIVE_KERNELS", "0")
        _no_kernel(kernel_spy, lambda: quantize(x, cast))
    leaf = x.clone().requires_grad_()
    t = quantize(leaf, cast)  # requires grad, grad mode on: the amax is differentiable (the codes are not)
    assert t.amax.requires_grad and not kernel_spy.calls
    meta = _no_kernel(kernel_spy, lambda: quantize(x.to("meta"), cast))
    assert meta.codes.device.type == "meta"
    with FakeTensorMode() as mode:
        fake = _no_kernel(kernel_spy, lambda: quantize(mode.from_tensor(x), cast))
    assert fake.codes.shape == (16, 16)
    with monkeypatch.context() as m:
        m.setattr(torch.compiler, "is_compiling", lambda: True)
        _no_kernel(kernel_spy, lambda: quantize(x, cast))
    with torch.no_grad():
        quantize(leaf, cast)  # grad mode off: the kernels serve
    assert kernel_spy.calls["fp4_encode"] == 1


def test_kernels_check_their_inputs(native_ops):
    x = torch.randn(4, 32)
    with pytest.raises(RuntimeError, match="contiguous 2-D"):
        native_ops.fp4_block_amax(x.t(), 1, 16)
    with pytest.raises(RuntimeError, match="one per block"):
        native_ops.fp4_encode(x, torch.ones(4, 1), 1, 16, None)
    with pytest.raises(RuntimeError, match="16 or 32 wide"):
        native_ops.fp4_encode(x, torch.ones(4, 4), 1, 8, None)
    with pytest.raises(RuntimeError, match="uniform draws"):
        native_ops.fp4_encode(x, torch.ones(4, 2), 1, 16, torch.rand(7))
    with pytest.raises(RuntimeError, match="whole"):
        native_ops.fp4_decode(torch.zeros(4, 8, dtype=torch.uint8), torch.ones(4, 1), 1, 16, 5, 16, torch.float32)
    with pytest.raises(RuntimeError, match="dtype"):
        native_ops.fp4_decode(torch.zeros(4, 8, dtype=torch.uint8), torch.ones(4, 1), 1, 16, 4, 16, torch.float64)
    with pytest.raises(RuntimeError, match="float32"):
        native_ops.fp4_nvfp4_scales(torch.ones(4, 2, dtype=torch.float64), None, False)
    with pytest.raises(RuntimeError, match="one float32 CPU value"):
        native_ops.fp4_nvfp4_scales(torch.ones(4, 2), torch.ones(2), False)
    with pytest.raises(RuntimeError, match="float8_e4m3fn"):
        native_ops.fp4_nvfp4_decode(torch.zeros(4, 8, dtype=torch.uint8), torch.ones(4, 1), torch.ones(()), 1, 16,
                                    4, 16, torch.float32)


@pytest.mark.parametrize("recipe", ["nvfp4", "mxfp4"])
def test_fp4_linear_trains_bitwise_alike(recipe, kernel_spy, monkeypatch):
    """``fp8.linear`` under the recipe (stochastic rounding and the Hadamard transform where NVFP4
    has them), two steps: outputs, gradients and the cast statistics the same with and without
    the kernels."""
    r = getattr(fp8.Float8Recipe, recipe)()

    def steps() -> list[Any]:
        gen = _gen(3)
        x, w, b = torch.randn(40, 64, generator=gen), torch.randn(96, 64, generator=gen), torch.randn(96, generator=gen)
        state, out = fp8.LayerState(), []
        for _ in range(2):
            xs, ws, bs = (t.clone().requires_grad_() for t in (x, w, b))
            y = fp8.linear(xs, ws, bs, r, state=state)
            y.square().sum().backward()
            out += [_bits(t) for t in (y, xs.grad, ws.grad, bs.grad)]
        return out + [state.read()]

    ours, theirs = both(steps, monkeypatch)
    assert ours == theirs and kernel_spy.calls["fp4_encode"] >= 8
