"""Name the module where an inf or NaN first appeared, in forward or in backward.

:func:`trace_nonfinite` installs hooks on every module of a model for the duration of a ``with``
block and removes them on exit: outside the block nothing is registered and nothing is paid.

How the culprit is found:

* **forward**: a forward hook checks each module's floating outputs; hooks fire innermost first,
  so the first non-finite output in time order is the module that produced it from finite inputs.
  A forward pre-hook checks inputs no hook has seen yet (tensors made by a parent's own code
  between two children, or the batch itself): a non-finite one names the enclosing module.
* **backward**: a gradient hook on every tensor that enters or leaves a module. The gradient with
  respect to a module's input is computed by that module's backward, so the first non-finite one
  in time order (the layer nearest the output) names the module; parameter gradients name the
  module that owns the parameter. A tensor taken by several calls (a parent that hands it to a
  child, sibling ``q``, ``k`` and ``v`` projections of one input, two branches) is handed to
  every call after the first as its own alias (``t.view_as(t)``), so the gradient each one sends
  back is checked on its own, before the sum: the child's part names the child, and what the
  parent's own code adds names the parent.
* **in-place ops**: a tensor seen before whose version counter moved (``t._version``) is checked
  again: a module that modifies its input in place and returns it is named as the producer.
* **fp8 layers**: a layer that ran :func:`mixprec.fp8.linear` in a call (its
  ``mixprec.fp8.LayerState`` was updated: ``Policy.fp8`` or ``fp8.convert``) marks its input
  and the gradient of its output as its ``input`` and ``grad_output`` operands, and its weight
  is checked; an event on such a tensor names the fp8 layer and the operand
  (``event.fp8_layer``, ``event.fp8_operand``): a non-finite amax makes the whole GEMM NaN.
* ``precise=True`` adds a :class:`~torch.utils._python_dispatch.TorchDispatchMode` that checks
  every ATen op, so the event also names the op (``"aten.mul.Tensor"``). Slow: debugging only.

Host syncs: the default (eager) mode reads one flag per checked tensor on the host (a sync per
module on CUDA) until the first event, which is what lets ``raise_on_nonfinite`` stop at once.
``deferred=True`` keeps every flag on the device and reads them once, in :meth:`resolve`; on a
step with an event, one more small read fetches the culprit's input ranges.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Literal

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from mixprec._modules import named_modules, unwrap
from mixprec.diagnostics._calls import Call, SeenTensor, min_max, stack_pairs, stats_mark, version_of
from mixprec.diagnostics._module_hook import ModuleHook
from mixprec.diagnostics._tensors import measured, no_autocast
from mixprec.diagnostics.event import NonFiniteError, NonFiniteEvent, Phase
from mixprec.fp8 import layer_state

__all__ = ["NonFiniteEvent", "NonFiniteError", "NonFiniteTracer", "trace_nonfinite"]

class NonFiniteTracer:
    """The object :func:`trace_nonfinite` returns; use it as a context manager.

    Attributes:
        first: the first :class:`NonFiniteEvent` seen since ``__enter__`` (``None`` if none yet;
            in deferred mode it is filled by :meth:`resolve`).
        events: the first event of every window (a window ends at each :meth:`resolve`).
        raise_on_nonfinite: raise :class:`NonFiniteError` as soon as an event is known (in the
            hook in eager mode, in :meth:`resolve` in deferred mode). May be set at any time.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        backward: bool = True,
        deferred: bool = False,
        precise: bool = False,
        raise_on_nonfinite: bool = False,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"trace_nonfinite needs an nn.Module, got {type(model).__name__}")
        self.model = model
        self.backward = backward
        self.deferred = deferred
        self.precise = precise
        self.raise_on_nonfinite = raise_on_nonfinite
        self.first: NonFiniteEvent | None = None
        self.events: list[NonFiniteEvent] = []
        self._handles: list[Any] = []
        self._active = False
        self._mode: Any = None
        self._busy = False
        self._reset_window()
        self._step = -1
        self._stack: list[Call] = []
        self._seen: dict[int, SeenTensor] = {}
        self._last_call: dict[nn.Module, Call] = {}

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> "NonFiniteTracer":
        if self._active:
            raise RuntimeError("this tracer is already active; create a new one to nest")
        self._active = True
        root = unwrap(self.model)  # the names mixprec's rules match: no wrapper's part (DDP's module.)
        for name, module in dict(named_modules(self.model)).items():
            self._handles.append(
                module.register_forward_pre_hook(ModuleHook(self._make_pre_hook(name, module is root)),
                                                 with_kwargs=True)
            )
            self._handles.append(module.register_forward_hook(ModuleHook(self._make_post_hook(name))))
            if self.backward:
                for pname, p in module.named_parameters(recurse=False):
                    if p.requires_grad:
                        self._handles.append(p.register_hook(self._make_param_hook(name, module, pname)))
        if self.precise:
            self._mode = _OpChecker(self)
            self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Remove every hook (and the dispatch mode). Idempotent; ``__exit__`` calls it."""
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._active = False
        self._stack.clear()
        self._seen.clear()
        self._last_call.clear()

    # ------------------------------------------------------------------ windows
    def _reset_window(self) -> None:
        self._window_event: NonFiniteEvent | None = None
        self._window_sources: list[SeenTensor] = []  # the tensors the window's event is about
        self._flags: list[torch.Tensor] = []  # deferred: the checked values, on the device
        self._builders: list[tuple[str, Callable[[str | None], NonFiniteEvent], int]] = []  # (kind, build, step)
        self._pending_op: str | None = None
        self._op_names: dict[int, str] = {}

    def resolve(self) -> NonFiniteEvent | None:
        """Return the first event since the previous ``resolve`` (or ``None``); start a new window.

        In deferred mode this is the one host sync of the step: the values gathered on the device
        are concatenated and copied to the host once (on a step with an event, a second small copy
        fetches the culprit's input ranges). Call it once per step, e.g. when the loss scaler
        reports a skipped step; call :meth:`clear` instead on good steps to drop the flags
        without syncing. Raises :class:`NonFiniteError` if ``raise_on_nonfinite`` is set.
        """
        self._busy = True
        try:
            event = self._resolve_window()
        finally:
            self._busy = False
        self._reset_window()
        if event is not None and self.deferred:  # eager mode recorded it in the hook
            self._record(event, raise_now=self.raise_on_nonfinite)
        return event

    def _resolve_window(self) -> NonFiniteEvent | None:
        event = self._window_event
        if self.deferred and event is None and self._flags:
            values = torch.cat(self._flags).cpu()  # the single host sync
            check = torch.repeat_interleave(torch.tensor([f.numel() for f in self._flags]))
            hits = sorted(set(check[~torch.isfinite(values)].tolist()))
            if hits:
                kind, build, step = self._builders[hits[0]]
                op = None
                if kind == "op":  # the op names itself; the next module-level hit names the module
                    op = self._op_names[hits[0]]
                    nxt = [i for i in hits if self._builders[i][0] != "op"]
                    event = self._builders[nxt[0]][1](op) if nxt else None
                else:
                    event = build(None)
                if event is not None:  # built now: the step it was checked in, not this one
                    event = dataclasses.replace(event, step=step)
        return event

    def clear(self) -> None:
        """Drop the flags gathered since the last :meth:`resolve` without reading them (no sync)."""
        self._reset_window()

    def _record(self, event: NonFiniteEvent, raise_now: bool) -> None:
        if self.first is None:
            self.first = event
        if not self.events or self.events[-1] is not event:
            self.events.append(event)
        if raise_now:
            raise NonFiniteError(event)

    # ------------------------------------------------------------------ checks
    def _check(self, pairs: torch.Tensor, kind: str,
               build: Callable[[str | None], NonFiniteEvent], op: str | None = None,
               sources: list[SeenTensor] | None = None) -> None:
        """Flag ``pairs`` (``[k, 2]`` mins/maxes) if any is non-finite; eager mode syncs here."""
        if self.deferred:  # keep the values on the device; resolve() tests them all at once
            if kind == "op":
                self._op_names[len(self._flags)] = op  # type: ignore[assignment]
            self._flags.append(pairs.flatten())
            self._builders.append((kind, build, max(self._step, 0)))
            return
        if bool(torch.isfinite(pairs).all()):  # host sync (eager mode)
            return
        if kind == "op":
            if self._pending_op is None:
                self._pending_op = op
            return
        event = build(self._pending_op)
        self._window_event = event
        self._window_sources = sources or []
        self._record(event, raise_now=self.raise_on_nonfinite)

    def _watching(self) -> bool:
        # eager mode stops checking once the window has its event: no more syncs that step
        return self._active and (self.deferred or self._window_event is None)

    def _event(self, call_name: str, module: nn.Module, phase: Phase, tensor: str,
               pairs: torch.Tensor, dtype: torch.dtype, inputs: list[torch.Tensor],
               op: str | None, detail: str = "", fp8: tuple[str, str] | None = None) -> NonFiniteEvent:
        # one device-to-host copy for the culprit's values and every input range
        host = torch.cat([pairs.flatten(), *(p.flatten() for p in inputs)]).cpu().tolist()
        n = pairs.numel()
        kind: Literal["inf", "nan"] = "nan" if any(math.isnan(v) for v in host[:n]) else "inf"
        ranges = tuple(zip(host[n::2], host[n + 1::2]))
        return NonFiniteEvent(
            module=call_name, module_type=type(module).__name__, phase=phase, tensor=tensor,
            kind=kind, dtype=dtype, input_ranges=ranges, op=op,
            step=max(self._step, 0), detail=detail,
            fp8_layer=None if fp8 is None else fp8[0], fp8_operand=None if fp8 is None else fp8[1],
        )

    def _forward_fp8(self, sources: list[SeenTensor], call: Call | None) -> tuple[str, str] | None:
        """The fp8 layer and operand a forward event's tensors were: an fp8 layer's input, or,
        for the output of an fp8 call, its weight when that is non-finite (reads it: one sync)."""
        for info in sources:
            if info.fp8_use is not None:
                return info.fp8_use
        if call is not None and call.fp8 and call.weight_pair is not None \
                and not bool(torch.isfinite(call.weight_pair).all()):
            return call.name, "weight"
        return None

    def _note_fp8_input(self, call: Call) -> None:
        """``call`` ran in fp8: mark its input as the fp8 ``input`` operand, measure its weight,
        and name the layer in the window's event if that event is about this input (eager mode
        builds events before the layer runs)."""
        call.fp8 = True
        weight = getattr(call.module, "weight", None)
        if isinstance(weight, torch.Tensor) and self._active:
            call.weight_pair = min_max(weight)
        if not call.inputs:
            return
        info = call.inputs[0]
        info.fp8_use = (call.name, "input")
        event = self._window_event
        if event is not None and event.fp8_layer is None and any(s is info for s in self._window_sources):
            new = dataclasses.replace(event, fp8_layer=call.name, fp8_operand="input")
            self._window_event = new
            if self.first is event:
                self.first = new
            if self.events and self.events[-1] is event:
                self.events[-1] = new

    def _known(self, t: torch.Tensor) -> SeenTensor | None:
        """What was recorded about ``t``, unless it is another tensor or was modified in place."""
        info = self._seen.get(id(t))
        if info is None or info.ref() is not t or info.version != version_of(t):
            return None
        return info

    def _shared(self, info: SeenTensor, call: Call) -> bool:
        """Whether ``info``'s tensor was already taken by another call (a sibling, or an
        enclosing module whose own code may use it too)."""
        return self.backward and info.consumer is not None and info.consumer is not call

    def _watch_grad(self, t: torch.Tensor, info: SeenTensor) -> None:
        if self.backward and t.requires_grad:
            handle = t.register_hook(self._make_grad_hook(info))
            if t.grad_fn is None:  # a leaf (a parameter passed as input) outlives the graph
                self._handles.append(handle)

    # ------------------------------------------------------------------ hooks
    def _quiet(self, hook: Callable[..., Any]) -> Callable[..., Any]:
        """Run ``hook``'s own math with autocast off (in the dtypes of the tensors it measures:
        under the user's autocast its ``stack`` of a bfloat16 pair would be a float16 promote,
        an error, and its casts would change what the model runs), and in precise mode, keep
        the tracer's own reductions out of the op checks."""

        def quiet(*args: Any, **kwargs: Any) -> Any:
            self._busy = True
            try:
                with no_autocast():
                    return hook(*args, **kwargs)
            finally:
                self._busy = False

        return quiet

    def _make_pre_hook(self, name: str, is_root: bool) -> Callable[..., None]:
        def pre_hook(module: nn.Module, args: tuple[Any, ...],
                     kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]] | None:
            if is_root:  # a new forward of the model (a stack left by an exception is dropped)
                self._stack.clear()
                self._step += 1
                self._seen.clear()
            parent = self._stack[-1] if self._stack else None
            call = Call(name, module, parent)
            self._stack.append(call)
            if not self._active:
                return
            fresh: list[tuple[torch.Tensor, torch.Tensor]] = []
            fresh_infos: list[SeenTensor] = []
            aliases: dict[int, torch.Tensor] = {}
            for t in measured((args, kwargs) if kwargs else args):
                info = self._known(t)
                if info is None:
                    pair = min_max(t)
                    info = SeenTensor(t, pair, producer=None, enclosing=parent)
                    self._seen[id(t)] = info
                    self._watch_grad(t, info)
                    fresh.append((t, pair))
                    fresh_infos.append(info)
                elif id(t) in aliases:  # the same tensor passed twice to this call
                    info = self._seen[id(aliases[id(t)])]
                elif self._shared(info, call) and t.requires_grad and not t.is_leaf and torch.is_grad_enabled():
                    # another call took t already: this call gets its own alias, so the gradient
                    # it sends back to t is checked before it is summed with the others. Not a
                    # leaf (a parameter or a batch that requires grad): autocast caches its cast
                    # by identity, an alias would cast again and change the gradient's rounding
                    alias = aliases[id(t)] = t.view_as(t)
                    info = SeenTensor(alias, info.pair, producer=info.producer,
                                   enclosing=info.enclosing)
                    self._seen[id(alias)] = info
                    self._watch_grad(alias, info)
                info.consumer = call
                call.input_pairs.append(info.pair)
                call.inputs.append(info)
            if fresh and self._watching():
                pairs = stack_pairs([p for _, p in fresh])
                dtypes = [t.dtype for t, _ in fresh]

                def build(op: str | None) -> NonFiniteEvent:
                    dtype = _first_nonfinite(dtypes, pairs)
                    fp8 = self._forward_fp8(fresh_infos, None)
                    if parent is None:
                        return self._event(name, module, "forward", "input", pairs, dtype,
                                           call.input_pairs, op, fp8=fp8)
                    return self._event(parent.name, parent.module, "forward", "intermediate",
                                       pairs, dtype, parent.input_pairs, op,
                                       detail=f"passed to {name!r}", fp8=fp8)

                self._check(pairs, "module", build, sources=fresh_infos)
            if aliases:
                swap = lambda a: aliases.get(id(a), a) if isinstance(a, torch.Tensor) else a
                return tree_map(swap, (args, kwargs))
            return None

        return self._quiet(pre_hook)

    def _make_post_hook(self, name: str) -> Callable[..., None]:
        def post_hook(module: nn.Module, args: Any, output: Any) -> None:
            while self._stack and self._stack[-1].module is not module:
                self._stack.pop()  # a child raised mid-forward last time
            call = self._stack.pop() if self._stack else Call(name, module, None)
            self._last_call[module] = call
            if not self._active:
                return
            state = layer_state(module, create=False) if call.fp8_mark is not None else None
            if state is not None and stats_mark(state) != call.fp8_mark:  # it ran fp8.linear
                self._note_fp8_input(call)
            outs = measured(output)
            fresh: list[tuple[torch.Tensor, torch.Tensor]] = []
            fresh_infos: list[SeenTensor] = []
            for t in outs:
                info = self._known(t)
                if info is not None:  # an input or a child's output, passed through
                    call.outputs.append(info)
                    if info.consumer is None:  # it leaves this call: whoever takes it is outside
                        info.enclosing = call.parent
                    continue
                pair = min_max(t)
                info = SeenTensor(t, pair, producer=call, enclosing=call.parent)
                self._seen[id(t)] = info
                call.outputs.append(info)
                self._watch_grad(t, info)
                fresh.append((t, pair))
                fresh_infos.append(info)
            if fresh and self._watching():
                pairs = stack_pairs([p for _, p in fresh])
                dtypes = [t.dtype for t, _ in fresh]
                self._check(pairs, "module", lambda op: self._event(
                    name, module, "forward", "output", pairs, _first_nonfinite(dtypes, pairs), call.input_pairs, op,
                    fp8=self._forward_fp8([], call)), sources=fresh_infos)

        return self._quiet(post_hook)

    def _make_grad_hook(self, info: SeenTensor) -> Callable[[torch.Tensor], None]:
        def grad_hook(grad: torch.Tensor) -> None:
            if not self._watching() or not grad.is_floating_point() or grad.numel() == 0:
                return
            pair = min_max(grad)
            info.grad_pair = pair
            pairs = pair[None]

            def build(op: str | None) -> NonFiniteEvent:
                # the gradient of an fp8 layer's output is its grad_output operand
                p = info.producer
                fp8 = (p.name, "grad_output") if p is not None and p.fp8 else None
                if info.consumer is not None:
                    c = info.consumer
                    arrived = [o.grad_pair for o in c.outputs if o.grad_pair is not None]
                    return self._event(c.name, c.module, "backward", "grad_input", pairs,
                                       grad.dtype, arrived, op, fp8=fp8)
                if info.enclosing is not None:
                    e = info.enclosing
                    arrived = [o.grad_pair for o in e.outputs if o.grad_pair is not None]
                    made_by = p.name if p is not None else "?"
                    return self._event(e.name, e.module, "backward", "intermediate", pairs,
                                       grad.dtype, arrived, op,
                                       detail=f"gradient of the output of {made_by!r}", fp8=fp8)
                # no consumer, no enclosing call: an output of the model itself
                return self._event("", self.model, "backward", "grad_output", pairs,
                                   grad.dtype, [], op, detail="gradient of the loss", fp8=fp8)

            self._check(pairs, "module", build)

        return self._quiet(grad_hook)

    def _make_param_hook(self, name: str, module: nn.Module, pname: str) -> Callable[..., None]:
        def param_hook(grad: torch.Tensor) -> None:
            if not self._watching():
                return
            pairs = min_max(grad)[None]

            def build(op: str | None) -> NonFiniteEvent:
                call = self._last_call.get(module)
                arrived = [] if call is None else [
                    o.grad_pair for o in call.outputs if o.grad_pair is not None]
                return self._event(name, module, "backward", f"grad:{pname}", pairs,
                                   grad.dtype, arrived, op)

            self._check(pairs, "module", build)

        return self._quiet(param_hook)

    def _check_op(self, func: Any, out: Any) -> None:
        if not self._watching():
            return
        ts = measured(out)
        if ts:
            self._check(stack_pairs([min_max(t) for t in ts]), "op",
                        lambda op: None, op=str(func))  # type: ignore[arg-type,return-value]


