"""The fp8 rule of a policy: which ``nn.Linear`` layers run in fp8, under which Guard or
Controller settings, and its checked JSON form.

The rule is a value: its recipe, selection, first/last, backend, per-layer recipes and the
settings of its guard or controller (:class:`~mixprec.fp8.GuardSettings`,
:class:`~mixprec.fp8.ControllerSettings`) compare, hash, print and serialise. The live Guard or
Controller that steps a run is the model's (``ctl.attach(model)``, ``fp8.convert(model,
controller=ctl)``); a rule names its settings and the region checks that the model's has them.
The older spelling, ``Policy.fp8(controller=ctl)`` with the object, keeps working: the rule takes
``ctl.settings`` into its value and carries the object beside it (:attr:`Fp8Rule.live`: not in
equality, hash or JSON), for the regions of a model without one attached. No registry: the
policy (and Dynamo's canonical copy of it) holds that object while it lives.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Mapping

from torch import nn

from mixprec._modules import compile_names
from mixprec._tree import tracing as _tracing
from mixprec.control._settings import ControllerSettings, GuardSettings
from mixprec.formats._layers import as_recipe
from mixprec.formats._linear import BACKENDS
from mixprec.formats._recipe import RECIPE_NAMES, Float8Recipe
from mixprec.policy._codec import expect, import_type, module_types, refuse_unknown, type_path

__all__ = ["Fp8Rule", "named_recipe", "rule_to_dict", "rule_from_dict", "refuse_unused_state"]

_JSON_FIELDS = ("backend", "controller", "first_last", "guard", "names", "recipe", "recipes", "types")
_KINDS = {"guard": GuardSettings, "controller": ControllerSettings}


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

    ``guard``/``controller`` (one at most): the settings of the Guard or Controller the rule's
    regions run under (:class:`~mixprec.fp8.GuardSettings`, :class:`~mixprec.fp8.ControllerSettings`,
    or their JSON dict); the live one is the model's (``ctl.attach(model)``). Given a live Guard
    or Controller instead (the older spelling), the rule keeps its settings and carries the object
    as :attr:`live` (see the module's docstring).

    Example:
        >>> Fp8Rule("rowwise", names=r"blocks\\.").recipe_name
        'rowwise'
        >>> Fp8Rule("tensorwise", recipes={"2": "mxfp8"}).recipe_for("2").name
        'mxfp8'
        >>> Fp8Rule(controller={"every": 5}).controller.every
        5
    """

    recipe: Any = "tensorwise"  # a recipe name or a mixprec.fp8.Float8Recipe
    types: tuple[type[nn.Module], ...] = (nn.Linear,)
    names: str | None = None
    first_last: str = "keep"
    backend: str = "auto"
    guard: GuardSettings | None = None
    controller: ControllerSettings | None = None
    recipes: Any = ()  # {qualified name: recipe}, stored as sorted (name, recipe) pairs

    def __post_init__(self) -> None:
        if _tracing():  # see mixprec._tree.refuse_tracing
            raise RuntimeError("build mixprec Fp8Rules and Policies outside torch.compile")
        as_recipe(self.recipe)  # validates
        object.__setattr__(self, "recipe", _canonical_recipe(self.recipe))
        types = module_types(self.types, "Policy.fp8", nn.Linear)
        if not types or not all(isinstance(t, type) and issubclass(t, nn.Linear) for t in types):
            raise ValueError(f"Policy.fp8 types must be nn.Linear subclasses, got {self.types!r}")
        if self.names is not None:
            compile_names("Policy.fp8", self.names)
        if self.first_last not in ("keep", "fp8"):
            raise ValueError(f"Policy.fp8 first_last must be 'keep' or 'fp8', got {self.first_last!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"Policy.fp8 backend must be one of {', '.join(map(repr, BACKENDS))}, "
                             f"got {self.backend!r}")
        if self.guard is not None and self.controller is not None:
            raise ValueError("Policy.fp8: give guard= or controller=, not both (the controller promotes "
                             "a layer before the guard's thresholds are crossed, and demotes it again)")
        live = None
        for kind, cls in _KINDS.items():
            given = getattr(self, kind)
            if given is None or isinstance(given, cls):
                continue
            if isinstance(given, Mapping):
                object.__setattr__(self, kind, cls.from_dict(given))
            elif isinstance(getattr(given, "settings", None), cls):  # a live Guard or Controller
                live = given
                object.__setattr__(self, kind, given.settings)
            else:
                live_name = "mixprec.fp8.Guard" if kind == "guard" else "mixprec.Controller"
                raise ValueError(f"Policy.fp8 {kind} must be a {live_name} or its settings (a "
                                 f"mixprec.fp8.{cls.__name__}, or a dict of them), got {type(given).__name__}")
        object.__setattr__(self, "types", types)
        object.__setattr__(self, "recipes", _per_layer_recipes(self.recipes))
        object.__setattr__(self, "_live", live)  # not a field: outside equality, hash, repr and JSON

    def __reduce__(self) -> tuple[Any, ...]:
        """Copy and pickle through the constructor, with the live object (the older spelling) if any."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        if self._live is not None:
            values[self.kind] = self._live
        return _rebuild_rule, (values,)

    @property
    def kind(self) -> str | None:
        """``"guard"`` or ``"controller"``: what the rule's regions run under, or None."""
        return "guard" if self.guard is not None else "controller" if self.controller is not None else None

    @property
    def live(self) -> Any:
        """The Guard or Controller the rule was built with (``Policy.fp8(controller=ctl)``), or None
        (built with settings: the live one is the model's)."""
        return self._live

    @property
    def recipe_name(self) -> str:
        """The default recipe's name (``tensorwise``, ``rowwise``, ``mxfp8``, ...)."""
        return self.recipe if isinstance(self.recipe, str) else self.recipe.name

    def recipe_for(self, fqn: str) -> Float8Recipe:
        """The :class:`mixprec.fp8.Float8Recipe` the layer named ``fqn`` runs: its own from
        ``recipes``, else the rule's ``recipe``."""
        return as_recipe(dict(self.recipes).get(fqn, self.recipe))

    def detached(self) -> "Fp8Rule":
        """The same value without a live object."""
        if self._live is None:
            return self
        return Fp8Rule(self.recipe, self.types, self.names, self.first_last, self.backend, self.guard,
                       self.controller, self.recipes)


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
    return tuple(sorted(((n, _canonical_recipe(r)) for n, r in pairs), key=lambda p: p[0]))


