"""Functional AdamW and SGD over lists of tensors, for parameters of any floating dtype.

The arithmetic is torch's single-tensor AdamW/SGD, operation for operation, carried out in the
*compute dtype* ``promote_types(param.dtype, float32)``:

* a float32/float64 parameter with state in its own dtype is updated in place, exactly as
  ``torch.optim`` does;
* a bfloat16/float16 parameter is read into float32 (plus its compensation buffer, if any),
  updated there, and written back by the ``compensation`` rule: ``None`` rounds to nearest,
  ``"kahan"`` keeps the rounding error in a buffer of the parameter's dtype, ``"exact"`` keeps
  the float32 value's low 16 bits in an int16 buffer, ``"stochastic"`` rounds stochastically;
* optimizer state in a narrower float dtype than the compute dtype is read up, updated, and
  rounded back *stochastically* (unbiased: rounding to nearest loses the small steady increments
  of a moving average, which under-estimates ``exp_avg_sq`` and over-steps); 8-bit state
  (:class:`~mixprec.optim.quant8.Quantized8`) is dequantized and quantized back.

:mod:`mixprec.optim._foreach` is the multi-tensor version of the same arithmetic, bitwise equal;
both share the per-tensor reads and writes defined here, in the same order (so the random draws
of stochastic rounding are the same too).

Gradients are read, never written: no ``.grad`` is used as scratch space. With ``inv_scale``
(a loss scaler's fused protocol) they are unscaled on the fly, in the compute dtype.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional, Union

import torch
from torch import Tensor

from mixprec._unscale import PerDevice
from mixprec.optim._chunks import part, plan
from mixprec.optim.exact import exact_value, exact_write_
from mixprec.optim.kahan import compensated_value, kahan_write_
from mixprec.optim.quant8 import Quantized8
from mixprec.optim.rounding import stochastic_round_

__all__ = ["adamw", "sgd", "compute_dtype", "COMPENSATIONS", "State"]  # and helpers for _foreach

#: Accepted values of ``compensation``.
COMPENSATIONS = (None, "kahan", "exact", "stochastic")

#: An optimizer-state tensor: a plain tensor (any floating dtype) or an 8-bit quantized one.
State = Union[Tensor, Quantized8]

#: The low-precision float dtypes (parameters the optimizers compensate, state rounded stochastically).
NARROW = (torch.bfloat16, torch.float16)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype an update of a ``dtype`` parameter is computed in (float32 or wider)."""
    return torch.promote_types(dtype, torch.float32)


def _read(t: Tensor, dtype: torch.dtype) -> Tensor:
    """``t`` itself when already ``dtype`` (updated in place), else a ``dtype`` copy."""
    return t if t.dtype == dtype else t.to(dtype)


def read_state(state: State, cdtype: torch.dtype) -> Tensor:
    """The state in the compute dtype: ``state`` itself (updated in place) or a copy."""
    if isinstance(state, Quantized8):
        return _read(state.dequantize(), cdtype)
    return _read(state, cdtype)


def write_state(state: State, value: Tensor, generator: Optional[torch.Generator]) -> None:
    """Store ``value`` (from :func:`read_state`) back into ``state``."""
    if isinstance(state, Quantized8):
        state.quantize_(value.float())
    elif value is not state:
        if state.dtype in NARROW and value.dtype == torch.float32:
            stochastic_round_(state, value, generator)
        else:
            state.copy_(value)


def load_param(param: Tensor, comp: Optional[Tensor]) -> Tensor:
    """The tensor the update is applied to: ``param`` in place, or its float32 value."""
    if comp is None:
        return _read(param, compute_dtype(param.dtype))
    if comp.dtype == torch.int16:
        return exact_value(param, comp)
    return compensated_value(param, comp)


def store_param(
    param: Tensor,
    value: Tensor,
    comp: Optional[Tensor],
    compensation: Optional[str],
    generator: Optional[torch.Generator],
) -> None:
    """Write the updated ``value`` (from :func:`load_param`) into ``param`` (and ``comp``)."""
    if value is param:
        return
    if comp is not None:
        if comp.dtype == torch.int16:
            exact_write_(param, comp, value)
        else:
            kahan_write_(param, comp, value)
    elif compensation == "stochastic":
        stochastic_round_(param, value, generator)
    else:
        param.copy_(value)


