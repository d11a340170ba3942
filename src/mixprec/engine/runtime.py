"""The engine's per-thread state, in one object, and the one way into and out of it.

Every region path changes the thread's state through :func:`enter` and :func:`leave`: an eager
``mixprec.autocast`` region, a checkpoint's recompute (``_Replay``), a module that a keep rule
runs in its own dtype, the fp8 layer being called, and a region traced inside compiled code
(the ``mixprec::region`` op). :func:`enter` sets PyTorch's autocast state for the devices it is
given (enabled, dtype, cache flag, nesting), pushes mixprec frames and the fp8 target; the
:class:`Entry` it returns is what :func:`leave` restores.

:data:`RUNTIME` holds, per thread: the frames per device, the key of the innermost eager region's
policy (what Dynamo guards on, :func:`policy_key`), the region depth and mixprec's cast cache, the
frames entered by traced regions, the counters :func:`mixprec.release_kernels` reads, the fp8 layer
being called, the C++ kernel's active tables, and the module-call stack the module hooks keep (see
:mod:`mixprec.engine.module_calls`).
"""

from __future__ import annotations

import itertools
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from mixprec import _native
from mixprec.engine.dynamo import compiler_disable
from mixprec.policy import Policy, canonical

__all__ = ["Frame", "Runtime", "RUNTIME", "Entry", "enter", "leave", "top", "disabled_frame", "edits_key",
           "policy_key", "DEVICES", "edited_totals", "COUNTERS_LOCK"]

#: The device types mixprec regions run on (index: the device argument of the C++ functions).
DEVICES = ("cpu", "cuda")


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


class Runtime(threading.local):
    """The engine's state in one thread (``threading.local``: each thread sees its own fields).

    ``active`` is read by the guards compiled code carries (attribute path
    ``mixprec.engine.runtime.RUNTIME.active``, see :func:`mixprec.engine.kernels.guard_on_active_policy`):
    per device, the :func:`policy_key` of the innermost region entered outside compiled code, ``None``
    for none.
    """

    def __init__(self) -> None:
        self.frames: dict[str, list[Frame]] = {}
        self.active: dict[str, tuple[int | None, int | None] | None] = {}
        self.depth = 0  # frames pushed (regions, enabled or not), for the cache
        self.cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # the Python kernel's weight casts
        self.traced: list[Entry] = []  # regions entered by a trace (mixprec::region), open
        # [frames with edits active in this thread, calls inside a Python kernel] (see COUNTERS)
        self.edited: list[int] | None = None
        self.fp8_target: tuple[Frame, Any] | None = None  # (frame, fp8 layer being called under it)
        self.native_tables: dict[str, int] = {}  # device -> the C++ kernel's active table, as last set
        # module calls (mixprec.engine.module_calls): the regions with hooks, the eager call stack
        # (module, name, entry, kept), the fp8 targets selected, the watches of first passes
        self.regions: list[Any] = []
        self.calls: list[tuple[Any, str, Entry | None, bool]] = []
        self.fp8: dict[int, Any] = {}
        self.watches: list[Any] = []
        self.broken: list[Any] = []  # modules whose eager hooks ran at a graph break
        # the shadow state of the trace in progress (reset when another trace starts)
        self.shadow: list[tuple[Any, str, tuple[bool, bool], bool]] = []
        self.traced_regions: list[Any] = []
        self.hooked_trace = False  # the trace decided a module under a hooked region
        self.trace_id: Any = None
        self.checkpointed = 0  # forwards under checkpoint(context_fn=mixprec.checkpoint_context_fn) open

    def counters(self) -> list[int]:
        """This thread's ``[frames with edits, calls in a Python kernel]``, registered in
        :data:`COUNTERS` on first use."""
        counter = self.edited
        if counter is None:
            with COUNTERS_LOCK:
                counter = self.edited = COUNTERS.setdefault(threading.get_ident(), [0, 0])
        return counter


#: The engine's state in this thread (see :class:`Runtime`).
RUNTIME = Runtime()

# Registry, process-wide by nature: release_kernels() must see every thread's counters (thread
# ident -> its [frames with edits, calls in a Python kernel]). Each counter is changed by its own
# thread only (no lock on the hot path); registering a thread's and summing them take the lock.
COUNTERS: dict[int, list[int]] = {}
COUNTERS_LOCK = threading.Lock()


def edited_totals() -> tuple[int, int, int]:
    """``(frames with edits, calls in Python kernels, this thread's frames with edits)`` over
    every thread; call it holding :data:`COUNTERS_LOCK`."""
    here = RUNTIME.edited[0] if RUNTIME.edited else 0
    return sum(c[0] for c in COUNTERS.values()), sum(c[1] for c in COUNTERS.values()), here


