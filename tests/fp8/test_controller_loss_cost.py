"""``Controller(max_loss_cost=...)``: the loss a forward GEMM's output error adds, estimated on
every step from the error against float32 and the output's gradient, checked against the loss
change it estimates (measured in the same run), invariant to micro-batching and to a loss scale
divided out; a costly forward GEMM is promoted (alone, per GEMM), it comes down once the recipe
below is cheap, and a resumed run decides bitwise as an uninterrupted one."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from mixprec import Controller, Policy, autocast, fp8
from mixprec.control._decide import OVER_WINDOWS
from mixprec.control._ladder import loss_cost

from _models import sharp_classifier, sharp_classifier_batch

#: marked cross_isa: results follow this CPU's rounding (scripts/cross_isa.py runs them under other caps);
#: the compiled variants compare with eager in one process and are left out of that subset
CROSS_ISA = pytest.mark.cross_isa

LADDER = ("nvfp4", "tensorwise", "compute")


_model = sharp_classifier  # (its logits, layer "2", are sharp: their NVFP4 error costs about 0.005 nats)


@pytest.fixture(scope="module")
def batch() -> tuple[torch.Tensor, torch.Tensor]:
    return sharp_classifier_batch(256, torch.Generator().manual_seed(1))


def _converted(recipe: str = "nvfp4", only: str | None = "2", **settings) -> tuple[nn.Module, Controller]:
    ctl = Controller(**{"every": 1, "ladder": LADDER, "per_gemm": True, "floor": "nvfp4", **settings})
    model = fp8.convert(_model(), recipe, filter_fn=lambda m, n: only is None or n == only, controller=ctl,
                        backend="emulate_fp32")
    return model, ctl


def _estimates(ctl: Controller, layer: str = "2") -> tuple[float, float]:
    """This step's (own, below) estimates of ``layer``, before ``ctl.step()`` folds them."""
    c = ctl._layers[layer].cost
    return loss_cost(*c[0, :3], at_error=True).item(), loss_cost(*c[1, :3]).item()


@CROSS_ISA
@pytest.mark.parametrize("recipe", ["nvfp4", "tensorwise"])
def test_the_estimates_are_the_loss_changes_they_estimate(batch, recipe):
    """Own casts: the loss of the run against the float32 model's; below (NVFP4, measured while
    the layer runs tensorwise): the loss with the layer's forward in NVFP4 against float32."""
    x, y = batch
    model, ctl = _converted(recipe, max_loss_cost=1.0)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    own, below = _estimates(ctl)
    reference = _model()
    ref_loss = F.cross_entropy(reference(x), y).item()
    hidden = reference[1](reference[0](x))
    nvfp4_out = fp8.linear(hidden, reference[2].weight, reference[2].bias, fp8.Float8Recipe.nvfp4(),
                           backend="emulate_fp32")
    nvfp4_change = F.cross_entropy(nvfp4_out, y).item() - ref_loss
    assert nvfp4_change > 1e-3  # the case is one where the cost matters
    if recipe == "nvfp4":
        assert own == pytest.approx(loss.item() - ref_loss, rel=0.2)
        assert below == 0.0  # at its floor: no recipe below
    else:
        assert abs(own) < nvfp4_change / 5  # fp8's error costs far less
        assert own == pytest.approx(loss.item() - ref_loss, abs=nvfp4_change / 10)
        assert below == pytest.approx(nvfp4_change, rel=0.2)


def _window_mean(ctl: Controller, layer: str = "2") -> torch.Tensor:
    c = ctl._layers[layer].cost
    return c[:, 3] / c[:, 4]


@CROSS_ISA
def test_micro_batches_and_a_divided_out_loss_scale_give_the_same_estimate(batch):
    """The estimate is of the step's loss: one batch, two micro-batches of a loss halved, and a
    loss multiplied by 1024 with ``step(loss_scale=1024.0)`` measure the same cost (the layer's
    rowwise casts: a row's error does not depend on the rows beside it)."""
    x, y = batch
    results = []
    for way in ("whole", "halves", "scaled"):
        model, ctl = _converted("rowwise", max_loss_cost=1.0, every=10, ladder=("nvfp4", "rowwise", "compute"))
        if way == "halves":
            for part in (slice(0, 128), slice(128, 256)):
                (F.cross_entropy(model(x[part]), y[part]) / 2).backward()
        else:
            (F.cross_entropy(model(x), y) * (1024.0 if way == "scaled" else 1.0)).backward()
        ctl.step(loss_scale=1024.0 if way == "scaled" else None)
        results.append(_window_mean(ctl))
    # (the row below is NVFP4's, whose tensor scale is the batch's amax: the halves' errors differ)
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(results[2], results[0], rtol=1e-5, atol=1e-8)


