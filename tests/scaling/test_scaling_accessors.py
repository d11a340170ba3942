"""What code ported from torch reads and writes on a scaler (:mod:`mixprec.scaling._accessors`):
torch's private settings (``_init_scale``, ``_growth_factor``, ...) with torch's meaning, and the
state tensors (``_scale``, ``_growth_tracker``, ``_get_scale_async()``) updated in place as
torch's are, so a reference taken once (a captured CUDA graph) tracks the live values."""

from __future__ import annotations

import copy
import pickle
from typing import Any

import pytest
import torch
from torch import nn

import mixprec

from _scaling_cases import IMPLS, INF, make_scaler

PRIVATE = ("_init_scale", "_init_growth_tracker", "_growth_factor", "_backoff_factor", "_growth_interval")
_TORCH_STATE = {"scale": 8.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2, "_growth_tracker": 1}

# Each case: {step: [(attribute, value) set before that step's scale(), ("load", state_dict), or
# ("pickle", None): the scaler replaced by its pickled copy]}
# over the steps of INFS (1: the step's gradient overflows). Step 0's settings precede the first
# scale(): torch takes _init_scale and _init_growth_tracker from them; later, they change nothing.
INFS = [0, 0, 1, 0, 0, 1, 1, 0, 0, 0]
SETTINGS: dict[str, dict[int, list[tuple[str, Any]]]] = {
    "ported settings before the first scale": {0: [("_init_scale", 32.0), ("_growth_interval", 1),
                                                   ("_growth_factor", 4.0)]},
    "a growth tracker to start from": {0: [("_init_growth_tracker", 2), ("_growth_interval", 3)]},
    "a backoff factor": {0: [("_backoff_factor", 0.25), ("_growth_interval", 2)]},
    "_init_scale after the first scale changes nothing": {3: [("_init_scale", 7.0), ("_init_growth_tracker", 5)]},
    "settings changed mid-run": {4: [("_growth_interval", 1), ("_growth_factor", 3.0), ("_backoff_factor", 0.125)]},
    "a checkpoint loaded mid-run": {4: [("load", {**_TORCH_STATE, "growth_interval": 3})], 6: [("_init_scale", 2.0)]},
    "pickled mid-run": {2: [("_init_scale", 2.0)], 5: [("pickle", None)], 7: [("_init_scale", 3.0)]},
}


def _trajectory(impl: str, settings: dict[int, list[tuple[str, Any]]]) -> list[tuple[Any, ...]]:
    """Scale, growth tracker and the private settings as read after each update()."""
    param = nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([param], lr=0.1)
    scaler = make_scaler(impl, init_scale=1024.0, growth_interval=3)
    out = [tuple(getattr(scaler, name) for name in PRIVATE)]
    for step, inf in enumerate(INFS):
        for name, value in settings.get(step, []):
            if name == "load":
                scaler.load_state_dict(dict(value))
            elif name == "pickle":
                scaler = pickle.loads(pickle.dumps(scaler))
            else:
                setattr(scaler, name, value)
        opt.zero_grad()
        scaler.scale(param.sum() * (INF if inf else 1.0)).backward()
        scaler.step(opt)
        scaler.update()
        out.append((scaler.get_scale(), scaler._get_growth_tracker(), *(getattr(scaler, n) for n in PRIVATE)))
    return out


@pytest.mark.parametrize("settings", SETTINGS.values(), ids=SETTINGS.keys())
def test_torch_private_settings_read_and_set_like_torch(settings):
    """They were ignored: ``_init_scale = 32`` before the first scale() kept 65536 (and reading it
    raised AttributeError)."""
    assert _trajectory("mixprec", settings) == _trajectory("torch", settings)


BAD_SETTINGS = [("_init_scale", INF), ("_init_scale", 0.0), ("_init_growth_tracker", -1),
                ("_init_growth_tracker", 1.5), ("_growth_factor", 0.5), ("_backoff_factor", 2.0),
                ("_growth_interval", 0)]


@pytest.mark.parametrize("name, value", BAD_SETTINGS)
def test_a_bad_private_setting_is_refused(name, value):
    """torch takes them silently (and trains with a zero or infinite scale); the setters check."""
    scaler = mixprec.GradScaler("cpu")
    with pytest.raises(ValueError, match=name.lstrip("_")):
        setattr(scaler, name, value)


# ------------------------------------------------------------------ the state tensors, in place

def _plain(**kwargs: Any):
    return lambda impl: (make_scaler(impl, **kwargs), None)


def _per_layer(impl: str):
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    return mixprec.GradScaler("cpu", init_scale=1024.0, growth_interval=2, per_layer=True).watch(model), model


