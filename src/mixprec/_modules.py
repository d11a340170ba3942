"""Module rules: which modules of a model a rule selects, by type or by qualified name.

Shared by :meth:`mixprec.Policy.keep` (run matched modules in another dtype inside an autocast
region) and :func:`mixprec.to_low_precision` (leave matched modules' weights in float32).
"""

from __future__ import annotations

import re
import re._constants as _re_constants  # sre internals: a names= pattern is checked before use
import re._parser as _re_parser
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from mixprec._tree import tracing as _tracing

__all__ = ["ModuleRule", "Fp8Rule", "NORM_TYPES", "compile_names"]

#: Normalisation layers: the modules that mixed-precision recipes keep in float32 by default.
NORM_TYPES: tuple[type[nn.Module], ...] = tuple(
    t
    for t in (
        nn.modules.batchnorm._NormBase,  # BatchNorm1d/2d/3d, SyncBatchNorm, InstanceNorm*
        nn.LayerNorm,
        nn.GroupNorm,
        nn.LocalResponseNorm,
        getattr(nn, "RMSNorm", None),  # torch >= 2.4
    )
    if t is not None
)


_MAX_REPEATS = 6  # quantifiers in one pattern: past this, a failing search can take polynomial ages
_MAX_DEPTH = 100  # nesting levels of a names= regex (deeper: refused whatever the recursion limit)
_NAME_CACHE_SIZE = 4096  # decisions by qualified name a rule remembers (cleared when full)


def compile_names(what: str, pattern: str) -> re.Pattern[str]:
    """``pattern`` compiled, if it is a safe ``names=`` regex: policy files are data, and a rule's
    pattern is searched in every module name the model calls.

    Refused (ValueError): an invalid regex or one nested too deeply, a quantifier or alternation
    inside a repeated group (``(a+)+``, ``(a|ab)*``: backtracking exponential in the name's length),
    a backreference, or more than 6 quantifiers. Write the name's parts out instead
    (``^blocks\\.\\d+\\.attn$``, ``^(q|k|v)_proj$``).
    """
    if not isinstance(pattern, str):
        raise ValueError(f"{what} names= must be a regex str, got {type(pattern).__name__}")
    try:
        compiled = re.compile(pattern)
        tree = _re_parser.parse(pattern)
    except re.error as e:
        raise ValueError(f"{what} names={_shown(pattern)} is not a valid regex: {e}") from None
    except RecursionError:
        raise ValueError(f"{what} names={_shown(pattern)}: the regex is nested too deeply") from None
    problem = _regex_problem(tree)
    if problem is not None and "nested too deeply" in problem:
        raise ValueError(f"{what} names={_shown(pattern)}: {problem}")
    if problem is not None:
        raise ValueError(
            f"{what} names={_shown(pattern)}: {problem}; mixprec refuses patterns whose search can backtrack "
            "for minutes on a long module name. Spell the name's parts out (e.g. r'^blocks\\.\\d+\\.attn$' "
            "or r'^(q|k|v)_proj$', no group that is both repeated and contains a quantifier or '|')")
    return compiled


def _shown(pattern: str) -> str:
    text = repr(pattern)
    return text if len(text) <= 80 else text[:77] + "..."


def _regex_problem(tree: Any) -> str | None:
    """Why a parsed regex may backtrack exponentially (or too long), or None. Iterative: a deep
    pattern cannot exhaust the stack here."""
    repeats = 0
    stack: list[tuple[Any, bool, int]] = [(tree, False, 0)]  # (subpattern, inside a repeat, depth)
    while stack:
        node, repeated, depth = stack.pop()
        if depth > _MAX_DEPTH:  # (whether re.compile recursed too deep depends on the recursion limit)
            return f"the regex is nested too deeply (more than {_MAX_DEPTH} levels)"
        depth += 1
        for op, av in node:
            name = str(op)
            if name in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT"):
                low, high, body = av
                if high > 1 or high == _re_constants.MAXREPEAT:
                    if repeated:
                        return "a quantifier inside a repeated group"
                    repeats += 1
                    stack.append((body, True, depth))
                else:
                    stack.append((body, repeated, depth))
            elif name == "BRANCH":
                if repeated:
                    return "an alternation '|' inside a repeated group"
                stack.extend((b, repeated, depth) for b in av[1])
            elif name in ("GROUPREF", "GROUPREF_EXISTS"):
                return "a backreference"
            elif name == "SUBPATTERN":
                stack.append((av[-1], repeated, depth))
            elif name in ("ASSERT", "ASSERT_NOT"):
                stack.append((av[1], repeated, depth))
            elif name == "ATOMIC_GROUP":
                stack.append((av, repeated, depth))
    if repeats > _MAX_REPEATS:
        return f"{repeats} quantifiers (at most {_MAX_REPEATS})"
    return None


