"""A Policy as a value: equality and hashing with and without an attached Guard/Controller, its
repr, the canonical object, the attachment registry's bound, and the checked JSON codec's errors."""

import copy
import gc
import json

import pytest
import torch
from torch import nn

import mixprec
from mixprec import Policy
from mixprec.policy._codec import expect, module_rule_from_dict, parse_dtype
from mixprec.fp8 import _rule
from mixprec.policy._rule import Attachment, Fp8Rule
from mixprec.policy import canonical


def _base():
    return Policy.parse("compute=bf16").with_ops(fp32=["exp"]).keep(types=nn.LayerNorm)


# ------------------------------------------------------------------ equality, hashing, canonical
def test_equal_settings_are_equal_and_hash_equal_whatever_is_attached():
    ctl, other = mixprec.Controller(every=5), mixprec.Controller(every=5)
    a, b = _base().fp8("rowwise", controller=ctl), _base().fp8("rowwise", controller=ctl)
    c, plain = _base().fp8("rowwise", controller=other), _base().fp8("rowwise")
    assert a == b == c == plain and len({a, b, c, plain}) == 1
    assert a.fp8_rule.attached == b.fp8_rule.attached == Attachment("controller", a.fp8_rule.attached.uid)
    assert c.fp8_rule.attached != a.fp8_rule.attached and plain.fp8_rule.attached is None
    assert a != _base().fp8("tensorwise", controller=ctl)
    assert hash(_base()) == hash(_base()) and _base() != _base().keep(names=r"^head$")


def test_canonical_is_one_object_per_value_and_attachment():
    ctl = mixprec.Controller()
    a, b = _base().fp8(controller=ctl), _base().fp8(controller=ctl)
    assert canonical(a) is canonical(b) and canonical(canonical(a)) is canonical(a)
    assert canonical(a) is not a and canonical(a).fp8_rule.controller is ctl
    assert canonical(_base().fp8(controller=mixprec.Controller())) is not canonical(a)
    assert canonical(_base().fp8()) is not canonical(a) and canonical(_base()) is canonical(_base())
    guard = mixprec.fp8.Guard()
    assert canonical(_base().fp8(guard=guard)).fp8_rule.guard is guard


def test_an_attachment_id_is_never_reused():
    guard = mixprec.fp8.Guard()
    first = Attachment.of("guard", guard)
    assert Attachment.of("guard", guard) == first and Attachment.of("controller", guard).uid == first.uid
    del guard
    gc.collect()
    later = {Attachment.of("guard", mixprec.fp8.Guard()).uid for _ in range(20)}
    assert first.uid not in later and min(later) > first.uid


def test_the_attachment_registry_holds_only_live_objects():
    gc.collect()
    before = len(_rule._UIDS)
    guards = [mixprec.fp8.Guard() for _ in range(50)]
    policies = [Policy.fp8(guard=g) for g in guards]
    assert len(_rule._UIDS) == before + 50
    assert len({p.fp8_rule.attached.uid for p in policies}) == 50
    del guards, policies
    gc.collect()
    assert len(_rule._UIDS) == before


# ------------------------------------------------------------------ repr, copies
def test_repr_names_the_attachment_not_the_live_object():
    ctl = mixprec.Controller(every=5)
    p = Policy.parse("bf16").fp8("rowwise", controller=ctl)
    uid = p.fp8_rule.attached.uid
    text = repr(p)
    assert f"attached=Attachment(kind='controller', uid={uid})" in text
    assert "Controller(" not in text and "controller=" not in text
    assert "attached=None" in repr(Policy.parse("bf16").fp8("rowwise"))
    assert repr(Policy.parse("bf16").fp8("rowwise")) == repr(Policy.parse("bf16").fp8("rowwise"))


def test_a_copied_rule_gets_its_own_attachment():
    guard = mixprec.fp8.Guard(every=3)
    rule = Fp8Rule("rowwise", guard=guard)
    shallow, deep = copy.copy(rule), copy.deepcopy(rule)
    assert shallow.guard is guard and shallow.attached == rule.attached
    assert deep.guard is not guard and deep.guard.every == 3
    assert deep == rule and deep.attached.kind == "guard" and deep.attached.uid != rule.attached.uid
    assert rule.detached() == rule and rule.detached().attached is None and rule.detached().guard is None


def test_pickling_a_policy_refuses_an_attachment_and_keeps_a_plain_rule():
    import pickle

    p = Policy.fp8("rowwise", names=r"blocks", recipes={"blocks.1": "tensorwise"})
    back = pickle.loads(pickle.dumps(p))
    assert back == p and back.fp8_rule.attached is None and canonical(back) is canonical(p)
    with pytest.raises(TypeError, match=r"cannot pickle a mixprec.Policy holding an fp8 controller.*"
                                        r"Policy.from_json\(text, controller=my_controller\)"):
        pickle.dumps(Policy.fp8(controller=mixprec.Controller()))


# ------------------------------------------------------------------ round trips
def test_load_round_trips_and_takes_the_given_controller(tmp_path):
    ctl = mixprec.Controller(every=5)
    p = _base().fp8("rowwise", controller=ctl)
    p.save(tmp_path / "p.json")
    loaded = Policy.load(tmp_path / "p.json", controller=ctl)
    assert loaded == p and loaded.fp8_rule.controller is ctl and canonical(loaded) is canonical(p)
    assert Policy.from_json(p.to_json(), controller=ctl).to_json() == p.to_json()
    with pytest.warns(UserWarning, match=r"Policy.load/from_json built a new Controller"):
        fresh = Policy.from_json(p.to_json())
    assert fresh == p and fresh.fp8_rule.controller.config() == ctl.config()
    assert canonical(fresh) is not canonical(p)


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


def test_a_policy_holds_no_live_guard_or_controller() -> None:
    """The rule keeps only its Attachment handle: nothing reachable from the policy's own fields is a
    Guard or Controller; the object is found through the handle while a rule names it, and is freed
    with the last such rule."""
    import gc
    import weakref

    from mixprec import Controller, Policy
    from mixprec.fp8 import Guard

    for kind, make in (("controller", Controller), ("guard", Guard)):
        state = make()
        policy = Policy.fp8("tensorwise", **{kind: state})
        seen, todo = set(), [policy]
        while todo:  # everything the policy's own attributes reach, containers included
            obj = todo.pop()
            if id(obj) in seen or isinstance(obj, type):
                continue
            seen.add(id(obj))
            assert not isinstance(obj, (Controller, Guard)), f"the policy holds its {kind}"
            todo.extend(gc.get_referents(obj))
        assert getattr(policy.fp8_rule, kind) is state
        ref = weakref.ref(state)
        del state
        gc.collect()
        assert ref() is not None  # named by the live policy: kept
        del policy
        gc.collect()
        assert ref() is None  # the last rule naming it is gone: freed
