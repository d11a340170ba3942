"""Property tests of a policy's JSON form: what a policy writes loads back equal; malformed
JSON of any shape is a ValueError, never another exception."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st
from torch import nn

from mixprec import Policy

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

DTYPES = st.sampled_from([torch.float32, torch.bfloat16, torch.float16])
OPS = st.sampled_from(["mm", "bmm", "softmax", "softmax.int", "log_softmax", "exp", "sum", "norm",
                       "cat", "linear", "layer_norm", "addmm", "conv2d", "mm.dtype", "prod"])
TYPES = st.lists(st.sampled_from([nn.LayerNorm, nn.Embedding, nn.Linear, nn.Conv2d]), max_size=2,
                 unique=True)
REGEX = st.sampled_from([None, r"^head$", r"blocks\.\d+", r"norm"])


@st.composite
def policies(draw: st.DrawFn) -> Policy:
    p = Policy(params=draw(DTYPES), compute=draw(st.none() | DTYPES), output=draw(st.none() | DTYPES),
               base=draw(st.sampled_from(["torch", "fp32-numerics"])),
               device_type=draw(st.sampled_from([None, "cpu", "cuda"])))
    for _ in range(draw(st.integers(0, 3))):
        kind = draw(st.sampled_from(["lower", "fp32", "promote", "passthrough"]))
        p = p.with_ops(**{kind: draw(st.lists(OPS, min_size=1, max_size=3, unique=True))})
    for _ in range(draw(st.integers(0, 2))):
        types, names = draw(TYPES), draw(REGEX)
        if types or names:
            p = p.keep(types=tuple(types), names=names, dtype=draw(DTYPES))
    if draw(st.booleans()):
        p = p.fp8(draw(st.sampled_from(["tensorwise", "rowwise", "rowwise_with_gw_hp"])),
                  names=draw(REGEX), first_last=draw(st.sampled_from(["keep", "fp8"])))
    return p


JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 3) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=8), children, max_size=3),
    max_leaves=12,
)


@SETTINGS
@given(policies())
def test_any_policy_loads_back_equal(p: Policy) -> None:
    assert Policy.from_json(p.to_json()) == p
    assert Policy.from_dict(json.loads(json.dumps(p.to_dict()))) == p
    assert str(Policy.from_json(p.to_json())) == str(p)


def _loads_or_value_error(text: str) -> None:
    try:
        assert isinstance(Policy.from_json(text), Policy)
    except ValueError:
        pass


@SETTINGS
@given(JSON)
def test_random_json_is_a_policy_or_a_value_error(value: object) -> None:
    _loads_or_value_error(json.dumps(value))


@SETTINGS
@given(policies(), st.data())
def test_a_policy_with_one_field_replaced_by_random_json_is_a_policy_or_a_value_error(
        p: Policy, data: st.DataObject) -> None:
    d = p.to_dict()
    target = d
    path = data.draw(st.lists(st.integers(0, 5), max_size=3))
    for i in path:  # walk into a random nested place
        children = list(target.values()) if isinstance(target, dict) else target
        nested = [c for c in children if isinstance(c, (dict, list)) and c]
        if not nested:
            break
        target = nested[i % len(nested)]
    if isinstance(target, dict):
        target[data.draw(st.sampled_from(sorted(target)))] = data.draw(JSON)
    elif isinstance(target, list):
        target[data.draw(st.integers(0, len(target) - 1))] = data.draw(JSON)
    _loads_or_value_error(json.dumps(d))


@pytest.mark.parametrize("depth", [50, 5_000, 200_000])
def test_deep_nesting_is_a_value_error(depth: int) -> None:
    for text in ("[" * depth + "]" * depth, '{"a":' * depth + "1" + "}" * depth,
                 json.dumps({"op_rules": [[["mm"]]]})):
        with pytest.raises(ValueError):
            Policy.from_json(text)


@pytest.mark.parametrize("content", [b"\xff\xfe{}", b'{"compute": "bf16"\x80}', b"\x00" * 8],
                         ids=["utf-16 mark", "latin-1 byte", "zeros"])
def test_a_file_that_is_not_utf8_text_is_a_value_error(tmp_path, content: bytes) -> None:
    path = tmp_path / "policy.json"
    path.write_bytes(content)
    with pytest.raises(ValueError, match="policy"):
        Policy.load(path)
