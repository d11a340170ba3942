"""``mixprec.autocast``: the autocast region, its module rules, and ``custom_fwd``/``custom_bwd``.

The op-by-op casting lives in :mod:`mixprec._dispatch`; this module manages regions: the
thread-local autocast state PyTorch's dispatcher reads (so the ``Autocast*`` dispatch keys are
active), the stack of mixprec frames our kernels consult, and, when a policy has module rules or an
output dtype, module hooks installed for the region's lifetime only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
import warnings
from typing import Any, Callable, TypeVar

import torch
from torch import nn

from mixprec import _dispatch
from mixprec._dispatch import Frame
from mixprec._tree import cast_tree, tracing as _tracing
from mixprec.policy import Policy

__all__ = [
    "autocast",
    "is_autocast_enabled",
    "get_autocast_dtype",
    "custom_fwd",
    "custom_bwd",
    "checkpoint_context_fn",
]

F = TypeVar("F", bound=Callable[..., Any])
_SUPPORTED = ("cpu", "cuda")


def is_autocast_enabled(device_type: str = "cuda") -> bool:
    """Whether autocast (mixprec's or PyTorch's) is on for ``device_type`` in this thread."""
    return torch.is_autocast_enabled(device_type)


def get_autocast_dtype(device_type: str = "cuda") -> torch.dtype:
    """The low-precision dtype autocast uses for ``device_type`` in this thread."""
    return torch.get_autocast_dtype(device_type)


def _resolve(device_type: str, dtype: torch.dtype | None, enabled: bool,
             policy: Policy | str | None) -> tuple[Policy, torch.dtype, bool]:
    """Validate a region's arguments: ``(policy, dtype, enabled)`` as the region runs them."""
    if not isinstance(device_type, str):
        raise ValueError(f"Expected `device_type` of type `str`, got: `{type(device_type)}`")
    if device_type not in _SUPPORTED:
        raise ValueError(
            f"mixprec.autocast supports device_type 'cpu' and 'cuda', got {device_type!r}; "
            "use torch.autocast for other devices"
        )
    policy = Policy.coerce(policy)
    if dtype is not None and policy.compute is not None and dtype != policy.compute:
        raise ValueError(
            f"mixprec.autocast got dtype={dtype} and a policy with compute={policy.compute}; "
            "pass one of them (or the same dtype twice)"
        )
    if dtype is None:
        dtype = policy.compute if policy.compute is not None else torch.get_autocast_dtype(device_type)
    if enabled and device_type == "cuda":
        if not torch.cuda.is_available():
            warnings.warn(
                "User provided device_type of 'cuda', but CUDA is not available. Disabling",
                stacklevel=3,
            )
            enabled = False
        elif dtype is torch.bfloat16 and not torch.cuda.is_bf16_supported():
            raise RuntimeError(
                "Current CUDA Device does not support bfloat16. Please switch dtype to float16."
            )
    if enabled and dtype not in (torch.bfloat16, torch.float16):
        warnings.warn(
            f"In {device_type.upper()} autocast, but the target dtype {dtype} is not supported. "
            "Disabling autocast. Autocast only supports torch.bfloat16 and torch.float16.",
            stacklevel=3,
        )
        enabled = False
    return policy, dtype, bool(enabled)


@torch.compiler.assume_constant_result
def _traced_region(device_type: str, dtype: torch.dtype | None, enabled: bool,
                   policy: Policy | str | None) -> tuple[int, torch.dtype, bool]:
    """Run by Dynamo at trace time (not traced): resolve a region and key its policy."""
    policy, dtype, enabled = _resolve(device_type, dtype, enabled, policy)
    if enabled and (policy.module_rules or policy.output is not None or policy.fp8_rule is not None):
        _ModuleRules.install_permanently()
    return (_dispatch.traced_key(policy, device_type) if enabled else -1), dtype, enabled


