"""The optimizer steps on float32 working copies: the update's definition, shared by the foreach
path (:mod:`~mixprec.optim._foreach`) and the fused one where mixprec's C++ kernel does not serve
(:mod:`~mixprec.optim._fused`), below both.

Each parameter (and its gradient, states, compensation) is read into float32 as a foreach op, the
update runs as torch's foreach ops or its fused CPU kernel (``fused=True``; with
``whole_vectors``, :func:`on_whole_vectors`: every element as its vector body computes it, the C++
kernel's bits), and the parameters and states are written back by their rule: per tensor in list
order where random numbers are drawn, else as foreach ops.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Optional

import torch
from torch import Tensor

from mixprec.optim._chunks import batches, part, plan
from mixprec.optim._functional import State, Unscaler, compute_dtype, draws_random, read_state, write_back, write_state
from mixprec.optim.exact import drop_stale_low_bits
from mixprec.optim.kahan import kahan_write_

__all__ = ["adamw_copies", "sgd_copies", "on_whole_vectors", "pick"]

#: torch's widest float32 vector on the CPU (AVX-512): its kernels' scalar tail is shorter
_VECTOR = 16


def pick(items: list, index: list[int]) -> list:
    return [items[i] for i in index]


def _to_compute(tensors: list[Tensor], cdtypes: list[torch.dtype]) -> list[Tensor]:
    """Each tensor itself if already in its compute dtype, else a converted copy (one foreach copy)."""
    out = [t if t.dtype == c else torch.empty_like(t, dtype=c) for t, c in zip(tensors, cdtypes)]
    copied = [i for i, (t, o) in enumerate(zip(tensors, out)) if o is not t]
    if copied:
        torch._foreach_copy_(pick(out, copied), pick(tensors, copied))
    return out


def _grads(
    grads: list[Tensor], cdtypes: list[torch.dtype], inv_scale: Optional[Tensor], maximize: bool
) -> list[Tensor]:
    """:func:`~mixprec.optim._functional.step_grad` on a list (never writes ``grads``)."""
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
        torch._foreach_add_([values[i].view(torch.int32) for i in exact], pick(comps, exact))
        for i in exact:  # as exact_value: stale low bits of a weight written from outside
            values[i] = drop_stale_low_bits(values[i], params[i])
    if kahan:
        torch._foreach_add_(pick(values, kahan), pick(comps, kahan))
    return values


def _store_params(params: list[Tensor], values: list[Tensor], comps: list[Optional[Tensor]]) -> None:
    """:func:`~mixprec.optim._functional.store_param` on a list, for every rule but stochastic
    rounding (exact and Kahan as in :mod:`~mixprec.optim.exact` and :mod:`~mixprec.optim.kahan`)."""
    written = [i for i, (p, v) in enumerate(zip(params, values)) if v is not p]
    exact = [i for i in written if comps[i] is not None and comps[i].dtype == torch.int16]
    kahan = [i for i in written if comps[i] is not None and comps[i].dtype != torch.int16]
    nearest = [i for i in written if comps[i] is None]
    if exact:
        bits, low = [values[i].view(torch.int32) for i in exact], pick(comps, exact)
        torch._foreach_copy_(low, bits)
        torch._foreach_sub_(bits, low)
        torch._foreach_copy_(pick(params, exact), pick(values, exact))
    if kahan and torch.compiler.is_compiling():  # rounding Inductor keeps: kahan_write_
        for i in kahan:
            kahan_write_(params[i], comps[i], values[i])  # type: ignore[arg-type]
    elif kahan:
        p, v = pick(params, kahan), pick(values, kahan)
        torch._foreach_copy_(p, v)
        torch._foreach_sub_(v, p)
        torch._foreach_copy_(pick(comps, kahan), v)
    if nearest:
        torch._foreach_copy_(pick(params, nearest), pick(values, nearest))


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
    if any(draws_random(p, comps[i], [stored[i] for stored, _ in states], compensation) for i, p in enumerate(params)):
        for i, param in enumerate(params):
            pairs = [(stored[i], computed[i]) for stored, computed in states]
            write_back(param, values[i], comps[i], pairs, compensation, generator)
        return
    for stored, computed in states:
        for s, c in zip(stored, computed):
            if s is not None:
                write_state(s, c, generator)  # type: ignore[arg-type]  # 8-bit, or a wider copy
    _store_params(params, values, comps)


def _flat(t: Tensor) -> Tensor:
    """A dense tensor's elements in storage order (as torch's fused kernels walk them)."""
    return t.view(-1) if t.is_contiguous() else t.as_strided((t.numel(),), (1,))


def _dense(t: Tensor) -> bool:
    """Non-overlapping and dense: its elements fill a block of storage (in some dimension order)."""
    if t.is_contiguous():
        return True
    expected = 1
    for stride, size in sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def fused_call(fn: Any, lists: int, whole_vectors: bool, *args: Any, **kwargs: Any) -> None:
    """Call torch's fused CPU kernel ``fn`` as :func:`on_whole_vectors` does (``whole_vectors``)
    or plainly, on the tensors of each parameter laid out alike.

    The kernel walks each tensor in storage order, so a parameter's tensors (value, gradient,
    states) must be dense with the same strides, or element i of one meets element j of another
    (torch's own ``fused=True`` then computes garbage, e.g. for a transposed weight's contiguous
    gradient, or a non-dense float32 parameter). A tensor laid out otherwise is copied into the
    first one's layout (a non-dense first one: all into contiguous copies) for the call, and
    copied back after it (all but argument 1, the gradients, which are only read)."""
    tensors = [list(lst) for lst in args[:lists]]
    back: list[tuple[Tensor, Tensor]] = []
    for i, first in enumerate(tensors[0]):
        alike = _dense(first) and all(not lst or lst[i].stride() == first.stride() for lst in tensors)
        if alike:
            continue
        ref = first if _dense(first) else torch.empty_like(first, memory_format=torch.contiguous_format)
        for k, lst in enumerate(tensors):
            if not lst or (lst[i] is ref) or lst[i].stride() == ref.stride():
                continue
            copy = torch.empty_like(ref, dtype=lst[i].dtype).copy_(lst[i])
            if k != 1:
                back.append((lst[i], copy))
            lst[i] = copy
    if whole_vectors:
        on_whole_vectors(fn, lists, *tensors, *args[lists:], **kwargs)
    else:
        fn(*tensors, *args[lists:], **kwargs)
    for dst, src in back:
        dst.copy_(src)


def on_whole_vectors(fn: Any, lists: int, *args: Any, **kwargs: Any) -> None:
    """Call torch's fused CPU kernel ``fn`` (``torch._fused_adamw_``, ``torch._fused_sgd_``) so that
    it computes every element with its vector body, as mixprec's C++ kernel does.

    Each tensor of the first ``lists`` arguments (per parameter: float32 values, gradients,
    states, dense and laid out alike; argument 1, the gradients, is only read) runs as two: its
    whole 16-element vectors (a view) and the rest of it padded with zeros to one vector (a copy,
    written back after the call). Further positional arguments are per parameter (step
    counters): repeated for each piece. Keyword arguments go to ``fn``.

    Example:
        >>> import torch
        >>> p, g = torch.zeros(20), torch.ones(20)
        >>> on_whole_vectors(torch._fused_sgd_, 3, [p], [g], [], lr=0.5, momentum=0.0, dampening=0.0,
        ...                  weight_decay=0.0, nesterov=False, maximize=False, is_first_step=False)
        >>> bool((p == -0.5).all())
        True
    """
    tensors, per_param = args[:lists], args[lists:]
    split: list[list[Tensor]] = [[] for _ in tensors]
    repeated: list[list[Any]] = [[] for _ in per_param]
    tails: list[tuple[Tensor, Tensor]] = []
    for i, first in enumerate(tensors[0]):
        n = first.numel()
        cut = n - n % _VECTOR
        for k, lst in enumerate(tensors):
            if not lst:  # no max_exp_avg_sqs, no momentum buffers
                continue
            flat = _flat(lst[i])
            if cut:
                split[k].append(flat[:cut])
            if cut < n:
                pad = flat.new_zeros(_VECTOR)
                pad[: n - cut] = flat[cut:]
                split[k].append(pad)
                if k != 1:
                    tails.append((flat[cut:], pad[: n - cut]))
        for k, lst in enumerate(per_param):
            repeated[k] += [lst[i]] * ((cut > 0) + (cut < n))
    fn(*split, *repeated, **kwargs)
    for dst, src in tails:
        dst.copy_(src)


def adamw_copies(
    params: list[Tensor], grads: list[Tensor], stored: list[list[State]], comps: list[Optional[Tensor]],
    state_steps: list[Tensor], *, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
    maximize: bool, compensation: Optional[str], generator: Optional[torch.Generator],
    inv_scale: Optional[Tensor], fused: bool, whole_vectors: bool = False,
) -> None:
    """:func:`adamw_foreach`'s update on float32 working copies, the step counters already
    incremented; ``stored``: ``[exp_avgs, exp_avg_sqs(, max_exp_avg_sqs)]``. ``whole_vectors``
    (with ``fused``): torch's kernel computes every element as its vector body does, the scalar
    tail included (:func:`on_whole_vectors`): mixprec's C++ kernel's bits."""
    amsgrad = len(stored) == 3
    fused_adamw = partial(fused_call, torch._fused_adamw_, 5, whole_vectors)
    compiling = torch.compiler.is_compiling()
    fused = fused and not compiling  # compiled: foreach ops, which the compiler fuses
    steps: list[Any] = state_steps if compiling else [t.item() for t in state_steps]
    units = plan(params, [grads, comps, *stored])
    for batch in batches(units, params):
        index = [i for i, _ in batch]
        p = [part(params[i], sl) for i, sl in batch]
        cdtypes = [compute_dtype(t.dtype) for t in p]
        grads_c = _grads([part(grads[i], sl) for i, sl in batch], cdtypes, inv_scale, maximize)
        states = [[part(s[i], sl) for i, sl in batch] for s in stored]
        computed = [[read_state(s, c) for s, c in zip(lst, cdtypes)] for lst in states]
        c = [part(comps[i], sl) for i, sl in batch]
        values = _load_params(p, c, cdtypes)

        if fused:  # gradients already unscaled and negated: the kernel must not do it again
            fused_adamw(
                values, grads_c, computed[0], computed[1], computed[2] if amsgrad else [],
                pick(state_steps, index), amsgrad=amsgrad, lr=lr, beta1=beta1, beta2=beta2,
                weight_decay=weight_decay, eps=eps, maximize=False, grad_scale=None, found_inf=None,
            )
        else:
            _adamw_update(values, grads_c, computed, pick(steps, index), lr=lr, beta1=beta1, beta2=beta2,
                          eps=eps, weight_decay=weight_decay)

        _write_back_all(p, values, c, list(zip(states, computed)), compensation, generator)


def _adamw_update(
    values: list[Tensor], grads: list[Tensor], moments: list[list[Tensor]], steps: list[Any], *,
    lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
) -> None:
    """torch's foreach AdamW on float32 working values; ``moments``: ``[exp_avgs, exp_avg_sqs(,
    max_exp_avg_sqs)]``. ``steps``: the step counts as floats, or while ``torch.compile`` traces,
    the counters themselves (torch's capturable formulation, -step_size folded into the
    denominator), so that one graph serves every step; float32 bias corrections then round
    differently from the floats' double ones."""
    exp_avgs, exp_avg_sqs = moments[0], moments[1]
    if weight_decay != 0:
        torch._foreach_mul_(values, 1 - lr * weight_decay)
    torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
    if len(moments) == 3:  # amsgrad
        torch._foreach_maximum_(moments[2], exp_avg_sqs)
    denoms = torch._foreach_sqrt(moments[-1])
    if steps and isinstance(steps[0], Tensor):
        neg_step_sizes = [-(lr / (1 - beta1**step)) for step in steps]
        bias_correction2_sqrts = [(1 - beta2**step).sqrt() for step in steps]
        torch._foreach_div_(denoms, [b * n for b, n in zip(bias_correction2_sqrts, neg_step_sizes)])
        torch._foreach_add_(denoms, [eps / n for n in neg_step_sizes])
        torch._foreach_addcdiv_(values, exp_avgs, denoms)
    else:
        torch._foreach_div_(denoms, [(1 - beta2**step) ** 0.5 for step in steps])
        torch._foreach_add_(denoms, eps)
        torch._foreach_addcdiv_(values, exp_avgs, denoms, [-(lr / (1 - beta1**step)) for step in steps])


