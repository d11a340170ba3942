"""Import paths that moved, kept as aliases for one release (0.2 removes them).

Issue 36 gave fp8's low-bit formats, its precision control and the policy value packages of their
own (:mod:`mixprec.formats`, :mod:`mixprec.control`, :mod:`mixprec.policy`). Code, pickles and
``torch.save`` files written before the move name the old modules (``mixprec.fp8._recipe``,
``mixprec._codec``, ...): importing one imports its new module under the old name too, with a
DeprecationWarning naming the new path. Nothing is imported before an old name is asked for.

Example:
    >>> import importlib, warnings
    >>> with warnings.catch_warnings():
    ...     warnings.simplefilter("ignore", DeprecationWarning)
    ...     old = importlib.import_module("mixprec.fp8._recipe")
    >>> old is importlib.import_module("mixprec.formats._recipe")
    True
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType

__all__ = ["MOVED", "install"]

_FORMATS = ("_recipe", "_blocks", "_quant", "_fp4", "_fp4_linear", "_state", "_linear", "_fsdp", "_like", "_layers")
_CONTROL = ("_controller", "_decide", "_ladder", "_trend", "_guard", "_collective", "_convert")

#: old module path -> where it lives now
MOVED: dict[str, str] = {
    **{f"mixprec.fp8.{m}": f"mixprec.formats.{m}" for m in _FORMATS},
    **{f"mixprec.fp8.{m}": f"mixprec.control.{m}" for m in _CONTROL},
    "mixprec.fp8._rule": "mixprec.policy._rule",
    "mixprec._policy_text": "mixprec.policy._text",
    "mixprec._codec": "mixprec.policy._codec",
}


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old path of :data:`MOVED` and loads it as its new module (the same object)."""

    def __init__(self) -> None:
        self._specs: dict[str, importlib.machinery.ModuleSpec] = {}  # old name -> the new module's own spec

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        new = MOVED[spec.name]
        warnings.warn(f"{spec.name} moved to {new} (mixprec 0.1.x keeps the old path as an alias; 0.2 removes "
                      f"it): import {new}, or re-save pickles and checkpoints that name it", DeprecationWarning,
                      stacklevel=2)
        module = importlib.import_module(new)
        self._specs[spec.name] = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run (the module is the new one, already imported): undo the import system's
        overwrite of its ``__spec__`` with the alias's."""
        module.__spec__ = self._specs[module.__spec__.name]


_FINDER = _Alias()


def install() -> None:
    """Put the alias finder last on ``sys.meta_path`` (once): real modules are always found first."""
    if _FINDER not in sys.meta_path:
        sys.meta_path.append(_FINDER)
