"""How a :class:`mixprec.GradScaler` unscales: the strategy it holds, global or per-layer.

The scaler owns the loss scale, its rule and the iteration's bookkeeping (stages, skips,
attribution); what scale each gradient carries, and so how it is unscaled, is the strategy's.
:class:`GlobalUnscaling` is the plain one: every gradient carries the loss scale and is divided
by it (:func:`mixprec._unscale.unscale_`, torch's recipe, bit for bit).
:class:`mixprec.scaling.layerwise.Layerwise` (``per_layer=True``) multiplies the gradient by a
power of two at each cut point of a watched model and divides each gradient by its own region's
scale. The scaler asks a strategy, in the order of an iteration:

1. :meth:`~Unscaling.check_ready` then :meth:`~Unscaling.observe` in ``scale(loss)``: whether it
   can serve this step, and what it must know of the step's graph before the backward;
2. :meth:`~Unscaling.unscale` in ``unscale_`` (for ``step``, first when
   :attr:`~Unscaling.unscale_before_step`: fused kernels know one scale only);
3. :meth:`~Unscaling.update` (or :meth:`~Unscaling.skip_update` when the scale is set by hand);
4. :meth:`~Unscaling.state_dict` and :meth:`~Unscaling.load_state_dict` for checkpoints.

None of these costs a host sync unless its docstring says so.
"""

from __future__ import annotations

import warnings
from typing import Any, Mapping, Protocol, Sequence

import torch
from torch import nn

from mixprec._unscale import unscale_
from mixprec.scaling.rule import ScaleConfig, ScaleState

__all__ = ["GlobalUnscaling", "Unscaling", "pipeline_stage"]


def pipeline_stage(obj: Any) -> tuple[torch.nn.Module, int, int] | None:
    """``(module, stage_index, num_stages)`` of a ``torch.distributed.pipelining`` stage
    (``PipelineStage``, or a stage ``pipeline()`` built), else ``None``."""
    try:
        from torch.distributed.pipelining.stage import _PipelineStageBase
    except ImportError:  # torch.distributed unavailable
        return None
    if not isinstance(obj, _PipelineStageBase):
        return None
    return obj.submod, int(obj.stage_index), int(obj.num_stages)


