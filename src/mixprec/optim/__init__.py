"""Optimizers that train low-precision (bfloat16/float16) parameters like float32 ones.

``AdamW`` and ``SGD`` take torch's hyper-parameters and defaults (``foreach`` included) plus
``compensation="auto" | None | "exact" | "kahan" | "stochastic"`` (``"auto"``, the default:
exact for bfloat16, Kahan for float16 parameters; ``None``: round to nearest), ``state_dtype``
(a float dtype, or ``"8bit"`` for AdamW) and ``generator``; ``torch_state_dict()`` is a
checkpoint ``torch.optim`` loads. The functional updates are in
:mod:`mixprec.optim._functional` (per tensor), :mod:`mixprec.optim._foreach` (multi-tensor,
bitwise the same; ``fused=True``) and :mod:`mixprec.optim._fused` (the one-pass C++ kernel that
steps low-precision CPU parameters by default); :func:`stochastic_round_` is public.

Example:
    >>> import torch, mixprec
    >>> model = mixprec.to_low_precision(torch.nn.Linear(8, 8))
    >>> opt = mixprec.optim.AdamW(model.parameters(), lr=1e-4)  # compensation="exact" here
"""

from mixprec.optim.adamw import AdamW
from mixprec.optim.rounding import stochastic_round_
from mixprec.optim.sgd import SGD

__all__ = ["AdamW", "SGD", "stochastic_round_"]
