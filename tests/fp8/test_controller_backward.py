"""The loss cost of the backward GEMMs (``Controller(max_backward_cost=...)``, issue 39): the
formula against a measured loss change, a planted large weight-gradient error promoted and a
harmless one not, the flush of the backward GEMMs' operands no longer deciding them, and the
loss scale divided out."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.utils.checkpoint
import torch.nn as nn
import torch.nn.functional as F

import mixprec
import mixprec.control._backward as backward_module
from mixprec.control._backward import backward_costs, cost_ratio, step_error, update_terms
from mixprec.formats._fp4_linear import Fp4Matmul
from mixprec.formats._recipe import Float8Recipe

LADDER = ("nvfp4", "tensorwise", "rowwise", "compute")


def test_the_cost_matches_the_loss_change_of_an_sgd_step():
    """``gain * c1 + gain**2 * c2`` (:func:`update_terms`; ``gain``: the first-order loss change
    of the step taken) against the loss change a planted weight-gradient error makes in an SGD
    step, measured on the step's own batch of a softmax classifier whose labels are drawn from
    its own predictions (so its empirical Fisher is its Hessian in expectation): a gradient
    shrunk, grown, flipped and noised, at two step sizes."""
    torch.manual_seed(0)
    x, w = torch.randn(512, 32), torch.randn(16, 32) * 0.3
    with torch.no_grad():
        y = torch.distributions.Categorical(logits=x @ w.t()).sample()
    wg = w.clone().requires_grad_()
    logits = x @ wg.t()
    logits.retain_grad()
    F.cross_entropy(logits, y).backward()
    grad, g2 = wg.grad, logits.grad

    def loss(v: torch.Tensor) -> float:
        return float(F.cross_entropy(x @ v.t(), y))

    for lr in (0.5, 2.0):
        gain = lr * float(grad.square().sum())
        for planted in (-0.5 * grad, 0.3 * grad, -2 * grad, 2 * torch.randn_like(grad) * grad.abs().mean()):
            measured = loss(w - lr * (grad + planted)) - loss(w - lr * grad)
            c1, c2 = update_terms(g2, x, grad, grad + planted).tolist()
            assert gain * c1 + gain ** 2 * c2 == pytest.approx(measured, rel=0.2), (lr, measured)
    assert float(cost_ratio(grad, torch.zeros_like(grad))) == pytest.approx(1.0)  # the whole gain, to first order


def _row(gain: float, reach: float = 1.0, end: float | None = None, shrink: float = 0.0) -> list[float]:
    """A layer's all-reduced row: own grad_input [first, shrink, curvature] = [0.1, shrink, 0],
    own grad_weight [0.2, shrink, 1.0], nothing below; its gain, reach and end slope."""
    terms = [0.1, shrink, 0.0, 0.2, shrink, 1.0] + [0.0] * 6
    return terms + [1, 1, 0, 0] + [gain, 1, reach] + ([-float("inf"), 0] if end is None else [end, 1])


def test_backward_costs_weigh_input_gradients_by_the_layers_before():
    costs = backward_costs([_row(0.5), None, _row(0.25), _row(-1.0)])
    assert costs[0][:4] == [0.0, pytest.approx(0.5 * 0.2 + 0.25 * 1.0), 0.0, 0.0]  # the first layer: nothing before it
    assert costs[1] is None
    assert costs[2][:2] == pytest.approx([0.5 * 0.1, 0.25 * 0.2 + 0.0625])
    assert costs[3][:2] == pytest.approx([0.75 * 0.1, 0.0])  # a negative gain counts as none
    assert costs[2][4:] == [1.0, 1.0, 0.0, 0.0]


def test_the_weight_gradients_shrink_is_weighed_by_the_end_slope_the_input_gradients_by_the_gains_before():
    """A shrunk step loses the loss's slope along it at its end (``-<G', dW>``, the next batch's
    gradient), not its first-order gain; an overshooting step (slope < 0) loses nothing by it.
    The first-order and curvature terms keep the gain; the input gradient's shrink is charged
    to the gains of the layers before it; without a measured slope the gain stands in."""
    first, second = backward_costs([_row(0.5, shrink=0.1), _row(0.4, end=0.05, shrink=0.1)])
    assert second[:2] == pytest.approx([0.5 * (0.1 + 0.1), 0.4 * 0.2 + 0.05 * 0.1 + 0.16 * 1.0])
    assert first[1] == pytest.approx(0.5 * 0.2 + 0.5 * 0.1 + 0.25 * 1.0)  # no slope yet: the gain
    overshoot = backward_costs([_row(0.5, shrink=0.1), _row(0.4, end=-0.3, shrink=0.1)])[1]
    assert overshoot[:2] == pytest.approx([0.1, 0.4 * 0.2 + 0.16 * 1.0])


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 16))


def _train(ctl: mixprec.Controller, steps: int = 30, seed: int = 0, loss_scale: float = 1.0,
           one_output: bool = False, sgd: bool = False, checkpointed: bool = False) -> list:
    model = _model(seed)
    ctl.attach(model)
    policy = mixprec.Policy.parse("compute=bf16").fp8("nvfp4", first_last="fp8", controller=ctl.settings,
                                                      backend="emulate_fp32")
    opt = torch.optim.SGD(model.parameters(), lr=0.1) if sgd else torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(seed + 1)
    target = torch.randn(64, 16, generator=gen)
    weights = torch.ones(16)
    if one_output:  # the loss is all in output 0: the others' gradients flush in its e2m1 block
        weights[1:] = 1e-3
    for _ in range(steps):
        x = torch.randn(64, 64, generator=gen)
        with mixprec.autocast("cpu", policy=policy):
            out = (torch.utils.checkpoint.checkpoint(model, x, use_reentrant=False,
                                                     context_fn=mixprec.checkpoint_context_fn) if checkpointed else model(x))
            loss = ((out.float() - target).square() * weights).mean()
        (loss * loss_scale).backward()
        if loss_scale != 1.0:
            for p in model.parameters():
                p.grad /= loss_scale
        opt.step()
        opt.zero_grad()
        ctl.step(loss_scale=loss_scale if loss_scale != 1.0 else None)
    return ctl.log


def _plant(monkeypatch, layer: int, size: float, seed: int = 0, where: str = "measured") -> None:
    """Make ``layer``'s NVFP4 weight-gradient GEMM add ``size`` times the weight gradient to its
    result (what a GEMM that biases its result would give: -3 flips it): as the measurement reads
    it (``where="measured"``: the own GEMM's result handed to the cost, and the rung below's
    emulation), or in training itself (``"training"``: the layer's own backward GEMM, which the
    cost then reads)."""
    shape = tuple(_model(seed)[2 * layer].weight.shape)  # (the layers' shapes tell them apart)
    original, backward, measure = backward_module.linear_grads, Fp4Matmul.backward, backward_module.BackwardCost._measure

    def biased(gw):
        return gw if gw is None or tuple(gw.shape) != shape else gw * (1 + size)

    def planted(x, w, g, recipe, wanted, backend):
        gi, gw = original(x, w, g, recipe, wanted, backend)
        return gi, biased(gw)

    if where == "training":  # (the layer's own GEMM, which records into its state: not an emulated copy)
        monkeypatch.setattr(Fp4Matmul, "backward", staticmethod(lambda ctx, grad_output: (lambda g: (
            g[0], biased(g[1]) if ctx.stats is not None else g[1], *g[2:]))(backward(ctx, grad_output))))
        return
    monkeypatch.setattr(backward_module, "linear_grads", planted)
    monkeypatch.setattr(backward_module.BackwardCost, "_measure",
                        lambda self, shadow, gi, gw: measure(self, shadow, gi, biased(gw)))


@pytest.mark.parametrize("reference, rel", [("float32", 1e-4), ("bfloat16", 2e-3)])
def test_the_end_slope_is_the_next_batchs_gradient_along_the_update(reference, rel):
    """The shadow step (step 3 of a window of 5) keeps the weight its update starts from; the
    next step's backward reads ``-<G', dW>`` with ``G'`` that step's float32 weight gradient of
    the head (from its output gradient and input) and ``dW`` the optimizer's update: the
    window's mean end slope, as the check after step 4 keeps it (from bfloat16 operands, within
    their rounding)."""
    torch.manual_seed(0)
    model = _model(0)
    ctl = mixprec.Controller(every=5, ladder=LADDER, per_gemm=True, max_backward_cost=1.0, reference=reference)
    ctl.attach(model)
    policy = mixprec.Policy.parse("compute=bf16").fp8("nvfp4", first_last="fp8", controller=ctl.settings,
                                                      backend="emulate_fp32")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    head, seen = model[4], {}

    def keep(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
        seen["x"] = args[0].detach()
        out.register_hook(lambda g: seen.update(g=g.detach()))

    head.register_forward_hook(keep)
    gen = torch.Generator().manual_seed(1)
    for step in range(5):
        with mixprec.autocast("cpu", policy=policy):
            loss = (model(torch.randn(64, 64, generator=gen)).float() - torch.randn(64, 16, generator=gen)).square().mean()
        loss.backward()
        before = head.weight.detach().clone()
        opt.step()
        opt.zero_grad()
        if step == 3:
            update = head.weight.detach() - before
        if step == 4:
            grad = seen["g"].float().t() @ seen["x"].float()
        ctl.step()
    assert float(ctl._layers["4"].backward.end_last) == pytest.approx(float(-(grad * update).sum()), rel=rel)


def test_a_checkpoint_keeps_the_update_in_flight_as_plain_data_and_refuses_a_broken_one():
    """Saved after the shadow step's update (step 3 of a window of 5), before the step that reads
    its end slope: each measured layer's entry keeps the update (a weight-shaped list: JSON goes
    through); end sums that are not two finite numbers are a ValueError at load, an update of
    another shape one at the layer's next forward, each saying what is wrong."""
    import json

    def fresh() -> tuple:
        model = _model(0)
        ctl = mixprec.Controller(every=5, ladder=LADDER, per_gemm=True, max_backward_cost=1.0)
        ctl.attach(model)
        policy = mixprec.Policy.parse("compute=bf16").fp8("nvfp4", first_last="fp8", controller=ctl.settings,
                                                          backend="emulate_fp32")
        with mixprec.autocast("cpu", policy=policy):
            model(torch.randn(2, 64))  # (the layers are known: a loaded state goes to them at once)
        return model, ctl, policy

    torch.manual_seed(0)
    model, ctl, policy = fresh()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    for _ in range(4):
        with mixprec.autocast("cpu", policy=policy):
            loss = (model(torch.randn(64, 64, generator=gen)).float() - torch.randn(64, 16, generator=gen)).square().mean()
        loss.backward()
        before = model[4].weight.detach().clone()
        opt.step()
        opt.zero_grad()
        ctl.step()
    state = json.loads(json.dumps(ctl.state_dict()))
    sums, last, update = state["layers"]["4"]["backward_cost"][5]
    assert torch.equal(torch.tensor(update), model[4].weight.detach() - before)
    fresh()[1].load_state_dict(state)
    for broken in ([[0.0], None, None], [[float("nan"), 1.0], None, None], "slopes"):
        bad = json.loads(json.dumps(state))
        bad["layers"]["4"]["backward_cost"][5] = broken
        with pytest.raises(ValueError, match="end slopes must be"):
            fresh()[1].load_state_dict(bad)
    bad = json.loads(json.dumps(state))
    bad["layers"]["4"]["backward_cost"][5][2] = [[0.0] * 3]
    resumed, ctl, policy = fresh()
    ctl.load_state_dict(bad)
    with pytest.raises(ValueError, match="load the state_dict of this model's controller"), \
            mixprec.autocast("cpu", policy=policy):
        resumed(torch.randn(2, 64))


