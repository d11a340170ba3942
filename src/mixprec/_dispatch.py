"""The one module that touches PyTorch's dispatcher (and Dynamo's guards for it).

Longer than our 500-line guide: the kernels, their registration and their torch.compile
counterparts (the traced region op, the guard on the active policy) share the thread state and
must change together.

Design
------
A region's policy is PyTorch's autocast table plus *edits* (ops moved between lists, presets
such as ``fp32-numerics``). Ops whose cast kind equals PyTorch's run PyTorch's own C++ autocast
kernel with no Python in between: a region sets the thread's autocast state exactly as
``torch.autocast`` does, and the ``AutocastCPU``/``AutocastCUDA`` keys do the rest. Only the
overloads some policy in use edits get a kernel of ours, registered through ``torch.library`` at
the autocast key: it is called exactly where
PyTorch's own kernel is, for every aten op, above autograd (so casts are recorded and backward
runs in the forward's dtypes), inside composites (``nn.MultiheadAttention``, SDPA, ``einsum``),
and under ``torch.compile`` tracing.

The kernel is C++ where it can be (:mod:`mixprec._native`), else Python; both behave the same.
An edited overload's kernel looks up the innermost mixprec frame of its device in this thread;
when that frame edits the op it runs the edited cast kind, otherwise it calls PyTorch's own
kernel for that key, captured before we overrode it (or, for an op PyTorch does not autocast,
redispatches below autocast, as PyTorch's fallthrough does). So a region with the default policy,
plain ``torch.autocast``, and every op no policy edits run at native speed and give bitwise
PyTorch's results, before and after any mixprec region.

Kernels stay registered once a policy has used them (lazy and permanent). The alternative,
registering on region entry and removing on the last exit, was measured on a 2-core CPU
(torch 2.13) at about 14 us to register and 1 us to remove one overload: a policy with k edits
would pay k * 15 us on every region entry (the ``fp32-numerics`` preset edits 55 CPU overloads:
0.8 ms per step, 4% of a 20 ms step and more of a dispatch-bound GPU step), while a kept kernel
costs, on its own op only and only outside regions that edit it, a table lookup (C++ kernel,
about 0.3 us) or one Python call (Python kernel, about 3.5 us). Code that wants PyTorch's
kernels back once it is done with mixprec calls :func:`release_kernels`.
Importing mixprec registers nothing.

Threads: PyTorch does not synchronize changes to the dispatcher with dispatch: it frees a
Python kernel as it is removed, under any thread running it (a segfault there), and removing a
kernel from an op it falls through trips an internal assert in a thread dispatching that op.
So an overload gets its kernel once per process and a region only switches tables (this
thread's frame stack, and the C++ kernel's per-thread active table); kernels go only through
:func:`release_kernels`, which refuses while a region that edits ops is active in any thread
(``_edited``, see :func:`push`), while a call is inside one of our kernels (the C++ kernel counts
its own, native threads included) or while any other thread is alive (``_thread``'s too). fp8
routing (``linear``, ``addmm``) runs in the C++ kernel, which calls a ``mixprec::route_*`` op
(:func:`_define_route`)
only where the thread's table routes the overload, so plain ``torch.autocast`` never enters
Python. Known, without the C++ build: a Python kernel calls PyTorch's kernel
(``get_kernel(...).call_boxed``) holding the GIL; if that kernel waits for PyTorch's cast-cache
lock while another thread clearing the cache (a region's exit) waits for the GIL, both hang.

Semantics follow ``aten/src/ATen/autocast_mode.{h,cpp}``: only defined floating tensors on the
region's device that are not float64 are cast (:func:`mixprec._tree.castable`); the cast of an
fp32 leaf that requires grad to the region's low-precision dtype is cached until the outermost
region exits (the C++ kernel uses PyTorch's own cache, the Python kernel its own); casts and the
op run with autocast excluded for every device.
"""

from __future__ import annotations

import sys
import threading
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch
from torch.library import Library

from mixprec import _native
from mixprec import ops as _ops
from mixprec._ops_names import op_overload
from mixprec._tree import castable

__all__ = ["Frame", "push", "pop", "top", "ensure_kernels", "registered", "release_kernels",
           "DISPATCH_KEYS", "compiler_disable", "assume_constant_result"]

DISPATCH_KEYS: dict[str, str] = {"cpu": "AutocastCPU", "cuda": "AutocastCUDA"}

_EXCLUDE_AUTOCAST = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)
for _k in ("AutocastCUDA", "AutocastXPU", "AutocastMPS", "AutocastHPU", "AutocastIPU",
           "AutocastPrivateUse1"):
    if hasattr(torch._C.DispatchKey, _k):
        _EXCLUDE_AUTOCAST = _EXCLUDE_AUTOCAST | torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, _k))


