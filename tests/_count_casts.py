"""``CountCasts``: a dispatch mode counting the casts (``aten._to_copy``) the ops under it make."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class CountCasts(TorchDispatchMode):
    """``with CountCasts() as c: ...``, then ``c.casts``."""

    def __init__(self) -> None:
        super().__init__()
        self.casts = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.casts += func is torch.ops.aten._to_copy.default
        return func(*args, **(kwargs or {}))
