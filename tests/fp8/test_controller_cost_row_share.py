"""``Controller(cost_row_share=s)``: a forward GEMM's loss cost measured on a share ``s`` of its
output rows a step (issue 39's cost): evenly spaced rows from a first row that moves each step,
each row measured equally often, the sums scaled to the whole output's, so that the steps of a
cycle average to the whole rows' estimate; the rung below's casts keep the whole input's scale;
the reference GEMM takes that share of the rows; compiled code draws the rows eager code does, a
resumed run the rows of an uninterrupted one."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from mixprec import Controller, fp8
from mixprec.control import _cost
from mixprec.control._cost import ROW_STEP, output_errors, sampled_rows
from mixprec.control._reference import reference_linear

from _models import sharp_classifier, sharp_classifier_batch

LADDER = ("nvfp4", "tensorwise", "compute")
ROWS = 256


_model = sharp_classifier  # (its logits, layer "2", are sharp: their NVFP4 error costs about 0.005 nats)


@pytest.fixture(scope="module")
def batch() -> tuple[torch.Tensor, torch.Tensor]:
    return sharp_classifier_batch(ROWS, torch.Generator().manual_seed(1))


def _converted(recipe: str = "tensorwise", **settings) -> tuple[nn.Module, Controller]:
    """Every layer on ``recipe`` above an NVFP4 floor: tensorwise measures its own casts' cost and
    NVFP4's (the rung below, whose tensor scale is the whole input's amax)."""
    ctl = Controller(**{"every": 10, "ladder": LADDER, "per_gemm": True, "floor": "nvfp4",
                        "max_loss_cost": 1.0, **settings})
    model = fp8.convert(_model(), recipe, filter_fn=lambda m, n: True, controller=ctl, backend="emulate_fp32")
    return model, ctl


def _step_sums(model: nn.Module, ctl: Controller, batch, steps: int, layer: str = "2", start: int = 0,
               forward=None) -> list[torch.Tensor]:
    """Each step's sums ``(first, squares, rows)`` per cost row of ``layer``, before the step's fold."""
    x, y = batch
    sums = []
    for _ in range(start, steps):
        F.cross_entropy((forward or model)(x), y).backward()
        model.zero_grad()
        sums.append(ctl._layers[layer].cost[:, :3].clone())
        ctl.step()
    return sums


# ------------------------------------------------------------------ which rows
SAMPLES = [(10, 4), (ROWS, 64), (24, 8), (7, 3), (100, 99), (64, 1), (513, 128)]


@pytest.mark.parametrize("count, most", SAMPLES)
def test_each_row_is_measured_equally_often_over_as_many_steps_as_rows(count, most):
    seen = torch.zeros(count, dtype=torch.long)
    size = math.ceil(count / math.ceil(count / most))
    for step in range(count):
        rows = sampled_rows(count, most, step)
        assert rows.dtype == torch.int64 and len(rows) == size <= most
        assert len(set(rows.tolist())) == size and 0 <= int(rows.min()) and int(rows.max()) < count
        seen += torch.bincount(rows, minlength=count)
    assert (seen == size).all()  # each row in `size` of the `count` samples: sum * count / size is unbiased


def test_a_device_step_draws_the_rows_an_int_does_and_few_rows_are_all_measured():
    for step in (0, 1, 5, 77, 2 ** 40 + 3):
        assert torch.equal(sampled_rows(512, 128, torch.tensor(step)), sampled_rows(512, 128, step))
    assert sampled_rows(128, 128, 3) is None and sampled_rows(5, None, 3) is None
    # consecutive steps move the sample: four of them cover every row of 512 taken 128 at a time
    assert sorted(torch.cat([sampled_rows(512, 128, s) for s in range(4)]).tolist()) == list(range(512))
    assert math.gcd(ROW_STEP, 2 ** 20 * 3 ** 5 * 5 ** 3 * 7 ** 2) == 1


def _record(recipe: str, below: str):
    """A record whose forward runs ``recipe`` and measures ``below``'s cost, against float32."""
    ctl = Controller(every=10, ladder=("nvfp4", "tensorwise", "rowwise", "compute"), per_gemm=True,
                     max_loss_cost=1.0, floor="nvfp4")
    model = fp8.convert(nn.Sequential(nn.Linear(32, 48)), recipe, filter_fn=lambda m, n: True, controller=ctl,
                        backend="emulate_fp32")
    model(torch.randn(4, 32)).sum().backward()
    rec = ctl._layers["0"]
    rec.forward_low, rec.forward_below, rec.reference = True, fp8.Float8Recipe.from_name(below), torch.float32
    return rec


