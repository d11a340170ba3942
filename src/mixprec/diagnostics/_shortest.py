"""The audit's policy in its shortest equivalent form.

The audit decides module by module (the modules kept in float32, the fp8 layers and their
formats) and writes those decisions with exact names, ``^(?:a|b\\.c|...)$``: hundreds of
characters on a model of a few dozen layers (issue 42: 997 for a 4-layer Llama). :func:`shortest`
tries shorter rules for the same decisions and keeps the shortest (by ``str(policy)``) that
decides exactly as the exact names do **on this model**, judged by the rules' own matching
(``ModuleRule.matches`` for the kept modules; for the fp8 layers the selection a region runs,
``select_targets``: :func:`mixprec.fp8.select_layers` less the kept modules, recipes included):

* kept modules: a rule over the types of the kept modules (types importable by their path, not
  ``__main__``'s or a function's local class), or a pattern over their last name parts,
  ``(?:^|\\.)(?:input_layernorm|norm)$``;
* fp8 layers: no names at all (``Policy.fp8``'s own selection: every eligible Linear but the first
  and last, or all of them with ``first_last="fp8"``), or a pattern over their last name parts,
  with either ``first_last``.

The exact names are always among the candidates, so an irregular choice keeps them.
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from typing import Any, Iterable

import torch
from torch import nn

from mixprec._modules import named_modules
from mixprec.fp8 import select_layers
from mixprec.policy import Policy

__all__ = ["bare_modules", "exact_names", "fp8_layers", "in_kept", "kept_modules", "shortest"]


def bare_modules(model: nn.Module) -> dict[str, nn.Module]:
    """``{name: module}`` of ``model`` named as mixprec's rules match them: without the parts of
    PyTorch's wrappers (DDP's and DataParallel's ``module.``, torch.compile's ``_orig_mod.``, FSDP1's;
    :func:`mixprec._modules.named_modules`), each name the innermost module (the wrapped one, not
    its wrapper). Every name the diagnostics print or put in a policy is one of these."""
    return dict(named_modules(model))


def exact_names(names: Iterable[str]) -> str:
    """A pattern that ``re.search`` finds in exactly ``names``: ``^(?:a|b\\.c)$``."""
    return rf"^(?:{'|'.join(re.escape(n) for n in sorted(names))})$"


def _tails(names: Iterable[str]) -> str | None:
    """A pattern over the last name parts of ``names`` (None when one is the model itself)."""
    names = list(names)
    if not names or "" in names:
        return None
    tails = sorted({n.rsplit(".", 1)[-1] for n in names})
    body = tails[0] if len(tails) == 1 else f"(?:{'|'.join(tails)})"
    return rf"(?:^|\.){body}$" if all(re.fullmatch(r"\w+", t) for t in tails) else None


def kept_modules(model: nn.Module, policy: Policy) -> set[str]:
    """The modules a module rule of ``policy`` selects by itself (not through a parent)."""
    return {n for n, m in bare_modules(model).items() if any(r.matches(m, n) for r in policy.module_rules)}


def fp8_layers(model: nn.Module, policy: Policy) -> dict[str, str] | None:
    """``{layer: recipe name}`` that a region under ``policy`` runs in fp8 on ``model``, as
    :func:`mixprec.fp8._target.select_targets` selects them (without giving the layers
    statistics); None when the rule names a layer it does not select, or one not eligible for
    its recipe."""
    rule = policy.fp8_rule
    if rule is None:
        return {}
    modules = bare_modules(model)
    with warnings.catch_warnings():  # an ineligible layer warns as the model runs: no news here
        warnings.simplefilter("ignore")
        try:
            chosen = select_layers(model, rule.types, rule.names, rule.first_last, rule.recipe, dict(rule.recipes))
        except ValueError:
            return None
    return {n: rule.recipe_for(n).name for n in chosen if not in_kept(policy, modules, n)}


def in_kept(policy: Policy, modules: dict[str, nn.Module], fqn: str) -> bool:
    """Whether a module rule of ``policy`` selects ``fqn`` or one of its ancestors (keep wins)."""
    parts = fqn.split(".") if fqn else []
    ancestors = [".".join(parts[:i]) for i in range(len(parts) + 1)]
    return any(r.matches(modules[a], a) for a in ancestors for r in policy.module_rules)


def _importable(t: type) -> bool:
    return t.__module__ != "__main__" and "<locals>" not in t.__qualname__


def _keep_forms(model: nn.Module, kept: set[str]) -> list[dict[str, Any]]:
    modules = bare_modules(model)
    types = tuple(dict.fromkeys(type(modules[n]) for n in sorted(kept)))
    forms: list[dict[str, Any]] = []
    if all(_importable(t) for t in types):
        forms.append({"types": types})
    tails = _tails(kept)
    if tails is not None:
        forms.append({"names": tails})
    return forms + [{"names": exact_names(kept)}]


def shortest(model: nn.Module, policy: Policy) -> Policy:
    """The shortest policy (by ``str``) that keeps the same modules in float32 and runs the same
    layers in the same fp8 formats as ``policy`` on ``model`` (see the module docs). ``policy``
    is the audit's: at most one float32 keep rule, by exact names, and an fp8 rule by exact
    names, ``first_last="fp8"``, with ``recipes`` for the layers not in its recipe."""
    base = dataclasses.replace(policy, module_rules=(), fp8_rule=None)
    kept = kept_modules(model, policy)
    best = base
    if kept:
        rules = [base.keep(**form, dtype=torch.float32) for form in _keep_forms(model, kept)]
        best = min((p for p in rules if kept_modules(model, p) == kept), key=lambda p: len(str(p)))
    rule = policy.fp8_rule
    if rule is None:
        return best
    target = fp8_layers(model, policy)
    recipes = dict(rule.recipes) or None
    names = [None, _tails(target or {}), rule.names]
    candidates = [best.fp8(rule.recipe, names=n, first_last=fl, recipes=recipes)
                  for n in dict.fromkeys(names) for fl in ("keep", "fp8")]
    same = [p for p in candidates if target is not None and fp8_layers(model, p) == target]
    return min(same, key=lambda p: len(str(p))) if same else best.fp8(
        rule.recipe, names=rule.names, first_last=rule.first_last, recipes=recipes)
