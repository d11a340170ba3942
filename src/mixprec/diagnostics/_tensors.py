"""Which tensors the diagnostics measure, in one place for the tracer and the range collector."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from mixprec.engine.casts import no_autocast  # the diagnostics' own math: never autocast
from mixprec.scaling.rule import FLOAT32_MAX

__all__ = ["FLOAT32_MAX", "measured", "no_autocast"]


def measured(tree: Any) -> list[torch.Tensor]:
    """The floating tensors (16 bits or wider, non-empty) among the leaves of a container.

    Example:
        >>> [t.dtype for t in measured((torch.ones(2), torch.ones(2).argmax(), {"h": torch.ones(1).half()}))]
        [torch.float32, torch.float16]
    """
    leaves = [tree] if isinstance(tree, torch.Tensor) else tree_leaves(tree)
    return [
        t
        for t in leaves
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.element_size() >= 2 and t.numel() > 0
    ]
