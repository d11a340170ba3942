"""mixprec's C++ kernels (``csrc/*.cpp``), built once per environment.

Four sets of kernels share one extension: the boxed autocast kernel for ops a policy edits
(``autocast_kernel.cpp``), the fused optimizer steps for low-precision parameters
(``optim_kernel.cpp``, used by :mod:`mixprec.optim._fused`), the fp4 casts
(``fp4_kernel.cpp``, used by :mod:`mixprec.formats._fp4`) and the cast statistics of an fp8 or
fp4 layer's window (``stats_kernel.cpp``, used by :mod:`mixprec.formats._state`).

A Python kernel at the autocast key costs about 6 us per call on top of the op (the dispatcher
boxes the arguments for Python and back); on an 8x8 softmax that is 3.5x the op. The boxed C++
kernel runs the same cast kinds (``lower``, ``fp32``, ``promote``, ``fp32_set_opt_dtype``,
``passthrough``) through PyTorch's own ``cached_cast``, at about 1.2x.

Building (:func:`build`, ``mixprec build-kernels`` ahead of time; else at first use: the first
op a policy edits, an optimizer constructed with a low-precision CPU parameter, the first fp4
cast or recorded fp8/fp4 cast statistics on a CPU) takes about
30 s on 2 idle cores with ``torch.utils.cpp_extension`` (a C++ compiler and ninja,
``mixprec[native]``), minutes on loaded ones, and says so on stderr: why it runs, what to expect
(the latest build here and the load it had, else a range from the load now), then how long it took. Each
environment has its own build folder, ``<root>/mixprec_native_<key>`` (root:
``TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``), the key hashing what the build
depends on (:func:`environment`: sources, flags, torch, ``sys.prefix``, mixprec's folder,
compiler, ninja), so two virtual environments never rebuild each other's, and a later process
only loads the library. Processes take turns on a file lock (``fcntl.flock``), which the system
releases when its holder dies: a killed build blocks nothing. The lock and the build's records
are never reached through a symbolic link (in a shared ``TORCH_EXTENSIONS_DIR`` a planted link
is refused or replaced, its target never written). A process waits at most
``MIXPREC_BUILD_WAIT`` seconds (default 900; a finite number > 0, else a ``BuildError`` says what
to set) for another's build, then goes on without the kernels and names the holder and the file
to remove. A child forked during a build (a
DataLoader worker) waits for it like any other process. A failed build warns with its cause
(the compiler's first error line, or which tool is missing) and the log's path, and is
remembered for the environment: later processes do not retry until the sources or the compiler
change, or ``mixprec build-kernels`` retries. Without the kernels, or with
``MIXPREC_NATIVE_KERNELS=0``, every edited op keeps its Python kernel, the optimizers run
torch's fused kernels on float32 copies and the fp4 casts and cast statistics their torch code: the
same results.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import re
import shutil
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch

from mixprec.ops import default_table

try:
    import fcntl
except ImportError:  # Windows: msvcrt's byte-range lock, also released when its holder dies
    fcntl = None  # type: ignore[assignment]
    import msvcrt

__all__ = ["load", "build", "Built", "BuildError", "environment", "build_directory", "KINDS"]

#: cast kinds the C++ kernel runs, and their codes (the enum in autocast_kernel.cpp); ``banned``
#: (PyTorch's messages) and ``fp32_append_dtype`` stay with the Python kernel; ``fp8`` (code 5,
#: ROUTE) calls the ``mixprec::route_*`` op :mod:`mixprec.engine.kernels` defines for the overload
KINDS: dict[str, int] = {"passthrough": 0, "lower": 1, "fp32": 2, "promote": 3, "fp32_set_opt_dtype": 4,
                         "fp8": 5}

_SOURCES = [Path(__file__).parent / "csrc" / name for name in ("autocast_kernel.cpp", "optim_kernel.cpp",
                                                                   "fp4_kernel.cpp", "stats_kernel.cpp", "fp8_kernel.cpp")]
_HEADERS = [Path(__file__).parent / "csrc" / "float_types.h"]  # (included by the sources: hashed with them)
#: Instruction sets the extension is compiled for, by torch's CPU capability: the vector units
#: torch's own kernels use on this machine (so the build never uses one the CPU lacks).
_ARCH_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c"],
}
_WAIT = 900.0  # default MIXPREC_BUILD_WAIT: seconds to wait for another process's build
_lock = threading.Lock()
_state: dict[str, Any] = {}
_held: set[int] = set()  # descriptors of the build locks this process holds
_log = logging.getLogger("mixprec")


class BuildError(RuntimeError):
    """The C++ kernels could not be built or loaded; the message says why and what to do."""


@dataclass(frozen=True)
class Built:
    """The extension, loaded: its build ``directory``, and ``seconds`` the build took (``None``
    if an earlier build was loaded)."""

    directory: Path
    seconds: Optional[float]


_OFF, _ON = ("0", "false", "no", "off"), ("1", "true", "yes", "on", "")


def enabled() -> bool:
    """Whether native kernels may be used (``MIXPREC_NATIVE_KERNELS=0`` turns them off).

    Raises:
        ValueError: the variable holds something other than ``1/true/yes/on`` or
            ``0/false/no/off``.
    """
    text = os.environ.get("MIXPREC_NATIVE_KERNELS", "1").strip().lower()
    if text not in _OFF + _ON:
        raise ValueError(f"MIXPREC_NATIVE_KERNELS must be 1 (use the C++ kernels, the default) or 0 (Python "
                         f"kernels only), got {os.environ['MIXPREC_NATIVE_KERNELS']!r}: set it to 1 or 0, or unset it")
    return text not in _OFF


def load() -> Any:
    """``torch.ops.mixprec_native``, building the extension if this environment has none;
    ``None`` if disabled or if it cannot be built (one warning says why; the Python kernels
    then serve). Raises only ``ValueError`` for a ``MIXPREC_NATIVE_KERNELS`` that is neither on
    nor off (:func:`enabled`)."""
    if "ops" in _state:
        return _state["ops"]
    with _lock:
        if "ops" in _state:
            return _state["ops"]
        ops = None
        if enabled():
            try:
                build(retry=False)
                ops = torch.ops.mixprec_native
            except Exception as e:  # BuildError, or an unwritable cache folder: the rest still works
                cause = e if isinstance(e, BuildError) else f"{type(e).__name__}: {e}"
                warnings.warn(
                    f"mixprec could not build its C++ kernels: {cause}. Ops a policy edits use Python "
                    "kernels (same results, about 6 us more per call), the optimizers torch's fused "
                    "kernels on float32 copies (same results, slower). `mixprec build-kernels` "
                    "retries; MIXPREC_NATIVE_KERNELS=0 skips the attempt.", stacklevel=3)
        _state["ops"] = ops
        return ops


def build(retry: bool = True, say: Optional[Callable[[str], None]] = None) -> Built:
    """Load this environment's build of the extension, building it first if there is none.

    ``retry=False`` gives up on a failure remembered from an earlier attempt (what :func:`load`
    does); ``True`` (``mixprec build-kernels``) tries again. ``say`` gets the progress lines
    (a build starts, and why; it took so long; waiting for another process's build); default:
    warnings of the ``mixprec`` logger (shown on stderr when logging is not configured).

    Raises:
        BuildError: no compiler or ninja, a compile error (its first line; the full log's path),
            another process's build still running after ``MIXPREC_BUILD_WAIT`` seconds, an
            unwritable build folder.

    Example:
        >>> from mixprec import _native
        >>> _native.build().directory.name.startswith("mixprec_native_")  # doctest: +SKIP
        True
    """
    say = say or _log.warning
    env = environment()
    directory = build_directory(env)
    if not _finished(directory):
        if directory.is_symlink():
            raise BuildError(f"the build folder {directory} is a symbolic link (to {os.readlink(directory)}): "
                             "remove it, or set TORCH_EXTENSIONS_DIR to a folder only you can write")
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise BuildError(f"cannot create the build folder {directory} ({e.strerror or e}); set "
                             "TORCH_EXTENSIONS_DIR to a writable folder") from None
        with _build_lock(directory, say):
            if not _finished(directory):  # else built by the process this one waited for
                failed = directory / "failed.json"
                if failed.exists() and not retry:
                    raise BuildError(_remembered(failed))
                failed.unlink(missing_ok=True)
                return _build(env, directory, say)
    _load_library(directory)
    return Built(directory, None)


def environment() -> dict[str, str]:
    """What a build depends on (hashed into :func:`build_directory`): the sources, compile
    flags, torch, the Python environment (``sys.prefix`` and version) and mixprec's folder (both
    in the build's ninja file), the compiler (``CXX`` or ``c++``: its path and file) and ninja."""
    sources = hashlib.sha1(b"".join(path.read_bytes() for path in _SOURCES + _HEADERS)).hexdigest()
    compiler = os.environ.get("CXX", "cl" if sys.platform == "win32" else "c++")
    return {
        "sources": sources,
        "flags": " ".join(_flags()),
        "torch": torch.__version__,
        "python": f"{sys.prefix} ({sys.implementation.cache_tag})",
        "package": str(Path(__file__).parent),
        "compiler": _tool(compiler),
        "ninja": _tool("ninja"),
    }


def build_directory(env: Optional[dict[str, str]] = None) -> Path:
    """This environment's build folder (``env``: :func:`environment`'s, computed if ``None``)."""
    env = environment() if env is None else env
    digest = hashlib.sha1(json.dumps(env, sort_keys=True).encode()).hexdigest()[:12]
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if not root:
        from torch.utils.cpp_extension import get_default_build_root

        root = get_default_build_root()
    return Path(root) / f"mixprec_native_{digest}"


def _flags() -> list[str]:
    # -ffp-contract=off: no multiply-add is fused unless the source says so (optim_kernel.cpp
    # reproduces torch's rounding step by step); -fno-math-errno: sqrt vectorizes
    return ["-O3", "-ffp-contract=off", "-fno-math-errno", *_ARCH_FLAGS.get(cpu_capability(), [])]


def _tool(name: str) -> str:
    """``name``'s resolved path, size and modification time, or ``"<name>: not found"``."""
    path = shutil.which(name)
    if path is None:
        return f"{name}: not found"
    real = os.path.realpath(path)
    stat = os.stat(real)
    return f"{real} {stat.st_size} {stat.st_mtime_ns}"


def _finished(directory: Path) -> bool:
    return (directory / "built.json").exists() and (directory / f"{directory.name}.so").exists()


def _load_library(directory: Path) -> None:
    path = directory / f"{directory.name}.so"
    try:
        torch.ops.load_library(str(path))
    except OSError as e:
        raise BuildError(f"cannot load {path} ({e}); remove {directory} to rebuild it") from None


def _build(env: dict[str, str], directory: Path, say: Callable[[str], None]) -> Built:
    """Compile into ``directory`` (this process holds its lock), announcing it; remember a failure."""
    try:
        _check_tools(env)
        load = _load_now()
        say(f"mixprec: building its C++ kernels ({_reason(env, directory)}) in {directory}: "
            f"{_expected(directory.parent, load, os.cpu_count() or 1)}; once per environment")
        stale = directory / "lock"  # torch's own lock: left behind only by a killed build
        if stale.exists():
            stale.unlink()
            say(f"mixprec: removed {stale}, left by an interrupted build")
        start = time.monotonic()
        _compile(directory)
        seconds = time.monotonic() - start
    except Exception as e:  # a compile error, or one of the tools missing
        cause = e if isinstance(e, BuildError) else BuildError(_failure(e, directory))
        _write_file(directory / "failed.json", json.dumps({"cause": str(cause), "time": time.time(), **env}))
        raise cause from None
    _load_library(directory)
    _write_file(directory / "built.json", json.dumps({"seconds": round(seconds, 1), "time": time.time(),
                                                      "load": load, "cores": os.cpu_count(), **env}))
    say(f"mixprec: built its C++ kernels in {seconds:.1f} s")
    return Built(directory, seconds)


#: the build's time on 2 idle cores (an AVX-512 Xeon, load under 1): the floor of the estimate
IDLE_BUILD_S = 30.0


def _load_now() -> float | None:
    """The 1-minute load average, or ``None`` where the system has none (Windows)."""
    try:
        return round(os.getloadavg()[0], 1)
    except (AttributeError, OSError):
        return None


def _expected(root: Path, load: float | None, cores: int) -> str:
    """How long the build should take, for its first line: from the latest finished build under
    ``root`` when there is one (its time and the load then), else a range from
    :data:`IDLE_BUILD_S` on idle cores, stretched by the share of the cores that other work holds
    now (``load / cores``, each of them shared by ``1 + load / cores`` jobs): a guess from this
    machine, not a promise; always with the load now."""
    now = "load now unknown" if load is None else f"load now {load:g} on {cores} core(s)"
    records = []
    for marker in root.glob("mixprec_native_*/built.json"):
        try:
            record = json.loads(marker.read_text())
            records.append((float(record["time"]), float(record["seconds"]), record.get("load")))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    if records:
        _, seconds, then = max(records)
        at = "" if then is None else f" at load {then:g}"
        return f"the last build here took {seconds:.0f} s{at}; {now}"
    low = IDLE_BUILD_S * max(1.0, 2 / cores)
    high = low * (1 + (load or 0.0) / cores)
    if high < 1.5 * low:
        return f"about {low:.0f} s ({now})"
    return f"{low:.0f} to {high:.0f} s or more ({now})"


def _check_tools(env: dict[str, str]) -> None:
    if env["compiler"].endswith(": not found"):
        name = env["compiler"].split(":")[0]
        raise BuildError(f"{name} not found (the C++ compiler: CXX, default c++ on PATH): install g++ or "
                         "clang++, or set CXX")
    if env["ninja"].endswith(": not found"):
        raise BuildError("ninja not found on PATH: pip install ninja (from a checkout: pip install -e '.[native]')")


def _compile(directory: Path) -> None:
    """Build the extension into ``directory`` with ``torch.utils.cpp_extension`` (and load it)."""
    from torch.utils import cpp_extension

    # one translation unit per source: ninja compiles them in parallel
    cpp_extension.load(directory.name, sources=[str(path) for path in _SOURCES], extra_cflags=_flags(),
                       build_directory=str(directory), is_python_module=False, verbose=False)


_ERROR_LINE = re.compile(r"error\b|not found|cannot find|no such file", re.IGNORECASE)
_NINJA_LINES = ("Error building extension", "FAILED:", "ninja: build stopped", "[")


def _failure(error: Exception, directory: Path) -> str:
    """The cause of a failed build in one line (the compiler's first error), and where the full
    output is (``build.log``)."""
    text = str(error)
    log = directory / "build.log"
    _write_file(log, f"{type(error).__name__}: {text}\n")
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if _ERROR_LINE.search(line) and not line.startswith(_NINJA_LINES)]
    first = (errors or lines or [type(error).__name__])[0]
    return f"{first[:300]} (full log: {log})"


def _remembered(failed: Path) -> str:
    record = json.loads(failed.read_text())
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(record["time"]))
    return (f"{record['cause']}; remembered from the attempt of {when}, not retried until the sources or the "
            "compiler change")


