"""Which Linear layers go to fp8 (shared with ``Policy.fp8``), module conversion, the stats table."""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn

from mixprec.fp8._guard import Guard, layer_states
from mixprec.fp8._linear import BACKENDS, linear
from mixprec.fp8._quant import STAT_NAMES
from mixprec.fp8._recipe import Float8Recipe
from mixprec.fp8._state import OPERANDS, LayerState, layer_state

__all__ = ["eligible", "select_layers", "Float8Linear", "convert", "stats", "Float8Stats", "as_recipe"]

_MULTIPLE = 16
FIRST_LAST = ("keep", "fp8")


def as_recipe(recipe: Float8Recipe | str) -> Float8Recipe:
    """A :class:`Float8Recipe` from itself or from a recipe name."""
    if isinstance(recipe, str):
        return Float8Recipe.from_name(recipe)
    if not isinstance(recipe, Float8Recipe):
        raise ValueError(f"recipe must be a Float8Recipe or one of 'tensorwise', 'rowwise', "
                         f"'rowwise_with_gw_hp', got {recipe!r}")
    return recipe


def eligible(module: nn.Module, fqn: str = "") -> tuple[bool, str]:
    """Whether ``module`` can run in fp8, and why not: an ``nn.Linear`` whose ``in_features`` and
    ``out_features`` are multiples of 16 (what ``torch._scaled_mm`` needs; the emulation follows
    the same rule so that a CPU run selects the layers a GPU run would).

    Example:
        >>> eligible(nn.Linear(10, 32), "head")
        (False, "'head': in_features=10 is not a multiple of 16")
    """
    if not isinstance(module, nn.Linear):
        return False, f"{fqn!r}: {type(module).__name__} is not an nn.Linear"
    bad = [f"{name}={value}" for name, value in (("in_features", module.in_features),
                                                  ("out_features", module.out_features))
           if value % _MULTIPLE]
    if bad:
        what = "is not a multiple" if len(bad) == 1 else "are not multiples"
        return False, f"{fqn!r}: {' and '.join(bad)} {what} of {_MULTIPLE}"
    return True, ""


def select_layers(model: nn.Module, types: Sequence[type] | type = (nn.Linear,), names: str | None = None,
                  first_last: str = "keep") -> list[str]:
    """The qualified names of the layers of ``model`` that go to fp8.

    Candidates are the modules that are instances of ``types`` (and, with ``names``, whose name
    matches ``re.search(names, fqn)``) and pass :func:`eligible`; each candidate that does not
    stays in the compute dtype with one warning naming it. With ``first_last="keep"`` (default),
    the first and the last eligible layer of the whole model, in registration order, stay too
    (the embedding-side projection and the head are the most sensitive); ``"fp8"`` includes them.

    Example:
        >>> m = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 16))
        >>> select_layers(m)
        ['1']
    """
    types = tuple(types) if isinstance(types, (list, tuple)) else (types,)
    if not types or not all(isinstance(t, type) for t in types):
        raise ValueError(f"types must be a module class or a tuple of them, got {types!r}")
    if first_last not in FIRST_LAST:
        raise ValueError(f"first_last must be 'keep' (first and last eligible Linear stay in the compute "
                         f"dtype) or 'fp8' (they go to fp8 too), got {first_last!r}")
    try:
        pattern = re.compile(names) if names is not None else None
    except (re.error, TypeError) as exc:
        raise ValueError(f"names must be a regular expression (re.search on the qualified name), got {names!r}") from exc
    eligible_names = []
    for fqn, mod in model.named_modules():
        if not isinstance(mod, types):
            continue
        ok, reason = eligible(mod, fqn)
        if ok:
            eligible_names.append(fqn)
        elif pattern is None or pattern.search(fqn):
            warnings.warn(f"fp8: layer {reason}; it stays in the compute dtype", stacklevel=2)
    if first_last == "keep":
        eligible_names = eligible_names[1:-1]
    return [n for n in eligible_names if pattern is None or pattern.search(n)]