@pytest.mark.parametrize("recipe, below", [("tensorwise", "nvfp4"), ("rowwise", "tensorwise")])
def test_sampled_errors_are_the_whole_errors_rows(recipe, below):
    """Both errors on the sampled rows are the whole output's errors on them: the rung below's
    casts take the whole input's scale though its largest magnitude lies in a row not sampled."""
    rec = _record(recipe, below)
    torch.manual_seed(4)
    x, w, b = torch.randn(2, 32, 32), torch.randn(48, 32), torch.randn(48)
    x[1, 5, 3] = 1e6  # the input's amax, in row 37: the whole scale flushes most of the other rows' values
    out = fp8.linear(x, w, b, fp8.Float8Recipe.from_name(recipe), backend="emulate_fp32")
    rows = sampled_rows(64, 16, 2)
    assert 37 not in rows.tolist()
    whole = dict(output_errors(rec, x, w, b, out))
    sampled = dict(output_errors(rec, x, w, b, out, rows=rows))
    assert sorted(sampled) == [0, 1]
    for row, error in sampled.items():
        assert error.shape == (16, 48)
        expected = whole[row].reshape(64, 48)[rows]
        torch.testing.assert_close(error, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))
    # the same rows cast on their own scale (no whole-tensor amax) err by far less: the scale took effect
    alone = fp8.linear(x.reshape(64, 32)[rows], w, b, fp8.Float8Recipe.from_name(below), backend="emulate_fp32")
    exact = reference_linear(x.reshape(64, 32)[rows], w, b)
    assert (alone - exact).norm() < 0.5 * sampled[1].norm()


# ------------------------------------------------------------------ the estimate
def test_the_steps_of_a_cycle_average_to_the_whole_rows_estimate(batch):
    """256 rows taken 64 at a time, ``ROW_STEP`` odd: four consecutive steps measure disjoint rows
    covering all, so (model and batch fixed) their mean sums are the whole rows' sums; each step's
    differs (the sample took effect) and counts all 256 rows."""
    whole = _step_sums(*_converted(), batch, 1)[0]
    steps = _step_sums(*_converted(cost_row_share=0.25), batch, 4)
    assert (whole[:, 2] == ROWS).all() and whole[:, 1].gt(0).all()
    for sums in steps:
        assert (sums[:, 2] == ROWS).all() and not torch.allclose(sums[:, :2], whole[:, :2], rtol=1e-3)
    torch.testing.assert_close(torch.stack(steps).mean(0), whole, rtol=1e-4, atol=0)


def test_a_share_of_one_measures_every_row_bitwise(batch):
    assert all(torch.equal(a, b) for a, b in zip(_step_sums(*_converted(), batch, 3),
                                                 _step_sums(*_converted(cost_row_share=1.0), batch, 3)))


def test_the_reference_and_the_rung_below_take_the_share_of_the_rows(batch, monkeypatch):
    seen = []
    for name, original in (("reference_linear", _cost.reference_linear), ("local_linear", _cost.local_linear)):
        monkeypatch.setattr(_cost, name, lambda x, *a, _o=original, _n=name: seen.append((_n, x.shape[0])) or _o(x, *a))
    _step_sums(*_converted(cost_row_share=0.125), batch, 2)
    # (the rung below's GEMM takes one more row: the whole input's amax, so that its casts take the whole scale)
    assert sorted(set(seen)) == [("local_linear", 33), ("reference_linear", 32)] and len(seen) == 8


