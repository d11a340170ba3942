"""mixprec.GradScaler's state: state_dict across both implementations, pickling, deepcopy,
mid-training checkpoints, and what a bad state dict or an unpicklable scaler says."""

from __future__ import annotations

import copy
import pickle
import warnings

import pytest
import torch
from torch import nn

from mixprec.scaling import CSVHistory, GradScaler

from _scaling_cases import IMPLS, make_scaler, one_param_step, grads_trajectory, gradient_sequence


@pytest.mark.parametrize("impl", IMPLS)
def test_pickle_round_trip(impl):
    scaler = make_scaler(impl, init_scale=3.0, growth_factor=4.0, backoff_factor=0.25, growth_interval=3)
    scaler.scale(torch.tensor(1.0))
    clone = pickle.loads(pickle.dumps(scaler))
    assert clone.get_scale() == 3.0
    assert (clone.get_growth_factor(), clone.get_backoff_factor(), clone.get_growth_interval()) == (4.0, 0.25, 3)
    assert clone.is_enabled()


@pytest.mark.parametrize("src", IMPLS)
@pytest.mark.parametrize("dst", IMPLS)
def test_state_dict_across_implementations(src, dst):
    a = make_scaler(src, init_scale=16.0, growth_factor=4.0, backoff_factor=0.25, growth_interval=3)
    model = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        scaler_loss = a.scale(model(torch.ones(1, 2)).sum())
        scaler_loss.backward()
        a.step(optimizer)
        a.update()
    b = make_scaler(dst)
    b.load_state_dict(a.state_dict())
    assert b.get_scale() == 16.0
    assert (b.get_growth_factor(), b.get_backoff_factor(), b.get_growth_interval()) == (4.0, 0.25, 3)
    assert b._get_growth_tracker() == 2
    b.scale(torch.tensor(1.0))  # the lazily created device state starts from the loaded values
    assert b.get_scale() == 16.0 and b._get_growth_tracker() == 2
    with pytest.raises(RuntimeError, match="empty"):
        b.load_state_dict({})


def test_state_dict_and_pickle_keep_non_default_options(tmp_path):
    p = nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([p], lr=1.0)
    kwargs = dict(init_scale=64.0, hysteresis=3, consecutive_hysteresis=True, min_scale=0.5, max_scale=2.0**20)
    scaler = GradScaler("cpu", **kwargs, on_min_scale="warn", history=CSVHistory(tmp_path / "h.csv"))
    one_param_step(scaler, opt, p, True)
    state = scaler.state_dict()
    assert state["mixprec"] == dict(
        hysteresis=3,
        consecutive_hysteresis=True,
        min_scale=0.5,
        max_scale=2.0**20,
        on_min_scale="warn",
        hysteresis_left=2,
        skipped_steps=1,
        step=1,
    )
    loaded = GradScaler("cpu")
    loaded.load_state_dict(state)
    for restored in (pickle.loads(pickle.dumps(scaler)), loaded):
        assert restored.state_dict() == state
        one_param_step(restored, opt, p, True)  # hysteresis_left 2 -> 1: still tolerated
        assert restored.get_scale() == 64.0
        one_param_step(restored, opt, p, True)  # exhausted: back off
        assert restored.get_scale() == 32.0
    torch_scaler = torch.amp.GradScaler("cpu")
    torch_scaler.load_state_dict(state)
    assert torch_scaler.get_scale() == 64.0


def test_bad_state_dict_leaves_the_scaler_unchanged():
    scaler = GradScaler("cpu", init_scale=8.0, growth_factor=4.0)
    good = torch.amp.GradScaler("cpu").state_dict()
    for bad in (
        {**good, "scale": 0.0},
        {**good, "growth_factor": 0.5},
        {**good, "mixprec": {"hysteresis": 2, "hysteresis_left": 5}},
        {**good, "mixprec": {"on_min_scale": "explode"}},
    ):
        with pytest.raises(ValueError):
            scaler.load_state_dict(bad)
        assert scaler.get_scale() == 8.0 and scaler.get_growth_factor() == 4.0
        assert scaler.config.hysteresis == 1


@pytest.mark.parametrize("src, dst", [("torch", "mixprec"), ("mixprec", "torch")])
def test_state_dict_mid_training_continues_bitwise(src, dst):
    """Train 6 steps with one implementation, checkpoint (non-default options), continue 8 steps
    with the other: the continuation equals running the first implementation throughout."""
    kwargs = dict(init_scale=2.0**12, growth_factor=4.0, backoff_factor=0.25, growth_interval=3)
    seq = gradient_sequence(14, bad=(1, 4, 9, 10))

    def opt(params):
        return torch.optim.SGD(params, lr=0.01, momentum=0.9)

    ref_scales, ref_moved, _, ref_params, _ = grads_trajectory(src, seq, opt, kwargs)
    scales, moved, first, params, optimizer = grads_trajectory(src, seq[:6], opt, kwargs)
    assert first._get_growth_tracker() == 1  # mid-interval: the tracker must travel
    checkpoint = {"scaler": first.state_dict(), "optimizer": optimizer.state_dict()}
    second = make_scaler(dst)
    second.load_state_dict(checkpoint["scaler"])
    more_scales, more_moved, _, params, _ = grads_trajectory(
        dst, seq[6:], lambda ps: _loaded(opt(ps), checkpoint["optimizer"]), scaler=second, params=params
    )
    assert scales + more_scales == ref_scales
    assert moved + more_moved == ref_moved
    assert all(torch.equal(a, b) for a, b in zip(params, ref_params))


