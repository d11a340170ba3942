"""The block recipes' GEMMs on torch's scaled GEMM, on fake CUDA devices of compute capability 8.9,
9.0 and 10.0 (formats/_native_gemm.py).

Each recipe's three GEMMs (forward, input gradient, weight gradient) run under a
``TorchDispatchMode`` that records every aten op: where the device has the hardware (blockwise on
sm90; MXFP8, MXFP4, NVFP4 on sm100) all three reach torch's scaled GEMM (``aten._scaled_mm_v2``,
``F.scaled_mm``; ``aten._scaled_mm`` for MXFP4) and no high-precision GEMM of their shapes runs;
the fake tensors' meta functions accept every argument (operand layouts, scale counts, dtypes,
swizzles, padding), awkward shapes included: M = 200 (no multiple of 128 or 32; the weight-gradient
GEMM contracts over it), M = 1, M = 33, K = 48 for NVFP4 (a multiple of 16, not of the 32 the
packed fp4 kernel needs). Elsewhere the emulation runs (``aten.mm``), says so once on the
``mixprec`` logger, and ``backend="scaled_mm"`` is a ValueError naming the capability it needs.

Autograd cannot run on fake CUDA tensors (see _fake_cuda.py): the backward's two GEMMs run by
calling the autograd function's ``forward`` and ``backward`` with a stand-in context.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import mixprec
from mixprec import fp8
from mixprec.formats import _native_gemm
from mixprec.formats._fp4_linear import Fp4Matmul
from mixprec.formats._linear import _Float8Matmul, resolve_backend

from _fake_cuda import HostReads, cuda_module, fake_cuda, fake_mode  # noqa: F401

CAPABILITIES = [(8, 9), (9, 0), (10, 0)]
RECIPES = ["blockwise", "mxfp8", "mxfp4", "nvfp4"]
#: where each recipe runs natively
NATIVE_AT = {"blockwise": {(9, 0)}, "mxfp8": {(10, 0)}, "mxfp4": {(10, 0)}, "nvfp4": {(10, 0)}}
#: (M, K, N) per recipe
SHAPES = [(200, 256, 128), (1, 256, 128), (33, 128, 256)]
CASES = [(r, *s) for r in RECIPES for s in SHAPES] + [("nvfp4", 200, 48, 64), ("nvfp4_1x16", 33, 48, 64)]
_SCALED = {"aten._scaled_mm_v2.default", "aten._scaled_mm.default"}
_SCALING = {int(getattr(F.ScalingType, n).value): n for n in dir(F.ScalingType) if n[0].isupper()}
_SWIZZLE = {int(getattr(F.SwizzleType, n).value): n for n in dir(F.SwizzleType) if n[0].isupper()}


def _recipe(name: str) -> fp8.Float8Recipe:
    return fp8.Float8Recipe.nvfp4(weight_block=(1, 16)) if name == "nvfp4_1x16" else fp8.as_recipe(name)


class Ops(TorchDispatchMode):
    """Records each aten op that runs: its name, and for GEMMs what it was given."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[SimpleNamespace] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)  # (the fake mode below runs the meta checks)
        name = str(func)
        if name in _SCALED or name == "aten.mm.default":
            a, b = args[0], args[1]
            call = SimpleNamespace(op=name, a=(tuple(a.shape), a.stride(), a.dtype),
                                   b=(tuple(b.shape), b.stride(), b.dtype), out=(tuple(out.shape), out.dtype))
            if name == "aten._scaled_mm_v2.default":
                call.scales = [(s.dtype, tuple(s.shape), s.stride()) for s in args[2]] + \
                              [(s.dtype, tuple(s.shape), s.stride()) for s in args[5]]
                call.recipes = ([_SCALING[i] for i in args[3]], [_SCALING[i] for i in args[6]])
                call.swizzles = ([_SWIZZLE[i] for i in args[4]], [_SWIZZLE[i] for i in args[7]])
            elif name == "aten._scaled_mm.default":
                call.scales = [(s.dtype, tuple(s.shape), s.stride()) for s in args[2:4]]
            self.calls.append(call)
        return out


