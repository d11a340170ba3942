"""The pure loss-scale rule: exact cases, torch equivalence and a property test against a
pure-Python reference model."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mixprec.scaling import ScaleConfig, ScaleState, backoff_blocked, init_state, update_scale
from mixprec.scaling.rule import FLOAT32_MAX, FLOAT32_TINY


def f32(x: float) -> float:
    with np.errstate(over="ignore"):
        return float(np.float32(x))


def reference(scale: float, tracker: int, left: int, found: bool, cfg: ScaleConfig) -> tuple[float, int, int]:
    """The rule of rule.update_scale's docstring, in plain Python floats."""
    hyst = cfg.hysteresis
    if found:
        tracker = 0
        if hyst == 1:
            scale = f32(scale * cfg.backoff_factor)
        else:
            left = max(left - 1, 0)
            if left == 0:
                scale = f32(scale * cfg.backoff_factor)
    else:
        tracker += 1
        if cfg.consecutive_hysteresis and hyst > 1:
            left = hyst
        if tracker == cfg.growth_interval:
            tracker = 0
            if hyst > 1:
                left = hyst
            grown = f32(scale * cfg.growth_factor)
            if math.isfinite(grown):
                scale = grown
    scale = min(max(scale, f32(cfg.lower)), f32(cfg.upper))
    return scale, tracker, left


def run_rule(cfg: ScaleConfig, init: float, founds: list[float]) -> list[tuple[float, int, int]]:
    state = init_state(init, cfg)
    out = []
    for found in founds:
        state = update_scale(state, torch.tensor(float(found)), cfg)
        out.append((state.scale.item(), state.growth_tracker.item(), state.hysteresis_left.item()))
    return out


configs = st.builds(
    lambda g, b, i, h, c, lo, hi: ScaleConfig(
        growth_factor=g,
        backoff_factor=b,
        growth_interval=i,
        hysteresis=h,
        consecutive_hysteresis=c,
        min_scale=lo,
        max_scale=None if hi is None or (lo is not None and hi < lo) else hi,
    ),
    st.sampled_from([2.0, 1.5, 3.0, 1.0001, 16.0, 2.0**100]),  # 2**100 pushes growth past float32 max
    st.sampled_from([0.5, 0.25, 0.9, 1 / 3, 2.0**-100]),  # 2**-100 pushes backoff to 0/subnormal
    st.integers(1, 4),
    st.integers(1, 4),
    st.booleans(),
    st.sampled_from([None, 2.0**-10, 0.1, 1.0, 3.0]),
    st.sampled_from([None, 2.0**20, 1e5, 2.0**100]),
)


@settings(max_examples=150, deadline=None)
@given(
    cfg=configs,
    init=st.sampled_from([1.0, 2.0**16, 3.0, 1e-30, 3e38, 2.0**-126]),
    founds=st.lists(st.sampled_from([0.0, 0.0, 0.0, 1.0, 2.0]), max_size=40),
)
def test_rule_matches_reference_model(cfg, init, founds):
    got = run_rule(cfg, init, founds)
    scale, tracker, left = f32(init), 0, cfg.hysteresis
    for step, found in enumerate(founds):
        scale, tracker, left = reference(scale, tracker, left, found != 0, cfg)
        g_scale, g_tracker, g_left = got[step]
        assert g_scale == scale, (step, got[step], (scale, tracker, left))
        assert g_tracker == tracker
        if cfg.hysteresis > 1:
            assert g_left == left
        assert FLOAT32_TINY <= g_scale <= FLOAT32_MAX


@settings(max_examples=100, deadline=None)
@given(
    g=st.sampled_from([2.0, 1.5, 3.0, 1.0001]),
    b=st.sampled_from([0.5, 0.3, 0.9]),
    interval=st.integers(1, 5),
    init=st.sampled_from([2.0**16, 1.0, 7.0, 3e38]),
    founds=st.lists(st.sampled_from([0.0, 0.0, 1.0, 3.0]), max_size=40),
)
def test_defaults_are_torch_amp_update_scale(g, b, interval, init, founds):
    """hysteresis=1 and no bounds: bit for bit torch._amp_update_scale_ (within normal floats)."""
    cfg = ScaleConfig(growth_factor=g, backoff_factor=b, growth_interval=interval)
    state = init_state(init, cfg)
    scale = torch.full((), init, dtype=torch.float32)
    tracker = torch.zeros((), dtype=torch.int32)
    for found in founds:
        found_t = torch.tensor(found)
        state = update_scale(state, found_t, cfg)
        torch._amp_update_scale_(scale, tracker, found_t, g, b, interval)
        if scale.item() < FLOAT32_TINY:  # torch goes subnormal; we stop at 2**-126
            break
        assert torch.equal(state.scale, scale)
        assert torch.equal(state.growth_tracker, tracker)


def test_growth_exactly_at_interval_boundary():
    cfg = ScaleConfig(growth_interval=3)
    scales = [s for s, _, _ in run_rule(cfg, 4.0, [0, 0, 0, 0, 0, 0])]
    assert scales == [4.0, 4.0, 8.0, 8.0, 8.0, 16.0]


