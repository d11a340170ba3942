"""The stateful part of per-layer scaling: :class:`Layerwise`, the unscaling strategy that a
:class:`mixprec.GradScaler` built with ``per_layer=True`` holds (:mod:`mixprec.scaling.unscaling`).

It holds the cut points and their hooks, the device state (per cut point: the exponent of its
factor, a margin, a growth tracker and a hysteresis budget; per region: the step's amax), unscales
each gradient by its region's scale and applies the rule (:mod:`.rule`) in ``update``. What the
graph walks learnt and the backward's plan are its other half, :class:`.planning.GraphPlanning`.
"""

from __future__ import annotations

import math
import warnings
import weakref
from collections import deque
from typing import Any, Sequence

import torch
from torch import nn

from mixprec._unscale import unscale_
from mixprec.scaling.layerwise.graph import choose_cut_points
from mixprec.scaling.layerwise.planning import GRAPH_KEYS, CutHook, GraphPlanning
from mixprec.scaling.layerwise.stages import StageHook, StageLayout, agree, pipeline_stage, stage_layout
from mixprec.scaling.layerwise.rule import LayerState, Topology, exponent_of, host_rule, host_totals, layer_rule, pow2, topology
from mixprec.scaling._structure import Structure, decode, encode
from mixprec.scaling.protocol import master_pairs
from mixprec.scaling.rule import ScaleConfig, ScaleState
from mixprec.scaling.unscaling import Unscaling

__all__ = ["HISTORY_LEN", "SMALL", "Layerwise"]

#: Updates whose factors :meth:`Layerwise.history` keeps (device tensors, read only when asked).
HISTORY_LEN = 16

#: Why ``GradScaler(per_layer=True)`` needs the group its ranks average gradients over.
UNGROUPED = ("GradScaler(per_layer=True) on {what} without process_group: each rank picks its own per-layer "
             "factors, and ranks that average gradients (DDP, FSDP2) then mix gradients scaled by different factors "
             "and diverge silently; pass process_group='default' (or the data-parallel group, or (mesh, 'dp'))")


def _world_size() -> int:
    """The default group's size (1 without torch.distributed)."""
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


