"""The experts' grouped GEMMs on torch's grouped scaled GEMM (formats/_grouped_native.py).

On fake CUDA devices of compute capability 8.9, 9.0 and 10.0, the three grouped GEMMs of
``grouped_linear`` (forward, input gradient, weight gradient) run under a ``TorchDispatchMode``
that records every aten op: for the rowwise recipes on sm90 and sm100, and MXFP8 on sm100, they
reach ``aten._scaled_grouped_mm`` with arguments its meta check accepts (e4m3 operands row- and
column-major, float32 scales per row or swizzled E8M0 scales per expert, int32 offsets, bfloat16
out), awkward token counts included (an expert with no tokens, one with a single row, padding rows
after the last expert). Elsewhere (sm89; MXFP8 on sm90; a recipe torch's grouped kernel does not
take) ``"auto"`` emulates and says so once, and
``backend="scaled_mm"`` is a ValueError naming what is missing. Autograd cannot run on fake CUDA
tensors: the backward runs by calling the autograd function's ``backward`` with a stand-in context.

On the CPU, the native code path with ``torch._scaled_grouped_mm`` replaced by a reference (the
operands it was given, dequantized by the scales it was given, read back from their layout, and
multiplied group by group) equals the emulation bitwise: output, input gradient, weight gradient,
with experts in fallback and a Controller rung of another recipe among the native ones.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mixprec import fp8
from mixprec.formats import _native_gemm
from mixprec.formats._grouped import _FP32, _GroupedMatmul
from mixprec.formats._grouped_native import resolve_grouped
from mixprec.formats._swizzle import blocked_numel, from_blocked

from _fake_cuda import fake_cuda, fake_mode  # noqa: F401

CAPABILITIES = [(8, 9), (9, 0), (10, 0)]
#: where each recipe's experts run natively
NATIVE_AT = {"rowwise": {(9, 0), (10, 0)}, "rowwise_with_gw_hp": {(9, 0), (10, 0)}, "mxfp8": {(10, 0)},
             "tensorwise": set()}
#: tokens per expert: one with none, one with a single row; then two padding rows
COUNTS = [5, 0, 1, 26]
PAD = 2
K, N = 64, 96
_GROUPED = "aten._scaled_grouped_mm.default"


class Ops(TorchDispatchMode):
    """Records each grouped GEMM that runs and what it was given."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[SimpleNamespace] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)  # (the fake mode below runs the meta checks)
        name = str(func)
        if name in (_GROUPED, "aten._grouped_mm.default", "aten.mm.default"):
            a, b = args[0], args[1]
            call = SimpleNamespace(op=name, a=(tuple(a.shape), a.stride(), a.dtype),
                                   b=(tuple(b.shape), b.stride(), b.dtype), out=(tuple(out.shape), out.dtype))
            if name == _GROUPED:
                call.scales = [(s.dtype, tuple(s.shape), s.is_contiguous()) for s in args[2:4]]
                offs = kwargs.get("offs", args[4] if len(args) > 4 else None)
                call.offs = (offs.dtype, tuple(offs.shape))
            self.calls.append(call)
        return out


class _Ctx(SimpleNamespace):
    needs_input_grad = (True, True)

    def save_for_backward(self, *tensors: torch.Tensor) -> None:
        self.saved_tensors = tensors


def _bounds() -> list[int]:
    bounds = [0]
    for c in COUNTS:
        bounds.append(bounds[-1] + c)
    return bounds


def _three(x, w, go, plans, backend):
    """Output, input gradient and weight gradient of ``_GroupedMatmul`` (forward and backward called directly)."""
    ctx, e = _Ctx(), len(plans)
    out = _GroupedMatmul.forward(ctx, x, w, _bounds(), tuple(plans), (None,) * e, (None,) * e, (None,) * e, backend)
    return [out, *_GroupedMatmul.backward(ctx, go)[:2]]


