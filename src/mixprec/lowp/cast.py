"""Cast a model's weights to bfloat16/float16 in place, keeping selected modules in float32."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Union

import torch
from torch import nn

from mixprec._modules import NORM_TYPES, ModuleRule
from mixprec.policy import Policy

__all__ = ["to_low_precision", "KeepSpec", "LOW_PRECISION_DTYPES"]

#: The dtypes :func:`to_low_precision` casts to.
LOW_PRECISION_DTYPES = (torch.bfloat16, torch.float16)

_Predicate = Callable[[nn.Module, str], bool]
_KeepItem = Union[ModuleRule, type, str, _Predicate]
#: What ``keep=`` accepts: see :func:`to_low_precision`.
KeepSpec = Union[None, _KeepItem, Sequence[_KeepItem], "Policy"]


def _is_module_type(x: object) -> bool:
    return isinstance(x, type) and issubclass(x, nn.Module)


def _keep_rules(keep: KeepSpec) -> list[ModuleRule | _Predicate]:
    """Normalise ``keep`` into ModuleRules (types/regexes become float32 rules) and predicates."""
    if keep is None:
        return []
    module_rules = getattr(keep, "module_rules", None)  # a mixprec.Policy: its keep rules
    if isinstance(module_rules, tuple):
        keep = module_rules
    if isinstance(keep, (ModuleRule, str, type)) or callable(keep):
        items = [keep]
    else:
        try:
            items = list(keep)
        except TypeError:
            raise TypeError(
                "keep= takes a ModuleRule, an nn.Module type, a qualified-name regex (str), a "
                "callable (module, qualified_name) -> bool, a mixprec.Policy, or a sequence of "
                f"these; got {keep!r}"
            ) from None
    rules: list[ModuleRule | _Predicate] = []
    for item in items:  # in order: the first match wins
        if _is_module_type(item):
            rules.append(ModuleRule(torch.float32, types=(item,)))
        elif isinstance(item, (ModuleRule, str)):
            rules.append(ModuleRule(torch.float32, names=item) if isinstance(item, str) else item)
        elif callable(item) and not isinstance(item, type):
            rules.append(item)
        else:
            raise TypeError(
                "keep= takes ModuleRules, nn.Module types, qualified-name regexes (str) or "
                f"callables (module, qualified_name) -> bool; got {item!r}"
            )
    return rules


def _kept_dtype(rules: list[ModuleRule | _Predicate], module: nn.Module, name: str) -> torch.dtype | None:
    for rule in rules:
        if isinstance(rule, ModuleRule):
            if rule.matches(module, name):
                return rule.dtype
        elif rule(module, name):
            return torch.float32
    return None


def to_low_precision(
    model: nn.Module,
    dtype: torch.dtype | None = None,
    keep: KeepSpec = NORM_TYPES,
    *,
    policy: "Policy | str | None" = None,
) -> nn.Module:
    """Cast ``model``'s floating parameters and buffers to ``dtype`` in place; return ``model``.

    Modules selected by ``keep`` (and everything inside them) keep their weights in float32, or
    in the rule's dtype for a :class:`mixprec.ModuleRule`. Casting works like ``module.to``:
    ``nn.Parameter`` objects keep their identity (an optimizer built before still holds them),
    gradients are cast along, integer buffers (e.g. ``num_batches_tracked``) are left alone.

    Args:
        model: the model, changed in place.
        dtype: ``torch.bfloat16`` (default) or ``torch.float16``.
        keep: which modules not to cast, in the rule syntax of ``Policy.keep``: a
            :class:`mixprec.ModuleRule` or a sequence of them, ``nn.Module`` types (one or a
            tuple), a regex searched in qualified names (``r"^head$"``), a callable ``(module,
            qualified_name) -> bool``, or a sequence mixing these; the first match wins. A
            ``mixprec.Policy`` stands for its ``module_rules`` (``keep=policy`` keeps what
            ``Policy.keep`` selected). Default: normalisation layers
            (``mixprec._modules.NORM_TYPES``). ``None`` or ``()`` keeps nothing. A tensor shared
            by a kept and a cast module (tied weights) is kept.

        policy: a :class:`mixprec.Policy` (or a string for :meth:`Policy.parse`) whose
            ``params`` is the dtype and whose module rules, if it has any, are ``keep``.

    Raises:
        ValueError: ``dtype`` is not bfloat16/float16, ``policy.params`` is float32 (nothing to
            cast), or ``dtype`` and ``policy.params`` are both given and differ.
        TypeError: ``model`` is not an ``nn.Module`` or a ``keep`` item is not understood.

    Example:
        >>> model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 2))
        >>> model = to_low_precision(model, keep=(nn.LayerNorm, r"^2$"))
        >>> [p.dtype for p in model.parameters()][::2]
        [torch.bfloat16, torch.float32, torch.float32]
    """
    if policy is not None:
        policy = Policy.coerce(policy)
        if dtype is not None and dtype != policy.params:
            raise ValueError(f"to_low_precision got dtype={dtype} and policy.params={policy.params}; "
                             "pass one of them")
        if policy.params not in LOW_PRECISION_DTYPES:
            raise ValueError(f"the policy stores params={str(policy.params).removeprefix('torch.')}: "
                             "nothing to cast; give it "
                             "params=bfloat16 or params=float16")
        dtype = policy.params
        if policy.module_rules and keep is NORM_TYPES:
            keep = policy
    dtype = torch.bfloat16 if dtype is None else dtype
    if dtype not in LOW_PRECISION_DTYPES:
        raise ValueError(
            f"to_low_precision casts to torch.bfloat16 or torch.float16, got {dtype!r}; "
            "use model.to(dtype) for other dtypes"
        )
    if not isinstance(model, nn.Module):
        raise TypeError(f"to_low_precision needs an nn.Module, got {type(model).__name__}")
    rules = _keep_rules(keep)

    # Decide every tensor's dtype first, then cast each once: a tensor shared by a kept and a
    # cast module (tied weights, a module reachable under two names) keeps the first kept dtype
    # that reaches it, whatever the traversal order, and is never cast down and back up.
    kept_dtypes: dict[int, torch.dtype] = {}
    modules: list[nn.Module] = []

    def visit(module: nn.Module, name: str, kept: torch.dtype | None) -> None:
        if kept is None:
            kept = _kept_dtype(rules, module, name)
        modules.append(module)
        if kept is not None:
            for t in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
                kept_dtypes.setdefault(id(t), kept)
        for child_name, child in module.named_children():
            visit(child, f"{name}.{child_name}" if name else child_name, kept)

    visit(model, "", None)
    for module in modules:
        for p in module.parameters(recurse=False):  # a gradient follows its parameter
            if p.grad is not None and id(p) in kept_dtypes:
                kept_dtypes[id(p.grad)] = kept_dtypes[id(p)]
    for module in modules:
        module._apply(
            lambda t: t.to(kept_dtypes.get(id(t), dtype)) if t.is_floating_point() else t,
            recurse=False,
        )
    return model