# Each event: "clean" / "inf" (an iteration), ("new_scale", value), ("load", state_dict).
EVENTS = ["inf", "clean", "clean", "clean", "inf", ("new_scale", 512.0), "clean",
          ("new_scale", torch.tensor(16.0)), ("load", _TORCH_STATE), "clean", "inf"]
SCALERS = {
    "plain": (IMPLS, _plain(init_scale=1024.0, growth_interval=2)),
    "hysteresis": (["mixprec"], _plain(init_scale=1024.0, growth_interval=2, hysteresis=2)),
    "consecutive hysteresis": (["mixprec"], _plain(init_scale=1024.0, growth_interval=2, hysteresis=3,
                                                   consecutive_hysteresis=True)),
    "bounded": (["mixprec"], _plain(init_scale=1024.0, growth_interval=2, min_scale=256.0, max_scale=2048.0,
                                    on_min_scale="ignore")),
    "per layer": (["mixprec"], _per_layer),
}


@pytest.mark.parametrize("impls, make", SCALERS.values(), ids=SCALERS.keys())
def test_a_reference_to_the_state_tensors_tracks_the_live_state(impls, make):
    """update() and load_state_dict() replaced the tensors: a reference taken once went stale."""
    for impl in impls:
        torch.manual_seed(0)
        scaler, model = make(impl)
        params = list(model.parameters()) if model is not None else [nn.Parameter(torch.ones(3))]
        opt = torch.optim.SGD(params, lr=1e-3)

        def loss() -> torch.Tensor:
            return (model(torch.randn(2, 4)).sum() if model is not None else params[0].sum())

        scaler.scale(loss())
        scale, tracker = scaler._get_scale_async(), scaler._growth_tracker
        assert scale is scaler._scale and tracker is not None
        live = scaler.state if impl == "mixprec" else None
        bound = _bounded(scaler, impl)
        for event in EVENTS:
            kind, value = event if isinstance(event, tuple) else (event, None)
            if kind == "load":
                scaler.load_state_dict(dict(value))
            else:
                opt.zero_grad()
                scaler.scale(loss() * (INF if kind == "inf" else 1.0)).backward()
                scaler.step(opt)
                scaler.update(value)
            assert scaler._get_scale_async() is scale and scaler._growth_tracker is tracker, (impl, event)
            assert (scale.item(), tracker.item()) == (scaler.get_scale(), scaler._get_growth_tracker()), (impl, event)
            if live is not None:
                assert all(a is b for a, b in zip(scaler.state, live)), event
            assert bound(scale.item())


def _bounded(scaler: Any, impl: str):
    if impl == "torch":
        return lambda value: True
    lower, upper = scaler.config.lower, scaler.config.upper
    return lambda value: lower <= value <= upper


def test_the_scales_recorded_are_the_ones_each_step_used():
    """History, the MinScaleError report and the scale noted for the backward read the scale used,
    not the live tensor the next update() writes into."""
    from mixprec._scaled import scaled_since

    seen: list[float] = []
    param = nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([param], lr=0.1)
    scaler = mixprec.GradScaler("cpu", init_scale=8.0, growth_interval=1, min_scale=4.0,
                                history=lambda step, scale, skipped, names: seen.append(scale))
    noted = []
    for inf in (0, 1, 1, 1):
        opt.zero_grad()
        scaler.scale(param.sum() * (INF if inf else 1.0)).backward()
        noted.append(scaled_since(0))
        scaler.step(opt)
        try:
            scaler.update()
        except mixprec.scaling.MinScaleError as e:
            report = str(e)
    assert seen == [8.0, 16.0, 8.0, 4.0]
    assert [float(n.of(None)) for n in noted] == seen
    assert "Recent scales (oldest first): [8, 16, 8, 4]" in report


@pytest.mark.parametrize("copy_of", [copy.deepcopy, lambda s: pickle.loads(pickle.dumps(s))], ids=["deepcopy", "pickle"])
def test_a_copy_has_its_own_state_tensors(copy_of):
    param = nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([param], lr=0.1)
    scaler = mixprec.GradScaler("cpu", init_scale=8.0, growth_interval=1, hysteresis=2)
    for inf in (0, 1, 0):
        opt.zero_grad()
        scaler.scale(param.sum() * (INF if inf else 1.0)).backward()
        scaler.step(opt)
        scaler.update()
    clone = copy_of(scaler)
    assert clone.state_dict() == scaler.state_dict()
    clone.scale(torch.ones(1))
    clone.update(2.0)
    assert clone.get_scale() == 2.0 and scaler.get_scale() == 32.0
    assert all(a is not b for a, b in zip(clone.state, scaler.state))
