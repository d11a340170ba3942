"""``mixprec.autocast``: the autocast region, ``custom_fwd``/``custom_bwd``, checkpointing.

The op-by-op casting lives in :mod:`mixprec.engine.kernels` and :mod:`mixprec.engine.casts`,
module rules in :mod:`mixprec.engine.module_calls`; this module manages regions, entering and
leaving the thread's state through :func:`mixprec.engine.runtime.enter`: the autocast state
PyTorch's dispatcher reads (so the ``Autocast*`` dispatch keys are active), the stack of mixprec
frames our kernels consult, and, when a policy has module rules, an output dtype or fp8 layers,
the module hooks for the region's lifetime. Inside ``torch.compile`` a region is traced (see
``autocast.__enter__`` and :mod:`mixprec.engine.compile`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
import warnings
from typing import Any, Callable, TypeVar

import torch

from mixprec._tree import cast_tree
from mixprec.engine import module_calls, runtime
from mixprec.engine.compile import traced_key
from mixprec.engine.dynamo import assume_constant_result, compiler_disable, tracing as _tracing
from mixprec.engine.kernels import ensure_kernels
from mixprec.engine.module_calls import traced_region, traced_without_fullgraph
from mixprec.engine.runtime import DEVICES, RUNTIME, Frame, disabled_frame, top
from mixprec.policy import Policy, canonical, parse_dtype

__all__ = [
    "autocast",
    "is_autocast_enabled",
    "get_autocast_dtype",
    "custom_fwd",
    "custom_bwd",
    "checkpoint_context_fn",
    "DeviceTypeError",
]

F = TypeVar("F", bound=Callable[..., Any])
# torch.autocast's class: mixprec.autocast passes ``isinstance(ctx, torch.autocast)``. The
# subclass torch keeps for its own unmanaged regions, so that Dynamo, which turns a
# ``torch.autocast`` instance it meets (a decorator's, one built outside the compiled code) into
# its own autocast (dropping the policy), inlines ours as any object.
_TorchAutocast = getattr(torch.amp.autocast_mode, "_UnmanagedAutocast", torch.amp.autocast_mode.autocast)


class DeviceTypeError(ValueError, RuntimeError):
    """A ``device_type`` mixprec.autocast does not run: both torch's ``RuntimeError`` and a
    ``ValueError``, so code that catches either keeps working."""


def _device_type(device_type: str) -> str:
    """``"cpu"``/``"cuda"`` from a device string: an index is dropped (autocast state is per device
    type, as in torch: ``"cuda:1"`` -> ``"cuda"``).

    Raises:
        ValueError: not a string (as torch).
        DeviceTypeError: another device, a malformed index or an upper-case name.
    """
    if not isinstance(device_type, str):
        hint = "; pass its .type (e.g. 'cuda')" if isinstance(device_type, torch.device) else ""
        raise ValueError(f"Expected `device_type` of type `str`, got: `{type(device_type)}`{hint}")
    kind, sep, index = device_type.partition(":")
    if kind in DEVICES and (not sep or index.isdigit()):
        return kind
    try:  # torch's own words lead (code written against torch.autocast matches them)
        torch.device(device_type)
        torch_words = ""
    except RuntimeError as e:
        torch_words = f"{e}. "
    if sep and not index.isdigit():
        raise DeviceTypeError(f"{torch_words}mixprec.autocast got device_type={device_type!r}: write "
                              f"{kind.lower()!r} (an index after ':' must be a number, and is ignored)")
    if kind.lower() in DEVICES:
        raise DeviceTypeError(f"{torch_words}mixprec.autocast got device_type={device_type!r}; write "
                              f"{kind.lower()!r} (device types are lower case)")
    raise DeviceTypeError(
        f"{torch_words}mixprec.autocast supports device_type 'cpu' and 'cuda' (or 'cuda:N'), got "
        f"{device_type!r}; for another device use torch.autocast({kind!r}, ...)"
    )


def _dtype(dtype: Any) -> torch.dtype | None:
    """A region's ``dtype`` argument: a torch.dtype, a name :meth:`Policy.parse` accepts, or None."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str):
        return parse_dtype(dtype)  # ValueError listing the names
    raise TypeError(f"mixprec.autocast dtype must be a torch.dtype or a name such as 'bf16', got {dtype!r}")


def is_autocast_enabled(device_type: str = "cuda") -> bool:
    """Whether autocast (mixprec's or PyTorch's) is on for ``device_type`` in this thread."""
    return torch.is_autocast_enabled(device_type)


