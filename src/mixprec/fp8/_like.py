"""Linear-like layers: ``nn.Linear`` and the Linear-equivalents of common models that the fp8
path handles, without importing their libraries.

* ``transformers.pytorch_utils.Conv1D`` (GPT-2, OpenAI GPT, ImageGPT, Decision Transformer,
  CLVP): a Linear whose weight is stored ``(in, out)``; its forward is
  ``addmm(bias, x, weight)``. In fp8 it runs ``fp8.linear(x, weight.t(), bias)``: bitwise
  torchao's emulated ``Float8Linear`` on the ``nn.Linear`` with the weight transposed.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn

__all__ = ["LINEAR_LIKE", "conv1d_class", "features", "is_linear_like", "linear_params", "routed_call"]

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


def routed_call(op: str, module: nn.Module, args: tuple, kwargs: dict[str, Any]
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
    """``(input, weight as (out, in), bias)`` when the ``op`` call ``op(*args, **kwargs)`` is the
    GEMM of the Linear-like ``module`` (its ``linear``, or Conv1D's ``addmm``), else None."""
    weight = getattr(module, "weight", None)
    if op == "linear" and len(args) > 1 and args[1] is weight:
        return args[0], args[1], args[2] if len(args) > 2 else kwargs.get("bias")
    if (op == "addmm" and len(args) > 2 and args[2] is weight and _is_conv1d(module)
            and kwargs.get("beta", 1) == 1 and kwargs.get("alpha", 1) == 1):
        return args[1], args[2].t(), args[0]
    return None
