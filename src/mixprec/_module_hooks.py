"""Module rules: the global module hooks that run ``Policy.keep`` rules, ``output=`` and fp8 layers.

Hooks are installed while a region whose policy has module rules, an output dtype or fp8 layers is
active (:class:`ModuleRules`). Eagerly they keep a thread-local call stack; under
``torch.compile`` Dynamo inlines them, and they decide at trace time on a shadow stack
(``_traced_enter``/``_traced_leave``, run by Dynamo as constants), leaving autocast state nodes,
casts and the fp8 layer's own computation in the graph.
"""

from __future__ import annotations

import difflib
import re
import threading
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from mixprec import _dispatch
from mixprec._dispatch import DISPATCH_KEYS, Frame
from mixprec._tree import cast_tree, tracing as _tracing
from mixprec.policy import Policy

__all__ = ["ModuleRules", "traced_region"]

# Rules that have selected a module (in any region of the process), or were reported as
# selecting none: regions stop watching them.
_MATCHED: set[Any] = set()
_WARNED: set[Any] = set()


@dataclass(eq=False)
class _Watch:
    """A region's first pass: its rules that have matched no module yet, and what it called."""

    pending: list[Any]
    names: list[str] = field(default_factory=list)  # qualified names seen (for the message)
    outer: set[int] = field(default_factory=set)  # ids of the region's outermost modules

    def see(self, name: str, hits: list[Any]) -> None:
        """A module named ``name`` was called, selected by the rules ``hits``."""
        if name and len(self.names) < 256:
            self.names.append(name)
        for rule in hits:
            if rule in self.pending:
                self.pending.remove(rule)
            _MATCHED.add(rule)


@dataclass(eq=False)
class _Region:
    """A region whose policy needs the module hooks, as the hooks see it."""

    frame: Frame | None  # None: a region traced inside compiled code (its frame is made later)
    root: nn.Module | None = None  # names are paths in root (Policy.keep, fp8 selection)
    depth: int = 0  # len(calls) at entry: a call at this depth is an outermost call of the region
    replay: bool = False  # a checkpoint's recompute: the fp8 layers are the forward's
    selected: bool = False  # a region with a root selects its fp8 layers once
    watch: _Watch | None = None
    fp8_ran: bool = False  # an fp8 selection ran on a module with candidate layers
    fp8_without: list[str] = field(default_factory=list)  # types of outermost modules without any


@dataclass
class _Captured:
    """The module-rule context of a checkpointed segment's forward (see ``ModuleRules.capture``)."""

    regions: list[tuple[Frame, nn.Module | None]]  # (frame, root) of the regions with hooks
    calls: list[tuple[nn.Module, str, Any, bool]]
    fp8: dict[int, Any]


def _rule_text(rule: Any) -> str:
    parts = []
    if rule.types:
        parts.append("types=(" + ", ".join(t.__name__ for t in rule.types) + ",)")
    if rule.names is not None:
        parts.append(f"names={rule.names!r}")
    return f"keep({', '.join(parts)}, dtype={str(rule.dtype).removeprefix('torch.')})"


def _unmatched(rule: Any, watch: _Watch, region: _Region) -> str:
    """The warning for a rule that matched no module in a region's first pass."""
    base = ("the model given as root=" if region.root is not None
            else "the outermost module called in the region")
    names = list(dict.fromkeys(watch.names))
    close = []
    if rule.names is not None:
        literal = re.sub(r"\\(.)", r"\1", re.sub(r"[\^$]", "", rule.names))
        close = difflib.get_close_matches(literal, names, n=3, cutoff=0.6)
    seen = (f"did you mean {' or '.join(repr(n) for n in close)}?" if close
            else "names seen: " + (", ".join(repr(n) for n in names[:8]) + (", ..." if len(names) > 8 else "")
                                   if names else "none"))
    fix = "" if region.root is not None else (
        "; when the region is entered inside the model's forward, pass root=model to mixprec.autocast")
    return (f"mixprec: the module rule {_rule_text(rule)} selected no module called in the region "
            f"(qualified names are relative to {base}; {seen}). Fix the pattern or the types{fix}")