def _reason(env: dict[str, str], directory: Path) -> str:
    """Why this build runs: an unfinished one here, or what differs from the latest other build."""
    if any(directory.glob("*.o")) or (directory / "build.ninja").exists():
        return "the last build here did not finish"
    others = sorted(directory.parent.glob("mixprec_native_*/built.json"), key=lambda p: p.stat().st_mtime)
    for marker in reversed(others):
        try:
            earlier = json.loads(marker.read_text())
        except (OSError, ValueError):
            continue
        changed = [key for key in env if earlier.get(key) != env[key]]
        if changed:
            verb = "differs" if len(changed) == 1 else "differ"
            return f"no build for this environment yet: its {', '.join(changed)} {verb} from {marker.parent.name}'s"
    return "no build for this environment yet"


def _wait_limit() -> float:
    """``MIXPREC_BUILD_WAIT`` in seconds (default 900): a finite number > 0."""
    text = os.environ.get("MIXPREC_BUILD_WAIT", "")
    if not text.strip():
        return _WAIT
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        raise BuildError(f"MIXPREC_BUILD_WAIT must be a number of seconds, finite and > 0, got {text!r}: set it "
                         f"to how long to wait for another process's build (e.g. {_WAIT:.0f}), or unset it")
    return seconds


def _try_lock(fd: int) -> bool:
    try:
        if fcntl is not None:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        else:
            msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
        return True
    except OSError:  # held by another process
        return False


