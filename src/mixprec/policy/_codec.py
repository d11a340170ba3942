"""The checked JSON codec of policies: plain data in, validated values out, every error naming the
field it is about.

A policy file is data (it may come from another machine or a report), so nothing read here is
trusted: each value is checked for its type before it is used (:func:`expect`), unknown keys are
refused (:func:`refuse_unknown`), module types are looked up among the modules already imported and
never imported (:func:`import_type`), and op rules are validated as :meth:`mixprec.Policy.with_ops`
validates (:func:`checked_op_rules`). Shared by :mod:`mixprec.policy` and the fp8 rule
(:mod:`mixprec.policy._rule`); the one-line text form (:mod:`mixprec.policy._text`) uses the same
look-ups.

Example:
    >>> parse_dtype("bf16")
    torch.bfloat16
    >>> expect(3, str, "policy 'base'", "a str")
    Traceback (most recent call last):
    ValueError: policy 'base' must be a str, got int 3
"""

from __future__ import annotations

import sys
from types import MappingProxyType
from typing import Any, Iterable, Mapping

import torch
from torch import nn

from mixprec import ops as _ops
from mixprec._dtype_names import DTYPE_NAMES, SHORT_NAMES, dtype_name, parse_dtype
from mixprec._modules import ModuleRule
from mixprec._ops_names import check_castable, rule_names

__all__ = ["DTYPE_NAMES", "check_dtype", "parse_dtype", "dtype_name", "expect", "short", "refuse_unknown", "import_type",
           "module_types", "type_path", "module_rule_to_dict", "module_rule_from_dict", "checked_op_rules", "rule_kind"]

def expect(value: Any, types: type | tuple[type, ...], what: str, shape: str) -> Any:
    """``value`` if it is an instance of ``types`` (a bool is no int here), else a ValueError
    saying what ``what`` must be (``shape``) and what it was."""
    if isinstance(value, types) and not isinstance(value, bool):
        return value
    raise ValueError(f"{what} must be {shape}, got {type(value).__name__} {short(value)}")