class Float8Linear(nn.Linear):
    """An ``nn.Linear`` whose forward is :func:`mixprec.fp8.linear` (same parameters, same state
    dict keys). Under ``torch.autocast``/``mixprec.autocast`` the input is first cast to the
    region's dtype, as ``F.linear`` would be.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 recipe: Float8Recipe | str = "tensorwise", backend: str = "auto",
                 device: Any = None, dtype: torch.dtype | None = None) -> None:
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.recipe = as_recipe(recipe)
        if backend not in BACKENDS:
            raise ValueError(f"fp8 backend must be one of {BACKENDS}, got {backend!r}")
        self.backend = backend
        layer_state(self)

    @classmethod
    def from_linear(cls, mod: nn.Linear, recipe: Float8Recipe | str = "tensorwise",
                    backend: str = "auto") -> Float8Linear:
        """Wrap ``mod``'s parameters (shared, not copied)."""
        with torch.device("meta"):
            new = cls(mod.in_features, mod.out_features, bias=False, recipe=recipe, backend=backend)
        new.weight, new.bias = mod.weight, mod.bias
        new.__dict__.pop("_mixprec_fp8_state", None)
        layer_state(new)
        return new

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        device = input.device.type
        if torch.is_autocast_enabled(device):
            input = input.to(torch.get_autocast_dtype(device))
        return linear(input, self.weight, self.bias, self.recipe, state=layer_state(self), backend=self.backend)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe.name}"


def convert(model: nn.Module, recipe: Float8Recipe | str = "tensorwise", *,
            filter_fn: Callable[[nn.Module, str], bool] | None = None, guard: Guard | None = None,
            backend: str = "auto") -> nn.Module:
    """Swap the selected ``nn.Linear`` modules of ``model`` for :class:`Float8Linear`, in place.

    ``filter_fn(module, fqn) -> bool`` picks the layers (every ``nn.Linear`` is offered); by
    default :func:`select_layers` decides (dims multiples of 16, first and last kept). The
    parameters are shared and the state dict keys do not change. With ``guard``, the layers'
    states are tracked by it (its decisions apply at once, also after ``load_state_dict``).
    Returns ``model`` (or the new module when ``model`` itself is a converted Linear).

    Example:
        >>> m = convert(nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 16)))
        >>> type(m[1]).__name__, type(m[0]).__name__
        ('Float8Linear', 'Linear')
    """
    recipe = as_recipe(recipe)
    if filter_fn is None:
        chosen = set(select_layers(model))
        filter_fn = lambda mod, fqn: fqn in chosen  # noqa: E731
    for fqn, mod in list(model.named_modules()):
        if type(mod) is nn.Linear and filter_fn(mod, fqn):
            new = Float8Linear.from_linear(mod, recipe, backend)
            if not fqn:
                model = new
                continue
            parent, _, child = fqn.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, new)
    if guard is not None:
        guard.track(model)
    return model


@dataclass(frozen=True)
class Float8Stats:
    """Per-layer fp8 statistics: ``rows`` (one dict per layer and operand) and a text table."""

    rows: tuple[dict[str, Any], ...]

    def to_list(self) -> list[dict[str, Any]]:
        return [dict(r) for r in self.rows]

    def __str__(self) -> str:
        head = ("layer", "operand", *STAT_NAMES, "sqnr_db", "fallback")
        cells = [head] + [(r["layer"], r["operand"], f"{r['amax']:.4g}", f"{r['saturated']:.2%}",
                           f"{r['underflow']:.2%}", f"{r['nonfinite']:.0f}",
                           "-" if r["output_sqnr_db"] == float("inf") else f"{r['output_sqnr_db']:.1f}",
                           "yes" if r["fallback"] else "no") for r in self.rows]
        widths = [max(len(str(c[i])) for c in cells) for i in range(len(head))]
        return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells)


def stats(model: nn.Module | Mapping[str, LayerState]) -> Float8Stats:
    """The statistics of every fp8 layer since the last :meth:`Guard.check` (or creation).

    .. warning:: reads the device statistics: one host sync per layer.

    Example:
        >>> print(stats(convert(nn.Sequential(*[nn.Linear(16, 16) for _ in range(3)]))))  # doctest: +SKIP
    """
    states = layer_states(model) if isinstance(model, nn.Module) else dict(model)
    rows = []
    for name, st in states.items():
        data = st.read()
        for op in OPERANDS:
            rows.append({"layer": name, "operand": op, **data[op],
                         "output_sqnr_db": data["output_sqnr_db"], "fallback": data["fallback"]})
    return Float8Stats(tuple(rows))
