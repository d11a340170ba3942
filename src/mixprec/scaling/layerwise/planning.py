"""The backward of a per-layer-scaled step: what the graph walks learnt, and the hooks they plan.

:class:`GraphPlanning` is the half of :class:`mixprec.scaling.layerwise.Layerwise` that knows the
watched model's graph: the canonical structure (each cut point's parent region, each parameter's
region) learnt by the first walk and extended by later ones, the plan of each backward (the
factors the cut points' hooks multiply by, and the compensations of a step whose forward differs
from the first one's), and the check that every cut point that ran got its gradient. The
per-cut-point state, the unscale and the update are the other half (``scaler.py``), whose
attributes this one reads: ``names``, ``_model``, ``_device_state``, ``_topology``,
``_master_maps``, ``_saved_structure``, and its methods ``ensure_state`` and ``_refresh``.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any, Callable, Sequence

import torch
from torch import nn

from mixprec.scaling.layerwise.graph import (
    CutGrad, Times, TimesInput, Walk, first_tensor, reentrant_message, registrations, tensors_of, walk,
)
from mixprec.scaling.layerwise.rule import Topology, pow2
from mixprec.scaling.layerwise.stages import StageLayout
from mixprec.scaling._structure import Structure

__all__ = ["EDGE_LIMIT", "GRAPH_KEYS", "CutHook", "GraphPlanning"]


class GraphPlanning:
    """The graph half of :class:`~mixprec.scaling.layerwise.Layerwise` (see the module docstring)."""

    names: list[str]
    _model: weakref.ref[nn.Module] | None
    _device_state: dict[str, torch.Tensor] | None
    _topology: Topology | None
    _master_maps: dict[int, tuple[int, dict[int, int]]]
    _saved_structure: Structure | None
    ensure_state: Callable[[torch.device], dict[str, torch.Tensor]]
    _refresh: Callable[[dict[str, torch.Tensor]], None]
    _grad_hooks: list[Any]
    _stage: StageLayout | None  # a pipeline stage's place among the stages (None: a whole model)

    @property
    def _top(self) -> int:
        """The region whose scale the gradients arriving at the watched module's outputs carry."""
        return 0 if self._stage is None else self._stage.entry

    def _local_cuts(self) -> list[tuple[int, str]]:
        """``(cut point, module name)`` of the cut points the watched module holds."""
        if self._stage is None:
            return list(enumerate(self.names))
        return [(self._stage.offset + j, name) for j, name in enumerate(self._stage.local)]

    def see_cut_output(self, tensor: torch.Tensor, cut: int) -> None:
        """A forward's output of cut point ``cut`` (what its hook saw): remember its graph edge for
        the next walk and hook its gradient (the cut point's scale)."""
        edges = self._edges
        if len(edges) > EDGE_LIMIT:  # forwards without a scale() since (inference with grad)
            for key in list(edges)[: EDGE_LIMIT // 2]:
                del edges[key]
        hook = CutGrad(self._grad_hooks[cut])  # lives as long as the output's graph: tells that it died
        edges[(id(tensor.grad_fn), tensor.output_nr)] = (cut, tensor.grad_fn._sequence_nr(), weakref.ref(hook))
        tensor.register_hook(hook)

    def _forget_graph(self) -> None:
        """What the graph walks learnt and what one step planned: back to before the first step."""
        # the cut outputs of the forwards whose loss no scale() walked yet: (cut, sequence nr, hook)
        self._edges: dict[tuple[int, int], tuple[int, int, Any]] = {}
        self._calibrated = False
        self._param_region: dict[int, int] = {}
        self._placed: set[int] = set()  # parameters whose region a walk saw (not guessed by owner)
        self._parents: list[int] = [k + 2 if k + 1 < len(self.names) else 0 for k in range(len(self.names))]
        if self._saved_structure is not None:
            self._parents = list(self._saved_structure.parents)
        self._known: set[int] = set()  # cut points whose parent region a walk saw
        self._regular: list[int] = []  # the cut points one regular forward runs, each once
        self._shared = False  # a parameter reached from several regions: walk every step
        self._canonical_plan: list[tuple[torch.Tensor, ...]] = []  # per cut point: stats, s_k, [s_k, 1], index
        self._hook_plan: list[tuple[torch.Tensor, ...]] = []  # this backward's (the canonical one but where it compensates)
        self._step_hooks: list[Any] = []  # this backward's parameter hooks (removed after it)
        self._input_hooks: list[Any] = []  # a pipeline stage's inputs' hooks (removed in unscale)
        self._pending_cuts: frozenset[int] | None = None  # a stage's last planned forward's cut points
        self._fired: set[int] = set()  # cut points whose backward hook ran in this backward
        self._fired_step: set[int] = set()  # ... in any backward since the last update
        self._expected: frozenset[int] | None = None  # what this backward must fire (fast path)
        self._param_names: dict[int, str] | None = None  # id -> qualified name, for errors
        # parameters below no cut point that no walk reached (frozen, or in a branch not run yet),
        # guessed in the top region: while one requires grad, every step is walked (weak references)
        self._awaiting: list[weakref.ref[torch.Tensor]] = []
        self._registrations = -1  # registrations() when the model's parameters were last listed
        self._unwalked = False  # a backward of this step was planned without a whole walk

    # -- the cut points' backward hooks ------------------------------------------------------

    def _grad_hook(self, cut: int) -> Any:
        """The backward hook of cut point ``cut``'s output: records the incoming gradient's amax
        in the parent region's statistic and, times ``s_k``, in its own region's; returns the
        gradient times ``s_k``. A few device ops, no host sync, nothing cached per step. On a
        step whose graph differs from the first one's (a block skipped), ``s_k`` also brings the
        gradient from the region it arrives from to the parent region's scale (the plan)."""

        def hook(grad: torch.Tensor) -> torch.Tensor | None:
            self._fired.add(cut)
            plan = self._hook_plan
            if not plan:
                return None
            stats, factor, pair, index = plan[cut]
            amax = grad.abs().amax() if grad.numel() else grad.new_zeros(())
            if amax.device != stats.device or amax.dtype != torch.float32:
                amax = amax.to(stats.device, torch.float32, non_blocking=True)
            if self._calibrated:  # [own region, parent] <- [amax * s_k, amax]
                stats.scatter_reduce_(0, index, amax * pair, reduce="amax")
            else:  # the parent is not known yet
                own = stats.narrow(0, cut + 1, 1)
                torch.maximum(own, amax * factor, out=own)
            return grad * (factor if grad.device == factor.device else factor.to(grad.device, non_blocking=True))

        return hook

    # -- observe: the graph walk --------------------------------------------------------------

    def observe(self, outputs: Any, device: torch.device) -> None:
        """Called by ``scale(outputs)``, before the backward: creates the device state and plans
        the backward.

        The first time, the graph walk places the cut points and parameters (the canonical
        structure). Later, a forward that ran each of those cut points once, in a model without
        shared parameters, costs nothing here (the hooks check, in the backward, that each
        output reached the loss). Any other forward (a block skipped or exited early, a module
        run twice, a tied weight) is walked again, and this backward gets hooks that bring every
        gradient to its canonical region's scale: a cut point's factor times the factors of
        the cut points skipped above it, a parameter below no cut point that ran times the
        factors of its region's cut points that did not, a tied weight's contributions to its
        topmost region's scale before autograd sums them. All are powers of two: exact.

        Raises:
            ValueError: see :func:`walk`; or the previous backward missed a cut point that ran in
                its forward (see :meth:`check_backward`).
        """
        state = self.ensure_state(device)
        if self._stage is not None:
            self._same_as_pending({entry[0] for entry in self._edges.values()})
        self.check_backward()
        self._release_step_hooks()
        model = self._model() if self._model is not None else None
        # the cut outputs of forwards whose graph still lives (two forwards, then their losses)
        edges = {key: entry for key, entry in self._edges.items() if entry[2]() is not None}
        self._edges = {}
        roots = [t for t in tensors_of(outputs) if t.grad_fn is not None]
        if model is None or not roots:
            return
        unknown = self._new_parameters(model)
        if (self._calibrated and not self._shared and not unknown
                and sorted(entry[0] for entry in edges.values()) == self._regular
                and not any(p is not None and p.requires_grad for p in (ref() for ref in self._awaiting))
                and self._head_is_canonical(roots, edges)):
            self._hook_plan, self._expected = self._canonical_plan, frozenset(self._regular)
            self._unwalked = True
            return
        graph = walk(roots, edges, self.names, self._param_names, self._top)
        self._edges = {key: entry for key, entry in edges.items() if key not in graph.used}  # another loss's
        # a pipeline stage's inputs (leaves that are no parameter): their gradient goes to the
        # stage before, at this stage's bottom region's scale
        inputs = [graph.params.pop(key) for key in [k for k in graph.params if k not in self._param_names]] \
            if self._stage is not None else []
        if inputs and not self._calibrated and {k for k, _ in self._local_cuts()} <= set(graph.incoming):
            if any(label != self._stage.bottom for _, label in inputs):
                raise ValueError(
                    f"per_layer: the gradient of pipeline stage {self._stage.index}'s input does not cross all its cut "
                    f"points ({', '.join(map(repr, self._stage.local))}); across stages, per-layer scaling needs each "
                    "stage's input to flow into its lowest block (a chain of blocks): name cut points that every "
                    "path from the stage's output to its input crosses (cut_points=[...])."
                )
        if not self._calibrated and not self._adopt(model, graph):
            self._calibrate(model, graph)
            self._refresh(state)
        elif set(graph.incoming) - self._known:
            regions, scales = dict(self._param_region), state["region_factor"].clone()
            self._extend(graph)
            self._refresh(state)
            self._carry_over(model, regions, scales, state["region_factor"])
        else:
            self._shared = self._shared or bool(graph.rescale)
            self._place_awaited(model, graph, state)
        if unknown:
            self._guess_unreached(model)
        self._compensate(graph, state, inputs)

    def _head_is_canonical(self, roots: list[torch.Tensor], edges: dict[tuple[int, int], Any]) -> bool:
        """Whether the graph above the cut points is the canonical one, the shortcut's condition:
        a walk from the loss that stops at the cut points (the head and the loss: a few nodes)
        reaches exactly the cut points whose parent is the top region, and only parameters of
        that region. A loss term added later that reaches below a cut point without crossing it
        (a penalty on a lower block's weights, an auxiliary loss on a lower block's output)
        fails it: the step is walked (exact, or the walk's ``ValueError``)."""
        top = self._top
        head = walk(roots, edges, self.names, self._param_names, top, stop_at_cuts=True)
        if head.hidden or set(head.incoming) != {k for k, _ in self._local_cuts() if self._parents[k] == top}:
            return False
        names = self._param_names or {}
        for key in head.params:  # a pipeline stage's input (no parameter) arrives at its bottom region
            region = self._stage.bottom if self._stage is not None and key not in names else self._param_region.get(key)
            if region != top:
                return False
        return True

    def _new_parameters(self, model: nn.Module) -> bool:
        """Whether the watched model holds parameters that no walk (nor guess) placed: registered
        on a module since the last look (a LoRA adapter injected, a layer replaced). Lists the
        model's parameters only when something was registered on any module since (torch's
        global registration hooks, :func:`.graph.registrations`); forgets the region of an ``id``
        now held under another name (reused by a new parameter). One gone is kept: FSDP2 swaps
        the sharded parameters out of the module for the forward."""
        count = registrations()
        if count == self._registrations and self._param_names is not None:
            return False
        self._registrations = count
        names = {id(p): name for name, p in model.named_parameters()}
        old, self._param_names = self._param_names, names
        if old is not None and old != names:
            for key in [key for key, name in old.items() if names.get(key, name) != name]:
                self._param_region.pop(key, None)
                self._placed.discard(key)
            self._master_maps = {}
        return self._calibrated and any(key not in self._param_region for key in names)

    def _guess_unreached(self, model: nn.Module) -> None:
        """The parameters added to the model that this walk did not reach: the region of the cut
        point whose module holds them, else the top region until a walk reaches them (as the
        first walk guesses)."""
        cuts = [(name + ".", k) for k, name in self._local_cuts()]
        for name, param in model.named_parameters():
            if id(param) not in self._param_region:
                owner = [k for prefix, k in cuts if name.startswith(prefix)]
                self._param_region[id(param)] = owner[-1] + 1 if owner else self._top
                if not owner:
                    self._awaiting.append(weakref.ref(param))
        self._master_maps = {}

    def _same_as_pending(self, ran: set[int]) -> None:
        """A pipeline stage plans each micro-batch's backward at its forward, and a schedule may
        run later forwards first (GPipe, 1F1B's warm-up): every micro-batch of a step must run
        the cut points its first one ran (reset in ``unscale``).

        Raises:
            ValueError: this micro-batch ran other cut points than the step's first.
        """
        pending, self._pending_cuts = self._pending_cuts, frozenset(ran)
        if pending is not None and pending != self._pending_cuts:
            self._pending_cuts = None
            raise ValueError(
                f"per_layer: pipeline stage {self._stage.index} ran cut points {sorted(self.names[k] for k in ran)} "
                f"in this micro-batch and {sorted(self.names[k] for k in pending)} in the step's first; each "
                "backward is planned at its forward, and a schedule runs forwards ahead of backwards, so every "
                "micro-batch of a step must run the same blocks (skip blocks per step, not per micro-batch)."
            )

    def _adopt(self, model: nn.Module, graph: Walk) -> bool:
        """Takes the canonical structure of a loaded checkpoint (see :meth:`load_state_dict`) in
        place of the first walk's, when it names this model's parameters; returns whether it did.
        The walk then goes on as on a later step (new cut points join, the step is planned)."""
        saved, self._saved_structure = self._saved_structure, None
        if saved is None:
            return False
        params = dict(model.named_parameters())
        if set(saved.regions) != set(params):
            warnings.warn(
                "per_layer: the checkpoint's structure (the region of each cut point and parameter) "
                "names other parameters than the watched model's; it is learnt again from this step, "
                "so the run may not continue as it would have without the checkpoint. Load it into "
                "the model it was saved from.",
                RuntimeWarning,
                stacklevel=4,
            )
            return False
        self._parents = list(saved.parents)
        self._known = set(saved.known)
        self._regular = list(saved.regular)
        self._shared = saved.shared
        self._param_region = {id(param): saved.regions[name] for name, param in params.items()}
        self._placed = {id(params[name]) for name in saved.placed if name in params}
        self._awaiting = self._guessed_top(model, {})
        self._calibrated = True
        self._refresh(self._device_state)
        return True

    def _structure(self) -> Structure | None:
        """The canonical structure by parameter name (a loaded one while no walk took it);
        ``None`` before the first walk."""
        if not self._calibrated:
            return self._saved_structure
        names = self._param_names or {}
        return Structure(
            parents=list(self._parents), known=set(self._known), regular=list(self._regular), shared=self._shared,
            regions={names[key]: r for key, r in self._param_region.items() if key in names},
            placed={names[key] for key in self._placed if key in names},
        )

    def _calibrate(self, model: nn.Module, graph: Walk) -> None:
        """The canonical structure from the first walk: each cut point's parent region, each
        parameter's region."""
        inside = self._checkpointed(model, graph.hidden, graph.incoming)
        local = {k for k, _ in self._local_cuts()}
        self._parents = [graph.incoming.get(k, self._top) if k in local else p for k, p in enumerate(self._parents)]
        self._known = set(graph.incoming)
        self._regular = sorted(graph.incoming)
        self._shared = bool(graph.rescale)
        owners = [(name, k) for k, name in self._local_cuts()]
        self._param_region = {}
        unplaced = []
        for name, param in model.named_parameters():
            reached = graph.params.get(id(param))
            if reached is not None:
                self._param_region[id(param)] = reached[1]
                self._placed.add(id(param))
                continue
            if id(param) in inside:  # inside a reentrant checkpoint: the checkpoint's region
                self._param_region[id(param)] = inside[id(param)]
                continue
            # Not reached (unused in this step): the cut point whose module owns it, else the
            # top region, until a walk reaches it.
            owner = [k for cut, k in owners if name.startswith(cut + ".")]
            self._param_region[id(param)] = owner[-1] + 1 if owner else self._top
            if not owner and param.requires_grad:
                if None in inside:
                    what = f"parameter {name!r}, not in the graph of the first scaled loss, may run"
                    raise ValueError(reentrant_message(what))
                unplaced.append(name)
        known = {id(p) for p in model.parameters()}
        for key, (param, label) in graph.params.items():  # trainable tensors outside the watched model
            if key not in known:  # (an embedding, a soft prompt feeding it): where the walk found them
                self._param_region[key] = label
                self._placed.add(key)
        if unplaced and any(key not in known for key in graph.params):
            warnings.warn(
                f"per_layer: {', '.join(unplaced[:5])}{' ...' if len(unplaced) > 5 else ''} of the "
                "watched model are not in the autograd graph of the first scaled loss, which trains "
                "other tensors (a wrapper's copies of the parameters?); they are taken to lie above "
                "every cut point. If they lie below one, their gradients are unscaled by the wrong "
                "factor: name cut points that own them (cut_points=[...]) or do not use per_layer "
                "with this wrapper.",
                RuntimeWarning,
                stacklevel=4,
            )
        self._awaiting = self._guessed_top(model, inside)
        self._calibrated = True

    def _guessed_top(self, model: nn.Module, inside: dict[Any, int]) -> list[weakref.ref[torch.Tensor]]:
        """The parameters no walk placed, that no cut point owns, not inside a reentrant checkpoint
        (``inside``): guessed in the top region until a walk reaches them."""
        cuts = [name + "." for _, name in self._local_cuts()]
        return [weakref.ref(param) for name, param in model.named_parameters()
                if id(param) not in self._placed and id(param) not in inside and not name.startswith(tuple(cuts))]

    def _place_awaited(self, model: nn.Module, graph: Walk, state: dict[str, torch.Tensor]) -> None:
        """Parameters this walk reached that none had (a frozen one trained, a branch first run):
        their region is where this step found them, and gradients they got earlier in the step
        move to it (:meth:`_carry_over`)."""
        new = {key: label for key, (_, label) in graph.params.items() if key not in self._placed}
        if not new:
            return
        regions = dict(self._param_region)
        self._param_region.update(new)
        self._placed |= set(new)
        self._awaiting = [ref for ref in self._awaiting if (p := ref()) is not None and id(p) not in self._placed]
        self._master_maps = {}  # built from the parameters' regions
        self._carry_over(model, regions, state["region_factor"], state["region_factor"])

    def _extend(self, graph: Walk) -> None:
        """A later walk reached cut points the canonical structure lacks (skipped in the first
        step). When it reached all the known ones too, its structure becomes the canonical one
        (parents, parameter regions, the regular forward); otherwise the new cut points join
        where this step found them, and so do parameters no walk had reached."""
        reached = set(graph.incoming)
        self._shared = self._shared or bool(graph.rescale)
        complete = reached >= self._known
        for k in reached if complete else reached - self._known:
            self._parents[k] = graph.incoming[k]
        self._known |= reached
        if complete:
            self._regular = sorted(reached)
        for key, (_, label) in graph.params.items():
            if complete or key not in self._placed:
                self._param_region[key] = label
                self._placed.add(key)
        self._awaiting = [ref for ref in self._awaiting if (p := ref()) is not None and id(p) not in self._placed]
        self._master_maps = {}  # built from the parameters' regions

    def _carry_over(
        self, model: nn.Module, regions: dict[int, int], scales: torch.Tensor, new_scales: torch.Tensor
    ) -> None:
        """Gradients accumulated before the canonical structure changed (earlier backward calls
        of this step) carry their old region's scale: brought to the new one (powers of two)."""
        moved: dict[tuple[int, int], list[torch.Tensor]] = {}
        for param in model.parameters():
            key = id(param)
            if param.grad is not None and key in regions and key in self._param_region:
                moved.setdefault((regions[key], self._param_region[key]), []).append(param.grad)
        with torch.no_grad():
            for (old, new), grads in moved.items():
                ratio = new_scales[new] / scales[old]
                torch._foreach_mul_(grads, ratio.to(grads[0].device))

    def _compensate(self, graph: Walk, state: dict[str, torch.Tensor], inputs: Any = ()) -> None:
        """This backward's plan (see :meth:`observe`): factors ``2**(T_to - T_from)`` on the
        device (no host sync) for every gradient that arrives in a region other than its
        canonical one; ``inputs``: a pipeline stage's input leaves, whose canonical region is the
        stage's bottom one (their hooks stay until :meth:`release_input_hooks`, in ``unscale``:
        under GPipe a micro-batch's backward runs after the next one's plan)."""
        moves: list[tuple[int, int]] = []  # (to region, from region)
        cuts = {k: len(moves) + i for i, k in enumerate(k for k, lab in graph.incoming.items() if lab != self._parents[k])}
        moves += [(self._parents[k], graph.incoming[k]) for k in cuts]
        leaves = []
        for key, (param, label) in graph.params.items():
            region = self._param_region.get(key)
            if region is not None and region != label and param.requires_grad:
                leaves.append((param, len(moves)))
                moves.append((region, label))
        sent = []
        for tensor, label in inputs:
            if label != self._stage.bottom and tensor.requires_grad:
                sent.append((tensor, len(moves)))
                moves.append((self._stage.bottom, label))
        nodes = []
        for node, index, label, top in graph.rescale:
            nodes.append((node, index, len(moves)))
            moves.append((top, label))
        self._hook_plan = self._canonical_plan
        if not moves:
            return
        exponent = state["exponent"]
        totals = torch.cat([exponent.new_zeros(1, dtype=torch.float32), self._topology.membership @ exponent.float()])
        index = torch.tensor(moves, dtype=torch.int64).to(exponent.device)
        factors = pow2((totals[index[:, 0]] - totals[index[:, 1]]).clamp_(-126, 127)).unbind()
        plan = list(self._canonical_plan)
        for k, i in cuts.items():
            stats, factor, _, where = plan[k]
            moved = factor * factors[i]
            plan[k] = (stats, moved, torch.stack([moved, factors[i]]), where)
        self._hook_plan = plan
        self._step_hooks = [param.register_hook(Times(factors[i])) for param, i in leaves]
        # a micro-batch's input, a buffer the stage reuses at the next step: until unscale
        self._input_hooks += [tensor.register_hook(Times(factors[i])) for tensor, i in sent]
        for node, index_in, i in nodes:
            node.register_hook(TimesInput(index_in, factors[i]))  # dies with this step's graph

    def release_input_hooks(self) -> None:
        """Removes the hooks on a pipeline stage's inputs (after the step's backward)."""
        for handle in self._input_hooks:
            handle.remove()
        self._input_hooks, self._pending_cuts = [], None

    def _release_step_hooks(self) -> None:
        for handle in self._step_hooks:
            handle.remove()
        self._step_hooks = []

    def check_backward(self) -> None:
        """After a backward planned without a walk: every cut point that ran in the forward got
        its gradient (else the factors of the cut points above the parameters that did get
        gradients are not known here). Folds the backward's cut points into the step's.

        Raises:
            ValueError: a cut point ran in the forward but its output did not reach the loss.
        """
        fired, expected = self._fired, self._expected
        self._fired_step |= fired
        self._fired, self._expected = set(), None
        if expected is None or not fired or fired >= expected:
            return
        missing = ", ".join(repr(self.names[k]) for k in sorted(expected - fired))
        raise ValueError(
            f"per_layer: cut point {missing} ran in the forward but its output did not reach the "
            "loss in the backward (computed and discarded), so the gradients below it carry a "
            "scale that per-layer scaling cannot know, and this step's gradients are wrong. Skip "
            "the block instead of discarding its output (do not call it: skipped blocks, early "
            "exits and unused experts are exact), or name cut points whose outputs always reach "
            "the loss (cut_points=[...])."
        )

    def _unplaced(self, params: Sequence[torch.Tensor], regions: list[int]) -> list[int]:
        """``regions`` (of ``params``' gradients, in ``unscale``) where no walk placed some (-1).
        A parameter the model holds under the name of a placed one takes its region (FSDP2's
        sharded parameter: the module holds the unsharded one in the forward, which the walk
        reached); the rest the top region when every backward of the step was walked (their
        gradients came from no scaled loss's graph).

        Raises:
            ValueError: a backward of the step was planned without a walk, so their gradients may
                have crossed cut points (a tensor outside the model, first trained late).
        """
        model = self._model() if self._model is not None else None
        if model is not None:
            held = {id(p): name for name, p in model.named_parameters()}
            by_name = {name: self._param_region[key] for key, name in (self._param_names or {}).items()
                       if key in self._param_region}
            for param in params:
                if held.get(id(param)) in by_name:
                    self._param_region[id(param)] = by_name[held[id(param)]]
                    self._master_maps = {}
            regions = [self._param_region.get(id(p), r) if r < 0 else r for p, r in zip(params, regions)]
        if not self._unwalked or min(regions) >= 0:
            return [max(region, 0) for region in regions]
        self._awaiting += [weakref.ref(p) for p, r in zip(params, regions) if r < 0]  # walked until placed
        shapes = ", ".join(str(tuple(p.shape)) for p, r in zip(params, regions) if r < 0)
        raise ValueError(
            f"per_layer: tensors of shape {shapes} got a gradient, but no graph walk placed them (they are "
            "not parameters of the watched model, or were added to it without registering) and this step's "
            "backward was planned without a walk, so the scale their gradients carry is not known: this "
            "step's gradients are not usable (optimizer.zero_grad() and go on: the next steps are walked, "
            "which places them). Make them parameters of the watched model (an nn.Parameter attribute of one "
            "of its modules), or use them from the first scale(loss) after watch(model) on."
        )

    def _checkpointed(
        self, model: nn.Module, hidden: list[tuple[Any, int]], incoming: dict[int, int]
    ) -> dict[Any, int]:
        """What the reentrant checkpoints the walk met hide: ``{id(parameter): region}`` for
        the parameters of checkpointed modules (the region the checkpoint lies in), and the key
        ``None`` when one checkpointed a function that is no module's.

        Raises:
            ValueError: a cut point runs inside a reentrant checkpoint (its nesting, and so the
                scale of every gradient below it, cannot be known).
        """
        inside: dict[Any, int] = {}
        modules = dict(model.named_modules())
        for run_function, label in hidden:
            owner = run_function if isinstance(run_function, nn.Module) else getattr(run_function, "__self__", None)
            if not isinstance(owner, nn.Module):
                inside[None] = 0
                continue
            members = {id(m) for m in owner.modules()}
            cuts = [name for _, name in self._local_cuts() if id(modules[name]) in members]
            if cuts:
                raise ValueError(reentrant_message(f"cut point {cuts[0]!r} runs"))
            for param in owner.parameters():
                inside.setdefault(id(param), label)
        unreached = [name for k, name in self._local_cuts() if k not in incoming]
        if None in inside and unreached:
            raise ValueError(reentrant_message(f"cut point {unreached[0]!r} runs"))
        return inside


class CutHook:
    """The forward hook on a cut point's module: notes the output's ``grad_fn`` for the graph walk
    and hooks the output's gradient. It does nothing on a copy of the model (``copy.deepcopy``,
    ``pickle``, ``torch.save``: the copy is not watched; a pickled hook is an inert one), nor
    when an activation checkpoint recomputes the module in the backward."""

    def __init__(self, owner: GraphPlanning | None = None, cut: int = -1, module: nn.Module | None = None) -> None:
        self.owner = None if owner is None else weakref.ref(owner)
        self.module = None if module is None else weakref.ref(module)
        self.cut = cut

    @torch._dynamo.disable  # the hook runs eagerly: torch.compile breaks the graph here
    def __call__(self, module: nn.Module, args: Any, output: Any) -> None:
        owner = None if self.owner is None else self.owner()
        tensor = first_tensor(output)
        if owner is None or self.module is None or module is not self.module() or tensor is None:
            return
        if tensor.grad_fn is None or torch._C._current_graph_task_id() != -1:
            return
        owner.see_cut_output(tensor, self.cut)

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        return (CutHook, ())


#: What :meth:`GraphPlanning._forget_graph` sets: learnt from the watched model's graphs, not pickled.
GRAPH_KEYS = frozenset((
    "_edges", "_calibrated", "_param_region", "_placed", "_parents", "_known", "_regular", "_shared",
    "_canonical_plan", "_hook_plan", "_step_hooks", "_input_hooks", "_pending_cuts", "_fired", "_fired_step", "_expected", "_param_names",
    "_awaiting", "_registrations", "_unwalked",
))

#: Cut-point outputs remembered between two ``scale()`` calls at most (ints only).
EDGE_LIMIT = 4096
