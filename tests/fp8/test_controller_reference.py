"""``Controller(reference=...)``: the GEMMs the loss costs take their errors against run from
float32 operands or from bfloat16 ones accumulated in float32 (``"auto"``: bfloat16 for a layer
computing in bfloat16 where the device multiplies it natively); the costs they give agree within
bfloat16's rounding, and the setting is refused where it would take no effect."""

from __future__ import annotations

import contextlib
import functools
import importlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from mixprec.control import _reference
from mixprec.control._cost import output_errors
from mixprec.control._reference import emulation_backend, operand_dtype, reference_dtype, reference_linear, reference_mm

from _fake_cuda import fake_cuda, fake_mode  # noqa: F401

LADDER = ("nvfp4", "tensorwise", "rowwise", "compute")
NVFP4 = mixprec.fp8.Float8Recipe.from_name("nvfp4")


def test_the_setting_is_checked_and_needs_a_loss_cost():
    with pytest.raises(ValueError, match="reference must be one of"):
        mixprec.Controller(max_loss_cost=1e-3, reference="fp16")
    with pytest.raises(ValueError, match="takes effect with max_loss_cost or max_backward_cost"):
        mixprec.Controller(reference="float32")
    s = mixprec.ControllerSettings(max_loss_cost=1e-3, reference="bfloat16")
    assert mixprec.ControllerSettings.from_dict(s.to_dict()) == s and s.changed() == {
        "max_loss_cost": 1e-3, "reference": "bfloat16"}


@pytest.mark.parametrize("avx512_bf16, amx, isa, native", [
    (True, False, None, True), (False, True, None, True), (False, False, None, False),
    (True, False, "AVX2", False), (True, True, "AVX512_CORE", False), (True, False, "AVX512_CORE_BF16", True),
    (False, True, "avx512_core_amx", True), (True, False, "ALL", True)])
def test_auto_takes_bfloat16_where_the_cpu_multiplies_it_natively(monkeypatch, avx512_bf16, amx, isa, native):
    """The CPU's flags, unless ``ONEDNN_MAX_CPU_ISA`` holds oneDNN below them (where a bfloat16
    GEMM is emulated, 2-5x a float32 one)."""
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    if isa is None:
        monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    else:
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", isa)
    cpu = torch.device("cpu")
    auto = reference_dtype("auto", cpu)
    assert auto == (None if native else torch.float32)
    # bfloat16 for a layer computing in bfloat16 only: a float32 or float16 model keeps float32
    assert [operand_dtype(auto, d) for d in (torch.bfloat16, torch.float32, torch.float16)] == [
        torch.bfloat16 if native else torch.float32, torch.float32, torch.float32]
    assert (reference_dtype("float32", cpu), reference_dtype("bfloat16", cpu)) == (torch.float32, torch.bfloat16)
    assert operand_dtype(torch.bfloat16, torch.float32) == torch.bfloat16
    assert reference_dtype("auto", torch.device("meta")) == torch.float32


@pytest.mark.parametrize("capability, dtype", [((7, 5), torch.float32), ((8, 0), torch.bfloat16),
                                               ((9, 0), torch.bfloat16)])
def test_auto_on_cuda_takes_bfloat16_from_sm80_and_multiplies_into_float32(fake_cuda, capability, dtype):
    fake_cuda.set_capability(capability)
    assert operand_dtype(reference_dtype("auto", torch.device("cuda")), torch.bfloat16) == dtype
    with fake_mode():
        x, w = torch.randn(32, 64, device="cuda"), torch.randn(48, 64, device="cuda")
        out = reference_linear(x, w, torch.randn(48, device="cuda"), torch.bfloat16)
        mm = reference_mm(x, w.t(), torch.bfloat16)
    assert (out.shape, out.dtype, mm.dtype, out.device.type) == ((32, 48), torch.float32, torch.float32, "cuda")