def sgd_copies(
    params: list[Tensor], grads: list[Tensor], momentum_buffers: list[Optional[Tensor]], fresh: list[bool],
    comps: list[Optional[Tensor]], *, lr: float, momentum: float, dampening: float, weight_decay: float,
    nesterov: bool, maximize: bool, compensation: Optional[str], generator: Optional[torch.Generator],
    inv_scale: Optional[Tensor], fused: bool, whole_vectors: bool = False,
) -> None:
    """:func:`sgd_foreach`'s update on float32 working copies, the momentum buffers created
    (``fresh[i]``: new); ``whole_vectors`` as in :func:`adamw_copies`."""
    for batch in batches(plan(params, [grads, comps, momentum_buffers]), params):
        p = [part(params[i], sl) for i, sl in batch]
        cdtypes = [compute_dtype(t.dtype) for t in p]
        grads_c = _grads([part(grads[i], sl) for i, sl in batch], cdtypes, inv_scale, maximize)
        c = [part(comps[i], sl) for i, sl in batch]
        values = _load_params(p, c, cdtypes)

        if fused and not torch.compiler.is_compiling():  # compiled: foreach ops, which the compiler fuses
            _fused_sgd(batch, values, grads_c, momentum_buffers, fresh, cdtypes, generator, whole_vectors, lr=lr,
                       momentum=momentum, dampening=dampening, weight_decay=weight_decay, nesterov=nesterov)
            _write_back_all(p, values, c, [], compensation, generator)
            continue
        if weight_decay != 0:
            grads_c = torch._foreach_add(grads_c, values, alpha=weight_decay)
        stored: list[Optional[Tensor]] = [None] * len(batch)
        bufs: list[Optional[Tensor]] = [None] * len(batch)
        if momentum != 0:
            new = [k for k, (i, _) in enumerate(batch) if fresh[i]]
            old = [k for k, (i, _) in enumerate(batch) if not fresh[i]]
            views = [part(momentum_buffers[i], sl) for i, sl in batch]
            for k in new:
                bufs[k] = grads_c[k].detach().clone()
                views[k].copy_(bufs[k])  # type: ignore[union-attr, arg-type]
            for k in old:
                bufs[k], stored[k] = read_state(views[k], cdtypes[k]), views[k]  # type: ignore[arg-type]
            if old:
                torch._foreach_mul_(pick(bufs, old), momentum)
                torch._foreach_add_(pick(bufs, old), pick(grads_c, old), alpha=1 - dampening)
            grads_c = torch._foreach_add(grads_c, bufs, alpha=momentum) if nesterov else bufs  # type: ignore[arg-type]
        torch._foreach_add_(values, grads_c, alpha=-lr)

        _write_back_all(p, values, c, [(stored, bufs)], compensation, generator)


