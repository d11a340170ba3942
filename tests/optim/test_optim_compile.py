"""mixprec.optim under torch.compile: one graph for every step, no graph break, eager's results.

``torch.compile(opt.step, fullgraph=True)`` traces every deterministic recipe (nearest, Kahan,
exact) on each path: the C++ kernel (default and ``fused=True`` on the CPU) runs inside the
graph as an opaque op, bitwise as in eager; the foreach and per-tensor paths become tensor math
the compiler fuses (step counters as tensors, so later steps reuse the graph), equal to eager
up to the rounding of the bias corrections. Stochastic rounding draws from a ``torch.Generator``,
which Dynamo cannot trace: it graph-breaks there and stays bitwise eager.
"""

import pytest
import torch
import torch._dynamo

from mixprec.optim import SGD, AdamW
from mixprec.optim import _fused
from mixprec.optim.exact import exact_value

SHAPES = [(48, 32), (64,), (7, 3)]
FLAGS = [dict(), dict(fused=True), dict(foreach=True), dict(foreach=False)]
CASES = [(AdamW, dict(lr=1e-2, weight_decay=0.1)), (AdamW, dict(lr=3e-3, amsgrad=True, maximize=True)),
         (SGD, dict(lr=1e-2, momentum=0.9, nesterov=True, weight_decay=1e-3)), (SGD, dict(lr=1e-2))]


pytestmark = pytest.mark.usefixtures("fresh_dynamo")  # tests/conftest.py


def _setup(cls, compensation, flags, kwargs):
    g = torch.Generator().manual_seed(0)
    params = [torch.randn(s, generator=g).bfloat16().requires_grad_() for s in SHAPES]
    opt = cls(params, compensation=compensation, generator=torch.Generator().manual_seed(1), **flags, **kwargs)
    return params, opt


def _train(params, step, steps=4, settled=None):
    """``settled``: from that step on, a recompile is an error (the first step creates the
    optimizer state, so the second one traces once more, as for torch.optim)."""
    for i in range(steps):
        g = torch.Generator().manual_seed(100 + i)
        for p in params:
            p.grad = torch.randn(p.shape, generator=g).bfloat16()
        if settled is not None and i >= settled:
            with torch.compiler.set_stance("fail_on_recompile"):
                step()
        else:
            step()


def _master(opt, p):
    if "low_bits" in opt.state[p]:
        return exact_value(p, opt.state[p]["low_bits"])
    if "kahan_comp" in opt.state[p]:
        return p.float() + opt.state[p]["kahan_comp"].float()
    return p.float()


def _kernel_runs(flags):
    return _fused.native_ops() is not None and "foreach" not in flags


@pytest.mark.parametrize("compensation", ["exact", "kahan", None])
@pytest.mark.parametrize("flags", FLAGS)
@pytest.mark.parametrize("cls,kwargs", CASES)
def test_step_compiles_whole_and_matches_eager(cls, kwargs, flags, compensation):
    params, opt = _setup(cls, compensation, flags, kwargs)
    _train(params, torch.compile(opt.step, backend="aot_eager", fullgraph=True), settled=2)
    ref, ref_opt = _setup(cls, compensation, flags, kwargs)
    _train(ref, ref_opt.step)
    for p, q in zip(params, ref):
        if _kernel_runs(flags):  # the C++ kernel inside the graph
            assert torch.equal(p, q) and torch.equal(_master(opt, p), _master(ref_opt, q))
        else:
            _assert_near(_master(opt, p), _master(ref_opt, q), compensation)
        for key, value in ref_opt.state[q].items():
            assert opt.state[p][key].dtype == value.dtype
            if key in MOMENTS:
                torch.testing.assert_close(opt.state[p][key], value, rtol=1e-4, atol=1e-6)


MOMENTS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer")