class autocast:
    """Run a region with automatic mixed precision: a drop-in for ``torch.autocast``.

    Inside the region each aten op on ``device_type`` tensors runs in the dtype its policy gives
    it: matmuls and convolutions in ``dtype``, numerically sensitive ops in float32, multi-input
    ops in the widest input dtype, everything else in the dtypes it is given. The default policy
    is PyTorch 2.13's autocast lists for the device, so results are bitwise those of
    ``torch.autocast``. Only floating, non-float64 tensors on ``device_type`` are cast; in-place
    and ``out=`` ops are not. Backward runs in the forward's dtypes; gradients of float32
    parameters are float32. Casts of float32 leaf tensors that require grad (weights) are cached
    until the outermost region exits (``cache_enabled=False``: cast on every use).

    Args:
        device_type: ``"cpu"`` or ``"cuda"``.
        dtype: low-precision dtype; default: ``policy.compute`` if set, else the thread's current
            autocast dtype (bfloat16 on CPU, float16 on CUDA unless changed).
        enabled: ``False`` turns autocast off inside (nested regions may turn it on again).
        cache_enabled: cache weight casts for the region.
        policy: a :class:`mixprec.Policy` or a string for :meth:`Policy.parse` (e.g.
            ``"fp32-numerics"``); edits to the op lists, module rules (:meth:`Policy.keep`) and
            an output dtype apply inside this region.

    Usable as a context manager and as a decorator. State is thread-local.

    Example:
        >>> model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
        >>> policy = mixprec.Policy.parse("compute=bf16,output=f32").keep(types=(nn.LayerNorm,))
        >>> with mixprec.autocast("cpu", policy=policy):
        ...     y = model(torch.randn(2, 4))
        >>> y.dtype
        torch.float32

    Raises:
        ValueError: ``device_type`` is not a string naming cpu or cuda, or ``dtype`` and
            ``policy.compute`` are both given and differ.
        TypeError: ``policy`` is neither a Policy nor a string.
        RuntimeError: bfloat16 on a CUDA device without bf16 support.
    """

    def __init__(
        self,
        device_type: str,
        dtype: torch.dtype | None = None,
        enabled: bool = True,
        cache_enabled: bool = True,
        *,
        policy: Policy | str | None = None,
    ) -> None:
        self.device = device_type
        self._enabled = bool(enabled)
        self._cache_enabled = bool(cache_enabled)
        self._saved: list[tuple[Any, ...]] = []
        if _tracing():  # resolved at trace time by _traced_region
            self.fast_dtype, self.policy, self._raw = dtype, policy, (dtype, enabled, policy)
            return
        self.policy, self.fast_dtype, self._enabled = _resolve(device_type, dtype, enabled, policy)

    # Inside a function given to torch.compile, Dynamo traces __enter__/__exit__: the region
    # becomes torch.amp._enter_autocast (which Dynamo knows) plus mixprec::region nodes that
    # push the policy's frame wherever the graph is traced or run (see _dispatch). Dynamo guards
    # on the policy like on any value the traced code reads, so another policy recompiles.
    def __enter__(self) -> "autocast":
        if _tracing():
            return self._enter_traced()
        dev = self.device
        frame = None
        if self._enabled:
            edits = self.policy.edits(dev)
            if edits:
                _dispatch.ensure_kernels(edits, dev)
            frame = Frame(dev, edits, self.policy)
        prev = (torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev),
                torch.is_autocast_cache_enabled())
        torch.set_autocast_enabled(dev, self._enabled)
        torch.set_autocast_dtype(dev, self.fast_dtype)
        torch.set_autocast_cache_enabled(self._cache_enabled)
        torch.autocast_increment_nesting()
        _dispatch.push(frame)
        hooked = frame is not None and (bool(self.policy.module_rules) or self.policy.output is not None
                                        or self.policy.fp8_rule is not None)
        if hooked:
            _ModuleRules.enter(frame)
        self._saved.append((prev, frame, hooked))
        return self

    def __exit__(self, *exc: Any) -> None:
        if _tracing():
            return self._exit_traced()
        (enabled, dtype, cache), frame, hooked = self._saved.pop()
        if hooked:
            _ModuleRules.exit(frame)
        _dispatch.pop(frame)
        if torch.autocast_decrement_nesting() == 0:
            torch.clear_autocast_cache()
        torch.set_autocast_enabled(self.device, enabled)
        torch.set_autocast_dtype(self.device, dtype)
        torch.set_autocast_cache_enabled(cache)

    def _enter_traced(self) -> "autocast":
        key, dtype, enabled = _traced_region(self.device, *self._raw)
        ctx = torch.amp._enter_autocast(self.device, dtype, enabled, self._cache_enabled)
        torch.ops.mixprec.region(self.device, key, True)
        self._saved.append((ctx, key))
        return self

    def _exit_traced(self) -> None:
        ctx, key = self._saved.pop()
        torch.ops.mixprec.region(self.device, key, False)
        torch.amp._exit_autocast(ctx)

    def __call__(self, func: F) -> F:
        @functools.wraps(func)
        def decorate_autocast(*args: Any, **kwargs: Any) -> Any:
            with autocast(self.device, self.fast_dtype, self._enabled, self._cache_enabled,
                          policy=self.policy):
                out = func(*args, **kwargs)
            return out if self.policy.output is None else cast_tree(out, self.policy.output)

        return decorate_autocast  # type: ignore[return-value]

    def __repr__(self) -> str:
        return (f"mixprec.autocast({self.device!r}, dtype={self.fast_dtype}, "
                f"enabled={self._enabled}, policy={self.policy})")