def _backward_promotions(log: list) -> list:
    return [(d.layer, d.gemm, d.statistic) for d in log if d.gemm != "output" and d.action == "promote"]


def test_a_planted_weight_gradient_error_is_promoted_a_harmless_one_not(monkeypatch):
    settings = dict(every=5, ladder=LADDER, per_gemm=True, max_backward_cost=2e-3)
    clean = _train(mixprec.Controller(**settings))
    assert _backward_promotions(clean) == []
    _plant(monkeypatch, 2, -3.0)  # the head (Linear(64, 16)): its weight gradient flipped
    planted = _train(mixprec.Controller(**settings))
    ups = _backward_promotions(planted)
    assert ups and set(ups) == {("4", "grad_weight", "backward_cost")}, planted
    first = next(d for d in planted if d.gemm == "grad_weight")
    assert first.value > 2e-3 and first.from_ == "nvfp4" and first.to == "fp8-tensorwise"
    monkeypatch.undo()
    _plant(monkeypatch, 2, -0.01)  # a small bias costs next to nothing
    assert _backward_promotions(_train(mixprec.Controller(**settings))) == []


def test_the_own_casts_cost_reads_the_layers_own_backward_gemm():
    """The own casts' cost is measured on the weight gradient the layer's backward GEMM gave
    (no emulated copy of it): a bias planted in that GEMM (the head's gradient halved, trained by
    SGD, whose step follows it: about 9e-5 a step, the clean GEMM's at most 8e-6) is promoted by
    its cost, as measured; a harmless one is not."""
    settings = dict(every=5, ladder=LADDER, per_gemm=True, max_backward_cost=3e-5, normalized_updates=False)
    with pytest.MonkeyPatch.context() as mp:
        _plant(mp, 2, -0.5, where="training")
        ups = _backward_promotions(_train(mixprec.Controller(**settings), sgd=True))
    assert ups and set(ups) == {("4", "grad_weight", "backward_cost")}
    with pytest.MonkeyPatch.context() as mp:
        _plant(mp, 2, -0.01, where="training")
        assert _backward_promotions(_train(mixprec.Controller(**settings), sgd=True)) == []