def test_a_compiled_model_draws_and_measures_as_eager(batch):
    """Compiled code draws the rows from the step's device copy: the same sums, bitwise, and no
    recompile as the rows move."""
    import torch._dynamo
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    model, ctl = _converted(cost_row_share=0.25)
    eager = _step_sums(model, ctl, batch, 5)
    model, ctl = _converted(cost_row_share=0.25)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = _step_sums(model, ctl, batch, 5, forward=torch.compile(model, backend=counter, fullgraph=True))
    assert all(torch.equal(a, b) for a, b in zip(eager, compiled)) and counter.frame_count == 1


@pytest.mark.parametrize("tracked", ["before", "after"])
def test_a_resumed_run_draws_and_decides_bitwise_as_an_uninterrupted_one(batch, tracked):
    """Resumed at step 5 with the layers converted before the state loads (the load sets their
    step) or after it (each record, made at conversion, starts at the loaded step count)."""
    settings = dict(cost_row_share=0.1875, max_loss_cost=1e-3, every=2, demote_windows=2, min_dwell=0)
    model, ctl = _converted("nvfp4", **settings)
    _step_sums(model, ctl, batch, 5)
    state = json.loads(json.dumps(ctl.state_dict()))
    later = _step_sums(model, ctl, batch, 12, start=5)
    if tracked == "before":
        fresh, resumed = _converted("nvfp4", **settings)
        resumed.load_state_dict(state)
    else:
        resumed = Controller(**{"every": 10, "ladder": LADDER, "per_gemm": True, "floor": "nvfp4", **settings})
        resumed.load_state_dict(state)
        fresh = fp8.convert(_model(), "nvfp4", filter_fn=lambda m, n: True, controller=resumed, backend="emulate_fp32")
    again = _step_sums(fresh, resumed, batch, 12, start=5)
    assert resumed.log == ctl.log and resumed.state_dict() == ctl.state_dict()
    assert all(torch.equal(a, b) for a, b in zip(later, again))


def test_the_setting_is_checked_and_round_trips():
    ctl = Controller(max_loss_cost=1e-3, cost_row_share=0.25)
    assert ctl.settings.cost_row_share == 0.25 and Controller.from_config(json.loads(json.dumps(ctl.config()))) == ctl
    for bad in (0, 0.0, -0.5, 1.5, True, float("nan"), "0.5"):
        with pytest.raises(ValueError, match="cost_row_share"):
            Controller(max_loss_cost=1e-3, cost_row_share=bad)
    with pytest.raises(ValueError, match=r"cost_row_share=0\.5.*max_loss_cost"):
        Controller(cost_row_share=0.5)
    assert Controller(cost_row_share=1.0).settings.cost_row_share == 1  # (the default: every row)


# ------------------------------------------------------------------ the backward GEMMs' costs
def _backward_window(share: float, step: int, normalized: bool = True) -> torch.Tensor:
    """One shadow step's backward-cost terms of a layer (256 rows) whose own backward GEMMs gave
    the float32 results plus noise (the input gradient's, and the weight gradient's)."""
    from mixprec.control import _backward
    from mixprec.formats._recipe import Float8Recipe

    gen = torch.Generator().manual_seed(3)
    x, w, g = (torch.randn(*s, generator=gen) for s in ((ROWS, 32), (16, 32), (ROWS, 16)))
    gi, gw = g @ w, g.t() @ x
    cost = _backward.BackwardCost(torch.device("cpu"))
    cost.recipes = [(0, Float8Recipe.from_name("nvfp4"), (True, True))]
    cost.normalized, cost.row_share = normalized, share
    shadow = _backward._Shadow(x, w, w, True, step)
    shadow.grad = g
    cost._measure(shadow, gi + 0.3 * torch.randn(gi.shape, generator=gen), gw + 0.2 * torch.randn(gw.shape, generator=gen))
    return cost.window[0]