def _canonical_recipe(recipe: Any) -> Any:
    """``recipe`` as the rule stores it: a named recipe's name (``Float8Recipe.from_name("rowwise")``
    is ``"rowwise"``, so rules built either way are equal, and read back equal from their text and
    JSON forms), a custom recipe itself."""
    return named_recipe(recipe) or recipe


# ----------------------------------------------------------------- the checked JSON form
def rule_to_dict(rule: Fp8Rule) -> dict[str, Any]:
    """The rule as plain JSON data; a guard or controller as its settings (a live one's decisions,
    rungs and log are runtime state: its ``state_dict()``).

    Raises:
        ValueError: a custom recipe (not a named one), or a type not importable by its path.
    """
    recipe = _recipe_name(rule.recipe)
    guard = None if rule.guard is None else rule.guard.to_dict()
    out = {"recipe": recipe, "types": [type_path(t) for t in rule.types], "names": rule.names,
           "first_last": rule.first_last, "backend": rule.backend, "guard": guard}
    if rule.controller is not None:
        out["controller"] = rule.controller.to_dict()
    if rule.recipes:
        out["recipes"] = {n: _recipe_name(r) for n, r in rule.recipes}
    return out


def _recipe_name(recipe: Any) -> str:
    name = named_recipe(recipe)
    if name is None:
        raise ValueError(f"cannot serialize the custom fp8 recipe {recipe!r}: use a named recipe "
                         f"({', '.join(map(repr, RECIPE_NAMES))})")
    return name


def named_recipe(recipe: Any) -> str | None:
    """The name of ``recipe`` (a recipe name, or a :class:`~mixprec.fp8.Float8Recipe`) when it is a
    named recipe (``Float8Recipe.from_name(name) == recipe``); None for a custom recipe, which the
    JSON and text forms cannot hold."""
    if isinstance(recipe, str):
        return recipe
    if recipe.name not in RECIPE_NAMES or Float8Recipe.from_name(recipe.name) != recipe:
        return None
    return recipe.name


def rule_from_dict(data: Any, given: Mapping[str, Any]) -> Fp8Rule:
    """The rule :func:`rule_to_dict` wrote, checked field by field. ``given`` maps ``"guard"`` and
    ``"controller"`` to the caller's live objects (or None), the older spelling: one with the saved
    settings is carried by the rule (:attr:`Fp8Rule.live`).

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
    for kind, cls in _KINDS.items():
        mine = given[kind]
        if values.get(kind) is None:
            if mine is not None:
                raise ValueError(f"the policy's fp8 rule has no {kind}: attach yours to the model "
                                 f"({kind}.attach(model)), not with from_json/load({kind}=...)")
            continue
        saved = cls.from_dict(expect(values[kind], Mapping, f"fp8_rule {kind!r}", "an object"))
        if mine is not None and getattr(mine, "settings", None) != saved:
            theirs = mine.settings.to_dict() if isinstance(getattr(mine, "settings", None), cls) else mine
            raise ValueError(f"the {kind} passed has other settings than the policy's saved {kind}: "
                             f"{theirs} != {saved.to_dict()}; pass one built with the saved settings")
        values[kind] = mine if mine is not None else saved
    if "recipes" in values:
        recipes = expect(values["recipes"], Mapping, "fp8_rule 'recipes'", "an object {layer name: recipe name}")
        for name, recipe in recipes.items():
            expect(recipe, str, f"fp8_rule recipes[{name!r}]", "a recipe name")
        values["recipes"] = dict(recipes)
    return Fp8Rule(**values)


def refuse_unused_state(given: Mapping[str, Any], why: str) -> None:
    """Raise a ValueError if ``given`` holds a guard or controller a policy cannot use (``why``)."""
    for state, value in given.items():
        if value is not None:
            raise ValueError(f"{state}= given, but the policy cannot use it: {why}; attach it to the model "
                             f"({state}.attach(model))")
