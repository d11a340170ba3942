"""The fp8 rule of a policy: which ``nn.Linear`` layers run in fp8, its checked JSON form, and
its attachment to a live Guard or Controller.

The rule's settings (recipe, selection, first/last, backend, per-layer recipes) are a value: they
compare, hash, print and serialise. A Guard or Controller is runtime state (its decisions, its
rungs): the rule holds no live object, only an :class:`Attachment`, a small immutable handle (the
kind and a process-unique id, never reused as ``id()`` is); the object itself lives in a registry
while any rule names it, and ``policy.fp8_rule.controller`` reads it from there (``is ctl``). Equality leaves the attachment out (two policies
that differ only by their guard are the same settings: a policy loaded with your controller equals
the one you saved); :func:`mixprec.policy.canonical` keys on the settings *and* the attachment, so
a region never runs with another policy's guard or controller. In a policy file the attachment is
its settings only (:func:`rule_to_dict`); reading it back takes yours (``guard=``/``controller=``,
checked against the saved settings) or builds a new one with a warning (:func:`rule_from_dict`).
"""

from __future__ import annotations

import itertools
import threading
import warnings
import weakref
from dataclasses import InitVar, dataclass, field, fields
from typing import Any, Mapping

from torch import nn

from mixprec._codec import expect, import_type, refuse_unknown, type_path
from mixprec._modules import compile_names
from mixprec._tree import tracing as _tracing
from mixprec.fp8._controller import Controller
from mixprec.fp8._convert import as_recipe
from mixprec.fp8._guard import Guard
from mixprec.fp8._linear import BACKENDS
from mixprec.fp8._recipe import RECIPE_NAMES, Float8Recipe

__all__ = ["Attachment", "Fp8Rule", "rule_to_dict", "rule_from_dict", "guard_from_settings",
           "controller_from_settings", "settings_of", "warn_new_state", "refuse_unused_state"]

_JSON_FIELDS = ("backend", "controller", "first_last", "guard", "names", "recipe", "recipes", "types")


@dataclass(frozen=True)
class Attachment:
    """Which Guard or Controller an fp8 rule carries: its kind (``"guard"`` or ``"controller"``)
    and a process-unique id (the same object gets the same id however often it is attached, and
    no other object ever gets it). Hashable: part of :func:`mixprec.policy.canonical`'s key.

    Example:
        >>> ctl = Controller()
        >>> Attachment.of("controller", ctl) == Attachment.of("controller", ctl)
        True
    """

    kind: str
    uid: int

    @classmethod
    def of(cls, kind: str, obj: Any) -> "Attachment":
        """The attachment of ``obj`` (a Guard or Controller) as ``kind``."""
        key = id(obj)
        with _UIDS_LOCK:
            entry = _UIDS.get(key)
            if entry is None or entry[0]() is not obj:
                uid = next(_NEXT_UID)
                entry = _UIDS[key] = (weakref.ref(obj, lambda _, key=key, uid=uid: _forget(key, uid)), uid)
        return cls(kind, entry[1])


# id(obj) -> (weak reference to obj, its uid). A registry, not a cache: a Guard or Controller is a
# mutable dataclass (unhashable), so its process-unique id is found by id(); the weak reference
# checks that the entry is still that object and removes the entry when it dies, so it holds only
# the live attached objects (never keeps one alive).
_UIDS: dict[int, tuple[weakref.ref, int]] = {}
_UIDS_LOCK = threading.Lock()
_NEXT_UID = itertools.count(1)