class ModuleRules:
    """Global module hooks, installed while at least one region with module rules is active.

    The innermost mixprec region's policy governs: inside a nested ``mixprec.autocast`` region
    the outer region's module rules and output dtype are suspended, whether or not the nested
    policy has rules of its own (a nested ``torch.autocast`` is not a policy: outer rules still
    select modules inside it).

    A thread-local stack follows module calls. A module's qualified name is its parent's name
    plus the attribute under which the parent holds it, looked up at each call, so swapping or
    adding submodules between calls is seen at once; a module called from elsewhere than its
    parent is looked up from the outermost module of the region. A region with ``root`` names its
    outermost calls (and such lookups) by their path in ``root``, and selects fp8 layers on it.

    A region's first pass (until it exits, or one of its outermost modules is called again)
    watches its rules: each that selected no module warns once per process, unless it has
    selected one before. A checkpoint's recompute replays the calls, root and fp8 layers of the
    forward (:meth:`capture`, :meth:`replay`).
    """

    _lock = threading.Lock()
    _users = 0
    _handles: list[Any] = []
    _tls = threading.local()

    @classmethod
    def _state(cls) -> Any:
        st = cls._tls
        if not hasattr(st, "regions"):
            st.regions, st.calls, st.fp8, st.traced, st.trace_id = [], [], {}, [], None
            st.watches = []  # the watches of the regions in their first pass
            st.traced_regions = []  # regions traced inside compiled code (shadow, like traced)
            st.hooked_trace = False  # the current trace decided a module under a hooked region
            st.broken = []  # modules whose eager hooks ran at a graph break (see _breaks)
        return st

    @classmethod
    def _shadow(cls) -> Any:
        """The state, its shadow stack emptied when a new trace (or a retry of one) starts, so
        that a trace that failed half-way leaves nothing behind."""
        st = cls._state()
        try:
            from torch._guards import CompileContext

            context = CompileContext.try_get()
            trace_id = None if context is None else (str(context.compile_id), context.attempt)
        except (ImportError, AttributeError):
            trace_id = None
        if trace_id != st.trace_id:
            if st.traced and st.hooked_trace:
                # the last trace stopped inside these modules (Dynamo restarts at a graph break):
                # their hooks run eagerly from now on, around the break (see _breaks)
                _BREAKING.update(entry[0] for entry in st.traced)
            st.traced.clear()
            st.hooked_trace = False
            for region in st.traced_regions:  # a trace that stopped half-way watches no more
                if region.watch is not None:
                    st.watches.remove(region.watch)
            st.traced_regions.clear()
            st.trace_id = trace_id
        return st

    @classmethod
    def enter(cls, frame: Frame, root: nn.Module | None = None, replay: bool = False) -> None:
        """Start applying ``frame``'s policy to module calls (``root``: see ``mixprec.autocast``;
        ``replay``: a checkpoint's recompute, which watches nothing and selects no fp8 layers)."""
        st = cls._state()
        watch = None if replay else cls._watch(st, frame.policy)
        st.regions.append(_Region(frame, root, len(st.calls), replay, watch=watch))
        with cls._lock:
            if cls._users == 0:
                cls.enter_hooks_locked()
            cls._users += 1

    @classmethod
    def install_permanently(cls) -> None:
        """Keep the hooks for good: a region with module rules was traced inside compiled code,
        whose guards expect the hooks that were there when it was traced."""
        with cls._lock:
            if cls._users == 0:
                cls.enter_hooks_locked()
            if not getattr(cls, "_permanent", False):
                cls._permanent = True
                cls._users += 1

    @classmethod
    def enter_hooks_locked(cls) -> None:
        """Install the global hooks, under the same handle ids every time: compiled code guards
        on the ids of the global hooks it was traced with, so new ids would recompile it at
        every region."""
        mod = nn.modules.module
        if not cls._handles:
            cls._handles = [
                mod.register_module_forward_pre_hook(cls._pre),
                mod.register_module_forward_hook(cls._post, always_call=True),
            ]
            return
        pre, post = (h.id for h in cls._handles)
        mod._global_forward_pre_hooks[pre] = cls._pre
        mod._global_forward_hooks[post] = cls._post
        mod._global_forward_hooks_always_called[post] = True

    @classmethod
    def exit_hooks_locked(cls) -> None:
        for h in cls._handles:
            h.remove()  # the ids stay in cls._handles for the next region

    @classmethod
    def exit(cls, frame: Frame) -> None:
        st = cls._state()
        region = next(r for r in reversed(st.regions) if r.frame is frame)
        st.regions.remove(region)
        if not st.regions:  # nothing of the region outlives it (its fp8 layers' states, their controller)
            st.calls.clear()
            st.fp8 = {}
        if region.watch is not None:
            cls._finish(st, region)
        _warn_no_fp8_candidates(region)
        with cls._lock:
            cls._users -= 1
            if cls._users == 0:
                cls.exit_hooks_locked()

    @staticmethod
    def _watch(st: Any, policy: Policy) -> _Watch | None:
        """A first-pass watch of ``policy``'s rules that have neither matched nor warned yet."""
        pending = [r for r in policy.module_rules if r not in _MATCHED and r not in _WARNED]
        if not pending:
            return None
        watch = _Watch(pending)
        st.watches.append(watch)
        return watch

    @staticmethod
    def _finish(st: Any, region: _Region) -> None:
        """End a region's first pass: warn once for each rule that selected no module (when the
        region called any module at all)."""
        watch, region.watch = region.watch, None
        st.watches.remove(watch)
        if not (watch.outer or watch.names):
            return
        for rule in watch.pending:
            if rule not in _MATCHED and rule not in _WARNED:
                _WARNED.add(rule)
                warnings.warn(_unmatched(rule, watch, region), UserWarning, stacklevel=4)

    @classmethod
    def capture(cls, captured: _Captured | None = None) -> _Captured:
        """The module-rule context here, for a checkpoint's recompute (``captured``: the one taken
        before the segment's forward, completed with the fp8 layers the forward used)."""
        st = cls._state()
        if captured is not None:
            captured.fp8 = st.fp8
            return captured
        return _Captured([(r.frame, r.root) for r in st.regions],
                         [(m, name, None, kept) for m, name, _, kept in st.calls], st.fp8)

    @classmethod
    def replay(cls, captured: _Captured, frames: dict[int, Frame]) -> Callable[[], None]:
        """Enter the context ``captured`` again, with ``frames`` (``id(forward frame) -> frame``)
        standing for its regions; returns the function that leaves it."""
        st = cls._state()
        saved = st.calls, st.fp8
        entered = [(frames[id(f)], root) for f, root in captured.regions if id(f) in frames]
        st.calls, st.fp8 = list(captured.calls), captured.fp8  # names and output= as there
        for frame, root in entered:
            cls.enter(frame, root=root, replay=True)

        def leave() -> None:
            for frame, _ in reversed(entered):
                cls.exit(frame)
            st.calls, st.fp8 = saved

        return leave

    @classmethod
    def _region(cls, st: Any, frame: Frame) -> _Region | None:
        for region in reversed(st.regions):
            if region.frame is frame:
                return region
        return None  # a region traced inside compiled code

    @staticmethod
    def _path(root: nn.Module, module: nn.Module) -> str:
        root = getattr(root, "_orig_mod", root)
        if module is root or getattr(module, "_orig_mod", None) is root:
            return ""
        for name, m in root.named_modules(remove_duplicate=False):
            if m is module:
                return name
        return ""  # not under root: only type rules can match it

    @staticmethod
    def _qualified_name(module: nn.Module, calls: list[tuple[nn.Module, str, Any]],
                        root: nn.Module | None = None) -> str:
        if not calls:
            return ""  # the outermost module of the region
        parent, parent_name = calls[-1][0], calls[-1][1]
        inner = getattr(parent, "_orig_mod", None)  # torch.compile's wrapper is transparent
        if inner is module:
            return parent_name
        for key, child in (inner if isinstance(inner, nn.Module) else parent)._modules.items():
            if child is module:
                return f"{parent_name}.{key}" if parent_name else key
        return ModuleRules._path(calls[0][0] if root is None else root, module)

    @classmethod
    def _decide(cls, st: Any, calls: list, frame: Frame, module: nn.Module,
                region: _Region | None = None) -> tuple[str, Any, bool, Any]:
        """``(name, keep rule, kept, fp8 target)`` of ``module`` called under ``frame``'s policy
        (``region``: its record, looked up if not given), inside the calls ``calls`` (eager, or
        the shadow stack of a trace)."""
        policy = frame.policy
        rules, fp8_rule = policy.module_rules, policy.fp8_rule
        every = st.calls + calls if calls is not st.calls else calls
        if region is None:
            region = cls._region(st, frame)
            if region is None and frame.traced and st.traced_regions:
                region = st.traced_regions[-1]
        root = region.root if region is not None else None
        name = ""
        if rules or fp8_rule is not None:
            outermost = root is not None and len(every) <= region.depth
            name = cls._path(root, module) if outermost else cls._qualified_name(module, every, root)
        if st.watches:  # a rule that takes effect here counts for the enclosing regions too
            hits = [r for r in rules if r.matches(module, name)]
            for watch in st.watches:
                watch.see(name, hits)
        kept = bool(every) and every[-1][3]  # inside a kept module
        rule = next((r for r in rules if r.matches(module, name)), None) if rules else None
        kept = kept or rule is not None
        target = None
        if fp8_rule is not None:
            # a recompute keeps the forward's layers; a region with a root selects once
            if region is None or not (region.replay or region.selected):
                if root is not None:  # select on the model
                    st.fp8, region.selected = _fp8_layers(root, policy, region), True
                elif not every:  # the outermost call: select the layers (the model may have changed)
                    st.fp8 = _fp8_layers(module, policy, region)
            target = st.fp8.get(id(module)) if not kept else None
            if target is not None and target[2].fallback and target[2].probe is None:
                target = None  # (a Controller's probe measures its fallback layers in fp8.linear)
        if not torch.is_autocast_enabled(frame.device_type):
            # autocast turned off inside the region (a nested torch.autocast(enabled=False); while
            # Dynamo traces, the traced state): the module runs in float32, as asked; a half-dtype
            # rule or an fp8 layer would not run as selected (half inputs meet float32 weights)
            rule = rule if rule is not None and rule.dtype is torch.float32 else None
            target = None
        return name, rule, kept, target

    # Dynamo inlines these hooks when it traces module calls: the traced path (_pre_traced)
    # decides at trace time, on a shadow call stack, and leaves only autocast nodes, casts and
    # mixprec::fp8_target nodes in the graph.
    @classmethod
    def _pre(cls, module: nn.Module, args: tuple) -> Any:
        if _tracing():
            return _pre_traced(module, args)
        return cls._pre_eager(module, args)

    @classmethod
    def _pre_eager(cls, module: nn.Module, args: tuple) -> Any:
        st = cls._state()
        if not st.regions:
            return None
        region = st.regions[-1]
        frame = region.frame
        if _dispatch.top(frame.device_type) is not frame:  # a nested region governs
            st.calls.append((module, "", None, bool(st.calls) and st.calls[-1][3]))
            return None
        if region.watch is not None and len(st.calls) == region.depth:  # an outermost call
            if id(module) in region.watch.outer:  # called again: the first pass is over
                cls._finish(st, region)
            else:
                region.watch.outer.add(id(module))
        name, rule, kept, target = cls._decide(st, st.calls, frame, module, region)
        restores = []
        if rule is not None:
            restores.append(_enter_rule(frame, rule))
            args = cast_tree(args, rule.dtype, frame.device_type)
        if target is not None:
            restores.append(_enter_fp8(frame, target))
        restore = None
        if restores:
            restore = restores[0] if len(restores) == 1 else lambda: [r() for r in reversed(restores)]
        st.calls.append((module, name, restore, kept))
        return args if restore is not None else None

    @classmethod
    def _post(cls, module: nn.Module, args: tuple, output: Any) -> Any:
        if _tracing():
            return _post_traced(module, args, output)
        return cls._post_eager(module, args, output)

    @classmethod
    def _post_eager(cls, module: nn.Module, args: tuple, output: Any) -> Any:
        st = cls._state()
        if not st.calls or st.calls[-1][0] is not module:
            return None
        restore = st.calls.pop()[2]
        if restore is not None:
            restore()
        if not st.calls and st.regions:
            frame = st.regions[-1].frame
            if frame.policy.output is not None and _dispatch.top(frame.device_type) is frame:
                return cast_tree(output, frame.policy.output)
        return None


