"""A diagnostic's forward hook that a copy of the module does not carry live."""

from __future__ import annotations

from typing import Any, Callable


class ModuleHook:
    """``hook`` as a module's forward (pre-)hook, copied and pickled as an inert hook:
    ``copy.deepcopy`` copies a module's hooks, so an EMA copy taken inside a ``with`` block would
    report to the original's tracer under the original's names, and a closure cannot be pickled
    (``pickle.dumps(model)`` inside the block would raise).

    Example:
        >>> import copy, torch
        >>> calls = []
        >>> lin = torch.nn.Linear(2, 2)
        >>> _ = lin.register_forward_hook(ModuleHook(lambda m, args, out: calls.append(m)))
        >>> _ = lin(torch.ones(2)), copy.deepcopy(lin)(torch.ones(2))
        >>> len(calls)
        1
    """

    def __init__(self, hook: Callable[..., Any] | None = None) -> None:
        self.hook = hook

    def __call__(self, *args: Any) -> Any:
        return None if self.hook is None else self.hook(*args)

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        return (ModuleHook, ())
