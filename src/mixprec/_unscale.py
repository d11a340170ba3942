"""Unscaling gradients: the one place that divides by a loss scale.

``torch.amp.GradScaler.unscale_`` takes the reciprocal of the scale in float64 (float32 division
is imprecise on some builds; MPS has no float64), makes one copy of it per device and calls
``torch._amp_foreach_non_finite_check_and_unscale_`` once per (device, dtype) group. Bitwise
parity with it depends on doing exactly that, so every unscale in mixprec (``GradScaler``, its
per-layer strategy, ``MasterWeights``, ``mixprec.optim``) goes through these three names; per-layer
scaling is the same loop with one scale per region (:func:`unscale_`'s ``regions``).
"""

from __future__ import annotations

from collections import defaultdict
from itertools import repeat
from typing import Iterable, Optional, Sequence

import torch
from torch import Tensor

__all__ = ["PerDevice", "inverse_scale", "unscale_"]


def inverse_scale(scale: Tensor) -> Tensor:
    """``1 / scale`` as a float32 tensor on ``scale``'s device, as torch's scaler computes it.

    Example:
        >>> inverse_scale(torch.tensor(65536.0))
        tensor(1.5259e-05)
    """
    if scale.device.type == "mps":  # no float64 there
        return scale.float().reciprocal()
    return scale.double().reciprocal().float()


class PerDevice:
    """Serves one copy of ``tensor`` per device, made on first use (``non_blocking``) and cached.

    Example:
        >>> inv = PerDevice(inverse_scale(scale))
        >>> grad.mul_(inv.get(grad.device))
    """

    def __init__(self, tensor: Tensor) -> None:
        self.master = tensor
        self.copies: dict[torch.device, Tensor] = {}

    def get(self, device: torch.device) -> Tensor:
        copy = self.copies.get(device)
        if copy is None:
            copy = self.master.to(device=device, non_blocking=True, copy=True)
            self.copies[device] = copy
        return copy


def unscale_(
    grads: Iterable[Tensor], scale: Optional[Tensor], regions: Optional[Sequence[int]] = None
) -> dict[torch.device, Tensor]:
    """Divides ``grads`` by ``scale`` in place and returns the overflow flag of each device.

    ``scale`` is a 0-dim float32 tensor (the loss scale); ``None`` only checks for inf/NaN and
    leaves the gradients as they are. With ``regions`` (per-layer scaling: one entry per
    gradient), ``scale`` is a 1-D float32 tensor of the scales the gradients carry, one per
    region, and each gradient is divided by ``scale[regions[i]]``: the reciprocals are taken
    together (:func:`inverse_scale`), copied once per device, and every (device, dtype, region)
    group is one call of torch's kernel. The result maps every device that holds a gradient to a
    0-dim float32 tensor on it: ``1.0`` if a gradient there held inf/NaN, else ``0.0``. A sparse
    gradient's values are unscaled (coalesce a float16 one first: duplicate indices may overflow
    once summed). No host sync.

    Example:
        >>> flags = unscale_([p.grad for p in model.parameters() if p.grad is not None], scale)
        >>> skip = any(bool(f) for f in flags.values())   # reading them is a host sync

    Raises:
        ValueError: ``regions`` without a ``scale``, or not one region per gradient.
    """
    if regions is None:
        grads, regions = list(grads), repeat(0)
    elif scale is None or len(regions) != len(grads := list(grads)):
        raise ValueError("unscale_(grads, scale, regions) needs a scale per region and one region per gradient")
    groups: dict[tuple[torch.device, torch.dtype, int], list[Tensor]] = defaultdict(list)
    for grad, region in zip(grads, regions):
        if grad.is_sparse:
            grad = grad._values()
        groups[grad.device, grad.dtype, region].append(grad)
    if not groups:
        return {}
    anchor = next(iter(groups))[0] if scale is None else scale.device
    inv = torch.ones((), dtype=torch.float32, device=anchor) if scale is None else inverse_scale(scale)
    per_device_inv = PerDevice(inv.reshape(-1))
    per_device_found_inf = PerDevice(torch.zeros((), dtype=torch.float32, device=anchor))
    with torch.no_grad():
        for (device, _, region), tensors in groups.items():
            torch._amp_foreach_non_finite_check_and_unscale_(
                tensors, per_device_found_inf.get(device), per_device_inv.get(device)[region]
            )
    return per_device_found_inf.copies