# ----------------------------------------------------------------- module rules, traced by Dynamo
_TRACE_CTX: list[Any] = []  # autocast states entered by traced rules (Dynamo pairs the nodes)
_TRACE_FP8: list[Any] = []  # outputs of traced fp8 layers, computed by the pre-hook
_TRACE_RECIPES: dict[int, Any] = {}  # key -> fp8 recipe of traced layers
_TRACE_RECIPES_KEYS: dict[Any, int] = {}


@_dispatch.assume_constant_result
def traced_region(root: nn.Module | None, key: int, enter: bool) -> int:
    """Run by Dynamo at trace time (not traced): the region ``key`` (see ``_dispatch.traced_key``;
    ``-1``: disabled) traced inside compiled code enters (or leaves) the shadow state, with its
    ``root``; the trace is its first pass (rules that select nothing warn as it leaves)."""
    st = ModuleRules._shadow()
    if enter:
        watch = ModuleRules._watch(st, _dispatch._TRACED[key][2]) if key >= 0 else None
        st.traced_regions.append(_Region(None, root, len(st.calls) + len(st.traced), watch=watch))
    elif st.traced_regions:
        region = st.traced_regions.pop()
        if region.watch is not None:
            ModuleRules._finish(st, region)
    return 0


def _hooked_frame() -> Frame | None:
    """While tracing: the innermost mixprec frame whose policy needs the module hooks."""
    for dev in DISPATCH_KEYS:
        frame = _dispatch.top(dev)
        if frame is not None and frame.policy.acts_on_modules:
            return frame
    return None


