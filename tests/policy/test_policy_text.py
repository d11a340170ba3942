"""The one-line policy syntax: ``Policy.parse(str(p)) == p`` for every policy (jmp's
``get_policy(str(policy))``), so a policy fits a command-line flag or an environment variable."""

import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st
from torch import nn

import mixprec
from mixprec import Policy

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
OPS = ["mm", "mm.default", "softmax", "softmax.int", "exp", "cat", "sum", "bmm.default", "layer_norm", "addmm",
       "norm", "log_softmax.int", torch.exp]
NAMES = [None, r"^head$", r"blocks\.\d+", "a/ b; c|d", "x/y", '"q"', "tab\there", r"^(q|k|v)_proj$", "/", "a /b",
         "a/\u00a0b"]
LAYERS = ["a", "blocks.0.fc", "x y", "q;k"]


class Block(nn.Module):  # a module type of this file: written by its import path
    pass


class MyLinear(nn.Linear):
    pass


op_edits = st.lists(st.tuples(st.sampled_from(["lower", "fp32", "promote", "passthrough"]),
                              st.lists(st.sampled_from(OPS), min_size=1, max_size=3)), max_size=4)
keep_rules = st.lists(st.tuples(st.lists(st.sampled_from([nn.LayerNorm, nn.Embedding, Block]), max_size=2, unique=True),
                                st.sampled_from(NAMES), st.sampled_from(DTYPES)), max_size=3)
fp8_rules = st.none() | st.fixed_dictionaries({
    "recipe": st.sampled_from(["tensorwise", "rowwise", "rowwise_with_gw_hp", "mxfp8", "blockwise"]),
    "types": st.sampled_from([(nn.Linear,), (MyLinear,), (nn.Linear, MyLinear)]),
    "names": st.sampled_from(NAMES),
    "first_last": st.sampled_from(["keep", "fp8"]),
    "backend": st.sampled_from(["auto", "emulate", "scaled_mm"]),
    "recipes": st.dictionaries(st.sampled_from(LAYERS), st.sampled_from(["tensorwise", "mxfp8"]), max_size=2),
})


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(params=st.sampled_from(DTYPES), compute=st.sampled_from([None, *DTYPES]),
       output=st.sampled_from([None, *DTYPES]), base=st.sampled_from(["torch", "fp32-numerics"]),
       device_type=st.sampled_from([None, "cpu", "cuda"]), edits=op_edits, keeps=keep_rules, fp8=fp8_rules)
def test_parse_reads_back_what_str_writes(params, compute, output, base, device_type, edits, keeps, fp8):
    p = Policy(params=params, compute=compute, output=output, base=base, device_type=device_type)
    for kind, ops in edits:
        p = p.with_ops(**{kind: ops})
    for types, names, dtype in keeps:
        if types or names is not None:
            p = p.keep(types=tuple(types), names=names, dtype=dtype)
    if fp8 is not None:
        p = p.fp8(**fp8)
    text = str(p)
    assert "\n" not in text
    back = Policy.parse(text)
    assert back == p and str(back) == text
    assert back.op_rules == p.op_rules and back.module_rules == p.module_rules


def test_guard_and_controller_settings_come_back_as_settings():
    ctl = mixprec.Controller(every=5, ladder=("tensorwise", "compute"))
    p = Policy.parse("bf16").fp8("rowwise", controller=ctl)
    assert str(p).endswith('controlled {"every":5,"ladder":["tensorwise","compute"]}')
    back = Policy.parse(str(p))
    assert back == p and back.fp8_rule.live is None and back.fp8_rule.controller == ctl.settings
    back = Policy.parse(str(Policy.fp8(guard=mixprec.fp8.Guard(every=7))))
    assert back.fp8_rule.guard == mixprec.fp8.GuardSettings(every=7)
    with pytest.raises(ValueError, match="Controller.every must be an int >= 1"):
        Policy.parse('bf16; fp8 rowwise=Linear controlled {"every":0}')


def test_a_command_line_policy():
    p = Policy.parse("c=bf16,o=f32; ops fp32=exp,softmax lower=bmm.default; keep f32=LayerNorm|/^head$/; "
                     "fp8 rowwise=Linear|/blocks/ except first/last recipes blocks.0=mxfp8")
    assert p == (Policy.parse("c=bf16,o=f32").with_ops(fp32=["exp", "softmax"]).with_ops(lower=["bmm.default"])
                 .keep(types=nn.LayerNorm, names=r"^head$")
                 .fp8("rowwise", names="blocks", first_last="keep", recipes={"blocks.0": "mxfp8"}))


