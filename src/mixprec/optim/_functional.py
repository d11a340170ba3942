"""Functional AdamW and SGD over lists of tensors, for parameters of any floating dtype.

The arithmetic is torch's single-tensor AdamW/SGD, operation for operation, carried out in the
*compute dtype* ``promote_types(param.dtype, float32)``:

* a float32/float64 parameter with state in its own dtype is updated in place, exactly as
  ``torch.optim`` does;
* a bfloat16/float16 parameter is read into float32 (plus its Kahan buffer, if any), updated
  there, and written back by the ``compensation`` rule: ``None`` rounds to nearest, ``"kahan"``
  keeps the rounding error in the buffer, ``"stochastic"`` rounds stochastically;
* optimizer state in a narrower dtype than the compute dtype is read up, updated, and rounded back.

Gradients are read, never written: no ``.grad`` is used as scratch space. With ``inv_scale``
(a loss scaler's fused protocol) they are unscaled on the fly, in the compute dtype.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from mixprec.optim.kahan import compensated_value, kahan_write_
from mixprec.optim.rounding import stochastic_round_

__all__ = ["adamw", "sgd", "compute_dtype", "COMPENSATIONS"]

#: Accepted values of ``compensation``.
COMPENSATIONS = (None, "kahan", "stochastic")


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype an update of a ``dtype`` parameter is computed in (float32 or wider)."""
    return torch.promote_types(dtype, torch.float32)


def _read(t: Tensor, dtype: torch.dtype) -> Tensor:
    """``t`` itself when already ``dtype`` (updated in place), else a ``dtype`` copy."""
    return t if t.dtype == dtype else t.to(dtype)


def _write_back(state: Tensor, value: Tensor) -> None:
    if value is not state:
        state.copy_(value)


def _param_view(param: Tensor, comp: Optional[Tensor]) -> Tensor:
    """The tensor the update is applied to: ``param`` in place, or its compensated fp32 value."""
    if param.dtype == compute_dtype(param.dtype) and comp is None:
        return param
    return compensated_value(param, comp)  # float32: only low-precision params get here


def _store_param(
    param: Tensor,
    value: Tensor,
    comp: Optional[Tensor],
    compensation: Optional[str],
    generator: Optional[torch.Generator],
) -> None:
    if value is param:
        return
    if comp is not None:
        kahan_write_(param, comp, value)
    elif compensation == "stochastic":
        stochastic_round_(param, value, generator)
    else:
        param.copy_(value)


class _Unscaler:
    """Divides gradients by the loss scale: ``grad * inv_scale``, one copy of it per device."""

    def __init__(self, inv_scale: Optional[Tensor]) -> None:
        self.inv_scale = inv_scale
        self.per_device: dict[torch.device, Tensor] = {}

    def __call__(self, grad: Tensor) -> Tensor:
        if self.inv_scale is None:
            return grad
        inv = self.per_device.get(grad.device)
        if inv is None:
            inv = self.inv_scale.to(grad.device, non_blocking=True)
            self.per_device[grad.device] = inv
        return grad * inv


def _check_grad(grad: Tensor) -> None:
    if grad.is_sparse:
        raise RuntimeError("mixprec.optim does not support sparse gradients; use torch.optim.SparseAdam")
    if grad.is_complex():
        raise RuntimeError("mixprec.optim does not support complex parameters; use torch.optim")


def _step_grad(grad: Tensor, cdtype: torch.dtype, unscale: "_Unscaler", maximize: bool) -> Tensor:
    """The gradient a step uses: checked, read in the compute dtype, unscaled, negated to maximize."""
    _check_grad(grad)
    grad = unscale(_read(grad, cdtype))
    return -grad if maximize else grad


def adamw(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    max_exp_avg_sqs: list[Optional[Tensor]],
    state_steps: list[Tensor],
    kahan_comps: list[Optional[Tensor]],
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
    """One AdamW step (decoupled weight decay) over lists of tensors, in place.

    Args:
        params: parameters, any floating dtype; updated in place.
        grads: their gradients (read only), any floating dtype.
        exp_avgs, exp_avg_sqs: first and second moments, any floating dtype.
        max_exp_avg_sqs: running maxima of the second moment (entries may be ``None`` unless
            ``amsgrad``).
        state_steps: scalar float32 step counters on the CPU, incremented in place (read with
            ``.item()``: no device sync, as in torch's non-capturable path).
        kahan_comps: compensation buffers (param dtype) or ``None`` per parameter. A parameter
            with a buffer is written Kahan-compensated whatever ``compensation`` says.
        compensation: ``"stochastic"`` rounds parameters without a buffer stochastically;
            otherwise they are rounded to nearest.
        generator: randomness for stochastic rounding (on the parameters' device).
        inv_scale: if given, a float32 scalar tensor the gradients are multiplied by first
            (``1 / loss_scale``).
    """
    unscale = _Unscaler(inv_scale)
    for i, param in enumerate(params):
        cdtype = compute_dtype(param.dtype)
        grad = _step_grad(grads[i], cdtype, unscale, maximize)
        exp_avg = _read(exp_avgs[i], cdtype)
        exp_avg_sq = _read(exp_avg_sqs[i], cdtype)
        comp = kahan_comps[i]
        value = _param_view(param, comp)
        step_t = state_steps[i]

        step_t += 1
        if weight_decay != 0:
            value.mul_(1 - lr * weight_decay)
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)

        step = step_t.item()
        bias_correction1 = 1 - beta1**step
        bias_correction2 = 1 - beta2**step
        step_size = lr / bias_correction1
        bias_correction2_sqrt = bias_correction2**0.5
        if amsgrad:
            max_state = max_exp_avg_sqs[i]
            if max_state is None:
                raise ValueError("amsgrad=True needs a max_exp_avg_sq state for every parameter")
            max_exp_avg_sq = _read(max_state, cdtype)
            torch.maximum(max_exp_avg_sq, exp_avg_sq, out=max_exp_avg_sq)
            denom = (max_exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
            _write_back(max_state, max_exp_avg_sq)
        else:
            denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
        value.addcdiv_(exp_avg, denom, value=-step_size)

        _write_back(exp_avgs[i], exp_avg)
        _write_back(exp_avg_sqs[i], exp_avg_sq)
        _store_param(param, value, comp, compensation, generator)


def sgd(
    params: list[Tensor],
    grads: list[Tensor],
    momentum_buffers: list[Optional[Tensor]],
    kahan_comps: list[Optional[Tensor]],
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
    """One SGD step over lists of tensors, in place.

    ``momentum_buffers[i]`` is ``None`` until the first step with ``momentum != 0``; this function
    then creates it (in ``state_dtype``, default the compute dtype) and stores it in the list, as
    torch does. Other arguments as in :func:`adamw`.
    """
    unscale = _Unscaler(inv_scale)
    for i, param in enumerate(params):
        cdtype = compute_dtype(param.dtype)
        grad = _step_grad(grads[i], cdtype, unscale, maximize)
        comp = kahan_comps[i]
        value = _param_view(param, comp)

        if weight_decay != 0:
            grad = grad.add(value, alpha=weight_decay)
        if momentum != 0:
            stored = momentum_buffers[i]
            if stored is None:
                buf = grad.detach().clone()
                momentum_buffers[i] = buf.to(state_dtype or cdtype)
            else:
                buf = _read(stored, cdtype)
                buf.mul_(momentum).add_(grad, alpha=1 - dampening)
                _write_back(stored, buf)
            grad = grad.add(buf, alpha=momentum) if nesterov else buf
        value.add_(grad, alpha=-lr)

        _store_param(param, value, comp, compensation, generator)