# Modules whose forward graph-broke while their traced hooks were open: a break between a
# module's pre- and post-hook would leave its autocast state, fp8 output and the shadow stack
# behind (the code after the break is traced anew), so their hooks run eagerly instead.
_BREAKING: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


def _breaks(st: Any, module: nn.Module) -> bool:
    """At trace time, under a hooked region, without fullgraph: whether ``module``'s hooks run
    eagerly (a graph break each): its forward graph-broke in an earlier trace (``_BREAKING``:
    Dynamo then traces the frame again), it is called inside a module whose hooks ran eagerly
    (whose eager call stack the shadow stack of this trace does not see), or the trace is the
    hook's own frame (the module's call runs eagerly: its post-hook is another trace)."""
    return bool(st.broken) or module in _BREAKING or _traced_code() in _HOOK_CODES


def _traced_code() -> Any:
    """While Dynamo traces: the code object of the frame it compiles (not of an inlined call)."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        return InstructionTranslator.current_tx().f_code
    except (ImportError, AttributeError, AssertionError):
        return None


@_dispatch.assume_constant_result
def _traced_enter(module: nn.Module) -> tuple | str | None:
    """Run by Dynamo at trace time (not traced): what a traced pre-hook does for ``module``:
    ``(device, autocast enabled, autocast dtype, cache flag, cast inputs to, fp8 target)``, or
    ``"break"`` when the module's hooks run eagerly (see ``_breaks``)."""
    st = ModuleRules._shadow()
    frame = _hooked_frame()
    if frame is not None and not _fullgraph():
        if _breaks(st, module):
            return "break"
        st.hooked_trace = True
    if frame is None:
        st.traced.append((module, "", (False, False), bool(st.traced) and st.traced[-1][3]))
        return None
    name, rule, kept, target = ModuleRules._decide(st, st.traced, frame, module)
    fp8 = None
    if target is not None:  # (recipe key, backend)
        fp8 = (_TRACE_RECIPES_KEYS.setdefault(target[1], len(_TRACE_RECIPES_KEYS)), target[3])
        _TRACE_RECIPES[fp8[0]] = target[1]
    st.traced.append((module, name, (rule is not None, fp8 is not None), kept))
    if rule is None and fp8 is None:
        return None
    dev, cache = frame.device_type, torch.is_autocast_cache_enabled()
    if rule is None:
        return dev, None, None, cache, None, fp8
    enabled = rule.dtype is not torch.float32
    dtype = rule.dtype if enabled else torch.get_autocast_dtype(dev)
    if enabled and dtype != torch.get_autocast_dtype(dev):
        cache = False  # the cast cache is keyed by weight, not dtype (see _enter_rule)
    return dev, enabled, dtype, cache, rule.dtype, fp8