def top(device_type: str) -> Frame | None:
    """The innermost mixprec frame for ``device_type`` in this thread, if any."""
    stack = RUNTIME.frames.get(device_type)
    return stack[-1] if stack else None


def disabled_frame(device_type: str, traced: bool = False) -> Frame:
    """The frame of a disabled region (``enabled=False``): no edits and the default policy, so
    that it governs what runs inside it and an enclosing region's module rules, fp8 layers and
    ``output=`` stop at it, as a nested region's policy does."""
    return Frame(device_type, {}, Policy(), traced=traced)


# --------------------------------------------------------------------------- edits keys
# Registry, process-wide by nature: a small integer per set of edits, the same in every thread
# (compiled code guards on it, the C++ kernel names its tables by it). _EDITS_BY_ID caches the
# lookup by identity (edits are cached values; the strong ref keeps the id unique).
_EDITS_KEYS: dict[tuple[tuple[str, str], ...], int] = {}
_EDITS_BY_ID: dict[int, tuple[Mapping[str, str], int]] = {}
_KEYS_LOCK = threading.Lock()


def edits_key(edits: Mapping[str, str] | None) -> int | None:
    """A small integer naming a set of edits (equal edits, equal key); ``None`` for no edits,
    which is plain ``torch.autocast``."""
    if not edits:
        return None
    hit = _EDITS_BY_ID.get(id(edits))
    if hit is not None and hit[0] is edits:
        return hit[1]
    items = tuple(edits.items())
    with _KEYS_LOCK:  # one key per set of edits, whichever threads ask at once
        key = _EDITS_KEYS.setdefault(items, len(_EDITS_KEYS))
    _EDITS_BY_ID[id(edits)] = (edits, key)
    return key


# Registries, process-wide by nature (compiled code guards on the keys, whichever thread runs it):
# a small integer per value of what a policy makes the module hooks do (_MODULE_KEYS), that key by
# the identity of the canonical policy while it lives (_MODULE_KEY_OF), and a number per live object
# (a Guard or Controller), never given to another (_TOKENS). Entries by identity go with their object.
_MODULE_KEYS: dict[Any, int] = {}
_MODULE_KEY_OF: dict[int, tuple[weakref.ref, int]] = {}
_TOKENS: dict[int, tuple[weakref.ref, int]] = {}
_NEXT_TOKEN = itertools.count()


def _by_identity(table: dict[int, tuple[weakref.ref, int]], obj: Any, value: int) -> int:
    """Record ``value`` for ``obj`` in ``table`` while ``obj`` lives (its id is not reused before)."""
    ident = id(obj)
    table[ident] = (weakref.ref(obj, lambda _, ident=ident: table.pop(ident, None)), value)
    return value


def _token(obj: Any) -> int:
    """A number naming ``obj`` while it lives, never given to another object."""
    hit = _TOKENS.get(id(obj))
    if hit is not None and hit[0]() is obj:
        return hit[1]
    return _by_identity(_TOKENS, obj, next(_NEXT_TOKEN))


def _module_key(policy: Policy) -> int:
    """A small integer naming what ``policy`` makes the module hooks do: its module rules, fp8 rule,
    output and compute dtypes by value (equal policies, equal key), the live Guard or Controller of
    its fp8 rule by identity (a region never runs with another policy's)."""
    found = canonical(policy)
    hit = _MODULE_KEY_OF.get(id(found))
    if hit is not None and hit[0]() is found:
        return hit[1]
    rule = policy.fp8_rule
    live = None if rule is None else rule.live
    value: Any = (policy.compute, policy.output, policy.module_rules, None if rule is None else rule.detached(),
                  None if live is None else _token(live))
    try:
        hash(value)
    except TypeError:  # an unhashable field (a custom recipe): by identity, as canonical() does
        value = ("policy", _token(found))
    with _KEYS_LOCK:
        key = _MODULE_KEYS.setdefault(value, len(_MODULE_KEYS))
    return _by_identity(_MODULE_KEY_OF, found, key)


def policy_key(frame: Frame) -> tuple[int | None, int | None] | None:
    """What code Dynamo traces under ``frame``'s region depends on (compiled code guards on it, see
    :attr:`Runtime.active`): ``(edits key, module key)``, the key of the policy's edits on its device
    (:func:`edits_key`) and, for a policy that acts on module calls (module rules, fp8 layers,
    ``output=``), the key of what the module hooks do; ``None`` for neither, as plain
    ``torch.autocast``."""
    policy = frame.policy
    modules = _module_key(policy) if policy is not None and policy.acts_on_modules else None
    edits = edits_key(frame.edits)
    return None if edits is None and modules is None else (edits, modules)


