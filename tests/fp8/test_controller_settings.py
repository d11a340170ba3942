"""Every Controller and Guard setting is checked at construction (a ValueError naming it and
its range, never an error steps later), forecasts far ahead of an exploding amax stay finite,
and a layer whose recipe is not on the ladder is told exactly which ladder to pass."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import mixprec
from mixprec import Controller, Policy, fp8

NAN, INF = float("nan"), float("inf")
# setting -> values that must be refused (each alone, the others at their defaults)
CONTROLLER_BAD = {
    "max_underflow": [-0.1, 1.5, NAN, INF, True, "0.05", None],
    "max_nonfinite": [-1, NAN, True, "0"],
    "max_range": [-0.1, 2.0, NAN, INF, True],
    "demote_underflow": [-0.01, NAN, 0.06, True],  # 0.06: above max_underflow
    "demote_range": [-1.0, NAN, 0.5, True],  # 0.5: above max_range
    "every": [0, -1, 1.5, True, None],
    "horizon": [0, 101, 100000, 2.0, True],
    "ema": [0, -0.5, 1.5, NAN, True],
    "trend_windows": [0, 1.0, True],
    "demote_windows": [0, -3, True],
    "min_dwell": [-1, 0.5, True],
    "max_switches": [0, True],
    "budget_steps": [0, 10.0, True],
    "sample": [0, -4096, True],
    "shadow_steps": [0, 2.0, True],
    "ladder": [("compute", "tensorwise"), ("tensorwise",), ("tensorwise", "bogus", "compute"), "tensorwise"],
    "floor": ["compute", "mxfp8", 3],
    "reference": ["fp16", "bf16", None, 1, "float32"],  # "float32": no loss-cost limit for it to serve
}
CONTROLLER_GOOD = {
    "max_underflow": [0.01, 1, 0.2], "max_nonfinite": [None, 0, 5.5], "max_range": [0.03125, 1],
    "demote_underflow": [0, 0.05], "demote_range": [0, 0.25], "every": [1, 1000], "horizon": [1, 100],
    "ema": [1, 0.01], "trend_windows": [1, 50], "demote_windows": [1], "min_dwell": [0], "max_switches": [1],
    "budget_steps": [1], "sample": [1], "shadow_steps": [1, 10],
    "ladder": [("tensorwise", "compute"), ("rowwise", "mxfp8", "blockwise", "compute", "fp32")],
    "floor": [None, "tensorwise"],
    "reference": ["auto"],
}
GUARD_BAD = {
    "max_saturated": [-0.1, 1.5, NAN, True, "0"],
    "max_underflow": [-0.1, 1.01, NAN, INF, True],
    "max_nonfinite": [-1, NAN, True],
    "min_sqnr_db": [NAN, INF, -INF, True, "20"],
    "every": [0, -1, 2.0, True, None],
}
GUARD_GOOD = {"max_saturated": [None, 0, 1], "max_underflow": [None, 0, 1], "max_nonfinite": [None, 0, 3],
              "min_sqnr_db": [None, 20, -5.5], "every": [1, 500]}


@pytest.mark.parametrize("name,value", [(n, v) for n, vs in CONTROLLER_BAD.items() for v in vs])
def test_controller_refuses_each_setting_out_of_range(name, value):
    with pytest.raises(ValueError, match=rf"Controller\.{name}|Controller: demote_underflow"):
        Controller(**{name: value})


@pytest.mark.parametrize("name,value", [(n, v) for n, vs in CONTROLLER_GOOD.items() for v in vs])
def test_controller_takes_each_setting_at_its_bounds(name, value):
    assert getattr(Controller(**{name: value}), name) == value


@pytest.mark.parametrize("name,value", [(n, v) for n, vs in GUARD_BAD.items() for v in vs])
def test_guard_refuses_each_setting_out_of_range(name, value):
    with pytest.raises(ValueError, match=rf"Guard\.{name}"):
        fp8.Guard(**{name: value})


@pytest.mark.parametrize("name,value", [(n, v) for n, vs in GUARD_GOOD.items() for v in vs])
def test_guard_takes_each_setting_at_its_bounds(name, value):
    assert getattr(fp8.Guard(**{name: value}), name) == value


def test_a_far_horizon_on_an_exploding_amax_promotes_without_overflow():
    """horizon=100 windows of 1 step: an input amax that grows 2**30 per step forecasts a rise of
    2**3000 (OverflowError in float arithmetic): the forecast is capped, the layer promoted."""
    torch.manual_seed(0)
    model = fp8.convert(nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 32)),
                        controller=(ctl := Controller(every=1, horizon=100, trend_windows=1)))
    for step in range(6):
        x = torch.randn(8, 32)
        x[0, 0] *= 2.0 ** (30 * step - 60)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(x).float().square().mean().backward()
        ctl.step()
    promotions = [d for d in ctl.log if d.action == "promote"]
    assert promotions and promotions[0].layer == "1" and promotions[0].operand == "input"
    assert all(math.isfinite(d.value) for d in ctl.log)


@pytest.mark.parametrize("recipe,ladder", [
    ("mxfp8", ("tensorwise", "rowwise", "mxfp8", "compute", "fp32")),
    ("blockwise", ("tensorwise", "rowwise", "blockwise", "compute", "fp32")),
    ("rowwise_with_gw_hp", ("tensorwise", "rowwise", "rowwise_with_gw_hp", "compute", "fp32")),
])
def test_a_recipe_off_the_ladder_says_which_ladder_to_pass(recipe, ladder):
    policy = Policy.parse("compute=bf16").fp8(recipe, controller=Controller(), first_last="fp8")
    model = nn.Sequential(nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 128))
    with pytest.raises(ValueError, match="pass Controller") as err:
        with mixprec.autocast("cpu", policy=policy):
            model(torch.randn(4, 128))
    assert f"Controller(ladder={ladder!r})" in str(err.value)
    # what it says to pass runs
    ok = Policy.parse("compute=bf16").fp8(recipe, controller=Controller(ladder=ladder), first_last="fp8")
    with mixprec.autocast("cpu", policy=ok):
        model(torch.randn(4, 128))
    assert ok.fp8_rule.live.precisions() == {"0": f"fp8-{recipe}", "2": f"fp8-{recipe}"}
