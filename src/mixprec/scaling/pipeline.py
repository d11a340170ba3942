"""Loss scaling under pipeline parallelism (``torch.distributed.pipelining``).

A pipeline schedule calls its ``loss_fn`` on the last stage, once per micro-batch, and runs the
backward from what it returns: the loss is scaled there, by :class:`ScaledLoss`. Every stage
holds a :class:`~mixprec.GradScaler` built with the same arguments and the pipeline's
``process_group``; the stages before the last scale no loss (their gradients arrive from the
next stage carrying the scale) and create their scale in ``unscale_``/``step``. The found-inf
all-reduce over the group makes every stage skip the same steps, so their scales stay equal.

Per-layer scaling (``per_layer=True``) serves a pipeline when every stage's scaler watches its
stage, ``scaler.watch(pipeline_stage)``, with a group holding every stage
(:mod:`mixprec.scaling.layerwise.stages`): each stage's layers then get the factors the unsplit
model's scaler would give them.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

__all__ = ["ScaledLoss"]


class ScaledLoss:
    """``loss_fn`` for a pipeline schedule, scaled by ``scaler``:
    ``ScheduleGPipe(stage, n_microbatches, loss_fn=ScaledLoss(scaler, loss_fn))``.

    Calls ``loss_fn(output, target, **kwargs)`` and returns ``scaler.scale(loss)`` (so the
    schedule's ``losses=`` list holds scaled losses); :attr:`losses` keeps the unscaled ones
    (detached), :meth:`take` hands them over. No host sync.

    Raises TypeError for a ``loss_fn`` that is not callable; at the call, ValueError for a
    per-layer scaler (``per_layer=True``) that does not watch a pipeline stage
    (``scaler.watch(stage)``: its factors would not be the other stages').

    Example:
        >>> scaled = ScaledLoss(mixprec.GradScaler("cpu", process_group=group), F.mse_loss)
        >>> schedule = ScheduleGPipe(stage, 4, loss_fn=scaled)
    """

    def __init__(self, scaler: Any, loss_fn: Callable[..., torch.Tensor]) -> None:
        if not callable(loss_fn):
            raise TypeError(f"ScaledLoss(scaler, loss_fn): loss_fn must be callable, got {type(loss_fn).__name__}")
        self.scaler = scaler
        self.loss_fn = loss_fn
        self.losses: list[torch.Tensor] = []

    def __call__(self, output: Any, target: Any, **kwargs: Any) -> torch.Tensor:
        layerwise = getattr(self.scaler, "_layerwise", None)
        if layerwise is not None and layerwise._stage is None:
            raise ValueError(
                "ScaledLoss: a GradScaler(per_layer=True) in a pipeline must watch this rank's stage, "
                "scaler.watch(pipeline_stage), on every stage and with a process_group holding every stage, so "
                "that the stages agree on the factors and the gradients crossing a stage boundary carry them "
                "(docs/parallelism.md); watching the stage's module alone scales as if it were the whole model."
            )
        loss = self.loss_fn(output, target, **kwargs)
        self.losses.append(loss.detach())
        return self.scaler.scale(loss)

    def take(self) -> list[torch.Tensor]:
        """The unscaled losses since the last call (one per micro-batch), and forget them."""
        losses, self.losses = self.losses, []
        return losses
