"""Where per-layer scaling cuts (:mod:`mixprec.scaling.layerwise`): the cut points of a model and
the walk of one step's autograd graph that finds which region's scale each gradient carries."""

from __future__ import annotations

import difflib
from typing import Any, Callable, Iterable, NamedTuple, Sequence

import torch
import torch.utils.checkpoint
from torch import nn

__all__ = [
    "CutGrad", "Times", "TimesInput", "Walk", "choose_cut_points", "first_tensor", "reentrant_message", "registrations",
    "tensors_of", "walk",
]

_ACCUMULATE = torch._C._functions.AccumulateGrad  # a parameter's (leaf's) gradient node
_CHECKPOINT = torch.utils.checkpoint.CheckpointFunction._backward_cls  # a reentrant checkpoint


class Walk(NamedTuple):
    """What :func:`walk` found in one step's autograd graph. A *label* is the region whose total
    scale a gradient carries there: 0 above every cut point, ``k + 1`` below cut point ``k``
    (the hooks bring every gradient leaving cut point ``k`` to region ``k + 1``'s scale).

    Attributes:
        params: ``id(parameter) -> (parameter, label)`` for every parameter reached.
        incoming: ``cut -> label`` of the gradient arriving at each cut point reached.
        hidden: ``(run_function, label)`` of each reentrant activation checkpoint met.
        rescale: ``(node, input index, from label, to label)``: the edges into a shared
            parameter's gradient (or into a cast of it that leads only to it) that arrive with
            several labels; each must be brought to ``to label``, the topmost, before autograd
            sums them.
        used: the keys of ``edges`` (cut point outputs) the walk met.
    """

    params: dict[int, tuple[torch.Tensor, int]]
    incoming: dict[int, int]
    hidden: list[tuple[Any, int]]
    rescale: list[tuple[Any, int, int, int]]
    used: frozenset[tuple[int, int]] = frozenset()


def _node_name(fn: Any, names: dict[int, str]) -> str:
    variable = getattr(fn, "variable", None)
    if variable is None:
        return type(fn).__name__
    name = names.get(id(variable))
    return f"parameter {name!r}" if name else f"the gradient of a parameter of shape {tuple(variable.shape)}"


def _above(label: int, incoming: dict[int, int]) -> list[int]:
    """The cut points crossed above region ``label`` (this walk's, bottom first)."""
    cuts = []
    while label and len(cuts) <= len(incoming):
        cuts.append(label - 1)
        label = incoming.get(label - 1, 0)
    return cuts