class Unscaling(Protocol):
    """What a :class:`mixprec.GradScaler` asks of its unscaling strategy (see the module docstring).

    Attributes:
        unscale_before_step: ``step`` unscales first, also for a fused optimizer (which would
            otherwise divide by the loss scale inside its kernel).
        names: the cut points, top-down as the scaler reports them (empty: none, or none yet).
        absorbed: after :meth:`update`, a 0-dim bool device tensor: the strategy took the
            iteration's overflow (no loss-scale backoff was due, so none was blocked at
            ``min_scale``); ``None`` when it cannot have.
    """

    unscale_before_step: bool
    names: Sequence[str]
    absorbed: torch.Tensor | None

    def watch(self, model: Any, group: Any = None) -> nn.Module:
        """``scaler.watch(model)``: the model whose gradients this strategy scales, or a pipeline
        stage (its module); ``group``: a callable returning the scaler's process group (or None).
        Returns the module."""

    def check_ready(self) -> None:
        """Raises ``ValueError`` (what to do) when a step cannot be scaled yet; first in ``scale``."""

    def observe(self, outputs: Any, device: torch.device) -> None:
        """``scale(outputs)``, after the scale exists on ``device``: learns what the backward
        from ``outputs`` needs (no host sync)."""

    def stage_device(self, device_type: str) -> torch.device:
        """Where a scaler with a process group that has scaled no loss (a pipeline stage before
        the last) creates its scale: ``device_type``'s current device; raises ``ValueError``
        (what to do) when the strategy needs this rank's own ``scale(loss)``."""

    def unscale(
        self, optimizer: Any, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], scale: torch.Tensor
    ) -> dict[torch.device, torch.Tensor]:
        """Divides ``grads`` (of ``params``, in ``optimizer``) by the scales they carry, in place;
        returns the overflow flag of each device that holds one (0 or 1, float32)."""

    def update(
        self, state: ScaleState, proposed: ScaleState, found_inf: torch.Tensor, group: Any, config: ScaleConfig,
        overflow: bool | None,
    ) -> ScaleState:
        """The loss-scale state after this iteration: ``proposed`` (what the rule gives from
        ``state``), or what the strategy makes of it. ``overflow``: the flag when already read on
        the host, else ``None``; ``group``: the process group to agree over, or ``None``."""

    def skip_update(self) -> None:
        """``update(new_scale=...)``: the iteration ends without the rule."""

    def carried(self, scale: torch.Tensor) -> tuple[torch.Tensor, Mapping[int, int]]:
        """What the gradients of a backward from a loss times ``scale`` carry: per region the
        scale (a device tensor, region 0 the loss scale's) and ``id(parameter) -> region``
        (:class:`mixprec._scaled.Scaled`). After :meth:`observe`; no host sync."""

    def scales(self) -> dict[str, float]:
        """``{cut point: factor}`` (one host sync)."""

    def factors(self) -> torch.Tensor | None:
        """The factors as a new device tensor (no host sync); ``None`` when there are none."""

    def history(self) -> list[dict[str, float]]:
        """:meth:`scales` after each recent update, oldest first."""

    def last_overflow(self) -> tuple[str, ...]:
        """The cut points whose regions overflowed first on the last update."""

    def state_dict(self) -> dict[str, Any]:
        """The entries this strategy adds to the scaler's ``state_dict()`` (one host sync at most)."""

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores from a scaler's whole ``state_dict`` (its own entries, or their absence).

        Raises:
            ValueError: its entries are invalid; nothing has changed then.
        """


class GlobalUnscaling(Unscaling):
    """One loss scale for every gradient: the strategy of a ``GradScaler(per_layer=False)``.

    Stateless. ``unscale`` is :func:`mixprec._unscale.unscale_` (torch's recipe, bit for bit).

    Example:
        >>> grad = torch.tensor([6.0, 1.0])
        >>> GlobalUnscaling().unscale(None, [param], [grad], torch.tensor(2.0)), grad
        ({device(type='cpu'): tensor(0.)}, tensor([3.0000, 0.5000]))
    """

    unscale_before_step = False
    names: Sequence[str] = ()
    absorbed = None

    def watch(self, model: Any, group: Any = None) -> nn.Module:
        """Nothing to watch: the scaler's attribution names the parameters (of a pipeline
        stage's module)."""
        stage = pipeline_stage(model)
        return model if stage is None else stage[0]

    def check_ready(self) -> None:
        """Always ready."""

    def observe(self, outputs: Any, device: torch.device) -> None:
        """Nothing to plan: every gradient carries the loss scale."""

    def stage_device(self, device_type: str) -> torch.device:
        if device_type == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device(device_type)

    def unscale(
        self, optimizer: Any, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], scale: torch.Tensor
    ) -> dict[torch.device, torch.Tensor]:
        """:func:`mixprec._unscale.unscale_` of ``grads`` by ``scale`` (no host sync)."""
        return unscale_(grads, scale)

    def update(
        self, state: ScaleState, proposed: ScaleState, found_inf: torch.Tensor, group: Any, config: ScaleConfig,
        overflow: bool | None,
    ) -> ScaleState:
        """``proposed``: the loss scale's rule decides alone."""
        return proposed

    def skip_update(self) -> None:
        """Nothing kept between iterations."""

    def carried(self, scale: torch.Tensor) -> tuple[torch.Tensor, Mapping[int, int]]:
        """One region, the loss scale's (a copy: the scale tensor is updated in place)."""
        return scale.reshape(1).clone(), {}

    def scales(self) -> dict[str, float]:
        """``{}``: no cut points."""
        return {}

    def factors(self) -> torch.Tensor | None:
        """``None``: no cut points."""
        return None

    def history(self) -> list[dict[str, float]]:
        """``[]``: no cut points."""
        return []

    def last_overflow(self) -> tuple[str, ...]:
        """``()``: no cut points."""
        return ()

    def state_dict(self) -> dict[str, Any]:
        """``{}``: the loss scale's own entries say it all."""
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Takes nothing; warns (``UserWarning``) when the checkpoint holds per-layer state, which
        a global scaler cannot restore."""
        if "layerwise" not in state_dict:
            return
        cuts = list(state_dict["layerwise"].get("cut_points", []))
        warnings.warn(
            f"this checkpoint holds per-layer scaling state (cut points {cuts!r}) that this "
            "GradScaler (per_layer=False) ignores: only the loss scale is restored. To restore "
            f"the factors, build it with GradScaler(..., per_layer=True, cut_points={cuts!r}) "
            "and watch(model) the same model.",
            UserWarning,
            stacklevel=3,
        )
