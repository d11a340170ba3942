"""Where a run's live Guard or Controller comes from: attached to the model (``live.attach(model)``),
checked against the settings the policy's fp8 rule names, under wrappers, copies, pickles and
threads."""

from __future__ import annotations

import copy
import pickle
import threading

import pytest
import torch
from torch import nn

import mixprec
from mixprec import Controller, Policy, fp8

POLICY = Policy.parse("compute=bf16").fp8("tensorwise", first_last="fp8", controller={"every": 2})


def _model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32))


def _forward(model: nn.Module, policy: Policy = POLICY) -> None:
    with mixprec.autocast("cpu", policy=policy):
        model(torch.randn(4, 32)).float().sum().backward()


def test_the_attached_controller_governs_the_model_under_a_wrapper():
    model = _model()
    ctl = Controller(POLICY.fp8_rule.controller).attach(torch.compile(model, backend="eager"))
    assert fp8.Controller.__name__ == "Controller" and model.__dict__["_mixprec_fp8_control"] is ctl
    _forward(model)
    assert ctl.precisions() == {"0": "fp8-tensorwise", "2": "fp8-tensorwise"}


def test_a_second_attach_is_refused_and_detach_frees_the_model():
    model = _model()
    Controller(every=2).attach(model)
    with pytest.raises(ValueError, match="already has a Controller attached.*detach"):
        Controller(every=2).attach(model)
    Controller.detach(model)
    other = Controller(every=2).attach(model)
    _forward(model)
    assert list(other.precisions()) == ["0", "2"]


def test_a_guard_attached_where_the_policy_names_a_controller_is_an_error():
    model = _model()
    fp8.Guard().attach(model)
    with pytest.raises(ValueError, match="runs under a controller, and the model has a Guard attached"):
        _forward(model)


def test_a_pickled_or_copied_model_carries_its_own_controller():
    model = _model()
    ctl = Controller(POLICY.fp8_rule.controller).attach(model)
    for _ in range(4):
        _forward(model)
        ctl.step()
    back = pickle.loads(pickle.dumps(model))
    twin = copy.deepcopy(model)
    for other in (back, twin):
        live = other.__dict__["_mixprec_fp8_control"]
        assert live is not ctl and live.settings == ctl.settings and live.steps == ctl.steps == 4
        _forward(other)  # governed by its own copy, which takes its layers over
        assert live.precisions() == ctl.precisions()
    assert ctl.state_dict()["steps"] == 4


def test_threads_each_run_their_own_model_under_its_own_controller():
    models = [_model(seed) for seed in range(3)]
    controllers = [Controller(POLICY.fp8_rule.controller).attach(m) for m in models]
    errors: list[BaseException] = []

    def run(model: nn.Module, ctl: Controller) -> None:
        try:
            for _ in range(4):
                _forward(model)
                ctl.step()
        except BaseException as e:  # noqa: BLE001 (reported by the main thread)
            errors.append(e)

    threads = [threading.Thread(target=run, args=pair) for pair in zip(models, controllers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for model, ctl in zip(models, controllers):
        assert ctl.steps == 4 and list(ctl.precisions()) == ["0", "2"]
        assert all(rec.module() is model[int(name)] for name, rec in ctl._layers.items())