def test_float32_is_the_float32_linear_and_bfloat16_its_operands_rounded():
    torch.manual_seed(0)
    x, w, b = torch.randn(2, 24, 64, dtype=torch.bfloat16), torch.randn(48, 64), torch.randn(48)
    exact = F.linear(x.float(), w, b)
    assert torch.equal(reference_linear(x, w, b), exact)
    assert torch.equal(reference_linear(x, w, None, torch.float32), F.linear(x.float(), w))
    rounded = reference_linear(x, w, b, torch.bfloat16)
    # from bfloat16 operands: the weight's rounding (2**-9 of each element) moves the result,
    # a cast's error (NVFP4: up to 2**-3 of a block's scale) moves it 30-60x more
    assert rounded.dtype == torch.float32 and rounded.shape == exact.shape and not torch.equal(rounded, exact)
    expected = F.linear(x.float(), w.bfloat16().float(), b)
    assert (rounded - expected).abs().max() <= 2 ** -8 * expected.abs().max()
    nvfp4 = (mixprec.fp8.linear(x, w, b, recipe=NVFP4, backend="emulate_fp32").float() - exact).norm()
    assert (rounded - exact).norm() * 30 < nvfp4


def _run(reference: str, steps: int = 5, compute: str = "bf16", limit: float = 10.0) -> mixprec.Controller:
    """Five steps (one window, its shadow steps 3 and 4) of a 3-layer MLP under a per-GEMM NVFP4
    Controller whose limits no cost reaches (the same casts and draws for every reference; every
    cost reaches a ``limit`` of 1e-9), computing in ``compute``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 16))
    ctl = mixprec.Controller(every=5, ladder=LADDER, per_gemm=True, max_loss_cost=limit, max_backward_cost=limit,
                             reference=reference)
    ctl.attach(model)
    if compute == "fp32":  # (no autocast: the layers converted)
        model = mixprec.fp8.convert(model, "nvfp4", filter_fn=lambda m, name: True, controller=ctl,
                                    backend="emulate_fp32")
        region = contextlib.nullcontext
    else:
        policy = mixprec.Policy.parse(f"compute={compute}").fp8("nvfp4", first_last="fp8", controller=ctl.settings,
                                                                 backend="emulate_fp32")
        region = functools.partial(mixprec.autocast, "cpu", policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        with region():
            out = model(torch.randn(64, 64, generator=gen)).float()
        (out - torch.randn(64, 16, generator=gen)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        if _ < steps - 1:
            ctl.step()
    return ctl


def test_the_costs_from_bfloat16_operands_agree_with_float32s():
    """The same run measured against both references (its window not yet checked): the forward
    loss costs' squared terms within 2% and their first-order sums within 5% of those sums' noise,
    the backward GEMMs' terms within 2%, and they differ (the setting took effect)."""
    runs = {ref: _run(ref) for ref in ("float32", "bfloat16")}
    for name in ("0", "2", "4"):
        exact, rounded = (runs[r]._layers[name] for r in ("float32", "bfloat16"))
        assert (exact.reference, rounded.reference) == (torch.float32, torch.bfloat16)
        assert rounded.backward.reference == torch.bfloat16
        measured = exact.cost[:, 4] > 0
        assert measured.any() and torch.equal(measured, rounded.cost[:, 4] > 0)
        (first, squares, rows), (first_b, squares_b, _) = (c[measured, :3].t() for c in (exact.cost, rounded.cost))
        torch.testing.assert_close(squares_b, squares, rtol=2e-2, atol=0)
        # the first-order sum (of signed per-row terms) moves by a few percent of its own noise
        assert ((first_b - first).abs() <= 0.05 * (rows * squares).sqrt()).all()
        assert not torch.equal(exact.cost, rounded.cost)
        terms = exact.backward.window, rounded.backward.window
        assert torch.equal(terms[0][..., -1], terms[1][..., -1]) and terms[0][..., -1].sum() > 0
        torch.testing.assert_close(terms[1], terms[0], rtol=2e-2, atol=1e-6 * float(terms[0].abs().max()))


def test_output_errors_take_the_records_reference():
    """:func:`output_errors` of one layer against either reference: the own casts' error moves
    by the reference's rounding only."""
    ctl = _run("bfloat16", steps=1)
    rec = ctl._layers["2"]
    torch.manual_seed(2)
    x, w = torch.randn(64, 64, dtype=torch.bfloat16), torch.randn(64, 64)
    out = mixprec.fp8.linear(x, w, None, recipe=NVFP4, backend="emulate_fp32").requires_grad_()
    rounded = dict(output_errors(rec, x, w, None, out, (True, False)))[0]
    rec.reference = torch.float32
    exact = dict(output_errors(rec, x, w, None, out, (True, False)))[0]
    assert not torch.equal(rounded, exact)
    assert (rounded.float() - exact.float()).norm() < 0.05 * exact.float().norm()


