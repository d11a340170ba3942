"""Per-layer fp8 statistics on the device, the Guard's fallback decisions (warning, state dict,
SQNR sampling), and the same decision on every rank (2 processes, gloo)."""

from __future__ import annotations

import math
import os
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

import mixprec
from mixprec import fp8

from _distributed import gloo_group, spawn
from _models import fp8_stack

OUTLIER_LAYER = "2"


def _model() -> nn.Module:
    """The shared fp8 stack, every Linear converted."""
    return fp8.convert(fp8_stack(), filter_fn=lambda mod, fqn: True)


def _step(model: nn.Module, seed: int, outlier: bool = False) -> None:
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(seed))
    handle = None
    if outlier:
        def inject(mod, args):
            (h,) = args
            h = h.clone()
            h[0, 0] = 1e6
            return (h,)
        handle = model.get_submodule(OUTLIER_LAYER).register_forward_pre_hook(inject)
    model(x).square().mean().backward()
    if handle is not None:
        handle.remove()


def test_layer_statistics_are_recorded_per_operand():
    model = _model()
    _step(model, 0)
    states = fp8.layer_states(model)
    assert sorted(states) == ["0", "2", "4", "6"]
    st = states["2"].read()
    with torch.no_grad():
        h = model[1](model[0](torch.randn(16, 32, generator=torch.Generator().manual_seed(0))))
    assert st["input"]["amax"] == float(h.abs().max())
    assert st["weight"]["amax"] == float(model[2].weight.detach().abs().max())
    assert st["grad_output"]["amax"] > 0
    assert all(st[op]["saturated"] == 0 and st[op]["underflow"] < 1e-3 and st[op]["nonfinite"] == 0
               for op in ("input", "weight", "grad_output"))


def test_statistics_flag_underflow_saturation_and_nonfinite():
    state = fp8.LayerState()
    w = torch.randn(16, 32)
    x = torch.randn(8, 32)
    fp8.linear(x, w, state=state)
    assert state.read()["input"]["saturated"] == 0  # no previous amax: nothing to judge against
    x[0, 0] = 1e6  # every other value flushes to zero at scale 448 / 1e6
    fp8.linear(x, w, state=state)
    got = state.read()["input"]
    assert got["underflow"] > 0.9 and got["saturated"] == 1 / x.numel()  # beyond the last amax
    fp8.linear(2 * x, w, state=state)  # every value with |2x| > 1e6 (just one) would clip
    assert state.read()["input"]["saturated"] == 1 / x.numel()
    x[0, 0] = float("inf")
    fp8.linear(x, w, state=state)
    got = state.read()["input"]
    assert got["nonfinite"] == 1 and got["amax"] == math.inf
    assert got["underflow"] > 0.9  # the window keeps the worst value
    state.reset()
    assert torch.equal(state.stats, torch.zeros(3, 4))
    fp8.linear(torch.randn(8, 32) * 3, w, state=state)  # the last amax (inf) survives the reset
    assert state.read()["input"]["saturated"] == 0


def test_saturation_against_the_previous_amax():
    state = fp8.LayerState()
    w = torch.randn(16, 32)
    x = torch.linspace(-1, 1, 256).reshape(8, 32)
    fp8.linear(x, w, state=state)
    fp8.linear(x * 2, w, state=state)  # half the values are now beyond the previous amax (1)
    assert state.read()["input"]["saturated"] == pytest.approx(0.5, abs=0.01)
    assert state.read()["weight"]["saturated"] == 0
    assert fp8.Guard().check({"l": state}, 0) == []  # off by default
    fp8.linear(x * 4, w, state=state)
    with pytest.warns(fp8.Float8FallbackWarning, match="input saturated = 0.5 > 0.1"):
        assert fp8.Guard(max_saturated=0.1).check({"l": state}, 1)[0].statistic == "saturated"


