"""mixprec's C++ kernels against their torch code, in one process: :class:`KernelSpy` (the
``kernel_spy`` fixture of tests/conftest.py) counts the kernels called through
``torch.ops.mixprec_native``; :func:`both` runs a computation with the kernels, then with the
torch code (``MIXPREC_NATIVE_KERNELS=0``, read at every call)."""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable

import pytest


class KernelSpy:
    """``torch.ops.mixprec_native`` that counts, by name, the kernels fetched through it."""

    def __init__(self, ops: Any) -> None:
        self.ops, self.calls = ops, Counter()

    def __getattr__(self, name: str) -> Any:
        self.calls[name] += 1
        return getattr(self.ops, name)


def both(fn: Callable[[], Any], monkeypatch: pytest.MonkeyPatch) -> tuple[Any, Any]:
    """``fn()`` with the kernels, then with the torch code."""
    with_kernels = fn()
    with monkeypatch.context() as m:
        m.setenv("MIXPREC_NATIVE_KERNELS", "0")
        return with_kernels, fn()
