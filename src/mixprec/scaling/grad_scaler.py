"""``mixprec.GradScaler``: a drop-in for ``torch.amp.GradScaler`` with hysteresis, bounds, skip
signals, overflow attribution and distributed agreement.

The scaler is a stateful shell: the scale-update rule is the pure function
:func:`mixprec.scaling.update_scale` (``rule.py``), unscaling is the strategy it holds
(``unscaling.py``: one loss scale, or per layer, ``layerwise/``), attribution and the
``MinScaleError`` report are ``_attribution.py``, the per-optimizer record, the host snapshot and
the checkpoint format are ``_state.py``, the readers, getters and setters ``_accessors.py``,
saving and pickling ``_checkpoint.py``, and the optimizer protocol is ``protocol.py``. What is
left here is the iteration: scale, unscale, step, update, with their stages and skips.
"""

from __future__ import annotations

import inspect
import warnings
from collections import abc, defaultdict, deque
from typing import Any, Callable, Iterable, Literal, Sequence, overload

import torch
from torch import nn

from mixprec._groups import check as check_group, is_default, resolve as resolve_group
from mixprec._unscale import PerDevice, unscale_
from mixprec.scaling._accessors import ScalerAccessors
from mixprec._scaled import note_scaled
from mixprec.scaling._attribution import Attribution, MinScaleError, local, min_scale_message
from mixprec.scaling._checkpoint import ScalerCheckpoint
from mixprec.scaling._state import ON_MIN_SCALE, HostSnapshot, OptimizerState, Stage, chosen_options, persist
from mixprec.scaling._state import check_optimizer as _check_optimizer, validated_new_scale
from mixprec.scaling.layerwise import DEFAULT_BOUNDS, Layerwise
from mixprec.scaling.protocol import lend_scale, prepare_grads
from mixprec.scaling.rule import ScaleConfig, ScaleState, _check_scale_value, backoff_blocked, update_scale
from mixprec.scaling.unscaling import GlobalUnscaling, Unscaling

__all__ = ["GradScaler", "HistoryCallback", "MinScaleError"]

#: ``history(step, scale, skipped, overflow_names)``; see :class:`GradScaler`.
HistoryCallback = Callable[[int, float, bool, tuple[str, ...]], None]

_HISTORY_LEN = 16