def _loaded(optimizer, state):
    optimizer.load_state_dict(state)
    return optimizer


def test_state_dict_round_trips_through_torch_save(tmp_path):
    scaler = GradScaler("cpu", hysteresis=2, min_scale=0.5, max_scale=2.0**20, on_min_scale="warn")
    p = nn.Parameter(torch.zeros(2))
    one_param_step(scaler, torch.optim.SGD([p], lr=1.0), p, True)
    torch.save(scaler.state_dict(), tmp_path / "scaler.pt")
    state = torch.load(tmp_path / "scaler.pt", weights_only=True)  # plain values only
    restored = GradScaler("cpu")
    restored.load_state_dict(state)
    assert restored.state_dict() == scaler.state_dict()


def test_load_state_dict_with_missing_keys_names_them_and_the_source():
    scaler = GradScaler("cpu", init_scale=8.0)
    partial = {k: v for k, v in torch.amp.GradScaler("cpu").state_dict().items() if k not in ("scale", "_growth_tracker")}
    with pytest.raises(ValueError, match=r"lacks 'scale', '_growth_tracker'.*scaler\.state_dict\(\)"):
        scaler.load_state_dict(partial)
    with pytest.raises(ValueError, match="not the model's or the optimizer's"):
        scaler.load_state_dict(nn.Linear(2, 2).state_dict())
    assert scaler.get_scale() == 8.0


def test_state_dict_pickling_and_deepcopy_read_the_device_once(syncs):
    scaler = GradScaler("cpu", init_scale=8.0, hysteresis=2)
    p = nn.Parameter(torch.zeros(2))
    one_param_step(scaler, torch.optim.SGD([p], lr=1.0), p, True)
    counts = []
    for save in (scaler.state_dict, lambda: pickle.dumps(scaler), lambda: copy.deepcopy(scaler)):
        syncs.start()
        save()
        counts.append(syncs.stop())
    assert counts == [1, 1, 1]
    clone = copy.deepcopy(scaler)
    assert clone.state_dict() == scaler.state_dict() and clone.state_dict()["mixprec"]["hysteresis_left"] == 1


def module_level_history(step, scale, skipped, names):
    """A history callback pickle can store (by name)."""


def test_pickling_a_lambda_history_says_what_to_do():
    rows = []
    scaler = GradScaler("cpu", history=lambda *row: rows.append(row))
    with pytest.raises(TypeError, match="lambda or a local function.*module-level function"):
        pickle.dumps(scaler)
    clone = copy.deepcopy(scaler)  # deepcopy keeps the callback itself
    p = nn.Parameter(torch.zeros(2))
    one_param_step(clone, torch.optim.SGD([p], lr=1.0), p, False)
    assert rows == [(0, 2.0**16, False, ())]
    restored = pickle.loads(pickle.dumps(GradScaler("cpu", history=module_level_history)))
    assert restored._history is module_level_history


CHOSEN = dict(hysteresis=4, min_scale=1.0, on_min_scale="warn")


def test_a_mixprec_checkpoint_restores_its_options_and_warns_where_it_overrides_chosen_ones():
    """A mixprec checkpoint wins (it is what the run was saved with), but a constructor option
    it replaces is named in a warning instead of being dropped silently."""
    scaler = GradScaler("cpu", growth_interval=7, **CHOSEN)
    with pytest.warns(UserWarning, match=r"hysteresis 4 -> 1, min_scale 1.0 -> None, on_min_scale 'warn' -> 'raise'"):
        scaler.load_state_dict(GradScaler("cpu", growth_interval=7).state_dict())
    assert (scaler.config.hysteresis, scaler.config.min_scale, scaler._on_min_scale) == (1, None, "raise")
    scaler.set_growth_interval(9)
    saved = GradScaler("cpu", growth_interval=7, **CHOSEN).state_dict()
    with pytest.warns(UserWarning, match=r"growth_interval 9 -> 7.*set_\* methods") as record:
        scaler.load_state_dict(saved)
    assert len(record) == 1 and "hysteresis" not in str(record[0].message)
    # Dropping a key from "mixprec" keeps the scaler's own value, without a warning.
    kept = GradScaler("cpu", **CHOSEN)
    mine = {**saved, "mixprec": {k: v for k, v in saved["mixprec"].items() if k != "min_scale"}}
    mine["mixprec"]["hysteresis"] = 4
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kept.load_state_dict(mine)
        GradScaler("cpu").load_state_dict(saved)  # default options: nothing chosen, nothing to warn
    assert (kept.config.hysteresis, kept.config.min_scale, kept._on_min_scale) == (4, 1.0, "warn")


def test_a_torch_checkpoint_keeps_the_mixprec_options():
    scaler = GradScaler("cpu", **CHOSEN)
    torch_scaler = torch.amp.GradScaler("cpu", init_scale=32.0, growth_interval=5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scaler.load_state_dict(torch_scaler.state_dict())
    assert (scaler.config.hysteresis, scaler.config.min_scale, scaler._on_min_scale) == (4, 1.0, "warn")
    assert scaler.get_scale() == 32.0 and scaler.get_growth_interval() == 5
    # torch's own three options are in its checkpoint and win, as with torch's scaler: named
    # when they replace a chosen one.
    chosen = GradScaler("cpu", growth_interval=100)
    with pytest.warns(UserWarning, match="growth_interval 100 -> 2000"):
        chosen.load_state_dict(torch.amp.GradScaler("cpu").state_dict())
