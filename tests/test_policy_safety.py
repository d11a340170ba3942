"""Policies are data: what a policy file or string may make mixprec do (regex cost, view ops,
object lifetimes, pickling)."""

import json
import re

import pytest
import torch
from torch import nn

import mixprec
from mixprec import Policy
from mixprec._modules import ModuleRule

# Backtracks exponentially on a name of [a-z_.0-9] without a final "!": minutes at 30 characters.
BACKTRACKING = r"^([a-z_.0-9]+)+!$"


def _policy_files(pattern):
    keep = json.loads(Policy().keep(names="x").to_json())
    keep["module_rules"][0]["names"] = pattern
    fp8 = json.loads(Policy.fp8(names="x").to_json())
    fp8["fp8_rule"]["names"] = pattern
    return [json.dumps(keep), json.dumps(fp8)]


@pytest.mark.parametrize("pattern, problem", [
    (BACKTRACKING, "quantifier inside a repeated group"),
    (r"^(a|ab)*c$", "alternation"),
    (r"(\w)\1", "backreference"),
    ("(" * 500 + "a" + ")" * 500, "nested too deeply"),
])
def test_a_costly_or_deep_names_pattern_is_refused_everywhere(pattern, problem):
    makers = [lambda: Policy().keep(names=pattern), lambda: ModuleRule(torch.float32, names=pattern),
              lambda: Policy.fp8(names=pattern)]
    makers += [lambda text=text: Policy.from_json(text) for text in _policy_files(pattern)]
    for make in makers:
        with pytest.raises(ValueError, match=re.escape(problem)):
            make()


def test_usual_names_patterns_are_accepted():
    for pattern in (r"^head$", r"^(q|k|v)_proj$", r"blocks\.\d+\.attn", r"^layers\.[0-9]+\.mlp\.fc2?$", r"(a)?b"):
        assert Policy().keep(names=pattern).module_rules[0].matches(nn.Identity(), "x") is False


class _CountingPattern:
    def __init__(self, pattern):
        self.pattern, self.names = pattern, []

    def search(self, name):
        self.names.append(name)
        return self.pattern.search(name)


def test_each_module_name_is_searched_once():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)))
    policy = Policy.parse("bf16").keep(names=r"^2\.1$")
    rule = policy.module_rules[0]
    counter = _CountingPattern(rule._pattern)
    object.__setattr__(rule, "_pattern", counter)
    x = torch.randn(2, 4)
    for _ in range(3):
        with mixprec.autocast("cpu", policy=policy):
            model(x)
    assert sorted(counter.names) == sorted({"", "0", "1", "2", "2.0", "2.1"})


VIEW_OPS = ["view", "select.int", "t", "detach", "transpose.int", "permute", "expand", "narrow", "slice.Tensor",
            "squeeze.dim", "unsqueeze", "reshape", "as_strided", "diagonal", "unbind.int", "split.Tensor", "alias",
            "view_as", "unfold", torch.Tensor.view, torch.ops.aten.t.default]


@pytest.mark.parametrize("op", VIEW_OPS, ids=str)
def test_view_and_alias_ops_are_refused_in_every_way_of_making_a_policy(op):
    for kind in ("lower", "fp32", "promote", "passthrough"):
        with pytest.raises(ValueError, match="returns a view of its input"):
            Policy().with_ops(**{kind: [op]})
    if isinstance(op, str):
        with pytest.raises(ValueError, match="returns a view of its input"):
            Policy(op_rules=((op, "fp32"),))
        text = json.dumps({"op_rules": [[op, "lower"]]})
        with pytest.raises(ValueError, match="returns a view of its input"):
            Policy.from_json(text)


def test_a_write_through_a_view_reaches_its_base_in_a_region():
    """What the refusal protects: views stay views inside a region (PyTorch's lists cast none)."""
    x = torch.zeros(4, 10)
    with mixprec.autocast("cpu", policy=Policy.parse("bf16").with_ops(fp32=["exp"])):
        x.view(-1).add_(1.0)
        x.t()[0].fill_(2.0)
    assert x.sum().item() == 4 * 10 - 4 + 2 * 4  # column 0 (4 elements) set to 2