@_dispatch.assume_constant_result
def _traced_leave(module: nn.Module) -> tuple | str | None:
    """Run by Dynamo at trace time: ``(device, exit autocast, clear fp8, output dtype)``."""
    st = ModuleRules._shadow()
    if not st.traced or st.traced[-1][0] is not module:  # its pre-hook ran eagerly, if at all
        return "break" if _hooked_frame() is not None and not _fullgraph() else None
    has_ctx, has_fp8 = st.traced.pop()[2]
    frame = _hooked_frame()
    output = None
    if frame is not None and not st.traced and not st.calls:  # the outermost call of the region
        output = frame.policy.output
    if not (has_ctx or has_fp8 or output is not None):
        return None
    return (frame.device_type if frame is not None else "cpu"), has_ctx, has_fp8, output


@_dispatch.assume_constant_result
def traced_without_fullgraph() -> bool:
    """Run by Dynamo at trace time (not traced): whether this trace may graph-break. A region
    whose policy needs the module hooks then runs eagerly (see ``mixprec.autocast``): its
    modules' hooks may graph-break and run eagerly (see ``_breaks``), where a region entered by
    the trace is not seen."""
    return not _fullgraph()


def _fullgraph() -> bool:
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
        return bool(tx.one_graph or tx.error_on_graph_break)
    except (ImportError, AttributeError, AssertionError):
        return True