@dataclass(frozen=True)
class ModuleRule:
    """Selects modules by type and/or by a regular expression on their qualified name.

    A module matches when it is an instance of one of ``types`` **or** when ``re.search(names,
    qualified_name)`` finds a match (so ``names=r"^head$"`` selects exactly ``head`` and
    ``names=r"norm"`` every module with ``norm`` in its name). The root module's name is ``""``.
    Each name is searched once (the decision is remembered, for up to 4096 names); a pattern
    that could backtrack for long is refused (:func:`compile_names`).

    Example:
        >>> rule = ModuleRule(torch.float32, types=(nn.LayerNorm,), names=r"^lm_head$")
        >>> rule.matches(nn.LayerNorm(4), "blocks.0.ln")
        True
    """

    dtype: torch.dtype
    types: tuple[type[nn.Module], ...] = ()
    names: str | None = None
    _pattern: re.Pattern[str] | None = field(default=None, init=False, repr=False, compare=False)
    _by_name: dict[str, bool] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if _tracing():  # see mixprec.policy._refuse_tracing
            raise RuntimeError("build mixprec ModuleRules and Policies outside torch.compile")
        if not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point:
            raise ValueError(f"ModuleRule dtype must be a floating torch.dtype, got {self.dtype!r}")
        types = self.types
        if isinstance(types, type):
            types = (types,)
        types = tuple(types)
        for t in types:
            if not (isinstance(t, type) and issubclass(t, nn.Module)):
                raise ValueError(f"ModuleRule types must be nn.Module subclasses, got {t!r}")
        pattern = None if self.names is None else compile_names("ModuleRule", self.names)
        if not types and pattern is None:
            raise ValueError("a ModuleRule needs types=(...) or names=r'...' (or both)")
        object.__setattr__(self, "types", types)
        object.__setattr__(self, "_pattern", pattern)

    def matches(self, module: nn.Module, qualified_name: str) -> bool:
        """Whether this rule selects ``module``, whose qualified name in the model is given."""
        if self.types and isinstance(module, self.types):
            return True
        if self._pattern is None:
            return False
        hit = self._by_name.get(qualified_name)
        if hit is None:
            hit = self._pattern.search(qualified_name) is not None
            if len(self._by_name) >= _NAME_CACHE_SIZE:
                self._by_name.clear()
            self._by_name[qualified_name] = hit
        return hit