class Unscaler:
    """Divides gradients by the loss scale: ``grad * inv_scale``, one copy of it per device."""

    def __init__(self, inv_scale: Optional[Tensor]) -> None:
        self.inv = None if inv_scale is None else PerDevice(inv_scale)

    def __call__(self, grad: Tensor) -> Tensor:
        return grad if self.inv is None else grad * self.inv.get(grad.device)


def check_grads(grads: list[Tensor]) -> None:
    for grad in grads:
        if grad.is_sparse:
            raise RuntimeError("mixprec.optim does not support sparse gradients; use torch.optim.SparseAdam")
        if grad.is_complex():
            raise RuntimeError("mixprec.optim does not support complex parameters; use torch.optim")


def step_grad(grad: Tensor, cdtype: torch.dtype, unscale: Unscaler, maximize: bool) -> Tensor:
    """The gradient a step uses: read in the compute dtype, unscaled, negated to maximize."""
    grad = unscale(_read(grad, cdtype))
    return -grad if maximize else grad


def draws_random(
    param: Tensor, comp: Optional[Tensor], states: Sequence[Optional[State]], compensation: Optional[str]
) -> bool:
    """Whether writing a parameter back draws random numbers: stochastic rounding of a
    low-precision parameter (no compensation buffer) or of a bfloat16/float16 state. A float32
    parameter draws nothing (it is updated in place, or copied back exactly)."""
    narrow = any(isinstance(s, Tensor) and s.dtype in NARROW for s in states)
    return narrow or (comp is None and compensation == "stochastic" and param.dtype in NARROW)


def write_back(
    param: Tensor,
    value: Tensor,
    comp: Optional[Tensor],
    states: Sequence[tuple[Optional[State], Optional[Tensor]]],
    compensation: Optional[str],
    generator: Optional[torch.Generator],
) -> None:
    """Write back a parameter's ``(stored, computed)`` states, then the parameter: one fixed
    order for both paths, so that stochastic rounding draws the same numbers."""
    for stored, computed in states:
        if stored is not None:
            write_state(stored, computed, generator)  # type: ignore[arg-type]
    store_param(param, value, comp, compensation, generator)