def _train(model: nn.Module, ctl: Controller, batch, steps: int, start: int = 0) -> None:
    x, y = batch
    for _ in range(start, steps):
        F.cross_entropy(model(x), y).backward()
        model.zero_grad()
        ctl.step()


@CROSS_ISA
@pytest.mark.parametrize("per_gemm", [True, False])
def test_a_costly_forward_is_promoted_and_only_it(batch, per_gemm):
    """The logits' NVFP4 forward costs about 0.0045 nats a step, the hidden layer's at most 0.0014
    on any rung (the flush limits raised: no underflow promotion): promoted at the second check
    (windows of 2 steps: two readings over the limit, ``OVER_WINDOWS``)."""
    settings = dict(only=None, every=2, per_gemm=per_gemm, fp4_max_underflow=0.5, fp4_demote_underflow=0.4)
    model, ctl = _converted(max_loss_cost=3e-3, **settings)
    _train(model, ctl, batch, 6)
    by_cost = [d for d in ctl.log if d.statistic == "loss_cost"]
    assert by_cost and {d.layer for d in by_cost} == {"2"}
    first = by_cost[0]
    assert (first.step, first.action, first.from_, first.to, first.operand) == (
        2 * OVER_WINDOWS, "promote", "nvfp4", "fp8-tensorwise", "output")
    assert first.gemm == ("output" if per_gemm else None) and first.value > first.threshold == 3e-3
    assert "loss cost" in first.reason and len(ctl.log) == 1
    assert ctl.precision("0") == "nvfp4"
    if per_gemm:  # the backward GEMMs keep their own rungs
        assert [ctl.precision("2", g) for g in ("output", "grad_input", "grad_weight")] == [
            "fp8-tensorwise", "nvfp4", "nvfp4"]
    # without the setting nothing measures nor decides on the loss cost
    model, ctl = _converted(**settings)
    _train(model, ctl, batch, 6)
    assert not ctl.log and ctl._layers["2"].cost is None


@CROSS_ISA
@pytest.mark.parametrize("demote_loss_cost, demoted", [(1.0, True), (1e-4, False)])
def test_a_promoted_forward_comes_down_only_when_the_recipe_below_is_cheap(batch, demote_loss_cost, demoted):
    """Started on tensorwise above an NVFP4 floor: NVFP4's forward costs about 0.005 nats."""
    model, ctl = _converted("tensorwise", max_loss_cost=1.0, demote_loss_cost=demote_loss_cost, every=2,
                            demote_windows=2, min_dwell=0)
    _train(model, ctl, batch, 10)
    down = [d for d in ctl.log if d.gemm == "output" and d.action == "demote"]
    assert bool(down) == demoted
    assert ctl.precision("2", "output") == ("nvfp4" if demoted else "fp8-tensorwise")
    if demoted:
        assert down[0].step == 4  # two clean windows


@CROSS_ISA
def test_a_resumed_run_decides_bitwise_as_an_uninterrupted_one(batch):
    settings = dict(only=None, max_loss_cost=1e-3, every=2, demote_windows=2, min_dwell=0)
    model, ctl = _converted(**settings)
    _train(model, ctl, batch, 5)
    state = json.loads(json.dumps(ctl.state_dict()))
    assert "loss_cost" in state["layers"]["2"]
    _train(model, ctl, batch, 12, start=5)
    fresh, resumed = _converted(**settings)
    resumed.load_state_dict(state)
    _train(fresh, resumed, batch, 12, start=5)
    assert resumed.log == ctl.log and resumed.state_dict() == ctl.state_dict()


@CROSS_ISA
def test_settings_are_checked_and_round_trip():
    ctl = Controller(max_loss_cost=2e-3)
    assert ctl.demote_cost == 1e-3 and Controller.from_config(json.loads(json.dumps(ctl.config()))) == ctl
    assert Controller(max_loss_cost=2e-3, demote_loss_cost=5e-4).demote_cost == 5e-4
    for bad in (dict(max_loss_cost=-1.0), dict(max_loss_cost=float("nan")), dict(demote_loss_cost=1e-3),
                dict(max_loss_cost=1e-3, demote_loss_cost=2e-3), dict(max_loss_cost="1e-3")):
        with pytest.raises(ValueError, match="loss_cost"):
            Controller(**bad)
    for bad in (0, -1.0, float("inf"), True, "1024"):
        with pytest.raises(ValueError, match="loss_scale"):
            Controller().step(loss_scale=bad)


