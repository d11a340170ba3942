"""A per-GEMM Controller measures only the cast statistics a check reads (issue 39): a backward
GEMM its measured loss cost decides (``max_backward_cost``) is not judged by its operands' flush,
so the probe does not cast samples of them; a non-finite operand still promotes it (read from the
layer's own statistics, every step); the flags resume with the controller's state."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import mixprec

LADDER = ("nvfp4", "tensorwise", "rowwise", "compute")
SETTINGS = dict(every=5, ladder=LADDER, per_gemm=True, max_backward_cost=2e-3)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 16))


def _run(ctl: mixprec.Controller, model: nn.Module, steps: range, poison: int | None = None) -> None:
    """Train ``model`` on ``steps`` (each its own batch); on step ``poison`` the middle layer's
    output gradient holds an infinity."""
    policy = mixprec.Policy.parse("compute=bf16").fp8("nvfp4", first_last="fp8", controller=ctl.settings,
                                                      backend="emulate_fp32")
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in steps:
        gen = torch.Generator().manual_seed(step)
        x, target = torch.randn(64, 64, generator=gen), torch.randn(64, 16, generator=gen)
        handle = None
        if step == poison:
            handle = model[2].register_forward_hook(_poisoned)
        with mixprec.autocast("cpu", policy=policy):
            loss = F.mse_loss(model(x).float(), target)
        loss.backward()
        if handle is not None:
            handle.remove()
            model.zero_grad()  # (the weights stay finite: only the statistics saw the infinity)
        else:
            opt.step()
        opt.zero_grad()
        ctl.step()


def _poisoned(module: nn.Module, inputs: tuple, out: torch.Tensor) -> None:
    out.register_hook(lambda g: g.index_fill(0, torch.tensor([0]), float("inf")))


def test_backward_gemms_decided_by_their_cost_are_not_measured():
    """After checks that measured the backward GEMMs' costs, the next window's shadow steps
    measure the forward GEMM's own casts and no backward GEMM's (eager code: no sample cast)."""
    ctl = mixprec.Controller(**SETTINGS)
    model = _model()
    ctl.attach(model)
    _run(ctl, model, range(19))  # checks at 5, 10, 15; steps 18 and 19 are the shadow steps of the 4th window
    by_cost = [name for name, rec in ctl._layers.items() if not any(rec.stats_read[0][1:])]
    assert by_cost, {name: rec.stats_read for name, rec in ctl._layers.items()}
    for name in by_cost:
        windows = ctl._layers[name].gemm_windows
        assert windows[0, 0, :, 0].min() > 0  # the forward GEMM's own casts: measured (amax)
        assert windows[0, 1:, :, :-1].abs().sum() == 0  # the backward GEMMs' own casts: not


def test_a_nonfinite_gradient_promotes_a_backward_gemm_its_cost_decides():
    """An infinity in the middle layer's output gradient on a step the probe does not measure
    (not a shadow step), once its backward GEMMs are decided by their cost: the layer's own
    statistics saw it, and the check promotes both backward GEMMs that read it to the compute
    dtype; without the infinity, nothing is promoted for a non-finite value."""
    for poison in (None, 16):
        ctl = mixprec.Controller(**SETTINGS)
        model = _model()
        ctl.attach(model)
        _run(ctl, model, range(20), poison=poison)
        assert not any(ctl._layers["2"].stats_read[0][1:])  # (decided by cost when the infinity came)
        nonfinite = [(d.step, d.layer, d.gemm) for d in ctl.log if d.statistic == "nonfinite"]
        if poison is None:
            assert nonfinite == []
        else:
            assert {(20, "2", "grad_input"), (20, "2", "grad_weight")} <= set(nonfinite), ctl.log
            assert ctl.precision("2", "grad_weight") == "bf16"


def test_the_flags_resume_with_the_state():
    """``stats_read`` (and the backward costs' count of checks over the limit) go into the
    state_dict and come back; a malformed entry is a ValueError."""
    ctl = mixprec.Controller(**SETTINGS)
    model = _model()
    ctl.attach(model)
    _run(ctl, model, range(12))
    state = ctl.state_dict()
    flags = {name: rec.stats_read for name, rec in ctl._layers.items()}
    assert any(not all(kind) for f in flags.values() for kind in f)
    fresh = mixprec.Controller(**SETTINGS)
    copy = _model()
    fresh.attach(copy)
    policy = mixprec.Policy.parse("compute=bf16").fp8("nvfp4", first_last="fp8", controller=fresh.settings,
                                                      backend="emulate_fp32")
    with mixprec.autocast("cpu", policy=policy):
        copy(torch.randn(2, 64))
    fresh.load_state_dict(state)
    assert {name: rec.stats_read for name, rec in fresh._layers.items()} == flags
    for key, value in (("stats_read", [[True]]), ("stats_read", [["False"] * 3, [True] * 3]),
                       ("backward_over", [1]), ("backward_over", [0, -1, 0]), ("backward_over", [0.5, 0, 0])):
        bad = {**state, "layers": {n: {**d, key: value} for n, d in state["layers"].items()}}
        with pytest.raises(ValueError, match=key):
            fresh.load_state_dict(bad)


def test_flags_loaded_before_the_layers_are_reached_are_kept():
    """A state loaded before the layers are tracked (a resume's first forward comes after
    ``load_state_dict``) keeps its flags: the records made at that forward take them."""
    settings = {**SETTINGS, "max_loss_cost": 1e-6, "max_backward_cost": 1e-6}
    ctl = mixprec.Controller(**settings)
    model = _model()
    ctl.attach(model)
    _run(ctl, model, range(12))
    flags = {name: rec.stats_read for name, rec in ctl._layers.items()}
    assert any(f != [[True] * 3] * 2 for f in flags.values()), flags  # (not a fresh record's)
    fresh = mixprec.Controller(**settings)
    fresh.load_state_dict(ctl.state_dict())
    copy = _model()
    fresh.attach(copy)
    _run(fresh, copy, range(12, 13))
    assert {name: rec.stats_read[0] for name, rec in fresh._layers.items()} == {n: f[0] for n, f in flags.items()}


class _LateBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.late = _model(), nn.Linear(64, 64)

    def forward(self, x: torch.Tensor, late: bool) -> torch.Tensor:
        return self.body(self.late(x) if late else x)


def test_a_layer_reached_after_the_shadow_step_reads_its_casts_the_next_window():
    """A layer first reached after its first window's shadow step (a branch taken late) has no
    backward cost measured there: its check reads neither, and its next window measures its
    backward GEMMs' casts (their flush judges them until a cost is measured)."""
    model = _LateBranch()
    ctl = mixprec.Controller(**SETTINGS)
    ctl.attach(model)
    policy = mixprec.Policy.parse("compute=bf16").fp8("nvfp4", first_last="fp8", controller=ctl.settings,
                                                      backend="emulate_fp32")
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(5):
        x = torch.randn(64, 64)
        with mixprec.autocast("cpu", policy=policy):
            # the branch first reached on the window's last step, after its first shadow step
            F.mse_loss(model(x, late=step == 4).float(), torch.randn(64, 16)).backward()
        opt.step()
        opt.zero_grad()
        ctl.step()
    assert ctl._layers["late"].stats_read[0] == [True, True, True]
    assert all(rec.stats_read[0] == [True, False, False] for name, rec in ctl._layers.items() if name != "late"), {
        name: rec.stats_read for name, rec in ctl._layers.items()}
