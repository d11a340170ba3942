"""Module calls: the global module hooks that run ``Policy.keep`` rules, ``output=`` and fp8 layers.

Hooks are installed while a region whose policy has module rules, an output dtype or fp8 layers is
active (:func:`enter_region`), and in the first region with grad on of each set of op edits, which
looks for reentrant checkpoints (:func:`looks_for_checkpoints`). Eagerly they keep the runtime's
call stack; under ``torch.compile`` Dynamo inlines them, and they decide at trace time on a shadow
stack (``_traced_enter`` / ``_traced_leave``, run by Dynamo as constants), leaving autocast state
nodes, casts and the fp8 layer's own computation in the graph, and a guard on the key of the
policy of the region around the compiled call. Both paths decide with one function, :func:`mixprec.engine.module_decision.decide`.
Once Dynamo has traced them, or a region that acts on modules enters after Dynamo compiled code,
the hooks stay installed (see ``_Hooks``).

The innermost mixprec region's policy governs: inside a nested ``mixprec.autocast`` region the
outer region's module rules and output dtype are suspended, whether or not the nested policy has
rules of its own (a nested ``torch.autocast`` is not a policy: outer rules still select modules
inside it). A module's qualified name is its parent's name plus the attribute under which the
parent holds it, looked up at each call, so swapping or adding submodules between calls is seen
at once; a module called from elsewhere than its parent is looked up from the outermost module of
the region. A region with ``root`` names its outermost calls (and such lookups) by their path in
``root``, and selects fp8 layers on it (through ``mixprec.fp8.internals.select_targets``).

A region's first pass (until it exits, or one of its outermost modules is called again) watches
its rules: each that selected no module warns once per process, unless it has selected one
before. A checkpoint's recompute replays the calls, root and fp8 layers of the forward
(:func:`capture`, :func:`replay`).
"""

from __future__ import annotations

import sys
import threading
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from mixprec._tree import cast_tree
from mixprec.engine import runtime
from mixprec.engine.compile import traced_policy
from mixprec.engine.dynamo import (assume_constant_result, compile_attempt, compiled_graphs, compiler_disable,
                                   fullgraph, mark_compiled_code, reset_compiled_code, still_compiled, traced_code,
                                   tracing)
from mixprec.engine.kernels import guard_on_active_policy
from mixprec.engine.module_decision import (Region, casts_output, decide, name_of, region_of, rule_state,
                                           warn_no_fp8_candidates)
from mixprec.engine.runtime import DEVICES, RUNTIME, Frame, Runtime, edits_key, top
from mixprec.engine.watch import finish as finish_watch, start as start_watch
from mixprec.fp8.internals import Fp8Target, traced_output

__all__ = ["enter_region", "exit_region", "install_permanently", "looks_for_checkpoints", "capture", "replay",
           "traced_region", "traced_without_fullgraph"]

# modules warned about running inside a checkpoint that recomputes them outside the policy (once
# per module, while it lives)
_REENTRANT_WARNED: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()
# the edits keys (mixprec.engine.runtime.edits_key) whose regions looked for reentrant checkpoints
_LOOKED: set[int] = set()


@dataclass
class Captured:
    """The module-call context of a checkpointed segment's forward (see :func:`capture`)."""

    regions: list[tuple[Frame, nn.Module | None]]  # (frame, root) of the regions with hooks
    calls: list[tuple[nn.Module, str, Any, bool]]
    fp8: dict[int, Any]