def _fake_run(name: str, dtype: torch.dtype, backend: str = "auto"):
    recipe = fp8.as_recipe(name)
    with fake_mode(), torch.no_grad():
        t = sum(COUNTS)
        x = torch.randn(t + PAD, K, device="cuda", dtype=dtype)
        w = torch.randn(len(COUNTS), N, K, device="cuda", dtype=dtype)
        go = torch.randn(t, N, device="cuda", dtype=dtype)
        ran = resolve_grouped(backend, x, w, recipe)
        with Ops() as ops:
            results = _three(x, w, go, [recipe] * len(COUNTS), ran)
    return ran, ops.calls, [(tuple(r.shape), r.dtype) for r in results]


def _row_major(a) -> bool:
    (_, cols), (s0, s1), _ = a[0][-2:], a[1][-2:], a[2]
    return s1 == 1 and s0 > 1 and s0 % 16 == 0


def _col_major(b) -> bool:
    (rows, _), (s0, s1) = b[0][-2:], b[1][-2:]
    return s0 == 1 and s1 > 1 and s1 % 16 == 0


@pytest.mark.parametrize("capability", CAPABILITIES, ids=lambda c: f"sm{c[0]}{c[1]}")
@pytest.mark.parametrize("name", ["rowwise", "rowwise_with_gw_hp", "tensorwise", "mxfp8"])
def test_each_grouped_gemm_reaches_the_scaled_grouped_gemm_where_the_device_has_it(fake_cuda, capability, name):
    fake_cuda.set_capability(capability)
    e, t = len(COUNTS), sum(COUNTS)
    for dtype in (torch.bfloat16, torch.float32):
        ran, calls, results = _fake_run(name, dtype)
        assert results == [((t, N), dtype), ((t + PAD, K), dtype), ((e, N, K), dtype)]
        scaled = [c for c in calls if c.op == _GROUPED]
        if capability not in NATIVE_AT[name]:
            assert ran == "emulate" and scaled == []
            continue
        assert ran == "scaled_mm"
        # forward [t, N] over K, input gradient [t, K] over N; the weight gradient [E, N, K] over the tokens
        want = [((t, N), torch.bfloat16), ((t, K), torch.bfloat16)]
        if name != "rowwise_with_gw_hp":
            want.append(((e, N, K), torch.bfloat16))
        assert [c.out for c in scaled] == want, [c.op for c in calls]
        hp = [c for c in calls if c.op != _GROUPED]
        if name == "mxfp8":
            _check_mxfp8(scaled, hp)
            continue
        if name == "rowwise":
            assert hp == []  # no high-precision GEMM runs
        else:  # the weight gradient in high precision: one grouped GEMM (bf16) or one mm per expert
            assert all(c.out[0] in {(e, N, K), (N, K)} for c in hp) and hp
        fwd, gi = scaled[:2]
        assert fwd.a == ((t, K), (K, 1), torch.float8_e4m3fn) and fwd.b[0] == (e, K, N) and _col_major(fwd.b)
        assert gi.a == ((t, N), (N, 1), torch.float8_e4m3fn) and gi.b[0] == (e, N, K) and _col_major(gi.b)
        assert fwd.scales == [(torch.float32, (t,), True), (torch.float32, (e, N), True)]
        assert gi.scales == [(torch.float32, (t,), True), (torch.float32, (e, K), True)]
        if name == "rowwise":
            gw = scaled[2]
            padded = sum(-(-c // 16) * 16 for c in COUNTS)  # each expert's tokens padded to 16
            assert gw.a == ((N, padded), (padded, 1), torch.float8_e4m3fn)
            assert gw.b[0] == (padded, K) and _col_major(gw.b)
            assert gw.scales == [(torch.float32, (e * N,), True), (torch.float32, (e * K,), True)]
        for c in scaled:
            assert c.offs == (torch.int32, (e,)) and _row_major(c.a)


def _tiles(rows: int, blocks: int) -> int:
    """The swizzled scales of ``[rows, blocks]``: whole 128x4 tiles."""
    return -(-rows // 128) * 128 * -(-blocks // 4) * 4


def _check_mxfp8(scaled: list[SimpleNamespace], hp: list[SimpleNamespace]) -> None:
    """MXFP8: E8M0 scales swizzled per expert, laid out as torchao's grouped GEMM does."""
    e, t = len(COUNTS), sum(COUNTS)
    assert hp == []
    fwd, gi, gw = scaled
    e8m0 = torch.float8_e8m0fnu
    rows = sum(-(-c // 128) * 128 for c in COUNTS)  # each expert's rows padded to a 128-row tile
    assert fwd.a == ((t, K), (K, 1), torch.float8_e4m3fn) and _col_major(fwd.b)
    assert fwd.scales == [(e8m0, (rows, 4), True), (e8m0, (e, _tiles(N, K // 32)), True)]
    assert gi.scales == [(e8m0, (rows, 4), True), (e8m0, (e, _tiles(K, N // 32)), True)]
    padded = sum(-(-c // 32) * 32 for c in COUNTS)  # each expert's tokens padded to whole blocks
    assert gw.a == ((N, padded), (padded, 1), torch.float8_e4m3fn) and gw.b[0] == (padded, K) and _col_major(gw.b)
    cols = sum(-(-c // 128) * 4 for c in COUNTS)  # per expert: its blocks padded to 4 (one tile column)
    assert gw.scales == [(e8m0, (128, cols), True), (e8m0, (128, cols), True)]
    for c in scaled:
        assert c.offs == (torch.int32, (e,)) and _row_major(c.a)


@pytest.mark.parametrize("name,capability,words", [
    ("rowwise", (8, 9), r"rowwise grouped GEMMs compute capability 9\.0 or 10\.x .*this device has 8\.9"),
    ("tensorwise", (9, 0), r"e4m3 operands .*the grad_input GEMM casts e5m2"),
    ("mxfp8", (9, 0), r"mxfp8 grouped GEMMs compute capability 10\.x \(sm100\); this device has 9\.0"),
    ("blockwise", (9, 0), r"or MXFP8 blocks \(the output GEMM casts e4m3fn 1x128"),
])
def test_scaled_mm_where_it_cannot_run_names_what_is_missing(fake_cuda, name, capability, words):
    fake_cuda.set_capability(capability)
    with pytest.raises(ValueError, match=words):
        _fake_run(name, torch.bfloat16, backend="scaled_mm")


def test_features_off_16_and_the_cpu_are_named(fake_cuda):
    recipe = fp8.as_recipe("rowwise")
    with fake_mode():
        x, w = torch.randn(8, 40, device="cuda"), torch.randn(2, 16, 40, device="cuda")
        with pytest.raises(ValueError, match=r"multiples of 16 \(out, in = 16, 40\)"):
            resolve_grouped("scaled_mm", x, w, recipe)
    with pytest.raises(ValueError, match="a CUDA device of compute capability 9.0 or 10.x .* on cpu"):
        fp8.grouped_linear(torch.randn(4, 32), torch.randn(2, 16, 32), torch.tensor([1, 4]), recipe,
                           backend="scaled_mm")


def test_the_emulation_says_so_once(fake_cuda, caplog, monkeypatch):
    monkeypatch.setattr(_native_gemm, "_SAID", set())
    fake_cuda.set_capability((8, 9))
    with caplog.at_level(logging.INFO, logger="mixprec"):
        for _ in range(3):
            assert _fake_run("rowwise", torch.bfloat16)[0] == "emulate"
    said = [r for r in caplog.records if "experts' rowwise grouped GEMMs" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING and "'rowwise'" in said[0].getMessage()


# ------------------------------------------------------------------ the CPU: the native path's math
class Reference:
    """``torch._scaled_grouped_mm`` as the emulation computes it: each group's operands dequantized
    by the inverse scales given, multiplied in float32, written in bfloat16. Checks what the
    kernel needs beyond the meta check: each group's tokens 16-aligned in the weight gradient.
    A group with nothing to contract gets NaN: the caller may not assume the kernel zeroes it."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __call__(self, mat_a, mat_b, scale_a, scale_b, offs=None, bias=None, scale_result=None,
                 out_dtype=None, use_fast_accum=False):
        assert mat_a.dtype == mat_b.dtype == torch.float8_e4m3fn and out_dtype == torch.bfloat16
        assert mat_a.stride(-1) == 1 and mat_b.stride(-2) == 1 and offs.dtype == torch.int32
        ends = [0, *offs.tolist()]
        if scale_a.dtype == torch.float8_e8m0fnu:
            return self._mxfp8(mat_a, mat_b, scale_a, scale_b, ends)
        a = mat_a.float()
        if mat_b.dim() == 3:  # jagged rows
            self.calls.append("rows")
            b = mat_b.float() * scale_b[:, None, :]
            a = a * scale_a[:, None]
            return torch.cat([a[s:t] @ b[e] for e, (s, t) in enumerate(zip(ends, ends[1:]))]).bfloat16()
        self.calls.append("jagged")
        n, k = mat_a.shape[0], mat_b.shape[1]
        assert all(t % 16 == 0 for t in ends)
        outs = []
        for e, (s, t) in enumerate(zip(ends, ends[1:])):
            ae = a[:, s:t] * scale_a[e * n:(e + 1) * n, None]
            be = mat_b[s:t].float() * scale_b[e * k:(e + 1) * k][None, :]
            outs.append(ae @ be if t > s else torch.full((n, k), float("nan")))
        return torch.stack(outs).bfloat16()


    def _mxfp8(self, mat_a, mat_b, scale_a, scale_b, ends):
        """MXFP8: each group's scales read back from torchao's layout (``from_blocked``), the
        operands dequantized in bfloat16 (as the emulation's MX GEMMs) and multiplied group by group."""
        flat_a, flat_b = scale_a.reshape(-1), scale_b.reshape(-1) if scale_b.dim() == 2 else scale_b
        outs, at = [], 0
        if mat_b.dim() == 3:  # jagged rows: A's groups of round_up(rows, 128) rows; B's one row of tiles each
            self.calls.append("mx-rows")
            k = mat_a.shape[1]
            for e, (s, t) in enumerate(zip(ends, ends[1:])):
                size = blocked_numel(t - s, k // 32)
                sa = from_blocked(flat_a[at:at + size], t - s, k // 32)
                at += size
                sb = from_blocked(scale_b[e], mat_b.shape[2], k // 32)
                outs.append(_deq(mat_a[s:t], sa) @ _deq(mat_b[e].t(), sb).t())
            assert at == flat_a.numel()
            return torch.cat(outs)
        self.calls.append("mx-jagged")  # the tokens jagged: each group's tiles one after another
        n, k = mat_a.shape[0], mat_b.shape[1]
        assert all(t % 32 == 0 for t in ends)
        bt = 0
        for s, t in zip(ends, ends[1:]):
            blocks = (t - s) // 32
            sa = from_blocked(flat_a[at:at + blocked_numel(n, blocks)], n, blocks)
            sb = from_blocked(scale_b.reshape(-1)[bt:bt + blocked_numel(k, blocks)], k, blocks)
            at, bt = at + blocked_numel(n, blocks), bt + blocked_numel(k, blocks)
            outs.append(_deq(mat_a[:, s:t], sa) @ _deq(mat_b[s:t].t(), sb).t() if t > s
                        else torch.full((n, k), float("nan"), dtype=torch.bfloat16))
        return torch.stack(outs)


def _deq(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``q`` (``[rows, K]``, e4m3) times its ``1x32`` block scales, in bfloat16."""
    return (q.float() * scales.float().repeat_interleave(32, dim=1)[:, :q.shape[1]]).bfloat16()


def _data(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    t = sum(COUNTS)
    x = (torch.randn(t + PAD, K, generator=g) * torch.logspace(-3, 3, K)[torch.randperm(K, generator=g)]).bfloat16()
    w = (torch.randn(len(COUNTS), N, K, generator=g) / K ** 0.5).bfloat16()
    go = (torch.randn(t, N, generator=g) * 1e-4).bfloat16()
    return x, w, go


@pytest.mark.parametrize("mix", ["all", "fallback", "rung"])
@pytest.mark.parametrize("name", ["rowwise", "rowwise_with_gw_hp", "mxfp8"])
def test_native_path_with_a_reference_kernel_is_the_emulation_bitwise(monkeypatch, name, mix):
    recipe = fp8.as_recipe(name)
    plans = [recipe] * len(COUNTS)
    if mix == "fallback":  # expert 0 in the compute dtype, expert 3 on the fp32 rung
        plans[0], plans[3] = None, _FP32
    elif mix == "rung":  # a Controller rung whose e5m2 gradients torch's grouped kernel does not take
        plans[3] = fp8.as_recipe("tensorwise")
    x, w, go = _data()
    with torch.no_grad():
        expected = _three(x, w, go, plans, "emulate")
        ref = Reference()
        monkeypatch.setattr(torch, "_scaled_grouped_mm", ref)
        got = _three(x, w, go, plans, "scaled_mm")
    assert any(p is recipe and c for p, c in zip(plans, COUNTS))
    want = {"rowwise": ["rows", "rows", "jagged"], "rowwise_with_gw_hp": ["rows", "rows"],
            "mxfp8": ["mx-rows", "mx-rows", "mx-jagged"]}
    if name == "mxfp8" and mix == "rung":  # the tensorwise rung's forward: e4m3, on the rowwise kernel beside
        want[name] = ["rows", "mx-rows", "mx-rows", "mx-jagged"]
    assert ref.calls == want[name]
    for what, e, g in zip(("output", "grad_input", "grad_weight"), expected, got):
        assert g.dtype == e.dtype == torch.bfloat16 and g.shape == e.shape
        assert torch.equal(g, e), f"{name} {mix} {what}: {(g.float() - e.float()).abs().max()}"


@pytest.mark.parametrize("name", ["rowwise", "mxfp8"])
def test_grouped_linear_runs_native_with_the_reference(monkeypatch, name):
    """Through the public entry: ``backend="scaled_mm"`` resolved (as on sm90/sm100) reaches the
    kernel for all three GEMMs and gives the emulation's bits, gradients through autograd."""
    x, w, go = _data(1)
    offsets = torch.tensor(COUNTS).cumsum(0)
    results = {}
    for backend in ("emulate", "scaled_mm"):
        if backend == "scaled_mm":
            monkeypatch.setattr(torch, "_scaled_grouped_mm", ref := Reference())
            monkeypatch.setattr("mixprec.formats._grouped.resolve_grouped", lambda *a: "scaled_mm")
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        out = fp8.grouped_linear(xr, wr, offsets, fp8.as_recipe(name), backend=backend)
        out[:sum(COUNTS)].backward(go)
        results[backend] = (out, xr.grad, wr.grad)
    assert ref.calls == (["rows", "rows", "jagged"] if name == "rowwise" else ["mx-rows", "mx-rows", "mx-jagged"])
    for e, g in zip(results["emulate"], results["scaled_mm"]):
        assert torch.equal(e, g)
    assert not results["scaled_mm"][1][sum(COUNTS):].any()  # padding rows: no gradient


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", ["rowwise", "mxfp8"])
def test_native_grouped_gemms_agree_with_the_emulation_on_a_gpu(name):
    """On a real GPU that has the kernel: output and both gradients within bf16 rounding and
    accumulation order of the emulation (the same casts; the CPU tests above prove the layouts)."""
    recipe = fp8.as_recipe(name)
    g = torch.Generator(device="cuda").manual_seed(0)
    counts = [37, 0, 1, 90]
    x = torch.randn(sum(counts) + PAD, 256, device="cuda", generator=g).bfloat16()
    w = (torch.randn(len(counts), 128, 256, device="cuda", generator=g) / 16).bfloat16()
    offsets = torch.tensor(counts, device="cuda").cumsum(0)
    try:
        resolve_grouped("scaled_mm", x, w, recipe)
    except ValueError as gap:
        pytest.skip(str(gap))
    results = {}
    for backend in ("scaled_mm", "emulate"):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = fp8.grouped_linear(xi, wi, offsets, recipe, backend=backend)
        y.backward(torch.ones_like(y))
        results[backend] = (y.detach(), xi.grad, wi.grad)
    for native, emulated in zip(results["scaled_mm"], results["emulate"]):
        diff = torch.linalg.vector_norm((native - emulated).float()) / torch.linalg.vector_norm(emulated.float())
        assert float(diff) < 2 ** -6, name
    assert not results["scaled_mm"][2][1].any()  # the expert without tokens: no weight gradient