def walk(
    roots: Iterable[Any], edges: dict[tuple[int, int], tuple[int, int]], cut_names: Sequence[str],
    param_names: dict[int, str] | None = None, top: int = 0, stop_at_cuts: bool = False,
) -> Walk:
    """Walks the autograd graph down from ``roots`` (``grad_fn`` nodes, or tensors: a tensor
    that is a cut point's output starts below that cut point) and labels every node with the
    region whose scale its gradient carries (see :class:`Walk`); the roots' gradients carry
    region ``top``'s (0: the loss scale's; a pipeline stage's entry region).

    ``edges`` maps ``(id(grad_fn), output_nr)`` of each cut point's output tensor to the cut
    point's index and that ``grad_fn``'s sequence number (compared, so that a reused id cannot
    match; holding the node would keep its graph alive);
    ``param_names`` (``id -> qualified name``) names parameters in errors; ``stop_at_cuts``: walk
    the top region only (what reaches the roots without crossing a cut point), not below the cut
    points met (their ``incoming`` is the top label). A node reached with
    several labels is fine when only parameters lie below it (a tied or shared weight: its
    contributions are rescaled to the topmost label, see :attr:`Walk.rescale`): a parameter's
    gradient node, or a chain of one-input nodes (a cast, a transpose) leading only to it.

    Raises:
        ValueError: a node with a cut point below it is reached along paths that crossed
            different cut points (a skip connection around a cut point, or a cut point inside a
            residual branch), a cut point receives gradients from different regions, or a path
            crosses one cut point twice (a module run twice in one step).
    """
    names = param_names or {}
    # id -> (node, label, the first edge into it); the node is kept alive so that its id is not
    # reused during the walk
    seen: dict[int, tuple[Any, int, Any, int]] = {}
    extra: dict[int, list[tuple[Any, int, int]]] = {}
    incoming: dict[int, int] = {}
    params: dict[int, tuple[torch.Tensor, int]] = {}
    hidden: list[tuple[Any, int]] = []
    stack: list[tuple[Any, int, Any, int]] = []
    used: set[tuple[int, int]] = set()
    for root in roots:
        fn, label = (root.grad_fn, top) if isinstance(root, torch.Tensor) else (root, top)
        if fn is None:
            continue
        entry = edges.get((id(fn), root.output_nr)) if isinstance(root, torch.Tensor) else None
        if entry is not None and entry[1] == fn._sequence_nr():  # a cut point's output: its hook runs first
            incoming[entry[0]] = top
            label = entry[0] + 1
            used.add((id(fn), root.output_nr))
            if stop_at_cuts:
                continue
        stack.append((fn, label, None, 0))
    while stack:
        fn, label, producer, index = stack.pop()
        key = id(fn)
        if key in seen:
            extra.setdefault(key, []).append((producer, index, label))
            continue
        seen[key] = (fn, label, producer, index)
        kind = type(fn)
        if kind is _ACCUMULATE:
            params[id(fn.variable)] = (fn.variable, label)
            continue
        if kind is _CHECKPOINT:
            hidden.append((fn.run_function, label))
        for i, (child, nr) in enumerate(fn.next_functions):
            if child is None:
                continue
            below = label
            entry = edges.get((id(child), nr))
            cut = entry[0] if entry is not None and entry[1] == child._sequence_nr() else None
            if cut is not None:
                if cut in _above(label, incoming):
                    raise ValueError(
                        f"per_layer: the gradient crosses cut point {cut_names[cut]!r} twice (the "
                        "module runs more than once per step); choose cut points that run once."
                    )
                if incoming.setdefault(cut, label) != label:
                    raise ValueError(
                        f"per_layer: cut point {cut_names[cut]!r} receives gradients that crossed "
                        "different cut points (a skip connection bypasses some of them); choose "
                        "cut points that every path crosses (cut_points=[...])."
                    )
                used.add((id(child), nr))
                if stop_at_cuts:
                    continue
                below = cut + 1
            stack.append((child, below, fn, i))
    rescale: list[tuple[Any, int, int, int]] = []
    for key, more in extra.items():
        fn, label, producer, index = seen[key]
        labels = {label, *(m[2] for m in more)}
        if len(labels) == 1:
            continue
        depth = {lab: len(_above(lab, incoming)) for lab in labels}
        top = min(labels, key=lambda lab: (depth[lab], lab))
        shared = _parameter_below(fn, edges)
        if shared is None:
            around = sorted(set().union(*(_above(lab, incoming) for lab in labels)) - set(_above(top, incoming)))
            raise ValueError(
                f"per_layer: {_node_name(fn, names)} is reached by gradient paths that cross different "
                f"cut points ({', '.join(repr(cut_names[k]) for k in around)} on some paths "
                "only), so gradients with different scales would be summed there. A cut point "
                "must be crossed by every path from the loss to what lies below it: choose "
                "outputs of whole blocks (the residual stream), not modules inside a residual "
                "branch or blocks that a skip connection bypasses (cut_points=[...])."
            )
        params[id(shared)] = (shared, top)
        for producer, index, lab in [(producer, index, label), *more]:
            if lab != top:
                rescale.append((producer, index, lab, top))
    return Walk(params, incoming, hidden, rescale, frozenset(used))


def _parameter_below(fn: Any, edges: dict[tuple[int, int], tuple[int, int]]) -> torch.Tensor | None:
    """The parameter when ``fn`` is its gradient's node or a chain of one-input nodes (casts,
    views, transposes) leading to it and to nothing else, else ``None``."""
    for _ in range(16):
        if type(fn) is _ACCUMULATE:
            return fn.variable
        children = [(child, nr) for child, nr in fn.next_functions if child is not None]
        if len(children) != 1 or type(fn) is _CHECKPOINT:
            return None
        child, nr = children[0]
        entry = edges.get((id(child), nr))
        if entry is not None and entry[1] == child._sequence_nr():
            return None
        fn = child
    return None


# ----------------------------------------------------------------------------- cut points


def _has_params(module: nn.Module) -> bool:
    return any(p.requires_grad for p in module.parameters())


