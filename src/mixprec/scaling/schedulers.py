"""``skip_aware``: learning-rate schedulers that do not advance on skipped optimizer steps."""

from __future__ import annotations

from typing import Any

from torch.optim.lr_scheduler import LRScheduler

from mixprec.scaling.grad_scaler import GradScaler

__all__ = ["skip_aware", "SkipAwareScheduler"]

_OWN = ("scheduler", "scaler")


class SkipAwareScheduler(LRScheduler):
    """Wraps an LR scheduler; :meth:`step` does nothing when the scaler skipped the last step.

    A ``torch.optim.lr_scheduler.LRScheduler`` (frameworks that check the type take it) whose
    every method and attribute (``get_last_lr``, ``state_dict``, ``last_epoch``, ``optimizer``,
    ...) is the wrapped scheduler's; ``LRScheduler.__init__`` is not called, so wrapping changes
    nothing in the scheduler or its optimizer. Because a skipped iteration never reaches
    ``scheduler.step()``, PyTorch's "Detected call of `lr_scheduler.step()` before
    `optimizer.step()`" warning cannot appear. It is not an instance of the wrapped class (a
    framework that tests for ``ReduceLROnPlateau`` to pass a metric will not see one).
    """

    def __init__(self, scheduler: Any, scaler: GradScaler) -> None:
        object.__setattr__(self, "scheduler", scheduler)
        object.__setattr__(self, "scaler", scaler)

    def step(self, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        """Advances the scheduler unless the scaler skipped its optimizer's last step.

        Reads the skip flag of the scheduler's optimizer (or the scaler's
        ``last_step_skipped``): one host sync when the scaler is enabled.
        """
        if self.scaler.is_enabled():
            optimizer = getattr(self.scheduler, "optimizer", None)
            skipped = self.scaler.last_step_skipped if optimizer is None else self.scaler.skipped_for(optimizer)
            if bool(skipped):
                return
        self.scheduler.step(*args, **kwargs)

    def get_last_lr(self) -> list[float]:
        """The wrapped scheduler's ``get_last_lr()``."""
        return self.scheduler.get_last_lr()

    def get_lr(self) -> Any:
        """The wrapped scheduler's ``get_lr()``."""
        return self.scheduler.get_lr()

    def state_dict(self) -> dict[str, Any]:
        """The wrapped scheduler's ``state_dict()`` (wrapping adds nothing to save)."""
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The wrapped scheduler's ``load_state_dict()``."""
        self.scheduler.load_state_dict(state_dict)

    def __getattr__(self, name: str) -> Any:
        if name in _OWN:  # not set yet (e.g. during unpickling)
            raise AttributeError(name)
        return getattr(self.scheduler, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _OWN:
            object.__setattr__(self, name, value)
        else:
            setattr(self.scheduler, name, value)


def skip_aware(scheduler: Any, scaler: GradScaler) -> SkipAwareScheduler:
    """Returns ``scheduler`` wrapped so that it does not advance on steps ``scaler`` skipped.

    Example:
        >>> sched = mixprec.skip_aware(torch.optim.lr_scheduler.StepLR(opt, 10), scaler)
        >>> scaler.step(opt); scaler.update(); sched.step()   # no step when skipped

    Raises:
        TypeError: if ``scheduler`` has no ``step`` method.
    """
    if not callable(getattr(scheduler, "step", None)):
        raise TypeError(
            f"skip_aware expects an LR scheduler with a step() method, got {type(scheduler).__name__}."
        )
    return SkipAwareScheduler(scheduler, scaler)
