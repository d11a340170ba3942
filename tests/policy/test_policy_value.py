"""A Policy as a value: equality and hashing by its settings (a Guard's or Controller's too), the
live object the older spelling carries beside the value, its repr, the canonical object, pickles
and round trips, and the checked JSON codec's errors."""

import copy
import gc
import json
import pickle
import weakref

import pytest
import torch
from torch import nn

import mixprec
from mixprec import Controller, Policy
from mixprec.fp8 import ControllerSettings, Guard, GuardSettings
from mixprec.policy import canonical
from mixprec.policy._codec import expect, module_rule_from_dict, parse_dtype
from mixprec.policy._rule import Fp8Rule


def _base():
    return Policy.parse("compute=bf16").with_ops(fp32=["exp"]).keep(types=nn.LayerNorm)


# ------------------------------------------------------------------ equality, hashing, canonical
def test_policies_compare_by_the_settings_of_their_guard_or_controller():
    ctl, other = Controller(every=5), Controller(every=5)
    a, b = _base().fp8("rowwise", controller=ctl), _base().fp8("rowwise", controller=ctl.settings)
    c, d = _base().fp8("rowwise", controller=other), _base().fp8("rowwise", controller={"every": 5})
    assert a == b == c == d and len({a, b, c, d}) == 1
    assert a.fp8_rule.controller == ControllerSettings(every=5) and a.fp8_rule.live is ctl and b.fp8_rule.live is None
    assert a != _base().fp8("rowwise") and a != _base().fp8("rowwise", controller={"every": 6})
    assert a != _base().fp8("tensorwise", controller=ctl)
    assert _base().fp8(guard={}) != _base().fp8(controller={}) and _base().fp8(guard={}).fp8_rule.kind == "guard"
    assert hash(_base()) == hash(_base()) and _base() != _base().keep(names=r"^head$")


def test_canonical_is_one_object_per_value_and_live_object():
    ctl = Controller()
    a, b = _base().fp8(controller=ctl), _base().fp8(controller=ctl)
    assert canonical(a) is canonical(b) and canonical(canonical(a)) is canonical(a)
    assert canonical(a) is not a and canonical(a).fp8_rule.live is ctl
    assert canonical(_base().fp8(controller=Controller())) is not canonical(a)
    plain = _base().fp8(controller=ctl.settings)
    assert canonical(plain) is not canonical(a) and canonical(plain).fp8_rule.live is None
    assert canonical(_base().fp8(controller={})) is canonical(plain)
    guard = Guard()
    assert canonical(_base().fp8(guard=guard)).fp8_rule.live is guard


def test_the_settings_values_are_frozen_checked_and_json_equal_to_config():
    s = ControllerSettings(every=5, ladder=["nvfp4", "tensorwise", "compute"], per_gemm=True)
    assert s.ladder == ("nvfp4", "tensorwise", "compute") and hash(s) == hash(ControllerSettings.from_dict(s.to_dict()))
    assert Controller(s).config() == s.to_dict() == Controller(every=5, ladder=s.ladder, per_gemm=True).config()
    assert json.loads(json.dumps(s.to_dict())) == s.to_dict()
    with pytest.raises(AttributeError):
        s.every = 6  # frozen
    with pytest.raises(ValueError, match="Controller.every must be an int >= 1"):
        s.replace(every=0)
    with pytest.raises(ValueError, match=r"unknown Guard setting\(s\) \['evry'\]"):
        GuardSettings.from_dict({"evry": 3})
    ctl = Controller(s)
    assert ctl.settings is s and ctl.every == 5
    with pytest.raises(AttributeError, match=r"Controller.every is a setting, fixed when it is built"):
        ctl.every = 6
    assert Guard(GuardSettings(every=3), max_underflow=0.1).settings == GuardSettings(every=3, max_underflow=0.1)
    with pytest.raises(ValueError, match=r"Guard\(settings=...\) must be a GuardSettings"):
        Guard(s)


# ------------------------------------------------------------------ repr, copies
def test_repr_shows_the_settings_not_the_live_object():
    ctl = Controller(every=5)
    p = Policy.parse("bf16").fp8("rowwise", controller=ctl)
    text = repr(p)
    assert "ControllerSettings(" in text and "every=5" in text and "Controller(every" not in text
    assert repr(p) == repr(Policy.parse("bf16").fp8("rowwise", controller=ctl.settings))
    assert repr(ctl) == "Controller(every=5)"


def test_a_copied_rule_copies_its_live_object_and_keeps_its_value():
    guard = Guard(every=3)
    rule = Fp8Rule("rowwise", guard=guard)
    shallow, deep = copy.copy(rule), copy.deepcopy(rule)
    assert shallow.live is guard and shallow == rule
    assert deep.live is not guard and deep.live.every == 3 and deep == rule
    assert rule.detached() == rule and rule.detached().live is None and rule.detached().guard == guard.settings