def _no_autocast() -> Any:
    return torch._C._ExcludeDispatchKeyGuard(_EXCLUDE_AUTOCAST)


# Keys below every autocast key: redispatching with ``keyset & _BELOW_AUTOCAST`` skips autocast for
# this op only, as PyTorch's fallthrough does; ops it calls internally are autocast again.
_BELOW_AUTOCAST = torch._C._dispatch_keyset_full_after(torch._C.DispatchKey.AutocastCPU)


@dataclass(eq=False)  # identity: nested regions with equal policies are distinct frames
class Frame:
    """One active mixprec region of one device in one thread.

    The low-precision dtype and the cache flag are not stored here: like PyTorch's kernels, ours
    read the thread's autocast state, so a region nested inside (``torch.autocast``, a module
    rule) that changes them is followed.
    """

    device_type: str
    edits: Mapping[str, str]  # overload -> cast kind, where it differs from PyTorch's
    policy: Any = None
    traced: bool = False  # pushed by a region traced inside torch.compile
    # (module, recipe, LayerState, backend) of the fp8 layer being called, set by module hooks
    fp8_target: Any = None


@dataclass
class _ThreadState(threading.local):
    frames: dict[str, list[Frame]] = field(default_factory=dict)
    # per device, the edits of the innermost region entered outside compiled code (or None):
    # what compiled code traced under such a region depends on, and is guarded on (see below)
    active: dict[str, Any] = field(default_factory=dict)
    depth: int = 0  # nesting of mixprec regions (enabled or not), for the cache
    traced: list[Frame | None] = field(default_factory=list)  # regions entered by a trace, open
    # [frames with edits active in this thread, calls inside a Python kernel], in _edited
    edited: list[int] | None = None
    cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


_tls = _ThreadState()
# Per thread, the frames with edits active there and the calls inside our Python kernels: while
# any thread has one, release_kernels() refuses (their kernels must stay). Each counter is
# changed by its own thread only (no lock on the hot path); release_kernels sums them under _lock
# after clearing _ensured, so a frame counted after the sum misses _ensured and waits on _lock in
# ensure_kernels (see push). The C++ kernel counts its calls in flight itself (live_calls).
_edited: dict[int, list[int]] = {}  # thread ident -> its counters


def disabled_frame(device_type: str, traced: bool = False) -> Frame:
    """The frame of a disabled region (``enabled=False``): no edits and the default policy, so
    that it governs what runs inside it and an enclosing region's module rules, fp8 layers and
    ``output=`` stop at it, as a nested region's policy does."""
    from mixprec.policy import Policy

    return Frame(device_type, {}, Policy(), traced=traced)


def top(device_type: str) -> Frame | None:
    """The innermost mixprec frame for ``device_type`` in this thread, if any."""
    stack = _tls.frames.get(device_type)
    return stack[-1] if stack else None


def push(frame: Frame | None) -> None:
    """Enter a region (``frame=None``: a region that only counts for the cache).

    A frame with edits is counted first, then its kernels are ensured: from then on until its
    :func:`pop`, :func:`release_kernels` in any thread refuses instead of removing them.
    """
    if frame is not None and frame.edits:
        counter = _tls.edited or _edited_counter()
        counter[0] += 1
        if _ensured.get((id(frame.edits), frame.device_type)) is not frame.edits:
            try:
                ensure_kernels(frame.edits, frame.device_type)
            except BaseException:
                counter[0] -= 1
                raise
    _tls.depth += 1
    if frame is not None:
        _tls.frames.setdefault(frame.device_type, []).append(frame)
        if not frame.traced:
            _tls.active[frame.device_type] = _edits_key(frame.edits)
        if _native_ops is not None:
            _native.set_active(_native_ops, frame.device_type, _edits_key(frame.edits), frame.edits)


def _edited_counter() -> list[int]:
    with _lock:  # release_kernels iterates _edited under it
        counter = _tls.edited = _edited.setdefault(threading.get_ident(), [0, 0])
    return counter


def pop(frame: Frame | None) -> None:
    """Leave a region; the outermost exit clears the cast cache."""
    if frame is not None:
        stack = _tls.frames[frame.device_type]
        if stack[-1] is frame:
            stack.pop()
        else:  # left out of order (a generator's region): by identity, equal frames are distinct
            del stack[next(i for i, f in enumerate(stack) if f is frame)]
        if frame.edits:
            _tls.edited[0] -= 1
        if not frame.traced:
            eager = next((f for f in reversed(stack) if not f.traced), None)
            _tls.active[frame.device_type] = None if eager is None else _edits_key(eager.edits)
        if _native_ops is not None:
            edits = stack[-1].edits if stack else None
            _native.set_active(_native_ops, frame.device_type, _edits_key(edits or {}), edits)
    _tls.depth -= 1
    if _tls.depth == 0:
        _tls.cache.clear()