def test_outlier_in_one_layer_makes_only_that_layer_fall_back():
    model = _model()
    guard = fp8.Guard()
    _step(model, 0)
    assert guard.check(model, step=0) == []
    _step(model, 1, outlier=True)
    with pytest.warns(fp8.Float8FallbackWarning, match=r"fp8 layer '2' falls back to the compute dtype at "
                                                       r"step 1: input underflow = 0\.9\d* > 0\.05"):
        new = guard.check(model, step=1)
    assert [(d.layer, d.operand, d.statistic) for d in new] == [(OUTLIER_LAYER, "input", "underflow")]
    assert {n: s.fallback for n, s in fp8.layer_states(model).items()} == {"0": False, "2": True, "4": False, "6": False}
    # the fallen layer now runs F.linear: output equal to the plain layer's
    x = torch.randn(4, 32)
    assert torch.equal(model[2](x), nn.functional.linear(x, model[2].weight, model[2].bias))
    _step(model, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert guard.check(model, step=2) == []  # one warning per layer, ever


def test_check_reads_only_every_n_steps_and_resets_the_window():
    model = _model()
    guard = fp8.Guard(every=2)
    _step(model, 0, outlier=True)
    _step(model, 1)
    states = fp8.layer_states(model)
    before = states["0"].stats.clone()
    assert guard.check(model, step=1) == []  # not a check step: nothing read, nothing reset
    assert torch.equal(states["0"].stats, before)
    with pytest.warns(fp8.Float8FallbackWarning):
        assert [d.layer for d in guard.check(model, step=2)] == [OUTLIER_LAYER]  # step 0's outlier counts
    assert torch.equal(states["0"].stats, torch.zeros(3, 4))


def test_sampled_sqnr_threshold():
    model = _model()
    guard = fp8.Guard(min_sqnr_db=60.0, every=2)  # fp8 is about 28 dB: every layer falls back
    states = fp8.layer_states(model)
    _step(model, 0)
    assert guard.check(model, step=0) == []  # the first window was not sampled
    assert not any(s.sample_sqnr for s in states.values())
    _step(model, 1)
    guard.check(model, step=1)
    assert all(s.sample_sqnr for s in states.values())  # armed for the last step of the window
    _step(model, 2)
    sqnr = float(states["0"].output_sqnr_db)
    assert 20 < sqnr < 40
    with pytest.warns(fp8.Float8FallbackWarning, match="output sqnr_db"):
        new = guard.check(model, step=2)
    assert sorted(d.layer for d in new) == ["0", "2", "4", "6"]
    assert math.isinf(float(states["0"].output_sqnr_db))


def test_nonfinite_threshold_and_none_switches_off():
    state = fp8.LayerState()
    x = torch.randn(8, 32)
    x[1, 1] = float("nan")
    fp8.linear(x, torch.randn(16, 32), state=state)
    assert fp8.Guard(max_nonfinite=None, max_underflow=None, max_saturated=None).check({"l": state}, 0) == []
    fp8.linear(x, torch.randn(16, 32), state=state)
    with pytest.warns(fp8.Float8FallbackWarning, match="input nonfinite = 1 > 0"):
        assert fp8.Guard().check({"l": state}, 0)[0].statistic == "nonfinite"


def test_decisions_survive_state_dict_round_trip():
    model = _model()
    guard = fp8.Guard(max_underflow=0.2)
    _step(model, 0, outlier=True)
    with pytest.warns(fp8.Float8FallbackWarning):
        guard.check(model, step=7)
    sd = guard.state_dict()
    assert sd["decisions"][OUTLIER_LAYER]["step"] == 7 and sd["decisions"][OUTLIER_LAYER]["threshold"] == 0.2
    # resume: a fresh model converted with a fresh guard, which then loads the decisions
    resumed_guard = fp8.Guard(max_underflow=0.2)
    resumed = fp8.convert(nn.Sequential(*[nn.Linear(32, 32) for _ in range(4)]),
                          filter_fn=lambda m, f: True, guard=resumed_guard)
    resumed_guard.load_state_dict(torch.load(_roundtrip(sd), weights_only=True))
    assert [n for n, s in fp8.layer_states(resumed).items() if s.fallback] == ["2"]
    assert resumed_guard.decisions == guard.decisions
    # and in the other order: decisions loaded first apply when the guard tracks the model
    other = fp8.Guard()
    other.load_state_dict(sd)
    model2 = fp8.convert(nn.Sequential(*[nn.Linear(32, 32) for _ in range(4)]), filter_fn=lambda m, f: True)
    other.check(model2, step=8)
    assert fp8.layer_state(model2[2]).fallback and not fp8.layer_state(model2[1]).fallback


def _roundtrip(obj):
    import io

    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return buf


def test_guard_validation():
    with pytest.raises(ValueError, match="every must be an int >= 1"):
        fp8.Guard(every=0)
    with pytest.raises(ValueError, match=r"max_underflow must be a number in \[0, 1\]"):
        fp8.Guard(max_underflow=-0.1)
    with pytest.raises(ValueError, match="expects the dict of Guard.state_dict"):
        fp8.Guard().load_state_dict({"fallbacks": {}})
    with pytest.raises(ValueError, match="must be a LayerState"):
        fp8.Guard().check({"x": object()}, 0)


# --- two processes ---------------------------------------------------------------------------

def _worker(rank: int, port: int, out_dir: str) -> None:
    with gloo_group(rank, port):
        torch.set_num_threads(1)
        model = _model()
        guard = fp8.Guard()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _step(model, 10 + rank)
            first = guard.check(model, step=0)
            _step(model, 20 + rank, outlier=rank == 1)  # only rank 1 sees the outlier
            second = guard.check(model, step=1)
        torch.save({"first": [d.layer for d in first], "second": [(d.layer, d.operand, d.statistic) for d in second],
                    "flags": {n: s.fallback for n, s in fp8.layer_states(model).items()},
                    "warnings": [str(w.message) for w in caught if w.category is fp8.Float8FallbackWarning],
                    "state_dict": guard.state_dict()}, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_fallback_decision_is_the_same_on_every_rank(tmp_path):
    spawn(_worker, str(tmp_path))
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    for res in results:
        assert res["first"] == []
        assert res["second"] == [(OUTLIER_LAYER, "input", "underflow")]
        assert res["flags"] == {"0": False, "2": True, "4": False, "6": False}
        assert len(res["warnings"]) == 1 and "'2'" in res["warnings"][0]
    assert results[0]["state_dict"]["decisions"] == results[1]["state_dict"]["decisions"]  # windows: per rank


def test_large_operands_are_measured_on_a_sample_and_nonfinite_is_never_missed():
    from mixprec.formats._quant import SAMPLE

    x = torch.randn(256, 256)
    assert x.numel() > 2 * SAMPLE
    x[0, 1] = 1e6  # off the stride-5 sample, but the amax sees it: every other value flushes
    state = fp8.LayerState()
    fp8.linear(x, torch.randn(16, 256), state=state)
    got = state.read()["input"]
    assert got["amax"] == 1e6 and got["underflow"] > 0.9 and got["nonfinite"] == 0
    x[0, 1] = float("nan")
    fp8.linear(x, torch.randn(16, 256), state=state)
    assert state.read()["input"]["nonfinite"] == 1


def test_an_fp4_operand_is_judged_against_the_fp4_underflow_limit():
    """e2m1 blocks flush several percent of ordinary data: a default Guard keeps an nvfp4 layer on
    Gaussian data (its flush rate is between max_underflow and fp4_max_underflow), and moves it
    when fp4_max_underflow is below that rate; the fallback names the limit it crossed."""
    from mixprec.fp8 import Float8FallbackWarning, Float8Recipe, Guard, LayerState, linear

    def run(guard):
        st = LayerState()
        g = torch.Generator().manual_seed(0)
        x = torch.randn(64, 64, generator=g, requires_grad=True)
        w = torch.randn(32, 64, generator=g, requires_grad=True)
        linear(x, w, None, Float8Recipe.nvfp4(), state=st).square().sum().backward()
        rate = float(st.stats[0, 2])
        return rate, guard.check({"layer": st}, step=1)

    rate, fallbacks = run(Guard())
    assert Guard().max_underflow < rate < Guard().fp4_max_underflow and fallbacks == []
    with pytest.warns(Float8FallbackWarning, match="underflow"):
        rate, fallbacks = run(Guard(fp4_max_underflow=rate / 2))
    assert [(f.operand, f.statistic, f.threshold) for f in fallbacks][:1] == [("input", "underflow", rate / 2)]
    rate, fallbacks = run(Guard(fp4_max_underflow=None))
    assert fallbacks == []


# ----------------------------------------------------------- steps that say nothing of the format
def test_a_cast_with_a_non_finite_amax_counts_only_its_nonfinite_values():
    """Its scale (448 / inf) flushed every finite element: no underflow nor saturation is measured
    (before 2026-12-07 underflow read about 1), on the C++ kernel's path and torch's alike."""
    from mixprec.formats._quant import cast_stats

    x = torch.randn(8, 32)
    x[0, 0] = float("inf")
    q = (x * 0).to(torch.float8_e4m3fn)  # what the cast at scale 448 / inf gives: every finite value 0
    assert cast_stats(x, q, x.abs().max(), torch.tensor(1.0)).tolist() == [math.inf, 0.0, 0.0, 1.0]
    state = fp8.LayerState()
    fp8.linear(x, torch.randn(16, 32), state=state)
    got = state.read()["input"]
    assert (got["nonfinite"], got["underflow"], got["saturated"]) == (1, 0, 0)


def _overflow_run(make_controller) -> tuple[list, list[bool]]:
    """Four fp16 steps under torch.amp.GradScaler, the third overflowing in one grad_output element
    (the scaler skips it); returns the decisions and which steps the scaler skipped."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 32))
    control = make_controller()
    model = fp8.convert(model, "tensorwise", filter_fn=lambda m, n: isinstance(m, nn.Linear),
                        **({"guard": control} if isinstance(control, fp8.Guard) else {"controller": control}))
    opt, scaler = torch.optim.SGD(model.parameters(), lr=1e-3), torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
    decisions, skipped = [], []
    for step in range(4):
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(torch.randn(16, 32, generator=torch.Generator().manual_seed(step)))
        weight = torch.ones(16, 32)
        weight[0, 0] = 2.0 ** 20 if step == 2 else 1.0
        scale = scaler.get_scale()
        scaler.scale((out.float().square() * weight).mean()).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        skipped.append(scaler.get_scale() < scale)
        decisions += control.step() if isinstance(control, fp8.Guard) else control.step(loss_scale=scale)
    return decisions, skipped


_LEFT_TO_THE_SCALER = {  # a loss scaler's overflow step with max_nonfinite=None moves no layer
    "guard": lambda: fp8.Guard(max_nonfinite=None, every=1),
    "controller": lambda: mixprec.Controller(max_nonfinite=None, every=2),
}


@pytest.mark.parametrize("case", _LEFT_TO_THE_SCALER)
def test_an_overflow_step_a_loss_scaler_skips_moves_no_layer_with_max_nonfinite_none(case):
    """As docs/fp8.md says: with an fp16 GradScaler, ``max_nonfinite=None`` leaves inf/NaN to the
    scaler (before 2026-12-07 the skipped step's flushed grad_output read as underflow 0.998: the
    Guard fell a layer back, the Controller promoted one). The default limit still judges it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        decisions, skipped = _overflow_run(_LEFT_TO_THE_SCALER[case])
        assert skipped == [False, False, True, False] and decisions == []
        if case == "guard":
            judged, _ = _overflow_run(lambda: fp8.Guard(every=1))
            assert [(d.operand, d.statistic, d.step) for d in judged][:1] == [("grad_output", "nonfinite", 3)]


_EXACT_OUTPUTS = {  # name: (zero the middle layer's weight, input)
    "zero-initialized weight": (True, lambda: torch.randn(8, 32)),
    "all-zero batch": (False, lambda: torch.zeros(8, 32)),
}


@pytest.mark.parametrize("case", _EXACT_OUTPUTS)
def test_an_exact_output_passes_the_sqnr_limit(case):
    """A GEMM whose fp8 output is exact (zero error: a zero-initialized projection, an all-zero
    padding batch) has an SQNR of +inf dB: before 2026-12-07 it read 0/0 = NaN, and the Guard's
    ``min_sqnr_db`` fell the layer back for good."""
    zero_weight, make_input = _EXACT_OUTPUTS[case]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32, bias=False), nn.GELU(), nn.Linear(32, 32, bias=False))
    if zero_weight:
        with torch.no_grad():
            model[2].weight.zero_()
    guard = fp8.Guard(min_sqnr_db=20, every=1)
    model = fp8.convert(model, "tensorwise", guard=guard, filter_fn=lambda m, n: isinstance(m, nn.Linear))
    for _ in range(2):
        model(make_input()).square().mean().backward()
        assert guard.step() == []
    assert all(math.isinf(float(st.output_sqnr_db)) or float(st.output_sqnr_db) > 20
               for st in fp8.layer_states(model).values())
