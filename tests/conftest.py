"""Shared fixtures: ``syncs`` counts host reads of device memory; ``native_ops`` is mixprec's
C++ kernels (a skip without them, a failure in CI: ``_native_required``); ``fresh_dynamo``
resets Dynamo around a test (``pytestmark = pytest.mark.usefixtures("fresh_dynamo")``). Every
test starts from its own seed and leaves torch's thread count as it found it (autouse)."""

from __future__ import annotations

import random
import zlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from _native_required import kernels_missing
from _pytest_setup import NO_TIMEOUT
from mixprec import _native




def pytest_addoption(parser: pytest.Parser, pluginmanager: pytest.PytestPluginManager) -> None:
    """Without pytest-timeout, declare pyproject's ``timeout`` ini key (which the plugin reads)
    so that pytest starts without it; :func:`pytest_report_header` says the tests run untimed."""
    if not pluginmanager.hasplugin("timeout"):
        parser.addini("timeout", "the per-test timeout in seconds, read by pytest-timeout (not installed)")


def pytest_report_header(config: pytest.Config) -> str | None:
    return None if config.pluginmanager.hasplugin("timeout") else NO_TIMEOUT


def _to_host(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether ``Tensor.to(*args, **kwargs)`` moves to the host on purpose: its device is the
    string ``"cpu"`` (a ``torch.device`` taken from another tensor is a move to that tensor's
    device, which is the CPU on a CPU-only machine but no host transfer on CUDA)."""
    target = kwargs.get("device", args[0] if args else None)
    return isinstance(target, str) and torch.device(target).type == "cpu"


class SyncCounter:
    """Counts Tensor calls that read device memory on the host, or would on an accelerator.

    ``item``, ``tolist``, ``cpu``, ``numpy``, the ``bool``/``float``/``int``/``index``
    conversions, and ``.to("cpu")`` (even ``non_blocking=True``: the host must wait before
    reading the copy). On a CPU-only machine these are no syncs at all: the counter tells which
    code would sync on CUDA.
    """

    names = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__")

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.monkeypatch = monkeypatch
        self.count = 0

    def start(self) -> SyncCounter:
        self.count = 0
        for name in self.names:
            original = getattr(torch.Tensor, name)

            def counted(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
                self.count += 1
                return _original(*args, **kwargs)

            self.monkeypatch.setattr(torch.Tensor, name, counted)
        original_to = torch.Tensor.to

        def counted_to(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if _to_host(args, kwargs):
                self.count += 1
            return original_to(tensor, *args, **kwargs)

        self.monkeypatch.setattr(torch.Tensor, "to", counted_to)
        return self

    def stop(self) -> int:
        self.monkeypatch.undo()
        return self.count


@pytest.fixture
def syncs(monkeypatch: pytest.MonkeyPatch) -> SyncCounter:
    """A :class:`SyncCounter`; call ``syncs.start()`` where counting begins."""
    return SyncCounter(monkeypatch)


@pytest.fixture(scope="session")
def native_ops() -> Any:
    """``torch.ops.mixprec_native``, built if need be; skips without it (fails in CI)."""
    ops = _native.load()
    if ops is None:
        kernels_missing("the C++ kernels could not be built here (a warning said why)")
    return ops


@pytest.fixture
def kernel_spy(native_ops: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The C++ kernels behind a counter of the ones called (``_kernel_spy.KernelSpy``)."""
    from _kernel_spy import KernelSpy

    spy = KernelSpy(native_ops)
    monkeypatch.setattr(_native, "load", lambda: spy)
    return spy


@pytest.fixture
def fresh_dynamo() -> Iterator[None]:
    """Dynamo's caches reset and its counters cleared before the test, its caches reset after.
    (``torch._dynamo`` loads on first use: a session that compiles nothing never imports it.)"""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.reset()


@pytest.fixture(autouse=True)
def _seeded(request: pytest.FixtureRequest) -> None:
    """Every test starts torch's and Python's default generators from its own seed (its node id's
    CRC32): torch seeds its generator from the OS at start, so a test that draws without seeding
    would see other inputs on every run, and a test's inputs would depend on the tests before it."""
    seed = zlib.crc32(request.node.nodeid.encode())
    torch.manual_seed(seed)
    random.seed(seed)


@pytest.fixture(autouse=True)
def _keep_torch_threads():
    """Every test leaves torch's intra-op thread count as it found it (the demo and the CLI set it:
    ``--threads``). CPU kernels that split work by thread (stft's FFT) round differently with another
    count, so a later bitwise comparison against a subprocess oracle would depend on the test order."""
    threads = torch.get_num_threads()
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