# --------------------------------------------------------------------------- torch.compile
# A region around a compiled call: the compiled graph bakes in the casts of the policy it was
# traced under. Whenever one of our kernels runs while Dynamo traces, it adds a guard on the
# edits of the innermost eager region (``_tls.active``): called under a policy with other
# edits, the function recompiles. A graph traced before any kernel existed has no such guard;
# so registering new kernels resets Dynamo's caches once (see ensure_kernels).
_EDITS_KEYS: dict[Any, int] = {}


def _edits_key(edits: Mapping[str, str]) -> int | None:
    """A small integer naming a set of edits (equal edits, equal key); ``None`` for no edits,
    which is plain ``torch.autocast``."""
    if not edits:
        return None
    hit = _EDITS_BY_ID.get(id(edits))
    if hit is not None and hit[0] is edits:
        return hit[1]
    items = tuple(edits.items())
    with _keys_lock:  # one key per set of edits, whichever threads ask at once
        key = _EDITS_KEYS.setdefault(items, len(_EDITS_KEYS))
    _EDITS_BY_ID[id(edits)] = (edits, key)  # edits are cached values; the ref keeps the id unique
    return key


_EDITS_BY_ID: dict[int, tuple[Mapping[str, str], int]] = {}
_keys_lock = threading.Lock()  # numbering new edits (here) and traced policies (traced_key)


def _guard_on_active_policy(device_type: str) -> None:
    """While Dynamo traces: make the compiled code depend on this thread's active edits."""
    try:
        from torch._dynamo.guards import GuardBuilder, install_guard
        from torch._dynamo.source import AttrSource, DictGetItemSource, ImportSource
        from torch._guards import TracingContext
    except ImportError:  # a torch without these internals: nothing to guard with
        return
    if TracingContext.try_get() is None:
        return
    active = AttrSource(AttrSource(AttrSource(ImportSource("mixprec"), "_dispatch"), "_tls"), "active")
    if device_type not in _tls.active:
        _tls.active[device_type] = None
    install_guard(DictGetItemSource(active, device_type).make_guard(GuardBuilder.EQUALS_MATCH))


def _reset_compiled_code() -> None:
    """Drop Dynamo's compiled code once new kernels exist: it was traced without them."""
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is None or torch.compiler.is_compiling():
        return
    from torch._dynamo.utils import counters

    if counters["stats"]["unique_graphs"]:
        dynamo.reset()


# Decorators for Dynamo, applied once Dynamo is imported: ``torch.compiler.disable`` and
# ``assume_constant_result`` import ``torch._dynamo`` (and sympy: about 3 s of CPU, as long as
# torch itself), and nothing compiles before Dynamo is imported. A function so decorated is
# registered here and decorated, in its module, right after ``torch._dynamo`` is executed (a
# finder on ``sys.meta_path`` sees the import), before any trace can read its module's globals.
_FOR_DYNAMO: list[tuple[str, str, str]] = []  # (module, function name, "disable" | "constant")