def test_the_flush_rule_no_longer_decides_backward_gemms():
    """A loss whose every output but one weighs 1e-3: the head's output gradient holds one large
    value per e2m1 block of 16, which flushes the other 15, so the flush rule promotes the
    backward GEMMs that read it; what they flush costs the loss next to nothing, so with
    ``max_backward_cost`` they stay in fp4, and the decisions are the same with the fp4 flush
    limits off."""
    flush = _train(mixprec.Controller(every=5, ladder=LADDER, per_gemm=True), one_output=True)
    assert any(d.gemm != "output" and d.statistic == "underflow_forecast" for d in flush), flush
    settings = dict(every=5, ladder=LADDER, per_gemm=True, max_backward_cost=2e-3)
    costed = _train(mixprec.Controller(**settings), one_output=True)
    assert _backward_promotions(costed) == []
    off = _train(mixprec.Controller(**settings, fp4_max_underflow=1.0), one_output=True)
    assert [(d.step, d.layer, d.gemm, d.action) for d in off] == [(d.step, d.layer, d.gemm, d.action) for d in costed]


def test_the_loss_scale_is_divided_out(monkeypatch):
    _plant(monkeypatch, 2, -3.0)
    settings = dict(every=5, ladder=LADDER, per_gemm=True, max_backward_cost=2e-3)
    plain = [d for d in _train(mixprec.Controller(**settings)) if d.gemm == "grad_weight"]
    scaled = [d for d in _train(mixprec.Controller(**settings), loss_scale=1024.0) if d.gemm == "grad_weight"]
    assert plain and len(scaled) == len(plain)
    assert scaled[0].step == plain[0].step
    assert scaled[0].value == pytest.approx(plain[0].value, rel=0.1)


