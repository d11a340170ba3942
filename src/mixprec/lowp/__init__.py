"""Low-precision weights: cast a model to bf16/fp16 and train it with fp32 master weights.

* :func:`to_low_precision`: cast parameters and buffers in place, keeping chosen modules fp32.
* :class:`MasterWeights`: float32 master copies around any ``torch.optim`` optimizer.
* :func:`memory_bytes`: measure what params, grads, masters and optimizer state hold.

Pure low-precision optimizers (Kahan summation, stochastic rounding) are in :mod:`mixprec.optim`.

Example:
    >>> import torch
    >>> model = to_low_precision(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8)))
    >>> opt = MasterWeights(torch.optim.AdamW(model.parameters(), lr=1e-4))
"""

from mixprec.lowp.cast import to_low_precision
from mixprec.lowp.master import MasterWeights
from mixprec.lowp.memory import memory_bytes

__all__ = ["MasterWeights", "memory_bytes", "to_low_precision"]
