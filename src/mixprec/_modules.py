"""Module rules: which modules of a model a rule selects, by type or by qualified name (the fp8
rule, which selects ``nn.Linear`` layers, is :class:`mixprec.policy._rule.Fp8Rule`).

Shared by :meth:`mixprec.Policy.keep` (run matched modules in another dtype inside an autocast
region) and :func:`mixprec.to_low_precision` (leave matched modules' weights in float32).
"""

from __future__ import annotations

import re
import re._constants as _re_constants  # sre internals: a names= pattern is checked before use
import re._parser as _re_parser
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from mixprec._dtype_names import SHORT_NAMES
from mixprec._tree import tracing as _tracing

__all__ = ["ModuleRule", "NORM_TYPES", "compile_names", "WRAPPER_KEYS", "is_wrapper_key", "unwrap", "named_modules",
           "clean_name"]

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


#: The attributes under which PyTorch's module wrappers hold the module they wrap: torch.compile's
#: ``OptimizedModule``, FSDP1's ``FullyShardedDataParallel``, ``checkpoint_wrapper``'s
#: ``CheckpointWrapper`` (the names ``torch.distributed.checkpoint`` drops from its fully qualified
#: names too); ``DistributedDataParallel`` and ``DataParallel`` hold theirs as ``module``.
WRAPPER_KEYS = ("_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module")


def is_wrapper_key(parent: nn.Module, key: str) -> bool:
    """Whether ``parent``'s child ``key`` is the module a wrapper wraps (no part of a name)."""
    return key in WRAPPER_KEYS or (key == "module" and isinstance(
        parent, (nn.DataParallel, nn.parallel.DistributedDataParallel)))


def unwrap(module: nn.Module) -> nn.Module:
    """``module`` without its outer wrappers (DDP, DataParallel, FSDP1, torch.compile,
    checkpoint_wrapper, nested in any order): the user's model."""
    while True:
        inner = next((c for k, c in module._modules.items() if c is not None and is_wrapper_key(module, k)), None)
        if inner is None:
            return module
        module = inner


def named_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``model.named_modules()`` (each module once, parents first) with the wrappers' parts left
    out of the names: ``DistributedDataParallel(model)``'s ``module.head``, FSDP1's
    ``layers.0._fsdp_wrapped_module.attn`` and torch.compile's ``_orig_mod.head`` are ``head``,
    ``layers.0.attn`` and ``head``, as in the bare model. A wrapper comes right before the module
    it wraps, under the same name (so ``dict(named_modules(m))[name]`` is the wrapped module).

    Example:
        >>> [n for n, _ in named_modules(nn.DataParallel(nn.Sequential(nn.Linear(2, 2))))]
        ['', '', '0']
    """
    out: list[tuple[str, nn.Module]] = []
    seen: set[int] = set()
    stack = [("", model)]
    while stack:
        name, mod = stack.pop()
        if id(mod) in seen:
            continue
        seen.add(id(mod))
        out.append((name, mod))
        children = [(name if is_wrapper_key(mod, k) else f"{name}.{k}" if name else k, c)
                    for k, c in mod._modules.items() if c is not None]
        stack.extend(reversed(children))
    return out


def clean_name(name: str) -> str:
    """A qualified name without the wrapper attributes that can be told by name alone
    (:data:`WRAPPER_KEYS`: torch.compile's, FSDP1's, checkpoint_wrapper's). DDP's ``module.``
    cannot (a model may have a child called ``module``): :func:`named_modules` drops it by type.

    Example:
        >>> clean_name("_orig_mod.layers.0._fsdp_wrapped_module.attn")
        'layers.0.attn'
    """
    return ".".join(p for p in name.split(".") if p not in WRAPPER_KEYS)


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
    ``names=r"norm"`` every module with ``norm`` in its name). The root module's name is ``""``;
    PyTorch's wrappers (DDP's ``module.``, FSDP1's, torch.compile's) add no part to the names
    the engine gives (:func:`named_modules`).
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
        if _tracing():  # see mixprec._tree.refuse_tracing
            raise RuntimeError("build mixprec ModuleRules and Policies outside torch.compile")
        if not isinstance(self.dtype, torch.dtype) or self.dtype not in SHORT_NAMES:
            raise ValueError(f"ModuleRule dtype must be torch.float32, torch.bfloat16 or torch.float16 (what a "
                             f"module runs in under autocast, and what a policy's text and JSON forms hold), "
                             f"got {self.dtype!r}")
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
