"""Loss scaling: :class:`GradScaler`, its pure update rule, ``skip_aware`` and history writers."""

from mixprec.scaling.grad_scaler import GradScaler, HistoryCallback, MinScaleError
from mixprec.scaling.history import CSVHistory, TensorBoardHistory
from mixprec.scaling.pipeline import ScaledLoss
from mixprec.scaling.rule import ScaleConfig, ScaleState, backoff_blocked, init_state, update_scale
from mixprec.scaling.schedulers import SkipAwareScheduler, skip_aware

__all__ = [
    "CSVHistory",
    "GradScaler",
    "HistoryCallback",
    "MinScaleError",
    "ScaleConfig",
    "ScaleState",
    "ScaledLoss",
    "SkipAwareScheduler",
    "TensorBoardHistory",
    "backoff_blocked",
    "init_state",
    "skip_aware",
    "update_scale",
]