def _pre_traced(module: nn.Module, args: tuple) -> Any:
    if not _tracing():  # its own frame, run uncompiled (past Dynamo's recompile limit)
        return _pre_eager(module, args)
    decision = _traced_enter(module)
    if decision is None:
        return None
    if decision == "break":  # a graph break: the eager hook runs, Dynamo resumes after it
        return _pre_eager(module, args)
    dev, enabled, dtype, cache, cast_to, fp8_layer = decision
    if enabled is not None:
        _TRACE_CTX.append(torch.amp._enter_autocast(dev, dtype, enabled, cache))
    if cast_to is not None:
        args = cast_tree(args, cast_to, dev)
    if fp8_layer is not None:
        # Traced, the fp8 layer is computed here, visible to Dynamo as fp8.convert's modules
        # are (its statistics become graph inputs that the compiled code updates); the post-hook
        # returns it, and the module's own linear, now unused, is eliminated from the graph.
        from mixprec import fp8

        recipe_key, backend = fp8_layer
        recipe = _TRACE_RECIPES[recipe_key]  # a global: Dynamo reads recipes it cannot build
        state = fp8.layer_state(module)
        x = args[0].to(torch.get_autocast_dtype(dev)) if torch.is_autocast_enabled(dev) else args[0]
        if not state.fallback or state.probe is not None:  # read while tracing: a guard, so a fallback recompiles
            from mixprec.fp8._like import linear_params

            _TRACE_FP8.append(fp8.linear(x, *linear_params(module), recipe, state=state, backend=backend))
        else:
            _TRACE_FP8.append(None)
    return args if cast_to is not None else None


def _post_traced(module: nn.Module, args: tuple, output: Any) -> Any:
    if not _tracing():  # its own frame, run uncompiled (past Dynamo's recompile limit)
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


_HOOK_CODES = {ModuleRules._pre.__func__.__code__, _pre_traced.__code__}


@_dispatch.compiler_disable
def _pre_eager(module: nn.Module, args: tuple) -> Any:
    st = ModuleRules._state()
    depth = len(st.calls)
    result = ModuleRules._pre_eager(module, args)
    if len(st.calls) > depth:
        st.broken.append(module)
    return result