@dataclass(frozen=True)
class Fp8Rule:
    """Which ``nn.Linear`` layers run their GEMMs in fp8 inside an autocast region.

    Built by :meth:`mixprec.Policy.fp8`; see :mod:`mixprec.fp8` for the recipes and the guard.
    Layers are chosen by :func:`mixprec.fp8.select_layers` (instances of ``types`` whose
    qualified name matches ``names``, with in/out features multiples of 16; the first and last
    such layer stay in the compute dtype unless ``first_last="fp8"``). Modules selected by a
    ``keep`` rule, or inside one, never run in fp8.

    ``recipes`` gives layers their own recipe: ``{qualified name: recipe}`` (a mapping, stored as
    sorted ``(name, recipe)`` pairs); the other selected layers run ``recipe``. Each named layer
    must be one the rule selects, eligible for its own recipe (checked as the model runs:
    ValueError otherwise).

    Example:
        >>> Fp8Rule("rowwise", names=r"blocks\\.").recipe_name
        'rowwise'
        >>> Fp8Rule("tensorwise", recipes={"2": "mxfp8"}).recipe_for("2").name
        'mxfp8'
    """

    recipe: Any = "tensorwise"  # a recipe name or a mixprec.fp8.Float8Recipe
    types: tuple[type[nn.Module], ...] = (nn.Linear,)
    names: str | None = None
    first_last: str = "keep"
    backend: str = "auto"
    guard: Any = field(default=None, compare=False)  # a mixprec.fp8.Guard (mutable: its decisions)
    controller: Any = field(default=None, compare=False)  # a mixprec.Controller (mutable: its rungs)
    recipes: Any = ()  # {qualified name: recipe}, stored as sorted (name, recipe) pairs

    def __post_init__(self) -> None:
        if _tracing():  # see mixprec.policy._refuse_tracing
            raise RuntimeError("build mixprec Fp8Rules and Policies outside torch.compile")
        from mixprec import fp8

        fp8.as_recipe(self.recipe)  # validates
        types = (self.types,) if isinstance(self.types, type) else tuple(self.types)
        if not types or not all(isinstance(t, type) and issubclass(t, nn.Linear) for t in types):
            raise ValueError(f"Policy.fp8 types must be nn.Linear subclasses, got {self.types!r}")
        if self.names is not None:
            compile_names("Policy.fp8", self.names)
        if self.first_last not in ("keep", "fp8"):
            raise ValueError(f"Policy.fp8 first_last must be 'keep' or 'fp8', got {self.first_last!r}")
        if self.backend not in ("auto", "emulate", "scaled_mm"):
            raise ValueError(f"Policy.fp8 backend must be 'auto', 'emulate' or 'scaled_mm', got {self.backend!r}")
        if self.guard is not None and not isinstance(self.guard, fp8.Guard):
            raise ValueError(f"Policy.fp8 guard must be a mixprec.fp8.Guard, got {type(self.guard).__name__}")
        if self.controller is not None:
            if not isinstance(self.controller, fp8.Controller):
                raise ValueError(f"Policy.fp8 controller must be a mixprec.Controller, got "
                                 f"{type(self.controller).__name__}")
            if self.guard is not None:
                raise ValueError("Policy.fp8: give guard= or controller=, not both (the controller promotes "
                                 "a layer before the guard's thresholds are crossed, and demotes it again)")
        object.__setattr__(self, "types", types)
        object.__setattr__(self, "recipes", _per_layer_recipes(self.recipes))

    @property
    def recipe_name(self) -> str:
        """The default recipe's name (``tensorwise``, ``rowwise``, ``mxfp8``, ...)."""
        return self.recipe if isinstance(self.recipe, str) else self.recipe.name

    def recipe_for(self, fqn: str) -> Any:
        """The :class:`mixprec.fp8.Float8Recipe` the layer named ``fqn`` runs: its own from
        ``recipes``, else the rule's ``recipe``."""
        from mixprec import fp8

        return fp8.as_recipe(dict(self.recipes).get(fqn, self.recipe))


def _per_layer_recipes(recipes: Any) -> tuple[tuple[str, Any], ...]:
    """``recipes`` (a mapping or ``(name, recipe)`` pairs) as sorted pairs, each recipe validated."""
    from mixprec import fp8

    if isinstance(recipes, Mapping):
        pairs = list(recipes.items())
    elif isinstance(recipes, (tuple, list)) and all(isinstance(p, (tuple, list)) and len(p) == 2 for p in recipes):
        pairs = [tuple(p) for p in recipes]
    else:
        raise ValueError(f"Policy.fp8 recipes must be a mapping {{layer name: recipe}}, got {recipes!r}")
    names = [n for n, _ in pairs]
    if not all(isinstance(n, str) for n in names) or len(set(names)) != len(names):
        raise ValueError(f"Policy.fp8 recipes keys must be distinct layer names (str), got {names!r}")
    for name, recipe in pairs:
        try:
            fp8.as_recipe(recipe)
        except ValueError as e:
            raise ValueError(f"Policy.fp8 recipes[{name!r}]: {e}") from e
    return tuple(sorted(pairs, key=lambda p: p[0]))
