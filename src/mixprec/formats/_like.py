"""Linear-like layers: ``nn.Linear`` and the Linear-equivalents of common models that the fp8
path handles, without importing their libraries.

* ``transformers.pytorch_utils.Conv1D`` (GPT-2, OpenAI GPT, ImageGPT, Decision Transformer,
  CLVP): a Linear whose weight is stored ``(in, out)``; its forward is
  ``addmm(bias, x, weight)``. In fp8 it runs ``fp8.linear(x, weight.t(), bias)``: bitwise
  torchao's emulated ``Float8Linear`` on the ``nn.Linear`` with the weight transposed.

Under a policy a layer's GEMM is found by the op its forward calls (``routed_call``); a selected
layer whose forward calls neither (an ``nn.Linear`` subclass computing ``x @ weight.T``, as
transformers' ``FalconLinear``) is reported once per class (``warn_unrouted``) instead of running
in the compute dtype unnoticed.
"""

from __future__ import annotations

import sys
import warnings
from typing import Any

import torch
from torch import nn

from mixprec.formats._state import layer_state

__all__ = ["LINEAR_LIKE", "conv1d_class", "features", "is_linear_like", "linear_params", "routed_call",
           "unroutable", "warn_unrouted"]

#: what the rules call a Linear-like layer, for messages.
LINEAR_LIKE = "nn.Linear or Linear-equivalent (transformers Conv1D)"


def conv1d_class() -> type | None:
    """transformers' ``Conv1D`` if transformers is imported (a model holding one has imported it)."""
    module = sys.modules.get("transformers.pytorch_utils")
    return getattr(module, "Conv1D", None)


def _is_conv1d(module: nn.Module) -> bool:
    cls = conv1d_class()
    return cls is not None and isinstance(module, cls)


def is_linear_like(module: nn.Module) -> bool:
    """Whether ``module`` is an ``nn.Linear`` or a Linear-equivalent the fp8 path handles.

    Example:
        >>> is_linear_like(nn.Linear(4, 4)), is_linear_like(nn.Conv1d(4, 4, 1))
        (True, False)
    """
    return isinstance(module, nn.Linear) or _is_conv1d(module)


def features(module: nn.Module) -> tuple[int, int]:
    """``(in_features, out_features)`` of a Linear-like layer."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    return module.nx, module.nf


def linear_params(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(weight as (out, in), bias)`` of a Linear-like layer: the arguments of ``F.linear``."""
    if isinstance(module, nn.Linear):
        return module.weight, module.bias
    return module.weight.t(), module.bias


def unroutable(module: nn.Module) -> str | None:
    """Why a Linear-like ``module`` cannot run in fp8 although its shape fits, or None: the
    ``out_proj`` of ``nn.MultiheadAttention``, whose weight the attention passes to its fused
    function without calling the module."""
    if isinstance(module, nn.modules.linear.NonDynamicallyQuantizableLinear):
        return "nn.MultiheadAttention's out_proj (the attention uses its weight without calling it)"
    return None


def routed_call(op: str, module: nn.Module, args: tuple, kwargs: dict[str, Any]
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
    """``(input, weight as (out, in), bias)`` when the ``op`` call ``op(*args, **kwargs)`` is the
    GEMM of the Linear-like ``module`` (its ``linear``, or Conv1D's ``addmm``), else None; a
    match marks the module's layer state as routed (see :func:`warn_unrouted`)."""
    weight = getattr(module, "weight", None)
    if op == "linear" and len(args) > 1 and args[1] is weight:
        call = args[0], args[1], args[2] if len(args) > 2 else kwargs.get("bias")
    elif (op == "addmm" and len(args) > 2 and args[2] is weight and _is_conv1d(module)
            and kwargs.get("beta", 1) == 1 and kwargs.get("alpha", 1) == 1):
        call = args[1], args[2].t(), args[0]
    else:
        return None
    layer_state(module).routed = True
    return call


_UNROUTED: set[type] = set()


def warn_unrouted(module: nn.Module) -> None:
    """Warn once per class that a selected ``module`` ran in the compute dtype: its forward
    called neither ``F.linear`` on its weight nor (Conv1D) ``addmm``."""
    cls = type(module)
    if cls in _UNROUTED:
        return
    _UNROUTED.add(cls)
    warnings.warn(f"fp8: a selected {cls.__module__}.{cls.__qualname__} layer ran in the compute dtype, "
                  f"not in fp8: its forward calls neither F.linear on its weight (as nn.Linear) nor addmm "
                  f"(as transformers' Conv1D). Leave such layers out (Policy.fp8 names=...) or make their "
                  f"forward call F.linear(x, self.weight, self.bias)", stacklevel=4)
