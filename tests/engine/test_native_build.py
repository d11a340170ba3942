"""Building mixprec's C++ kernels (mixprec._native): one build per environment, announced;
a killed or running build never hangs another process; forks; failures; ``mixprec
build-kernels``; and optimizer numerics that do not depend on whether the build succeeded.

Only the slow test builds the real extension (about 30 s), in a folder of its own: the others
replace the compile and load steps (``_compile``, ``_load_library``) with fakes in a temporary
``TORCH_EXTENSIONS_DIR``.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch

import mixprec.optim._fused as fused
from mixprec import _native, cli
from mixprec.optim import SGD, AdamW

from _optim_cases import assert_same, train


class FakeBuild:
    """Stands in for the compiler and the library loader: counts builds, can fail or block."""

    def __init__(self, monkeypatch, tmp_path):
        self.builds = 0
        self.error: Exception | None = None
        self.gate: threading.Event | None = None
        self.started = threading.Event()
        monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
        monkeypatch.setenv("MIXPREC_NATIVE_KERNELS", "1")  # (the build is what is tested, whatever the run says)
        monkeypatch.setattr(_native, "_state", {})
        monkeypatch.setattr(_native, "_compile", self.compile)
        monkeypatch.setattr(_native, "_load_library", lambda directory: None)

    def compile(self, directory: Path) -> None:
        self.builds += 1
        self.started.set()
        if self.gate is not None:
            assert self.gate.wait(60)
        if self.error is not None:
            raise self.error
        (directory / f"{directory.name}.so").write_bytes(b"")


@pytest.fixture
def fake(monkeypatch, tmp_path):
    return FakeBuild(monkeypatch, tmp_path)


@pytest.fixture
def said(caplog):
    caplog.set_level(logging.WARNING, logger="mixprec")
    return lambda: [r.getMessage() for r in caplog.records if r.name == "mixprec"]


# -- one build per environment, announced -----------------------------------------------------


def test_each_environment_has_its_own_build(fake, monkeypatch):
    """Two venvs with the same torch (the build writes their paths into build.ninja) or two
    checkouts get two folders: neither rebuilds the other's. The same environment reuses its."""
    here = _native.build_directory()
    assert here == _native.build_directory()
    monkeypatch.setattr(sys, "prefix", "/elsewhere/venv")
    assert _native.build_directory() != here
    monkeypatch.undo()
    env = _native.environment()
    for key, other in [("package", "/other/checkout/src/mixprec"), ("compiler", "/usr/bin/clang++ 1 2"),
                       ("torch", "9.9.9"), ("sources", "0" * 40)]:
        assert _native.build_directory({**env, key: other}) != here, key


def test_a_build_says_why_and_how_long_and_is_reused(fake, said, monkeypatch):
    assert _native.build().seconds is not None
    assert fake.builds == 1
    building, built = said()
    assert "building its C++ kernels (no build for this environment yet)" in building
    assert "built its C++ kernels in" in built
    again = _native.build()
    assert again.seconds is None and fake.builds == 1  # loaded, not rebuilt, nothing said
    assert len(said()) == 2
    monkeypatch.setenv("CXX", sys.executable)  # another compiler: another build, and why
    _native.build()
    assert fake.builds == 2
    assert "no build for this environment yet: its compiler differs from mixprec_native_" in said()[2]


def test_an_unfinished_build_is_redone_and_says_so(fake, said):
    directory = _native.build_directory()
    directory.mkdir(parents=True)
    (directory / "build.ninja").write_text("")  # a build killed half-way: no built.json
    _native.build()
    assert fake.builds == 1
    assert "the last build here did not finish" in said()[0]


# -- locks: a killed build, a running one, a fork -----------------------------------------------


