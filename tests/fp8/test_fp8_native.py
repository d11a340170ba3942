"""The tensor- and row-scaled fp8 casts' C++ kernels (``csrc/fp8_kernel.cpp``) against their
definition, the torch code of :mod:`mixprec.formats._quant` (run with ``MIXPREC_NATIVE_KERNELS=0``):
the same bits for codes, scales and amaxes (their shapes and strides too) and the dequantized
values, over e4m3/e5m2, tensor and row scales, power-of-2 scales, three operand dtypes, given
amaxes, transposed weights and special values; the torch code where the kernels must not serve.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from mixprec import fp8
from mixprec.formats._quant import cast_to_fp8, dequantize

from _kernel_spy import KernelSpy, both

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
CASTS = {f"{fmt}-{gran}": fp8.Cast(fmt, gran) for fmt in ("e4m3fn", "e5m2") for gran in ("tensor", "row")}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _ties(seed: int) -> torch.Tensor:
    """Values halfway between e4m3 and e5m2 neighbours once scaled (the row's amax 448 or 57344
    scales by exactly 1): each lands on a tie, rounded to even."""
    grid = torch.tensor([1.0, 1.125, 1.25, 1.5, 1.75, 2.0]) * 2.0 ** torch.arange(-8, 8).reshape(-1, 1)
    mids = (grid[:, :-1] + grid[:, 1:]).reshape(-1) / 2
    x = mids[torch.randint(0, mids.numel(), (12, 40), generator=_gen(seed))]
    x[:, 0] = 448.0
    return x


def _specials(seed: int) -> torch.Tensor:
    x = torch.randn(9, 24, generator=_gen(seed))
    x[1, 3], x[2, 5], x[3, 7] = float("inf"), float("-inf"), float("nan")
    x[4] = 0.0
    x[5, :4] = torch.tensor([-0.0, 1e-30, -1e-40, 3e38])
    return x


#: name -> operand (float32 unless it says otherwise; cast as each dtype)
OPERANDS: dict[str, Callable[[int], torch.Tensor]] = {
    "normal": lambda s: torch.randn(33, 96, generator=_gen(s)),
    "decades": lambda s: torch.randn(30, 20, generator=_gen(s)) * torch.logspace(-20, 20, 30)[:, None],
    "one element": lambda s: torch.randn(1, 1, generator=_gen(s)),
    "ties": _ties,
    "zeros": lambda s: torch.zeros(5, 16),
    "specials": _specials,
    "3-d": lambda s: torch.randn(2, 5, 48, generator=_gen(s)),
}


def _bits(t: torch.Tensor) -> Any:
    """A tensor's dtype, shape, strides and bytes (NaNs compared by their bits)."""
    flat = t.detach().contiguous().reshape(-1)
    return t.dtype, tuple(t.shape), t.stride(), flat.view(torch.uint8).tolist() if flat.numel() else []


def _cast_and_values(x: torch.Tensor, cast: fp8.Cast, row_dim: int, pow2: bool,
                     amax: torch.Tensor | None = None) -> list[Any]:
    q, scale, found = cast_to_fp8(x, cast, row_dim, pow2, amax)
    out = [_bits(q), _bits(scale), _bits(found)]
    if q.dim() == 2:
        out.append(_bits(dequantize(q, scale)))
    return out


@pytest.mark.parametrize("pow2", [False, True], ids=["scales", "pow2-scales"])
@pytest.mark.parametrize("cast", list(CASTS), ids=list(CASTS))
@pytest.mark.parametrize("operand", list(OPERANDS), ids=list(OPERANDS))
def test_kernels_bitwise_the_torch_code(operand, cast, pow2, kernel_spy, monkeypatch):
    for dtype in DTYPES:
        x = OPERANDS[operand](3).to(dtype)
        kernel_spy.calls.clear()
        ours, theirs = both(lambda: _cast_and_values(x, CASTS[cast], -1, pow2), monkeypatch)
        assert ours == theirs, (operand, cast, pow2, dtype)
        assert kernel_spy.calls["fp8_cast"] == 1 and kernel_spy.calls["fp8_dequantize"] == (x.dim() == 2)


@pytest.mark.parametrize("cast", list(CASTS), ids=list(CASTS))
def test_a_transposed_weight_is_the_torch_code(cast, kernel_spy, monkeypatch):
    """``W.t()`` scaled over its first dimension (a weight's cast for the forward GEMM): the codes
    keep the transposed layout, the scales are a row ``(1, out)``, dequantized per column."""
    for dtype in DTYPES:
        wt = torch.randn(48, 32, generator=_gen(5)).to(dtype).t()
        ours, theirs = both(lambda: _cast_and_values(wt, CASTS[cast], 0, True), monkeypatch)
        assert ours == theirs, (cast, dtype)
    assert kernel_spy.calls["fp8_cast"] == len(DTYPES) and kernel_spy.calls["fp8_dequantize"] == len(DTYPES)


