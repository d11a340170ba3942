"""Module calls: the global module hooks that run ``Policy.keep`` rules, ``output=`` and fp8 layers.

Hooks are installed while a region whose policy has module rules, an output dtype or fp8 layers is
active (:func:`enter_region`). Eagerly they keep the runtime's call stack; under ``torch.compile``
Dynamo inlines them, and they decide at trace time on a shadow stack (``_traced_enter`` /
``_traced_leave``, run by Dynamo as constants), leaving autocast state nodes, casts and the fp8
layer's own computation in the graph. Both paths decide with one function, :func:`_decide`.

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
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from mixprec._modules import is_wrapper_key, named_modules, unwrap
from mixprec._tree import cast_tree
from mixprec.engine import runtime
from mixprec.engine.compile import traced_policy
from mixprec.engine.dynamo import (assume_constant_result, compile_attempt, compiler_disable, fullgraph, traced_code,
                                   tracing)
from mixprec.engine.runtime import DEVICES, RUNTIME, Frame, Runtime, top
from mixprec.engine.watch import Watch, finish as finish_watch, start as start_watch
from mixprec.fp8.internals import Fp8Target, select_targets, traced_output
from mixprec.policy import Policy

__all__ = ["enter_region", "exit_region", "install_permanently", "capture", "replay", "traced_region",
           "traced_without_fullgraph"]

# Registry, process-wide by nature (a warning is given once per process): the sets of module
# types warned about as having no fp8 candidate layer.
_NO_CANDIDATES_WARNED: set[tuple[str, ...]] = set()
# fp8 layers warned about running inside a reentrant checkpoint (once per layer, while it lives)
_REENTRANT_WARNED: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


@dataclass(eq=False)
class _Region:
    """A region whose policy needs the module hooks, as the hooks see it."""

    frame: Frame | None  # None: a region traced inside compiled code (its frame is made later)
    root: nn.Module | None = None  # names are paths in root (Policy.keep, fp8 selection)
    depth: int = 0  # len(calls) at entry: a call at this depth is an outermost call of the region
    replay: bool = False  # a checkpoint's recompute: the fp8 layers are the forward's
    selected: bool = False  # a region with a root selects its fp8 layers once
    watch: Watch | None = None
    fp8_ran: bool = False  # an fp8 selection ran on a module with candidate layers
    fp8_without: list[str] = field(default_factory=list)  # types of outermost modules without any


@dataclass
class Captured:
    """The module-call context of a checkpointed segment's forward (see :func:`capture`)."""

    regions: list[tuple[Frame, nn.Module | None]]  # (frame, root) of the regions with hooks
    calls: list[tuple[nn.Module, str, Any, bool]]
    fp8: dict[int, Any]


def _warn_no_fp8_candidates(region: _Region) -> None:
    """As a region exits: warn (once per set of module types) when its policy has an fp8 rule and
    none of the modules called in it had a layer the rule could select."""
    if region.fp8_ran or not region.fp8_without or region.replay:
        return
    called = tuple(dict.fromkeys(region.fp8_without))
    if called not in _NO_CANDIDATES_WARNED:
        _NO_CANDIDATES_WARNED.add(called)
        warnings.warn(f"fp8: no layer selected, nothing runs in fp8: no module called in the region has an "
                      f"nn.Linear or Linear-equivalent layer (called: {', '.join(called)}); call the model "
                      f"inside the region, or pass root=model", UserWarning, stacklevel=4)


def _fp8_layers(root: nn.Module, policy: Policy, region: _Region | None = None) -> dict[int, Any]:
    """The fp8 layers of the model called as ``root`` (``mixprec.fp8.internals.select_targets``); a
    model without candidate layers (a loss criterion called in the region) selects nothing and
    is noted in ``region``, which warns as it exits if no call had such layers."""
    targets = select_targets(root, policy)
    if targets is None:
        if region is not None and len(region.fp8_without) < 8:
            region.fp8_without.append(type(unwrap(root)).__name__)
        return {}
    if region is not None:
        region.fp8_ran = True
    return targets


# --------------------------------------------------------------------------- the global hooks
class _Hooks:
    """The global module hooks, installed while at least one region with module hooks is active
    (process-wide, as torch's global hook tables are), under the same handle ids every time:
    compiled code guards on the ids of the global hooks it was traced with, so new ids would
    recompile it at every region."""

    lock = threading.Lock()
    users = 0
    handles: list[Any] = []
    permanent = False

    @classmethod
    def use(cls, permanent: bool = False) -> None:
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
            if permanent:
                if cls.permanent:
                    return
                cls.permanent = True
            cls.users += 1

    @classmethod
    def release(cls) -> None:
        with cls.lock:
            cls.users -= 1
            if cls.users == 0:
                for h in cls.handles:
                    h.remove()  # the ids stay in cls.handles for the next region