# --------------------------------------------------------------------------- the global hooks
class _Hooks:
    """The global module hooks, installed while at least one region with module hooks is active
    (process-wide, as torch's global hook tables are), under the same handle ids every time:
    compiled code guards on the ids of the global hooks it was traced with, so new ids would
    recompile it at every region.

    Once compile is in play they stay (:meth:`keep`): as Dynamo traces them (compiled code guards
    on the hooks it traced, and they guard on the policy: ``_traced_hooks``), or as a region that
    acts on modules enters after Dynamo compiled code: code traced while no hook was installed
    guards on no policy and would run, stale, under a policy with module rules, fp8 layers or
    ``output=`` (it is dropped then, once)."""

    lock = threading.Lock()
    users = 0
    handles: list[Any] = []
    kept = False  # installed for good
    stale: Any = None  # a mark on the code Dynamo held as they were kept (maybe traced without them)

    @classmethod
    def use(cls) -> None:
        with cls.lock:
            if cls.users == 0:
                mod = nn.modules.module
                if not cls.handles:
                    cls.handles = [mod.register_module_forward_pre_hook(_pre),
                                   mod.register_module_forward_hook(_post, always_call=True)]
                else:
                    pre, post = (h.id for h in cls.handles)
                    mod._global_forward_pre_hooks[pre] = _pre
                    mod._global_forward_hooks[post] = _post
                    mod._global_forward_hooks_always_called[post] = True
            cls.users += 1

    @classmethod
    def keep(cls) -> None:
        """Keep the hooks installed for good (once), marking the code Dynamo has compiled so far
        (:attr:`stale`: :func:`enter_region` drops it unless Dynamo was reset since)."""
        with cls.lock:
            if cls.kept:
                return
            cls.kept = True
        cls.stale = mark_compiled_code()
        cls.use()

    @classmethod
    def release(cls) -> None:
        with cls.lock:
            cls.users -= 1
            if cls.users == 0:
                for h in cls.handles:
                    h.remove()  # the ids stay in cls.handles for the next region


def enter_region(frame: Frame, root: nn.Module | None = None, replay: bool = False) -> None:
    """Start applying ``frame``'s policy to module calls (``root``: see ``mixprec.autocast``;
    ``replay``: a checkpoint's recompute, which watches nothing and selects no fp8 layers).

    A policy that acts on modules, entered once Dynamo has compiled code, keeps the hooks installed
    for good, and drops (once) that code, which may have been traced without them."""
    rt = RUNTIME
    watch = None if replay else start_watch(rt, frame.policy)
    training = not replay and torch.is_grad_enabled()
    rt.regions.append(Region(frame, root, len(rt.calls), replay, watch=watch, training=training,
                              edits=training and _edits_recomputed(frame)))
    _Hooks.use()
    if frame.policy.acts_on_modules and compiled_graphs():
        _Hooks.keep()
        if still_compiled(_Hooks.stale):
            reset_compiled_code()
        _Hooks.stale = None


def install_permanently() -> None:
    """Keep the hooks for good: a region with module rules was traced inside compiled code,
    whose guards expect the hooks that were there when it was traced (code compiled before is
    dropped as the next region with module rules enters, see :func:`enter_region`)."""
    _Hooks.keep()


def _edits_recomputed(frame: Frame) -> bool:
    """Whether ``frame``'s policy edits ops other than by fp8 routing (which its fp8 layers stand
    for): a reentrant checkpoint's recompute would run them under PyTorch's lists."""
    return any(kind != "fp8" for kind in frame.edits.values())


def looks_for_checkpoints(frame: Frame) -> bool:
    """Whether the region of ``frame``, whose policy edits ops and acts on no module, takes the
    module hooks to look for ``checkpoint(..., use_reentrant=True)`` around its modules (a warning,
    see ``_warn_reentrant``): the first region of its edits with grad on in the process does; later
    regions of its edits cost nothing."""
    if not torch.is_grad_enabled() or not _edits_recomputed(frame):
        return False
    key = edits_key(frame.edits)
    if key in _LOOKED:
        return False
    _LOOKED.add(key)
    return True


def exit_region(frame: Frame) -> None:
    """Stop applying ``frame``'s policy to module calls."""
    rt = RUNTIME
    region = next(r for r in reversed(rt.regions) if r.frame is frame)
    rt.regions.remove(region)
    if not rt.regions:  # nothing of the region outlives it (its fp8 layers' states, their controller)
        rt.calls.clear()
        rt.fp8 = {}
    if region.watch is not None:
        finish_watch(rt, region)
    warn_no_fp8_candidates(region)
    _Hooks.release()


def capture(captured: Captured | None = None) -> Captured:
    """The module-call context here, for a checkpoint's recompute (``captured``: the one taken
    before the segment's forward, completed with the fp8 layers the forward used)."""
    rt = RUNTIME
    if captured is not None:
        captured.fp8 = rt.fp8
        return captured
    return Captured([(r.frame, r.root) for r in rt.regions],
                    [(m, name, None, kept) for m, name, _, kept in rt.calls], rt.fp8)