@CROSS_ISA
def test_under_fp16_without_a_loss_scale_it_warns_once():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32))
    ctl = Controller(every=1, max_loss_cost=1e-3)
    policy = Policy.parse("compute=fp16").fp8("tensorwise", first_last="fp8", controller=ctl)
    x = torch.randn(16, 32)

    def step(**kw):
        with autocast("cpu", policy=policy):
            out = model(x)
        out.float().square().mean().backward()
        ctl.step(**kw)

    with pytest.warns(UserWarning, match=r"loss_scale=scaler\.get_scale\(\)"):
        step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step()  # once
    ctl = Controller(every=1, max_loss_cost=1e-3)
    policy = Policy.parse("compute=fp16").fp8("tensorwise", first_last="fp8", controller=ctl)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step(loss_scale=1.0)


def test_a_compiled_model_measures_and_decides_as_eager(batch):
    """Under ``torch.compile(fullgraph=True)`` the probe's reference GEMM, the recipe below's and
    the backward hook are traced: the same estimates, bitwise, and the same decisions."""
    import torch._dynamo

    torch._dynamo.reset()
    x, y = batch
    runs = []
    for compiled in (False, True):
        model, ctl = _converted(only=None, max_loss_cost=3e-3, every=2, fp4_max_underflow=0.5,
                                fp4_demote_underflow=0.4)
        forward = torch.compile(model, backend="aot_eager", fullgraph=True) if compiled else model
        sums = []
        for _ in range(6):
            F.cross_entropy(forward(x), y).backward()
            model.zero_grad()
            sums.append(ctl._layers["2"].cost[:, :3].clone())
            ctl.step()
        runs.append((ctl.log, sums))
    (eager_log, eager_sums), (compiled_log, compiled_sums) = runs
    assert eager_log and compiled_log == eager_log
    assert all(torch.equal(a, b) for a, b in zip(eager_sums, compiled_sums))


@CROSS_ISA
def test_fp4_limits_without_fp4_warn_that_they_take_no_effect():
    """A Controller's fp4 limits on a ladder without fp4 rungs, a Guard's over layers without e2m1
    operands (told once, at its first check): nothing configured silently does nothing."""
    with pytest.warns(UserWarning, match=r"Controller\(fp4_max_underflow=0.2\) takes no effect"):
        Controller(fp4_max_underflow=0.2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Controller(fp4_max_underflow=0.2, ladder=LADDER)
        Controller()
    for recipe, warned in (("tensorwise", True), ("nvfp4", False), ("tensorwise", False)):
        guard = fp8.Guard(fp4_max_underflow=0.3 if warned or recipe == "nvfp4" else 0.25)
        model = fp8.convert(_model(), recipe, filter_fn=lambda m, n: True, guard=guard)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):
                model(torch.randn(8, 32)).sum().backward()
                guard.step()
        said = [str(w.message) for w in caught if "fp4_max_underflow" in str(w.message)]
        assert len(said) == warned and all("none of the layers it watches" in m for m in said)


def _scaled_step(model: nn.Module, ctl: Controller, batch, compute: torch.dtype, scaler=None, **step) -> torch.Tensor:
    """One training step (the loss scaled by ``scaler`` when given), ``ctl.step(**step)``; the
    window's mean loss cost (own, below) of every layer, stacked."""
    x, y = batch
    with torch.autocast("cpu", dtype=compute, enabled=compute is not torch.float32):
        loss = F.cross_entropy(model(x).float(), y)
    (loss if scaler is None else scaler.scale(loss)).backward()
    ctl.step(**step)
    return torch.stack([_window_mean(ctl, name) for name in sorted(ctl._layers)])


@pytest.mark.parametrize("compute", [torch.float32, torch.bfloat16])
def test_a_grad_scalers_scale_is_divided_out_without_loss_scale(batch, compute):
    """A ``mixprec.GradScaler`` scales the gradients by 65536: with ``ctl.step()`` and no
    ``loss_scale`` the cost is the unscaled run's, in any compute dtype (no warning needed)."""
    from mixprec import GradScaler

    settings = dict(only=None, max_loss_cost=1.0, every=10, ladder=("nvfp4", "rowwise", "compute"))
    model, ctl = _converted("rowwise", **settings)
    plain = _scaled_step(model, ctl, batch, compute)
    model, ctl = _converted("rowwise", **settings)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scaled = _scaled_step(model, ctl, batch, compute, GradScaler("cpu"))
    assert plain[:, 0].abs().max() > 0
    torch.testing.assert_close(scaled, plain, rtol=1e-5, atol=1e-9)
    # an explicit loss_scale replaces the scaler's (what the loss was multiplied by)
    model, ctl = _converted("rowwise", **settings)
    again = _scaled_step(model, ctl, batch, compute, GradScaler("cpu", init_scale=1024.0), loss_scale=1024.0)
    torch.testing.assert_close(again, plain, rtol=1e-5, atol=1e-9)
    # a loss scaled before the controller existed is not this step's
    GradScaler("cpu").scale(torch.ones((), requires_grad=True))
    model, ctl = _converted("rowwise", **settings)
    torch.testing.assert_close(_scaled_step(model, ctl, batch, compute), plain, rtol=0, atol=0)


