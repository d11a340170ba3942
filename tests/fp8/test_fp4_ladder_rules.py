"""The fp4 ladder's rules (``Controller`` with ``nvfp4``/``mxfp4`` rungs), each checked against the
statistic it protects: an e2m1 block cast's flush does not depend on the tensor's scale (so a
growing amax forecasts nothing for it), NVFP4's weight-gradient operands are measured after the
Hadamard transform the GEMM applies, a demotion to fp4 that had to be undone makes the next one
wait twice as long, and a backward GEMM promoted from NVFP4 takes the fp8 rung that composes."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from mixprec import Controller
from mixprec.fp8 import ControllerSettings
from mixprec.control._check import Check
from mixprec.control._decide import gemm_up
from mixprec.formats._fp4 import quantize
from mixprec.formats._hadamard import hadamard, hadamard_matrix
from mixprec.control._ladder import LayerRecord, compose, gemm_casts
from mixprec.control._measure import measure
from mixprec.formats._recipe import Cast, Float8Recipe
from mixprec.formats._state import LayerState, new_window, record_cast
from mixprec.control._trend import Trend, demote_windows, underflow_forecast

from _train_cases import CASES, WeightedLoss, train

NV, MX = Cast("e2m1", "1x16"), Cast("e2m1", "1x32")


def _gaussian(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(64, 64, generator=g)  # e2m1 blocks flush about 7% (NVFP4) to 11% (MXFP4)


@pytest.mark.parametrize("cast, factor", [(NV, 37.3), (NV, 1e-3), (MX, 2.0 ** 7), (MX, 2.0 ** -9)])
def test_an_e2m1_block_cast_flushes_the_same_elements_at_any_scale(cast, factor):
    """The statistic behind ``scale_free``: NVFP4's tensor scale is the amax, MXFP4's power-of-2
    block scales follow it exactly, so ``c * x`` flushes what ``x`` does."""
    x = _gaussian()
    a, b = quantize(x, cast).magnitudes(), quantize(x * factor, cast).magnitudes()
    assert torch.equal(a == 0, b == 0) and 0.05 < (a == 0).float().mean().item() < 0.15
    wa, wb = new_window(), new_window()
    measure(wa, 0, x, cast, False, 4096)
    measure(wb, 0, x * factor, cast, False, 4096)
    assert wa[0, 2].item() == wb[0, 2].item() > 0


def test_a_scale_free_forecast_follows_the_share_not_the_amax():
    rising_amax = Trend(3.0, 0.1, (0.1, 0.1))  # log2 amax up 0.1 per step: x2**3 over 30 steps
    rising_share = Trend(0.1, 0.001, (0.001, 0.002))
    assert underflow_forecast(0.1, rising_amax, Trend(), 30, 2) == pytest.approx(0.8)  # fp8's rule
    assert underflow_forecast(0.1, rising_amax, Trend(), 30, 2, scale_free=True) == 0.1
    assert underflow_forecast(0.1, rising_amax, rising_share, 30, 2, scale_free=True) == pytest.approx(0.13)
    assert underflow_forecast(0.99, Trend(), rising_share, 30, 2, scale_free=True) == 1.0


def test_weight_gradient_operands_are_measured_after_the_hadamard_transform():
    """grad_output as the weight-gradient GEMM reads it (a row per feature, tokens along it) with
    one token 100x the others in each block of 16: without the transform the 15 others flush;
    NVFP4's GEMM casts the transformed rows (the outlier spread over its block), and so does
    the probe, bitwise what ``quantize(hadamard(rows))`` flushes."""
    g = torch.Generator().manual_seed(1)
    rows = torch.randn(8, 64, generator=g)
    rows[:, ::16] *= 100.0
    plain, rht = new_window(), new_window()
    measure(plain, 0, rows, NV, False, 4096)
    measure(rht, 0, rows, NV, False, 4096, hadamard_seed=0)
    by_hand = new_window()
    h = hadamard(rows, hadamard_matrix(0))
    record_cast(by_hand, 0, h, quantize(h, NV).magnitudes(), rows.abs().max())
    assert torch.equal(rht, by_hand)
    assert plain[0, 2].item() > 0.8 and rht[0, 2].item() < 0.2
    nv = Float8Recipe.nvfp4()
    assert gemm_casts(nv, "grad_weight").hadamard_seed == nv.seed == 0
    assert gemm_casts(nv, "output").hadamard_seed is None and gemm_casts(nv, "grad_input").hadamard_seed is None
    assert gemm_casts(Float8Recipe.nvfp4(hadamard=False), "grad_weight").hadamard_seed is None
    assert gemm_casts(Float8Recipe.tensorwise(), "grad_weight").hadamard_seed is None


def test_a_demotion_to_fp4_waits_twice_as_long_per_round_trip():
    assert [demote_windows(3, n, True) for n in range(7)] == [3, 3, 6, 6, 12, 12, 24]
    assert [demote_windows(3, n, False) for n in range(7)] == [3] * 7  # fp8 rungs: as before


def test_a_forward_gemm_that_had_to_come_back_up_waits_longer_the_second_time():
    """``demote_windows=2``, every 5 steps: the first demotion after two clean windows (step 30),
    the second after four (step 80, not 70: the demotion at 30 was undone at 45)."""
    twice = WeightedLoss("heavy_inputs", steps=100, heavy=20, seed=5, again=40)  # heavy on [0, 20) and [40, 60)
    run = train(replace(CASES["ladder-fp4"], data=twice, steps=100))
    log = [(d.step, d.gemm, d.action) for d in run.supervisor.log if d.layer == "0"]
    assert log == [(5, "output", "promote"), (30, "output", "demote"), (45, "output", "promote"),
                   (80, "output", "demote")]
    assert run.records["gemm_precisions"][75]["0"] == ("fp8-tensorwise", "nvfp4", "nvfp4")


def test_a_backward_gemm_promoted_from_nvfp4_takes_the_fp8_rung_that_composes():
    """nvfp4 -> tensorwise -> rowwise beside NVFP4 GEMMs (each GEMM runs its own casts); a GEMM
    skips rowwise only beside a tensorwise one: a recipe has one ``pow2_scales``, tensorwise's
    scales are exact and rowwise's powers of 2, so one of the two would not run its rung's casts."""
    ctl = Check.of(ControllerSettings(ladder=("nvfp4", "tensorwise", "rowwise", "compute"), per_gemm=True))
    rec = LayerRecord(None, LayerState(), 0, 0, (True,) * 4, per_gemm=True)
    assert gemm_up(ctl, rec, 1) == 1 and gemm_up(ctl, rec, 2) == 1
    rec.rungs = [0, 1, 0]
    assert gemm_up(ctl, rec, 1) == 2 and gemm_up(ctl, rec, 2) == 1
    composed = compose(tuple(ctl.recipes.get(ctl.settings.ladder[r]) for r in (0, 2, 0)))
    assert composed.grad_output == Cast("e4m3fn", "row") and composed.input == NV and composed.pow2_scales
    rec.rungs = [1, 1, 0]
    assert gemm_up(ctl, rec, 1) == 3  # (tensorwise, rowwise) do not compose: to the compute dtype