@pytest.mark.parametrize("cast", list(CASTS), ids=list(CASTS))
def test_a_given_amax_is_the_torch_code(cast, kernel_spy, monkeypatch):
    """The amax a tensor-parallel or FSDP2 operand takes (all-reduced, larger than its own): its
    scale and codes follow it, and the cast returns it."""
    x = torch.randn(6, 4, 32, generator=_gen(6)).to(torch.bfloat16)
    own = x.abs().amax() if CASTS[cast].granularity == "tensor" else x.abs().amax(-1, keepdim=True)
    given = own * 3
    ours, theirs = both(lambda: _cast_and_values(x, CASTS[cast], -1, False, given), monkeypatch)
    assert ours == theirs and kernel_spy.calls["fp8_cast"] == 1
    assert cast_to_fp8(x, CASTS[cast], -1, False, given)[2] is given


def _no_kernel(kernel_spy: KernelSpy, fn: Callable[[], Any]) -> None:
    fn()
    assert not kernel_spy.calls, kernel_spy.calls


def test_torch_code_where_the_kernels_must_not_serve(kernel_spy, monkeypatch):
    x, cast = torch.randn(16, 32, generator=_gen(8)), CASTS["e4m3fn-row"]
    with monkeypatch.context() as m:
        m.setenv("MIXPREC_NATIVE_KERNELS", "0")
        _no_kernel(kernel_spy, lambda: dequantize(*cast_to_fp8(x, cast, -1, False)[:2]))
    leaf = x.clone().requires_grad_()
    _no_kernel(kernel_spy, lambda: cast_to_fp8(leaf, cast, -1, False))  # a gradient to record: torch's ops
    _no_kernel(kernel_spy, lambda: cast_to_fp8(x.to("meta"), cast, -1, False))
    with FakeTensorMode() as mode:
        _no_kernel(kernel_spy, lambda: cast_to_fp8(mode.from_tensor(x), cast, -1, False))
    with monkeypatch.context() as m:
        m.setattr(torch.compiler, "is_compiling", lambda: True)
        _no_kernel(kernel_spy, lambda: dequantize(*cast_to_fp8(x, cast, -1, False)[:2]))
    _no_kernel(kernel_spy, lambda: cast_to_fp8(x[:, ::2], cast, -1, False))  # strided: neither layout the kernel reads
    _no_kernel(kernel_spy, lambda: cast_to_fp8(x, cast, 0, False))  # rows over a contiguous operand's first dimension
    _no_kernel(kernel_spy, lambda: cast_to_fp8(x.double(), cast, -1, False))
    _no_kernel(kernel_spy, lambda: cast_to_fp8(x, cast, -1, False, x.abs().amax(-1, keepdim=True).double()))
    with torch.no_grad():
        cast_to_fp8(leaf, cast, -1, False)  # grad mode off: the kernel serves
    assert kernel_spy.calls["fp8_cast"] == 1


def test_kernels_check_their_inputs(native_ops):
    x = torch.randn(4, 32)
    with pytest.raises(RuntimeError, match="contiguous 2-D"):
        native_ops.fp8_cast(x.t(), torch.float8_e4m3fn, True, None, False)
    with pytest.raises(RuntimeError, match="float8_e4m3fn or float8_e5m2"):
        native_ops.fp8_cast(x, torch.float16, True, None, False)
    with pytest.raises(RuntimeError, match="one per row"):
        native_ops.fp8_cast(x, torch.float8_e4m3fn, True, torch.ones(3), False)
    q = x.to(torch.float8_e4m3fn)
    with pytest.raises(RuntimeError, match="one per column"):
        native_ops.fp8_dequantize(q, torch.ones(4, 2))
    with pytest.raises(RuntimeError, match="2-D"):
        native_ops.fp8_dequantize(x, torch.ones(()))


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
def test_fp8_linear_trains_bitwise_alike(recipe, kernel_spy, monkeypatch):
    """``fp8.linear`` under the recipe, bfloat16 autocast, two steps: outputs, gradients and the cast
    statistics the same with and without the kernels."""
    r = getattr(fp8.Float8Recipe, recipe)()

    def steps() -> list[Any]:
        gen = _gen(3)
        x, w, b = torch.randn(4, 10, 64, generator=gen), torch.randn(96, 64, generator=gen), torch.randn(96, generator=gen)
        state, out = fp8.LayerState(), []
        for _ in range(2):
            xs, ws, bs = (t.clone().requires_grad_() for t in (x, w, b))
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = fp8.linear(xs, ws, bs, r, state=state)
            y.float().square().sum().backward()
            out += [_bits(t) for t in (y, xs.grad, ws.grad, bs.grad)]
        return out + [state.read()]

    ours, theirs = both(steps, monkeypatch)
    assert ours == theirs and kernel_spy.calls["fp8_cast"] >= 6 and kernel_spy.calls["fp8_dequantize"] >= 6