def short(value: Any) -> str:
    """``repr(value)``, cut to 60 characters (a message quotes data, never all of it)."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def refuse_unknown(data: Mapping[str, Any], known: Iterable[str], what: str, listed: str) -> None:
    """Raise a ValueError naming the keys of ``data`` not in ``known`` (``what``: whose keys,
    ``listed``: the known ones as the message shows them)."""
    unknown = set(data) - set(known)
    if unknown:
        raise ValueError(f"unknown {what} field(s) {sorted(map(str, unknown))}; fields: {listed}")


def module_types(types: Any, where: str, base: type = nn.Module) -> tuple[Any, ...]:
    """``types`` (a module type, or an iterable of them) as a tuple, for the rule's own check of
    each item (``base``: the class each must subclass, named in the message).

    Raises:
        ValueError: a str (a type's name: only the text form names types, ``Policy.parse``), a
            module instance (pass its class), either inside the tuple, or anything not iterable.
    """
    if isinstance(types, type):
        return (types,)
    want = f"{where} types must be an {'nn.Module' if base is nn.Module else 'nn.' + base.__name__} subclass " \
           "or a tuple of them"
    if isinstance(types, str):
        raise ValueError(f"{want}, got the str {short(types)}: pass the class (types=nn.{types.split('.')[-1]}), "
                         "or name it in the one-line form that Policy.parse reads")
    if isinstance(types, nn.Module):
        raise ValueError(f"{want}, got a module instance {short(types)}: pass its class "
                         f"(types={'nn.' if getattr(nn, type(types).__name__, None) is type(types) else ''}"
                         f"{type(types).__qualname__})")
    try:
        items = tuple(types)
    except TypeError:
        raise ValueError(f"{want}, got {type(types).__name__} {short(types)}") from None
    for item in items:
        if isinstance(item, (str, nn.Module)):
            module_types(item, where, base)
    return items


def type_path(t: type) -> str:
    """The import path a policy file stores a module type by (``"torch.nn.modules.linear.Linear"``).

    Raises:
        ValueError: ``t`` cannot be imported back by that path (defined inside a function).
    """
    path = f"{t.__module__}.{t.__qualname__}"
    if "<locals>" in t.__qualname__ or import_type(path, strict=False) is not t:
        raise ValueError(
            f"cannot serialize module rule type {t.__qualname__}: it is not importable as "
            f"{path!r}; define it at module level or select the modules with names=r'...'"
        )
    return path


def import_type(path: Any, strict: bool = True) -> Any:
    """The type ``"package.module.Class"`` (or a nested ``Outer.Inner``) names, looked up in the
    modules already imported (``sys.modules``): a policy file never imports (runs) a module.

    Raises (``strict``):
        ValueError: not a dotted str, its module is not imported (the message names the import
            to run first), or it names no ``nn.Module`` subclass.
    """
    if not isinstance(path, str) or "." not in path:
        if not strict:
            return None
        raise ValueError(f"a module rule type is a dotted path such as "
                         f"'torch.nn.modules.normalization.LayerNorm', got {short(path)}")
    parts, obj = path.split("."), None
    for i in range(len(parts) - 1, 0, -1):  # the longest imported module prefix
        module = sys.modules.get(".".join(parts[:i]))
        if module is None:
            continue
        obj = module
        for attr in parts[i:]:  # no getattr: a module's __getattr__ may import
            obj = vars(obj).get(attr) if hasattr(obj, "__dict__") else None
        break
    else:
        if strict:
            raise ValueError(
                f"module rule type {path!r}: module {'.'.join(parts[:-1])!r} is not imported; "
                f"mixprec does not import modules named in a policy: run "
                f"`import {'.'.join(parts[:-1])}` before loading it")
    if strict and not (isinstance(obj, type) and issubclass(obj, nn.Module)):
        raise ValueError(f"module rule type {path!r} is not an importable nn.Module subclass (looked "
                         f"up in the imported module {'.'.join(parts[:i])!r})")
    return obj


def module_rule_to_dict(rule: ModuleRule) -> dict[str, Any]:
    """A module rule as plain data (inverse: :func:`module_rule_from_dict`)."""
    return {"dtype": dtype_name(rule.dtype), "types": [type_path(t) for t in rule.types], "names": rule.names}


def module_rule_from_dict(data: Any) -> ModuleRule:
    """The module rule :func:`module_rule_to_dict` wrote, checked field by field."""
    expect(data, Mapping, "a module rule", "an object with dtype, types, names")
    refuse_unknown(data, ("dtype", "types", "names"), "module rule", "dtype, types, names")
    names = data.get("names")
    return ModuleRule(
        parse_dtype(expect(data.get("dtype", "float32"), str, "a module rule's dtype", "a dtype name")),
        types=tuple(import_type(t) for t in expect(data.get("types", []), (list, tuple),
                                                    "a module rule's types", "a list of type paths")),
        names=None if names is None else expect(names, str, "a module rule's names", "a regex str"),
    )


def checked_op_rules(rules: Any) -> tuple[tuple[str, str], ...]:
    """``op_rules`` validated as :meth:`mixprec.Policy.with_ops` validates: every name an aten op
    this PyTorch has (expanded with :func:`mixprec._ops_names.rule_names`), no in-place or ``out=``
    overload (autocast never casts them: the op would write into a temporary), no view
    (:func:`mixprec._ops_names.check_castable`: a cast view is a copy), a known kind;
    ``"fp32"`` becomes the op's dtype-argument form where PyTorch has one (as ``with_ops`` does).
    """
    if isinstance(rules, (str, bytes)) or not isinstance(rules, (tuple, list)):
        raise ValueError(f"Policy.op_rules must be a tuple of (op, kind) pairs (build them with "
                         f"Policy.with_ops), got {type(rules).__name__}")
    out: list[tuple[str, str]] = []
    for rule in rules:
        if not (isinstance(rule, (tuple, list)) and len(rule) == 2
                and all(isinstance(x, str) for x in rule)):
            raise ValueError(f"an op rule is an (op name, cast kind) pair of strings, got {short(rule)}")
        name, kind = rule
        if kind not in _ops.CAST_KINDS:
            raise ValueError(f"unknown cast kind {kind!r} for {name}; kinds: {', '.join(_ops.CAST_KINDS)}")
        for overload in rule_names(name):
            check_castable(overload)
            out.append((overload, rule_kind(overload, kind)))
    return tuple(out)


def rule_kind(name: str, kind: str) -> str:
    """The kind an op rule stores for ``name``: ``"fp32"`` becomes the op's dtype-argument form
    where PyTorch has one.

    Raises:
        ValueError: a dtype-argument kind the op has no form of.
    """
    forms = _fp32_forms()
    if kind == "fp32":
        return forms.get(name, "fp32")
    if kind in ("fp32_set_opt_dtype", "fp32_append_dtype") and forms.get(name) != kind:
        raise ValueError(f"{name} has no {kind} form (PyTorch uses it for "
                         f"{', '.join(n for n, k in sorted(forms.items()) if k == kind)}); use 'fp32'")
    return kind


def _fp32_forms() -> Mapping[str, str]:
    """The fp32 forms PyTorch uses for ops with a dtype argument (from the CUDA table)."""
    global _FP32_FORMS
    if _FP32_FORMS is None:
        _FP32_FORMS = MappingProxyType({
            name: kind for name, kind in _ops.default_table("cuda").items()
            if kind in ("fp32_set_opt_dtype", "fp32_append_dtype")})
    return _FP32_FORMS


_FP32_FORMS: Mapping[str, str] | None = None  # a cache: the CUDA table is read once, when first needed


def check_dtype(what: str, dtype: object, allow_none: bool) -> None:
    """Raise ValueError unless ``dtype`` is float32, bfloat16 or float16 (or None, with
    ``allow_none``): the dtypes the policy's text and JSON forms hold, so that every built policy
    saves and loads back."""
    if dtype is None and allow_none:
        return
    if not isinstance(dtype, torch.dtype) or dtype not in SHORT_NAMES:
        raise ValueError(f"Policy.{what} must be torch.float32, torch.bfloat16 or torch.float16, got {dtype!r}")