def enter_region(frame: Frame, root: nn.Module | None = None, replay: bool = False) -> None:
    """Start applying ``frame``'s policy to module calls (``root``: see ``mixprec.autocast``;
    ``replay``: a checkpoint's recompute, which watches nothing and selects no fp8 layers)."""
    rt = RUNTIME
    watch = None if replay else start_watch(rt, frame.policy)
    rt.regions.append(_Region(frame, root, len(rt.calls), replay, watch=watch))
    _Hooks.use()


def install_permanently() -> None:
    """Keep the hooks for good: a region with module rules was traced inside compiled code,
    whose guards expect the hooks that were there when it was traced."""
    _Hooks.use(permanent=True)


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
    _warn_no_fp8_candidates(region)
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


# --------------------------------------------------------------------------- the decision
def _path(root: nn.Module, module: nn.Module) -> str:
    """``module``'s name under ``root``, without wrappers' parts (:func:`mixprec._modules.named_modules`)."""
    root = unwrap(root)
    if module is root or unwrap(module) is root:
        return ""
    for name, m in named_modules(root):
        if m is module:
            return name
    return ""  # not under root: only type rules can match it


def _qualified_name(module: nn.Module, calls: list[tuple[nn.Module, str, Any, bool]],
                    root: nn.Module | None = None) -> str:
    if not calls:
        return ""  # the outermost module of the region
    parent, parent_name = calls[-1][0], calls[-1][1]
    holder = parent  # the parent, then the modules it wraps: wrappers (DDP, FSDP1, compile) are transparent
    while True:
        inner = None
        for key, child in holder._modules.items():
            if child is module:
                return parent_name if is_wrapper_key(holder, key) else f"{parent_name}.{key}" if parent_name else key
            if child is not None and inner is None and is_wrapper_key(holder, key):
                inner = child
        if inner is None:
            break
        holder = inner
    return _path(calls[0][0] if root is None else root, module)


def _region_of(rt: Runtime, frame: Frame) -> _Region | None:
    for region in reversed(rt.regions):
        if region.frame is frame:
            return region
    return None  # a region traced inside compiled code


def _decide(rt: Runtime, calls: list, frame: Frame, module: nn.Module,
            region: _Region | None = None) -> tuple[str, Any, bool, Fp8Target | None]:
    """``(name, keep rule, kept, fp8 target)`` of ``module`` called under ``frame``'s policy
    (``region``: its record, looked up if not given), inside the calls ``calls`` (eager, or the
    shadow stack of a trace)."""
    policy = frame.policy
    rules, fp8_rule = policy.module_rules, policy.fp8_rule
    every = rt.calls + calls if calls is not rt.calls else calls
    if region is None:
        region = _region_of(rt, frame)
        if region is None and frame.traced and rt.traced_regions:
            region = rt.traced_regions[-1]
    root = region.root if region is not None else None
    name = ""
    if rules or fp8_rule is not None:
        outermost = root is not None and len(every) <= region.depth
        name = _path(root, module) if outermost else _qualified_name(module, every, root)
    if rt.watches:  # a rule that takes effect here counts for the enclosing regions too
        hits = [r for r in rules if r.matches(module, name)]
        for watch in rt.watches:
            watch.see(name, hits)
    kept = bool(every) and every[-1][3]  # inside a kept module
    rule = next((r for r in rules if r.matches(module, name)), None) if rules else None
    kept = kept or rule is not None
    target = None
    if fp8_rule is not None:
        # a recompute keeps the forward's layers; a region with a root selects once
        if region is None or not (region.replay or region.selected):
            if root is not None:  # select on the model
                rt.fp8, region.selected = _fp8_layers(root, policy, region), True
            elif not every:  # the outermost call: select the layers (the model may have changed)
                rt.fp8 = _fp8_layers(module, policy, region)
        target = rt.fp8.get(id(module)) if not kept else None
        if target is not None and not target.runs:
            target = None  # (a Controller's probe measures its fallback layers in fp8.linear)
    if not torch.is_autocast_enabled(frame.device_type):
        # autocast turned off inside the region (a nested torch.autocast(enabled=False); while
        # Dynamo traces, the traced state): the module runs in float32, as asked; a half-dtype
        # rule or an fp8 layer would not run as selected (half inputs meet float32 weights)
        rule = rule if rule is not None and rule.dtype is torch.float32 else None
        target = None
    return name, rule, kept, target