@pytest.mark.parametrize("stop, known", [(7, True), (9, True), (8, False)])
def test_a_resumed_run_decides_as_the_uninterrupted_one(monkeypatch, stop, known):
    """Saved mid-window (windows of 5: after step 7, between shadow steps; after step 9, a shadow
    step whose update's gain the next forward reads: the checkpoint keeps that gain; after step
    8, loaded before any forward has shown the layers, so the next step, a shadow step, is their
    first: each asks whether it measures), the controller's state (its backward-cost windows
    included), the model and the optimizer resume to the same decisions, with the same costs, as
    the run that went on."""
    _plant(monkeypatch, 2, -3.0)
    settings = dict(every=5, ladder=LADDER, per_gemm=True, max_backward_cost=2e-3)

    def run(stop: int | None, state: dict | None = None, end: int = 20) -> tuple:
        torch.manual_seed(0)
        model = _model(0)
        ctl = mixprec.Controller(**settings)
        ctl.attach(model)
        policy = mixprec.Policy.parse("compute=bf16").fp8("nvfp4", first_last="fp8", controller=ctl.settings,
                                                          backend="emulate_fp32")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        data = [(torch.randn(64, 64, generator=torch.Generator().manual_seed(s)), torch.randn(64, 16)) for s in range(20)]
        start = 0
        if state is not None:
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["opt"])
            if known:
                with mixprec.autocast("cpu", policy=policy):
                    model(data[0][0][:0])  # (the layers are known at a forward: the controller's state goes to them)
            ctl.load_state_dict(state["ctl"])
            start = state["step"]
        for step in range(start, end if stop is None else stop):
            x, target = data[step]
            with mixprec.autocast("cpu", policy=policy):
                loss = F.mse_loss(model(x).float(), target)
            loss.backward()
            opt.step()
            opt.zero_grad()
            ctl.step()
        saved = {"model": model.state_dict(), "opt": opt.state_dict(), "ctl": ctl.state_dict(), "step": stop}
        return ctl.log, saved

    whole, end = run(None)
    assert any(d.statistic == "backward_cost" for d in whole)
    _, saved = run(stop)
    resumed, resumed_end = run(None, copy.deepcopy(saved))  # (a resumed optimizer's state is the saved tensors)
    assert resumed == whole
    assert resumed_end["ctl"] == end["ctl"]  # every window, gain and reach (_reach.Reach.state) alike
    assert run(None, saved, end=10)[1]["ctl"] == run(None, end=10)[1]["ctl"]  # (the gain the check at 10 kept)