def test_overflow_resets_growth_tracker():
    cfg = ScaleConfig(growth_interval=2)
    assert [s for s, _, _ in run_rule(cfg, 4.0, [0, 1, 0, 0])] == [4.0, 2.0, 2.0, 4.0]


def test_floor_after_many_overflows_is_smallest_normal_not_zero():
    cfg = ScaleConfig()
    final = run_rule(cfg, 2.0**16, [1.0] * 300)[-1][0]
    assert final == FLOAT32_TINY == 2.0**-126


def test_growth_never_reaches_inf():
    cfg = ScaleConfig(growth_factor=16.0, growth_interval=1)
    scales = [s for s, _, _ in run_rule(cfg, 1e38, [0.0] * 3)]
    assert scales == [f32(1e38)] * 3


def test_bounds_clamp_both_ways():
    cfg = ScaleConfig(growth_interval=1, min_scale=1.0, max_scale=8.0)
    scales = [s for s, _, _ in run_rule(cfg, 4.0, [0, 0, 0, 1, 1, 1, 1, 1])]
    assert scales == [8.0, 8.0, 8.0, 4.0, 2.0, 1.0, 1.0, 1.0]


def test_hysteresis_tolerates_then_backs_off_until_growth_refills():
    cfg = ScaleConfig(growth_interval=2, hysteresis=3)
    out = run_rule(cfg, 64.0, [1, 1, 1, 1, 0, 0, 1])
    assert [s for s, _, _ in out] == [64.0, 64.0, 32.0, 16.0, 16.0, 32.0, 32.0]
    assert [h for _, _, h in out] == [2, 1, 0, 0, 0, 3, 2]


def test_consecutive_hysteresis_refills_on_every_clean_step():
    cfg = ScaleConfig(growth_interval=100, hysteresis=2, consecutive_hysteresis=True)
    out = run_rule(cfg, 64.0, [1, 0, 1, 0, 1, 1])
    assert [s for s, _, _ in out] == [64.0, 64.0, 64.0, 64.0, 64.0, 32.0]
    plain = dataclasses.replace(cfg, consecutive_hysteresis=False)
    assert [s for s, _, _ in run_rule(plain, 64.0, [1, 0, 1, 0, 1, 1])] == [64.0, 64.0, 32.0, 32.0, 16.0, 8.0]


def test_rule_is_pure_and_preserves_dtypes():
    cfg = ScaleConfig(growth_interval=1, hysteresis=2)
    state = init_state(4.0, cfg)
    before = [t.clone() for t in state]
    new = update_scale(state, torch.tensor(1.0), cfg)
    new = update_scale(new, torch.tensor(1.0), cfg)
    for old, kept in zip(state, before):
        assert torch.equal(old, kept)
    assert isinstance(new, ScaleState)
    assert [t.dtype for t in new] == [torch.float32, torch.int32, torch.int32]
    assert all(t.shape == () for t in new)
    assert new.scale.item() == 2.0


def test_backoff_blocked_only_at_floor_when_backoff_due():
    cfg = ScaleConfig(min_scale=1.0)
    at_floor = init_state(1.0, cfg)
    above = init_state(2.0, cfg)
    assert backoff_blocked(at_floor, torch.tensor(1.0), cfg).item()
    assert not backoff_blocked(at_floor, torch.tensor(0.0), cfg).item()
    assert not backoff_blocked(above, torch.tensor(1.0), cfg).item()
    hyst = dataclasses.replace(cfg, hysteresis=2)
    assert not backoff_blocked(init_state(1.0, hyst), torch.tensor(1.0), hyst).item()
    assert backoff_blocked(init_state(1.0, hyst, hysteresis_left=1), torch.tensor(1.0), hyst).item()


@pytest.mark.parametrize(
    "kwargs, error",
    [
        (dict(growth_factor=1.0), ValueError),
        (dict(growth_factor=float("inf")), ValueError),
        (dict(backoff_factor=1.0), ValueError),
        (dict(backoff_factor=0.0), ValueError),
        (dict(growth_interval=0), ValueError),
        (dict(growth_interval=2.5), TypeError),
        (dict(hysteresis=0), ValueError),
        (dict(min_scale=0.0), ValueError),
        (dict(min_scale=1e-40), ValueError),
        (dict(max_scale=float("inf")), ValueError),
        (dict(min_scale=4.0, max_scale=2.0), ValueError),
    ],
)
def test_config_validation(kwargs, error):
    with pytest.raises(error):
        ScaleConfig(**kwargs)


def test_init_state_rejects_zero_and_inf():
    for bad in (0.0, float("inf"), float("nan"), -1.0):
        with pytest.raises(ValueError, match="init_scale"):
            init_state(bad, ScaleConfig())


def test_backoff_blocked_at_a_floor_float32_cannot_represent():
    cfg = ScaleConfig(min_scale=0.1, backoff_factor=0.5)
    state = update_scale(init_state(0.15, cfg), torch.tensor(1.0), cfg)  # 0.075 -> clamped to f32(0.1)
    assert state.scale.item() == f32(0.1)
    assert backoff_blocked(state, torch.tensor(1.0), cfg).item()
