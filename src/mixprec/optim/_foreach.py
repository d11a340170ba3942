"""Multi-tensor (``foreach``) AdamW and SGD: :mod:`mixprec.optim._functional`'s arithmetic on lists.

Each element-wise step runs as one ``torch._foreach_*`` call over all parameters of a group
(one fused kernel launch per op on CUDA, one C++ loop without Python overhead on the CPU), in
the same order and with the same scalars as the per-tensor path, so the two are bitwise equal.
Reading a low-precision parameter or state into float32 and writing it back (Kahan, exact low
bits, stochastic or 8-bit rounding) stays per tensor, through the helpers the per-tensor path
uses, one parameter after the other in list order: the random draws are the same too.

Costs one float32 temporary per parameter for the denominator, as ``torch.optim``'s foreach
path, besides the float32 working copies that the per-tensor path makes one at a time.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from mixprec.optim._functional import (
    State,
    Unscaler,
    compute_dtype,
    load_param,
    read_state,
    step_grad,
    store_param,
    write_back,
    write_state,
)

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
) -> None:
    """:func:`mixprec.optim._functional.adamw`, multi-tensor; same arguments, same results."""
    if amsgrad and any(s is None for s in max_exp_avg_sqs):
        raise ValueError("amsgrad=True needs a max_exp_avg_sq state for every parameter")
    unscale = Unscaler(inv_scale)
    cdtypes = [compute_dtype(p.dtype) for p in params]
    grads_c = [step_grad(g, c, unscale, maximize) for g, c in zip(grads, cdtypes)]
    exp_avgs_c = [read_state(s, c) for s, c in zip(exp_avgs, cdtypes)]
    exp_avg_sqs_c = [read_state(s, c) for s, c in zip(exp_avg_sqs, cdtypes)]
    values = [load_param(p, c) for p, c in zip(params, comps)]

    torch._foreach_add_(state_steps, 1)
    if weight_decay != 0:
        torch._foreach_mul_(values, 1 - lr * weight_decay)
    torch._foreach_lerp_(exp_avgs_c, grads_c, 1 - beta1)
    torch._foreach_mul_(exp_avg_sqs_c, beta2)
    torch._foreach_addcmul_(exp_avg_sqs_c, grads_c, grads_c, value=1 - beta2)

    steps = [t.item() for t in state_steps]
    step_sizes = [-(lr / (1 - beta1**step)) for step in steps]
    bias_correction2_sqrts = [(1 - beta2**step) ** 0.5 for step in steps]
    if amsgrad:
        maxes_c = [read_state(s, c) for s, c in zip(max_exp_avg_sqs, cdtypes)]  # type: ignore[arg-type]
        torch._foreach_maximum_(maxes_c, exp_avg_sqs_c)
        denoms = torch._foreach_sqrt(maxes_c)
    else:
        denoms = torch._foreach_sqrt(exp_avg_sqs_c)
    torch._foreach_div_(denoms, bias_correction2_sqrts)
    torch._foreach_add_(denoms, eps)
    torch._foreach_addcdiv_(values, exp_avgs_c, denoms, step_sizes)

    for i, param in enumerate(params):
        states = [(exp_avgs[i], exp_avgs_c[i]), (exp_avg_sqs[i], exp_avg_sqs_c[i])]
        if amsgrad:
            states.append((max_exp_avg_sqs[i], maxes_c[i]))
        write_back(param, values[i], comps[i], states, compensation, generator)


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
) -> None:
    """:func:`mixprec.optim._functional.sgd`, multi-tensor; same arguments, same results."""
    unscale = Unscaler(inv_scale)
    cdtypes = [compute_dtype(p.dtype) for p in params]
    grads_c = [step_grad(g, c, unscale, maximize) for g, c in zip(grads, cdtypes)]
    values = [load_param(p, c) for p, c in zip(params, comps)]

    if weight_decay != 0:
        grads_c = torch._foreach_add(grads_c, values, alpha=weight_decay)
    old: list[int] = []  # parameters whose buffer existed before this step
    if momentum != 0:
        bufs = []
        for i, stored in enumerate(momentum_buffers):
            if stored is None:
                buf = grads_c[i].detach().clone()
                momentum_buffers[i] = buf.to(state_dtype or cdtypes[i])
            else:
                buf = read_state(stored, cdtypes[i])
                old.append(i)
            bufs.append(buf)
        if old:
            torch._foreach_mul_([bufs[i] for i in old], momentum)
            torch._foreach_add_([bufs[i] for i in old], [grads_c[i] for i in old], alpha=1 - dampening)
        grads_c = torch._foreach_add(grads_c, bufs, alpha=momentum) if nesterov else bufs
    torch._foreach_add_(values, grads_c, alpha=-lr)

    written = set(old)
    for i, param in enumerate(params):
        if i in written:
            write_state(momentum_buffers[i], bufs[i], generator)  # type: ignore[arg-type]
        store_param(param, values[i], comps[i], compensation, generator)