def get_autocast_dtype(device_type: str = "cuda") -> torch.dtype:
    """The low-precision dtype autocast uses for ``device_type`` in this thread."""
    return torch.get_autocast_dtype(device_type)


def _resolve(device_type: str, dtype: torch.dtype | str | None, enabled: bool,
             policy: Policy | str | None) -> tuple[Policy, torch.dtype, bool]:
    """Validate a region's arguments: ``(policy, dtype, enabled)`` as the region runs them."""
    device_type, dtype = _device_type(device_type), _dtype(dtype)
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
        lost = "" if policy.fp8_rule is None and not policy.module_rules else (
            " This policy's fp8 rule and module rules then do nothing either: set compute=bf16 or fp16, or run "
            "fp8 layers in a float32 model with mixprec.fp8.convert(model, recipe).")
        warnings.warn(
            f"In {device_type.upper()} autocast, but the target dtype {dtype} is not supported. "
            f"Disabling autocast. Autocast only supports torch.bfloat16 and torch.float16.{lost}",
            stacklevel=3,
        )
        enabled = False
    return policy, dtype, bool(enabled)


@assume_constant_result
def _traced_region(device_type: str, dtype: torch.dtype | None, enabled: bool,
                   policy: Policy | str | None) -> tuple[int, torch.dtype, bool]:
    """Run by Dynamo at trace time (not traced): resolve a region and key its policy."""
    policy, dtype, enabled = _resolve(device_type, dtype, enabled, policy)
    if enabled and policy.acts_on_modules:
        module_calls.install_permanently()
    return (traced_key(policy, device_type) if enabled else -1), dtype, enabled


@assume_constant_result
def _traced_eagerly(device_type: str, dtype: torch.dtype | None, enabled: bool, policy: Policy | str | None) -> bool:
    """Run by Dynamo at trace time (not traced): whether a region traced without ``fullgraph``
    runs eagerly instead, because its policy needs the module hooks (module rules, fp8 layers,
    ``output=``): those hooks may graph-break and run eagerly, where a traced region is not seen."""
    policy, dtype, enabled = _resolve(device_type, dtype, enabled, policy)
    return enabled and policy.acts_on_modules and traced_without_fullgraph()


def _thread() -> int:
    """The key of this thread's open entries of a region object (entered by several at once)."""
    return threading.get_ident()


@compiler_disable
def _enter_eagerly(region: "autocast") -> None:
    """Enter ``region`` (built while Dynamo traced) eagerly, outside the trace."""
    region._enter_eager()


@compiler_disable
def _exit_eagerly(region: "autocast") -> None:
    region._exit_eager()



@assume_constant_result
def _exporting() -> bool:
    """Whether torch.export is tracing (read once per trace: a constant to Dynamo)."""
    return torch.compiler.is_exporting()


