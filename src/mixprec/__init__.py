"""mixprec: automatic mixed precision for PyTorch.

An autocast engine of our own with editable precision policies, a loss scaler with hysteresis,
bounds and overflow attribution, low-precision weights that train like fp32, and numerics
diagnostics. ``import mixprec`` is cheap: each public name is loaded on first use.

Example:
    >>> import torch, mixprec
    >>> model = torch.nn.Linear(8, 8)
    >>> with mixprec.autocast("cpu", dtype=torch.bfloat16):
    ...     y = model(torch.randn(2, 8))
    >>> y.dtype
    torch.bfloat16
"""

import importlib as _importlib
import typing as _typing

from mixprec import _moved

_moved.install()  # old import paths of moved modules (pickles, checkpoints): aliases for one release

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    # autocast (issue: foundation)
    "autocast": "mixprec.engine.region",
    "is_autocast_enabled": "mixprec.engine.region",
    "get_autocast_dtype": "mixprec.engine.region",
    "custom_fwd": "mixprec.engine.region",
    "custom_bwd": "mixprec.engine.region",
    "checkpoint_context_fn": "mixprec.engine.region",
    "DeviceTypeError": "mixprec.engine.region",
    "release_kernels": "mixprec.engine.kernels",
    "Policy": "mixprec.policy",
    "ModuleRule": "mixprec._modules",
    "Fp8Rule": "mixprec.policy",
    "Controller": "mixprec.fp8",
    "ControllerSettings": "mixprec.fp8",
    # loss scaling
    "GradScaler": "mixprec.scaling",
    "skip_aware": "mixprec.scaling",
    "MinScaleError": "mixprec.scaling",
    # low-precision weights
    "to_low_precision": "mixprec.lowp",
    "MasterWeights": "mixprec.lowp",
    # diagnostics
    "trace_nonfinite": "mixprec.diagnostics",
    "collect_ranges": "mixprec.diagnostics",
    "audit": "mixprec.diagnostics",
    "AuditReport": "mixprec.diagnostics",
    "NonFiniteEvent": "mixprec.diagnostics",
    "NonFiniteError": "mixprec.diagnostics",
}
_SUBMODULES = ("optim", "scaling", "lowp", "diagnostics", "policy", "fp8", "integrations", "export")

__all__ = sorted([*_EXPORTS, "optim"])


def __getattr__(name: str) -> _typing.Any:
    if name in _EXPORTS:
        value = getattr(_importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        return _importlib.import_module(f"mixprec.{name}")
    raise AttributeError(f"module 'mixprec' has no attribute {name!r}")


def __dir__() -> list[str]:
    """The public names (``__all__``, the public submodules, ``__version__``) and the module's
    dunders: not the helpers of this file nor the private modules loaded so far."""
    return sorted({*__all__, *_SUBMODULES, *(n for n in globals() if n.startswith("__") and n.endswith("__"))})


if _typing.TYPE_CHECKING:  # static type checkers see the real names
    from mixprec import optim
    from mixprec._modules import ModuleRule
    from mixprec.engine.kernels import release_kernels
    from mixprec.engine.region import (
        DeviceTypeError,
        autocast,
        checkpoint_context_fn,
        custom_bwd,
        custom_fwd,
        get_autocast_dtype,
        is_autocast_enabled,
    )
    from mixprec.diagnostics import (
        AuditReport,
        NonFiniteError,
        NonFiniteEvent,
        audit,
        collect_ranges,
        trace_nonfinite,
    )
    from mixprec.fp8 import Controller, ControllerSettings
    from mixprec.policy._rule import Fp8Rule
    from mixprec.lowp import MasterWeights, to_low_precision
    from mixprec.policy import Policy
    from mixprec.scaling import GradScaler, MinScaleError, skip_aware