def test_the_late_phase_tightens_the_cost_limits(monkeypatch):
    """``late_start``: a weight-gradient GEMM whose cost (planted, above 2e-3) is far under the
    limit (1.0) is promoted only once the late phase's limit (1.0 * 2e-3) applies: over it at the
    first check from step 15 on, promoted at the second (``BACKWARD_WINDOWS`` checks in a row;
    ``FAR`` times over, but not the run's first check)."""
    _plant(monkeypatch, 2, -3.0)
    log = _train(mixprec.Controller(every=5, ladder=LADDER, per_gemm=True, max_backward_cost=1.0, late_start=15,
                                    late_factor=2e-3), steps=25)
    ups = [d for d in log if d.statistic == "backward_cost"]
    assert ups and ups[0].step == 20 and ups[0].threshold == pytest.approx(2e-3), log
    assert ups[0].value > backward_module.FAR * 2e-3
    assert ("4", "grad_weight") in {(d.layer, d.gemm) for d in ups}
    assert not [d for d in _train(mixprec.Controller(every=5, ladder=LADDER, per_gemm=True, max_backward_cost=1.0),
                                  steps=25) if d.statistic == "backward_cost"]


@pytest.mark.parametrize("costs, promoted_at", [
    ((1.5, 0.5, 0.5), None),   # over once by chance (under FAR times): nothing
    ((0.5, 1.5, 1.5), 15),     # over in two windows in a row: promoted at the second
    ((1.5, 0.5, 1.5), None),   # never twice in a row
    ((2.5, 0.5, 0.5), 5),      # FAR times over at the first check: promoted at once
    ((0.5, 2.5, 0.5), None),   # FAR times over later, once: a spike, nothing
])
def test_one_window_over_the_limit_by_chance_promotes_nothing(monkeypatch, costs, promoted_at):
    """A backward GEMM's cost is one step's estimate per window: over ``max_backward_cost`` in one
    window and under it in the next, nothing is promoted; over it in ``BACKWARD_WINDOWS`` windows
    in a row, or ``FAR`` times over it at the first check, promoted (the head's weight-gradient
    cost replaced by ``costs`` times the limit, check after check; the rest as measured)."""
    limit = 2e-3
    assert backward_module.BACKWARD_WINDOWS == 2 and backward_module.FAR == 2.0
    measured, script = backward_module.backward_costs, iter(costs)

    def scripted(backs):
        out = measured(backs)
        head = out[-1]
        head[1], head[5] = next(script) * limit, 1.0  # (own grad_weight cost, measured)
        return out

    monkeypatch.setattr(backward_module, "backward_costs", scripted)
    log = _train(mixprec.Controller(every=5, ladder=LADDER, per_gemm=True, max_backward_cost=limit), steps=15)
    ups = [d for d in log if d.statistic == "backward_cost" and d.layer == "4" and d.gemm == "grad_weight"]
    assert [d.step for d in ups] == ([] if promoted_at is None else [promoted_at]), log


