"""``skip_aware``: learning-rate schedulers that do not advance on skipped optimizer steps."""

from __future__ import annotations

from typing import Any

from mixprec.scaling.grad_scaler import GradScaler

__all__ = ["skip_aware", "SkipAwareScheduler"]


class SkipAwareScheduler:
    """Wraps an LR scheduler; :meth:`step` does nothing when the scaler skipped the last step.

    Every other attribute (``get_last_lr``, ``state_dict``, ``last_epoch``, ...) is the wrapped
    scheduler's. Because a skipped iteration never reaches ``scheduler.step()``, PyTorch's
    "Detected call of `lr_scheduler.step()` before `optimizer.step()`" warning cannot appear.
    """

    def __init__(self, scheduler: Any, scaler: GradScaler) -> None:
        self.scheduler = scheduler
        self.scaler = scaler

    def step(self, *args: Any, **kwargs: Any) -> None:
        """Advances the scheduler unless the scaler skipped its optimizer's last step.

        Reads the skip flag of the scheduler's optimizer (or the scaler's
        ``last_step_skipped``): one host sync when the scaler is enabled.
        """
        if self.scaler.is_enabled():
            optimizer = getattr(self.scheduler, "optimizer", None)
            if optimizer is None:
                skipped = self.scaler.last_step_skipped
            else:
                skipped = self.scaler._skipped_for(optimizer)
            if bool(skipped):
                return
        self.scheduler.step(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        if name in ("scheduler", "scaler"):  # not set yet (e.g. during unpickling)
            raise AttributeError(name)
        return getattr(self.scheduler, name)


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


