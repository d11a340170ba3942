"""Module conversion (:func:`convert`, :func:`unconvert`) and the statistics table (:func:`stats`).

The layers themselves and their selection live in :mod:`._layers`; ``Float8Linear`` and
``Float8Conv1D`` (and the ``_UnshardedLayers`` a converted layer holds) are also names of this
module, where models pickled before the split find them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

from torch import nn

from mixprec._modules import named_modules
from mixprec.control._controller import Controller
from mixprec.formats._fsdp import check_recipe, retie, wrap_weight
from mixprec.formats._grouped import GroupedExperts
from mixprec.control._guard import Guard, layer_states
from mixprec.formats._layers import (Float8Conv1D, Float8Linear, as_recipe, check_backend, group_unsharded, select_layers,
                                 warn_once)
from mixprec.formats._layers import _UnshardedLayers  # noqa: F401  (named here by models pickled before the split)
from mixprec.formats._like import LINEAR_LIKE, conv1d_class, features, is_linear_like
from mixprec.formats._quant import STAT_NAMES
from mixprec.formats._recipe import Float8Recipe
from mixprec.formats._state import OPERANDS, LayerState, layer_state

__all__ = ["convert", "unconvert", "stats", "Float8Stats", "Float8Linear", "Float8Conv1D"]


def _swap(model: nn.Module, fqn: str, new: nn.Module) -> nn.Module:
    """Put ``new`` at ``fqn`` in ``model``; returns the model (``new`` for the root)."""
    if not fqn:
        return new
    parent, _, child = fqn.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)
    return model


def convert(model: nn.Module, recipe: Float8Recipe | str = "tensorwise", *,
            filter_fn: Callable[[nn.Module, str], bool] | None = None, guard: Guard | None = None,
            backend: str = "auto", fsdp_fp8_all_gather: bool = False, controller: Any = None) -> nn.Module:
    """Swap the selected ``nn.Linear`` modules of ``model`` for :class:`Float8Linear`, and
    transformers' ``Conv1D`` ones for :class:`Float8Conv1D`, in place.

    ``filter_fn(module, fqn) -> bool`` picks the layers (every ``nn.Linear`` and ``Conv1D`` is
    offered, under its name in the bare model: a torch.compile or DDP wrapper adds no part); by
    default :func:`select_layers` decides (dims multiples of 16, first and last kept). The
    parameters are shared and the state dict keys do not change. Each
    :class:`~mixprec.fp8.GroupedExperts` (a mixture of experts' experts) in high precision is
    given ``recipe`` in place (``filter_fn`` is offered it too; by default every one whose
    features are multiples of 16 and of the recipe's blocks): each expert is cast with its own
    scales and is a layer of its own for :func:`stats` and a Guard. With ``guard``, the
    layers' states are tracked by it (its decisions apply at once, also after
    ``load_state_dict``). With ``controller`` (a :class:`mixprec.Controller`, not with ``guard``)
    the converted layers, and each expert of each weight, move up and down its ladder from their
    recipe (``Controller.track``).
    Either is attached to the model (``attach``): a policy's regions of it run under it too.
    Returns ``model`` (or the new module when ``model`` itself is a
    converted Linear). Warns once when no layer is converted, saying why. :func:`unconvert`
    undoes it (before torchao's ``quantize_`` for inference).

    ``fsdp_fp8_all_gather=True`` (tensorwise weight casts only, as torchao's
    ``enable_fsdp_float8_all_gather``): under FSDP2's ``fully_shard`` each converted layer's
    weight is all-gathered as its fp8 bytes (a quarter of fp32's, half of bf16's) with one scale
    from the amax all-reduced over the shards, bitwise the cast of the unsharded weight; see
    docs/fp8.md, "FSDP2". Convert before ``fully_shard`` and before creating the optimizer (the
    weights become new ``nn.Parameter`` objects on the same storage; a tied weight, an embedding
    sharing a converted head's, stays one parameter, the new one, in every module that holds it). A converted layer run
    without ``fully_shard`` warns once and casts its weight itself.

    Raises ValueError, before changing anything, when ``model`` itself is chosen and has
    children (they would be lost with it): convert a parent, or leave the root out; with
    ``fsdp_fp8_all_gather`` for a recipe that does not cast the weight tensorwise in both its
    GEMMs, or a model already sharded; for a chosen layer whose features are not multiples of
    the recipe's blocks (``mxfp4``, ``nvfp4``, ``mxfp8``, ``blockwise``), naming it.

    Example:
        >>> m = convert(nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 16)))
        >>> type(m[1]).__name__, type(m[0]).__name__
        ('Float8Linear', 'Linear')
    """
    recipe, backend = as_recipe(recipe), check_backend(backend)
    if controller is not None:
        if not isinstance(controller, Controller) or guard is not None:
            raise ValueError(f"fp8.convert: controller must be a mixprec.Controller, without guard= (got "
                             f"{type(controller).__name__}{' and a guard' if guard is not None else ''})")
    if not isinstance(fsdp_fp8_all_gather, bool):
        raise ValueError(f"fsdp_fp8_all_gather must be True or False, got {fsdp_fp8_all_gather!r}")
    if fsdp_fp8_all_gather:
        check_recipe(recipe)
    by_user = filter_fn is not None
    if filter_fn is None:  # select_layers warns when it selects none; its names are without wrappers' parts
        experts_only = any(isinstance(m, GroupedExperts) for m in model.modules()) and \
            not any(is_linear_like(m) for m in model.modules())  # (select_layers would warn: nothing in fp8)
        names = set() if experts_only else set(select_layers(model, recipe=recipe))
        chosen = {id(mod) for name, mod in named_modules(model) if name in names}
        filter_fn = lambda mod, fqn: id(mod) in chosen  # noqa: E731
    conv1d = conv1d_class()
    swappable = lambda mod: type(mod) is nn.Linear or (conv1d is not None and type(mod) is conv1d)  # noqa: E731
    bare = {id(mod): fqn for fqn, mod in named_modules(model)}  # (filter_fn and errors: the bare model's names)
    swaps = [(fqn, mod) for fqn, mod in model.named_modules() if swappable(mod) and filter_fn(mod, bare[id(mod)])]
    if not by_user:
        for fqn, mod in named_modules(model):
            if id(mod) in chosen and not swappable(mod):
                warn_once(model, f"fp8.convert: layer {fqn!r} ({type(mod).__name__}) is selected, but convert "
                                 f"swaps only nn.Linear and transformers Conv1D modules, not subclasses: it stays "
                                 f"as it is (Policy.fp8 runs subclasses whose forward calls F.linear)")
    blocks = recipe.block_multiple
    unfit = [f"{bare[id(mod)]!r} ({' x '.join(map(str, features(mod)))})" for _, mod in swaps
             if any(f % blocks for f in features(mod))]
    if unfit:
        raise ValueError(f"fp8.convert: {', '.join(unfit)} {'has features that are' if len(unfit) == 1 else 'have features'}"
                         f" not multiples of {blocks}, the {recipe.name!r} recipe's blocks; leave "
                         f"{'it' if len(unfit) == 1 else 'them'} out of filter_fn (fp8.select_layers(model, "
                         f"recipe={recipe.name!r}) lists the layers that fit), or pick a recipe without blocks")
    if swaps and not swaps[0][0] and next(model.children(), None) is not None:
        raise ValueError(f"fp8.convert: the root module is a {type(model).__name__} with children "
                         f"({', '.join(n for n, _ in model.named_children())}), which converting it would "
                         f"drop; convert its parent module, or pass a filter_fn that leaves the root ('') out")
    wrapped, weights = [], {}
    for fqn, mod in swaps:
        new = (Float8Linear.from_linear(mod, recipe, backend) if type(mod) is nn.Linear
               else Float8Conv1D.from_conv1d(mod, recipe, backend))
        layer_state(new).name = bare[id(mod)]  # (for errors: the tensor-parallel checks name the layer)
        if fsdp_fp8_all_gather:
            wrap_weight(new, recipe, weights)
            wrapped.append((fqn, new))
        model = _swap(model, fqn, new)
    if wrapped:
        retie(model, weights)
        group_unsharded(wrapped)
    experts = convert_experts(model, recipe, backend, filter_fn if by_user else None)
    if not swaps and not experts and by_user:
        likes = sum(1 for mod in model.modules() if swappable(mod))
        warn_once(model, f"fp8.convert: no layer converted, nothing runs in fp8: filter_fn chose none of the "
                         f"{likes} nn.Linear and Conv1D layers" if likes else
                         f"fp8.convert: no layer converted, nothing runs in fp8: the model has no {LINEAR_LIKE} layer")
    for live in (guard, controller):
        if live is not None:  # the model's from now on: a policy's regions of it run under it too
            live.attach(model)
            live.track(model)  # (a Controller: each expert a layer of its own, as on the policy route)
    return model


def convert_experts(model: nn.Module, recipe: Float8Recipe, backend: str,
                    filter_fn: Callable[[nn.Module, str], bool] | None = None) -> list[str]:
    """Give the :class:`GroupedExperts` of ``model`` that run in high precision ``recipe`` (those
    ``filter_fn`` picks; by default every one whose features are multiples of 16 and of the
    recipe's blocks, the others warned about); returns their names."""
    chosen = []
    for fqn, mod in named_modules(model):  # (the bare model's names: filter_fn's, the warnings')
        if not isinstance(mod, GroupedExperts) or mod.recipe is not None:
            continue
        if filter_fn is not None:
            if filter_fn(mod, fqn):
                chosen.append(mod)
            continue
        multiple = max(16, recipe.block_multiple)
        if mod.dim % multiple or mod.hidden_dim % multiple:
            warn_once(model, f"fp8: GroupedExperts {fqn!r}: dim={mod.dim}, hidden_dim={mod.hidden_dim} are not "
                             f"multiples of {multiple}; it stays in the compute dtype")
        else:
            chosen.append(mod)
    for mod in chosen:
        mod.set_recipe(recipe, backend)
    names = {id(mod): fqn for fqn, mod in named_modules(model)}
    return [names[id(mod)] for mod in chosen]


def unconvert(model: nn.Module) -> nn.Module:
    """Undo :func:`convert`, in place: each :class:`Float8Linear` becomes an ``nn.Linear`` and
    each :class:`Float8Conv1D` a transformers ``Conv1D``, sharing the parameters (state dict
    unchanged; the fp8 statistics go). The way from fp8 training to inference quantization:
    torchao's ``quantize_(model, Float8WeightOnlyConfig())`` handles the plain layers. Returns
    ``model`` (or the new module when ``model`` itself is a converted layer).

    Example:
        >>> m = unconvert(convert(nn.Sequential(*[nn.Linear(16, 16) for _ in range(3)])))
        >>> [type(x).__name__ for x in m]
        ['Linear', 'Linear', 'Linear']
    """
    plain: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}  # a wrapped weight: its plain one, tied kept
    for fqn, mod in list(model.named_modules()):
        if isinstance(mod, GroupedExperts):
            mod.set_recipe(None)
        if isinstance(mod, (Float8Linear, Float8Conv1D)):
            new = mod.to_linear() if isinstance(mod, Float8Linear) else mod.to_conv1d()
            if id(mod.weight) in plain:
                new.weight = plain[id(mod.weight)][1]
            elif new.weight is not mod.weight:
                plain[id(mod.weight)] = (mod.weight, new.weight)
            model = _swap(model, fqn, new)
    retie(model, plain)
    return model


@dataclass(frozen=True)
class Float8Stats:
    """Per-layer fp8 statistics: ``rows`` (one dict per layer and operand) and a text table."""

    rows: tuple[dict[str, Any], ...]

    def to_list(self) -> list[dict[str, Any]]:
        return [dict(r) for r in self.rows]

    def __str__(self) -> str:
        head = ("layer", "operand", *STAT_NAMES, "sqnr_db", "fallback", "backend", "window")
        cells = [head] + [(r["layer"], r["operand"], f"{r['amax']:.4g}", f"{r['saturated']:.2%}",
                           f"{r['underflow']:.2%}", f"{r['nonfinite']:.0f}",
                           "-" if r["output_sqnr_db"] == float("inf") else f"{r['output_sqnr_db']:.1f}",
                           "yes" if r["fallback"] else "no", r.get("backend") or "-", r["window"])
                          for r in self.rows]
        widths = [max(len(str(c[i])) for c in cells) for i in range(len(head))]
        return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells)


def stats(model: nn.Module | Mapping[str, LayerState]) -> Float8Stats:
    """The statistics of every fp8 layer since the last check of its Guard or Controller (or
    creation); right after a check, before any forward, those of the window the check closed
    (column ``window``: ``open`` or ``last``; see :meth:`LayerState.read`).

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
                         "output_sqnr_db": data["output_sqnr_db"], "fallback": data["fallback"],
                         "window": data["window"], "backend": data["backend"]})
    return Float8Stats(tuple(rows))