REGEXES_AFTER_A_SLASH = [  # a '/' before what ends a /regex/ for the reader: any str.isspace(), '|', ';'
    "a/\u00a0b", "a/\u2003", "a/\x85b", "a/\u3000b", "^head/\u00a0;keep float32=/^body$", "a/ b", "a/|b", "a/;b", "a/",
]


@pytest.mark.parametrize("names", REGEXES_AFTER_A_SLASH, ids=ascii)
def test_a_regex_with_a_slash_before_a_terminator_reads_back(names):
    """``/`` then U+00A0 was written as ``/regex/``: the reader ended it there (an error, or two rules)."""
    p = Policy().keep(names=names)
    back = Policy.parse(str(p))
    assert back == p and back.module_rules[0].names == names


def _custom(recipe, **changes):
    import dataclasses

    from mixprec.fp8 import Float8Recipe

    base = Float8Recipe.from_name(recipe)
    return dataclasses.replace(base, **{k: (not getattr(base, k)) if v is ... else v for k, v in changes.items()})


CUSTOM_RECIPES = {  # policies with a custom fp8 recipe: shown, never read back as another policy
    "the rule's recipe": (lambda: Policy.fp8(_custom("rowwise", pow2_scales=..., seed=7)), "fp8 <custom rowwise>="),
    "a layer's recipe": (lambda: Policy.fp8(names="^(a|b)$", recipes={"a": _custom("mxfp8", seed=7)}),
                         "recipes a=<custom mxfp8>"),
    "a renamed recipe": (lambda: Policy.fp8(_custom("tensorwise", name="mine")), "fp8 <custom mine>="),
}


@pytest.mark.parametrize("make, shown", CUSTOM_RECIPES.values(), ids=CUSTOM_RECIPES.keys())
def test_a_custom_fp8_recipe_is_shown_and_refused_by_parse(make, shown):
    """``str`` wrote the named recipe a custom one came from: parse gave another policy, silently."""
    p = make()
    text = str(p)  # display and logs: never raises
    assert shown in text
    with pytest.raises(ValueError, match="custom fp8 recipe .* has no text form"):
        Policy.parse(text)
    with pytest.raises(ValueError, match="custom fp8 recipe"):
        p.to_json()


def test_a_named_recipe_object_is_its_name():
    """``Float8Recipe.from_name("rowwise")`` printed as ``rowwise`` but the rule held the object:
    ``parse(str(p))`` (and ``from_json``) gave a rule holding the name, not equal to ``p``."""
    from mixprec.fp8 import Float8Recipe

    by_object = Policy.fp8(Float8Recipe.from_name("rowwise"), names="^(a|b)$",
                           recipes={"a": Float8Recipe.from_name("mxfp8")})
    by_name = Policy.fp8("rowwise", names="^(a|b)$", recipes={"a": "mxfp8"})
    assert by_object == by_name and hash(by_object) == hash(by_name)
    assert Policy.parse(str(by_object)) == by_object == Policy.from_json(by_object.to_json())
    assert by_object.fp8_rule.recipe_for("a") == Float8Recipe.from_name("mxfp8")


@pytest.mark.parametrize("spec, match", [
    ("bf16; keep float32=Lineer", "no torch.nn module type"),
    ("bf16; keep float32=notimported_pkg.mod.Block", "is not imported"),
    ("bf16; oops fp32=exp", "unknown section"),
    ("bf16; ops fp33=exp", "unknown cast kind"),
    ("bf16; ops fp32=view", "returns a view"),
    ("bf16; keep float32=/^([a-z]+)+$/", "quantifier inside a repeated group"),
    ("bf16; keep float32=/a/|/b/", "one name regex"),
    ("bf16; fp8 tensorwise=Linear sideways", "unknown fp8 option"),
    ("bf16,fp8=rowwise; fp8 tensorwise=Linear", "give one"),
    ("bf16; keep float32=/abc", "closing"),
])
def test_a_bad_policy_string_says_what_is_wrong(spec, match):
    with pytest.raises(ValueError, match=match):
        Policy.parse(spec)


def test_parsing_never_imports_a_module():
    import sys

    assert "xml.dom.minidom" not in sys.modules or pytest.skip("already imported")
    with pytest.raises(ValueError, match="not imported|not an importable"):
        Policy.parse("bf16; keep float32=xml.dom.minidom.Node")
    assert "xml.dom.minidom" not in sys.modules


def test_no_warning_for_a_policy_without_state():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Policy.parse(str(Policy.parse("bf16").keep(types=Block).fp8()))