def _blocks() -> nn.Sequential:
    """Three blocks, cut points of a per-layer scaler; the second's Linear gives the block's
    output itself (the cut point's gradient hook is on that Linear's output tensor)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Sequential(nn.Linear(32, 64), nn.GELU()), nn.Sequential(nn.GELU(), nn.Linear(64, 64)),
                          nn.Sequential(nn.GELU(), nn.Linear(64, 64)))
    with torch.no_grad():
        model[2][1].weight.mul_(4)
    return model


@pytest.mark.parametrize("compute", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("explicit", [False, True])
def test_per_layer_scaling_each_layer_divides_out_its_own_scale(batch, compute, explicit):
    """``GradScaler(per_layer=True)`` with every cut point's factor 2**3: a layer below k cut
    points carries the loss scale times 8**k; each layer's cost is the unscaled run's, with
    ``ctl.step()`` and with ``ctl.step(loss_scale=scaler.get_scale())`` as the docs say."""
    from mixprec import GradScaler

    def run(scaler_factory):
        ctl = Controller(every=10, ladder=("nvfp4", "rowwise", "compute"), floor="nvfp4", per_gemm=True,
                         max_loss_cost=1.0)
        model = fp8.convert(_blocks(), "rowwise", filter_fn=lambda m, n: True, controller=ctl,
                            backend="emulate_fp32")
        scaler = scaler_factory(model) if scaler_factory else None
        step = {"loss_scale": scaler.get_scale()} if explicit and scaler is not None else {}
        return _scaled_step(model, ctl, batch, compute, scaler, **step), scaler

    plain, _ = run(None)

    def per_layer(model):
        scaler = GradScaler("cpu", per_layer=True, init_scale=1024.0).watch(model)
        state = scaler.state_dict()
        n = len(state["layerwise"]["cut_points"])
        state["layerwise"]["exponent"] = [3] * n
        scaler.load_state_dict(state)
        return scaler

    scaled, scaler = run(per_layer)
    factors = scaler.layer_scales()
    assert len(factors) >= 2 and set(factors.values()) == {8.0}
    assert plain.shape == (3, 2) and plain.abs().min() > 0
    torch.testing.assert_close(scaled, plain, rtol=1e-5, atol=1e-9)


def test_under_the_fp8_all_gather_it_warns_naming_the_layers_it_cannot_measure(batch):
    """``fp8.convert(fsdp_fp8_all_gather=True)``: FSDP2 gathers those weights in fp8, no rank holds
    the high-precision weight the cost's reference needs; the controller says which layers it
    cannot see (and measures nothing there, not even on the weight a rung dequantizes)."""
    x, y = batch
    ctl = Controller(every=10, ladder=LADDER, per_gemm=True, max_loss_cost=1e-3)
    with pytest.warns(UserWarning, match=r"cannot measure the loss cost of \['0', '2'\]: FSDP2 all-gathers"):
        model = fp8.convert(_model(), "tensorwise", filter_fn=lambda m, n: True, fsdp_fp8_all_gather=True,
                            controller=ctl, backend="emulate_fp32")
    F.cross_entropy(model(x), y).backward()
    ctl.step()
    assert all(int(rec.cost[:, 4].sum()) == 0 for rec in ctl._layers.values())
    with warnings.catch_warnings():  # without the setting: nothing to say
        warnings.simplefilter("error")
        fp8.convert(_model(), "tensorwise", filter_fn=lambda m, n: True, fsdp_fp8_all_gather=True,
                    controller=Controller(ladder=LADDER), backend="emulate_fp32")


def test_the_step_folds_every_layer_at_once_bitwise_as_each_alone(batch):
    """``Controller.step`` folds the layers' loss-cost sums in one pass per shared loss scale
    (``_fold.StepWrites.end_steps``): in place on the buffer whose rows the layers' windows are
    (scales shared: a number, the same tensor), stacked where they differ (a tensor of its own)
    and for a record the controller did not bank; bitwise what each layer's own fold gives."""
    from mixprec.control._fold import fold
    from mixprec.control._ladder import LayerRecord
    from mixprec.formats._state import LayerState

    model, ctl = _converted(only=None, max_loss_cost=1.0)
    x, y = batch
    F.cross_entropy(model(x), y).backward()
    recs = list(ctl._layers.values())
    assert len(recs) == 2 and all(r.cost[:, 2].gt(0).any() for r in recs)
    assert recs[0].cost.untyped_storage().data_ptr() == recs[1].cost.untyped_storage().data_ptr()  # (one buffer)
    assert recs[0].step_index is recs[1].step_index
    loose = LayerRecord(None, LayerState(), 0, 0, (True,) * 3, cost=True)  # (a record of its own: stacked)
    loose.cost.copy_(recs[0].cost * 3)
    recs.append(loose)
    before = [r.cost.clone() for r in recs]
    shared = torch.tensor(4.0)
    for scales in ([2.0, 2.0, 2.0], [1, 1.0, 1.0], [shared, shared, shared], [shared, torch.tensor(4.0), shared],
                   [3.0, shared, 3.0]):
        for r, b in zip(recs, before):
            r.cost.copy_(b)
        ctl._writes.end_steps(recs, scales)
        together = [r.cost.clone() for r in recs]
        for r, b, scale in zip(recs, before, scales):
            r.cost.copy_(b)
            fold(r.cost.unsqueeze(0), scale, r.cost_sign)
            assert torch.equal(r.cost, together[recs.index(r)]), scales
        assert not torch.equal(together[0], before[0]) and together[0][:, :3].eq(0).all()