def replay(captured: Captured, frames: dict[int, Frame]) -> Callable[[], None]:
    """Enter the context ``captured`` again, with ``frames`` (``id(forward frame) -> frame``)
    standing for its regions; returns the function that leaves it."""
    rt = RUNTIME
    saved = rt.calls, rt.fp8
    entered = [(frames[id(f)], root) for f, root in captured.regions if id(f) in frames]
    rt.calls, rt.fp8 = list(captured.calls), captured.fp8  # names and output= as there
    for frame, root in entered:
        enter_region(frame, root=root, replay=True)

    def restore() -> None:
        for frame, _ in reversed(entered):
            exit_region(frame)
        rt.calls, rt.fp8 = saved

    return restore


# --------------------------------------------------------------------------- eager hooks
# Dynamo inlines the installed hooks when it traces module calls: the traced path (_pre_traced)
# decides at trace time, on a shadow call stack, and leaves only autocast nodes, casts and the
# fp8 layers' computation in the graph.
def _pre(module: nn.Module, args: tuple) -> Any:
    if tracing():
        return _pre_traced(module, args)
    return _pre_call(module, args)


def _post(module: nn.Module, args: tuple, output: Any) -> Any:
    if tracing():
        return _post_traced(module, args, output)
    return _post_call(module, args, output)


def _pre_call(module: nn.Module, args: tuple) -> Any:
    rt = RUNTIME
    if not rt.regions:
        return None
    region = rt.regions[-1]
    frame = region.frame
    if top(frame.device_type) is not frame:  # a nested region governs
        rt.calls.append((module, "", None, bool(rt.calls) and rt.calls[-1][3]))
        return None
    if region.watch is not None and len(rt.calls) == region.depth:  # an outermost call
        if id(module) in region.watch.outer:  # called again: the first pass is over
            finish_watch(rt, region)
        else:
            region.watch.outer.add(id(module))
    name, rule, kept, target = decide(rt, rt.calls, frame, module, region)
    recomputed = rule is not None or target is not None
    if region.training and not torch.is_grad_enabled():  # maybe a reentrant checkpoint's forward
        if (recomputed or region.edits) and module not in _REENTRANT_WARNED:
            _warn_reentrant(region, module, name, rule, target)
    elif recomputed and not rt.checkpointed and module not in _REENTRANT_WARNED and _in_checkpoint():
        _warn_recompute(module, name, target is not None)
    if not recomputed:
        rt.calls.append((module, name, None, kept))
        return None
    devices, cache = (), None
    if rule is not None:
        state, cache = rule_state(rule, frame.device_type)
        devices = (state,)
    entry = runtime.enter(devices=devices, cache=cache, fp8=None if target is None else (frame, target))
    if target is not None:
        target.begin()  # (a GroupedExperts runs its experts in fp8 itself; finish() in _post_call)
    if rule is not None:
        args = cast_tree(args, rule.dtype, frame.device_type)
    rt.calls.append((module, name, (entry, target), kept))
    return args


