"""mixprec's C++ kernels (``csrc/*.cpp``), built on first use.

Two kernels share one extension: the boxed autocast kernel for ops a policy edits
(``autocast_kernel.cpp``) and the fused optimizer steps for low-precision parameters
(``optim_kernel.cpp``, used by :mod:`mixprec.optim._fused`).

A Python kernel at the autocast key costs about 6 us per call on top of the op (the dispatcher
boxes the arguments for Python and back); on an 8x8 softmax that is 3.5x the op. The boxed C++
kernel runs the same cast kinds (``lower``, ``fp32``, ``promote``, ``fp32_set_opt_dtype``,
``passthrough``) through PyTorch's own ``cached_cast``, at about 1.2x. It is compiled
once per machine and torch version with ``torch.utils.cpp_extension`` (about 30 s on 2 cores,
cached under ``~/.cache/torch_extensions``; it needs a C++ compiler and ninja, ``mixprec[native]``).
Without them, or with
``MIXPREC_NATIVE_KERNELS=0``, every edited op keeps its Python kernel (same results).
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import warnings
from pathlib import Path
from typing import Any

import torch

__all__ = ["load", "KINDS"]

#: cast kinds the C++ kernel runs, and their codes (the enum in autocast_kernel.cpp); ``banned``
#: (PyTorch's messages), ``fp32_append_dtype`` and ``fp8`` stay with the Python kernel
KINDS: dict[str, int] = {"passthrough": 0, "lower": 1, "fp32": 2, "promote": 3, "fp32_set_opt_dtype": 4}

_SOURCES = [Path(__file__).parent / "csrc" / name for name in ("autocast_kernel.cpp", "optim_kernel.cpp")]
#: Instruction sets the extension is compiled for, by torch's CPU capability: the vector units
#: torch's own kernels use on this machine (so the build never uses one the CPU lacks).
_ARCH_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c"],
}
_lock = threading.Lock()
_state: dict[str, Any] = {}
_log = logging.getLogger("mixprec")


def enabled() -> bool:
    """Whether native kernels may be used (``MIXPREC_NATIVE_KERNELS=0`` turns them off)."""
    return os.environ.get("MIXPREC_NATIVE_KERNELS", "1").strip().lower() not in ("0", "false", "no", "off")


def load() -> Any:
    """``torch.ops.mixprec_native``, building the extension the first time; ``None`` if disabled
    or if it cannot be built (one warning says why; the Python kernels then serve)."""
    if "ops" in _state:
        return _state["ops"]
    with _lock:
        if "ops" in _state:
            return _state["ops"]
        ops = None
        if enabled():
            try:
                ops = _build()
            except Exception as e:  # no compiler, no headers, an ABI problem: fall back
                warnings.warn(
                    f"mixprec could not build its C++ kernels ({type(e).__name__}: "
                    f"{str(e).splitlines()[0] if str(e) else ''}); ops a policy edits use Python "
                    "kernels (same results, about 6 us more per call), fused optimizer steps their "
                    "PyTorch version (same results, slower). Set "
                    "MIXPREC_NATIVE_KERNELS=0 to skip the attempt.", stacklevel=3)
        _state["ops"] = ops
        return ops


def _build() -> Any:
    from torch.utils import cpp_extension

    sources = [path.read_text() for path in _SOURCES]
    # -ffp-contract=off: no multiply-add is fused unless the source says so (optim_kernel.cpp
    # reproduces torch's rounding step by step); -fno-math-errno: sqrt vectorizes
    flags = ["-O3", "-ffp-contract=off", "-fno-math-errno", *_ARCH_FLAGS.get(cpu_capability(), [])]
    digest = hashlib.sha1(f"{sources}{flags}{torch.__version__}".encode()).hexdigest()[:12]
    name = f"mixprec_native_{digest}"
    build_dir = Path(cpp_extension._get_build_directory(name, verbose=False))
    if not any(build_dir.glob("*.so")):
        _log.warning("mixprec: building its C++ kernels (once per machine and torch "
                     "version, about 30 s) in %s", build_dir)
    # one translation unit per source: ninja compiles them in parallel
    cpp_extension.load(name, sources=[str(path) for path in _SOURCES], is_python_module=False,
                       extra_cflags=flags, verbose=False)
    return torch.ops.mixprec_native


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
_defined: set[int] = set()  # edits keys (mixprec._dispatch._edits_key) with a table
_local = threading.local()


def define_defaults(ops: Any) -> None:
    """Tables 0 and 1: PyTorch's kinds on CPU and CUDA, for ops no active table lists."""
    from mixprec.ops import default_table

    for i, dev in enumerate(_DEVICES):
        table = {n: k for n, k in default_table(dev).items() if runs(k)}
        ops.define_table(i, list(table), [KINDS[k] for k in table.values()])


def set_active(ops: Any, device_type: str, key: int | None, edits: Any) -> None:
    """Make ``edits`` (named by ``key``, their ``_dispatch._edits_key``; ``None``: no edits) the
    active table of this thread for ``device_type``."""
    table_id = -1
    if key is not None:
        table_id = key + len(_DEVICES)  # after the default tables
        if key not in _defined:
            with _lock:
                native = {n: k for n, k in edits.items() if runs(k)}
                ops.define_table(table_id, list(native), [KINDS[k] for k in native.values()])
                _defined.add(key)
    last = getattr(_local, "active", None)
    if last is None:
        last = _local.active = {}
    if last.get(device_type, -1) != table_id:
        ops.set_active(_DEVICES.index(device_type), table_id)
        last[device_type] = table_id