# --------------------------------------------------------------------------- module rules
class _ModuleRules:
    """Global module hooks, installed while at least one region with module rules is active.

    The innermost mixprec region's policy governs: inside a nested ``mixprec.autocast`` region
    the outer region's module rules and output dtype are suspended, whether or not the nested
    policy has rules of its own (a nested ``torch.autocast`` is not a policy: outer rules still
    select modules inside it).

    A thread-local stack follows module calls. A module's qualified name is its parent's name
    plus the attribute under which the parent holds it, looked up at each call, so swapping or
    adding submodules between calls is seen at once; a module called from elsewhere than its
    parent is looked up from the outermost module of the region.
    """

    _lock = threading.Lock()
    _users = 0
    _handles: list[Any] = []
    _tls = threading.local()

    @classmethod
    def _state(cls) -> Any:
        st = cls._tls
        if not hasattr(st, "frames"):
            st.frames, st.calls, st.fp8, st.traced = [], [], {}, []
        return st

    @classmethod
    def enter(cls, frame: Frame) -> None:
        cls._state().frames.append(frame)
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
                callbacks = getattr(getattr(torch, "_dynamo", None), "callback_handler", None)
                if callbacks is not None:  # a new trace starts with an empty shadow stack
                    callbacks.register_start_callback(lambda *_: cls._state().traced.clear())

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
        st.frames.remove(frame)
        if not st.frames:
            st.calls.clear()
        with cls._lock:
            cls._users -= 1
            if cls._users == 0:
                cls.exit_hooks_locked()

    @staticmethod
    def _qualified_name(module: nn.Module, calls: list[tuple[nn.Module, str, Any]]) -> str:
        if not calls:
            return ""  # the outermost module of the region
        parent, parent_name = calls[-1][0], calls[-1][1]
        inner = getattr(parent, "_orig_mod", None)  # torch.compile's wrapper is transparent
        if inner is module:
            return parent_name
        for key, child in (inner if isinstance(inner, nn.Module) else parent)._modules.items():
            if child is module:
                return f"{parent_name}.{key}" if parent_name else key
        root = calls[0][0]
        for name, m in getattr(root, "_orig_mod", root).named_modules(remove_duplicate=False):
            if m is module:
                return name
        return ""  # not under the outermost module: only type rules can match it

    @classmethod
    def _decide(cls, st: Any, calls: list, frame: Frame, module: nn.Module) -> tuple[str, Any, bool, Any]:
        """``(name, keep rule, kept, fp8 target)`` of ``module`` called under ``frame``'s policy,
        inside the calls ``calls`` (eager, or the shadow stack of a trace)."""
        policy = frame.policy
        rules, fp8_rule = policy.module_rules, policy.fp8_rule
        every = st.calls + calls if calls is not st.calls else calls
        name = cls._qualified_name(module, every) if rules or fp8_rule is not None else ""
        kept = bool(every) and every[-1][3]  # inside a kept module
        rule = next((r for r in rules if r.matches(module, name)), None) if rules else None
        kept = kept or rule is not None
        target = None
        if fp8_rule is not None:
            if not every:  # the outermost call: select the layers (the model may have changed)
                st.fp8 = _fp8_layers(module, policy)
            target = st.fp8.get(id(module)) if not kept else None
            if target is not None and target[2].fallback:
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
        if not st.frames:
            return None
        frame = st.frames[-1]
        if _dispatch.top(frame.device_type) is not frame:  # a nested region governs
            st.calls.append((module, "", None, bool(st.calls) and st.calls[-1][3]))
            return None
        name, rule, kept, target = cls._decide(st, st.calls, frame, module)
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
        if not st.calls and st.frames:
            frame = st.frames[-1]
            if frame.policy.output is not None and _dispatch.top(frame.device_type) is frame:
                return cast_tree(output, frame.policy.output)
        return None