def _forget(key: int, uid: int) -> None:
    with _UIDS_LOCK:
        entry = _UIDS.get(key)
        if entry is not None and entry[1] == uid:
            del _UIDS[key]


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

    ``guard``/``controller`` (one at most) are carried for the regions that run the rule and
    named by :attr:`attached`; equality, hashing and the JSON form leave the objects out (see the
    module's docstring).

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
    # runtime state, given to the constructor only: the rule keeps its Attachment handle, never the
    # object (read back through the ``guard``/``controller`` properties, defined below the class)
    guard: InitVar[Guard | None] = None
    controller: InitVar[Controller | None] = None
    recipes: Any = ()  # {qualified name: recipe}, stored as sorted (name, recipe) pairs
    attached: Attachment | None = field(default=None, init=False, compare=False)

    def __post_init__(self, guard: Guard | None, controller: Controller | None) -> None:
        if _tracing():  # see mixprec.policy._refuse_tracing
            raise RuntimeError("build mixprec Fp8Rules and Policies outside torch.compile")
        as_recipe(self.recipe)  # validates
        types = (self.types,) if isinstance(self.types, type) else tuple(self.types)
        if not types or not all(isinstance(t, type) and issubclass(t, nn.Linear) for t in types):
            raise ValueError(f"Policy.fp8 types must be nn.Linear subclasses, got {self.types!r}")
        if self.names is not None:
            compile_names("Policy.fp8", self.names)
        if self.first_last not in ("keep", "fp8"):
            raise ValueError(f"Policy.fp8 first_last must be 'keep' or 'fp8', got {self.first_last!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"Policy.fp8 backend must be one of {', '.join(map(repr, BACKENDS))}, "
                             f"got {self.backend!r}")
        if guard is not None and not isinstance(guard, Guard):
            raise ValueError(f"Policy.fp8 guard must be a mixprec.fp8.Guard, got {type(guard).__name__}")
        if controller is not None:
            if not isinstance(controller, Controller):
                raise ValueError(f"Policy.fp8 controller must be a mixprec.Controller, got "
                                 f"{type(controller).__name__}")
            if guard is not None:
                raise ValueError("Policy.fp8: give guard= or controller=, not both (the controller promotes "
                                 "a layer before the guard's thresholds are crossed, and demotes it again)")
        object.__setattr__(self, "types", types)
        object.__setattr__(self, "recipes", _per_layer_recipes(self.recipes))
        state = guard if guard is not None else controller
        if state is not None:
            attached = Attachment.of("guard" if guard is not None else "controller", state)
            object.__setattr__(self, "attached", attached)
            _hold(self, attached.uid, state)

    def __reduce__(self) -> tuple[Any, ...]:
        """Copy and pickle through the constructor: a copied guard or controller gets its own
        :attr:`attached` id."""
        values = {f.name: getattr(self, f.name) for f in fields(self) if f.init}
        return _rebuild_rule, ({**values, "guard": self.guard, "controller": self.controller},)

    @property
    def recipe_name(self) -> str:
        """The default recipe's name (``tensorwise``, ``rowwise``, ``mxfp8``, ...)."""
        return self.recipe if isinstance(self.recipe, str) else self.recipe.name

    def recipe_for(self, fqn: str) -> Float8Recipe:
        """The :class:`mixprec.fp8.Float8Recipe` the layer named ``fqn`` runs: its own from
        ``recipes``, else the rule's ``recipe``."""
        return as_recipe(dict(self.recipes).get(fqn, self.recipe))

    def detached(self) -> "Fp8Rule":
        """The same settings without a guard or controller."""
        if self.attached is None:
            return self
        return Fp8Rule(self.recipe, self.types, self.names, self.first_last, self.backend, recipes=self.recipes)


# uid -> [the Guard or Controller, how many live rules name it]. A registry with a reason: a
# policy is a value and holds no live object, so the object its rule names lives here while any
# rule naming it does (a controller made inline, ``Policy.fp8(controller=Controller())``, is
# reached only through ``policy.fp8_rule.controller``); the last such rule's finalizer drops it.
_HELD: dict[int, list[Any]] = {}


def _hold(rule: Fp8Rule, uid: int, state: Any) -> None:
    with _UIDS_LOCK:
        entry = _HELD.setdefault(uid, [state, 0])
        entry[1] += 1
    weakref.finalize(rule, _release, uid)


def _release(uid: int) -> None:
    with _UIDS_LOCK:
        entry = _HELD.get(uid)
        if entry is not None:
            entry[1] -= 1
            if entry[1] == 0:
                del _HELD[uid]


def _attached(kind: str) -> property:
    def get(rule: Fp8Rule) -> Any:
        a = rule.attached
        if a is None or a.kind != kind:
            return None
        return _HELD[a.uid][0]

    get.__doc__ = f"The {kind} the rule names (:attr:`Fp8Rule.attached`), or None."
    return property(get)


# after the dataclass is made: its __init__ takes guard=/controller= (InitVars with default None)
Fp8Rule.guard = _attached("guard")  # type: ignore[assignment]
Fp8Rule.controller = _attached("controller")  # type: ignore[assignment]


def _rebuild_rule(values: dict[str, Any]) -> Fp8Rule:
    return Fp8Rule(**values)


def _per_layer_recipes(recipes: Any) -> tuple[tuple[str, Any], ...]:
    """``recipes`` (a mapping or ``(name, recipe)`` pairs) as sorted pairs, each recipe validated."""
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
            as_recipe(recipe)
        except ValueError as e:
            raise ValueError(f"Policy.fp8 recipes[{name!r}]: {e}") from e
    return tuple(sorted(pairs, key=lambda p: p[0]))


# ----------------------------------------------------------------- the checked JSON form
def rule_to_dict(rule: Fp8Rule) -> dict[str, Any]:
    """The rule as plain JSON data; a guard or controller as its settings (its decisions, rungs
    and log are runtime state: their ``state_dict()``).

    Raises:
        ValueError: a custom recipe (not a named one), or a type not importable by its path.
    """
    recipe = _recipe_name(rule.recipe)
    guard = None if rule.guard is None else settings_of(rule.guard)
    out = {"recipe": recipe, "types": [type_path(t) for t in rule.types], "names": rule.names,
           "first_last": rule.first_last, "backend": rule.backend, "guard": guard}
    if rule.controller is not None:
        out["controller"] = settings_of(rule.controller)
    if rule.recipes:
        out["recipes"] = {n: _recipe_name(r) for n, r in rule.recipes}
    return out


def _recipe_name(recipe: Any) -> str:
    if isinstance(recipe, str):
        return recipe
    if recipe.name not in RECIPE_NAMES or Float8Recipe.from_name(recipe.name) != recipe:
        raise ValueError(f"cannot serialize the custom fp8 recipe {recipe!r}: use a named recipe "
                         f"({', '.join(map(repr, RECIPE_NAMES))})")
    return recipe.name


def rule_from_dict(data: Any, given: Mapping[str, Any]) -> Fp8Rule:
    """The rule :func:`rule_to_dict` wrote, checked field by field. ``given`` maps ``"guard"`` and
    ``"controller"`` to the caller's objects (or None): a saved guard or controller is replaced by
    the caller's of the same kind and settings, else built new from its settings with a warning.

    Raises:
        ValueError: data of the wrong shape (the message names the field), or a given guard or
            controller the data has no settings for, or other settings.
    """
    expect(data, Mapping, "policy 'fp8_rule'", "an object")
    refuse_unknown(data, _JSON_FIELDS, "fp8_rule", str(list(_JSON_FIELDS)))
    values = dict(data)
    for key in ("recipe", "first_last", "backend"):
        if key in values:
            expect(values[key], str, f"fp8_rule {key!r}", "a str")
    if values.get("names") is not None:
        expect(values["names"], str, "fp8_rule 'names'", "a regex str")
    values["types"] = tuple(import_type(t) for t in expect(
        values.get("types", ["torch.nn.modules.linear.Linear"]), (list, tuple), "fp8_rule 'types'",
        "a list of type paths"))
    for state, build in (("guard", guard_from_settings), ("controller", controller_from_settings)):
        mine = given[state]
        if values.get(state) is None:
            if mine is not None:
                raise ValueError(f"the policy's fp8 rule has no {state}: attach yours with "
                                 f"policy.fp8(..., {state}=...), not from_json/load({state}=...)")
            continue
        saved = build(values[state])
        if mine is None:
            warn_new_state(state, saved, "Policy.load/from_json")
            values[state] = saved
            continue
        if type(mine) is not type(saved) or settings_of(mine) != settings_of(saved):
            raise ValueError(f"the {state} passed has other settings than the policy's saved {state}: "
                             f"{settings_of(mine)} != {settings_of(saved)}; pass one built with the saved settings")
        values[state] = mine
    if "recipes" in values:
        recipes = expect(values["recipes"], Mapping, "fp8_rule 'recipes'", "an object {layer name: recipe name}")
        for name, recipe in recipes.items():
            expect(recipe, str, f"fp8_rule recipes[{name!r}]", "a recipe name")
        values["recipes"] = dict(recipes)
    return Fp8Rule(**values)


def guard_from_settings(data: Any) -> Guard:
    """A new Guard with the saved settings (``data``: its constructor's keyword arguments)."""
    settings = expect(data, Mapping, "fp8_rule 'guard'", "an object")
    known = {f.name for f in fields(Guard) if f.init}
    refuse_unknown(settings, known, "fp8 guard", str(sorted(known)))
    return Guard(**settings)


def controller_from_settings(data: Any) -> Controller:
    """A new Controller with the saved settings (:meth:`Controller.config`)."""
    return Controller.from_config(expect(data, Mapping, "fp8_rule 'controller'", "an object"))


def settings_of(state: Guard | Controller) -> dict[str, Any]:
    """A guard's or controller's settings, as saved in a policy file."""
    if isinstance(state, Controller):
        return state.config()
    return {f.name: getattr(state, f.name) for f in fields(state) if f.init}


def warn_new_state(state: str, built: Any, where: str) -> None:
    """Say that a guard or controller was built from saved settings (nothing of the caller's steps it)."""
    fix = (f"pass {state}=your_{state} to Policy.load/from_json to run with yours" if where != "Policy.parse"
           else f"to run with yours, attach it: policy.fp8(..., {state}=your_{state})")
    warnings.warn(
        f"mixprec.Policy: {where} built a new {type(built).__name__} from the policy's saved {state} "
        f"settings (fresh: no decisions yet, and nothing of yours steps it; step it as "
        f"policy.fp8_rule.{state}.step()); {fix}", UserWarning, stacklevel=5)


def refuse_unused_state(given: Mapping[str, Any], why: str) -> None:
    """Raise a ValueError if ``given`` holds a guard or controller a policy cannot use (``why``)."""
    for state, value in given.items():
        if value is not None:
            raise ValueError(f"{state}= given, but the policy cannot use it: {why}; attach it with "
                             f"policy.fp8(..., {state}=...)")