def _warn_reentrant(region: Region, module: nn.Module, name: str, rule: Any, target: Fp8Target | None) -> None:
    """Warn once for ``module`` when it runs in the forward of a ``checkpoint(...,
    use_reentrant=True)`` (grad off, ``CheckpointFunction.forward`` on the stack): PyTorch
    recomputes it in backward outside every mixprec region, so that its gradients silently differ
    from the forward's. Warned for: an fp8 layer (its backward is not fp8 and records no
    grad_output statistics), a module a keep ``rule`` casts, and, once per region, the first
    module called there in a region whose policy edits ops."""
    from torch.utils.checkpoint import CheckpointFunction

    code = CheckpointFunction.forward.__code__
    f = sys._getframe(2)
    while f is not None and f.f_code is not code:
        f = f.f_back
    if f is None:
        return  # grad off for another reason (evaluation under no_grad): its forward is the policy's
    _REENTRANT_WARNED.add(module)
    name = name or name_of(module, RUNTIME.calls, region) or type(module).__name__
    fix = "Use checkpoint(..., use_reentrant=False, context_fn=mixprec.checkpoint_context_fn)"
    if target is not None:
        message = (f"fp8: layer {name!r} runs inside torch.utils.checkpoint.checkpoint(..., use_reentrant=True), "
                   f"which recomputes it in backward outside mixprec's policy: its backward is not fp8 and records "
                   f"no grad_output statistics (a Guard or Controller cannot see its gradients). {fix}")
    elif rule is not None:
        message = (f"mixprec: layer {name!r}, which a module rule runs in {str(rule.dtype).removeprefix('torch.')}, "
                   f"runs inside torch.utils.checkpoint.checkpoint(..., use_reentrant=True), which recomputes it in "
                   f"backward outside mixprec's policy, without the rule: its gradients silently differ from the "
                   f"forward's. {fix}")
    else:
        region.edits = False
        edited = sorted(k for k, kind in region.frame.edits.items() if kind != "fp8")
        ops = ", ".join(edited[:4]) + (f", ... ({len(edited)} ops)" if len(edited) > 4 else "")
        message = (f"mixprec: module {name!r} runs inside torch.utils.checkpoint.checkpoint(..., use_reentrant=True), "
                   f"which recomputes it in backward outside mixprec's policy: the ops the policy edits ({ops}) "
                   f"run PyTorch's autocast casts there, and its gradients silently differ from the forward's. {fix}")
    warnings.warn(message, UserWarning, stacklevel=4)


def _in_checkpoint() -> bool:
    """Whether this forward runs inside ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``
    (its saved-tensor hooks are the innermost)."""
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    return hooks is not None and getattr(hooks[0], "__qualname__", "").startswith("_checkpoint_hook.")


def _warn_recompute(module: nn.Module, name: str, fp8: bool) -> None:
    """Warn once for ``module``, an fp8 layer or one a module rule casts, in the forward of a
    ``checkpoint(..., use_reentrant=False)`` without mixprec's ``context_fn``: PyTorch recomputes
    it in backward under its own autocast lists, outside mixprec's policy."""
    _REENTRANT_WARNED.add(module)
    what = "fp8 layer" if fp8 else "layer (a module rule casts it)"
    warnings.warn(f"mixprec: {what} {name or type(module).__name__!r} runs inside torch.utils.checkpoint.checkpoint("
                  f"..., use_reentrant=False) without context_fn=mixprec.checkpoint_context_fn: PyTorch recomputes it "
                  f"in backward outside mixprec's policy, whose tensors then differ from the forward's (PyTorch raises "
                  f"CheckpointError in backward). Pass context_fn=mixprec.checkpoint_context_fn to checkpoint()",
                  UserWarning, stacklevel=4)


def _post_call(module: nn.Module, args: tuple, output: Any) -> Any:
    rt = RUNTIME
    if not rt.calls or rt.calls[-1][0] is not module:
        return None
    opened = rt.calls.pop()[2]
    if opened is not None:
        entry, target = opened
        runtime.leave(entry)
        if target is not None:
            target.finish()
    if not rt.calls and rt.regions:
        region = rt.regions[-1]
        frame = region.frame
        if frame.policy.output is not None and top(frame.device_type) is frame and casts_output(region, module):
            return cast_tree(output, frame.policy.output)
    return None


# --------------------------------------------------------------------------- traced by Dynamo
# Read and written by code Dynamo traces, so plain module globals (Dynamo cannot trace a
# threading.local): a traced pre-hook appends and its post-hook pops in the same trace (a module
# whose forward graph-breaks runs its hooks eagerly, see _breaks), so they are empty between traces.
_TRACE_CTX: list[Any] = []  # autocast states entered by traced rules (Dynamo pairs the nodes)
_TRACE_FP8: list[Any] = []  # outputs of traced fp8 layers, computed by the pre-hook
# Registry, process-wide: key -> fp8 recipe of traced layers (a global: Dynamo reads recipes it
# cannot build; compiled code carries the keys as constants).
_TRACE_RECIPES: dict[int, Any] = {}
_TRACE_RECIPES_KEYS: dict[Any, int] = {}
# Registry, process-wide like Dynamo's compiled code: modules whose forward graph-broke while
# their traced hooks were open: a break between a module's pre- and post-hook would leave its
# autocast state, fp8 output and the shadow stack behind (the code after the break is traced
# anew), so their hooks run eagerly instead.
_BREAKING: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