@pytest.mark.parametrize("reference, out_dtype, reference_gemm", [
    (torch.bfloat16, torch.bfloat16, False), (torch.float32, torch.float32, False),
    (torch.bfloat16, torch.float32, False), (torch.float32, torch.bfloat16, True)])
def test_a_forward_without_casts_is_its_own_reference(monkeypatch, reference, out_dtype, reference_gemm):
    """A promoted forward on the compute dtype (or float32) measures the rung below against its
    own output, with no reference GEMM, where that output is at least as precise as the
    reference (a bfloat16 output against bfloat16 operands, a float32 one against either): the
    error is what a demotion would change the output by. A bfloat16 output against a float32
    reference takes the reference GEMM."""
    rec = _run("bfloat16", steps=1)._layers["2"]
    calls = []
    monkeypatch.setattr("mixprec.control._cost.reference_linear",
                        lambda *args: calls.append(args[-1]) or reference_linear(*args))
    rec.forward_low, rec.forward_below, rec.reference = False, NVFP4, reference
    torch.manual_seed(3)
    x, w, b = torch.randn(64, 64, dtype=torch.bfloat16), torch.randn(48, 64), torch.randn(48)
    out = F.linear(x.to(out_dtype), w.to(out_dtype), b.to(out_dtype)).requires_grad_()
    errors = dict(output_errors(rec, x, w, b, out))
    assert list(errors) == [1] and errors[1].dtype == out_dtype
    emulated = mixprec.fp8.linear(x, w, b, recipe=NVFP4, backend=emulation_backend(operand_dtype(reference, x.dtype)))
    emulated = emulated.float()
    against = reference_linear(x, w, b, operand_dtype(reference, x.dtype)) if reference_gemm else out.detach().float()
    assert calls == ([operand_dtype(reference, x.dtype)] if reference_gemm else [])
    assert torch.equal(errors[1], (emulated - against).to(out_dtype))


@pytest.mark.parametrize("reference", ["bfloat16", "float32"])
def test_the_rung_below_is_emulated_in_the_references_operands(monkeypatch, reference):
    """GEMMs promoted at the first check (limits of 1e-9; a forward on one check over its limit,
    ``OVER_WINDOWS`` 1 here): the next window emulates the rung below's forward and backward GEMMs
    with the backend of the reference's operands (bfloat16: NVFP4 multiplied in bfloat16; float32:
    in float32)."""
    monkeypatch.setattr("mixprec.control._decide.OVER_WINDOWS", 1)
    seen = []
    for module, name, at in (("_backward", "linear_grads", 5), ("_cost", "local_linear", 4)):
        original = getattr(importlib.import_module(f"mixprec.control.{module}"), name)
        monkeypatch.setattr(f"mixprec.control.{module}.{name}",
                            functools.partial(_spied, original, lambda args, n=name, i=at: seen.append((n, args[i]))))
    _run(reference, steps=10, limit=1e-9)
    expected = emulation_backend(torch.bfloat16 if reference == "bfloat16" else torch.float32)
    assert {n for n, _ in seen} == {"linear_grads", "local_linear"} and {b for _, b in seen} == {expected}, seen


def _spied(original, note, *args):
    note(args)
    return original(*args)


@pytest.mark.parametrize("reference, native, compute, expected", [
    ("bfloat16", False, "bf16", torch.bfloat16), ("float32", True, "bf16", torch.float32),
    ("auto", True, "bf16", torch.bfloat16), ("auto", False, "bf16", torch.float32),
    ("auto", True, "fp32", torch.float32), ("bfloat16", False, "fp32", torch.bfloat16)])
def test_every_measurement_takes_the_reference_the_settings_and_compute_give(monkeypatch, reference, native, compute,
                                                                             expected):
    """The GEMMs of every measurement (forward, backward results, projections, end slope) go
    through :func:`reference_mm` in one dtype: the setting's, or under ``"auto"`` bfloat16 for a
    bfloat16 model on a device that multiplies it natively and float32 for a float32 model."""
    calls = []
    mm = _reference.reference_mm

    def counted(a, b, dtype=torch.float32):
        calls.append(dtype)
        return mm(a, b, dtype)

    for module in ("mixprec.control._backward", "mixprec.control._update_error", "mixprec.control._reference"):
        monkeypatch.setattr(f"{module}.reference_mm", counted)
    monkeypatch.setattr(_reference, "_native_bfloat16", lambda device: native)
    _run(reference, steps=6, compute=compute)
    assert len(calls) >= 8 and set(calls) == {expected}, calls