def _rule_state(rule: Any, device_type: str) -> tuple[tuple[str, bool | None, torch.dtype | None], bool | None]:
    """``(device state, cache flag)`` that runs a module a keep rule matched in ``rule.dtype``:
    autocast off for float32, else that dtype.

    PyTorch's weight-cast cache is keyed by the weight alone, not the dtype: a weight cast to
    the rule's dtype would be handed to every later use of that weight (a tied weight, another
    thread) in the region's dtype, and a cast cached before to the rule's module. A half dtype
    other than the region's therefore runs with the cache off (its weights are cast per use)."""
    if rule.dtype is torch.float32:
        return (device_type, False, None), None
    cache = False if rule.dtype != torch.get_autocast_dtype(device_type) else None
    return (device_type, None, rule.dtype), cache


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
    name, rule, kept, target = _decide(rt, rt.calls, frame, module, region)
    if rule is None and target is None:
        rt.calls.append((module, name, None, kept))
        return None
    if target is not None and not torch.is_grad_enabled() and module not in _REENTRANT_WARNED:
        _warn_reentrant(module, name)
    elif torch.is_grad_enabled() and not rt.checkpointed and module not in _REENTRANT_WARNED and _in_checkpoint():
        _warn_recompute(module, name, target is not None)
    devices, cache = (), None
    if rule is not None:
        state, cache = _rule_state(rule, frame.device_type)
        devices = (state,)
    entry = runtime.enter(devices=devices, cache=cache, fp8=None if target is None else (frame, target))
    if target is not None:
        target.begin()  # (a GroupedExperts runs its experts in fp8 itself; finish() in _post_call)
    if rule is not None:
        args = cast_tree(args, rule.dtype, frame.device_type)
    rt.calls.append((module, name, (entry, target), kept))
    return args


def _warn_reentrant(module: nn.Module, name: str) -> None:
    """Warn once for the fp8 layer ``module`` when it runs in the forward of a
    ``checkpoint(..., use_reentrant=True)`` (grad off, ``CheckpointFunction.forward`` on the
    stack): PyTorch recomputes it in backward outside every mixprec region, so its backward
    would silently not be fp8 and record no grad_output statistics."""
    from torch.utils.checkpoint import CheckpointFunction

    code = CheckpointFunction.forward.__code__
    f = sys._getframe(2)
    while f is not None and f.f_code is not code:
        f = f.f_back
    if f is None:
        return  # grad off for another reason (evaluation under no_grad): its forward is the fp8 one
    _REENTRANT_WARNED.add(module)
    warnings.warn(f"fp8: layer {name or type(module).__name__!r} runs inside torch.utils.checkpoint.checkpoint(..., "
                  f"use_reentrant=True), which recomputes it in backward outside mixprec's policy: its backward is "
                  f"not fp8 and records no grad_output statistics (a Guard or Controller cannot see its gradients). "
                  f"Use checkpoint(..., use_reentrant=False, context_fn=mixprec.checkpoint_context_fn)",
                  UserWarning, stacklevel=4)


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
        frame = rt.regions[-1].frame
        if frame.policy.output is not None and top(frame.device_type) is frame:
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
        rt.traced_regions.append(_Region(None, root, len(rt.calls) + len(rt.shadow), watch=watch))
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
    frame = _hooked_frame()
    if frame is not None and not fullgraph():
        if _breaks(rt, module):
            return "break"
        rt.hooked_trace = True
    if frame is None:
        rt.shadow.append((module, "", (False, False), bool(rt.shadow) and rt.shadow[-1][3]))
        return None
    name, rule, kept, target = _decide(rt, rt.shadow, frame, module)
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
    (_, enabled, dtype), rule_cache = _rule_state(rule, dev)
    enabled = enabled is None
    dtype = dtype if enabled else torch.get_autocast_dtype(dev)
    return dev, enabled, dtype, cache if rule_cache is None else rule_cache, rule.dtype, layer


@assume_constant_result
def _traced_leave(module: nn.Module) -> tuple | str | None:
    """Run by Dynamo at trace time: ``(device, exit autocast, clear fp8, output dtype)``."""
    rt = _shadow()
    if not rt.shadow or rt.shadow[-1][0] is not module:  # its pre-hook ran eagerly, if at all
        return "break" if _hooked_frame() is not None and not fullgraph() else None
    has_ctx, has_fp8 = rt.shadow.pop()[2]
    frame = _hooked_frame()
    output = None
    if frame is not None and not rt.shadow and not rt.calls:  # the outermost call of the region
        output = frame.policy.output
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
