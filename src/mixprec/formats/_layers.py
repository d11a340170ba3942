"""What an fp8 layer is: which Linear layers go to fp8 (shared with ``Policy.fp8``: :func:`eligible`,
:func:`select_layers`) and the modules :func:`~mixprec.fp8.convert` swaps in (:class:`Float8Linear`,
:class:`Float8Conv1D`). Below :mod:`._controller` and :mod:`._convert`, which both use them."""

from __future__ import annotations

import functools
import re
import warnings
import weakref
from typing import Any, Mapping, Sequence

import torch
from torch import nn

from mixprec._modules import named_modules
from mixprec.formats._fsdp import Float8AllGatherWeight, plain_weight
from mixprec.formats._like import LINEAR_LIKE, conv1d_class, features, is_linear_like, unroutable
from mixprec.formats._linear import BACKENDS, linear
from mixprec.formats._recipe import RECIPE_NAMES, Float8Recipe
from mixprec.formats._state import CountsInStateDict, layer_state, swap_layer_state

__all__ = ["eligible", "select_layers", "Float8Linear", "Float8Conv1D", "as_recipe", "FIRST_LAST", "check_backend",
           "group_unsharded", "warn_once"]

_MULTIPLE = 16
FIRST_LAST = ("keep", "fp8")
_WARNED: weakref.WeakKeyDictionary[nn.Module, set[str]] = weakref.WeakKeyDictionary()


def warn_once(model: nn.Module, message: str) -> None:
    """Warn ``message`` once per model (the policy selects layers at every outermost call)."""
    seen = _WARNED.setdefault(model, set())
    if message not in seen:
        seen.add(message)
        warnings.warn(message, stacklevel=3)


def as_recipe(recipe: Float8Recipe | str) -> Float8Recipe:
    """A :class:`Float8Recipe` from itself or from a recipe name (one frozen value per name: a
    policy asks for its layers' recipes at every call)."""
    if isinstance(recipe, str):
        return _named_recipe(recipe)
    if not isinstance(recipe, Float8Recipe):
        raise ValueError(f"recipe must be a Float8Recipe or one of {', '.join(map(repr, RECIPE_NAMES))}, "
                         f"got {recipe!r}")
    return recipe


@functools.lru_cache(maxsize=None)
def _named_recipe(name: str) -> Float8Recipe:
    return Float8Recipe.from_name(name)  # (an unknown name raises, and is not cached)


def eligible(module: nn.Module, fqn: str = "", recipe: Float8Recipe | str | None = None) -> tuple[bool, str]:
    """Whether ``module`` can run in fp8, and why not: an ``nn.Linear`` or a Linear-equivalent
    (transformers' ``Conv1D``, a Linear with its weight stored transposed) whose in and out
    features are multiples of 16 (what ``torch._scaled_mm`` needs; the emulation follows the
    same rule so that a CPU run selects the layers a GPU run would). With a block ``recipe``
    (``mxfp8``, ``blockwise``) they must be multiples of its blocks too (``recipe.multiple``:
    32, 128).

    Example:
        >>> eligible(nn.Linear(10, 32), "head")
        (False, "'head': in_features=10 is not a multiple of 16")
    """
    if not is_linear_like(module):
        return False, f"{fqn!r}: {type(module).__name__} is not an {LINEAR_LIKE}"
    if (why := unroutable(module)) is not None:
        return False, f"{fqn!r}: {why}"
    bad = [f"{name}={value}" for name, value in zip(("in_features", "out_features"), features(module))
           if value % _multiple(recipe)]
    if bad:
        what = "is not a multiple" if len(bad) == 1 else "are not multiples"
        return False, f"{fqn!r}: {' and '.join(bad)} {what} of {_multiple_why(recipe)}"
    return True, ""


def _multiple(recipe: Float8Recipe | str | None) -> int:
    return _MULTIPLE if recipe is None else as_recipe(recipe).multiple


def _multiple_why(recipe: Float8Recipe | str | None) -> str:
    m = _multiple(recipe)
    return f"{m}" if m == _MULTIPLE else f"{m} (the {as_recipe(recipe).name!r} recipe's block)"