def test_late_settings_say_what_they_need():
    with pytest.raises(ValueError, match="late_start"):
        mixprec.Controller(late_factor=0.5, per_gemm=True, max_loss_cost=1e-3)
    with pytest.raises(ValueError, match="needs max_loss_cost or max_backward_cost"):
        mixprec.Controller(late_start=10)
    with pytest.raises(ValueError, match="late_factor"):
        mixprec.Controller(late_start=10, late_factor=0.0, max_loss_cost=1e-3)


def test_max_backward_cost_needs_per_gemm():
    with pytest.raises(ValueError, match="per_gemm=True"):
        mixprec.Controller(max_backward_cost=1e-3)
    with pytest.raises(ValueError, match="max_backward_cost"):
        mixprec.Controller(per_gemm=True, max_backward_cost=-1.0)


def test_a_checkpointed_model_measures_and_decides_as_the_plain_one():
    """Activation checkpointing (recomputed in the forward's policy): the backward GEMMs' cost is
    measured on the recomputed forward's GEMMs, bitwise the windows and decisions of the plain
    run (a planted bias in the head's own weight-gradient GEMM promotes it in both)."""
    settings = dict(every=5, ladder=LADDER, per_gemm=True, max_backward_cost=3e-5, normalized_updates=False)
    runs = []
    for checkpointed in (False, True):
        with pytest.MonkeyPatch.context() as mp:
            _plant(mp, 2, -0.5, where="training")
            ctl = mixprec.Controller(**settings)
            log = _train(ctl, 20, sgd=True, checkpointed=checkpointed)
        runs.append((log, [r.backward.window.clone() for r in ctl._layers.values()]))
    (plain, plain_windows), (recomputed, windows) = runs
    assert _backward_promotions(plain) and recomputed == plain
    assert all(torch.equal(a, b) for a, b in zip(plain_windows, windows))


STEP_ERRORS = {  # (reference, error): the error a normalizing optimizer's step sees
    "shrunk": ([1.0, 2.0], [-0.5, -1.0], [0.0, 0.0]),
    "grown": ([1.0, 2.0], [2.0, 4.0], [0.0, 0.0]),
    "turned": ([1.0, 0.0], [0.0, 1.0], [0.0, 1.0]),
    "shrunk and turned": ([1.0, 0.0], [-0.5, 0.5], [0.0, 1.0]),  # across R, against the halved result
    "flipped": ([1.0, 0.0], [-3.0, 0.0], [-3.0, 0.0]),
    "lost": ([1.0, 0.0], [-1.0, 0.0], [-1.0, 0.0]),
}