def _hold_lock(path: Path) -> subprocess.Popen:
    """Another process holding the build lock (as a running build does) until killed."""
    code = ("import fcntl, os, sys, time\n"
            f"fd = os.open({str(path)!r}, os.O_RDWR | os.O_CREAT)\n"
            "fcntl.flock(fd, fcntl.LOCK_EX)\n"
            "os.write(fd, f'{os.getpid()} {time.time():.0f}'.encode())\n"
            "print('held', flush=True)\n"
            "time.sleep(120)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


@pytest.mark.slow
@pytest.mark.skipif(sys.platform == "win32", reason="fcntl")
def test_a_killed_build_leaves_nothing_that_blocks(fake, said):
    """A build killed while holding the lock (and torch's own lock file it left behind, on
    which torch's FileBaton waits forever): the next process builds at once."""
    directory = _native.build_directory()
    directory.mkdir(parents=True)
    holder = _hold_lock(directory / "build.lock")
    holder.kill()
    holder.wait(10)
    (directory / "lock").write_text("")
    _native.build()
    assert fake.builds == 1
    assert not (directory / "lock").exists()
    assert any("removed" in line and "interrupted build" in line for line in said())


@pytest.mark.slow
@pytest.mark.skipif(sys.platform == "win32", reason="fcntl")
def test_a_running_build_is_waited_for_a_bounded_time(fake, said, monkeypatch):
    directory = _native.build_directory()
    directory.mkdir(parents=True)
    holder = _hold_lock(directory / "build.lock")
    try:
        monkeypatch.setenv("MIXPREC_BUILD_WAIT", "0.5")
        with pytest.raises(_native.BuildError) as info:
            _native.build()
        message = str(info.value)
        assert f"process {holder.pid}" in message and f"remove {directory / 'build.lock'}" in message
        assert any(f"waiting for process {holder.pid}" in line for line in said())
        assert fake.builds == 0
        with pytest.warns(UserWarning, match="could not build its C.. kernels: process"):
            assert _native.load() is None  # the rest keeps working, on the Python kernels
    finally:
        holder.kill()
        holder.wait(10)
    monkeypatch.setenv("MIXPREC_BUILD_WAIT", "soon")
    with pytest.raises(_native.BuildError, match="MIXPREC_BUILD_WAIT must be a number of seconds, finite and > 0, got 'soon'"):
        _native.build()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_child_forked_during_a_build_waits_for_it_instead_of_hanging(fake):
    """A DataLoader-style fork while another thread builds: the child inherits the thread lock
    held; it must get a fresh one and wait for the build (the file lock), then load it."""
    fake.gate = threading.Event()
    builder = threading.Thread(target=_native.load)
    builder.start()
    assert fake.started.wait(30)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork in a threaded process
        pid = os.fork()
    if pid == 0:  # the child: load, or be stopped by the alarm
        signal.alarm(30)
        code = 0 if _native.load() is not None else 3
        os._exit(code)
    fake.gate.set()
    builder.join(30)
    deadline = time.monotonic() + 40
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.1)
    else:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("the forked child hung in mixprec._native.load()")
    assert os.waitstatus_to_exitcode(status) == 0
    assert fake.builds == 1  # the child loaded the parent's build


# -- failures ------------------------------------------------------------------------------------


NINJA_OUTPUT = (
    "Error building extension 'mixprec_native_x': [1/3] c++ -MMD -MF optim_kernel.o.d -O3 -c optim_kernel.cpp\n"
    "FAILED: optim_kernel.o\n"
    "c++ -MMD -MF optim_kernel.o.d -O3 -c optim_kernel.cpp -o optim_kernel.o\n"
    "optim_kernel.cpp:12:10: fatal error: ATen/Parallel.h: No such file or directory\n"
    "compilation terminated.\n"
    "ninja: build stopped: subcommand failed.\n"
)


def test_a_failed_build_shows_the_compilers_error_and_is_remembered(fake, said, monkeypatch):
    fake.error = RuntimeError(NINJA_OUTPUT)
    with pytest.warns(UserWarning) as caught:
        assert _native.load() is None
    message = str(caught[0].message)
    assert "fatal error: ATen/Parallel.h: No such file or directory" in message
    assert "full log:" in message and "FAILED" not in message
    directory = _native.build_directory()
    assert "fatal error" in (directory / "build.log").read_text()
    monkeypatch.setattr(_native, "_state", {})  # the next process: no retry, the same cause
    with pytest.warns(UserWarning, match="ATen/Parallel.h.*remembered from the attempt of"):
        assert _native.load() is None
    assert fake.builds == 1
    fake.error = None  # mixprec build-kernels retries
    assert _native.build(retry=True).seconds is not None
    assert fake.builds == 2 and not (directory / "failed.json").exists()