def choose_cut_points(
    model: nn.Module, names: Sequence[str] | None = None, keep_last: bool = False, stage: bool = False
) -> list[str]:
    """The qualified names of the modules whose outputs are cut points, bottom (input side) first.

    With ``names``, checks and returns them. Otherwise finds the ``nn.Sequential`` or
    ``nn.ModuleList`` (the model itself included) whose children hold the most trainable
    parameters, and cuts after each of its children with parameters; when that
    container is the model itself (or what single-child wrappers such as DDP or
    ``torch.compile`` hold), its last child is left out (its output is the model's output, which
    only the loss consumes), unless ``keep_last`` (a pipeline stage before the last: its output
    is where the unsplit model's next block begins). ``stage``: a pipeline stage's module, which
    may hold no cut point (a last stage of one block): ``[]`` rather than an error.

    Raises:
        ValueError: a name that is not a submodule (with close matches), a repeated name, or no
            container of blocks found (name the cut points then).

    Example:
        >>> choose_cut_points(nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Linear(4, 1)))
        ['0', '2']
    """
    modules = dict(model.named_modules())
    if names is not None:
        names = list(names)
        for name in names:
            if name not in modules or name == "":
                close = difflib.get_close_matches(name, [n for n in modules if n], n=3)
                hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
                raise ValueError(
                    f"cut_points: {name!r} is not a submodule of the watched model.{hint} Give the "
                    "qualified names of model.named_modules(), e.g. 'blocks.0'."
                )
        if len(set(names)) != len(names) or not names:
            raise ValueError(f"cut_points must be distinct module names, at least one; got {names!r}.")
        return names
    best: tuple[int, str] | None = None
    cuts: list[str] = []
    for name, module in modules.items():
        if not isinstance(module, (nn.Sequential, nn.ModuleList)):
            continue
        children = [c for c in module.children() if _has_params(c)]
        if not children:
            continue
        count = sum(p.numel() for c in children for p in c.parameters() if p.requires_grad)
        if best is None or count > best[0]:
            best = (count, name)
    if best is not None:
        container = modules[best[1]]
        prefix = f"{best[1]}." if best[1] else ""
        cuts = [f"{prefix}{n}" for n, c in container.named_children() if _has_params(c)]
        root = model
        while len(root._modules) == 1 and not (stage and root is container):  # wrappers: DDP's .module, ...
            root = next(iter(root._modules.values()))
        if container is root and not keep_last and cuts[-1] == f"{prefix}{list(container._modules)[-1]}":
            cuts = cuts[:-1]
    if not cuts and not stage:
        raise ValueError(
            "GradScaler(per_layer=True) found no nn.Sequential or nn.ModuleList of blocks in the "
            "watched model. Name the modules whose outputs are cut points: "
            "GradScaler(..., per_layer=True, cut_points=['blocks.0', 'blocks.1', ...])."
        )
    return cuts


def reentrant_message(what: str) -> str:
    """The error for ``what`` (e.g. "cut point 'blocks.0' runs") inside a reentrant checkpoint."""
    return (
        f"per_layer: {what} inside reentrant activation checkpointing "
        "(torch.utils.checkpoint.checkpoint(..., use_reentrant=True)), whose graph the walk from "
        "the loss cannot see into, so the scale its gradients carry cannot be known. Pass "
        "use_reentrant=False (torch's recommendation; per-layer scaling sees through it; in "
        "transformers: model.gradient_checkpointing_enable(gradient_checkpointing_kwargs="
        "{'use_reentrant': False})), or keep the cut points and the parameters outside reentrant "
        "checkpoints."
    )


def first_tensor(output: Any) -> torch.Tensor | None:
    """The tensor that flows on from a module's ``output``: itself, or a tuple/list's first item."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    return None


def tensors_of(outputs: Any) -> list[torch.Tensor]:
    """The tensors in ``outputs``, nested lists and tuples flattened (what ``scale`` got)."""
    if isinstance(outputs, torch.Tensor):
        return [outputs]
    if isinstance(outputs, (list, tuple)):
        return [t for o in outputs for t in tensors_of(o)]
    return []


_REGISTERED = [0, False]  # parameters and submodules registered on any module; hooks installed


def _count(*args: Any) -> None:
    _REGISTERED[0] += 1


def registrations() -> int:
    """How many parameters and submodules were registered on any ``nn.Module`` since the first
    call (which installs torch's global registration hooks: one counter increment each)."""
    if not _REGISTERED[1]:
        nn.modules.module.register_module_parameter_registration_hook(_count)
        nn.modules.module.register_module_module_registration_hook(_count)
        _REGISTERED[1] = True
    return _REGISTERED[0]


class CutGrad:
    """A cut point's gradient hook on one forward's output: the cut point's hook, in an object
    that lives as long as that output's graph (:meth:`.planning.GraphPlanning.observe` forgets the cut
    outputs of graphs that died)."""

    __slots__ = ("hook", "__weakref__")

    def __init__(self, hook: Callable[[torch.Tensor], torch.Tensor | None]) -> None:
        self.hook = hook

    def __call__(self, grad: torch.Tensor) -> torch.Tensor | None:
        return self.hook(grad)


class Times:
    """A parameter's gradient hook for one backward: times a power of two (a device tensor)."""

    def __init__(self, factor: torch.Tensor) -> None:
        self.factor = factor

    def __call__(self, grad: torch.Tensor) -> torch.Tensor:
        factor = self.factor
        return grad * (factor if grad.device == factor.device else factor.to(grad.device, non_blocking=True))


class TimesInput(Times):
    """An autograd node's hook for one backward: its gradient for input ``index`` times a power
    of two (one contribution to a tied weight's gradient, before autograd sums them)."""

    def __init__(self, index: int, factor: torch.Tensor) -> None:
        super().__init__(factor)
        self.index = index

    def __call__(self, grad_inputs: tuple[torch.Tensor | None, ...], grad_outputs: Any) -> tuple[Any, ...] | None:
        grad = grad_inputs[self.index]
        if grad is None:
            return None
        moved = list(grad_inputs)
        moved[self.index] = super().__call__(grad)
        return tuple(moved)