# ----------------------------------------------------------------- module rules, traced by Dynamo
_TRACE_CTX: list[Any] = []  # autocast states entered by traced rules (Dynamo pairs the nodes)
_TRACE_FP8: list[Any] = []  # outputs of traced fp8 layers, computed by the pre-hook
_TRACE_RECIPES: dict[int, Any] = {}  # key -> fp8 recipe of traced layers
_TRACE_RECIPES_KEYS: dict[Any, int] = {}


def _hooked_frame() -> Frame | None:
    """While tracing: the innermost mixprec frame whose policy needs the module hooks."""
    for dev in _SUPPORTED:
        frame = _dispatch.top(dev)
        if frame is not None and (frame.policy.module_rules or frame.policy.output is not None
                                  or frame.policy.fp8_rule is not None):
            return frame
    return None


@torch.compiler.assume_constant_result
def _traced_enter(module: nn.Module) -> tuple | str | None:
    """Run by Dynamo at trace time (not traced): what a traced pre-hook does for ``module``:
    ``(device, autocast enabled, autocast dtype, cache flag, cast inputs to, fp8 target)``, or
    ``"break"`` when the trace may graph-break (a break between a module's pre- and post-hook
    would leave its autocast state behind: the module then runs eagerly, through the eager
    hooks)."""
    st = _ModuleRules._state()
    frame = _hooked_frame()
    if frame is not None and not _fullgraph():
        return "break"
    if frame is None:
        st.traced.append((module, "", (False, False), bool(st.traced) and st.traced[-1][3]))
        return None
    name, rule, kept, target = _ModuleRules._decide(st, st.traced, frame, module)
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
    return dev, enabled, dtype, cache, rule.dtype, fp8


@torch.compiler.assume_constant_result
def _traced_leave(module: nn.Module) -> tuple | str | None:
    """Run by Dynamo at trace time: ``(device, exit autocast, clear fp8, output dtype)``."""
    st = _ModuleRules._state()
    if _hooked_frame() is not None and not _fullgraph():
        return "break"
    if not st.traced or st.traced[-1][0] is not module:
        return None
    has_ctx, has_fp8 = st.traced.pop()[2]
    frame = _hooked_frame()
    output = None
    if frame is not None and not st.traced and not st.calls:  # the outermost call of the region
        output = frame.policy.output
    if not (has_ctx or has_fp8 or output is not None):
        return None
    return (frame.device_type if frame is not None else "cpu"), has_ctx, has_fp8, output


