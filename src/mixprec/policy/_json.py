"""A policy's JSON form: its fields as plain data (:func:`policy_to_dict`) and back, each field
checked (:func:`policy_values`), with the fp8 rule's own form (:mod:`mixprec.policy._rule`)."""

from __future__ import annotations

from typing import Any, Mapping

from mixprec.policy._codec import (dtype_name, expect, module_rule_from_dict, module_rule_to_dict, parse_dtype,
                                   refuse_unknown)
from mixprec.policy._rule import refuse_unused_state, rule_from_dict, rule_to_dict

__all__ = ["policy_to_dict", "policy_values"]


def policy_to_dict(policy: Any) -> dict[str, Any]:
    """``policy``'s fields as plain JSON data (:meth:`mixprec.Policy.to_dict`)."""
    return {
        "params": dtype_name(policy.params),
        "compute": None if policy.compute is None else dtype_name(policy.compute),
        "output": None if policy.output is None else dtype_name(policy.output),
        "base": policy.base,
        "device_type": policy.device_type,
        "op_rules": [list(r) for r in policy.op_rules],
        "module_rules": [module_rule_to_dict(r) for r in policy.module_rules],
        "fp8_rule": None if policy.fp8_rule is None else rule_to_dict(policy.fp8_rule),
    }


def policy_values(data: Any, fields: list[str], guard: Any, controller: Any) -> dict[str, Any]:
    """The constructor's keyword arguments from :func:`policy_to_dict`'s data, each field
    checked (:meth:`mixprec.Policy.from_dict`; ``fields``: the Policy's)."""
    expect(data, Mapping, "a policy", "an object")
    refuse_unknown(data, fields, "policy", str(fields))
    values = dict(data)
    for key in ("params", "compute", "output"):
        if values.get(key) is not None:
            values[key] = parse_dtype(expect(values[key], str, f"policy {key!r}", "a dtype name"))
    for key in ("base", "device_type"):
        if values.get(key) is not None:
            expect(values[key], str, f"policy {key!r}", "a str")
    values["op_rules"] = tuple(
        tuple(expect(r, (list, tuple), "an op rule", "an [op, kind] pair"))
        for r in expect(values.get("op_rules", []), (list, tuple), "policy 'op_rules'", "a list"))
    values["module_rules"] = tuple(
        module_rule_from_dict(r)
        for r in expect(values.get("module_rules", []), (list, tuple), "policy 'module_rules'", "a list"))
    given = {"guard": guard, "controller": controller}
    if values.get("fp8_rule") is not None:
        values["fp8_rule"] = rule_from_dict(values["fp8_rule"], given)
    else:
        refuse_unused_state(given, "it has no fp8 rule")
    return values