class Layerwise(GraphPlanning, Unscaling):
    """The per-layer part of a :class:`mixprec.GradScaler` (built by ``per_layer=True``).

    Holds the cut points of the watched model, the hooks, the device state (per cut point: the
    exponent of its factor, a margin, a growth tracker and a hysteresis budget; per region: the
    step's amax) and the parameter-to-region map. The scaler calls it as its
    :class:`~mixprec.scaling.unscaling.Unscaling` strategy: :meth:`watch`, :meth:`check_ready`
    and :meth:`observe` (in ``scale``), :meth:`unscale` (in ``unscale_``) and :meth:`update`.

    Preconditions: one watched model; each cut point's module runs at most once per step, with
    its output (a tensor, or a tuple/list whose first item is the tensor that flows on) consumed
    only above it. The graph walk checks this on the first ``scale(loss)`` after :meth:`watch`
    and on every step whose forward differs from the first (see :meth:`observe`).
    """

    #: Device types whose state :meth:`update` reads on the host and updates with
    #: :func:`host_rule` (host memory: no sync); elsewhere :func:`layer_rule` runs on the device.
    host_devices: tuple[str, ...] = ("cpu",)
    #: Fused optimizers divide by one scale inside their kernels: ``step`` unscales first.
    unscale_before_step = True

    def __init__(self, config: ScaleConfig, cut_points: Sequence[str] | None, bounds: tuple[float, float]) -> None:
        if cut_points is not None and (isinstance(cut_points, str) or not all(isinstance(n, str) for n in cut_points)):
            raise TypeError(f"cut_points must be a list of module names, got {cut_points!r}.")
        lo, hi = (exponent_of(float(b), f"layer_bounds[{i}]") for i, b in enumerate(bounds))
        if lo > hi:
            raise ValueError(f"layer_bounds must be (low, high) with low <= high, got {bounds!r}.")
        self.config = config
        self.requested = None if cut_points is None else list(cut_points)
        self.bounds = (lo, hi)
        self.names: list[str] = []
        self._model: weakref.ref[nn.Module] | None = None
        self._handles: list[Any] = []
        self._device_state: dict[str, torch.Tensor] | None = None
        self._pending: dict[str, Any] | None = None  # a loaded state waiting for the cut points
        self._master_maps: dict[int, tuple[int, dict[int, int]]] = {}
        self._indices: dict[tuple[tuple[int, ...], torch.device], torch.Tensor] = {}
        self._grad_hooks: list[Any] = []  # one backward hook per cut point, made by watch
        self._topology: Topology | None = None
        self.recent: deque[torch.Tensor] = deque(maxlen=HISTORY_LEN)  # exponents after each update
        self._saved_structure: Structure | None = None  # a loaded structure waiting for the first walk
        self._stage: StageLayout | None = None
        self._skipped_step: set[int] = set()  # a pipeline stage's cut points skipped in the step
        self.absorbed: torch.Tensor | None = None  # the last update's (see Unscaling)
        self._warned_ungrouped = False
        self._forget_graph()

    # -- watch --------------------------------------------------------------------------------

    def watch(self, model: Any, group: Any = None) -> nn.Module:
        """Chooses the cut points of ``model`` and hooks their modules (replacing an earlier model);
        returns the module watched.

        ``model`` may be a ``torch.distributed.pipelining`` stage (``PipelineStage``): its module's
        cut points are one stage's of the pipeline's chain (:mod:`.stages`), and ``group()`` (the
        scaler's resolved process group) must hold every stage; every rank of it calls ``watch``
        (one ``all_gather_object``).

        Raises:
            ValueError: see :func:`choose_cut_points` and :func:`.stages.stage_layout`.
        """
        stage = pipeline_stage(model)
        module = model if stage is None else stage[0]
        if self._model is not None and self._model() is module and (stage is None) == (self._stage is None):
            return module
        last = stage is None or stage[1] == stage[2] - 1
        local = choose_cut_points(module, self.requested, keep_last=not last, stage=stage is not None)
        layout = None
        if stage is not None:
            layout = stage_layout(local, stage[1], stage[2], None if group is None else group())
        self.remove_hooks()
        _supersede_watchers(module, self)
        modules = dict(module.named_modules())
        self._model = weakref.ref(module)
        self._superseded = False
        self._stage = layout
        self.names = local if layout is None else layout.names
        self._grad_hooks = [self._grad_hook(k) for k in range(len(self.names))]
        self._handles = [modules[n].register_forward_hook(CutHook(self, k, modules[n])) for k, n in self._local_cuts()]
        if not last:
            self._handles.append(module.register_forward_hook(StageHook(self, module)))
        self._forget_graph()  # until the graph walk says otherwise: a chain
        if self._device_state is not None:
            self._device_state = self._fresh_state(self._device_state["exponent"].device)
        return module

    def check_ready(self) -> None:
        """Raises ``ValueError`` (what to do) unless a model is watched: without one the scaler
        would train with the loss scale alone."""
        if self.__dict__.get("_superseded"):
            raise ValueError(
                "GradScaler(per_layer=True): another per-layer scaler's watch() took over this scaler's model "
                "(a model is watched by one scaler: its hooks scale the gradients); step with that scaler, or "
                "call watch(model) on this one again to take the model back"
            )
        if self._model is None or self._model() is None:
            again = " again (watching is not pickled or copied)" if self.names else ""
            raise ValueError(
                "GradScaler(per_layer=True) scales per cut point of a watched model, and none is "
                f"watched: call scaler.watch(model){again} before the first scale(loss) (it "
                "returns the scaler: scaler = mixprec.GradScaler(..., per_layer=True).watch(model)). "
                "Without it every gradient would carry the loss scale alone."
            )

    def stage_device(self, device_type: str) -> torch.device:
        """A watched pipeline stage's device (its forward hook planned its backward); otherwise
        raises: per-layer scales are planned by this rank's own ``scale(loss)``."""
        if self._stage is not None:
            return torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else torch.device(device_type)
        raise ValueError(
            "GradScaler(per_layer=True) unscales what this rank's scaler.scale(loss) planned, and this rank has "
            "scaled no loss: call scaler.scale(loss) before unscale_/step. On a pipeline stage without the loss "
            "(every stage but the last), watch the stage itself, scaler.watch(pipeline_stage), with a process_group "
            "holding every stage (docs/parallelism.md)."
        )

    def release(self) -> None:
        """Another scaler now watches the model: drop the hooks and the model (scaling again raises)."""
        self.remove_hooks()
        self._model, self._superseded = None, True

    def remove_hooks(self) -> None:
        """Removes the cut points' forward hooks and this backward's parameter hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._release_step_hooks()
        self.release_input_hooks()

    # -- device state -------------------------------------------------------------------------

    def _fresh_state(self, device: torch.device | str) -> dict[str, torch.Tensor]:
        n = len(self.names)
        zeros = torch.zeros(n, dtype=torch.int32, device=device)
        state = {
            "exponent": zeros.clone(),
            "margin": zeros.clone(),
            "growth_tracker": zeros.clone(),
            "hysteresis_left": torch.full((n,), self.config.hysteresis, dtype=torch.int32, device=device),
            "stats": torch.full((n + 1,), -1.0, dtype=torch.float32, device=device),
            "overflow": torch.zeros(n, dtype=torch.bool, device=device),
        }
        if self._pending is not None:
            for key, values in self._pending.items():
                state[key] = torch.tensor(values, dtype=torch.int32, device=device)
            self._pending = None
        state["no_overflow"] = state["overflow"]
        # [s_0 .. s_(n-1), 1, 2**T_1 .. 2**T_n]: the factors, then each region's (region 0: 1)
        state["powers"] = torch.ones(2 * n + 1, dtype=torch.float32, device=device)
        state["factor"] = state["powers"][:n]
        state["region_factor"] = state["powers"][n:]
        self._refresh(state)
        return state

    def _refresh(self, state: dict[str, torch.Tensor]) -> None:
        """Rebuilds what derives from the exponents and the parents: the topology, the factors,
        the regions' totals and scales, and the hooks' views of them."""
        device = state["exponent"].device
        self._topology = topology(self._parents, device)
        self._store_factors(state, state["exponent"])
        stats, powers, n = state["stats"], state["powers"], len(self.names)
        indices = torch.tensor([[k + 1, p] for k, p in enumerate(self._parents)], dtype=torch.int64).to(device)
        # per cut point: stats, s_k, [s_k, 1] (a strided view of the powers), [own region, parent]
        self._canonical_plan = [
            (stats, powers[k], powers.as_strided((2,), (n - k,), k), indices[k]) for k in range(n)
        ]
        self._hook_plan = self._canonical_plan

    def _store_factors(self, state: dict[str, torch.Tensor], exponent: torch.Tensor) -> None:
        state["exponent"] = exponent
        state["factor"].copy_(pow2(exponent))
        state["region_factor"][1:].copy_(pow2(self._topology.membership @ exponent.float()))

    def ensure_state(self, device: torch.device) -> dict[str, torch.Tensor]:
        """The device state, created on ``device`` on first use (from a loaded state if any)."""
        if self._device_state is None:
            self._device_state = self._fresh_state(device)
        return self._device_state

    # -- unscale --------------------------------------------------------------------------------

    def _region_lookup(self, optimizer: Any) -> dict[int, int]:
        """Parameter id -> region, with the masters of an optimizer that steps on copies
        (:func:`mixprec.scaling.protocol.master_pairs`: ``MasterWeights``' float32 masters)
        mapped to their model parameters' regions."""
        pairs = master_pairs(optimizer)
        if not pairs:
            return self._param_region
        cached = self._master_maps.get(id(optimizer))
        if cached is None or cached[0] != len(pairs):
            mapping = dict(self._param_region)
            for model_param, master in pairs:
                if id(model_param) in self._param_region:
                    mapping[id(master)] = self._param_region[id(model_param)]
            cached = (len(pairs), mapping)
            self._master_maps[id(optimizer)] = cached
        return cached[1]

    def unscale(
        self, optimizer: Any, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], scale: torch.Tensor
    ) -> dict[torch.device, torch.Tensor]:
        """Divides each gradient by its region's scale (``scale * 2**T_r``) in place, records the
        regions' amax first; returns the per-device overflow flags (0 or 1). No host sync.

        The division is :func:`mixprec._unscale.unscale_` with one scale per region (the loss
        scale's loop: reciprocals in float64, one torch kernel call per (device, dtype, region)).
        """
        state = self.ensure_state(scale.device)
        self.check_backward()
        self._release_step_hooks()
        self.release_input_hooks()
        lookup = self._region_lookup(optimizer)
        regions = [lookup.get(id(param), -1) for param in params]
        if -1 in regions:
            regions = self._unplaced(params, regions)
        measured: dict[tuple[torch.device, torch.dtype], tuple[list[torch.Tensor], list[int]]] = {}
        for grad, region in zip(grads, regions):
            values = grad._values() if grad.is_sparse else grad
            if hasattr(values, "to_local"):  # (with a process group the scaler hands over the local shards)
                raise ValueError(UNGROUPED.format(what="FSDP2 or DTensor gradients") + "; it is required here")
            if values.numel():  # FSDP2: empty shards
                tensors, regions_of = measured.setdefault((values.device, values.dtype), ([], []))
                tensors.append(values)
                regions_of.append(region)
        stats = state["stats"]
        with torch.no_grad():
            for tensors, regions_of in measured.values():  # the regions' amax, before the division
                extremes, regions_of = _extremes(tensors, regions_of)
                if extremes.device != stats.device or extremes.dtype != torch.float32:
                    extremes = extremes.to(stats.device, torch.float32)
                stats.scatter_reduce_(0, self._index(regions_of, stats.device), extremes, reduce="amax")
            found = unscale_(grads, scale * state["region_factor"], regions)
            skipped = self._known - self._fired_step
            if self._stage is not None:  # silenced once the stages' statistics are all-reduced
                self._skipped_step |= skipped
            elif skipped and measured:
                # A step that skipped cut points: the regions at and below them are not measured
                # (their gradients are not those of the network the factors serve, e.g. larger
                # without a skipped block above, or zeros after zero_grad(set_to_none=False)):
                # their factors keep their value; overflows still count.
                silent = tuple(k + 1 for k in range(len(self.names)) if skipped.intersection(self._path(k)))
                index = self._index(silent, stats.device)
                seen = stats.index_select(0, index)
                stats.index_copy_(0, index, torch.where(seen.isfinite(), -1.0, seen))
        return found

    def _path(self, cut: int) -> list[int]:
        """Cut point ``cut`` and the cut points above it (the canonical tree)."""
        path = [cut]
        while self._parents[path[-1]] and len(path) <= len(self._parents):
            path.append(self._parents[path[-1]] - 1)
        return path

    def _index(self, regions_of: tuple[int, ...], device: torch.device) -> torch.Tensor:
        """The int64 index tensor of ``regions_of`` on ``device``, made once per layout."""
        key = (regions_of, device)
        index = self._indices.get(key)
        if index is None:
            index = torch.tensor(regions_of, dtype=torch.int64).to(device)
            self._indices[key] = index
        return index

    # -- update ---------------------------------------------------------------------------------

    def update(
        self, state: ScaleState, proposed: ScaleState, found_inf: torch.Tensor, group: Any, config: ScaleConfig,
        overflow: bool | None,
    ) -> ScaleState:
        """Applies the rule to the factors (:meth:`update_factors`); the loss scale and its
        hysteresis budget stay at ``state``'s where the cut points absorbed the overflow, else
        they are ``proposed``'s. No host sync but :meth:`update_factors`'."""
        absorbed = self.absorbed = self.update_factors(found_inf, group, config, overflow)
        if absorbed is None:
            return proposed
        return proposed._replace(
            scale=torch.where(absorbed, state.scale, proposed.scale),
            hysteresis_left=torch.where(absorbed, state.hysteresis_left, proposed.hysteresis_left),
        )

    def update_factors(
        self, found_inf: torch.Tensor, group: Any, config: ScaleConfig, overflow: bool | None = None
    ) -> torch.Tensor | None:
        """Applies :func:`layer_rule` to the step's statistics, with the scaler's ``config``
        (hysteresis, growth interval, factors). ``overflow``: the step's overflow flag when the
        scaler has already read it on the host (it does when watching), else ``None``.

        Returns a 0-dim bool tensor: the overflow was absorbed by the cut points below the top
        region (their factors backed off or their hysteresis tolerated it), so the loss scale
        must not back off; ``None`` when nothing can have been absorbed (a clean step known on
        the host, or no state yet). No host sync; with ``group``, one all-reduce (MAX) of the
        statistics so that every rank gets the same factors.
        """
        self.config = config
        self._fired_step, self._unwalked = set(), False
        state = self._device_state
        if state is None:
            return None
        stats = state["stats"]
        if self._stage is not None and group is not None:
            stats = self._agree(state, stats, group)
        elif group is not None:
            stats = torch.nan_to_num(stats, nan=math.inf, posinf=math.inf)
            torch.distributed.all_reduce(stats, op=torch.distributed.ReduceOp.MAX, group=group)
        elif not self._warned_ungrouped and _world_size() > 1:
            self._warned_ungrouped = True
            warnings.warn(UNGROUPED.format(what=f"{_world_size()} ranks") + "; ranks that train apart may ignore this",
                          stacklevel=4)
        if stats.device.type in self.host_devices:
            return self._update_on_host(state, stats, found_inf, config, overflow)
        flag = (found_inf.to(stats.device) != 0) if overflow is None else overflow
        layer = LayerState(*(state[k] for k in LayerState._fields))
        totals = self._topology.membership @ layer.exponent.float()
        new, culprit, absorbed = layer_rule(layer, stats, totals, flag, self._topology, config, self.bounds)
        state.update(
            margin=new.margin,
            growth_tracker=new.growth_tracker,
            hysteresis_left=new.hysteresis_left,
            overflow=state["no_overflow"] if culprit is None else culprit,
        )
        self._store_factors(state, new.exponent)
        state["stats"].fill_(-1.0)
        self.recent.append(new.exponent)
        return absorbed

    def _agree(self, state: dict[str, torch.Tensor], stats: torch.Tensor, group: Any) -> torch.Tensor:
        """A pipeline stage's statistics made every stage's (:func:`.stages.agree`): the parents
        its peers learnt taken in, the regions at and below a cut point any stage skipped
        silenced (as :meth:`unscale` does for a whole model)."""
        local = range(self._stage.offset, self._stage.offset + len(self._stage.local))
        stats, parents, skipped = agree(stats, self._parents, local, self._skipped_step, group)
        self._skipped_step = set()
        if parents != self._parents:
            self._parents = parents
            self._refresh(state)
        silent = tuple(k + 1 for k in range(len(self.names)) if skipped.intersection(self._path(k)))
        if silent:
            index = self._index(silent, stats.device)
            seen = stats.index_select(0, index)
            stats.index_copy_(0, index, torch.where(seen.isfinite(), -1.0, seen))
        return stats

    def _update_on_host(
        self, state: dict[str, torch.Tensor], stats: torch.Tensor, found_inf: torch.Tensor, config: ScaleConfig,
        overflow: bool | None,
    ) -> torch.Tensor | None:
        """:meth:`update` through :func:`host_rule`, for a state in host memory: two reads and
        a few writes instead of the rule's fifty small ops."""
        values = self._host_values()
        if overflow is None:
            overflow = bool(found_inf.item())
        layer = LayerState(*(values[k] for k in LayerState._fields))
        new, culprit, absorbed = host_rule(layer, stats.tolist(), overflow, self._parents, config, self.bounds)
        ints = torch.tensor([*new, culprit], dtype=torch.int32, device=stats.device)
        exponent, margin, tracker, left, culprits = ints.unbind()
        state.update(exponent=exponent, margin=margin, growth_tracker=tracker, hysteresis_left=left,
                     overflow=culprits.bool() if overflow else state["no_overflow"])
        powers = [2.0**e for e in new.exponent] + [1.0] + [2.0**t for t in host_totals(new.exponent, self._parents)]
        state["powers"].copy_(torch.tensor(powers, device=stats.device))
        state["stats"].fill_(-1.0)
        self.recent.append(exponent)
        return torch.tensor(True, device=stats.device) if absorbed else None

    def skip_update(self) -> None:
        """What ``update(new_scale=...)`` does here: the step's statistics are discarded (the next
        update measures its own step only); factors, margins, trackers and budgets stay, and the
        history records the unchanged factors. No host sync."""
        self._fired_step, self._skipped_step, self._unwalked = set(), set(), False
        state = self._device_state
        if state is None:
            return
        state["stats"].fill_(-1.0)
        state["overflow"] = state["no_overflow"]
        self.recent.append(state["exponent"])

    def reset(self) -> None:
        """Back to the start: every factor 1, margins 0, budgets full (what a checkpoint without
        per-layer state loads into a per-layer scaler)."""
        self._pending = None
        self._saved_structure = None
        if self._device_state is not None:
            self._device_state = self._fresh_state(self._device_state["exponent"].device)
        self.recent.clear()

    # -- reading --------------------------------------------------------------------------------

    def _host_values(self) -> dict[str, list[int]]:
        keys = ("exponent", "margin", "growth_tracker", "hysteresis_left")
        if self._device_state is None:
            n = len(self.names)
            default = {"exponent": [0] * n, "margin": [0] * n, "growth_tracker": [0] * n,
                       "hysteresis_left": [self.config.hysteresis] * n}
            return {k: list((self._pending or default).get(k, default[k])) for k in keys}
        values = torch.stack([self._device_state[k] for k in keys]).tolist()  # one host sync
        return dict(zip(keys, values))

    def carried(self, scale: torch.Tensor) -> tuple[torch.Tensor, dict[int, int]]:
        """Per region ``scale * 2**T_r`` (a new device tensor: the factors change in place at
        :meth:`update`) and the parameters' regions, as :meth:`unscale` divides them. No host sync."""
        state = self.ensure_state(scale.device)
        return scale * state["region_factor"], self._param_region

    def scales(self) -> dict[str, float]:
        """``{cut point: s_k}`` (one host sync)."""
        return {name: 2.0**e for name, e in zip(self.names, self._host_values()["exponent"])}

    def region_scales(self, scale: float) -> dict[str, float]:
        """``{parameter region's cut point: total scale}`` of each cut point's region."""
        membership = topology(self._parents, "cpu").membership
        totals = membership @ torch.tensor(self._host_values()["exponent"], dtype=torch.float32)
        return {name: scale * 2.0 ** int(t) for name, t in zip(self.names, totals.tolist())}

    def factors(self) -> torch.Tensor | None:
        """``s_k`` as a new float32 device tensor (no host sync); ``None`` before the state exists."""
        return None if self._device_state is None else pow2(self._device_state["exponent"])

    def history(self) -> list[dict[str, float]]:
        """``{cut point: s_k}`` after each of the last :data:`HISTORY_LEN` updates, oldest first
        (one host sync)."""
        if not self.recent:
            return []
        rows = torch.stack(list(self.recent)).tolist()
        return [{name: 2.0**e for name, e in zip(self.names, row)} for row in rows]

    def last_overflow(self) -> tuple[str, ...]:
        """Cut points whose region overflowed first on the last update (one host sync)."""
        if self._device_state is None:
            return ()
        flags = self._device_state["overflow"].tolist()
        return tuple(name for name, bad in zip(self.names, flags) if bad)

    def state_dict(self) -> dict[str, Any]:
        """``{"layerwise": {"cut_points": names, "exponent": [...], "margin": [...],
        "growth_tracker": [...], "hysteresis_left": [...], "structure": {...}}}`` (one host sync),
        the entry it adds to the scaler's state. ``structure`` (after the first step): the region
        of each cut point and parameter as the graph walks learnt them
        (:func:`mixprec.scaling._structure.encode`), by name, so that a resumed run
        scales and measures as the uninterrupted one would after steps that skipped blocks."""
        saved: dict[str, Any] = {"cut_points": list(self.names), **self._host_values()}
        structure = self._structure()
        if structure is not None:
            saved["structure"] = encode(structure, self.names)
        return {"layerwise": saved}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores the per-cut-point values of :meth:`state_dict` from a scaler's whole state,
        and the ``structure`` when it has one (the next ``scale(loss)`` takes it in place of the
        first walk's); a state without it (saved before the first step, or by an older mixprec)
        leaves the structure to the walks, as before. A state without a ``"layerwise"`` entry
        (``per_layer=False``, or torch's) resets every factor to 1 (:meth:`reset`).

        Raises:
            ValueError: the saved cut points are not this scaler's (after :meth:`watch`), or a
                value is out of range; nothing has changed then.
        """
        if "layerwise" not in state_dict:
            self.reset()
            return
        saved = state_dict["layerwise"]
        names = list(saved.get("cut_points", []))
        keys = ("exponent", "margin", "growth_tracker", "hysteresis_left")
        values = {k: [int(v) for v in saved[k]] for k in keys if k in saved}
        if set(values) != set(keys) or any(len(v) != len(names) for v in values.values()):
            raise ValueError(f"the 'layerwise' state must hold cut_points and {', '.join(keys)} of one length.")
        if self.names and names != self.names:
            raise ValueError(
                f"the checkpoint's cut points {names!r} are not this scaler's {self.names!r}; build the "
                "scaler with the same cut_points (or the same model) before loading."
            )
        lo, hi = self.bounds
        if any(not lo <= e <= hi for e in values["exponent"]) or any(m < 0 for m in values["margin"]):
            raise ValueError(f"layerwise exponents must lie in layer_bounds [2**{lo}, 2**{hi}] and margins be >= 0.")
        structure = decode(saved["structure"], names) if "structure" in saved else None
        if not self.names:
            self.requested = self.requested or names
        self._pending = values
        self._saved_structure = structure
        if structure is not None:
            self._release_step_hooks()
            self._forget_graph()
        if self._device_state is not None:
            self._device_state = self._fresh_state(self._device_state["exponent"].device)

    def __getstate__(self) -> dict[str, Any]:
        """Options and per-cut-point values; not the hooks or the model (``watch`` again)."""
        state = {k: v for k, v in self.__dict__.items()}
        state.update(
            _pending=self._host_values() if self.names else None, _saved_structure=self._structure(),
            _model=None, _handles=[], _device_state=None, _master_maps={}, _indices={},
            recent=deque(maxlen=HISTORY_LEN), _grad_hooks=[], absorbed=None,
            requested=self.requested if self.requested is not None else (list(self.names) or None),
        )
        state.pop("_topology", None)
        for key in [k for k in state if k in GRAPH_KEYS]:
            del state[key]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.__dict__.setdefault("_saved_structure", None)  # pickled by an older mixprec
        self.__dict__.setdefault("_stage", None)
        self.__dict__.setdefault("_skipped_step", set())
        self.__dict__.setdefault("absorbed", None)
        self._topology = None
        self._forget_graph()


#: 1-D tensors of at most this many elements (biases, norms) are concatenated per region before
#: the CPU amax (:func:`_extremes`): one reduction for them all.
SMALL = 2**16


def _extremes(tensors: list[torch.Tensor], regions: Sequence[int]) -> tuple[torch.Tensor, tuple[int, ...]]:
    """Values whose maximum over each region is the region's ``max |t|`` (NaN propagates), and
    the region of each value; ``tensors`` are non-empty, on one device, of one dtype, and
    ``regions`` gives each one's region.

    On CUDA, each tensor's ``max |t|``: one ``_foreach_norm(inf)``. On the CPU, where that op
    (and ``vector_norm(inf)``) is 6 to 10x slower: ``|min|`` and ``|max|`` of each group from one
    ``aminmax`` (no copy), the groups being each tensor but the small 1-D ones, which are one
    group per region (one ``cat``).
    """
    if tensors[0].device.type != "cpu":
        return torch.stack(torch._foreach_norm(tensors, float("inf"))), tuple(regions)
    groups: list[tuple[torch.Tensor, int]] = []
    small: dict[int, list[torch.Tensor]] = {}
    for t, region in zip(tensors, regions):
        if t.dim() == 1 and t.numel() <= SMALL:
            small.setdefault(region, []).append(t)
        else:
            groups.append((t, region))
    groups += [(torch.cat(ts) if len(ts) > 1 else ts[0], region) for region, ts in small.items()]
    values = torch.stack([v for t, _ in groups for v in torch.aminmax(t)]).abs_()
    return values, tuple(region for _, region in groups for _ in range(2))


def _supersede_watchers(module: nn.Module, watcher: Layerwise) -> None:
    """Release every other per-layer scaler whose hooks are on ``module`` or its submodules (the
    last ``watch`` wins: two scalers' factors on one model's gradients would multiply), and drop
    the hooks of scalers that no longer exist (inert, but each still a hook call)."""
    others = set()
    for m in module.modules():
        for key, hook in list(m._forward_hooks.items()):
            if isinstance(hook, (CutHook, StageHook)):
                owner = None if hook.owner is None else hook.owner()
                if owner is None:
                    del m._forward_hooks[key]
                    m._forward_hooks_always_called.pop(key, None)
                    m._forward_hooks_with_kwargs.pop(key, None)
                elif owner is not watcher:
                    others.add(owner)
    for owner in others:
        owner.release()