def select_layers(model: nn.Module, types: Sequence[type] | type = (nn.Linear,), names: str | None = None,
                  first_last: str = "keep", recipe: Float8Recipe | str | None = None,
                  recipes: Mapping[str, Float8Recipe | str] | None = None) -> list[str]:
    """The qualified names of the layers of ``model`` that go to fp8.

    Candidates are the modules that are instances of ``types`` (``nn.Linear`` there also stands
    for its equivalents, transformers' ``Conv1D``) and, with ``names``, whose name matches
    ``re.search(names, fqn)``, and pass :func:`eligible` (for ``recipe``: a block recipe needs
    features that are multiples of its blocks); each candidate that does not stays in
    the compute dtype with one warning naming it. With ``first_last="keep"`` (default), the
    model's first and last matmul layers stay too (the input-side projection and the head are the
    most sensitive), with their parallel siblings (``q/k/v_proj``); a side whose layer is not
    eligible (a patch-embedding convolution, a 10-class head) keeps nothing more (see
    ``_first_last``); ``"fp8"`` includes them.
    When no layer is selected, one warning (once per model) says why. ``recipes``
    (``{name: recipe}``, ``Policy.fp8(recipes=...)``) checks the named layers with their own
    recipe; a named layer that is not selected, or not eligible for its recipe, raises ValueError.
    Layers :func:`convert` made are fp8 already (in their own recipe) and never selected again.

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
    likes = nn.Linear in types
    recipes = dict(recipes or {})
    candidates, eligible_names, converted = [], [], []
    for fqn, mod in named_modules(model):
        if not (isinstance(mod, types) or (likes and is_linear_like(mod))):
            continue
        if isinstance(mod, (Float8Linear, Float8Conv1D)):  # fp8 already, in its own recipe
            converted.append(fqn)
            continue
        candidates.append(fqn)
        ok, reason = eligible(mod, fqn, recipes.get(fqn, recipe))
        if ok:
            eligible_names.append(fqn)
        elif fqn in recipes:
            raise ValueError(f"fp8 recipes: layer {reason}: give it another recipe or leave it out of recipes")
        elif pattern is None or pattern.search(fqn):
            warn_once(model, f"fp8: layer {reason}; it stays in the compute dtype")
    kept = _first_last(model, eligible_names) if first_last == "keep" else []
    chosen = [n for n in eligible_names if n not in kept and (pattern is None or pattern.search(n))]
    unselected = sorted(set(recipes) - set(chosen))
    if unselected:
        raise ValueError(f"fp8 recipes name layer(s) {unselected} that the rule does not select (selected: "
                         f"{chosen}); name selected layers (see types, names, first_last='fp8')")
    if not chosen and converted and not candidates:
        warn_once(model, f"fp8: no layer selected: the model's {len(converted)} fp8 layer(s) (e.g. "
                  f"{converted[0]!r}) were converted by fp8.convert and run in their own recipe")
    elif not chosen:
        warn_once(model, "fp8: no layer selected, nothing runs in fp8: "
                  + _why_none(types, pattern, candidates, eligible_names, kept, recipe))
    return chosen


_MATMUL_TYPES = (nn.Linear, nn.modules.conv._ConvNd)
_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


def _first_last(model: nn.Module, eligible_names: list[str]) -> list[str]:
    """What ``first_last="keep"`` keeps: the model's first and last matmul layers (Linear,
    Linear-equivalent or convolution, eligible or not, in registration order), each with its
    parallel siblings (eligible layers next to it in the same module, not a container, with the
    same in and out features: ``q_proj``/``k_proj``/``v_proj``, ``gate_proj``/``up_proj``; a
    square ``o_proj`` beside them too, the safe side: registration order cannot tell its input),
    when it is eligible. A first or last layer that is not (a patch-embedding convolution, a 10-class head)
    runs in the compute dtype already: nothing is kept on that side, never one projection of
    several fed by the same input."""
    modules = dict(named_modules(model))
    matmuls = [n for n, m in modules.items() if isinstance(m, _MATMUL_TYPES) or is_linear_like(m)]
    eligible = set(eligible_names)
    kept: list[str] = []
    for end, order in ((matmuls[:1], eligible_names), (matmuls[-1:], eligible_names[::-1])):
        if not end or end[0] not in eligible:
            continue
        name = end[0]
        parent = name.rpartition(".")[0]
        kept.append(name)
        if isinstance(modules[parent], _CONTAINERS):
            continue
        shape = features(modules[name])
        for other in order[order.index(name) + 1:]:
            if other.rpartition(".")[0] != parent or features(modules[other]) != shape:
                break
            kept.append(other)
    return list(dict.fromkeys(kept))


def _why_none(types: tuple[type, ...], pattern: re.Pattern | None, candidates: list[str],
              eligible_names: list[str], kept: list[str], recipe: Float8Recipe | str | None = None) -> str:
    matching = [n for n in candidates if pattern is None or pattern.search(n)]
    what = LINEAR_LIKE if types == (nn.Linear,) else "instance of " + ", ".join(t.__name__ for t in types)
    if not candidates:
        return f"the model has no {what} layer"
    if not matching:
        return (f"names={pattern.pattern!r} matches none of the {len(candidates)} {what} layers "
                f"(e.g. {', '.join(map(repr, candidates[:3]))})")
    hits = [n for n in eligible_names if n in matching]
    if not hits:
        return (f"none of the {len(matching)} {what} layers is eligible (in and out features multiples "
                f"of {_multiple_why(recipe)}; each one's reason is in its own warning)")
    which = "eligible layers matching names" if pattern is not None else "eligible layers"
    return (f"the only {which} ({', '.join(map(repr, hits))}) are the model's first and last, "
            f"kept in the compute dtype by first_last='keep'; pass first_last='fp8' to include them")


def _fp8_forward(module: nn.Module, input: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The forward of the converted modules: ``weight`` is ``(out, in)``."""
    wtype = type(module.weight)  # (a Parameter first: Dynamo cannot trace str.startswith on a class's __module__)
    if wtype is not nn.Parameter and wtype.__module__.startswith("torchao."):
        if not isinstance(module, nn.Linear):
            raise RuntimeError(f"fp8 layer {type(module).__name__}: its weight is a torchao "
                               f"{type(module.weight).__name__} (torchao's quantize_ ran on a model still "
                               f"converted for fp8 training); call mixprec.fp8.unconvert(model) before quantize_")
        return _quantized_forward(module, input)
    if isinstance(module.weight, Float8AllGatherWeight):
        group = module.__dict__.get(_UNSHARDED)
        if group is not None:
            group.warn(module)
    device = input.device.type
    if torch.is_autocast_enabled(device):
        input = input.to(torch.get_autocast_dtype(device))
    return linear(input, weight, module.bias, module.recipe, state=layer_state(module), backend=module.backend)