@pytest.mark.parametrize("case", STEP_ERRORS.values(), ids=STEP_ERRORS.keys())
def test_step_error(case):
    reference, error, expected = (torch.tensor(v) for v in case)
    assert torch.allclose(step_error(reference, error), expected)


def test_step_error_is_across_the_gradient_and_scale_free():
    torch.manual_seed(0)
    r, e = torch.randn(16, 32), 0.3 * torch.randn(16, 32)
    out = step_error(r, e)
    assert abs(float((out * r).sum())) < 1e-4 * float(r.norm() * out.norm())  # no first-order cost
    assert torch.allclose(step_error(2.5 * r, 2.5 * e), 2.5 * out, atol=1e-5)  # in the gradient's units: a loss scale cancels in the cost
    # what AdamW's step sees: the result's direction, (1 + a) R + (E - a R), over its scale
    a = float((r * e).sum() / r.square().sum())
    assert torch.allclose((r + e) / (1 + a), r + out, atol=1e-5)


def test_a_gradient_halved_is_promoted_under_sgd_not_under_adamw():
    """``normalized_updates``: the head's weight gradient halved on every step (its own GEMM)
    halves SGD's step, a scale AdamW's steps do not see (each is the gradient over its own running
    scale): promoted by its cost with ``normalized_updates=False`` under SGD, not with the default
    under AdamW; a flipped gradient is promoted under AdamW too (test above). Under AdamW the
    clean NVFP4 GEMMs' noise costs this toy 1-2e-4 a step (the second moment it inflates shrinks
    every step: ``gain * share / 2``), so AdamW's limit sits above it, where the halving would be
    promoted if AdamW saw the scale (planted below: ``step_error`` as identity); SGD's at 3e-5."""
    settings = dict(every=5, ladder=LADDER, per_gemm=True)
    with pytest.MonkeyPatch.context() as mp:
        _plant(mp, 2, -0.5, where="training")
        assert _backward_promotions(_train(mixprec.Controller(**settings, max_backward_cost=5e-4))) == []
        assert ("4", "grad_weight", "backward_cost") in _backward_promotions(
            _train(mixprec.Controller(**settings, max_backward_cost=3e-5, normalized_updates=False), sgd=True))
        mp.setattr(backward_module, "step_error", lambda reference, error: error)
        assert ("4", "grad_weight", "backward_cost") in _backward_promotions(
            _train(mixprec.Controller(**settings, max_backward_cost=5e-4)))


def test_normalized_updates_is_a_bool_that_takes_effect():
    with pytest.raises(ValueError, match="normalized_updates must be True"):
        mixprec.Controller(per_gemm=True, max_backward_cost=1e-4, normalized_updates="adam")
    with pytest.raises(ValueError, match="takes effect with max_backward_cost"):  # (nothing it would shape)
        mixprec.Controller(per_gemm=True, normalized_updates=False)


@pytest.mark.parametrize("normalized", [True, False])
def test_the_input_gradients_error_is_costed_as_the_optimizer_sees_it(normalized):
    """The layer's own input-gradient GEMM gave half the float32 result: a scale the layers before
    it would take out of their normalized steps (no cost), or half their step's gain lost (SGD)."""
    torch.manual_seed(0)
    x, w, g = torch.randn(8, 32), torch.randn(16, 32), torch.randn(8, 16)
    cost = backward_module.BackwardCost(torch.device("cpu"))
    cost.recipes = [(0, Float8Recipe.from_name("nvfp4"), (True, True))]
    cost.normalized = normalized
    shadow = backward_module._Shadow(x, w, w, True)
    shadow.grad = g
    cost._measure(shadow, 0.5 * (g @ w), g.t() @ x)
    c1, shrink, share_term, count = cost.window[0, 0].tolist()
    assert count == 1
    assert (c1, shrink, share_term) == ((pytest.approx(0.0, abs=1e-6), pytest.approx(0.0, abs=1e-12),
                                         pytest.approx(0.0, abs=1e-12)) if normalized
                                        else (pytest.approx(0.5), 0.0, pytest.approx(share_term)))
    assert normalized or share_term > 0