def compiler_disable(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.compiler.disable(fn)`` without importing Dynamo before compile is in play: ``fn``
    as it is until ``torch._dynamo`` is imported, then its module's global holds the disabled
    function. Callers must reach it through that global (a module-level function)."""
    return _for_dynamo(fn, "disable")


def assume_constant_result(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.compiler.assume_constant_result(fn)`` without importing Dynamo before compile is
    in play (it marks ``fn`` in place once ``torch._dynamo`` is imported)."""
    return _for_dynamo(fn, "constant")


def _for_dynamo(fn: Callable[..., Any], kind: str) -> Callable[..., Any]:
    if "torch._dynamo" in sys.modules:
        return _decorated(fn, kind)
    _FOR_DYNAMO.append((fn.__module__, fn.__name__, kind))
    if not any(isinstance(f, _OnDynamoImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _OnDynamoImport())
    return fn


def _decorated(fn: Callable[..., Any], kind: str) -> Callable[..., Any]:
    return torch.compiler.disable(fn) if kind == "disable" else torch.compiler.assume_constant_result(fn)


def _decorate_for_dynamo() -> None:
    """Apply the registered decorators (``torch._dynamo`` has just been executed)."""
    while _FOR_DYNAMO:
        module, name, kind = _FOR_DYNAMO.pop(0)
        namespace = sys.modules[module]
        setattr(namespace, name, _decorated(getattr(namespace, name), kind))


class _OnDynamoImport:
    """A ``sys.meta_path`` finder that finds nothing itself: when ``torch._dynamo`` is imported,
    it lets the other finders find it and runs :func:`_decorate_for_dynamo` once the module has
    executed. It removes itself on that import."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != "torch._dynamo":
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        spec = next((found for finder in sys.meta_path if hasattr(finder, "find_spec")
                     for found in [finder.find_spec(name, path, target)] if found is not None), None)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        execute = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            execute(module)
            _decorate_for_dynamo()

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


# A region inside a compiled function is traced as two graph nodes around its body:
# ``torch.amp._enter_autocast`` (which Dynamo knows) and our ``mixprec::region`` op, whose fake
# kernel pushes (or pops) the region's frame wherever the graph is traced (Dynamo's example
# values, AOTAutograd) and whose real kernel does the same where the graph runs eagerly. The
# frame's policy travels as an integer key into ``_TRACED``; kernels for the policy's edits are
# registered at trace time, before AOTAutograd traces through them.
_TRACED: dict[int, tuple[str, Mapping[str, str], Any]] = {}
_TRACED_KEYS: dict[tuple[int, str], int] = {}
_region_op: Any = None


def traced_key(policy: Any, device_type: str) -> int:
    """The key of ``policy`` on ``device_type`` for ``mixprec::region``; registers kernels.

    Keyed by the identity of the policy's canonical object (one per value and fp8 guard and
    controller: equality leaves those out, and a traced region must run with its own; ``_TRACED``
    keeps the object alive, so ids stay unique)."""
    policy = getattr(policy, "_canonical", policy)
    key = _TRACED_KEYS.get((id(policy), device_type))
    if key is None:
        with _keys_lock:
            key = _TRACED_KEYS.get((id(policy), device_type))
            if key is None:
                key = len(_TRACED)
                _TRACED[key] = (device_type, policy.edits(device_type), policy)
                _TRACED_KEYS[(id(policy), device_type)] = key
    ensure_kernels(_TRACED[key][1], device_type)
    _define_region_op()
    handler = getattr(sys.modules.get("torch._dynamo"), "callback_handler", None)
    if handler is not None and _drop_traced_frames not in handler.end_callbacks:  # (again after a reset)
        handler.register_end_callback(_drop_traced_frames)
    return key


def _drop_traced_frames(_args: Any = None) -> None:
    """When Dynamo finishes compiling: leave the regions it traced in this thread and left open
    (a graph break inside the region ends the trace there), which would otherwise govern this
    thread's later ops."""
    while _tls.traced:
        pop(_tls.traced.pop())


def _region(device_type: str, key: int, enter: bool) -> None:
    """Enter (or leave) the traced region ``key``; ``-1`` is a disabled region."""
    if enter:
        frame = Frame(*_TRACED[key], traced=True) if key >= 0 else disabled_frame(device_type, traced=True)
        push(frame)
        _tls.traced.append(frame)
    elif _tls.traced:  # else entered by an earlier trace, which ended at a graph break inside it
        pop(_tls.traced.pop())


def _define_region_op() -> None:
    """Define ``mixprec::region`` once: a CompositeImplicitAutograd op, so that AOTAutograd runs
    it while tracing and leaves nothing of it in the graphs it hands to a compiler."""
    global _region_op
    if _region_op is not None:
        return
    with _lock:
        if _region_op is None:
            lib = Library("mixprec", "DEF")
            lib.define("region(str device_type, int key, bool enter) -> ()")
            lib.impl("region", _region_impl, "CompositeImplicitAutograd")
            lib.define("trace_hook(int device) -> ()")  # called by the C++ kernel while tracing
            lib.impl("trace_hook", _trace_hook_impl, "CompositeImplicitAutograd")
            overload = torch.ops.mixprec.region.default
            if hasattr(torch.fx.node, "has_side_effect"):
                torch.fx.node.has_side_effect(overload)
            else:  # torch < 2.6
                torch.fx.node._side_effectful_functions.add(overload)
            _region_op = lib


def _region_impl(device_type: str, key: int, enter: bool) -> None:
    _region(device_type, key, enter)


def _trace_hook_impl(device: int) -> None:
    if torch.compiler.is_compiling():
        _guard_on_active_policy(list(DISPATCH_KEYS)[device])


# --------------------------------------------------------------------------- casting
_eligible = castable


# dtype -> the Tensor method that casts to it: same result as ``t.to(dtype)``, cheaper to call
_CAST_METHOD = {
    torch.bfloat16: torch.Tensor.bfloat16,
    torch.float16: torch.Tensor.half,
    torch.float32: torch.Tensor.float,
}


def _to(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    method = _CAST_METHOD.get(dtype)
    return method(t) if method is not None else t.to(dtype)


def _cached_cast(t: Any, to: torch.dtype, frame: Frame) -> Any:
    if not isinstance(t, torch.Tensor) or t.dtype is to or not _eligible(t, frame.device_type):
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
    ):
        hit = _tls.cache.get(id(t))
        if hit is not None and hit[0] is t:
            return hit[1]
        # Cast with grad enabled so that a cast first made under no_grad still carries a
        # grad_fn when a later, grad-enabled forward of the same region reuses it.
        with torch.enable_grad():
            casted = _to(t, to)
        _tls.cache[id(t)] = (t, casted)  # the strong ref keeps id(t) unique while cached
        return casted
    return _to(t, to)


def _cast_arg(a: Any, to: torch.dtype, frame: Frame) -> Any:
    if isinstance(a, torch.Tensor):
        return _cached_cast(a, to, frame)
    if isinstance(a, (list, tuple)) and a and any(isinstance(x, torch.Tensor) for x in a):
        return type(a)(_cached_cast(x, to, frame) for x in a)
    return a


def _cast_all(args: tuple, kwargs: dict, to: torch.dtype, frame: Frame) -> tuple[tuple, dict]:
    args = tuple([_cast_arg(a, to, frame) for a in args])
    if kwargs:
        kwargs = {k: _cast_arg(v, to, frame) for k, v in kwargs.items()}
    return args, kwargs


def _tensors(args: tuple, kwargs: dict):
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            for x in a:
                if isinstance(x, torch.Tensor):
                    yield x


def _promote_type(args: tuple, kwargs: dict, frame: Frame, lower: torch.dtype) -> torch.dtype:
    current = lower
    for t in _tensors(args, kwargs):
        if not _eligible(t, frame.device_type):  # float64 is ignored, as in PyTorch
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
    return bool(args) and isinstance(args[0], torch.Tensor) and _eligible(args[0], frame.device_type)


def _set_opt_dtype(info: "_OpInfo", args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Set the op's optional ``dtype`` argument to float32 unless the caller set it."""
    i = info.dtype_index
    if not info.dtype_kwarg_only and len(args) > i:
        if args[i] is None:
            args = (*args[:i], torch.float32, *args[i + 1 :])
    elif kwargs.get("dtype") is None:
        kwargs = {**kwargs, "dtype": torch.float32}
    return args, kwargs


# --------------------------------------------------------------------------- kernels
@dataclass(frozen=True)
class _OpInfo:
    name: str
    op: "torch._ops.OpOverload"
    dtype_index: int | None  # position of the optional `dtype` argument (set_opt_dtype)
    dtype_kwarg_only: bool
    append_target: "torch._ops.OpOverload | None"
    # A CompositeImplicitAutograd op calls other ops from the top of the dispatcher: it runs with
    # autocast excluded, as PyTorch's kernels do. Any other op is redispatched below autocast,
    # which is the same and saves a Python-to-dispatcher round trip.
    composite: bool


def _op_info(name: str, op: "torch._ops.OpOverload") -> _OpInfo:
    dtype_index, kwarg_only = None, False
    positional = 0
    for arg in op._schema.arguments:
        if arg.name == "dtype":
            dtype_index, kwarg_only = positional, arg.kwarg_only
            break
        if not arg.kwarg_only:
            positional += 1
    target_name = _ops.APPEND_DTYPE_TARGETS.get(name)
    composite = torch._C._dispatch_has_kernel_for_dispatch_key(
        op.name(), "CompositeImplicitAutograd")
    return _OpInfo(name, op, dtype_index, kwarg_only,
                   op_overload(target_name) if target_name else None, composite)


def _call(info: _OpInfo, keyset: Any, args: tuple, kwargs: dict) -> Any:
    """Run the op below autocast on (already cast) arguments."""
    if info.composite or keyset is None:  # None: called from a route op (_define_route)
        with _no_autocast():
            return info.op(*args, **kwargs)
    return info.op.redispatch(keyset & _BELOW_AUTOCAST, *args, **kwargs)


def _run_lower(info: _OpInfo, frame: Frame, keyset: Any, args: tuple, kwargs: dict) -> Any:
    lower = torch.get_autocast_dtype(frame.device_type)
    return _call(info, keyset, *_cast_all(args, kwargs, lower, frame))


def _run_fp32(info: _OpInfo, frame: Frame, keyset: Any, args: tuple, kwargs: dict) -> Any:
    return _call(info, keyset, *_cast_all(args, kwargs, torch.float32, frame))


def _run_promote(info: _OpInfo, frame: Frame, keyset: Any, args: tuple, kwargs: dict) -> Any:
    lower = torch.get_autocast_dtype(frame.device_type)
    to = _promote_type(args, kwargs, frame, lower)
    return _call(info, keyset, *_cast_all(args, kwargs, to, frame))


def _run_set_opt_dtype(info: _OpInfo, frame: Frame, keyset: Any, args: tuple, kwargs: dict) -> Any:
    if info.dtype_index is not None and _first_eligible(args, frame):
        args, kwargs = _set_opt_dtype(info, args, kwargs)
    return _call(info, keyset, args, kwargs)


def _run_append_dtype(info: _OpInfo, frame: Frame, keyset: Any, args: tuple, kwargs: dict) -> Any:
    out = torch.float32 if _first_eligible(args, frame) else args[0].dtype
    with _no_autocast():
        return info.append_target(*args, **kwargs, dtype=out)


def _run_banned(info: _OpInfo, frame: Frame, keyset: Any, args: tuple, kwargs: dict) -> Any:
    raise RuntimeError(_ops.BANNED_MESSAGES.get(info.name, f"{info.name} is banned in autocast"))


def _run_passthrough(info: _OpInfo, frame: Frame, keyset: Any, args: tuple, kwargs: dict) -> Any:
    if keyset is None:  # from a route op (see _define_route): the op below autocast, its own
        if info.composite:  # calls autocast again, as PyTorch's fallthrough does
            return info.op.decompose(*args, **kwargs)
        with _no_autocast():
            return info.op(*args, **kwargs)
    return info.op.redispatch(keyset & _BELOW_AUTOCAST, *args, **kwargs)  # as on no list


def _run_fp8(info: _OpInfo, frame: Frame, keyset: Any, args: tuple, kwargs: dict) -> Any:
    """``linear`` (and ``addmm``, transformers' Conv1D) of a policy with fp8 layers: the selected
    layer's GEMM runs in fp8, any other call as the policy's table says."""
    target = frame.fp8_target
    if target is not None:
        from mixprec import fp8
        from mixprec.fp8._like import routed_call

        call = routed_call(info.name, target[0], args, kwargs)
        if call is not None:
            module, recipe, state, backend = target
            x = _cached_cast(call[0], torch.get_autocast_dtype(frame.device_type), frame)
            return fp8.linear(x, call[1], call[2], recipe, state=state, backend=backend)
    kind = frame.policy.table(frame.device_type).get(info.name, "passthrough")
    return _RUNNERS[kind](info, frame, keyset, args, kwargs)


_RUNNERS: dict[str, Callable[..., Any]] = {
    "fp8": _run_fp8,
    "lower": _run_lower,
    "fp32": _run_fp32,
    "promote": _run_promote,
    "fp32_set_opt_dtype": _run_set_opt_dtype,
    "fp32_append_dtype": _run_append_dtype,
    "banned": _run_banned,
    "passthrough": _run_passthrough,
}


_libs: dict[tuple[str, str], Library] = {}  # (overload, key) -> the library holding our kernel
# (overload, key) -> "native" (the C++ kernel), "python", or False (no such overload)
_registered: dict[tuple[str, str], str | bool] = {}
_torch_kernels: dict[tuple[str, str], Any] = {}  # PyTorch's own kernels, captured before ours
_lock = threading.Lock()
_native_ops: Any = None  # torch.ops.mixprec_native once loaded (see mixprec._native)
_ensured: dict[tuple[int, str], Any] = {}  # (id(edits), device) -> edits whose kernels exist


def _make_kernel(info: _OpInfo, device_type: str, native: Any) -> Callable[..., Any]:
    name, op = info.name, info.op

    def kernel(keyset: Any, *args: Any, **kwargs: Any) -> Any:
        counter = _tls.edited or _edited_counter()
        counter[1] += 1  # a call in flight: release_kernels refuses until it returns
        try:
            if torch.compiler.is_compiling():
                _guard_on_active_policy(device_type)
            stack = _tls.frames.get(device_type)
            if stack:
                frame = stack[-1]
                kind = frame.edits.get(name)
                if kind is not None:
                    return _RUNNERS[kind](info, frame, keyset, args, kwargs)
            if native is not None:  # a region that does not edit this op, or plain torch.autocast
                return native.call_boxed(keyset, *args, **kwargs)
            # PyTorch falls through for ops it does not autocast
            return op.redispatch(keyset & _BELOW_AUTOCAST, *args, **kwargs)
        finally:
            counter[1] -= 1

    return kernel


def ensure_kernels(names: Mapping[str, str], device_type: str) -> None:
    """Register our kernel for each overload of ``names`` (a policy's
    :meth:`~mixprec.Policy.edits`: overload -> kind) at the device's autocast key, once.

    The ops a policy does not edit keep PyTorch's kernel. An overload whose edited kind and
    PyTorch's kind the C++ kernel runs gets it (:mod:`mixprec._native`; fp8 routing calls its
    ``mixprec::route_*`` op from there, so outside fp8 regions ``linear``/``addmm`` never enter
    Python); the others (``fp32_append_dtype``, ``banned``), or every one without the C++
    kernel, get a Python kernel, which stays once given. Overloads this PyTorch does not have are skipped.
    """
    hit = _ensured.get((id(names), device_type))
    if hit is not None and hit is names:
        return
    key = DISPATCH_KEYS[device_type]
    table = _ops.default_table(device_type)
    wanted = {n: ("native" if _native.runs(kind) and _native.runs(table.get(n, "passthrough")) else "python")
              for n, kind in names.items()}
    global _native_ops
    if "native" in wanted.values() and _native_ops is None and _native.enabled():
        _native_ops = _native.load()
        if _native_ops is not None:
            _native.define_defaults(_native_ops)
            _define_region_op()  # and mixprec::trace_hook, which the C++ kernel calls
            for dev in DISPATCH_KEYS:  # regions already active in this thread
                if top(dev) is not None:
                    _native.set_active(_native_ops, dev, _edits_key(top(dev).edits), top(dev).edits)
    with _lock:  # what is missing is decided here: not while release_kernels removes kernels
        if _native_ops is not None:  # an fp8 overload's C++ kernel calls its route op
            for name in [n for n, kind in names.items() if kind == "fp8" and wanted[n] == "native"]:
                if op_overload(name) is not None:
                    _define_route(name)
        missing = [n for n, impl in wanted.items()
                   if _registered.get((n, key)) not in (impl, "python", False)]
        get_kernel = getattr(torch.library, "get_kernel", None)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*Overriding a previously registered kernel")
            warnings.filterwarnings("ignore", message=".*Warning only once for all operators")
            for name in missing:
                op = op_overload(name)
                if op is None:
                    _registered[(name, key)] = False
                    continue
                if (name, key) not in _torch_kernels:
                    native = None
                    if torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{name}", key):
                        if get_kernel is not None:
                            native = get_kernel(op, key)
                        else:  # torch < 2.9: emulate PyTorch's kernel with its own table
                            native = _Emulated(_op_info(name, op), device_type)
                    _torch_kernels[(name, key)] = native
                if wanted[name] == "native" and _native_ops is not None:
                    _native_ops.register_kernel(name, list(DISPATCH_KEYS).index(device_type))
                    _registered[(name, key)] = "native"
                    continue
                _libs[(name, key)] = _python_kernel(name, op, device_type)
                _registered[(name, key)] = "python"
        _ensured[(id(names), device_type)] = names  # (cached) edits done: skip next time
    if missing:
        _reset_compiled_code()


_routes: dict[str, Library] = {}  # overload -> the library defining its mixprec::route_* op


def _define_route(name: str) -> None:
    """Define ``mixprec::route_<name>`` (the overload's schema, a CompositeImplicitAutograd Python
    body: :func:`_run_fp8` under the thread's innermost frame) and make the C++ kernel call it
    where the active table routes ``name`` (kind ``fp8``). Called under ``_lock``, once."""
    if name in _routes:
        return
    op = op_overload(name)
    target = "route_" + name.replace(".", "_")
    schema = str(op._schema)
    lib = Library("mixprec", "FRAGMENT")
    lib.define(target + schema[schema.index("("):])
    info = _op_info(name, op)

    @torch.compiler.disable  # never a frame of its own for Dynamo (eager code between graph breaks)
    def route(*args: Any, **kwargs: Any) -> Any:
        frame = top("cuda" if next(_tensors(args, kwargs)).is_cuda else "cpu")
        if frame is None or frame.edits.get(name) != "fp8":  # the C++ kernel routes only for these
            raise RuntimeError(f"mixprec: {name} was routed to fp8 outside a region with fp8 layers")
        return _run_fp8(info, frame, None, args, kwargs)

    lib.impl(target, route, "CompositeImplicitAutograd")
    _native_ops.define_route(name, f"mixprec::{target}")
    _routes[name] = lib


def _python_kernel(name: str, op: Any, device_type: str) -> Library:
    lib = Library("aten", "IMPL")  # kept in _libs for good: dropping it would remove the kernel
    key = DISPATCH_KEYS[device_type]
    lib.impl(name, _make_kernel(_op_info(name, op), device_type, _torch_kernels[(name, key)]), key,
             with_keyset=True)
    return lib


def release_kernels() -> int:
    """Remove every mixprec kernel: PyTorch's own autocast kernels run every op again.

    Only where nothing else can be dispatching: PyTorch does not synchronize removing a kernel
    with other threads' dispatch (it frees a Python kernel under a thread running it, and trips
    an internal assert in a thread dispatching an op PyTorch falls through), and a thread can be
    on its way into a kernel (the dispatcher has chosen it) before any count of ours sees it. So
    this refuses while a call is inside one of our kernels in any thread (counted by the C++
    kernel and the Python kernels: native threads included), while a region that edits ops is
    active in any thread, and while any other thread is alive: ``threading``'s, those started
    with ``_thread.start_new_thread``, and native threads running Python code. Kept kernels cost
    little (see the module docstring) and give PyTorch's casts outside the regions that edit
    their op, so leaving them is always safe. Regions entered later register what they need
    again. Not seen: a native thread that never runs Python (a C++ thread of an extension, a
    TorchScript ``fork``) and is not inside one of our kernels at the moment of the call; call
    this only once such threads have stopped dispatching under autocast.

    Returns:
        How many kernels were removed.

    Raises:
        RuntimeError: a call is inside a mixprec kernel, a mixprec region that edits ops is
            active (its ops would silently lose the policy's casts), or other threads are alive;
            nothing is removed.

    Example:
        >>> with mixprec.autocast("cpu", policy="fp32-numerics"):
        ...     loss = model(x).sum()
        >>> mixprec.release_kernels()  # doctest: +SKIP
        46
    """
    with _lock:
        _ensured.clear()  # first: a region counted after the sum below finds nothing ensured
        active = sum(c[0] for c in _edited.values())
        if active:
            here = _tls.edited[0] if _tls.edited else 0
            raise RuntimeError(
                f"release_kernels() while {active} mixprec.autocast region(s) that edit ops are "
                f"active ({here} in this thread, {active - here} in other threads): their ops would "
                "silently lose the policy's casts; call it after the regions exit")
        calls = sum(c[1] for c in _edited.values())
        calls += _native_ops.live_calls() if _native_ops is not None else 0
        if calls:
            raise RuntimeError(
                f"release_kernels() while {calls} op call(s) are inside mixprec kernels (in other "
                "threads, native ones included): PyTorch would remove a kernel under them (a crash "
                "there); call it once they have stopped dispatching, or keep the kernels")
        others = _other_threads()
        if others:
            raise RuntimeError(
                f"release_kernels() while other threads are alive ({', '.join(others[:5])}): "
                "PyTorch does not synchronize removing a kernel with their dispatch (a crash "
                "there); call it once they have finished, or keep the kernels (outside regions "
                "that edit their op they give PyTorch's casts)")
        n = _native_ops.release_kernels() if _native_ops is not None else 0
        for lib in _libs.values():
            lib._destroy()
        n += len(_libs)
        _libs.clear()
        _registered.clear()
    return n


def _other_threads() -> list[str]:
    """The threads other than this one that may dispatch ops: every thread running Python code
    (``threading``'s, those ``_thread.start_new_thread`` started, which ``threading`` does not
    list, native threads inside Python now), and threads ``_thread`` is starting or ending."""
    import _thread

    me = threading.get_ident()
    names = {t.ident: t.name for t in threading.enumerate()}
    others = [names.get(i, f"thread {i}, not started by threading") for i in sys._current_frames() if i != me]
    if not others and _thread._count() > (threading.current_thread() is not threading.main_thread()):
        others.append("a thread starting or finishing")
    return others


def registered(device_type: str) -> frozenset[str]:
    """The overloads that have a mixprec kernel at ``device_type``'s autocast key."""
    key = DISPATCH_KEYS[device_type]
    return frozenset(n for (n, k), ok in _registered.items() if ok and k == key)


class _Emulated:
    """Stand-in for PyTorch's kernel on versions without ``torch.library.get_kernel``."""

    def __init__(self, info: _OpInfo, device_type: str) -> None:
        self.info, self.device_type = info, device_type
        self.kind = _ops.default_table(device_type).get(info.name, "passthrough")

    def call_boxed(self, keyset: Any, *args: Any, **kwargs: Any) -> Any:
        frame = Frame(self.device_type, {})
        return _RUNNERS[self.kind](self.info, frame, keyset, args, kwargs)
