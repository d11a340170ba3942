"""A check's rows of every layer at once (mixprec.control._windows): bitwise each layer's row
from the documented formulas, alone or beside others, and the running
values each layer keeps (its last gain, reach and end slope) moved on as one layer's check would."""

from __future__ import annotations

import math

import pytest
import torch

from mixprec.control._backward import TERMS, BackwardCost
from mixprec.control._ladder import LayerRecord
from mixprec.control._windows import stacked_windows
from mixprec.formats._state import LayerState


def _record(seed: int, per_gemm: bool = True, backward: bool = True) -> LayerRecord:
    """A record whose buffers hold random sums, some with nothing counted (zero counts and steps)."""
    gen = torch.Generator().manual_seed(seed)
    rec = LayerRecord(None, LayerState(), 0, 0, (True,) * 3, per_gemm, cost=True)

    def fill(t: torch.Tensor, zero_share: float = 0.3) -> None:
        values = torch.rand(t.shape, generator=gen) * 4 - 1
        t.copy_(torch.where(torch.rand(t.shape, generator=gen) < zero_share, 0.0, values))

    for t in (rec.state.window, rec.shadow, rec.range, rec.cost):
        fill(t)
    if rec.gemm_windows is not None:
        fill(rec.gemm_windows)
    rec.cost[:, 4] = torch.tensor([float(seed % 3), 2.0])  # steps: none measured on one seed in three
    if backward:
        rec.backward = cost = BackwardCost(torch.device("cpu"))
        for t in (cost.window, cost.gain, cost.end, cost.reach.window):
            fill(t, 0.5)
        cost.window[..., TERMS:] = torch.randint(0, 3, cost.window[..., TERMS:].shape, generator=gen).float()
        cost.end_last.fill_(-math.inf if seed % 2 else 0.25 * seed)
        cost.reach.gain.fill_(-math.inf if seed % 4 == 1 else 0.5)
        cost.reach.known.fill_(0.05 * (seed + 1))
        cost.reach.window[1] *= seed % 2  # (a window without a walk on every second seed: the last reach kept)
    return rec


def _expected(rec: LayerRecord) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A record's row by the formulas, one layer alone, and its running values after it."""
    parts = [rec.state.window[:, :-1].flatten(), rec.shadow[:, :-1].flatten(), rec.range]
    if rec.gemm_windows is not None:
        parts.append(rec.gemm_windows[..., :-1].flatten())
    steps = rec.cost[:, 4]
    parts += [torch.where(steps > 0, rec.cost[:, 3] / steps.clamp(min=1), -math.inf), (steps > 0).float(),
              rec.cost[:, 5] / steps.clamp(min=1), steps]
    kept: list[torch.Tensor] = []
    if rec.backward is not None:
        b, reach = rec.backward, rec.backward.reach
        counts = b.window[..., TERMS:]
        means = torch.where(counts > 0, b.window[..., :TERMS] / counts.clamp(min=1), -torch.inf)
        last = torch.where(b.end[1] > 0, b.end[0] / b.end[1].clamp(min=1), b.end_last)
        gain = torch.where(b.gain[1] > 0, b.gain[0] / b.gain[1].clamp(min=1), reach.gain)
        known = torch.where(reach.window[1] > 0, reach.window[0] / reach.window[1].clamp(min=1e-30), reach.known)
        parts += [means.flatten(), (counts > 0).float().flatten(), torch.stack([gain, torch.isfinite(gain).float(), known]),
                  torch.stack([last, torch.isfinite(last).float()])]
        kept = [last, gain, known]
    return torch.cat(parts), kept


def _kept(rec: LayerRecord) -> list[torch.Tensor]:
    b = rec.backward
    return [] if b is None else [b.end_last, b.reach.gain, b.reach.known]


LAYERS = {
    "one layer": [dict(seed=0)],
    "layers per GEMM, backward costs": [dict(seed=s) for s in range(5)],
    "layers per GEMM, no backward cost": [dict(seed=s, backward=False) for s in range(3)],
    "whole layers": [dict(seed=s, per_gemm=False, backward=False) for s in (4, 5)],
}


@pytest.mark.parametrize("layers", LAYERS)
def test_each_row_is_its_layers_own_bitwise_in_order(layers: str):
    records = [_record(**spec) for spec in LAYERS[layers]]
    expected = [_expected(rec) for rec in records]
    rows = stacked_windows(records)
    assert rows.shape == (len(records), len(expected[0][0]))
    for i, (rec, (row, kept)) in enumerate(zip(records, expected)):
        assert torch.equal(rows[i], row), i
        assert len(_kept(rec)) == len(kept) and all(torch.equal(a, b) for a, b in zip(_kept(rec), kept)), i


def test_a_check_without_a_measurement_keeps_the_last_gain_reach_and_end_slope():
    records = [_record(s) for s in (2, 4)]
    stacked_windows(records)
    before = [[t.clone() for t in _kept(rec)] for rec in records]
    for rec in records:
        rec.reset()
    rows = stacked_windows(records)
    for rec, kept in zip(records, before):
        assert all(torch.equal(a, b) for a, b in zip(_kept(rec), kept))
        assert all(math.isfinite(float(t)) for t in kept)
    assert rows[:, -5].tolist() == [float(kept[1]) for kept in before]  # the gain, the last window's
    assert rows[:, -1].tolist() == [1.0, 1.0]  # an end slope known


def test_each_layer_keeps_a_value_of_its_own():
    records = [_record(s) for s in (2, 4)]
    stacked_windows(records)
    for rec in records:
        rec.reset()
    records[0].backward.reach.known.fill_(0.125)  # (a load writes a layer's reach in place)
    assert float(records[1].backward.reach.known) != 0.125
    assert stacked_windows(records)[:, -3].tolist()[0] == 0.125
