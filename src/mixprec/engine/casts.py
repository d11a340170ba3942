"""The cast kinds our Python kernel runs, one runner per kind, and the weight-cast cache.

Semantics follow ``aten/src/ATen/autocast_mode.{h,cpp}``: only defined floating tensors on the
region's device that are not float64 are cast (:func:`mixprec._tree.castable`); the cast of an
fp32 leaf that requires grad to the region's low-precision dtype is cached until the outermost
region exits (the C++ kernel uses PyTorch's own cache, the Python kernel :data:`RUNTIME.cache
<mixprec.engine.runtime.Runtime>`); casts and the op run with autocast excluded for every device.
The ``fp8`` kind routes the call of the fp8 layer being called to its ``Fp8Target``
(``mixprec.fp8.internals``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from mixprec import ops as _ops
from mixprec._ops_names import op_overload
from mixprec._tree import castable
from mixprec.engine.runtime import RUNTIME, Frame

__all__ = ["OpInfo", "op_info", "RUNNERS", "no_autocast", "cached_cast", "tensors", "call_below", "wrapped_number"]

_EXCLUDE_AUTOCAST = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)
for _k in ("AutocastCUDA", "AutocastXPU", "AutocastMPS", "AutocastHPU", "AutocastIPU",
           "AutocastPrivateUse1"):
    if hasattr(torch._C.DispatchKey, _k):
        _EXCLUDE_AUTOCAST = _EXCLUDE_AUTOCAST | torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, _k))


def no_autocast() -> Any:
    """A guard that excludes every autocast dispatch key while it lives."""
    return torch._C._ExcludeDispatchKeyGuard(_EXCLUDE_AUTOCAST)


# Keys below every autocast key: redispatching with ``keyset & BELOW_AUTOCAST`` skips autocast for
# this op only, as PyTorch's fallthrough does; ops it calls internally are autocast again.
BELOW_AUTOCAST = torch._C._dispatch_keyset_full_after(torch._C.DispatchKey.AutocastCPU)


@dataclass(frozen=True)
class OpInfo:
    """What the runners need to know of one overload."""

    name: str
    op: "torch._ops.OpOverload"
    dtype_index: int | None  # position of the optional `dtype` argument (set_opt_dtype)
    dtype_kwarg_only: bool
    append_target: "torch._ops.OpOverload | None"
    # A CompositeImplicitAutograd op calls other ops from the top of the dispatcher: it runs with
    # autocast excluded, as PyTorch's kernels do. Any other op is redispatched below autocast,
    # which is the same and saves a Python-to-dispatcher round trip.
    composite: bool
    # positions of the Tensor arguments: a Python number there is a wrapped number (``x * 2``),
    # which reaches a Python kernel unwrapped and only the op's packet takes back (:func:`call_below`)
    tensor_positions: tuple[int, ...] = ()
    # the arguments ``promote`` weighs, as PyTorch's ``promote_type``: ``Tensor`` and ``Tensor[]``
    # ones (an optional ``Tensor?``, such as bilinear's bias, is cast but not weighed), by position
    # among the positional arguments and by name
    weighed_positions: tuple[int, ...] = ()
    weighed_names: frozenset[str] = frozenset()


def op_info(name: str, op: "torch._ops.OpOverload") -> OpInfo:
    """The :class:`OpInfo` of overload ``name``."""
    dtype_index, kwarg_only = None, False
    positional = 0
    for arg in op._schema.arguments:
        if arg.name == "dtype":
            dtype_index, kwarg_only = positional, arg.kwarg_only
            break
        if not arg.kwarg_only:
            positional += 1
    target_name = _ops.APPEND_DTYPE_TARGETS.get(name)
    composite = torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeImplicitAutograd")
    tensors_at = tuple(i for i, a in enumerate(a for a in op._schema.arguments if not a.kwarg_only)
                       if str(a.type) == "Tensor")
    weighed = [str(a.type) in ("Tensor", "List[Tensor]") for a in op._schema.arguments]
    weighed_at = tuple(i for i, (a, w) in enumerate(
        (a, w) for a, w in zip(op._schema.arguments, weighed) if not a.kwarg_only) if w)
    weighed_names = frozenset(a.name for a, w in zip(op._schema.arguments, weighed) if w)
    return OpInfo(name, op, dtype_index, kwarg_only, op_overload(target_name) if target_name else None, composite,
                  tensors_at, weighed_at, weighed_names)


def wrapped_number(info: OpInfo, args: tuple) -> bool:
    """Whether a Tensor argument came as a Python number (a wrapped number, ``x * 2``)."""
    return any(i < len(args) and isinstance(args[i], (bool, int, float, complex)) for i in info.tensor_positions)


def call_below(info: OpInfo, keyset: Any, args: tuple, kwargs: dict) -> Any:
    """Run the op below autocast on (already cast) arguments (``keyset`` None: from a route op).
    A wrapped number goes to the op's packet, which takes it as a Scalar (the same result)."""
    wrapped = wrapped_number(info, args)
    if info.composite or keyset is None or wrapped:
        with no_autocast():
            return (info.op.overloadpacket if wrapped else info.op)(*args, **kwargs)
    return info.op.redispatch(keyset & BELOW_AUTOCAST, *args, **kwargs)