_QUANTIZED_NOTED: list[bool] = []


def _quantized_forward(module: nn.Linear, input: torch.Tensor) -> torch.Tensor:
    """A converted ``Float8Linear`` whose weight torchao's ``quantize_`` replaced runs as the plain
    ``nn.Linear`` torchao quantized would (its weight serves the forward); its fp8 training state
    (statistics, guard or controller rung) is dropped, with a note the first time."""
    if swap_layer_state(module, None) is not None and not _QUANTIZED_NOTED:
        _QUANTIZED_NOTED.append(True)
        warnings.warn(f"fp8: torchao's quantize_ replaced the weight of layers converted for fp8 training "
                      f"(fp8.convert): they run torchao's quantized weight as nn.Linear does, and their fp8 "
                      f"training state (statistics, guard/controller decisions) is dropped; "
                      f"mixprec.fp8.unconvert(model) before quantize_ does this explicitly", UserWarning, stacklevel=4)
    return nn.Linear.forward(module, input)


_UNSHARDED = "_mixprec_fsdp_unsharded"


class _UnshardedLayers:
    """The layers one ``convert(..., fsdp_fp8_all_gather=True)`` wrapped: the first forward of one
    whose weight did not come from FSDP2's all-gather warns once for all, naming each layer of
    them not under ``fully_shard`` then. A copy or pickle keeps the names, not the references."""

    def __init__(self, layers: list[tuple[str, nn.Module]]) -> None:
        self.layers = [(fqn, weakref.ref(mod)) for fqn, mod in layers]
        self.warned = False

    def __getstate__(self) -> dict[str, Any]:
        return {"layers": [], "warned": self.warned}

    def warn(self, module: nn.Module) -> None:
        if self.warned:
            return
        self.warned = True
        names = [fqn for fqn, ref in self.layers
                 if (mod := ref()) is not None and isinstance(mod.weight, Float8AllGatherWeight)]
        names = names or [type(module).__name__]
        warnings.warn(f"fp8.convert(..., fsdp_fp8_all_gather=True): layer(s) {', '.join(map(repr, names))} reached "
                      f"the forward without FSDP2's all-gather (not under fully_shard): each casts its own "
                      f"high-precision weight, as without the option", UserWarning, stacklevel=4)