def show_table(device_type: str, edits: Mapping[str, str] | None) -> None:
    """Make ``edits`` the C++ kernel's active table for ``device_type`` in this thread (once
    the extension's tables exist)."""
    ops = _native.tables()
    if ops is not None:
        _native.set_active(ops, device_type, edits_key(edits), edits or {}, RUNTIME.native_tables)


# --------------------------------------------------------------------------- enter / leave
@dataclass(frozen=True)
class Entry:
    """What one :func:`enter` changed, for its :func:`leave`."""

    frames: tuple[Frame, ...]
    devices: tuple[tuple[str, bool, torch.dtype], ...]  # (device, enabled, dtype) before
    cache: bool  # the autocast cache flag before
    nest: bool  # counted in torch's autocast nesting
    fp8: tuple[Any, ...]  # (the fp8 target before,) when one was set, else ()


# Never traced by Dynamo (its replay of these side effects on the thread's state drifted): only
# eager code and the region op's kernel enter and leave; a frame Dynamo compiles around an eager
# region's enter (falling back from a graph break) calls them eagerly. Callers reach them through
# this module's globals (``runtime.enter``), which hold the disabled functions once Dynamo is imported.
@compiler_disable
def enter(*, frames: Sequence[Frame] = (), devices: Sequence[tuple[str, bool | None, torch.dtype | None]] = (),
          cache: bool | None = None, nest: bool = False, fp8: tuple[Frame, Any] | None = None) -> Entry:
    """Enter a state: set autocast per ``devices`` entry ``(device, enabled, dtype)`` (``None``:
    left as it is) and the cache flag, count one autocast nesting level (``nest``: a region, whose
    outermost exit clears the cast caches), push ``frames`` and the fp8 layer being called.

    The kernels of the frames' edits must exist (:func:`mixprec.engine.kernels.ensure_kernels`).
    """
    saved = []
    for dev, enabled, dtype in devices:
        saved.append((dev, torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev)))
        if enabled is not None:
            torch.set_autocast_enabled(dev, enabled)
        if dtype is not None:
            torch.set_autocast_dtype(dev, dtype)
    prev_cache = torch.is_autocast_cache_enabled()
    if cache is not None:
        torch.set_autocast_cache_enabled(cache)
    if nest:
        torch.autocast_increment_nesting()
    for frame in frames:
        _push(frame)
    prev_fp8: tuple[Any, ...] = ()
    if fp8 is not None:
        prev_fp8, RUNTIME.fp8_target = (RUNTIME.fp8_target,), fp8
    return Entry(tuple(frames), tuple(saved), prev_cache, nest, prev_fp8)


@compiler_disable
def leave(entry: Entry) -> None:
    """Leave the state ``entry`` entered: everything it set is as before."""
    if entry.fp8:
        RUNTIME.fp8_target = entry.fp8[0]
    for frame in reversed(entry.frames):
        _pop(frame)
    if entry.nest and torch.autocast_decrement_nesting() == 0:
        torch.clear_autocast_cache()
    for dev, enabled, dtype in reversed(entry.devices):
        torch.set_autocast_enabled(dev, enabled)
        torch.set_autocast_dtype(dev, dtype)
    torch.set_autocast_cache_enabled(entry.cache)


def _push(frame: Frame) -> None:
    """Push ``frame``: from now until its :func:`_pop`, a frame with edits is counted, so that
    :func:`mixprec.release_kernels` in any thread refuses instead of removing its kernels."""
    rt = RUNTIME
    if frame.edits:
        rt.counters()[0] += 1
    rt.depth += 1
    rt.frames.setdefault(frame.device_type, []).append(frame)
    if not frame.traced:
        rt.active[frame.device_type] = policy_key(frame)
    show_table(frame.device_type, frame.edits)


def _pop(frame: Frame) -> None:
    """Pop ``frame``; the outermost exit clears the cast cache."""
    rt = RUNTIME
    stack = rt.frames[frame.device_type]
    if stack[-1] is frame:
        stack.pop()
    else:  # left out of order (a generator's region): by identity, equal frames are distinct
        del stack[next(i for i, f in enumerate(stack) if f is frame)]
    if frame.edits:
        rt.edited[0] -= 1
    if not frame.traced:
        eager = next((f for f in reversed(stack) if not f.traced), None)
        rt.active[frame.device_type] = None if eager is None else policy_key(eager)
    show_table(frame.device_type, stack[-1].edits if stack else None)
    rt.depth -= 1
    if rt.depth == 0:
        rt.cache.clear()
