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
path, besides the float32 working copies that the per-tensor path makes one at a time.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from mixprec.optim._functional import (
    State,
    Unscaler,
    check_grad,
    compute_dtype,
    read_state,
    write_back,
    write_state,
)

__all__ = ["adamw_foreach", "sgd_foreach"]

_NARROW = (torch.bfloat16, torch.float16)


def _pick(items: list, index: list[int]) -> list:
    return [items[i] for i in index]


def _to_compute(tensors: list[Tensor], cdtypes: list[torch.dtype]) -> list[Tensor]:
    """Each tensor itself if already in its compute dtype, else a converted copy (one foreach copy)."""
    out = [t if t.dtype == c else torch.empty_like(t, dtype=c) for t, c in zip(tensors, cdtypes)]
    copied = [i for i, (t, o) in enumerate(zip(tensors, out)) if o is not t]
    if copied:
        torch._foreach_copy_(_pick(out, copied), _pick(tensors, copied))
    return out


def _grads(
    grads: list[Tensor], cdtypes: list[torch.dtype], inv_scale: Optional[Tensor], maximize: bool
) -> list[Tensor]:
    """:func:`~mixprec.optim._functional.step_grad` on a list (never writes ``grads``)."""
    for g in grads:
        check_grad(g)
    out = _to_compute(grads, cdtypes)
    if inv_scale is not None:
        unscale = Unscaler(inv_scale)
        out = [unscale(g) for g in out]
    return torch._foreach_neg(out) if maximize else out


def _load_params(params: list[Tensor], comps: list[Optional[Tensor]], cdtypes: list[torch.dtype]) -> list[Tensor]:
    """:func:`~mixprec.optim._functional.load_param` on a list."""
    values = _to_compute(params, cdtypes)
    exact = [i for i, c in enumerate(comps) if c is not None and c.dtype == torch.int16]
    kahan = [i for i, c in enumerate(comps) if c is not None and c.dtype != torch.int16]
    if exact:
        torch._foreach_add_([values[i].view(torch.int32) for i in exact], _pick(comps, exact))
    if kahan:
        torch._foreach_add_(_pick(values, kahan), _pick(comps, kahan))
    return values


def _store_params(params: list[Tensor], values: list[Tensor], comps: list[Optional[Tensor]]) -> None:
    """:func:`~mixprec.optim._functional.store_param` on a list, for every rule but stochastic
    rounding (exact and Kahan as in :mod:`~mixprec.optim.exact` and :mod:`~mixprec.optim.kahan`)."""
    written = [i for i, (p, v) in enumerate(zip(params, values)) if v is not p]
    exact = [i for i in written if comps[i] is not None and comps[i].dtype == torch.int16]
    kahan = [i for i in written if comps[i] is not None and comps[i].dtype != torch.int16]
    nearest = [i for i in written if comps[i] is None]
    if exact:
        bits, low = [values[i].view(torch.int32) for i in exact], _pick(comps, exact)
        torch._foreach_copy_(low, bits)
        torch._foreach_sub_(bits, low)
        torch._foreach_copy_(_pick(params, exact), _pick(values, exact))
    if kahan:
        p, v = _pick(params, kahan), _pick(values, kahan)
        torch._foreach_copy_(p, v)
        torch._foreach_sub_(v, p)
        torch._foreach_copy_(_pick(comps, kahan), v)
    if nearest:
        torch._foreach_copy_(_pick(params, nearest), _pick(values, nearest))


def _draws(compensation: Optional[str], states: list[list[Optional[State]]]) -> bool:
    """Whether writing back draws random numbers (stochastic parameters or narrow float state)."""
    return compensation == "stochastic" or any(
        isinstance(s, Tensor) and s.dtype in _NARROW for lst in states for s in lst
    )


def _write_back_all(
    params: list[Tensor],
    values: list[Tensor],
    comps: list[Optional[Tensor]],
    states: list[tuple[list[Optional[State]], list[Optional[Tensor]]]],
    compensation: Optional[str],
    generator: Optional[torch.Generator],
) -> None:
    """Write back every parameter's ``(stored, computed)`` states, then the parameters: per tensor
    in list order when random numbers are drawn (the per-tensor path's order), else foreach."""
    if _draws(compensation, [stored for stored, _ in states]):
        for i, param in enumerate(params):
            pairs = [(stored[i], computed[i]) for stored, computed in states]
            write_back(param, values[i], comps[i], pairs, compensation, generator)
        return
    for stored, computed in states:
        for s, c in zip(stored, computed):
            if s is not None:
                write_state(s, c, generator)  # type: ignore[arg-type]  # 8-bit, or a wider copy
    _store_params(params, values, comps)



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
    cdtypes = [compute_dtype(p.dtype) for p in params]
    grads_c = _grads(grads, cdtypes, inv_scale, maximize)
    exp_avgs_c = [read_state(s, c) for s, c in zip(exp_avgs, cdtypes)]
    exp_avg_sqs_c = [read_state(s, c) for s, c in zip(exp_avg_sqs, cdtypes)]
    values = _load_params(params, comps, cdtypes)

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

    states = [(exp_avgs, exp_avgs_c), (exp_avg_sqs, exp_avg_sqs_c)]
    if amsgrad:
        states.append((max_exp_avg_sqs, maxes_c))
    _write_back_all(params, values, comps, states, compensation, generator)  # type: ignore[arg-type]


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
    cdtypes = [compute_dtype(p.dtype) for p in params]
    grads_c = _grads(grads, cdtypes, inv_scale, maximize)
    values = _load_params(params, comps, cdtypes)

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
    stored = [momentum_buffers[i] if i in written else None for i in range(len(params))]
    computed = [bufs[i] if i in written else None for i in range(len(params))]
    _write_back_all(params, values, comps, [(stored, computed)], compensation, generator)
