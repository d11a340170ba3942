"""What the engine asks of Dynamo: decorators applied once Dynamo is imported, what a trace in
progress is, how much Dynamo has compiled, dropping compiled code traced before our kernels existed
(the guard on the active policy is in :mod:`mixprec.engine.kernels`). Imports nothing of the engine.
"""

from __future__ import annotations

import sys
from typing import Any, Callable

import torch

from mixprec._tree import tracing

__all__ = ["compiler_disable", "assume_constant_result", "reset_compiled_code", "compiled_graphs",
           "mark_compiled_code", "still_compiled", "tracing", "fullgraph", "traced_code", "compile_attempt"]


def reset_compiled_code() -> None:
    """Drop Dynamo's compiled code once new kernels exist, or once the module hooks stay: it was
    traced without them (not while Dynamo compiles)."""
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is None or torch.compiler.is_compiling():
        return
    if compiled_graphs():
        dynamo.reset()


def compiled_graphs() -> int:
    """How many graphs Dynamo has compiled (since its counters were last cleared): whether compile
    is in play (Dynamo's import is not: ``torch.utils.checkpoint`` imports it); 0 before it is
    imported."""
    if "torch._dynamo" not in sys.modules:
        return 0
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def mark_compiled_code() -> Callable[..., None] | None:
    """A mark on the code Dynamo has compiled so far, for :func:`still_compiled`; None when it has
    compiled none. (A no-op compile callback: ``torch._dynamo.reset()`` drops it with the code.)"""
    if not compiled_graphs():
        return None
    from torch._dynamo.callback import callback_handler

    def mark(_args: Any = None) -> None:
        return None

    callback_handler.register_end_callback(mark)
    return mark


def still_compiled(mark: Callable[..., None] | None) -> bool:
    """Whether the code ``mark`` (:func:`mark_compiled_code`) was made on may still be in Dynamo's
    caches: Dynamo has not been reset since."""
    if mark is None:
        return False
    from torch._dynamo.callback import callback_handler

    return mark in callback_handler.end_callbacks


def fullgraph() -> bool:
    """While Dynamo traces: whether this trace may not graph-break."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
        return bool(tx.one_graph or tx.error_on_graph_break)
    except (ImportError, AttributeError, AssertionError):
        return True


def traced_code() -> Any:
    """While Dynamo traces: the code object of the frame it compiles (not of an inlined call)."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        return InstructionTranslator.current_tx().f_code
    except (ImportError, AttributeError, AssertionError):
        return None


def compile_attempt() -> Any:
    """While Dynamo traces: ``(compile id, attempt)`` of the trace in progress, else None."""
    try:
        from torch._guards import CompileContext

        context = CompileContext.try_get()
        return None if context is None else (str(context.compile_id), context.attempt)
    except (ImportError, AttributeError):
        return None


# Decorators for Dynamo, applied once Dynamo is imported: ``torch.compiler.disable`` and
# ``assume_constant_result`` import ``torch._dynamo`` (and sympy: about 3 s of CPU, as long as
# torch itself), and nothing compiles before Dynamo is imported. A function so decorated is
# registered here and decorated, in its module, right after ``torch._dynamo`` is executed (a
# finder on ``sys.meta_path`` sees the import), before any trace can read its module's globals.
# Registry, process-wide like the import it waits for: (module, function name, kind).
_FOR_DYNAMO: list[tuple[str, str, str]] = []


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
