"""A region inside a function given to ``torch.compile``: the ``mixprec::region`` op.

A region inside a compiled function is traced as two graph nodes around its body:
``torch.amp._enter_autocast`` (which Dynamo knows) and our ``mixprec::region`` op, whose fake
kernel enters (or leaves) the region's frame wherever the graph is traced (Dynamo's example
values, AOTAutograd) and whose real kernel does the same where the graph runs eagerly. The
frame's policy travels as an integer key (:func:`traced_key`); kernels for the policy's edits are
registered at trace time, before AOTAutograd traces through them. The module hooks' traced path
is in :mod:`mixprec.engine.module_calls`, the guard on the active policy in
:mod:`mixprec.engine.dynamo`.
"""

from __future__ import annotations

import sys
import threading
from typing import Any, Mapping

import torch
from torch.library import Library

from mixprec.engine import runtime
from mixprec.engine.kernels import ensure_kernels
from mixprec.engine.runtime import RUNTIME, Frame, disabled_frame
from mixprec.policy import Policy, canonical

__all__ = ["traced_key", "traced_policy"]

# Registry, process-wide by nature: compiled graphs carry the keys as constants, whichever thread
# runs them. key -> (device, edits, canonical policy); the policy is kept alive, so ids stay unique
# (and so is the Guard or Controller its fp8 rule names: the compiled graph may run it again). Its
# size is the number of distinct policies traced, each also a graph in Dynamo's own cache.
_TRACED: dict[int, tuple[str, Mapping[str, str], Any]] = {}
_TRACED_KEYS: dict[tuple[int, str], int] = {}
_region_lib: list[Library] = []  # the library defining mixprec::region, once
_lock = threading.Lock()


def traced_key(policy: Policy, device_type: str) -> int:
    """The key of ``policy`` (its canonical object, :func:`mixprec.policy.canonical`: one per
    value and fp8 guard and controller, which equality leaves out and a traced region must run
    with) on ``device_type`` for ``mixprec::region``; registers kernels and the op."""
    policy = canonical(policy)
    key = _TRACED_KEYS.get((id(policy), device_type))
    if key is None:
        with _lock:
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


def traced_policy(key: int) -> Policy:
    """The policy of the traced region ``key``."""
    return _TRACED[key][2]


def _drop_traced_frames(_args: Any = None) -> None:
    """When Dynamo finishes compiling: leave the regions it traced in this thread and left open
    (a graph break inside the region ends the trace there), which would otherwise govern this
    thread's later ops."""
    while RUNTIME.traced:
        runtime.leave(RUNTIME.traced.pop())


def _region(device_type: str, key: int, enter_: bool) -> None:
    """Enter (or leave) the traced region ``key``; ``-1`` is a disabled region."""
    if enter_:
        if key >= 0:
            ensure_kernels(_TRACED[key][1], device_type)  # (released since the trace)
            frame = Frame(*_TRACED[key], traced=True)
        else:
            frame = disabled_frame(device_type, traced=True)
        RUNTIME.traced.append(runtime.enter(frames=(frame,)))
    elif RUNTIME.traced:  # else entered by an earlier trace, which ended at a graph break inside it
        runtime.leave(RUNTIME.traced.pop())


def _define_region_op() -> None:
    """Define ``mixprec::region`` once: a CompositeImplicitAutograd op, so that AOTAutograd runs
    it while tracing and leaves nothing of it in the graphs it hands to a compiler."""
    if _region_lib:
        return
    with _lock:
        if not _region_lib:
            lib = Library("mixprec", "FRAGMENT")
            lib.define("region(str device_type, int key, bool enter) -> ()")
            lib.impl("region", _region, "CompositeImplicitAutograd")
            overload = torch.ops.mixprec.region.default
            if hasattr(torch.fx.node, "has_side_effect"):
                torch.fx.node.has_side_effect(overload)
            else:  # torch < 2.6
                torch.fx.node._side_effectful_functions.add(overload)
            _region_lib.append(lib)