class autocast(_TorchAutocast):
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
        device_type: ``"cpu"`` or ``"cuda"``; an index is ignored (``"cuda:0"`` is ``"cuda"``:
            autocast state is per device type, as in torch).
        dtype: low-precision dtype, a ``torch.dtype`` or a name :meth:`Policy.parse` accepts
            (``"bf16"``, ``"float16"``, ``"half"``, ...); default: ``policy.compute`` if set, else
            the thread's current autocast dtype (bfloat16 on CPU, float16 on CUDA unless changed).
        enabled: ``False`` turns autocast off inside (nested regions may turn it on again).
        cache_enabled: cache weight casts for the region; ``None`` (default, as torch): the
            setting in force where the region is built (torch's default is on).
        policy: a :class:`mixprec.Policy` or a string for :meth:`Policy.parse` (e.g.
            ``"fp32-numerics"``); edits to the op lists, module rules (:meth:`Policy.keep`) and
            an output dtype apply inside this region.
        root: the module that module rules name modules from (``keep(names=...)``, fp8 layer
            selection); default: the outermost module called in the region, or, decorating a
            module's ``forward``, that module. Give the model when the region is entered inside
            its ``forward`` (a framework's wrapper).

    Usable as a context manager and as a decorator. State is thread-local. An instance of
    ``torch.autocast`` (``isinstance(ctx, torch.autocast)`` holds).

    Example:
        >>> model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
        >>> policy = mixprec.Policy.parse("compute=bf16,output=f32").keep(types=(nn.LayerNorm,))
        >>> with mixprec.autocast("cpu", policy=policy):
        ...     y = model(torch.randn(2, 4))
        >>> y.dtype
        torch.float32

    Raises:
        ValueError: ``device_type`` is not a string, ``dtype`` is an unknown name, or ``dtype``
            and ``policy.compute`` are both given and differ.
        DeviceTypeError: (a ``ValueError`` and a ``RuntimeError``) ``device_type`` is not cpu or
            cuda; the message says what to write.
        TypeError: ``policy`` is neither a Policy nor a string, or ``dtype`` neither a dtype
            nor a string; ``root`` is not an ``nn.Module``.
        RuntimeError: bfloat16 on a CUDA device without bf16 support.
    """

    def __init__(
        self,
        device_type: str,
        dtype: torch.dtype | str | None = None,
        enabled: bool = True,
        cache_enabled: bool | None = None,
        *,
        policy: Policy | str | None = None,
        root: torch.nn.Module | None = None,
    ) -> None:
        self.device = _device_type(device_type)
        self._enabled = bool(enabled)
        self._cache_enabled = cache_enabled if cache_enabled is None else bool(cache_enabled)
        self._saved: list[tuple[Any, ...]] = []  # per entry traced by Dynamo: (ctx, key)
        # per thread, per open eager entry: (Entry, hooked) (one instance may be entered by several)
        self._open: dict[int, list[tuple[Any, bool]]] = {}
        if root is not None and not isinstance(root, torch.nn.Module):
            raise TypeError(f"mixprec.autocast root must be an nn.Module, got {type(root).__name__}")
        self._root = root
        self._resolved = False
        self.fast_dtype, self.policy, self._raw = dtype, policy, (dtype, enabled, policy)
        if not _tracing():  # else resolved at trace time by _traced_region, or on an eager enter
            self._resolve_args()

    def _resolve_args(self) -> None:
        dtype, enabled, policy = self._raw
        if self._cache_enabled is None:  # as torch.autocast: inherit the enclosing setting
            self._cache_enabled = torch.is_autocast_cache_enabled()
        self.policy, self.fast_dtype, self._enabled = _resolve(self.device, dtype, enabled, policy)
        self._resolved = True

    # Inside a function given to torch.compile, Dynamo traces __enter__/__exit__: the region
    # becomes torch.amp._enter_autocast (which Dynamo knows) plus mixprec::region nodes that
    # push the policy's frame wherever the graph is traced or run (see engine.compile). Dynamo guards
    # on the policy like on any value the traced code reads, so another policy recompiles.
    def __enter__(self) -> "autocast":
        if _exporting():
            raise RuntimeError(
                "torch.export does not record a mixprec.autocast region: the exported program would run it in "
                "float32, silently; export the model without the region (a serving engine casts by itself), or "
                "export under torch.autocast, whose state torch.export records")
        if _tracing():
            return self._enter_traced()
        return self._enter_eager()

    def _enter_eager(self) -> "autocast":
        if not self._resolved:  # built while Dynamo traced, entered eagerly
            self._resolve_args()
        dev = self.device
        if self._enabled:
            edits = self.policy.edits(dev)
            if edits:
                ensure_kernels(edits, dev)
            frame = Frame(dev, edits, self.policy)
        else:  # governs too: an enclosing policy's module rules and fp8 layers stop here
            frame = disabled_frame(dev)
        entry = runtime.enter(frames=(frame,), devices=((dev, self._enabled, self.fast_dtype),),
                      cache=self._cache_enabled, nest=True)
        hooked = self._enabled and (self.policy.acts_on_modules or module_calls.looks_for_checkpoints(frame))
        if hooked:
            module_calls.enter_region(frame, root=self._root)
        self._open.setdefault(_thread(), []).append((entry, hooked))
        return self

    def __exit__(self, *exc: Any) -> None:
        if _tracing():
            return self._exit_traced()
        self._exit_eager()

    def _exit_eager(self) -> None:
        thread = _thread()
        entries = self._open[thread]
        entry, hooked = entries.pop()
        if not entries:
            del self._open[thread]
        if hooked:
            module_calls.exit_region(entry.frames[0])
        runtime.leave(entry)

    def _enter_traced(self) -> "autocast":
        dtype, enabled, policy = self._traced_args()
        if _traced_eagerly(self.device, dtype, enabled, policy):
            _enter_eagerly(self)
            return self
        key, dtype, enabled = _traced_region(self.device, dtype, enabled, policy)
        ctx = torch.amp._enter_autocast(self.device, dtype, enabled, self._cache_enabled)
        torch.ops.mixprec.region(self.device, key, True)
        traced_region(self._root, key, True)
        self._saved.append((ctx, key))
        return self

    def _traced_args(self) -> tuple[Any, bool, Any]:
        dtype, enabled, policy = self._raw
        if isinstance(policy, Policy):  # Dynamo guards on the object passed: one per value
            policy = canonical(policy)
        return dtype, enabled, policy

    def _exit_traced(self) -> None:
        if _traced_eagerly(self.device, *self._traced_args()):
            _exit_eagerly(self)
            return
        ctx, key = self._saved.pop()
        traced_region(self._root, key, False)
        torch.ops.mixprec.region(self.device, key, False)
        torch.amp._exit_autocast(ctx)

    def __call__(self, func: F) -> F:
        @functools.wraps(func)
        def decorate_autocast(*args: Any, **kwargs: Any) -> Any:
            root = self._root
            forward = func.__name__ == "forward" and bool(args) and isinstance(args[0], torch.nn.Module)
            if root is None and forward:
                root = args[0]  # a decorated forward: module rules name modules from its module
            with autocast(self.device, self.fast_dtype, self._enabled, self._cache_enabled,
                          policy=self.policy, root=root):
                out = func(*args, **kwargs)
            # the decorated function's result is cast to output= (a decorated forward's is its
            # module's output, cast as around the model); a disabled region casts nothing
            if self._enabled and self.policy.output is not None:
                return cast_tree(out, self.policy.output)
            return out

        return decorate_autocast  # type: ignore[return-value]

    def __repr__(self) -> str:
        return (f"mixprec.autocast({self.device!r}, dtype={self.fast_dtype}, "
                f"enabled={self._enabled}, policy={self.policy})")


def _without_compute(policy: Policy | None) -> Policy | None:
    """The policy of a region being replayed with the dtype it actually ran in."""
    return policy if policy is None or policy.compute is None else dataclasses.replace(policy, compute=None)


# --------------------------------------------------------------------------- checkpointing
def checkpoint_context_fn() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """``context_fn`` for ``torch.utils.checkpoint(..., use_reentrant=False)`` under mixprec.

    PyTorch recomputes a checkpointed segment in backward under ``torch.autocast`` with the
    forward's dtype, that is under PyTorch's default op lists and outside any module call. With
    a mixprec policy the recomputed tensors would then differ from the forward's (PyTorch raises
    "Recomputed values ... have different metadata"): edited ops, and module rules that name a
    checkpointed submodule from its model. Passing this function as ``context_fn`` recomputes in
    the forward's context: its mixprec regions (policy, dtype, cache flag, autocast state), the
    module calls the segment ran inside (so qualified names keep their prefix and ``output=``
    applies where it did) and its fp8 layers. A recompute is not a forward: fp8 layers are not
    selected again and a guard sees no extra forward. Values and gradients are bitwise those of
    the un-checkpointed forward.

    Example:
        >>> from torch.utils.checkpoint import checkpoint
        >>> with mixprec.autocast("cpu", policy=policy):
        ...     y = checkpoint(block, x, use_reentrant=False,
        ...                    context_fn=mixprec.checkpoint_context_fn)
    """
    replay = _Replay()
    return replay.forward(), replay


class _Replay:
    """The mixprec state where a checkpointed segment ran, entered again for its recompute."""

    def __init__(self) -> None:
        self.regions = [(frame, torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev))
                        for dev in DEVICES if (frame := top(dev)) is not None]
        self.cache = torch.is_autocast_cache_enabled()
        self.rules = module_calls.capture()
        self._stack: list[tuple[Any, ...]] = []

    @contextlib.contextmanager
    def forward(self) -> Any:
        """Around the segment's forward: records the fp8 layers it ran with."""
        RUNTIME.checkpointed += 1
        try:
            yield
        finally:
            RUNTIME.checkpointed -= 1
        self.rules = module_calls.capture(self.rules)

    def __enter__(self) -> None:
        frames = [dataclasses.replace(frame, traced=False) for frame, _, _ in self.regions]
        for frame in frames:
            if frame.edits:  # (released since the forward)
                ensure_kernels(frame.edits, frame.device_type)
        entry = runtime.enter(frames=frames, devices=[(f.device_type, enabled, dtype)
                                              for f, (_, enabled, dtype) in zip(frames, self.regions)],
                      cache=self.cache, nest=True)
        stand_ins = {id(old): new for (old, _, _), new in zip(self.regions, frames)}
        restore = module_calls.replay(self.rules, stand_ins)
        self._stack.append((entry, restore))

    def __exit__(self, *exc: Any) -> None:
        entry, restore = self._stack.pop()
        restore()
        runtime.leave(entry)


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
        frame = top(device_type)
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