# --------------------------------------------------------------------------- casting
# dtype -> the Tensor method that casts to it: same result as ``t.to(dtype)``, cheaper to call
_CAST_METHOD = {
    torch.bfloat16: torch.Tensor.bfloat16,
    torch.float16: torch.Tensor.half,
    torch.float32: torch.Tensor.float,
}


def _to(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    method = _CAST_METHOD.get(dtype)
    return method(t) if method is not None else t.to(dtype)


def cached_cast(t: Any, to: torch.dtype, frame: Frame) -> Any:
    """``t`` cast to ``to`` if autocast may cast it; a weight's cast to the low-precision dtype
    is cached until the outermost mixprec region exits (outside every one, as in a plain
    ``torch.autocast`` region calling an op with our kernel, nothing is cached)."""
    if not isinstance(t, torch.Tensor) or t.dtype is to or not castable(t, frame.device_type):
        return t
    if (
        to is not torch.float32  # only casts to the region's low-precision dtype are cached
        and t.dtype is torch.float32
        and t.requires_grad
        and t.is_leaf
        and torch.is_autocast_cache_enabled()
        and type(t) in (torch.Tensor, torch.nn.Parameter)  # never cache fake/traced tensors
        and not t._is_view()
        and not torch.is_inference_mode_enabled()
        and RUNTIME.depth > 0  # (outside every mixprec region nothing would clear it: plain torch.autocast)
    ):
        cache = RUNTIME.cache
        hit = cache.get(id(t))
        if hit is not None and hit[0] is t:
            return hit[1]
        # Cast with grad enabled so that a cast first made under no_grad still carries a
        # grad_fn when a later, grad-enabled forward of the same region reuses it.
        with torch.enable_grad():
            casted = _to(t, to)
        cache[id(t)] = (t, casted)  # the strong ref keeps id(t) unique while cached
        return casted
    return _to(t, to)


def _cast_arg(a: Any, to: torch.dtype, frame: Frame) -> Any:
    if isinstance(a, torch.Tensor):
        return cached_cast(a, to, frame)
    if isinstance(a, (list, tuple)) and a and any(isinstance(x, torch.Tensor) for x in a):
        return type(a)(cached_cast(x, to, frame) for x in a)
    return a


def _cast_all(args: tuple, kwargs: dict, to: torch.dtype, frame: Frame) -> tuple[tuple, dict]:
    args = tuple([_cast_arg(a, to, frame) for a in args])
    if kwargs:
        kwargs = {k: _cast_arg(v, to, frame) for k, v in kwargs.items()}
    return args, kwargs


def tensors(args: tuple, kwargs: dict) -> Iterator[torch.Tensor]:
    """The tensors among the arguments, one level into lists and tuples."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            for x in a:
                if isinstance(x, torch.Tensor):
                    yield x


def _promote_type(info: OpInfo, args: tuple, kwargs: dict, frame: Frame, lower: torch.dtype) -> torch.dtype:
    """The dtype a promote op runs in: float32 if a weighed argument is float32, else ``lower``."""
    current = lower
    weighed = ([a for i, a in enumerate(args) if i in info.weighed_positions]
               + [v for k, v in kwargs.items() if k in info.weighed_names])
    for t in tensors(tuple(weighed), {}):
        if not castable(t, frame.device_type):  # float64 is ignored, as in PyTorch
            continue
        nxt = t.dtype
        if current is torch.float32 or nxt is torch.float32:
            current = torch.float32
        elif current is lower and nxt is lower:
            continue
        else:
            raise RuntimeError(
                f"Unexpected floating ScalarType in at::autocast::prioritize: a {nxt} input "
                f"meets a {lower} autocast region; cast it to {lower} or float32 first"
            )
    return current


def _first_eligible(args: tuple, frame: Frame) -> bool:
    return bool(args) and isinstance(args[0], torch.Tensor) and castable(args[0], frame.device_type)


def _set_opt_dtype(info: OpInfo, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Set the op's optional ``dtype`` argument to float32 unless the caller set it."""
    i = info.dtype_index
    if not info.dtype_kwarg_only and len(args) > i:
        if args[i] is None:
            args = (*args[:i], torch.float32, *args[i + 1 :])
    elif kwargs.get("dtype") is None:
        kwargs = {**kwargs, "dtype": torch.float32}
    return args, kwargs


# --------------------------------------------------------------------------- runners
def _run_lower(info: OpInfo, frame: Frame, keyset: Any, args: tuple, kwargs: dict) -> Any:
    lower = torch.get_autocast_dtype(frame.device_type)
    return call_below(info, keyset, *_cast_all(args, kwargs, lower, frame))


def _run_fp32(info: OpInfo, frame: Frame, keyset: Any, args: tuple, kwargs: dict) -> Any:
    return call_below(info, keyset, *_cast_all(args, kwargs, torch.float32, frame))


def _run_promote(info: OpInfo, frame: Frame, keyset: Any, args: tuple, kwargs: dict) -> Any:
    lower = torch.get_autocast_dtype(frame.device_type)
    to = _promote_type(info, args, kwargs, frame, lower)
    return call_below(info, keyset, *_cast_all(args, kwargs, to, frame))


def _run_set_opt_dtype(info: OpInfo, frame: Frame, keyset: Any, args: tuple, kwargs: dict) -> Any:
    if info.dtype_index is not None and _first_eligible(args, frame):
        args, kwargs = _set_opt_dtype(info, args, kwargs)
    return call_below(info, keyset, args, kwargs)


def _run_append_dtype(info: OpInfo, frame: Frame, keyset: Any, args: tuple, kwargs: dict) -> Any:
    out = torch.float32 if _first_eligible(args, frame) else args[0].dtype
    # a boxed call leaves out trailing arguments at their defaults; the target may have none
    # (``norm.Scalar``'s ``p=2`` is ``norm.ScalarOpt_dtype``'s required ``p``)
    given = len(args)
    args = (*args, *(a.default_value for a in info.op._schema.arguments[given:]
                     if not a.kwarg_only and a.has_default_value() and a.name not in kwargs))
    with no_autocast():
        return info.append_target(*args, **kwargs, dtype=out)


def _run_banned(info: OpInfo, frame: Frame, keyset: Any, args: tuple, kwargs: dict) -> Any:
    raise RuntimeError(_ops.BANNED_MESSAGES.get(info.name, f"{info.name} is banned in autocast"))


def _run_passthrough(info: OpInfo, frame: Frame, keyset: Any, args: tuple, kwargs: dict) -> Any:
    if wrapped_number(info, args):
        return call_below(info, keyset, args, kwargs)
    if keyset is None:  # from a route op: the op below autocast, its own calls autocast again,
        if info.composite:  # as PyTorch's fallthrough does
            return info.op.decompose(*args, **kwargs)
        with no_autocast():
            return info.op(*args, **kwargs)
    return info.op.redispatch(keyset & BELOW_AUTOCAST, *args, **kwargs)  # as on no list


def _run_fp8(info: OpInfo, frame: Frame, keyset: Any, args: tuple, kwargs: dict) -> Any:
    """``linear`` (and ``addmm``, transformers' Conv1D) of a policy with fp8 layers: the call of
    the fp8 layer being called under ``frame`` runs in fp8, any other as the policy's table says."""
    current = RUNTIME.fp8_target
    if current is not None and current[0] is frame:
        target = current[1]
        call = target.match(info.name, args, kwargs)
        if call is not None:
            x = cached_cast(call[0], torch.get_autocast_dtype(frame.device_type), frame)
            RUNTIME.fp8_target = None  # the GEMM's own calls (a fallback's F.linear) are not the layer's call
            try:
                return target.run(x, call[1], call[2])
            finally:
                RUNTIME.fp8_target = current
    kind = frame.policy.table(frame.device_type).get(info.name, "passthrough")
    return RUNNERS[kind](info, frame, keyset, args, kwargs)


#: cast kind -> its runner ``(info, frame, keyset, args, kwargs) -> result``.
RUNNERS: dict[str, Callable[..., Any]] = {
    "fp8": _run_fp8,
    "lower": _run_lower,
    "fp32": _run_fp32,
    "promote": _run_promote,
    "fp32_set_opt_dtype": _run_set_opt_dtype,
    "fp32_append_dtype": _run_append_dtype,
    "banned": _run_banned,
    "passthrough": _run_passthrough,
}