def test_pickling_a_policy_keeps_its_settings_and_refuses_a_live_object():
    p = Policy.fp8("rowwise", names=r"blocks", recipes={"blocks.1": "tensorwise"}, controller={"every": 4})
    back = pickle.loads(pickle.dumps(p))
    assert back == p and back.fp8_rule.live is None and canonical(back) is canonical(p)
    with pytest.raises(TypeError, match=r"cannot pickle a mixprec.Policy carrying a live fp8 controller.*"
                                        r"controller.attach\(model\)"):
        pickle.dumps(Policy.fp8(controller=Controller()))


# ------------------------------------------------------------------ round trips
def test_load_round_trips_the_settings_and_takes_a_given_controller(tmp_path):
    ctl = Controller(every=5)
    p = _base().fp8("rowwise", controller=ctl)
    p.save(tmp_path / "p.json")
    loaded = Policy.load(tmp_path / "p.json", controller=ctl)
    assert loaded == p and loaded.fp8_rule.live is ctl and canonical(loaded) is canonical(p)
    assert Policy.from_json(p.to_json(), controller=ctl).to_json() == p.to_json()
    fresh = Policy.from_json(p.to_json())  # settings only: no object built, no warning
    assert fresh == p and fresh.fp8_rule.live is None and fresh.fp8_rule.controller == ctl.settings
    assert json.loads(p.to_json())["fp8_rule"]["controller"] == ctl.config()
    with pytest.raises(ValueError, match="other settings than the policy's saved controller"):
        Policy.from_json(p.to_json(), controller=Controller(every=6))


def test_a_policy_holds_no_live_guard_or_controller_unless_given_one() -> None:
    """Built from settings, nothing reachable from the policy is a Guard or Controller; the older
    spelling's object is held by the policy itself (no registry) and freed with it."""
    for kind, make in (("controller", Controller), ("guard", Guard)):
        state = make()
        policy = Policy.fp8("tensorwise", **{kind: state.settings})
        seen, todo = set(), [policy]
        while todo:  # everything the policy reaches, containers included
            obj = todo.pop()
            if id(obj) in seen or isinstance(obj, type):
                continue
            seen.add(id(obj))
            assert not isinstance(obj, (Controller, Guard)), f"the policy holds its {kind}"
            todo.extend(gc.get_referents(obj))
        legacy = Policy.fp8("tensorwise", **{kind: state})
        ref = weakref.ref(state)
        del state
        gc.collect()
        assert ref() is not None and legacy.fp8_rule.live is ref()  # carried by the policy
        del legacy
        gc.collect()
        assert ref() is None  # and freed with it


# ------------------------------------------------------------------ the checked codec
@pytest.mark.parametrize("data, field", [
    ({"params": 16}, "policy 'params' must be a dtype name, got int 16"),
    ({"base": ["torch"]}, "policy 'base' must be a str"),
    ({"op_rules": {"exp": "fp32"}}, "policy 'op_rules' must be a list"),
    ({"module_rules": [{"dtype": True, "types": []}]}, "a module rule's dtype must be a dtype name, got bool"),
    ({"module_rules": [{"names": 3}]}, "a module rule's names must be a regex str"),
    ({"fp8_rule": {"recipe": 8}}, "fp8_rule 'recipe' must be a str, got int 8"),
    ({"fp8_rule": {"first_last": None}}, "fp8_rule 'first_last' must be a str"),
    ({"fp8_rule": {"types": "Linear"}}, "fp8_rule 'types' must be a list of type paths"),
    ({"fp8_rule": {"recipes": {"0": 1}}}, r"fp8_rule recipes\['0'\] must be a recipe name"),
    ({"fp8_rule": {"guard": [1]}}, "fp8_rule 'guard' must be an object"),
    ({"fp8_rule": {"guard": {"every": 0}}}, "Guard.every must be an int >= 1"),
    ({"fp8_rule": {"controller": "fast"}}, "fp8_rule 'controller' must be an object"),
    ({"fp8_rule": {"recipe": "rowwise", "guards": {}}}, r"unknown fp8_rule field\(s\) \['guards'\]; fields: "
                                                        r"\['backend', 'controller'"),
    ({"compute": "bf16", "fp8": {}}, r"unknown policy field\(s\) \['fp8'\]; fields: \['params'"),
])
def test_codec_errors_name_the_field(data, field):
    with pytest.raises(ValueError, match=field):
        Policy.from_json(json.dumps(data))


def test_codec_helpers_check_types_exactly():
    assert expect(3, int, "x", "an int") == 3
    with pytest.raises(ValueError, match="x must be an int, got bool True"):
        expect(True, int, "x", "an int")
    with pytest.raises(ValueError, match=r"got str '" + "a" * 56 + r"\.\.\."):
        expect("a" * 100, int, "x", "an int")
    assert parse_dtype(" Torch.BF16 ") is torch.bfloat16 and parse_dtype(torch.half) is torch.float16
    rule = module_rule_from_dict({"dtype": "f16", "types": ["torch.nn.modules.normalization.LayerNorm"]})
    assert rule.dtype is torch.float16 and rule.types == (nn.LayerNorm,) and rule.names is None
    with pytest.raises(ValueError, match=r"unknown module rule field\(s\) \['dtypes'\]"):
        module_rule_from_dict({"dtypes": "f16"})