def _fullgraph() -> bool:
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
        return bool(tx.one_graph or tx.error_on_graph_break)
    except (ImportError, AttributeError, AssertionError):
        return True


def _pre_traced(module: nn.Module, args: tuple) -> Any:
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
        if not state.fallback:  # read while tracing: a guard, so a fallback recompiles
            _TRACE_FP8.append(fp8.linear(x, module.weight, module.bias, recipe, state=state,
                                         backend=backend))
        else:
            _TRACE_FP8.append(None)
    return args if cast_to is not None else None


def _post_traced(module: nn.Module, args: tuple, output: Any) -> Any:
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


@torch.compiler.disable
def _pre_eager(module: nn.Module, args: tuple) -> Any:
    return _ModuleRules._pre_eager(module, args)


@torch.compiler.disable
def _post_eager(module: nn.Module, args: tuple, output: Any) -> Any:
    return _ModuleRules._post_eager(module, args, output)


_GUARD_STEPS: dict[int, int] = {}  # id(guard) -> outermost calls seen, for Guard.check's step


def _fp8_layers(root: nn.Module, policy: Policy) -> dict[int, tuple[nn.Module, Any, Any, str]]:
    """The fp8 layers of the model called as ``root``: ``id(module) -> fp8 target``, without
    the modules a keep rule selects or contains; checks the rule's guard first (on its
    schedule), so that a layer it moves back is left out now."""
    from mixprec import fp8

    rule = policy.fp8_rule
    model = getattr(root, "_orig_mod", root)  # torch.compile's wrapper
    recipe = fp8.as_recipe(rule.recipe)
    if rule.guard is not None:
        step = _GUARD_STEPS.get(id(rule.guard), 0)
        _GUARD_STEPS[id(rule.guard)] = step + 1
        rule.guard.check(model, step)
    modules = dict(model.named_modules())

    def kept(fqn: str) -> bool:
        parts = fqn.split(".") if fqn else []
        ancestors = [".".join(parts[:i]) for i in range(len(parts) + 1)]
        return any(r.matches(modules[a], a) for a in ancestors for r in policy.module_rules)

    layers = {}
    for fqn in fp8.select_layers(model, rule.types, rule.names, rule.first_last):
        module = modules[fqn]
        if kept(fqn):
            continue
        layers[id(module)] = (module, recipe, fp8.layer_state(module), rule.backend)
    return layers


def _enter_fp8(frame: Frame, target: tuple) -> Callable[[], None]:
    """Route the module's ``linear`` to fp8 (see ``_dispatch._run_fp8``) until it returns."""
    prev, frame.fp8_target = frame.fp8_target, target

    def restore() -> None:
        frame.fp8_target = prev

    return restore


def _enter_rule(frame: Frame, rule: Any) -> Callable[[], None]:
    """Run a matched module in ``rule.dtype``: autocast off for float32, else that dtype."""
    dev = frame.device_type
    prev_enabled, prev_dtype = torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev)
    if rule.dtype is torch.float32:
        torch.set_autocast_enabled(dev, False)
    else:
        torch.set_autocast_dtype(dev, rule.dtype)

    def restore() -> None:
        torch.set_autocast_enabled(dev, prev_enabled)
        torch.set_autocast_dtype(dev, prev_dtype)

    return restore


def _without_compute(policy: Policy | None) -> Policy | None:
    """The policy of a region being replayed with the dtype it actually ran in."""
    return policy if policy is None or policy.compute is None else dataclasses.replace(policy, compute=None)