def _unlock(fd: int) -> None:
    if fcntl is not None:
        fcntl.flock(fd, fcntl.LOCK_UN)
    else:
        os.lseek(fd, 0, os.SEEK_SET)
        msvcrt.locking(fd, msvcrt.LK_UNLCK, 1)


@contextlib.contextmanager
def _build_lock(directory: Path, say: Callable[[str], None]) -> Iterator[None]:
    """Hold ``directory/build.lock`` (recording this process's id and the time), waiting at most
    ``MIXPREC_BUILD_WAIT`` seconds for the process that holds it."""
    path = directory / "build.lock"
    limit = _wait_limit()
    fd = _open_lock(path)
    try:
        start, said = time.monotonic(), False
        while not _try_lock(fd):
            if time.monotonic() - start > limit:
                raise BuildError(f"{_owner(path)} has held {path} for more than {limit:.0f} s "
                                 f"(MIXPREC_BUILD_WAIT); if no build is running, remove {path}")
            if not said:
                say(f"mixprec: waiting for {_owner(path)}, which is building the C++ kernels in {directory}")
                said = True
            time.sleep(0.2)
        _held.add(fd)
        try:
            # the record is overwritten in place and padded to a fixed width: never truncated
            os.lseek(fd, 0, os.SEEK_SET)
            os.write(fd, f"{os.getpid()} {time.time():.0f}".ljust(_RECORD).encode())
            yield
        finally:
            _held.discard(fd)
            _unlock(fd)
    finally:
        os.close(fd)