def group_unsharded(layers: list[tuple[str, nn.Module]]) -> None:
    """Give the layers one ``convert(..., fsdp_fp8_all_gather=True)`` wrapped (``(fqn, module)``)
    their shared :class:`_UnshardedLayers`."""
    group = _UnshardedLayers(layers)
    for _, module in layers:
        module.__dict__[_UNSHARDED] = group


def check_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"fp8 backend must be one of {BACKENDS}, got {backend!r}")
    return backend


class Float8Linear(CountsInStateDict, nn.Linear):
    """An ``nn.Linear`` whose forward is :func:`mixprec.fp8.linear` (same parameters, same state
    dict keys, and after a stochastically rounded fp4 call its call count:
    :class:`~mixprec.formats._state.CountsInStateDict`). Under ``torch.autocast``/``mixprec.autocast`` the input is first cast to the
    region's dtype, as ``F.linear`` would be.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 recipe: Float8Recipe | str = "tensorwise", backend: str = "auto",
                 device: Any = None, dtype: torch.dtype | None = None) -> None:
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.recipe, self.backend = as_recipe(recipe), check_backend(backend)
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

    def to_linear(self) -> nn.Linear:
        """A plain ``nn.Linear`` sharing these parameters (see :func:`unconvert`)."""
        with torch.device("meta"):
            new = nn.Linear(self.in_features, self.out_features, bias=False)
        new.weight, new.bias = plain_weight(self.weight), self.bias
        return new

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return _fp8_forward(self, input, self.weight)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe.name}"


class Float8Conv1D(CountsInStateDict):
    """transformers' ``Conv1D`` (a Linear whose weight is stored ``(in, out)``: ``nx`` inputs,
    ``nf`` outputs) whose forward is :func:`mixprec.fp8.linear` on the transposed weight: same
    parameters, same state dict keys and shapes (and the fp4 call count, as :class:`Float8Linear`), bitwise torchao's emulated ``Float8Linear`` on
    the equivalent ``nn.Linear``. Made by :func:`convert`; :func:`unconvert` gives the Conv1D back.
    """

    def __init__(self, nf: int, nx: int, *, recipe: Float8Recipe | str = "tensorwise", backend: str = "auto",
                 device: Any = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.nf, self.nx = nf, nx
        self.weight = nn.Parameter(torch.empty(nx, nf, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(nf, device=device, dtype=dtype))
        nn.init.normal_(self.weight, std=0.02)  # as Conv1D
        self.recipe, self.backend = as_recipe(recipe), check_backend(backend)
        layer_state(self)

    @classmethod
    def from_conv1d(cls, mod: nn.Module, recipe: Float8Recipe | str = "tensorwise",
                    backend: str = "auto") -> Float8Conv1D:
        """Wrap the ``Conv1D`` ``mod``'s parameters (shared, not copied)."""
        with torch.device("meta"):
            new = cls(mod.nf, mod.nx, recipe=recipe, backend=backend)
        new.weight, new.bias = mod.weight, mod.bias
        new.__dict__.pop("_mixprec_fp8_state", None)
        layer_state(new)
        return new

    def to_conv1d(self) -> nn.Module:
        """transformers' ``Conv1D`` sharing these parameters (see :func:`unconvert`)."""
        cls = conv1d_class()
        if cls is None:
            import transformers.pytorch_utils

            cls = transformers.pytorch_utils.Conv1D
        with torch.device("meta"):
            new = cls(self.nf, self.nx)
        new.weight, new.bias = plain_weight(self.weight), self.bias
        return new

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return _fp8_forward(self, input, self.weight.t())

    def extra_repr(self) -> str:
        return f"nf={self.nf}, nx={self.nx}, recipe={self.recipe.name}"