def test_no_compiler_says_so_and_retries_once_there_is_one(fake, monkeypatch):
    monkeypatch.setenv("CXX", "no-such-c++")
    said = r"no-such-c\+\+ not found \(the C\+\+ compiler: CXX, default c\+\+ on PATH\): install g\+\+"
    with pytest.warns(UserWarning, match=said):
        assert _native.load() is None
    assert fake.builds == 0
    assert json.loads((_native.build_directory() / "failed.json").read_text())["compiler"] == "no-such-c++: not found"
    monkeypatch.setenv("CXX", sys.executable)  # a compiler appeared: another environment, built
    monkeypatch.setattr(_native, "_state", {})
    assert _native.load() is not None
    assert fake.builds == 1


def test_an_unwritable_cache_says_what_to_set(fake, monkeypatch, tmp_path):
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "file" / "cache"))
    with pytest.raises(_native.BuildError, match="set TORCH_EXTENSIONS_DIR to a writable folder"):
        _native.build()
    with pytest.warns(UserWarning, match="cannot create the build folder"):
        assert _native.load() is None


def test_disabled_kernels_are_not_built(fake, monkeypatch):
    monkeypatch.setenv("MIXPREC_NATIVE_KERNELS", "0")
    assert _native.load() is None
    assert fake.builds == 0


# -- mixprec build-kernels ------------------------------------------------------------------------


def test_build_kernels_command(fake, capsys, monkeypatch):
    assert cli.main(["build-kernels"]) == 0
    out = capsys.readouterr().out
    assert "mixprec: building its C++ kernels (no build for this environment yet)" in out
    assert "mixprec build-kernels: built in" in out
    assert cli.main(["build-kernels"]) == 0
    assert "already built" in capsys.readouterr().out
    assert fake.builds == 1


def test_build_kernels_reports_a_failure(fake, capsys, monkeypatch):
    monkeypatch.setenv("CXX", "no-such-c++")
    assert cli.main(["build-kernels"]) == 1
    err = capsys.readouterr().err
    assert "no-such-c++ not found" in err and "Python kernels" in err
    monkeypatch.setenv("MIXPREC_NATIVE_KERNELS", "0")
    assert cli.main(["build-kernels"]) == 0
    assert "MIXPREC_NATIVE_KERNELS=0" in capsys.readouterr().out


# -- the optimizers' numerics do not depend on the build -------------------------------------------


@pytest.fixture(scope="module")
def ops():
    if fused.native_ops() is None:
        pytest.skip("the C++ optimizer kernel does not serve here (no compiler, another CPU, or MIXPREC_NATIVE_KERNELS=0)")
    return fused.native_ops()


SHAPES = [(64, 64), (37, 5), (9,)]  # whole vectors, and scalar tails of 1 and 9 elements


@pytest.mark.parametrize("cls,kwargs", [
    (AdamW, dict(compensation="exact", lr=1e-2, weight_decay=0.1)),
    (AdamW, dict(compensation="exact", amsgrad=True, maximize=True)),
    (AdamW, dict(compensation="stochastic", state_dtype="8bit")),
    (SGD, dict(compensation="exact", lr=1e-2, momentum=0.9, nesterov=True, weight_decay=1e-2)),
    (SGD, dict(compensation="kahan", lr=1e-2, momentum=0.9, dampening=0.1)),
])
@pytest.mark.parametrize("flags", [dict(), dict(fused=True)])
def test_without_the_kernel_the_same_bits(ops, monkeypatch, cls, kwargs, flags):
    """The issue's case: 20 default steps (fused=None, foreach=None) on a machine with the
    kernel and on one without (native_ops() None): every bit equal, scalar tails included."""
    def run():
        g = torch.Generator().manual_seed(0)
        params = [torch.randn(s, generator=g).bfloat16().requires_grad_() for s in SHAPES]
        return params, train(cls, params, steps=20, **flags, **kwargs)

    a, opt_a = run()
    monkeypatch.setattr(fused, "native_ops", lambda: None)
    b, opt_b = run()
    assert_same(a, opt_a, b, opt_b)


