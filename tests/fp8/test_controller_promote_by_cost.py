"""A forward GEMM over its loss limit is promoted to the rung its cost calls for
(``_ladder.past_costly``): the cost scaled by the ratio of the rungs' rounding
(``_ladder.output_roundoff``, the smaller of an error's two falls) must fit ``max_loss_cost``,
so a rung that rounds no finer is passed by, never past the compute dtype; a rung passed by that
would fit is found by demotion. At a check, early, per GEMM and per layer."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from mixprec import Controller, fp8
from mixprec.control._check import Check
from mixprec.control._decide import OVER_WINDOWS, up_by_cost
from mixprec.control._ladder import output_roundoff, past_costly
from mixprec.control._settings import ControllerSettings
from mixprec.fp8 import Float8Recipe

from test_controller_loss_cost import _model, batch  # noqa: F401  (the sharp logits: NVFP4 ~0.005 nats, fp8 under a fifth)

CROSS_ISA = pytest.mark.cross_isa
FP4, FP8, BF16 = math.hypot(2 ** -2, 2 ** -2), math.hypot(2 ** -4, 2 ** -4), math.hypot(2 ** -8, 2 ** -8)

# (cost, limit, here, above, the rung picked)
PICKS = [
    (6e-3, 1e-3, FP4, [(1, FP8), (2, FP8), (3, BF16)], 3),   # fp8 would still cost 1.5e-3: past both fp8 rungs
    (2e-3, 1e-3, FP4, [(1, FP8), (2, FP8), (3, BF16)], 1),   # fp8 fits (5e-4)
    (4e-3, 1e-3, FP4, [(1, FP8), (3, BF16)], 1),             # exactly at the limit: fits
    (4.01e-3, 1e-3, FP4, [(1, FP8), (3, BF16)], 3),
    (1.1e-3, 1e-3, FP8, [(2, FP8), (3, BF16)], 3),           # another fp8 rung rounds no finer
    (1.0, 1e-3, FP4, [(1, FP8), (3, BF16)], 3),              # nothing fits: the last (the caller's compute)
    (6e-3, 1e-3, FP4, [(2, BF16)], 2),                       # only one rung above
]


@pytest.mark.parametrize("cost, limit, here, above, picked", PICKS)
def test_the_rung_picked_is_the_first_whose_scaled_cost_fits(cost, limit, here, above, picked):
    assert past_costly(cost, limit, here, above) == picked


@pytest.mark.parametrize("recipe, compute, expected", [
    ("nvfp4", torch.bfloat16, FP4), ("mxfp4", torch.bfloat16, FP4), ("tensorwise", None, FP8),
    ("rowwise", None, FP8), ("mxfp8", None, FP8), ("blockwise", None, FP8), ("rowwise_with_gw_hp", None, FP8),
    (None, torch.bfloat16, BF16), (None, torch.float16, math.hypot(2 ** -11, 2 ** -11)),
    (None, None, math.hypot(2 ** -24, 2 ** -24)),
])
def test_a_rungs_roundoff_is_its_forward_operands_formats(recipe, compute, expected):
    r = None if recipe is None else Float8Recipe.from_name(recipe)
    assert output_roundoff(r, compute) == pytest.approx(expected, rel=1e-12)


def test_fp32_above_the_compute_dtype_is_never_a_cost_promotions():
    """fp32 is the whole layer's rung for fp16 range trouble (no GEMM comes down from it)."""
    at = Check.of(ControllerSettings(ladder=("nvfp4", "tensorwise", "compute", "fp32"), max_loss_cost=1e-3), compute=torch.float16)
    assert up_by_cost(at, 1e3, 0, [1, 2, 3]) == 2
    assert up_by_cost(at, 2e-3, 0, [1, 2, 3]) == 1


def _run(batch, steps: int, **settings) -> Controller:
    ctl = Controller(**{"every": 2, "ladder": ("nvfp4", "tensorwise", "rowwise", "compute"), "floor": "nvfp4",
                        "fp4_max_underflow": 0.5, "fp4_demote_underflow": 0.4, **settings})
    model = fp8.convert(_model(), "nvfp4", filter_fn=lambda m, n: n == "2", controller=ctl, backend="emulate_fp32")
    x, y = batch
    for _ in range(steps):
        F.cross_entropy(model(x), y).backward()
        model.zero_grad()
        ctl.step()
    return ctl


@CROSS_ISA
@pytest.mark.parametrize("per_gemm", [True, False])
@pytest.mark.parametrize("limit, to", [(5e-4, "fp32"), (3e-3, "fp8-tensorwise")])
def test_a_costly_forward_goes_to_the_rung_its_cost_calls_for(batch, per_gemm, limit, to):
    """NVFP4's ~0.005 nats over 5e-4: fp8 would cost ~1.2e-3, over it too, so both fp8 rungs are
    passed by (the compute dtype: float32 here); over 3e-3, fp8 fits. At the second check (two
    readings over the limit: ``OVER_WINDOWS``)."""
    ctl = _run(batch, 4, per_gemm=per_gemm, max_loss_cost=limit)
    (d,) = ctl.log
    assert (d.step, d.statistic, d.from_, d.to) == (2 * OVER_WINDOWS, "loss_cost", "nvfp4", to)
    assert d.value / 4 > limit if to == "fp32" else d.value / 4 <= limit < d.value
    assert ctl.precision("2") == to


@CROSS_ISA
def test_early_promotions_go_to_the_rung_their_mean_calls_for(batch):
    ctl = _run(batch, 9, every=10, per_gemm=True, max_loss_cost=5e-4)
    (d,) = ctl.log
    assert "early" in d.reason and (d.from_, d.to) == ("nvfp4", "fp32")


@CROSS_ISA
def test_a_rung_passed_by_that_fits_is_found_by_demotion(batch):
    """Passed by at first (NVFP4's ~0.005 over 5e-4, fp8 forecast over it too), the fp8 rungs'
    forwards are measured as the rung below (tensorwise's ~2.4e-4, cheap under
    ``demote_loss_cost=4.5e-4``): it comes down to rowwise, then tensorwise, two clean windows
    each, and stays (NVFP4's below it costs ~0.005)."""
    ctl = _run(batch, 16, per_gemm=True, max_loss_cost=5e-4, demote_loss_cost=4.5e-4, demote_windows=2, min_dwell=0)
    moves = [(d.action, d.from_, d.to) for d in ctl.log]
    assert moves[:3] == [("promote", "nvfp4", "fp32"), ("demote", "fp32", "fp8-rowwise"),
                         ("demote", "fp8-rowwise", "fp8-tensorwise")]
    assert ctl.precision("2", "output") == "fp8-tensorwise"