@pytest.mark.parametrize("normalized", [True, False])
def test_noise_costs_half_its_share_of_the_gain_under_normalized_updates(normalized):
    """Noise in either backward GEMM's result inflates a normalizing optimizer's second moment,
    so every step it steers shrinks by about half the noise's squared share: its shrink term
    is ``share / 2`` (``share``: the error's part across the result, squared, against the
    result's), its first-order term about 0; under SGD the noise has no first-order cost and no
    shrink (the curvature term prices it)."""
    torch.manual_seed(0)
    x, w, g = torch.randn(8, 32), torch.randn(16, 32), torch.randn(8, 16)
    gi, gw = g @ w, g.t() @ x
    noise_i, noise_w = 0.2 * torch.randn_like(gi) * gi.std(), 0.3 * torch.randn_like(gw) * gw.std()
    cost = backward_module.BackwardCost(torch.device("cpu"))
    cost.recipes = [(0, Float8Recipe.from_name("nvfp4"), (True, True))]
    cost.normalized = normalized
    shadow = backward_module._Shadow(x, w, w, True)
    shadow.grad = g
    cost._measure(shadow, gi + noise_i, gw + noise_w)
    (ci, si, _, _), (cw, sw, _, _) = cost.window[0].tolist()
    for c, shrink, ref, noise in ((ci, si, gi, noise_i), (cw, sw, gw, noise_w)):
        across = step_error(ref, noise) if normalized else noise
        share = float(across.square().sum() / ref.square().sum())
        assert c == pytest.approx(float(cost_ratio(ref, ref + across)), rel=1e-4, abs=1e-7)
        assert shrink == (pytest.approx(share / 2, rel=1e-4) if normalized else 0.0)
        assert not normalized or abs(c) < 0.05 * share / 2  # (across the result: next to no first-order share)


def _backward_costs_per_check(monkeypatch, reverse: bool) -> list:
    """The backward costs each check computes (``_controller.peel``'s), training as ``_train``
    does; ``reverse``: the controller's records listed in reverse after the first step (as on a
    rank that took the first layers from its peer's metadata: a peer's records come last)."""
    from mixprec.control import _backward, _controller
    seen, peel = [], _backward.peel
    monkeypatch.setattr(_controller, "peel", lambda *a: (seen.append((out := peel(*a))[1]), out)[1])
    model = _model(0)
    ctl = mixprec.Controller(every=5, ladder=LADDER, per_gemm=True, max_backward_cost=1.0)
    ctl.attach(model)
    policy = mixprec.Policy.parse("compute=bf16").fp8("nvfp4", first_last="fp8", controller=ctl.settings,
                                                      backend="emulate_fp32")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    target = torch.randn(64, 16, generator=gen)
    for step in range(20):
        with mixprec.autocast("cpu", policy=policy):
            loss = (model(torch.randn(64, 64, generator=gen)).float() - target).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        ctl.step()
        if reverse and step == 0:
            ctl._layers = dict(reversed(list(ctl._layers.items())))
    return seen


def test_the_backward_costs_sum_the_upstream_gains_in_the_layers_first_reached_order_whatever_the_records_order(
        monkeypatch):
    """An input gradient's cost sums the gains of the layers before it (``backward_costs``): in
    the order the layers were first reached (``LayerRecord.order``, a peer's taken from its
    metadata), not the order a rank happens to hold its records in."""
    plain = _backward_costs_per_check(monkeypatch, reverse=False)
    reordered = _backward_costs_per_check(monkeypatch, reverse=True)
    assert len(plain) == 4 and plain == reordered
    assert any(c is not None and c[0] > 0 for check in plain for c in check.values())  # (input-gradient costs measured)