class _OpChecker(TorchDispatchMode):
    """Checks the floating outputs of every ATen op (``precise=True``)."""

    def __init__(self, tracer: NonFiniteTracer) -> None:
        super().__init__()
        self.tracer = tracer

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        # skip the tracer's own reductions (inside its hooks) and uninitialised memory
        if not self.tracer._busy and "empty" not in func.__name__:
            with no_autocast():
                self.tracer._check_op(func, out)
        return out


def trace_nonfinite(
    model: nn.Module,
    *,
    backward: bool = True,
    deferred: bool = False,
    precise: bool = False,
    raise_on_nonfinite: bool = False,
) -> NonFiniteTracer:
    """Context manager that names the first module whose output or gradient is inf/NaN.

    Args:
        model: the model; every submodule (and parameter, if ``backward``) is watched.
        backward: also watch gradients (of module inputs/outputs and of parameters).
        deferred: keep the checks on the device, no host sync per module; call
            :meth:`NonFiniteTracer.resolve` (or :meth:`~NonFiniteTracer.clear`) once per step:
            the checks of a step are held until then.
        precise: also check every ATen op and report it in ``event.op`` (slow).
        raise_on_nonfinite: raise :class:`NonFiniteError` as soon as the event is known.

    Returns:
        A :class:`NonFiniteTracer`; hooks are installed by ``__enter__`` and removed by
        ``__exit__``, so there is no cost outside the ``with`` block.

    Host syncs: eager mode syncs once per checked tensor until the first event of the window;
    deferred mode syncs only in ``resolve``.

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
        >>> with trace_nonfinite(model) as tracer:
        ...     model[1].weight.data[0, 0] = float("inf")
        ...     _ = model(torch.ones(1, 4))
        >>> tracer.first.module, tracer.first.phase
        ('1', 'forward')
    """
    return NonFiniteTracer(model, backward=backward, deferred=deferred, precise=precise,
                           raise_on_nonfinite=raise_on_nonfinite)


def _first_nonfinite(dtypes: list[torch.dtype], pairs: torch.Tensor) -> torch.dtype:
    """The dtype of the first tensor whose ``(min, max)`` pair (a row of ``pairs``) is not finite
    (one host read: the event is being built)."""
    bad = (~torch.isfinite(pairs.reshape(len(dtypes), -1)).all(dim=1)).nonzero().flatten().tolist()
    return dtypes[bad[0] if bad else 0]