def test_a_step_that_measured_nothing_folds_a_window_unchanged(batch):
    """A layer without sums this step (its rows 0, folded with the whole buffer) keeps its window
    bitwise, and its step count: a measured step of another layer counts for it nowhere."""
    model, ctl = _converted(only=None, max_loss_cost=1.0)
    x, y = batch
    F.cross_entropy(model(x), y).backward()
    ctl.step()
    recs = list(ctl._layers.values())
    idle, busy = recs
    idle.cost[:, 3:] = torch.tensor([[-0.5, 3.0, 0.75, 1.5]] * 2)
    idle.cost[:, :3] = 0
    kept, counted = idle.cost.clone(), busy.cost[:, 4].clone()
    busy.cost[:, :3] = torch.tensor([[0.25, 0.5, 8.0]] * 2)
    ctl._writes.end_steps(recs, [1.0, 1.0])
    assert torch.equal(idle.cost, kept)
    assert torch.equal(busy.cost[:, 4], counted + 1) and busy.cost[:, :3].eq(0).all()


@pytest.mark.parametrize("kept", [(0,), (1,), (0, 1)], ids=["own", "below", "both"])
@pytest.mark.parametrize("sampled", [False, True], ids=["all-rows", "sampled-rows"])
def test_a_steps_sums_land_in_each_errors_own_row(kept, sampled):
    """``_accumulate_cost`` adds each error's ``sum(g * e)``, ``sum_t (g_t . e_t)**2`` and row count
    (scaled to the whole output where rows were sampled) to that error's row of the layer's
    buffer, and only there; a gate keeps a row only where its flag is set."""
    from mixprec.control._cost import _accumulate_cost

    gen = torch.Generator().manual_seed(4)
    grad, errors = torch.randn(3, 4, 8, generator=gen), {r: torch.randn(12, 8, generator=gen) for r in (0, 1)}
    rows = torch.tensor([1, 5, 9]) if sampled else None
    g2 = grad.reshape(12, 8) if rows is None else grad.reshape(12, 8)[rows]
    scale = 12 / 3 if sampled else 1.0
    for gate in (None, torch.tensor([False, True])):
        buf = torch.full((2, 7), 0.5)
        given = [(r, errors[r] if rows is None else errors[r][rows]) for r in kept]
        _accumulate_cost(buf, given, grad, gate, rows=rows, total=12)
        for r in (0, 1):
            expected = torch.full((7,), 0.5)
            if r in kept and (gate is None or gate[r]):
                per_row = (g2 * dict(given)[r]).sum(-1)
                expected[:3] += torch.stack([per_row.sum() * scale, per_row.square().sum() * scale, torch.tensor(12.0)])
            torch.testing.assert_close(buf[r], expected, msg=f"row {r}, errors {kept}, gate {gate}")