class _Ctx(SimpleNamespace):
    needs_input_grad = (True, True, True)

    def save_for_backward(self, *tensors: torch.Tensor) -> None:
        self.saved_tensors = tensors


def _three_gemms(recipe: fp8.Float8Recipe, m: int, k: int, n: int, dtype: torch.dtype, backend: str = "auto"
                 ) -> tuple[str, list[SimpleNamespace], list[tuple]]:
    """The resolved backend, the GEMM calls and the three results' (shape, dtype) on fake CUDA."""
    with fake_mode(), torch.no_grad():
        x = torch.randn(m, k, device="cuda", dtype=dtype)
        w = torch.randn(n, k, device="cuda", dtype=dtype)
        go = torch.randn(m, n, device="cuda", dtype=dtype)
        ran = resolve_backend(backend, x, w, recipe)
        with Ops() as ops:
            ctx = _Ctx()
            if recipe.fp4:
                step = torch.zeros((), dtype=torch.int64, device="cuda")
                out = Fp4Matmul.forward(ctx, x, w, None, recipe, None, None, step, ran)
                grads = Fp4Matmul.backward(ctx, go)[:2]
            else:
                out = _Float8Matmul.forward(ctx, x, w, recipe, ran, None, None)
                grads = _Float8Matmul.backward(ctx, go)[:2]
        return ran, ops.calls, [(tuple(t.shape), t.dtype) for t in (out, *grads)]


def _gemm_shaped(calls: list[SimpleNamespace], m: int, k: int, n: int) -> list[SimpleNamespace]:
    """The high-precision GEMMs whose result has one of the three GEMMs' shapes."""
    return [c for c in calls if c.op == "aten.mm.default" and c.out[0] in {(m, n), (m, k), (n, k)}]


def _row_major(shape_stride_dtype: tuple) -> bool:
    (_, cols), (s0, s1), _ = shape_stride_dtype
    return s1 == 1 and (s0 >= cols or s0 > s1)


def _col_major(shape_stride_dtype: tuple) -> bool:
    (rows, _), (s0, s1), _ = shape_stride_dtype
    return s0 == 1 and s1 >= rows


@pytest.mark.parametrize("capability", CAPABILITIES, ids=lambda c: f"sm{c[0]}{c[1]}")
@pytest.mark.parametrize("name,m,k,n", CASES, ids=[f"{c[0]}-{c[1]}x{c[2]}x{c[3]}" for c in CASES])
def test_each_gemm_reaches_the_scaled_gemm_where_the_device_has_it(fake_cuda, capability, name, m, k, n):
    fake_cuda.set_capability(capability)
    recipe = _recipe(name)
    for dtype in (torch.bfloat16, torch.float32):
        ran, calls, results = _three_gemms(recipe, m, k, n, dtype)
        assert results == [((m, n), dtype), ((m, k), dtype), ((n, k), dtype)]
        scaled = [c for c in calls if c.op in _SCALED]
        if capability not in NATIVE_AT[name.split("_")[0]]:
            assert ran == "emulate" and scaled == [] and len(_gemm_shaped(calls, m, k, n)) == 3
            continue
        assert ran == "scaled_mm" and _gemm_shaped(calls, m, k, n) == []
        assert len(scaled) == 3, [c.op for c in calls]
        # forward (M, N) over K, input gradient (M, K) over N, weight gradient (N, K) over M
        assert [c.out for c in scaled] == [((m, n), torch.bfloat16), ((m, k), torch.bfloat16),
                                           ((n, k), torch.bfloat16)]
        for c in scaled:
            assert _row_major(c.a) and _col_major(c.b), (c.a, c.b)
        _check_kind(name, scaled, m, k, n)