def _shadow() -> Runtime:
    """The runtime, its shadow stack emptied when a new trace (or a retry of one) starts, so that
    a trace that failed half-way leaves nothing behind."""
    rt = RUNTIME
    trace_id = compile_attempt()
    if trace_id != rt.trace_id:
        if rt.shadow and rt.hooked_trace:
            # the last trace stopped inside these modules (Dynamo restarts at a graph break):
            # their hooks run eagerly from now on, around the break (see _breaks)
            _BREAKING.update(entry[0] for entry in rt.shadow)
        rt.shadow.clear()
        rt.hooked_trace = False
        for region in rt.traced_regions:  # a trace that stopped half-way watches no more
            if region.watch is not None:
                rt.watches.remove(region.watch)
        rt.traced_regions.clear()
        rt.trace_id = trace_id
    return rt


@assume_constant_result
def traced_region(root: nn.Module | None, key: int, entering: bool) -> int:
    """Run by Dynamo at trace time (not traced): the region ``key`` (see
    :func:`mixprec.engine.compile.traced_key`; ``-1``: disabled) traced inside compiled code
    enters (or leaves) the shadow state, with its ``root``; the trace is its first pass (rules
    that select nothing warn as it leaves)."""
    rt = _shadow()
    if entering:
        watch = start_watch(rt, traced_policy(key)) if key >= 0 else None
        rt.traced_regions.append(Region(None, root, len(rt.calls) + len(rt.shadow), watch=watch))
    elif rt.traced_regions:
        region = rt.traced_regions.pop()
        if region.watch is not None:
            finish_watch(rt, region)
    return 0


def _hooked_frame() -> Frame | None:
    """While tracing: the innermost mixprec frame whose policy needs the module hooks."""
    for dev in DEVICES:
        frame = top(dev)
        if frame is not None and frame.policy.acts_on_modules:
            return frame
    return None


def _traced_hooks() -> None:
    """At trace time, as a traced hook reads the policy: the compiled code depends on the policy of
    the innermost eager region of each device (a region around the compiled call: another policy,
    in module rules, fp8 rule, ``output=`` or edits, recompiles; an equal one does not), and on the
    hooks it traced (Dynamo guards on the global hooks), which therefore stay."""
    _Hooks.keep()
    for dev in DEVICES:
        guard_on_active_policy(dev)


def _breaks(rt: Runtime, module: nn.Module) -> bool:
    """At trace time, under a hooked region, without fullgraph: whether ``module``'s hooks run
    eagerly (a graph break each): its forward graph-broke in an earlier trace (``_BREAKING``:
    Dynamo then traces the frame again), it is called inside a module whose hooks ran eagerly
    (whose eager call stack the shadow stack of this trace does not see), or the trace is the
    hook's own frame (the module's call runs eagerly: its post-hook is another trace)."""
    return bool(rt.broken) or module in _BREAKING or traced_code() in _HOOK_CODES


@assume_constant_result
def _traced_enter(module: nn.Module) -> tuple | str | None:
    """Run by Dynamo at trace time (not traced): what a traced pre-hook does for ``module``:
    ``(device, autocast enabled, autocast dtype, cache flag, cast inputs to, fp8 layer)``, or
    ``"break"`` when the module's hooks run eagerly (see ``_breaks``)."""
    rt = _shadow()
    _traced_hooks()
    frame = _hooked_frame()
    if frame is not None and not fullgraph():
        if _breaks(rt, module):
            return "break"
        rt.hooked_trace = True
    if frame is None:
        rt.shadow.append((module, "", (False, False), bool(rt.shadow) and rt.shadow[-1][3]))
        return None
    name, rule, kept, target = decide(rt, rt.shadow, frame, module)
    layer = None
    if target is not None:  # (recipe key, backend)
        layer = (_TRACE_RECIPES_KEYS.setdefault(target.recipe, len(_TRACE_RECIPES_KEYS)), target.backend)
        _TRACE_RECIPES[layer[0]] = target.recipe
    rt.shadow.append((module, name, (rule is not None, layer is not None), kept))
    if rule is None and layer is None:
        return None
    dev, cache = frame.device_type, torch.is_autocast_cache_enabled()
    if rule is None:
        return dev, None, None, cache, None, layer
    (_, enabled, dtype), rule_cache = rule_state(rule, dev)
    enabled = enabled is None
    dtype = dtype if enabled else torch.get_autocast_dtype(dev)
    return dev, enabled, dtype, cache if rule_cache is None else rule_cache, rule.dtype, layer