def adamw(
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
    """One AdamW step (decoupled weight decay) over lists of tensors, one tensor (or one CPU
    chunk of it, :mod:`mixprec.optim._chunks`) at a time.

    Args:
        params: parameters, any floating dtype; updated in place.
        grads: their gradients (read only), any floating dtype.
        exp_avgs, exp_avg_sqs: first and second moments, any floating dtype or
            :class:`~mixprec.optim.quant8.Quantized8`.
        max_exp_avg_sqs: running maxima of the second moment (entries may be ``None`` unless
            ``amsgrad``).
        state_steps: scalar float32 step counters on the CPU, incremented in place (read with
            ``.item()``: no device sync, as in torch's non-capturable path).
        comps: compensation buffers or ``None`` per parameter: a buffer of the parameter's
            dtype is Kahan's, an int16 buffer holds the exact low bits; a parameter with a
            buffer is written through it whatever ``compensation`` says.
        compensation: ``"stochastic"`` rounds parameters without a buffer stochastically;
            otherwise they are rounded to nearest.
        generator: randomness for stochastic rounding (on the parameters' device).
        inv_scale: if given, a float32 scalar tensor the gradients are multiplied by first
            (``1 / loss_scale``).
    """
    if amsgrad and any(s is None for s in max_exp_avg_sqs):
        raise ValueError("amsgrad=True needs a max_exp_avg_sq state for every parameter")
    check_grads(grads)
    unscale = Unscaler(inv_scale)
    stored = [exp_avgs, exp_avg_sqs] + ([max_exp_avg_sqs] if amsgrad else [])
    units = plan(params, [grads, comps, *stored])
    for i, sl in units:
        param = part(params[i], sl)
        cdtype = compute_dtype(param.dtype)
        grad = step_grad(part(grads[i], sl), cdtype, unscale, maximize)
        exp_avg = read_state(part(exp_avgs[i], sl), cdtype)
        exp_avg_sq = read_state(part(exp_avg_sqs[i], sl), cdtype)
        comp = part(comps[i], sl)
        value = load_param(param, comp)
        step_t = state_steps[i]

        if sl is None or sl.start == 0:
            step_t += 1
        if weight_decay != 0:
            value.mul_(1 - lr * weight_decay)
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)

        computed = [exp_avg, exp_avg_sq]
        if amsgrad:
            max_exp_avg_sq = read_state(part(max_exp_avg_sqs[i], sl), cdtype)  # type: ignore[arg-type]
            torch.maximum(max_exp_avg_sq, exp_avg_sq, out=max_exp_avg_sq)
            computed.append(max_exp_avg_sq)
        second = computed[-1]
        if torch.compiler.is_compiling():  # step-dependent scalars as tensors: one graph for every step
            step_size = lr / (1 - beta1**step_t)
            bias_correction2_sqrt = (1 - beta2**step_t).sqrt()
            # torch's capturable trick: fold -step_size into the denominator (addcdiv's value= is a number)
            denom = (second.sqrt() / (bias_correction2_sqrt * -step_size)).add_(eps / -step_size)
            value.addcdiv_(exp_avg, denom)
        else:
            step = step_t.item()
            step_size = lr / (1 - beta1**step)
            bias_correction2_sqrt = (1 - beta2**step) ** 0.5
            denom = (second.sqrt() / bias_correction2_sqrt).add_(eps)
            value.addcdiv_(exp_avg, denom, value=-step_size)

        states = [(part(s[i], sl), c) for s, c in zip(stored, computed)]
        write_back(param, value, comp, states, compensation, generator)


def new_momentum_buffers(
    momentum_buffers: list[Optional[Tensor]], params: list[Tensor], state_dtype: Optional[torch.dtype]
) -> list[bool]:
    """Create the missing momentum buffers (uninitialised, in ``state_dtype`` or the compute
    dtype) in place in the list; return which ones are new (a step sets them to the gradient)."""
    fresh = [b is None for b in momentum_buffers]
    for i, p in enumerate(params):
        if fresh[i]:
            dtype = state_dtype or compute_dtype(p.dtype)
            momentum_buffers[i] = torch.empty_like(p, dtype=dtype, memory_format=torch.preserve_format)
    return fresh


def sgd(
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
    """One SGD step over lists of tensors, one tensor (or CPU chunk) at a time, in place.

    ``momentum_buffers[i]`` is ``None`` until the first step with ``momentum != 0``; this function
    then creates it (in ``state_dtype``, default the compute dtype) as a copy of the gradient
    and stores it in the list, as torch does. Other arguments as in :func:`adamw`.
    """
    check_grads(grads)
    unscale = Unscaler(inv_scale)
    fresh = new_momentum_buffers(momentum_buffers, params, state_dtype) if momentum != 0 else []
    for i, sl in plan(params, [grads, comps, momentum_buffers]):
        param = part(params[i], sl)
        cdtype = compute_dtype(param.dtype)
        grad = step_grad(part(grads[i], sl), cdtype, unscale, maximize)
        comp = part(comps[i], sl)
        value = load_param(param, comp)

        if weight_decay != 0:
            grad = grad.add(value, alpha=weight_decay)
        if momentum != 0:
            stored = part(momentum_buffers[i], sl)
            if fresh[i]:
                buf = grad.detach().clone()
                stored.copy_(buf)  # type: ignore[union-attr]
            else:
                buf = read_state(stored, cdtype)  # type: ignore[arg-type]
                buf.mul_(momentum).add_(grad, alpha=1 - dampening)
                write_state(stored, buf, generator)  # type: ignore[arg-type]
            grad = grad.add(buf, alpha=momentum) if nesterov else buf
        value.add_(grad, alpha=-lr)

        store_param(param, value, comp, compensation, generator)