def _check_kind(name: str, scaled: list[SimpleNamespace], m: int, k: int, n: int) -> None:
    """What each kind's calls hold, beyond what the meta functions checked."""
    contracted = [k, n, m]
    if name == "blockwise":
        assert all(c.op == "aten._scaled_mm_v2.default" for c in scaled)
        assert [c.recipes for c in scaled] == [(["BlockWise1x128"], ["BlockWise128x128"])] * 2 + \
            [(["BlockWise1x128"], ["BlockWise1x128"])]
        for c, kk in zip(scaled, contracted):
            assert c.a[2] == c.b[2] == torch.float8_e4m3fn
            assert c.a[0][1] == -(-kk // 128) * 128  # the contracted dimension padded to 128
            assert all(s[0] == torch.float32 for s in c.scales)
    elif name == "mxfp8":
        for c, kk in zip(scaled, contracted):
            assert c.op == "aten._scaled_mm_v2.default" and c.recipes == (["BlockWise1x32"], ["BlockWise1x32"])
            assert c.swizzles == (["SWIZZLE_32_4_4"], ["SWIZZLE_32_4_4"])
            assert c.a[0][1] == -(-kk // 32) * 32
            assert all(s[0] == torch.float8_e8m0fnu for s in c.scales)
    elif name == "mxfp4":
        for c, kk in zip(scaled, contracted):
            assert c.op == "aten._scaled_mm.default"
            assert c.a[2] == c.b[2] == torch.float4_e2m1fn_x2
            assert c.a[0][1] * 2 == -(-kk // 32) * 32  # packed: two codes a byte
            assert all(s[0] == torch.float8_e8m0fnu for s in c.scales)
    else:  # nvfp4: two-level scaling, e4m3 block scales (swizzled) and the fp32 tensor scale
        for c, kk in zip(scaled, contracted):
            assert c.op == "aten._scaled_mm_v2.default"
            assert c.recipes == (["BlockWise1x16", "TensorWise"], ["BlockWise1x16", "TensorWise"])
            assert c.swizzles == (["SWIZZLE_32_4_4", "NO_SWIZZLE"], ["SWIZZLE_32_4_4", "NO_SWIZZLE"])
            assert c.a[2] == c.b[2] == torch.float4_e2m1fn_x2
            assert c.a[0][1] * 2 == -(-kk // 32) * 32
            assert [s[0] for s in c.scales] == [torch.float8_e4m3fn, torch.float32] * 2


@pytest.mark.parametrize("name", RECIPES)
def test_scaled_mm_where_the_device_lacks_it_names_what_is_missing(fake_cuda, name):
    recipe = fp8.as_recipe(name)
    for capability in CAPABILITIES:
        if capability in NATIVE_AT[name]:
            continue
        fake_cuda.set_capability(capability)
        with pytest.raises(ValueError, match=rf"compute capability .*this device has {capability[0]}\.{capability[1]}"):
            _three_gemms(recipe, 32, 128, 128, torch.bfloat16, backend="scaled_mm")
    with fake_mode():  # on the CPU
        x, w = torch.randn(4, 128), torch.randn(128, 128)
        with pytest.raises(ValueError, match="needs a CUDA device"):
            fp8.linear(x, w, recipe=recipe, backend="scaled_mm")


def test_the_emulation_says_so_once(fake_cuda, caplog, monkeypatch):
    """One warning on the ``mixprec`` logger per recipe and reason (on a GPU), not one per call."""
    monkeypatch.setattr(_native_gemm, "_SAID", set())
    fake_cuda.set_capability((9, 0))
    with caplog.at_level(logging.INFO, logger="mixprec"):
        for _ in range(3):
            _three_gemms(fp8.as_recipe("mxfp8"), 32, 128, 128, torch.bfloat16)
            _three_gemms(fp8.as_recipe("blockwise"), 32, 128, 128, torch.bfloat16)
        for m in (17, 33, 40):  # tensorwise with token counts off 16: one reason, said once
            _three_gemms(fp8.as_recipe("tensorwise"), m, 128, 128, torch.bfloat16)
    said = [r for r in caplog.records if "runs emulated" in r.getMessage()]
    assert len(said) == 2 and {r.levelno for r in said} == {logging.WARNING}
    assert "'mxfp8'" in said[0].getMessage() and "10.0 or newer (sm100)" in said[0].getMessage()
    assert "'tensorwise'" in said[1].getMessage() and "multiple of 16 (tokens, out, in = 17" in said[1].getMessage()


def test_a_torch_without_the_scaled_gemm_is_named(fake_cuda, monkeypatch):
    fake_cuda.set_capability((10, 0))
    monkeypatch.delattr(F, "scaled_mm")
    with pytest.raises(ValueError, match="torch.nn.functional.scaled_mm"):
        _three_gemms(fp8.as_recipe("mxfp8"), 32, 128, 128, torch.bfloat16, backend="scaled_mm")


@pytest.mark.parametrize("capability,expected", [((9, 0), "emulated"), ((10, 0), "scaled_mm")])
def test_stats_show_the_backend_per_layer(fake_cuda, capability, expected):
    """``fp8.stats`` says how each layer's GEMMs ran (the forward runs; backward cannot here)."""
    fake_cuda.set_capability(capability)
    with fake_mode(), torch.no_grad():
        state = fp8.LayerState(device="cuda")
        x, w = torch.randn(32, 128, device="cuda"), torch.randn(64, 128, device="cuda")
        fp8.linear(x, w, recipe=fp8.as_recipe("mxfp8"), state=state)
    assert state.backend == expected
    with torch.no_grad():
        cpu = fp8.LayerState()
        fp8.linear(torch.randn(4, 32), torch.randn(32, 32), recipe=fp8.as_recipe("mxfp8"), state=cpu)
    table = fp8.stats({"cpu": cpu})
    assert {r["backend"] for r in table.to_list()} == {"emulated"}
    head, row = (line.split() for line in str(table).splitlines()[:2])
    assert row[head.index("backend")] == "emulated"
    assert fp8.stats({"new": fp8.LayerState()}).to_list()[0]["backend"] is None


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", RECIPES)
def test_native_gemms_agree_with_the_emulation_on_a_gpu(name):
    """On a real GPU that has the recipe's scaled GEMM: output and both gradients within bf16
    rounding and accumulation order of the emulation (the same casts; tests/fp8/
    test_native_gemm_reference.py proves the layouts bitwise on the CPU)."""
    recipe = fp8.as_recipe(name)
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(200, 256, device="cuda", generator=g).bfloat16()
    w = (torch.randn(128, 256, device="cuda", generator=g) / 16).bfloat16()
    gap = _native_gemm.missing(recipe, x, w)
    if gap is not None:
        pytest.skip(f"this device lacks {gap}")
    results = {}
    for backend in ("scaled_mm", "emulate"):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        state = fp8.LayerState("cuda")
        y = fp8.linear(xi, wi, recipe=recipe, state=state, backend=backend)
        y.backward(torch.ones_like(y))
        results[backend] = (y.detach(), xi.grad, wi.grad)
        assert state.backend == ("scaled_mm" if backend == "scaled_mm" else "emulated")
    for native, emulated in zip(results["scaled_mm"], results["emulate"]):
        diff = torch.linalg.vector_norm((native - emulated).float()) / torch.linalg.vector_norm(emulated.float())
        assert float(diff) < 2 ** -6, name


@pytest.mark.parametrize("name,capability", [("blockwise", (9, 0)), ("mxfp8", (10, 0)), ("mxfp4", (10, 0)),
                                             ("nvfp4", (10, 0))])
def test_policy_layers_reach_the_scaled_gemm_without_host_reads(fake_cuda, name, capability):
    """``Policy.fp8(recipe)`` on a CUDA model: the selected layers' forward GEMMs (first and last
    kept) reach the scaled GEMM, with no host read (no sync) on the way: casts, padding, swizzle."""
    fake_cuda.set_capability(capability)
    policy = mixprec.Policy.parse("compute=bf16").fp8(name)

    def mlp() -> nn.Module:
        return nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256),
                             nn.ReLU(), nn.Linear(256, 128))

    with fake_mode(), torch.no_grad(), HostReads() as reads:
        model = cuda_module(mlp)
        with Ops() as ops, mixprec.autocast("cuda", policy=policy):
            out = model(torch.randn(33, 128, device="cuda"))
        states = fp8.layer_states(model)
    assert reads.count == 0, reads.sites
    assert out.dtype == torch.bfloat16 and out.shape == (33, 128)
    assert len([c for c in ops.calls if c.op in _SCALED]) == 2
    assert {n: s.backend for n, s in states.items()} == {"2": "scaled_mm", "4": "scaled_mm"}