@assume_constant_result
def _traced_leave(module: nn.Module) -> tuple | str | None:
    """Run by Dynamo at trace time: ``(device, exit autocast, clear fp8, output dtype)``."""
    rt = _shadow()
    _traced_hooks()
    if not rt.shadow or rt.shadow[-1][0] is not module:  # its pre-hook ran eagerly, if at all
        return "break" if _hooked_frame() is not None and not fullgraph() else None
    has_ctx, has_fp8 = rt.shadow.pop()[2]
    frame = _hooked_frame()
    output = None
    if frame is not None and not rt.shadow and not rt.calls and casts_output(region_of(rt, frame), module):
        output = frame.policy.output  # the outermost call of the region
    if not (has_ctx or has_fp8 or output is not None):
        return None
    return (frame.device_type if frame is not None else "cpu"), has_ctx, has_fp8, output


@assume_constant_result
def traced_without_fullgraph() -> bool:
    """Run by Dynamo at trace time (not traced): whether this trace may graph-break. A region
    whose policy needs the module hooks then runs eagerly (see ``mixprec.autocast``): its
    modules' hooks may graph-break and run eagerly (see ``_breaks``), where a region entered by
    the trace is not seen."""
    return not fullgraph()


def _pre_traced(module: nn.Module, args: tuple) -> Any:
    if not tracing():  # its own frame, run uncompiled (past Dynamo's recompile limit)
        return _pre_eager(module, args)
    decision = _traced_enter(module)
    if decision is None:
        return None
    if decision == "break":  # a graph break: the eager hook runs, Dynamo resumes after it
        return _pre_eager(module, args)
    dev, enabled, dtype, cache, cast_to, layer = decision
    if enabled is not None:
        _TRACE_CTX.append(torch.amp._enter_autocast(dev, dtype, enabled, cache))
    if cast_to is not None:
        args = cast_tree(args, cast_to, dev)
    if layer is not None:
        # Traced, the fp8 layer is computed here, visible to Dynamo as fp8.convert's modules
        # are (its statistics become graph inputs that the compiled code updates); the post-hook
        # returns it, and the module's own linear, now unused, is eliminated from the graph.
        recipe_key, backend = layer
        x = args[0].to(torch.get_autocast_dtype(dev)) if torch.is_autocast_enabled(dev) else args[0]
        _TRACE_FP8.append(traced_output(module, x, _TRACE_RECIPES[recipe_key], backend))
    return args if cast_to is not None else None


def _post_traced(module: nn.Module, args: tuple, output: Any) -> Any:
    if not tracing():  # its own frame, run uncompiled (past Dynamo's recompile limit)
        return _post_eager(module, args, output)
    decision = _traced_leave(module)
    if decision is None:
        return None
    if decision == "break":
        return _post_eager(module, args, output)
    dev, has_ctx, has_fp8, out_dtype = decision
    if has_fp8:
        fp8_output = _TRACE_FP8.pop()
        if fp8_output is not None:
            output = fp8_output
    if has_ctx:
        torch.amp._exit_autocast(_TRACE_CTX.pop())
    if out_dtype is not None:
        return cast_tree(output, out_dtype)
    return output if has_fp8 else None


_HOOK_CODES = {_pre.__code__, _pre_traced.__code__}


@compiler_disable
def _pre_eager(module: nn.Module, args: tuple) -> Any:
    rt = RUNTIME
    depth = len(rt.calls)
    result = _pre_call(module, args)
    if len(rt.calls) > depth:
        rt.broken.append(module)
    return result


@compiler_disable
def _post_eager(module: nn.Module, args: tuple, output: Any) -> Any:
    rt = RUNTIME
    if rt.broken and rt.broken[-1] is module:
        rt.broken.pop()
    return _post_call(module, args, output)