@pytest.mark.slow
def test_the_real_build_once_then_a_silent_fast_load(tmp_path):
    """The only real build here (about 30 s on 2 cores), in a fresh TORCH_EXTENSIONS_DIR: the
    first process says it builds and how long it took, the next only loads it."""
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path), "MIXPREC_NATIVE_KERNELS": "1"}
    code = ("import time; t = time.perf_counter(); from mixprec import _native\n"
            "assert _native.load() is not None; print(f'{time.perf_counter() - t:.2f}')\n")
    first = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr
    assert "building its C++ kernels (no build for this environment yet)" in first.stderr
    assert "built its C++ kernels in" in first.stderr
    second = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stderr
    assert "building" not in second.stderr
    print(f"first load (build): {first.stdout.strip()} s, second: {second.stdout.strip()} s")


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "0", "-5", "soon"])
def test_the_build_wait_must_be_finite_and_positive(fake, monkeypatch, value):
    """``MIXPREC_BUILD_WAIT=nan`` waited without bound (a NaN limit is never exceeded), ``inf``
    and ``0`` or less were taken as they came: refused, naming the variable and what to set."""
    monkeypatch.setenv("MIXPREC_BUILD_WAIT", value)
    with pytest.raises(_native.BuildError, match=rf"MIXPREC_BUILD_WAIT must be a number of seconds, finite and "
                                                 rf"> 0, got '{re.escape(value)}': set it to how long"):
        _native.build()
    assert fake.builds == 0


def test_the_native_kernels_switch_takes_only_on_or_off(monkeypatch):
    """``MIXPREC_NATIVE_KERNELS=of`` (a typo) silently meant on: refused, naming what to set."""
    for text, on in (("0", False), ("off", False), ("No", False), ("1", True), (" true ", True), ("", True)):
        monkeypatch.setenv("MIXPREC_NATIVE_KERNELS", text)
        assert _native.enabled() is on, text
    monkeypatch.setenv("MIXPREC_NATIVE_KERNELS", "of")
    with pytest.raises(ValueError, match="MIXPREC_NATIVE_KERNELS must be 1 .* or 0 .*, got 'of': set it to 1 or 0"):
        _native.enabled()


@pytest.mark.skipif(not hasattr(os, "symlink") or sys.platform == "win32", reason="POSIX links")
def test_a_planted_link_is_never_followed(fake, tmp_path):
    """A link planted at the build lock in a shared TORCH_EXTENSIONS_DIR: refused, its target
    unchanged (before: opened with O_CREAT, truncated and overwritten with the pid). A link at a
    build record is replaced, never written through."""
    victim = tmp_path / "victim.txt"  # (tmp_path: the TORCH_EXTENSIONS_DIR)
    victim.write_text("precious\n")
    directory = _native.build_directory()
    directory.mkdir(parents=True)
    (directory / "build.lock").symlink_to(victim)
    with pytest.raises(_native.BuildError, match=r"build.lock is a symbolic link .*remove it, or set TORCH_EXTENSIONS_DIR"):
        _native.build()
    assert victim.read_text() == "precious\n" and fake.builds == 0
    (directory / "build.lock").unlink()
    (directory / "built.json").symlink_to(victim)
    _native.build()
    assert victim.read_text() == "precious\n" and fake.builds == 1
    assert not (directory / "built.json").is_symlink() and json.loads((directory / "built.json").read_text())
    lock = (directory / "build.lock").read_text()
    assert len(lock) == 64 and lock.split()[0] == str(os.getpid())


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX links")
def test_a_linked_build_folder_is_refused(fake, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    _native.build_directory().symlink_to(elsewhere)
    with pytest.raises(_native.BuildError, match="is a symbolic link .*set TORCH_EXTENSIONS_DIR"):
        _native.build()
    assert list(elsewhere.iterdir()) == [] and fake.builds == 0
