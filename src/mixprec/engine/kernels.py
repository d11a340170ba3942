"""Our kernels at PyTorch's autocast keys: registering (:func:`ensure_kernels`), fp8 routing,
removing (:func:`release_kernels`). The one module that changes the dispatcher.

Design
------
A region's policy is PyTorch's autocast table plus *edits* (ops moved between lists, presets
such as ``fp32-numerics``). Ops whose cast kind equals PyTorch's run PyTorch's own C++ autocast
kernel with no Python in between: a region sets the thread's autocast state exactly as
``torch.autocast`` does, and the ``AutocastCPU``/``AutocastCUDA`` keys do the rest. Only the
overloads some policy in use edits get a kernel of ours, registered through ``torch.library`` at
the autocast key: it is called exactly where PyTorch's own kernel is, for every aten op, above
autograd (so casts are recorded and backward runs in the forward's dtypes), inside composites
(``nn.MultiheadAttention``, SDPA, ``einsum``), and under ``torch.compile`` tracing.

The kernel is C++ where it can be (:mod:`mixprec._native`), else Python; both behave the same.
An edited overload's kernel looks up the innermost mixprec frame of its device in this thread
(:data:`~mixprec.engine.runtime.RUNTIME`); when that frame edits the op it runs the edited cast
kind (:mod:`mixprec.engine.casts`), otherwise it calls PyTorch's own kernel for that key,
captured before we overrode it (or, for an op PyTorch does not autocast, redispatches below
autocast, as PyTorch's fallthrough does). So a region with the default policy, plain
``torch.autocast``, and every op no policy edits run at native speed and give bitwise PyTorch's
results, before and after any mixprec region.

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
(the runtime's counters), while a call is inside one of our kernels (the C++ kernel counts its
own, native threads included) or while any other thread is alive (``_thread``'s too): so no
thread can be between ensuring a region's kernels and entering it while they are removed. fp8
routing (``linear``, ``addmm``) runs in the C++ kernel, which calls a ``mixprec::route_*`` op
(:func:`_define_route`) only where the thread's table routes the overload, so plain
``torch.autocast`` never enters Python. Without the C++ build a Python kernel never calls
PyTorch's autocast kernel either: it runs PyTorch's cast kind itself (:mod:`.casts`, bitwise the
same), since PyTorch's kernel, called from Python, holds the GIL while it waits for PyTorch's
cast-cache lock, and a thread clearing that cache (a region's exit) holds the lock while it waits
for the GIL (a deadlock, measured: 3 stress runs of 3). Its weight casts then go to mixprec's cache
inside a mixprec region, and outside every one (a plain ``torch.autocast`` calling an op a
policy gave a Python kernel) are made afresh on each call: the same values, more casts.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
import warnings
from typing import Any, Callable, Mapping

import torch
from torch.library import Library

from mixprec import _native
from mixprec import ops as _ops
from mixprec._ops_names import op_overload
from mixprec.engine.casts import BELOW_AUTOCAST, RUNNERS, OpInfo, call_below, op_info, tensors, wrapped_number
from mixprec.engine.dynamo import reset_compiled_code
from mixprec.engine.runtime import COUNTERS_LOCK, DEVICES, RUNTIME, Frame, edited_totals, show_table, top

__all__ = ["DISPATCH_KEYS", "ensure_kernels", "registered", "added", "release_kernels", "guard_on_active_policy"]

DISPATCH_KEYS: dict[str, str] = {"cpu": "AutocastCPU", "cuda": "AutocastCUDA"}

# Registries, process-wide like the dispatcher they mirror (kernels are registered once per
# process, see the module docstring); changed under _lock.
_libs: dict[tuple[str, str], Library] = {}  # (overload, key) -> the library holding our kernel
# (overload, key) -> "native" (the C++ kernel), "python", or False (no such overload)
_registered: dict[tuple[str, str], str | bool] = {}
_torch_kernels: dict[tuple[str, str], Any] = {}  # PyTorch's own kernels, captured before ours
_ensured: dict[tuple[int, str], Any] = {}  # (id(edits), device) -> edits whose kernels exist
_routes: dict[str, Library] = {}  # overload -> the library defining its mixprec::route_* op
_hook_lib: list[Library] = []  # the library defining mixprec::trace_hook, once
_lock = threading.Lock()


# A region around a compiled call: the compiled graph bakes in the casts of the policy it was
# traced under. Whenever one of our kernels runs while Dynamo traces, and whenever a traced module
# hook reads the policy (mixprec.engine.module_calls), it adds a guard on the key of the innermost
# eager region's policy (``RUNTIME.active``, attribute path ``mixprec.engine.runtime.RUNTIME.active``,
# see :func:`mixprec.engine.runtime.policy_key`): called under a policy with other edits, module
# rules, fp8 rule or ``output=``, the function recompiles. A graph traced before any kernel existed
# has no such guard; so registering new kernels resets Dynamo's caches once
# (:func:`mixprec.engine.dynamo.reset_compiled_code`); the module hooks do the same once they stay.
def guard_on_active_policy(device_type: str) -> None:
    """While Dynamo traces: make the compiled code depend on this thread's active policy on
    ``device_type`` (its key; outside Dynamo's tracing, nothing)."""
    try:
        from torch._dynamo.guards import GuardBuilder, install_guard
        from torch._dynamo.source import AttrSource, DictGetItemSource, ImportSource
        from torch._guards import TracingContext
    except ImportError:  # a torch without these internals: nothing to guard with
        return
    if TracingContext.try_get() is None:
        return
    runtime = AttrSource(AttrSource(AttrSource(ImportSource("mixprec"), "engine"), "runtime"), "RUNTIME")
    if device_type not in RUNTIME.active:
        RUNTIME.active[device_type] = None
    install_guard(DictGetItemSource(AttrSource(runtime, "active"), device_type).make_guard(GuardBuilder.EQUALS_MATCH))



def _make_kernel(info: OpInfo, device_type: str, native: Any) -> Callable[..., Any]:
    name, op = info.name, info.op
    # PyTorch's own kind of the op, run by our runner where no frame edits it: PyTorch's kernel,
    # called from Python, would hold the GIL while it waits for PyTorch's cast-cache lock, which a
    # thread clearing that cache (a region's exit) holds while it waits for the GIL: a deadlock.
    # Called as PyTorch's kernel calls it, from the top with autocast excluded (the op's own calls
    # of other ops are not autocast: ``stack``'s ``cat``)
    own = _ops.default_table(device_type).get(name) if native is not None else None
    own_info = dataclasses.replace(info, composite=True)

    def kernel(keyset: Any, *args: Any, **kwargs: Any) -> Any:
        counter = RUNTIME.edited or RUNTIME.counters()
        counter[1] += 1  # a call in flight: release_kernels refuses until it returns
        try:
            if torch.compiler.is_compiling():
                guard_on_active_policy(device_type)
            stack = RUNTIME.frames.get(device_type)
            frame = stack[-1] if stack else None
            kind = frame.edits.get(name) if frame is not None else None
            if kind is not None:
                return RUNNERS[kind](info, frame, keyset, args, kwargs)
            if own is not None:  # a region that does not edit this op, or plain torch.autocast
                return RUNNERS[own](own_info, frame or Frame(device_type, {}), keyset, args, kwargs)
            if native is not None:  # (an op PyTorch autocasts that our tables do not know)
                return native.call_boxed(keyset, *args, **kwargs)
            # PyTorch falls through for ops it does not autocast
            if wrapped_number(info, args):
                return call_below(info, keyset, args, kwargs)
            return op.redispatch(keyset & BELOW_AUTOCAST, *args, **kwargs)
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
    native_ops = _native.tables()
    if "native" in wanted.values() and native_ops is None and _native.enabled():
        native_ops = _native.load()
        if native_ops is not None:
            _native.define_defaults(native_ops)
            _define_trace_hook()  # which the C++ kernel calls while Dynamo traces
            for dev in DEVICES:  # regions already active in this thread
                if top(dev) is not None:
                    show_table(dev, top(dev).edits)
    with _lock:  # what is missing is decided here: not while release_kernels removes kernels
        if native_ops is not None:  # an fp8 overload's C++ kernel calls its route op
            for name in [n for n, kind in names.items() if kind == "fp8" and wanted[n] == "native"]:
                if op_overload(name) is not None:
                    _define_route(name, native_ops)
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
                            native = _Emulated(op_info(name, op), device_type)
                    _torch_kernels[(name, key)] = native
                if wanted[name] == "native" and native_ops is not None:
                    native_ops.register_kernel(name, list(DISPATCH_KEYS).index(device_type))
                    _registered[(name, key)] = "native"
                    continue
                _libs[(name, key)] = _python_kernel(name, op, device_type)
                _registered[(name, key)] = "python"
        _ensured[(id(names), device_type)] = names  # (cached) edits done: skip next time
    if missing:
        reset_compiled_code()


def _define_route(name: str, native_ops: Any) -> None:
    """Define ``mixprec::route_<name>`` (the overload's schema, a CompositeImplicitAutograd Python
    body: the ``fp8`` runner under the thread's innermost frame) and make the C++ kernel call it
    where the active table routes ``name`` (kind ``fp8``). Called under ``_lock``, once."""
    if name in _routes:
        return
    op = op_overload(name)
    target = "route_" + name.replace(".", "_")
    schema = str(op._schema)
    lib = Library("mixprec", "FRAGMENT")
    lib.define(target + schema[schema.index("("):])
    info = op_info(name, op)
    run_fp8 = RUNNERS["fp8"]

    @torch.compiler.disable  # never a frame of its own for Dynamo (eager code between graph breaks)
    def route(*args: Any, **kwargs: Any) -> Any:
        frame = top("cuda" if next(tensors(args, kwargs)).is_cuda else "cpu")
        if frame is None or frame.edits.get(name) != "fp8":  # the C++ kernel routes only for these
            raise RuntimeError(f"mixprec: {name} was routed to fp8 outside a region with fp8 layers")
        return run_fp8(info, frame, None, args, kwargs)

    lib.impl(target, route, "CompositeImplicitAutograd")
    native_ops.define_route(name, f"mixprec::{target}")
    _routes[name] = lib


def _define_trace_hook() -> None:
    """Define ``mixprec::trace_hook`` once: the C++ kernel calls it while Dynamo traces, for the
    guard on the active policy."""
    with _lock:
        if not _hook_lib:
            lib = Library("mixprec", "FRAGMENT")
            lib.define("trace_hook(int device) -> ()")
            lib.impl("trace_hook", _trace_hook_impl, "CompositeImplicitAutograd")
            _hook_lib.append(lib)


def _trace_hook_impl(device: int) -> None:
    if torch.compiler.is_compiling():
        guard_on_active_policy(DEVICES[device])


def _python_kernel(name: str, op: Any, device_type: str) -> Library:
    lib = Library("aten", "IMPL")  # kept in _libs for good: dropping it would remove the kernel
    key = DISPATCH_KEYS[device_type]
    lib.impl(name, _make_kernel(op_info(name, op), device_type, _torch_kernels[(name, key)]), key,
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
    native_ops = _native.tables()
    with _lock:
        _ensured.clear()  # first: a region entered later registers its kernels again
        with COUNTERS_LOCK:
            active, calls, here = edited_totals()
        if active:
            raise RuntimeError(
                f"release_kernels() while {active} mixprec.autocast region(s) that edit ops are "
                f"active ({here} in this thread, {active - here} in other threads): their ops would "
                "silently lose the policy's casts; call it after the regions exit")
        calls += native_ops.live_calls() if native_ops is not None else 0
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
        n = native_ops.release_kernels() if native_ops is not None else 0
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


def added(device_type: str) -> set[str]:
    """The overloads only mixprec registered at ``device_type``'s autocast key (edits of ops
    PyTorch's table lacks)."""
    key = DISPATCH_KEYS[device_type]
    return {n for (n, k), kernel in _torch_kernels.items() if k == key and kernel is None}


class _Emulated:
    """Stand-in for PyTorch's kernel on versions without ``torch.library.get_kernel``."""

    def __init__(self, info: OpInfo, device_type: str) -> None:
        self.info, self.device_type = info, device_type
        self.kind = _ops.default_table(device_type).get(info.name, "passthrough")

    def call_boxed(self, keyset: Any, *args: Any, **kwargs: Any) -> Any:
        frame = Frame(self.device_type, {})
        return RUNNERS[self.kind](self.info, frame, keyset, args, kwargs)
