"""Which parameters overflowed: :class:`mixprec.GradScaler`'s attribution and failure report.

The scaler decides *whether* a step overflowed with one device flag; this module answers *which*
parameters did, only when asked (a skipped step while watching, a ``history`` callback, an
overflow at ``min_scale``), and writes the :class:`MinScaleError` message.
"""

from __future__ import annotations

import weakref
from typing import Any, Iterable, Sequence

import torch
from torch import nn

__all__ = ["Attribution", "MinScaleError", "local", "min_scale_message", "nonfinite_names"]


class MinScaleError(RuntimeError):
    """Gradients overflowed while the loss scale was already at ``min_scale``."""


def local(tensor: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (the same storage), or the tensor itself."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def _values(grad: torch.Tensor) -> torch.Tensor:
    return grad._values() if grad.is_sparse else local(grad)


def nonfinite_names(named_grads: Sequence[tuple[str, torch.Tensor]]) -> tuple[str, ...]:
    """The names whose gradient holds inf/NaN, in order. One host sync.

    The flags are stacked on the first gradient's device (device-to-device copies are ordered
    with the kernels that compute them) and read back by one blocking ``tolist()``; copying them
    to pinned host memory with ``non_blocking=True`` and reading that would race the kernels.
    """
    if not named_grads:
        return ()
    device = named_grads[0][1].device
    flags = [(~torch.isfinite(grad).all()).to(device, non_blocking=True) for _, grad in named_grads]
    bad = torch.stack(flags).tolist()
    return tuple(name for (name, _), is_bad in zip(named_grads, bad) if is_bad)


def _optimizer_grads(optimizers: Iterable[Any]) -> list[tuple[str, torch.Tensor]]:
    """Gradients labelled by position: ``optimizer0.param_groups[0]['params'][1] (4, 4)``."""
    named = []
    for index, optimizer in enumerate(optimizers):
        for g, param_group in enumerate(optimizer.param_groups):
            for p, param in enumerate(param_group["params"]):
                if param.grad is not None:
                    label = f"optimizer{index}.param_groups[{g}]['params'][{p}] {tuple(param.shape)}"
                    named.append((label, _values(param.grad)))
    return named


class Attribution:
    """The watched models (weakly) and the names found on the last skipped step.

    ``last_overflow`` is ``None`` until a model is watched, then ``()`` after a clean step and the
    names after a skipped one. ``checked`` says the names of this iteration were already found.
    """

    def __init__(self) -> None:
        self.watched: list[tuple[str, weakref.ref[nn.Module]]] = []
        self.last_overflow: tuple[str, ...] | None = None
        self.checked = False

    def watch(self, model: nn.Module, prefix: str) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"watch() expects an nn.Module, got {type(model).__name__}.")
        if not any(p == prefix and ref() is model for p, ref in self.watched):
            self.watched.append((prefix, weakref.ref(model)))
        if self.last_overflow is None:
            self.last_overflow = ()

    def record(self, skipped: bool) -> None:
        """Notes the iteration's overflow decision (read on the host); names the culprits once."""
        if skipped:
            self.last_overflow = nonfinite_names(self._watched_grads())
            self.checked = True
        else:
            self.last_overflow = ()

    def names(self, optimizers: Iterable[Any]) -> tuple[str, ...]:
        """The parameters with non-finite gradients now: the watched models' names (cached for
        the iteration), else labels by position in ``optimizers``. One host sync, or none if
        cached."""
        if self.checked and self.last_overflow is not None:
            return self.last_overflow
        if self.watched:
            return nonfinite_names(self._watched_grads())
        return nonfinite_names(_optimizer_grads(optimizers))

    def _watched_grads(self) -> list[tuple[str, torch.Tensor]]:
        named = []
        for prefix, ref in self.watched:
            model = ref()
            if model is None:
                continue
            for name, param in model.named_parameters():
                if param.grad is not None:
                    named.append((prefix + name, _values(param.grad)))
        return named

    def __getstate__(self) -> dict[str, Any]:
        return {"watched": [], "last_overflow": None, "checked": False}  # weak references do not pickle


def min_scale_message(step: int, min_scale: float, names: tuple[str, ...], recent: Sequence[torch.Tensor]) -> str:
    """The :class:`MinScaleError` text: step, culprits, recent scales (one host sync), remedies."""
    scales = ", ".join(f"{s:g}" for s in (torch.stack(list(recent)).tolist() if recent else []))
    listed = ", ".join(names[:20]) + (f", ... ({len(names)} in all)" if len(names) > 20 else "")
    return (
        f"Gradients overflowed at step {step} while the loss scale was already at min_scale="
        f"{min_scale:g}, so lowering the scale cannot help. Parameters with "
        f"non-finite gradients: {listed or 'none found (were the gradients zeroed?)'}. Recent "
        f"scales (oldest first): [{scales}]. Try: a lower learning rate or gradient clipping; "
        "keeping the modules of those parameters in float32 (mixprec.Policy.keep); bfloat16 "
        "instead of float16; mixprec.trace_nonfinite(model) to find the first op producing "
        "inf/NaN; or a smaller min_scale. on_min_scale='warn' keeps training (skipping)."
    )