@_dispatch.compiler_disable
def _post_eager(module: nn.Module, args: tuple, output: Any) -> Any:
    st = ModuleRules._state()
    if st.broken and st.broken[-1] is module:
        st.broken.pop()
    return ModuleRules._post_eager(module, args, output)




def _fp8_layers(root: nn.Module, policy: Policy, region: _Region | None = None) -> dict[int, tuple[nn.Module, Any, Any, str]]:
    """The fp8 layers of the model called as ``root``: ``id(module) -> fp8 target`` (each with its
    recipe, ``Fp8Rule.recipe_for``), without the modules a keep rule selects or contains; the rule's guard tracks the layers (it
    decides in ``guard.step()``, never in a forward: ranks may run different forwards).

    A module without any layer of the rule's types (a loss criterion called in the region) selects
    nothing, silently, and its call is no forward for the guard or controller: ``region`` notes it,
    and warns as it exits if no call of the region had such layers (:func:`_warn_no_fp8_candidates`)."""
    from mixprec import fp8
    from mixprec.fp8._like import is_linear_like

    rule = policy.fp8_rule
    model = getattr(root, "_orig_mod", root)  # torch.compile's wrapper
    likes = nn.Linear in rule.types
    if not any(isinstance(m, rule.types) or (likes and is_linear_like(m)) for m in model.modules()):
        if region is not None and len(region.fp8_without) < 8:
            region.fp8_without.append(type(model).__name__)
        return {}
    if region is not None:
        region.fp8_ran = True
    recipes = dict(rule.recipes)
    modules = dict(model.named_modules())

    def kept(fqn: str) -> bool:
        parts = fqn.split(".") if fqn else []
        ancestors = [".".join(parts[:i]) for i in range(len(parts) + 1)]
        return any(r.matches(modules[a], a) for a in ancestors for r in policy.module_rules)

    layers, named = {}, {}
    for fqn in fp8.select_layers(model, rule.types, rule.names, rule.first_last, rule.recipe, recipes):
        module = modules[fqn]
        if kept(fqn):
            continue
        layers[id(module)] = (module, rule.recipe_for(fqn), fp8.layer_state(module), rule.backend)
        named[fqn] = module
    if rule.guard is not None:
        rule.guard._policy_forward(model)  # its decisions apply now; warns if never stepped
    if rule.controller is not None:
        rule.controller._policy_forward(named, policy)  # its rungs apply now; decides in step()
    return layers


_NO_CANDIDATES_WARNED: set[tuple[str, ...]] = set()


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


def _enter_fp8(frame: Frame, target: tuple) -> Callable[[], None]:
    """Route the module's ``linear`` to fp8 (see ``_dispatch._run_fp8``) until it returns; warn
    if no call of the module so far made a call the routing recognizes (in the compute dtype)."""
    prev, frame.fp8_target = frame.fp8_target, target

    def restore() -> None:
        frame.fp8_target = prev
        if not target[2].routed:
            from mixprec.fp8._like import warn_unrouted

            warn_unrouted(target[0])

    return restore


def _enter_rule(frame: Frame, rule: Any) -> Callable[[], None]:
    """Run a matched module in ``rule.dtype``: autocast off for float32, else that dtype.

    PyTorch's weight-cast cache is keyed by the weight alone, not the dtype: a weight cast to
    the rule's dtype would be handed to every later use of that weight (a tied weight, another
    thread) in the region's dtype, and a cast cached before to the rule's module. A half dtype
    other than the region's therefore runs with the cache off (its weights are cast per use)."""
    dev = frame.device_type
    prev_enabled, prev_dtype = torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev)
    prev_cache = torch.is_autocast_cache_enabled()
    if rule.dtype is torch.float32:
        torch.set_autocast_enabled(dev, False)
    else:
        if rule.dtype != prev_dtype:
            torch.set_autocast_cache_enabled(False)
        torch.set_autocast_dtype(dev, rule.dtype)

    def restore() -> None:
        torch.set_autocast_enabled(dev, prev_enabled)
        torch.set_autocast_dtype(dev, prev_dtype)
        torch.set_autocast_cache_enabled(prev_cache)

    return restore