# --------------------------------------------------------------------------- checkpointing
def checkpoint_context_fn() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """``context_fn`` for ``torch.utils.checkpoint(..., use_reentrant=False)`` under mixprec.

    PyTorch recomputes a checkpointed segment in backward under ``torch.autocast`` with the
    forward's dtype, that is under PyTorch's default op lists. With a mixprec policy that edits
    the lists, the recomputed tensors would differ from the forward's (PyTorch then raises
    "Recomputed values ... have different metadata"). Passing this function as ``context_fn``
    recomputes inside the mixprec regions (policy, dtype, cache flag) active at forward time.

    Example:
        >>> from torch.utils.checkpoint import checkpoint
        >>> with mixprec.autocast("cpu", policy=policy):
        ...     y = checkpoint(block, x, use_reentrant=False,
        ...                    context_fn=mixprec.checkpoint_context_fn)
    """
    regions = [
        autocast(dev, torch.get_autocast_dtype(dev), True, torch.is_autocast_cache_enabled(),
                 policy=_without_compute(frame.policy))
        for dev in _SUPPORTED
        if (frame := _dispatch.top(dev)) is not None and torch.is_autocast_enabled(dev)
    ]

    @contextlib.contextmanager
    def recompute() -> Any:
        with contextlib.ExitStack() as stack:
            for region in regions:
                stack.enter_context(region)
            yield

    return contextlib.nullcontext(), recompute()


# --------------------------------------------------------------------------- custom functions
def custom_fwd(
    fwd: Callable[..., Any] | None = None,
    *,
    device_type: str,
    cast_inputs: torch.dtype | None = None,
) -> Any:
    """Decorate the ``forward`` of a ``torch.autograd.Function`` for autocast, as PyTorch does.

    With ``cast_inputs=None`` the forward runs in the surrounding autocast state and
    :func:`custom_bwd` replays that state in backward. With a dtype, inside an enabled region the
    floating ``device_type`` inputs are cast to it and the forward runs with autocast off.

    Example:
        >>> class MyMM(torch.autograd.Function):
        ...     @staticmethod
        ...     @mixprec.custom_fwd(device_type="cpu", cast_inputs=torch.float32)
        ...     def forward(ctx, a, b): ...
    """
    if not isinstance(device_type, str):
        raise ValueError(f"Expected `device_type` of type `str`, got: `{type(device_type)}`")
    if fwd is None:
        return functools.partial(custom_fwd, device_type=device_type, cast_inputs=cast_inputs)

    @functools.wraps(fwd)
    def decorate_fwd(*args: Any, **kwargs: Any) -> Any:
        ctx = args[0]
        ctx._dtype = torch.get_autocast_dtype(device_type)
        frame = _dispatch.top(device_type)
        ctx._mixprec_policy = frame.policy if frame is not None else None
        if cast_inputs is None:
            ctx._fwd_used_autocast = torch.is_autocast_enabled(device_type)
            return fwd(*args, **kwargs)
        ctx._fwd_used_autocast = False
        if torch.is_autocast_enabled(device_type):
            with autocast(device_type, enabled=False):
                return fwd(*cast_tree(args, cast_inputs, device_type),
                           **cast_tree(kwargs, cast_inputs, device_type))
        return fwd(*args, **kwargs)

    return decorate_fwd


def custom_bwd(bwd: Callable[..., Any] | None = None, *, device_type: str) -> Any:
    """Decorate the ``backward`` of a ``torch.autograd.Function``: it runs in the autocast state
    (enabled, dtype, mixprec policy) its ``custom_fwd`` forward saw."""
    if not isinstance(device_type, str):
        raise ValueError(f"Expected `device_type` of type `str`, got: `{type(device_type)}`")
    if bwd is None:
        return functools.partial(custom_bwd, device_type=device_type)

    @functools.wraps(bwd)
    def decorate_bwd(*args: Any, **kwargs: Any) -> Any:
        ctx = args[0]
        with autocast(device_type, enabled=ctx._fwd_used_autocast, dtype=ctx._dtype,
                      policy=_without_compute(getattr(ctx, "_mixprec_policy", None))):
            return bwd(*args, **kwargs)

    return decorate_bwd
