"""Multi-tensor (``foreach``) AdamW and SGD: :mod:`mixprec.optim._functional`'s arithmetic on lists.

Each element-wise step runs as one ``torch._foreach_*`` call over all parameters of a group
(one fused kernel launch per op on CUDA, one C++ loop without Python overhead on the CPU), in
the same order and with the same scalars as the per-tensor path, so the two are bitwise equal.
Reading low-precision parameters and gradients into float32 and writing parameters back by
nearest rounding, Kahan or exact low bits are foreach ops too (dtype-converting copies, mixed
dtype adds, int32/int16 arithmetic). What draws random numbers (stochastic rounding of
parameters or of bf16/fp16 state) or quantizes 8-bit state is written back per tensor, through
the per-tensor path's helpers, one parameter after the other in list order: the random draws
are the same too.

Costs one float32 temporary per parameter for the denominator, as ``torch.optim``'s foreach
path, besides the float32 working copies that the per-tensor path makes one at a time (on the
CPU both walk :mod:`~mixprec.optim._chunks`, so these stay cache-sized). ``fused=True`` replaces
the element-wise update by torch's fused AdamW/SGD kernel on the same working copies, after
mixprec's C++ kernel (:mod:`~mixprec.optim._fused`) has stepped the low-precision CPU parameters
it takes in one pass. Under ``torch.compile`` the step is traced whole, with the step counters
as tensors (:func:`mixprec.optim._copies._adamw_update`).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from mixprec.optim._copies import adamw_copies, pick, sgd_copies
from mixprec.optim._functional import State, check_grads, new_momentum_buffers
from mixprec.optim._fused import adamw_native, sgd_native

__all__ = ["adamw_foreach", "sgd_foreach"]


def adamw_foreach(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[State],
    exp_avg_sqs: list[State],
    max_exp_avg_sqs: list[Optional[State]],
    state_steps: list[Tensor],
    comps: list[Optional[Tensor]],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    amsgrad: bool,
    maximize: bool,
    compensation: Optional[str] = None,
    generator: Optional[torch.Generator] = None,
    inv_scale: Optional[Tensor] = None,
    fused: bool = False,
) -> None:
    """:func:`mixprec.optim._functional.adamw`, multi-tensor; same arguments, same results.

    ``fused=True`` runs the update itself (weight decay, moments, step) as torch's fused AdamW
    kernel (``torch._fused_adamw_``, one pass; on the CPU 4x faster than the foreach ops) on the
    same float32 working copies: results are then bitwise ``torch.optim.AdamW(fused=True)``'s,
    which differ from the foreach/for-loop arithmetic in the last bit.
    """
    if amsgrad and any(s is None for s in max_exp_avg_sqs):
        raise ValueError("amsgrad=True needs a max_exp_avg_sq state for every parameter")
    check_grads(grads)
    stored = [exp_avgs, exp_avg_sqs] + ([max_exp_avg_sqs] if amsgrad else [])
    torch._foreach_add_(state_steps, 1)
    if fused:  # mixprec's one-pass kernel for the parameters it takes, the rest as below
        rest = adamw_native(params, grads, stored, comps, state_steps, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                            weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize,
                            compensation=compensation, inv_scale=inv_scale, generator=generator)
        if len(rest) < len(params):
            params, grads, comps, state_steps = (pick(lst, rest) for lst in (params, grads, comps, state_steps))
            stored = [pick(lst, rest) for lst in stored]
            if not rest:
                return
    adamw_copies(params, grads, stored, comps, state_steps, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                 weight_decay=weight_decay, maximize=maximize, compensation=compensation, generator=generator,
                 inv_scale=inv_scale, fused=fused)


def sgd_foreach(
    params: list[Tensor],
    grads: list[Tensor],
    momentum_buffers: list[Optional[Tensor]],
    comps: list[Optional[Tensor]],
    *,
    lr: float,
    momentum: float,
    dampening: float,
    weight_decay: float,
    nesterov: bool,
    maximize: bool,
    compensation: Optional[str] = None,
    generator: Optional[torch.Generator] = None,
    state_dtype: Optional[torch.dtype] = None,
    inv_scale: Optional[Tensor] = None,
    fused: bool = False,
) -> None:
    """:func:`mixprec.optim._functional.sgd`, multi-tensor; same arguments, same results.

    ``fused=True``: the update runs as torch's fused SGD kernel (``torch._fused_sgd_``) on the
    float32 working copies, as :func:`adamw_foreach` does.
    """
    check_grads(grads)
    fresh = new_momentum_buffers(momentum_buffers, params, state_dtype) if momentum != 0 else []
    if fused:
        rest = sgd_native(params, grads, momentum_buffers, fresh, comps, lr=lr, momentum=momentum,
                          dampening=dampening, weight_decay=weight_decay, nesterov=nesterov,
                          maximize=maximize, compensation=compensation, inv_scale=inv_scale,
                          generator=generator)
        if len(rest) < len(params):  # the rest on lists that share the momentum buffers' objects
            params, grads, comps = (pick(lst, rest) for lst in (params, grads, comps))
            if momentum != 0:
                momentum_buffers, fresh = pick(momentum_buffers, rest), pick(fresh, rest)
            if not rest:
                return
    sgd_copies(params, grads, momentum_buffers, fresh, comps, lr=lr, momentum=momentum, dampening=dampening,
               weight_decay=weight_decay, nesterov=nesterov, maximize=maximize, compensation=compensation,
               generator=generator, inv_scale=inv_scale, fused=fused)
