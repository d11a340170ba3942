"""Files written by mixprec at 1067028, before fp8's formats, control and policy got packages of
their own (``scripts/compat_files.py`` made them there): policy JSON, pickles of a policy, a
Controller and a Guard, their state_dicts, a pickled converted model. Each loads here, holds what
it held, and saves back unchanged."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch
from torch import nn

import mixprec
from mixprec import Controller, Policy, fp8
from mixprec.fp8 import ControllerSettings, GuardSettings

DATA = Path(__file__).parent / "data" / "compat_1067028"
pytestmark = pytest.mark.filterwarnings("ignore:mixprec.*moved to:DeprecationWarning")

CONTROLLER = ControllerSettings(every=2, ladder=("tensorwise", "rowwise", "compute"), sample=64, min_dwell=2)
PER_GEMM = ControllerSettings(every=2, per_gemm=True, ladder=("nvfp4", "tensorwise", "compute"), sample=64)


#: Controller settings added since 1067028 (issue 39: the backward GEMMs' cost and the optimizer it assumes, the late phase,
#: the loss costs' reference GEMMs, the share of rows they measure, the scope of their limits): a file without them
#: loads with their defaults and saves them back.
ADDED = ("max_backward_cost", "normalized_updates", "late_start", "late_factor", "reference", "cost_row_share",
         "cost_scope")


def _with_added(old: dict) -> dict:
    """``old``, a Controller's settings JSON of 1067028, with the settings added since at their defaults."""
    defaults = ControllerSettings().to_dict()
    assert not set(old) & set(ADDED) and set(defaults) - set(old) == set(ADDED), sorted(set(defaults) - set(old))
    return {**old, **{k: defaults[k] for k in ADDED}}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(32, 32) for _ in range(4)])


@pytest.mark.parametrize("name, kind, settings", [
    ("policy_controller.json", "controller", CONTROLLER),
    ("policy_guard.json", "guard", GuardSettings(every=3, max_underflow=0.2)),
])
def test_a_policy_file_loads_with_its_settings_and_saves_back_the_same_json(name, kind, settings, tmp_path):
    text = (DATA / name).read_text()
    policy = Policy.load(DATA / name)
    assert getattr(policy.fp8_rule, kind) == settings and policy.fp8_rule.live is None
    policy.save(tmp_path / name)
    want = json.loads(text)
    if kind == "controller":
        want["fp8_rule"]["controller"] = _with_added(want["fp8_rule"]["controller"])
    assert json.loads((tmp_path / name).read_text()) == want


def test_a_pickled_policy_loads_equal_to_the_one_built_now():
    with pytest.warns(DeprecationWarning, match="mixprec.fp8._rule moved to mixprec.policy._rule"):
        policy = pickle.loads((DATA / "policy_plain.pkl").read_bytes())
    assert policy == Policy.parse("compute=bf16").with_ops(fp32=["exp"]).fp8("rowwise", names="1|2",
                                                                             recipes={"2": "mxfp8"})


def test_a_controllers_config_is_its_settings_json():
    assert Controller(CONTROLLER).config() == _with_added(json.loads((DATA / "controller_config.json").read_text()))


@pytest.mark.parametrize("name, settings", [("controller_state.pt", CONTROLLER),
                                            ("controller_per_gemm_state.pt", PER_GEMM)])
def test_a_controller_state_dict_loads_and_saves_back_unchanged(name, settings):
    state = torch.load(DATA / name, weights_only=True)
    ctl = Controller(settings)
    ctl.load_state_dict(state)
    assert ctl.steps == state["steps"] == 6 and ctl.state_dict() == state
    assert [d.layer for d in ctl.log] == [d["layer"] for d in state["log"]]


def test_a_pickled_controller_loads_with_its_settings_and_state():
    ctl = pickle.loads((DATA / "controller.pkl").read_bytes())
    assert type(ctl) is Controller and ctl.settings == CONTROLLER
    assert ctl.state_dict() == torch.load(DATA / "controller_state.pt", weights_only=True)
    model = _model()
    ctl.attach(model)
    with mixprec.autocast("cpu", torch.bfloat16, policy=Policy.fp8("tensorwise", controller=ctl.settings)):
        model(torch.randn(2, 32))
    saved = torch.load(DATA / "controller_state.pt", weights_only=True)
    assert ctl.precisions() == {name: {"tensorwise": "fp8-tensorwise", "rowwise": "fp8-rowwise"}.get(
        data["rung"], "bf16") for name, data in saved["layers"].items()}  # each layer resumes at its rung


def test_a_guard_state_dict_and_pickle_load():
    state = torch.load(DATA / "guard_state.pt", weights_only=True)
    guard = fp8.Guard(every=2, max_underflow=0.5)
    guard.load_state_dict(state)
    assert guard.state_dict() == state and guard.steps == 6
    loaded = pickle.loads((DATA / "guard.pkl").read_bytes())
    assert type(loaded) is fp8.Guard and loaded.settings == GuardSettings(every=2, max_underflow=0.5)
    assert loaded.steps == 6 and loaded.decisions.keys() == guard.decisions.keys()


def test_a_pickled_converted_model_loads_and_runs_as_its_state_dict_in_a_new_conversion():
    with pytest.warns(DeprecationWarning, match=r"mixprec.fp8._(layers|state|recipe) moved to mixprec.formats"):
        model = torch.load(DATA / "converted_model.pt", weights_only=False)
    assert [type(m).__name__ for m in model] == ["Linear", "Float8Linear", "Float8Linear", "Linear"]
    fresh = fp8.convert(_model(), "tensorwise")
    fresh.load_state_dict(torch.load(DATA / "converted_state.pt", weights_only=True))
    x = torch.randn(4, 32)
    with mixprec.autocast("cpu", torch.bfloat16):
        assert torch.equal(model(x), fresh(x))
