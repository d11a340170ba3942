"""mixprec's one-pass optimizer step on the CPU (``csrc/optim_kernel.cpp``): the default path
and ``fused=True`` for low-precision parameters.

The fused path's definition is torch's fused AdamW/SGD kernel applied to the float32 value of
each parameter (parameter + Kahan buffer, or bfloat16 + exact low bits) and written back by the
parameter's rule; :mod:`mixprec.optim._foreach` does exactly that with float32 working copies.
The C++ kernel computes the same numbers in one pass over memory for a low-precision CPU
parameter whose gradient (its dtype or float32) and state are dense and laid out alike
(contiguous, or channels-last as convolution weights), with float32 or 8-bit
state (:mod:`~mixprec.optim.quant8`: dequantized, updated and quantized block by block, the same
codes and absmaxes), written back to nearest, by Kahan, by exact low bits, or by stochastic
rounding of bfloat16 (the same random numbers, drawn in the same order from the optimizer's
generator). It reads the 2-byte weight and its buffer, updates in registers and writes them
back, where the working copies cost about ten passes (4.2M parameters, one thread: AdamW 2-3x,
SGD 5x faster).

It reproduces the vectorized body of torch's kernels operation by operation, fused multiply-adds
included, so it is used only where it agrees with them: on x86 CPUs with AVX2 or AVX-512
(torch's CPU capability), after a check at first use that both give the same bits on random
inputs (:func:`_agrees_with_torch`; a torch build that rounds otherwise keeps the working
copies, with a warning). It computes every element as that vector body does, where torch's
kernel rounds its scalar tail (the last ``numel % 16`` elements of a tensor) a little otherwise.

Where the kernel is not available (no compiler, ``MIXPREC_NATIVE_KERNELS=0``, another CPU, a
torch build that rounds otherwise) the parameters it would take run its definition instead:
torch's fused kernel on float32 working copies, the tail computed as a vector of its own
(:func:`mixprec.optim._copies.on_whole_vectors`). So the default optimizer and ``fused=True`` give the same bits with or
without a compiler (on one machine), and a run resumed elsewhere keeps its trajectory.
Everything the kernel does not take (CUDA, float32 parameters, float16 stochastic rounding,
bfloat16/float16 state) keeps its own path.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch
from torch import Tensor

from mixprec import _native
from mixprec.optim import quant8
from mixprec.optim._copies import adamw_copies, sgd_copies
from mixprec.optim._functional import NARROW, draws_random
from mixprec.optim.quant8 import Quantized8

__all__ = ["native_ops", "any_candidate", "adamw_native", "sgd_native"]

_log = logging.getLogger("mixprec")
#: torch's CPU capabilities where the kernel may serve (their fused kernels' arithmetic is known)
_CAPABILITIES = ("AVX512", "AVX2")
_KERNEL_BLOCK = 256  # kBlock in optim_kernel.cpp: 8-bit moments must use the same block size
_MODES = {None: 0, "kahan": 1, "exact": 2, "stochastic": 3}


def native_ops() -> Optional[Any]:
    """The compiled kernels, or ``None`` where their definition on working copies must serve (no
    compiler, ``MIXPREC_NATIVE_KERNELS=0``, a CPU other than x86 AVX2/AVX-512, or a torch build
    whose fused kernels round otherwise: :func:`_agrees_with_torch`). Builds them if this
    environment has no build yet (:mod:`mixprec._native`).

    Decided once per process, outside ``torch.compile`` (the optimizers ask at construction);
    code being compiled only reads the decision (``None`` if it was never taken)."""
    if torch.compiler.is_compiling():
        return _checked.get("ops")
    if "ops" not in _checked:
        ops = None
        if _native.cpu_capability() in _CAPABILITIES and _native.enabled():
            ops = _native.load()
        if ops is not None and not _agrees_with_torch(ops):
            _log.warning("mixprec: its optimizer kernel does not reproduce this torch build's fused "
                         "AdamW/SGD bit for bit; mixprec.optim uses torch's kernels on float32 copies")
            ops = None
        if ops is not None:
            _register_fakes()
        _checked["ops"] = ops
    return _checked["ops"]


_checked: dict[str, Any] = {}


def _register_fakes() -> None:
    """Let ``torch.compile`` trace calls to the kernels: they return nothing and only mutate."""
    for name in ("adamw_step", "sgd_step"):
        qualname = f"mixprec_native::{name}"
        if torch._C._dispatch_has_kernel_for_dispatch_key(qualname, "Meta"):
            continue
        torch.library.register_fake(qualname, lambda *args, **kwargs: None, lib=_fake_lib())


def _fake_lib() -> Any:
    if "lib" not in _checked:
        _checked["lib"] = torch.library.Library("mixprec_native", "FRAGMENT")
    return _checked["lib"]


def _agrees_with_torch(ops: Any) -> bool:
    """Whether the kernel reproduces torch's fused AdamW and SGD on float32 tensors (sizes that
    are whole vectors: torch's scalar tail rounds otherwise), bitwise, over the options that
    change the arithmetic."""
    gen = torch.Generator().manual_seed(0)
    n = 1024
    rand = lambda scale=1.0: torch.randn(n, generator=gen) * scale  # noqa: E731
    for amsgrad, weight_decay, beta1 in ((False, 0.0, 0.9), (True, 0.1, 0.9), (False, 0.1, 0.3)):
        p, g, m, v, vmax = rand(), rand(), rand(0.1), rand(0.01).abs(), rand(0.01).abs()
        ref = [t.clone() for t in (p, m, v, vmax)]
        hyper = dict(lr=1e-3, beta1=beta1, beta2=0.999, eps=1e-8, weight_decay=weight_decay)
        torch._fused_adamw_([ref[0]], [g.clone()], [ref[1]], [ref[2]], [ref[3]] if amsgrad else [],
                            [torch.tensor(3.0)], amsgrad=amsgrad, maximize=False, grad_scale=None,
                            found_inf=None, **hyper)
        ours = [t.clone() for t in (p, m, v, vmax)]
        ops.adamw_step([ours[0]], [g], [ours[1]], [ours[2]], [ours[3]] if amsgrad else [], [], [torch.tensor(3.0)],
                       [], [], *hyper.values(), amsgrad, False, None, 0, None)
        if not all(torch.equal(a, b) for a, b in zip(ours, ref)):
            return False
    for first, nesterov, dampening, weight_decay in ((True, False, 0.0, 0.0), (False, True, 0.0, 0.1),
                                                     (False, False, 0.1, 0.1)):
        p, g, buf = rand(), rand(), rand()
        ref = [p.clone(), buf.clone()]
        hyper = dict(lr=0.05, momentum=0.9, dampening=dampening, weight_decay=weight_decay, nesterov=nesterov)
        torch._fused_sgd_([ref[0]], [g.clone()], [ref[1]], maximize=False, is_first_step=first,
                          grad_scale=None, found_inf=None, **hyper)
        ours = [p.clone(), buf.clone()]
        ops.sgd_step([ours[0]], [g], [ours[1]], [], [first], *hyper.values(), False, None, 0, None)
        if not all(torch.equal(a, b) for a, b in zip(ours, ref)):
            return False
    return True


_CHANNELS_LAST = {4: torch.channels_last, 5: torch.channels_last_3d}


def _dense(t: Tensor) -> bool:
    """Contiguous, or channels-last (a convolution weight's usual layouts)."""
    if t.is_contiguous():
        return True
    fmt = _CHANNELS_LAST.get(t.dim())
    return fmt is not None and t.is_contiguous(memory_format=fmt)


def _alike(t: Any, layout: tuple[Any, Any]) -> bool:
    """``t`` is a CPU tensor with the parameter's ``(shape, stride)``: the kernel walks them all
    in storage order."""
    return isinstance(t, Tensor) and t.device.type == "cpu" and t.stride() == layout[1] and t.shape == layout[0]


def _mode(param: Tensor, comp: Optional[Tensor], compensation: Optional[str], layout: tuple[Any, Any]) -> Optional[int]:
    """The kernel's write-back code for ``param``, or ``None`` if the kernel cannot write it."""
    if comp is None:
        if compensation != "stochastic":
            return _MODES[None]
        return _MODES["stochastic"] if param.dtype == torch.bfloat16 else None
    if not _alike(comp, layout):
        return None
    if comp.dtype == torch.int16:
        return _MODES["exact"] if param.dtype == torch.bfloat16 else None
    return _MODES["kahan"] if comp.dtype == param.dtype else None


def _eight_bit(states: list[Any], param: Tensor, layout: tuple[Any, Any]) -> Optional[bool]:
    """``False``: float32 states the kernel takes; ``True``: 8-bit ones (in the kernel's block
    size); ``None``: neither."""
    if all(_alike(s, layout) and s.dtype == torch.float32 for s in states):
        return False
    if states and quant8.BLOCK == _KERNEL_BLOCK and param.is_contiguous() and all(
        isinstance(s, Quantized8) and s.codes.device.type == "cpu" and s.codes.is_contiguous()
        and s.absmax.is_contiguous() and s.shape.numel() == param.numel() for s in states
    ):
        return True
    return None


def _eligible(param: Tensor, grad: Tensor, states: list[Any], comp: Optional[Tensor],
              compensation: Optional[str]) -> Optional[tuple[int, bool]]:
    """``(write-back code, 8-bit states)`` for a parameter the kernel takes, else ``None``."""
    if param.dtype not in NARROW or param.device.type != "cpu" or not _dense(param):
        return None
    layout = (param.shape, param.stride())
    if not _alike(grad, layout) or grad.dtype not in (param.dtype, torch.float32):
        return None
    eight_bit = _eight_bit(states, param, layout)
    mode = _mode(param, comp, compensation, layout)
    return None if eight_bit is None or mode is None else (mode, eight_bit)


def _keep_draw_order(kinds: list[Optional[tuple[int, bool]]], params: list[Tensor], comps: list[Optional[Tensor]],
                     states: list[list[Any]], compensation: Optional[str]) -> list[Optional[tuple[int, bool]]]:
    """Leave stochastic rounding to the working copies if a parameter they keep draws too: the
    random numbers must come in parameter order, as the working-copy path draws them. (A float32
    parameter draws nothing: it does not hold the kernel back.)"""
    others_draw = any(kind is None and draws_random(params[i], comps[i], states[i], compensation)
                      for i, kind in enumerate(kinds))
    return [None if others_draw and kind is not None and kind[0] == _MODES["stochastic"] else kind
            for kind in kinds]


def _kernel_maps() -> list[Tensor]:
    """The dynamic maps' tables as the kernel reads them (signed, then unsigned: values, base
    as int32, midpoint), made once."""
    if "maps" not in _checked:
        tables = []
        for signed in (True, False):
            values, base, midpoint = quant8._maps(signed, torch.device("cpu"))
            tables += [values, base.to(torch.int32), midpoint]
        _checked["maps"] = tables
    return _checked["maps"]


def any_candidate(params: list[Tensor]) -> bool:
    """Whether any parameter could use the kernel: otherwise (CUDA, float32) it is not even built."""
    return any(p.device.type == "cpu" and p.dtype in NARROW for p in params)


def _kernel_or_definition(params: list[Tensor]) -> tuple[bool, Optional[Any]]:
    """``(runs, ops)``: whether the parameters the kernel takes are stepped here (not while
    compiling without the kernel: the caller's path is traced), and the kernel (``None``: its
    definition on working copies)."""
    if not any_candidate(params):
        return False, None
    ops = native_ops()
    return ops is not None or not torch.compiler.is_compiling(), ops


def _cpu_inv(inv_scale: Optional[Tensor]) -> Optional[Tensor]:
    return None if inv_scale is None else inv_scale.detach().to("cpu", torch.float32).reshape(())


def _groups(kinds: list[Optional[tuple[int, bool]]]) -> list[tuple[tuple[int, bool], list[int]]]:
    """The kernel calls: the parameters of each kind together, except that stochastic rounding
    draws in parameter order (as the working copies do), so its calls take runs of consecutive
    parameters of one kind (8-bit and float32 moments alternate: weights and biases)."""
    out: list[tuple[tuple[int, bool], list[int]]] = []
    together: dict[tuple[int, bool], list[int]] = {}
    for i, kind in enumerate(kinds):
        if kind is None:
            continue
        if kind[0] != _MODES["stochastic"]:
            if kind not in together:
                together[kind] = []
                out.append((kind, together[kind]))
            together[kind].append(i)
        elif out and out[-1][0] == kind:
            out[-1][1].append(i)
        else:
            out.append((kind, [i]))
    return out


def adamw_native(
    params: list[Tensor], grads: list[Tensor], stored: list[list[Any]], comps: list[Optional[Tensor]],
    state_steps: list[Tensor], *, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
    amsgrad: bool, maximize: bool, compensation: Optional[str], inv_scale: Optional[Tensor],
    generator: Optional[torch.Generator], increment: bool = False,
) -> list[int]:
    """Run the fused AdamW step on the parameters the C++ kernel takes (through the kernel, or
    without it its definition, bitwise: see the module); return the indices of the others, for
    the caller to run. ``stored``: ``[exp_avgs, exp_avg_sqs(, max_exp_avg_sqs)]``;
    ``state_steps``: the step counters (float32 CPU scalars), already incremented unless
    ``increment`` (then those of the parameters taken are incremented here)."""
    runs, ops = _kernel_or_definition(params)
    if not runs:
        return list(range(len(params)))
    states = [[s[i] for s in stored] for i in range(len(params))]
    kinds = [_eligible(p, g, states[i], c, compensation) for i, (p, g, c) in enumerate(zip(params, grads, comps))]
    kinds = _keep_draw_order(kinds, params, comps, states, compensation)
    inv = _cpu_inv(inv_scale)
    groups = _groups(kinds)
    if increment and groups:
        torch._foreach_add_([state_steps[i] for _, index in groups for i in index], 1)
    rest = [i for i, kind in enumerate(kinds) if kind is None]
    if ops is None:
        taken = [i for i, kind in enumerate(kinds) if kind is not None]
        pick = lambda lst: [lst[i] for i in taken]  # noqa: E731
        if taken:
            adamw_copies(pick(params), pick(grads), [pick(s) for s in stored], pick(comps), pick(state_steps),
                         lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, maximize=maximize,
                         compensation=compensation, generator=generator, inv_scale=inv_scale, fused=True,
                         whole_vectors=True)
        return rest
    for (mode, eight_bit), index in groups:
        pick = lambda lst: [lst[i] for i in index]  # noqa: E731
        moments = [pick(lst) for lst in stored]
        absmaxes: list[Tensor] = []
        maps: list[Tensor] = []
        if eight_bit:  # codes where the moments go, absmaxes and the maps' tables beside them
            absmaxes = [q.absmax for lst in moments for q in lst]
            moments = [[q.codes for q in lst] for lst in moments]
            maps = _kernel_maps()
        ops.adamw_step(
            pick(params), pick(grads), moments[0], moments[1], moments[2] if amsgrad else [],
            [comps[i] for i in index] if mode in (1, 2) else [], pick(state_steps), absmaxes, maps,
            lr, beta1, beta2, eps, weight_decay, amsgrad, maximize, inv, mode,
            generator if mode == _MODES["stochastic"] else None,  # (torch.compile cannot trace a generator)
        )
    return rest


def sgd_native(
    params: list[Tensor], grads: list[Tensor], momentum_buffers: list[Optional[Tensor]],
    fresh: list[bool], comps: list[Optional[Tensor]], *, lr: float, momentum: float,
    dampening: float, weight_decay: float, nesterov: bool, maximize: bool,
    compensation: Optional[str], inv_scale: Optional[Tensor], generator: Optional[torch.Generator],
) -> list[int]:
    """:func:`adamw_native` for SGD; ``fresh[i]``: the momentum buffer is new (set to the gradient)."""
    runs, ops = _kernel_or_definition(params)
    if not runs:
        return list(range(len(params)))
    has_momentum = momentum != 0
    states = [[momentum_buffers[i]] if has_momentum else [] for i in range(len(params))]
    kinds = [_eligible(p, g, states[i], c, compensation) for i, (p, g, c) in enumerate(zip(params, grads, comps))]
    kinds = _keep_draw_order(kinds, params, comps, states, compensation)
    rest = [i for i, kind in enumerate(kinds) if kind is None]
    if ops is None:
        taken = [i for i, kind in enumerate(kinds) if kind is not None]
        pick = lambda lst: [lst[i] for i in taken]  # noqa: E731
        if taken:
            sgd_copies(pick(params), pick(grads), pick(momentum_buffers), pick(fresh) if has_momentum else [],
                       pick(comps), lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                       nesterov=nesterov, maximize=maximize, compensation=compensation, generator=generator,
                       inv_scale=inv_scale, fused=True, whole_vectors=True)
        return rest
    inv = _cpu_inv(inv_scale)
    for (mode, _), index in _groups(kinds):
        pick = lambda lst: [lst[i] for i in index]  # noqa: E731
        ops.sgd_step(
            pick(params), pick(grads), pick(momentum_buffers) if has_momentum else [],
            [comps[i] for i in index] if mode in (1, 2) else [], pick(fresh) if has_momentum else [],
            lr, momentum, dampening, weight_decay, nesterov, maximize, inv, mode,
            generator if mode == _MODES["stochastic"] else None,
        )
    return rest