def _write_file(path: Path, text: str) -> None:
    """Write ``path`` as a new file moved into place: a link planted at ``path`` is replaced,
    never followed."""
    part = path.with_name(f"{path.name}.{os.getpid()}.part")
    part.unlink(missing_ok=True)
    fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(part, path)


_RECORD = 64  # bytes of the lock file's record: "<pid> <start time>", padded with spaces


def _open_lock(path: Path) -> int:
    """Open (or create) the build lock without following a link: in a shared
    ``TORCH_EXTENSIONS_DIR`` a link planted there would make this process write its target."""
    if path.is_symlink():
        raise BuildError(f"{path} is a symbolic link (to {os.readlink(path)}), not mixprec's build lock: remove "
                         f"it, or set TORCH_EXTENSIONS_DIR to a folder only you can write")
    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as e:
        raise BuildError(f"cannot open the build lock {path} ({e.strerror or e}): if it is a link or not a "
                         "file, remove it; or set TORCH_EXTENSIONS_DIR to a folder only you can write") from None
    if not _is_regular(fd):
        os.close(fd)
        raise BuildError(f"{path} is not a regular file: remove it, or set TORCH_EXTENSIONS_DIR to a folder "
                         "only you can write")
    return fd


def _is_regular(fd: int) -> bool:
    import stat

    return stat.S_ISREG(os.fstat(fd).st_mode)