@pytest.mark.parametrize("normalized", [True, False])
def test_the_backward_costs_rows_average_over_a_cycle_to_the_whole_rows(normalized):
    """Under ``cost_row_share`` the backward costs' per-row terms take the step's rows: the weight
    gradient's curvature (its Fisher projections, sums over rows scaled up) averages over the four
    steps of a cycle to the whole rows' (its first-order and shrink terms, of the whole gradient,
    stay bitwise); the input gradient's terms are ratios over the sampled rows of its reference
    and result, as the whole rows' are over all."""
    from mixprec.control._update_error import cost_ratio, step_error

    whole = _backward_window(1.0, 0, normalized)
    quarters = [_backward_window(0.25, k, normalized) for k in range(4)]
    for q in quarters:
        assert torch.equal(q[1, :2], whole[1, :2]) and q[1, 3] == 1 and not torch.isclose(q[1, 2], whole[1, 2], rtol=1e-3)
    torch.testing.assert_close(torch.stack([q[1, 2] for q in quarters]).mean(), whole[1, 2], rtol=1e-4, atol=0)
    gen = torch.Generator().manual_seed(3)
    x, w, g = (torch.randn(*s, generator=gen) for s in ((ROWS, 32), (16, 32), (ROWS, 16)))
    reference = g @ w
    error = 0.3 * torch.randn(reference.shape, generator=gen)
    for k, q in enumerate(quarters):
        rows = sampled_rows(ROWS, ROWS // 4, k)
        r, e = reference[rows], error[rows]
        e = step_error(r, e) if normalized else e
        torch.testing.assert_close(q[0, 0], cost_ratio(r, r + e), rtol=1e-4, atol=1e-7)
        share = e.square().sum() / r.square().sum()
        torch.testing.assert_close(q[0, 1], share / 2 if normalized else torch.tensor(0.0), rtol=1e-4, atol=0)


def test_the_end_slope_averages_over_a_cycle_to_the_whole_rows():
    from mixprec.control._backward import _end_slope  # (the hook; _update_error.along_update the sum)

    gen = torch.Generator().manual_seed(4)
    x, g, update = torch.randn(ROWS, 32, generator=gen), torch.randn(ROWS, 16, generator=gen), torch.randn(16, 32, generator=gen)

    def slope(share: float, step: int) -> torch.Tensor:
        sl = [update, None, 0, torch.zeros(()), False]
        _end_slope(sl, x, g, torch.float32, share, step)
        assert sl[4]
        return sl[3]

    whole = slope(1.0, 0)
    torch.testing.assert_close(whole, ((g @ update) * x).sum(), rtol=1e-5, atol=0)
    torch.testing.assert_close(torch.stack([slope(0.25, k) for k in range(4)]).mean(), whole, rtol=1e-4, atol=1e-5)


def test_a_controllers_backward_measurements_take_the_share_of_the_rows(batch, monkeypatch):
    """With ``max_backward_cost`` the shadow steps' reference GEMMs take the step's rows where a
    term is per row (the input gradient's reference, the Fisher projections, the end slope), and
    every row where it is a sum over them (the weight gradient's reference: its contraction)."""
    from mixprec.control import _backward, _update_error

    seen = []
    for module in (_backward, _update_error):
        original = module.reference_mm
        monkeypatch.setattr(module, "reference_mm", lambda a, b, *r, _o=original: seen.append(tuple(a.shape)) or _o(a, b, *r))
    for share, rows in ((1.0, ROWS), (0.25, ROWS // 4)):
        seen.clear()
        model, ctl = _converted("nvfp4", floor=None, cost_row_share=share, max_backward_cost=1.0)
        _step_sums(model, ctl, batch, 12)
        assert ctl._layers["2"].backward.row_share == share and ctl._layers["2"].backward.step == 12
        # both layers have 64 outputs: the weight gradient's reference is (64, all rows) @ (all rows, in)
        weight_gradients = [a for a in seen if a == (64, ROWS)]
        per_row = [a for a in seen if a != (64, ROWS)]
        assert weight_gradients and len(per_row) > len(weight_gradients), seen
        assert {a[0] for a in per_row} == {rows} and {a[1] for a in per_row} == {64}, seen