def _assert_near(ours, eager, compensation):
    """Compiled foreach/per-tensor masters against eager's. The compiled step computes the bias
    corrections in float32 (1 - 0.999**step loses digits) where eager uses doubles, so steps of
    about lr = 1e-2 agree to about 1e-4 of a step: exact masters within 1e-6; a Kahan master is
    known to its buffer's precision (2**-8 of half a bf16 gap) once the weight rounds the other
    way; a bf16 weight rounded to nearest may land one or two gaps apart."""
    if compensation == "exact":
        torch.testing.assert_close(ours, eager, rtol=2**-20, atol=1e-6)
    elif compensation == "kahan":
        torch.testing.assert_close(ours, eager, rtol=2**-15, atol=1e-6)
    else:
        torch.testing.assert_close(ours, eager, rtol=2**-7, atol=1e-6)


@pytest.mark.parametrize("cls,kwargs", CASES[::2])
def test_stochastic_rounding_breaks_the_graph_and_stays_bitwise(cls, kwargs):
    params, opt = _setup(cls, "stochastic", {}, kwargs)
    _train(params, torch.compile(opt.step, backend="aot_eager"))
    ref, ref_opt = _setup(cls, "stochastic", {}, kwargs)
    _train(ref, ref_opt.step)
    for p, q in zip(params, ref):
        assert torch.equal(p, q)
    assert torch.equal(opt.generator.get_state(), ref_opt.generator.get_state())
    with pytest.raises(torch._dynamo.exc.Unsupported):
        torch._dynamo.reset()
        torch.compile(opt.step, backend="aot_eager", fullgraph=True)()


@pytest.mark.slow
@pytest.mark.parametrize("compensation,flags", [("exact", {}), ("kahan", dict(foreach=True))])
def test_inductor_compiles_the_step(compensation, flags):
    """The real compiler: the kernel as an extern call, or the foreach math fused into C++ loops."""
    params, opt = _setup(AdamW, compensation, flags, dict(lr=1e-2, weight_decay=0.1))
    _train(params, torch.compile(opt.step, fullgraph=True), settled=2)
    ref, ref_opt = _setup(AdamW, compensation, flags, dict(lr=1e-2, weight_decay=0.1))
    _train(ref, ref_opt.step)
    for p, q in zip(params, ref):
        if _kernel_runs(flags):
            assert torch.equal(_master(opt, p), _master(ref_opt, q))
        else:
            _assert_near(_master(opt, p), _master(ref_opt, q), compensation)


def test_kahan_rounding_for_the_compiler_is_torchs_rounding():
    """The bit-level bf16 rounding used while compiling equals torch's conversion (ties to even,
    both signs, overflow to inf, NaN kept)."""
    from mixprec.optim.kahan import _rounded_for_compiler

    g = torch.Generator().manual_seed(0)
    x = torch.randn(100_000, generator=g) * torch.logspace(-30, 30, 100_000)
    ties = (torch.randn(1000, generator=g).bfloat16().float().view(torch.int32) + 0x8000).view(torch.float32)
    x = torch.cat([x, ties, torch.tensor([0.0, -0.0, 3.4e38, -3.4e38, float("inf"), float("-inf")])])
    assert torch.equal(_rounded_for_compiler(x, torch.bfloat16), x.bfloat16().float())
    assert torch.isnan(_rounded_for_compiler(torch.tensor([float("nan")]), torch.bfloat16)).all()


def test_float16_kahan_compiled_without_emulated_casts_is_refused():
    import torch._inductor.config as inductor_config

    # config.patch, not monkeypatch: undoing a monkeypatched config entry hides it from later
    # compiles ("emulate_precision_casts does not exist")
    p = torch.randn(8).half().requires_grad_()
    opt = AdamW([p], compensation="kahan", foreach=True)
    p.grad = torch.randn(8).half()
    with inductor_config.patch(emulate_precision_casts=False):
        with pytest.raises(Exception, match="emulate_precision_casts"):
            torch.compile(opt.step, backend="aot_eager", fullgraph=True)()
    with inductor_config.patch(emulate_precision_casts=True):
        torch._dynamo.reset()
        torch.compile(opt.step, backend="aot_eager", fullgraph=True)()
    assert opt.state[p]["kahan_comp"].abs().max() > 0