def _owner(path: Path) -> str:
    """Who holds the build lock, from what it wrote: ``process 123 (started 12 s ago)``."""
    try:
        pid, started = path.read_text().split()
        age = f"started {time.time() - float(started):.0f} s ago"
        return f"process {pid} ({age}{'' if _alive(int(pid)) else ', gone: a process it forked holds the lock'})"
    except (OSError, ValueError):
        return "another process"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists, owned by someone else
        return True
    return True


def _after_fork_in_child() -> None:
    """A forked child must not inherit a held lock: a new thread lock (the parent's may be held
    by a thread that is not in the child) and no pin on the parent's build lock."""
    global _lock
    _lock = threading.Lock()
    for fd in list(_held):
        os.close(fd)
    _held.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def cpu_capability() -> str:
    """torch's CPU kernel level on this machine (``"AVX512"``, ``"AVX2"``, ``"DEFAULT"``, ...)."""
    try:
        return torch.backends.cpu.get_cpu_capability()
    except AttributeError:  # torch < 2.3
        return "DEFAULT"


def runs(kind: str) -> bool:
    """Whether the C++ kernel runs cast kind ``kind``."""
    return kind in KINDS


_DEVICES = ("cpu", "cuda")  # index = the device argument of the C++ functions
# Registries, process-wide like the extension itself: the edits keys (mixprec.engine.runtime.edits_key)
# whose table the C++ kernel has, and the extension once its default tables are defined.
_defined: set[int] = set()
_tables: dict[str, Any] = {}


def define_defaults(ops: Any) -> None:
    """Tables 0 and 1: PyTorch's kinds on CPU and CUDA, for ops no active table lists; from now
    on :func:`tables` returns ``ops``."""
    for i, dev in enumerate(_DEVICES):
        table = {n: k for n, k in default_table(dev).items() if runs(k)}
        ops.define_table(i, list(table), [KINDS[k] for k in table.values()])
    _tables["ops"] = ops


def tables() -> Any:
    """The extension whose autocast tables are defined (:func:`define_defaults`), or None."""
    return _tables.get("ops")


def set_active(ops: Any, device_type: str, key: int | None, edits: Any, last: dict[str, int]) -> None:
    """Make ``edits`` (named by ``key``, their ``edits_key``; ``None``: no edits) the active
    table of this thread for ``device_type``; ``last``: this thread's tables as last set (the
    engine's per-thread runtime holds it), so an unchanged table is not set again."""
    table_id = -1
    if key is not None:
        table_id = key + len(_DEVICES)  # after the default tables
        if key not in _defined:
            with _lock:
                native = {n: k for n, k in edits.items() if runs(k)}
                ops.define_table(table_id, list(native), [KINDS[k] for k in native.values()])
                _defined.add(key)
    if last.get(device_type, -1) != table_id:
        ops.set_active(_DEVICES.index(device_type), table_id)
        last[device_type] = table_id
