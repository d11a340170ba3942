"""The fp8 side of the engine's seam: which layers of a model a policy runs in fp8, and running one.

The engine (:mod:`mixprec.engine`) reaches fp8 only through the names
:mod:`mixprec.fp8.internals` exports from here: :func:`select_targets` as a region's outermost module is called, a typed
:class:`Fp8Target` per selected layer (what its ``linear`` is routed to while the layer is
called), and :func:`traced_output` for a layer called while Dynamo traces.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mixprec._modules import named_modules, unwrap
from mixprec.control._shell import live_of
from mixprec.formats._grouped import GroupedExperts
from mixprec.formats._layers import select_layers, warn_once
from mixprec.formats._like import is_linear_like, linear_params, routed_call, warn_unrouted
from mixprec.formats._linear import linear
from mixprec.formats._recipe import Float8Recipe
from mixprec.formats._state import LayerState, layer_state

__all__ = ["Fp8Target", "GroupedTarget", "select_targets", "traced_output"]


@dataclass(frozen=True, eq=False)
class Fp8Target:
    """A layer selected to run in fp8: its ``module``, ``recipe``, statistics ``state`` and GEMM
    ``backend`` (``Policy.fp8``'s ``backend``)."""

    module: nn.Module
    recipe: Float8Recipe
    state: LayerState
    backend: str

    @property
    def runs(self) -> bool:
        """Whether the layer's calls are routed: not while it is in fallback, unless a
        Controller's probe measures it in :func:`mixprec.fp8.linear`."""
        return not self.state.fallback or self.state.probe is not None

    def match(self, op_name: str, args: tuple, kwargs: dict[str, Any]
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
        """``(input, weight as (out, in), bias)`` when the call ``op_name(*args, **kwargs)`` is
        the layer's GEMM (its ``linear``, Conv1D's ``addmm``), else None; a match marks the
        layer as routed."""
        return routed_call(op_name, self.module, args, kwargs)

    def run(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The layer's GEMM in fp8 (:func:`mixprec.fp8.linear`) on a matched call (``x`` cast
        to the compute dtype by the caller)."""
        return linear(x, weight, bias, self.recipe, state=self.state, backend=self.backend)

    def begin(self) -> None:
        """As the layer's call starts (its GEMM is routed by :meth:`match`: nothing to do)."""

    def finish(self) -> None:
        """As the layer's call returns: warn (once per class) if no call of it so far was
        routed (its forward calls neither ``F.linear`` on its weight nor Conv1D's ``addmm``)."""
        if not self.state.routed:
            warn_unrouted(self.module)


@dataclass(frozen=True, eq=False)
class GroupedTarget:
    """A :class:`GroupedExperts` selected to run in fp8: no op of its is routed; while it is called
    (:meth:`begin` to :meth:`finish`, eager), it runs its experts in ``recipe`` itself."""

    module: GroupedExperts
    recipe: Float8Recipe
    backend: str
    runs = True

    def match(self, op_name: str, args: tuple, kwargs: dict[str, Any]) -> None:
        return None

    def begin(self) -> None:
        self.module.enter_policy(self, self.recipe, self.backend)

    def finish(self) -> None:
        self.module.leave_policy()


def select_targets(root: nn.Module, policy: Any) -> dict[int, Fp8Target] | None:
    """The fp8 layers of the model called as ``root`` under ``policy``: ``id(module) ->``
    :class:`Fp8Target` (each with its recipe, ``Fp8Rule.recipe_for``), without the modules a keep
    rule of the policy selects or contains. The rule's guard or controller tracks the layers (it
    decides in its ``step()``, never in a forward: ranks may run different forwards).

    ``None`` when the model has no layer of the rule's types (a loss criterion called in the
    region): nothing is selected and the call is no forward for the guard or controller.

    The layers' states, and the records a guard or controller keeps of them, outlive the call
    that creates them: under ``torch.inference_mode()`` (a first forward that validates) they
    are made as normal tensors, so the training that follows can update them and save them for
    its backward.
    """
    if torch.is_inference_mode_enabled() and not torch.compiler.is_compiling():
        with torch.inference_mode(False), torch.no_grad():
            return _select_targets(root, policy)
    return _select_targets(root, policy)


def _select_targets(root: nn.Module, policy: Any) -> dict[int, Fp8Target] | None:
    rule = policy.fp8_rule
    model = unwrap(root)  # DDP's, FSDP1's, torch.compile's wrappers: the names are the bare model's
    live = live_of(model, rule.kind, rule.guard or rule.controller, rule.live)  # checked before any selection
    likes = nn.Linear in rule.types
    experts = {fqn: m for fqn, m in named_modules(model) if likes and isinstance(m, GroupedExperts) and m.recipe is None}
    if not experts and not any(isinstance(m, rule.types) or (likes and is_linear_like(m)) for m in model.modules()):
        return None
    recipes = dict(rule.recipes)
    modules = dict(named_modules(model))

    def kept(fqn: str) -> bool:
        parts = fqn.split(".") if fqn else []
        ancestors = [".".join(parts[:i]) for i in range(len(parts) + 1)]
        return any(r.matches(modules[a], a) for a in ancestors for r in policy.module_rules)

    targets, named = {}, {}
    for fqn, module in experts.items():  # a mixture of experts' experts (convert's run in their own recipe)
        if kept(fqn) or (rule.names is not None and not re.search(rule.names, fqn)):
            continue
        recipe = rule.recipe_for(fqn)
        multiple = max(16, recipe.block_multiple)
        if module.dim % multiple or module.hidden_dim % multiple:
            warn_once(model, f"fp8: GroupedExperts {fqn!r}: dim={module.dim}, hidden_dim={module.hidden_dim} are "
                             f"not multiples of {multiple}; it stays in the compute dtype")
            continue
        module.ensure_states()  # (before the guard tracks the model's layers: one per expert)
        targets[id(module)] = GroupedTarget(module, recipe, rule.backend)
        named.update({f"{fqn}.{key}" if fqn else key: (layer, recipe)  # a Controller's layers: one per expert
                      for key, layer in module.expert_layers().items()})
    linears = any(isinstance(m, rule.types) or (likes and is_linear_like(m)) for m in modules.values())
    for fqn in select_layers(model, rule.types, rule.names, rule.first_last, rule.recipe, recipes) if linears else ():
        module = modules[fqn]
        if kept(fqn):
            continue
        state = layer_state(module)
        state.name = fqn  # (for errors: the tensor-parallel checks name the layer)
        state.policy_recipe = rule.recipe_for(fqn)  # kept on the layer: what an export writes it in
        targets[id(module)] = Fp8Target(module, state.policy_recipe, state, rule.backend)
        named[fqn] = (module, state.policy_recipe)
    if live is not None:  # its decisions or rungs apply now; it decides in its step(), warns if never stepped
        live.govern(model, named, policy.compute)
    return targets


def traced_output(module: nn.Module, x: torch.Tensor, recipe: Float8Recipe, backend: str) -> torch.Tensor | None:
    """While Dynamo traces a selected layer's call: its output in fp8 on input ``x`` (in the
    compute dtype), or None when the layer is in fallback without a probe (read while tracing:
    a guard, so a fallback recompiles)."""
    if isinstance(module, GroupedExperts):
        warn_once(module, "fp8: under torch.compile Policy.fp8 does not route a GroupedExperts: its experts run in the "
                          "compute dtype; fp8.convert(model, recipe) runs them in fp8 compiled too")
        return None
    state = layer_state(module)
    if not state.fallback or state.probe is not None:
        return linear(x, *linear_params(module), recipe, state=state, backend=backend)
    return None