class GradScaler(ScalerCheckpoint, ScalerAccessors, torch.amp.GradScaler):
    """Dynamic loss scaling, a drop-in for :class:`torch.amp.GradScaler`.

    With the default settings the scale trajectory, the skipped steps and the weights are bit for
    bit those of ``torch.amp.GradScaler`` on the same gradients. The keyword-only options add
    what DeepSpeed, Megatron and Apex users reach for.

    It is a subclass of ``torch.amp.GradScaler``, so code that checks
    ``isinstance(scaler, torch.amp.GradScaler)`` (Lightning, Accelerate) takes it. It overrides
    every method torch defines except the stateless ``_unscale_grads_``, and does not call
    ``torch.amp.GradScaler.__init__``: its state is a :class:`ScaleState` (torch's ``_scale`` and
    ``_growth_tracker`` are read-only views of it, updated in place as torch's) and a
    :class:`~mixprec.scaling._state.HostSnapshot` (``_init_scale``, ``_growth_factor``, ...: torch's).

    The scale follows :func:`mixprec.scaling.update_scale` (its docstring has the exact rule):
    back off by ``backoff_factor`` on an overflow (after ``hysteresis`` overflows), grow by
    ``growth_factor`` after ``growth_interval`` clean steps, and stay in ``[min_scale,
    max_scale]``; it never becomes 0, subnormal or inf.

    Args:
        device: device type of the scale, ``"cuda"`` or ``"cpu"`` (as ``torch.amp``); with
            ``"cuda"`` and no CUDA the scaler warns and disables itself, as torch's does.
        init_scale: the first scale (clamped into ``[min_scale, max_scale]``).
        growth_factor, backoff_factor, growth_interval: as ``torch.amp.GradScaler``.
        enabled: ``False`` makes :meth:`step` a plain ``optimizer.step()`` and the rest no-ops.
        hysteresis: overflows tolerated before the scale backs off (steps are skipped all the
            same); refilled when the scale grows.
        consecutive_hysteresis: refill the hysteresis budget after every clean step instead.
        min_scale, max_scale: bounds of the scale (``None``: 2**-126 and float32 max).
        on_min_scale: what an overflow does when the scale is already at ``min_scale`` (lowering
            it cannot help): ``"raise"`` a :class:`MinScaleError` naming the parameters with
            non-finite gradients, the step and the recent scales; ``"warn"`` once and keep
            skipping; ``"ignore"``. Checked only when ``min_scale`` is set, in :meth:`update`.
        process_group: all-reduce the overflow flag (MAX) over this group so that every rank
            skips together: a ``ProcessGroup``, or ``(DeviceMesh, dim_name)`` (that dimension's
            group holding this rank); ``"default"`` uses the default group when
            ``torch.distributed`` is initialized (and nothing otherwise); ``None`` does not
            communicate (DTensor gradients, as from FSDP2 ``fully_shard``, are then reduced over
            their mesh by DTensor itself, as with torch's scaler). A rank outside the group gets
            a ValueError naming it. A pipeline stage that scales no loss creates its scale in
            :meth:`unscale_` or :meth:`step` (same arguments on every stage: docs/scaling.md).
        history: a plain callable ``history(step, scale, skipped, overflow_names)`` called by every
            :meth:`update` with the 0-based iteration, the scale used in it, whether an optimizer
            step was skipped and the names of the parameters with non-finite gradients (empty on
            clean steps). See :class:`mixprec.scaling.CSVHistory` and ``TensorBoardHistory``.
        per_layer: per-layer gradient scaling (:mod:`mixprec.scaling.layerwise`, the unscaling
            strategy the scaler then holds, see :mod:`mixprec.scaling.unscaling`): :meth:`watch`
            chooses cut points, each multiplies the gradient crossing it by a power of two chosen
            from the previous step's gradient amax, and :meth:`unscale_` divides each gradient
            by its own scale (exact). :meth:`layer_scales` reads the factors.
        cut_points: with ``per_layer``: the qualified names of the modules whose outputs are
            cut points (default: the children of the model's largest ``nn.Sequential`` or
            ``nn.ModuleList`` of blocks).
        layer_bounds: with ``per_layer``: ``(low, high)``, powers of two in ``[2**-14, 2**15]``
            bounding each cut point's factor; ``(1.0, 1.0)`` keeps every factor at 1.

    Host synchronisations (CPU-GPU syncs):
        * :meth:`scale`, :meth:`unscale_`, :meth:`update`: none, except as listed below.
        * :meth:`step` with a plain optimizer: exactly one (reads the overflow flag to decide
          whether to call ``optimizer.step()``), as torch.
        * :meth:`step` with a fused optimizer (``_step_supports_amp_scaling``, e.g.
          ``torch.optim.AdamW(fused=True)``): none; the kernel skips itself via ``found_inf``.
        * :meth:`watch`: the overflow flag is read once per optimizer and iteration, in
          :meth:`unscale_` (before clipping spreads a NaN to every gradient) or else in
          :meth:`step`; on the plain path that is the step's own sync, moved earlier; on the fused
          path it is one extra. Naming the parameters (only on skipped steps) is one more.
        * ``min_scale`` with ``on_min_scale`` ``"raise"`` (or ``"warn"`` until it has warned): one
          per :meth:`update`. ``history``: one per :meth:`update`.
        * :meth:`get_scale`, :meth:`state_dict`, pickling, ``copy.deepcopy``: one each (the
          scale, growth tracker, hysteresis budget and skip count are read together).

    Optimizer protocol (:mod:`mixprec.scaling.protocol`): before reading gradients,
    :meth:`unscale_` (and the fused path's overflow check) calls ``optimizer.prepare_grads()``
    when the optimizer is a :class:`~mixprec.scaling.protocol.PreparesGrads`; gradients are then
    read from ``optimizer.param_groups`` only, so float16 model weights behind
    :class:`mixprec.MasterWeights` never hit "Attempting to unscale FP16 gradients". Fused
    optimizers get ``grad_scale`` and ``found_inf`` for the duration of their step.

    Pickling keeps the options, the state and ``history`` (a lambda or local function cannot be
    pickled: pass a module-level function or a callable object such as
    :class:`mixprec.scaling.CSVHistory`), not the watched models (call :meth:`watch` again). A
    ``ProcessGroup`` cannot be pickled (it belongs to one process): pickling such a scaler raises;
    save :meth:`state_dict` instead, or use ``process_group="default"``, which is kept.

    Example:
        >>> scaler = mixprec.GradScaler("cpu", hysteresis=2, min_scale=1.0)
        >>> for x, y in data:
        ...     optimizer.zero_grad()
        ...     with mixprec.autocast("cpu", dtype=torch.float16):
        ...         loss = loss_fn(model(x), y)
        ...     scaler.scale(loss).backward()
        ...     scaler.unscale_(optimizer)
        ...     torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        ...     scaler.step(optimizer)
        ...     scaler.update()
    """

    def __init__(
        self,
        device: str = "cuda",
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        *,
        hysteresis: int = 1,
        consecutive_hysteresis: bool = False,
        min_scale: float | None = None,
        max_scale: float | None = None,
        on_min_scale: Literal["raise", "warn", "ignore"] = "raise",
        process_group: Any = None,
        history: HistoryCallback | None = None,
        per_layer: bool = False,
        cut_points: Sequence[str] | None = None,
        layer_bounds: tuple[float, float] = DEFAULT_BOUNDS,
    ) -> None:
        # torch.amp.GradScaler.__init__ is not called: it would assign _scale/_growth_tracker,
        # which are views of self._state here, and it validates with assert.
        self._device = device
        self._enabled = enabled
        if device == "cuda" and enabled and not torch.cuda.is_available():
            warnings.warn(
                "mixprec.GradScaler is enabled with device='cuda', but CUDA is not available. "
                "Disabling. Pass device='cpu' to scale on the CPU.",
                stacklevel=2,
            )
            self._enabled = False
        if on_min_scale not in ON_MIN_SCALE:
            raise ValueError(f"on_min_scale must be one of {ON_MIN_SCALE}, got {on_min_scale!r}.")
        if history is not None and not callable(history):
            raise TypeError(f"history must be callable or None, got {type(history).__name__}.")
        if isinstance(process_group, str) and not is_default(process_group):
            raise ValueError(f"process_group must be a ProcessGroup, (DeviceMesh, dim_name), 'default' or None, got {process_group!r}.")
        if process_group is not None:
            check_group(process_group, "GradScaler")
        self._config = ScaleConfig(
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            hysteresis=hysteresis,
            consecutive_hysteresis=consecutive_hysteresis,
            min_scale=min_scale,
            max_scale=max_scale,
        )
        _check_scale_value("init_scale", float(init_scale))
        self._on_min_scale = on_min_scale
        self._chosen = chosen_options(self._config, on_min_scale)  # what load_state_dict warns about
        self._process_group = process_group
        self._history = history
        # What the lazily created device state starts from; also what pickling stores.
        self._snapshot = HostSnapshot(self._clamped(float(init_scale)), 0, hysteresis, 0)
        self._state: ScaleState | None = None
        self._skipped_steps: torch.Tensor | None = None
        self._last_step_skipped: torch.Tensor | None = None
        self._step = 0
        self._warned_min_scale = False
        self._per_optimizer_states: dict[int, OptimizerState] = defaultdict(OptimizerState)
        self._skipped_by_optimizer: dict[int, torch.Tensor] = {}
        self._recent_scales: deque[torch.Tensor] = deque(maxlen=_HISTORY_LEN)
        self._attribution = Attribution()
        if cut_points is not None and not per_layer:
            raise ValueError("cut_points is an option of per-layer scaling: pass per_layer=True with it.")
        self._unscaling: Unscaling = (
            Layerwise(self._config, cut_points, layer_bounds) if per_layer and self._enabled else GlobalUnscaling()
        )

    # ------------------------------------------------------------------ state

    def _lazy_init_scale_growth_tracker(self, dev: torch.device | str) -> None:
        """Creates the device state on ``dev`` from the host snapshot (torch's name), in place."""
        state, self._skipped_steps = self._snapshot.device_state(self._config, dev)
        self._state = persist(self._state, state)
        self._last_step_skipped = torch.zeros((), dtype=torch.bool, device=dev)

    def _require_state(self, funcname: str) -> ScaleState:
        if self._state is None and self._process_group is not None and funcname in ("unscale_", "step"):
            # a pipeline stage without the loss: its gradients carry the scale its peers' scale() used
            self._lazy_init_scale_growth_tracker(self._unscaling.stage_device(self._device))
        if self._state is None:
            raise RuntimeError(
                f"Attempted {funcname} before the scale was initialised. Call "
                "scaler.scale(loss) (and backward) earlier in the iteration."
            )
        return self._state

    # ------------------------------------------------------------------ scale

    @overload
    def scale(self, outputs: torch.Tensor) -> torch.Tensor: ...

    @overload
    def scale(self, outputs: list[torch.Tensor]) -> list[torch.Tensor]: ...

    @overload
    def scale(self, outputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]: ...

    @overload
    def scale(self, outputs: Iterable[torch.Tensor]) -> Iterable[torch.Tensor]: ...

    def scale(self, outputs: torch.Tensor | Iterable[torch.Tensor]) -> Any:
        """Multiplies a tensor, or nested lists/tuples of tensors, by the current scale.

        The scale lives on the device of the first tensor scaled (created there lazily). Returns
        ``outputs`` unchanged when disabled. No host sync. Notes, for this thread, the scale each
        gradient of the coming backward carries (:mod:`mixprec._scaled`: the loss scale,
        per layer times the factors above it), which ``Controller.step()`` reads for its loss
        cost.

        With ``per_layer=True`` it also plans the backward (a graph walk on the first call and
        on steps whose forward differs from the first's: a block skipped, a tied weight).

        Raises:
            ValueError: if ``outputs`` holds something other than tensors and iterables; with
                ``per_layer=True``, without a watched model (call :meth:`watch`), or a graph the
                cut points cannot serve (see :meth:`mixprec.scaling.layerwise.Layerwise.observe`).
        """
        if not self._enabled:
            return outputs
        self._unscaling.check_ready()
        if isinstance(outputs, torch.Tensor):
            if self._state is None:
                self._lazy_init_scale_growth_tracker(outputs.device)
            scale = self._require_state("scale").scale
            self._unscaling.observe(outputs, scale.device)  # per-layer: plans the backward
            note_scaled(*self._unscaling.carried(scale))
            return outputs * scale.to(device=outputs.device, non_blocking=True)

        stash: list[PerDevice] = []

        def apply(value: Any) -> Any:
            if isinstance(value, torch.Tensor):
                if not stash:
                    if self._state is None:
                        self._lazy_init_scale_growth_tracker(value.device)
                    stash.append(PerDevice(self._require_state("scale").scale))
                return value * stash[0].get(value.device)
            if isinstance(value, abc.Iterable):
                mapped = map(apply, value)
                return type(value)(mapped) if isinstance(value, (list, tuple)) else mapped
            raise ValueError("outputs must be a Tensor or an iterable of Tensors")

        scaled = apply(outputs)
        if self._state is not None:
            self._unscaling.observe(outputs, self._state.scale.device)
            note_scaled(*self._unscaling.carried(self._state.scale))
        return scaled

    # ------------------------------------------------------------------ unscale

    def _group(self) -> Any:
        group = self._process_group
        if group is None or not is_default(group):
            return None if group is None else resolve_group(group, "GradScaler")
        dist = torch.distributed
        return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None

    def _check_and_unscale(
        self, optimizer: torch.optim.Optimizer, scale: torch.Tensor | None, allow_fp16: bool
    ) -> dict[torch.device, torch.Tensor]:
        """Unscales (``scale=None``: only checks) the optimizer's gradients; per-device flags."""
        prepare_grads(optimizer)
        group = self._group()
        grads, owners = [], []
        for param_group in optimizer.param_groups:
            for param in param_group["params"]:
                grad = param.grad
                if grad is None:
                    continue
                if not allow_fp16 and grad.dtype == torch.float16:
                    raise ValueError(
                        "Attempting to unscale FP16 gradients. The optimizer must update "
                        "float32 parameters: keep the weights in float32 and autocast the "
                        "forward, or wrap the optimizer in mixprec.MasterWeights. With "
                        "mixprec.optim.AdamW/SGD on float16 weights, skip unscale_ and call "
                        "scaler.step(optimizer): they unscale on the fly."
                    )
                if grad.is_sparse and grad.dtype is torch.float16:
                    # Duplicate indices of a scaled fp16 gradient may overflow once summed,
                    # so check the coalesced values.
                    param.grad = grad = grad.coalesce()
                elif not grad.is_sparse and group is not None:
                    grad = local(grad)  # we reduce found_inf ourselves below
                grads.append(grad)
                owners.append(param)
        found = unscale_(grads, None) if scale is None else self._unscaling.unscale(optimizer, owners, grads, scale)
        if group is None:
            return found
        # One flag on the scale's device, MAX over the ranks: every rank skips together. Every
        # rank calls this exactly once per unscale, with or without local gradients.
        combined = torch.zeros((), dtype=torch.float32, device=self._require_state("unscale_").scale.device)
        for flag in found.values():
            combined += flag.to(combined.device, non_blocking=True)
        torch.distributed.all_reduce(combined, op=torch.distributed.ReduceOp.MAX, group=group)
        return {combined.device: combined}

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divides the optimizer's gradients by the scale, in place, and records inf/NaN.

        Optional: :meth:`step` unscales by itself. Call it to work on true gradients before
        :meth:`step` (clipping, inspection). First calls ``optimizer.prepare_grads()`` if the
        optimizer has it (see the class docstring). With ``process_group`` the overflow flag is
        all-reduced (a collective that every rank must reach). No host sync.

        Raises:
            RuntimeError: if called twice for ``optimizer`` before :meth:`update`, or after
                :meth:`step`, or before :meth:`scale`.
            ValueError: if a gradient is float16 (the optimizer would step on float16 weights).
            TypeError: if ``optimizer`` is not an optimizer.

        .. warning:: sparse float16 gradients are coalesced, replacing ``param.grad``.
        """
        if not self._enabled:
            return
        _check_optimizer(optimizer, "unscale_")
        state = self._require_state("unscale_")
        optimizer_state = self._per_optimizer_states[id(optimizer)]
        if optimizer_state.stage is Stage.UNSCALED:
            raise RuntimeError(
                "unscale_() has already been called on this optimizer since the last update()."
            )
        if optimizer_state.stage is Stage.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        optimizer_state.found_inf_per_device = self._check_and_unscale(optimizer, state.scale, allow_fp16=False)
        optimizer_state.stage = Stage.UNSCALED
        optimizer_state.optimizer = optimizer
        # Attribute now, before the caller clips: clipping spreads a NaN to every gradient.
        self._attribute(optimizer_state)

    def _check_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[torch.device, torch.Tensor]:
        """Records inf/NaN in the gradients without unscaling them (for fused optimizers)."""
        self._require_state("_check_inf_per_device")
        optimizer_state = self._per_optimizer_states[id(optimizer)]
        optimizer_state.found_inf_per_device = self._check_and_unscale(optimizer, None, allow_fp16=True)
        optimizer_state.optimizer = optimizer
        return optimizer_state.found_inf_per_device

    def _found_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[torch.device, torch.Tensor]:
        return self._per_optimizer_states[id(optimizer)].found_inf_per_device

    def _combined_found_inf(self, found_infs: Iterable[torch.Tensor]) -> torch.Tensor:
        device = self._require_state("step").scale.device
        flags = [flag.to(device, non_blocking=True) for flag in found_infs]
        if not flags:
            raise RuntimeError(
                "No inf checks were recorded: call scaler.step(optimizer) (or unscale_) for at "
                "least one optimizer before scaler.update()."
            )
        combined = flags[0]
        for flag in flags[1:]:
            combined = combined + flag
        return combined

    def _optimizer_found_inf(self, optimizer_state: OptimizerState) -> torch.Tensor:
        found = optimizer_state.found_inf_per_device.values()
        if not found:
            raise RuntimeError(
                "No inf checks were recorded for this optimizer: none of its parameters has a "
                "gradient. Call backward() on a (scaled) loss that depends on them before "
                "scaler.step(optimizer), or do not step this optimizer in this iteration."
            )
        return self._combined_found_inf(found)

    # ------------------------------------------------------------------ step

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Unscales (unless :meth:`unscale_` was called) and steps if the gradients are finite.

        ``*args`` and ``**kwargs`` go to ``optimizer.step``; returns what it returns (``None`` on
        a skipped plain step). Sets :attr:`last_step_skipped`.

        * Plain optimizer: one host sync reads the overflow flag; ``optimizer.step()`` is not
          called on an overflow.
        * Fused optimizer (``optimizer._step_supports_amp_scaling``): no host sync; the optimizer
          gets ``optimizer.grad_scale`` and ``optimizer.found_inf`` for the duration of its step
          and skips inside its kernel. An optimizer whose ``step`` takes a ``grad_scaler`` keyword
          gets this scaler instead (deprecated by torch; a ``FutureWarning``).

        Raises:
            RuntimeError: on a ``closure`` keyword, a second :meth:`step` for ``optimizer`` before
                :meth:`update`, before :meth:`scale`, or when none of a plain optimizer's
                parameters has a gradient (a fused one's step is then a no-op, as torch's).
            TypeError: if ``optimizer`` is not an optimizer.
        """
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        _check_optimizer(optimizer, "step")
        state = self._require_state("step")
        optimizer_state = self._per_optimizer_states[id(optimizer)]
        if optimizer_state.stage is Stage.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")

        if self._unscaling.unscale_before_step and optimizer_state.stage is Stage.READY:
            self.unscale_(optimizer)  # per-layer scales: the fused kernels know one scale only
        if getattr(optimizer, "_step_supports_amp_scaling", False):
            if "grad_scaler" in inspect.signature(optimizer.step).parameters:
                warnings.warn(
                    "GradScaler is going to stop passing itself as a keyword argument to the "
                    "passed optimizer. In the near future GradScaler registers `grad_scale: "
                    "Tensor` and `found_inf: Tensor` to the passed optimizer and let the "
                    "optimizer use them directly.",
                    FutureWarning,
                    stacklevel=2,
                )
                kwargs["grad_scaler"] = self
                result = optimizer.step(*args, **kwargs)
                optimizer_state.stage = Stage.STEPPED
                optimizer_state.optimizer = optimizer
                found = optimizer_state.found_inf_per_device.values()
                if found:
                    self._record_skip(optimizer_state, self._combined_found_inf(found))
                return result
            if optimizer_state.stage is Stage.READY:
                self._check_inf_per_device(optimizer)
            found = optimizer_state.found_inf_per_device.values()  # none: no gradient, a no-op step (as torch)
            found_inf = self._combined_found_inf(found) if found else torch.zeros_like(state.scale)
            grad_scale = (
                getattr(optimizer, "grad_scale", None)
                if optimizer_state.stage is Stage.UNSCALED
                else state.scale * getattr(optimizer, "grad_scale", 1)
            )
            with lend_scale(optimizer, grad_scale, found_inf):
                result = optimizer.step(*args, **kwargs)
            optimizer_state.stage = Stage.STEPPED
            if found:
                self._record_skip(optimizer_state, found_inf)
            return result

        if optimizer_state.stage is Stage.READY:
            self.unscale_(optimizer)
        result = self._maybe_opt_step(optimizer, optimizer_state, *args, **kwargs)
        optimizer_state.stage = Stage.STEPPED
        self._record_skip(optimizer_state, self._optimizer_found_inf(optimizer_state))
        return result

    def _maybe_opt_step(
        self, optimizer: torch.optim.Optimizer, optimizer_state: OptimizerState, *args: Any, **kwargs: Any
    ) -> Any:
        """Steps a plain optimizer unless its gradients overflowed (torch's name; one host sync)."""
        if optimizer_state.skipped is None:
            optimizer_state.skipped = bool(self._optimizer_found_inf(optimizer_state).item())
        return None if optimizer_state.skipped else optimizer.step(*args, **kwargs)

    def _record_skip(self, optimizer_state: OptimizerState, found_inf: torch.Tensor) -> None:
        skipped = found_inf != 0
        self._last_step_skipped = skipped
        self._skipped_by_optimizer[id(optimizer_state.optimizer)] = skipped
        self._attribute(optimizer_state)

    def _attribute(self, optimizer_state: OptimizerState) -> None:
        """When watching: reads the overflow flag once (cached) and names the bad parameters."""
        attribution = self._attribution
        if not attribution.watched or attribution.checked or not optimizer_state.found_inf_per_device:
            return
        if optimizer_state.skipped is None:  # documented sync of watch()
            found = self._combined_found_inf(optimizer_state.found_inf_per_device.values())
            optimizer_state.skipped = bool(found.item())
        attribution.record(optimizer_state.skipped)

    def watch(self, model: nn.Module, prefix: str = "") -> GradScaler:
        """Remembers ``model``'s parameter names for :attr:`last_overflow` (weakly; returns self).

        On a skipped step, :attr:`last_overflow` lists ``prefix + name`` for every parameter of a
        watched model whose ``.grad`` holds inf/NaN; on a clean step it is ``()``. Watching is
        not pickled: call it again after unpickling. The overflow is attributed in
        :meth:`unscale_` when it is called (before clipping spreads a NaN to every gradient), else
        in :meth:`step`; on the fused path this costs one host sync per step. Naming the
        parameters costs one more, on skipped steps only. ``model`` may be a ``PipelineStage``
        (with ``per_layer=True``: collective over ``process_group``, see docs/parallelism.md).
        """
        self._attribution.watch(self._unscaling.watch(model, self._group), prefix)
        return self

    # ------------------------------------------------------------------ update

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Updates the scale with the overflows recorded since the last update (or sets it).

        Call once per iteration, after :meth:`step` for every optimizer. With ``new_scale`` the
        scale is set to it instead (a tensor's value is copied and clamped into
        ``[min_scale, max_scale]``, a NaN keeps the current scale; a float must lie in that
        range); with ``per_layer=True`` the cut points' factors are kept and the step's
        per-layer statistics are discarded (the next update measures only its own step). No host
        sync, except: with
        ``min_scale`` set and ``on_min_scale`` ``"raise"`` (or ``"warn"`` until it warned), one
        sync to check for an overflow at ``min_scale``; with ``history``, one sync.

        Raises:
            MinScaleError: (``on_min_scale="raise"``) the gradients overflowed while the scale
                was already at ``min_scale``; the state has been updated before raising.
            RuntimeError: if no :meth:`step`/:meth:`unscale_` was recorded (without ``new_scale``)
                or before :meth:`scale`.
            ValueError, TypeError: on an invalid ``new_scale``.
        """
        if not self._enabled:
            return
        state = self._require_state("update")
        recorded = [
            flag
            for optimizer_state in self._per_optimizer_states.values()
            for flag in optimizer_state.found_inf_per_device.values()
        ]
        found_inf: torch.Tensor | None = None
        blocked = None
        if new_scale is None:
            found_inf = self._combined_found_inf(recorded)  # raises when nothing was recorded
            if self._config.min_scale is not None and (
                self._on_min_scale == "raise" or (self._on_min_scale == "warn" and not self._warned_min_scale)
            ):
                blocked = backoff_blocked(state, found_inf, self._config)
            proposed = update_scale(state, found_inf, self._config)
            # per-layer: an overflow the cut points absorbed keeps the scale
            new_state = self._unscaling.update(
                state, proposed, found_inf, self._group(), self._config, self._read_overflow()
            )
            absorbed = self._unscaling.absorbed  # per-layer: the cut points took the overflow, no backoff due
            blocked = blocked if blocked is None or absorbed is None else blocked & ~absorbed
        else:
            found_inf = self._combined_found_inf(recorded) if recorded else None
            new_state = state._replace(scale=validated_new_scale(new_scale, state.scale, self._config))
            self._unscaling.skip_update()  # per-layer: factors kept, this step's statistics discarded
        used = state.scale.clone()  # the state tensors are updated in place just below
        self._recent_scales.append(used)
        if found_inf is not None and self._skipped_steps is not None:
            self._skipped_steps = self._skipped_steps + (found_inf != 0)
        self._state = persist(state, new_state)
        step = self._step
        self._step += 1

        is_blocked = blocked is not None and bool(blocked.item())  # documented sync
        optimizers = [s.optimizer for s in self._per_optimizer_states.values() if s.optimizer is not None]
        names: tuple[str, ...] | None = None
        if self._history is not None:
            flag = torch.zeros_like(state.scale) if found_inf is None else (found_inf != 0).float()
            skipped_value, scale_value = torch.stack([flag, used]).tolist()  # one sync
            names = self._attribution.names(optimizers) if skipped_value else ()
            self._history(step, scale_value, bool(skipped_value), names)
        if is_blocked and names is None:
            names = self._attribution.names(optimizers)
        self._per_optimizer_states = defaultdict(OptimizerState)
        self._attribution.checked = False
        if is_blocked:
            message = min_scale_message(step, self._config.lower, names or (), self._recent_scales)
            if self._on_min_scale == "raise":
                raise MinScaleError(message)
            self._warned_min_scale = True
            warnings.warn(message, RuntimeWarning, stacklevel=2)

    def _read_overflow(self) -> bool | None:
        """Whether this iteration overflowed, when every optimizer's flag has already been read
        on the host (watching reads it in unscale_ or step), else ``None``. No host sync."""
        read = [s.skipped for s in self._per_optimizer_states.values() if s.found_inf_per_device]
        return None if not read or None in read else any(read)