def _fused_sgd(
    batch: list,
    values: list[Tensor],
    grads_c: list[Tensor],
    momentum_buffers: list[Optional[Tensor]],
    fresh: list[bool],
    cdtypes: list[torch.dtype],
    generator: Optional[torch.Generator],
    whole_vectors: bool,
    **hyper: Any,
) -> None:
    """One batch of fused SGD, momentum buffers included: new buffers (set to the gradient by the
    kernel, ``is_first_step``) and old ones in two calls; a narrower buffer is worked on in a
    float32 copy and written back (new: to nearest, as the for-loop path; old: :func:`write_state`).
    ``whole_vectors``: as in :func:`adamw_copies`."""
    fused_sgd = partial(fused_call, torch._fused_sgd_, 3, whole_vectors)
    if hyper["momentum"] == 0:
        fused_sgd(values, grads_c, [], maximize=False, is_first_step=False, **hyper)
        return
    views = [part(momentum_buffers[i], sl) for i, sl in batch]
    bufs = [read_state(v, c) for v, c in zip(views, cdtypes)]  # type: ignore[arg-type]
    for first in (True, False):
        ks = [k for k, (i, _) in enumerate(batch) if fresh[i] == first]
        if ks:
            fused_sgd(pick(values, ks), pick(grads_c, ks), pick(bufs, ks), maximize=False,
                      is_first_step=first, **hyper)
    for k, (i, _) in enumerate(batch):
        if bufs[k] is not views[k]:
            if fresh[i]:
                views[k].copy_(bufs[k])  # type: ignore[union-attr]
            else:
                write_state(views[k], bufs[k], generator)  # type: ignore[arg-type]
