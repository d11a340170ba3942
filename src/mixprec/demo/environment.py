"""Where the demo runs: versions, the CPU's native fp16/bf16 support, and how many threads to use.

On a small model the CPU threads of PyTorch's intra-op pool mostly wait for each other; on a
machine whose cores are busy with other work they also wait for a core, and OpenMP's waiting
threads spin: the demo then burned about 3x the CPU time of an idle run and took 10x longer.
:func:`choose_threads` gives the demo the cores that are actually free (the process's CPU affinity
minus the load average), and ``mixprec demo`` makes OpenMP's idle threads sleep instead of spin
(``OMP_WAIT_POLICY=PASSIVE``, unless set).

Example:
    >>> threads, why = choose_threads(cores=2, load=2.7)
    >>> threads, why
    (1, '2 cores, load 2.7')
"""

from __future__ import annotations

import math
import os
import platform
import statistics
import time
from typing import Any

import torch

__all__ = ["available_cores", "load_average", "choose_threads", "lowp_speed", "cpu_lowp_support", "environment",
           "native_lowp", "steady_slowdown", "capability"]


def available_cores() -> int:
    """Cores this process may run on (its CPU affinity where the OS has one, else ``os.cpu_count``)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def load_average() -> float | None:
    """The 1-minute load average, or None where the OS has none."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def choose_threads(cores: int | None = None, load: float | None = None) -> tuple[int, str]:
    """Intra-op threads for the demo: the ``cores`` not busy with ``load`` (the 1-minute load
    average, taken before the demo starts), at least one; and the reason, for the report."""
    cores = available_cores() if cores is None else cores
    if load is None:
        load = load_average() or 0.0
    free = math.floor(cores - load + 0.5)
    return max(1, min(cores, free)), f"{cores} cores, load {load:.1f}"


def lowp_speed(device: torch.device, n: int = 256, rounds: int = 15) -> dict[str, dict[str, float]]:
    """Time of an ``n x n`` matmul in float16 and bfloat16 relative to float32 on ``device``.

    The three dtypes are timed in turn, ``rounds`` times after a warm-up; each ratio is the
    median of the per-round ratios, with their quartiles ``low`` (q1) and ``high`` (q3) and the
    spread ``(q3 - q1) / median`` (a busy machine shows a large spread). A ratio well above 1
    means no native kernels for that dtype (on most CPUs float16 and bfloat16 matmuls are
    emulated). Synchronises the device.

    Returns:
        ``{"float16": {"slowdown": ..., "low": ..., "high": ..., "spread": ...}, "bfloat16": {...}}``.
    """
    a = torch.randn(n, n, device=device)
    xs = {dtype: a.to(dtype) for dtype in (torch.float32, torch.float16, torch.bfloat16)}
    times: dict[torch.dtype, list[float]] = {dtype: [] for dtype in xs}
    for round_ in range(rounds + 1):
        for dtype, x in xs.items():
            _sync(device)
            start = time.perf_counter()
            x @ x
            _sync(device)
            if round_:  # round 0 warms up
                times[dtype].append(time.perf_counter() - start)
    out = {}
    for dtype in (torch.float16, torch.bfloat16):
        ratios = [t / f for t, f in zip(times[dtype], times[torch.float32])]
        q1, median, q3 = statistics.quantiles(ratios, n=4)
        out[str(dtype).removeprefix("torch.")] = {"slowdown": median, "low": q1, "high": q3,
                                                  "spread": (q3 - q1) / median}
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# CPU flags of native float16/bfloat16 matmul units (x86; /proc/cpuinfo)
_NATIVE_FLAGS = {"float16": ("avx512_fp16", "amx_fp16"), "bfloat16": ("avx512_bf16", "amx_bf16")}


def cpu_lowp_support() -> dict[str, dict[str, Any]]:
    """Whether this CPU has native float16/bfloat16 matmul units, and how slow those matmuls are.

    Returns ``{"float16": {"native": ..., "slowdown": ..., "spread": ...}, "bfloat16": {...}}``:
    ``native`` from the CPU flags in ``/proc/cpuinfo`` (``None`` where they cannot be read),
    ``slowdown`` and ``spread`` from :func:`lowp_speed`.
    """
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags: set[str] | None = {
                flag for line in f if line.startswith("flags") for flag in line.split(":", 1)[1].split()
            }
    except OSError:
        flags = None
    speed = lowp_speed(torch.device("cpu"))
    return {
        dtype: {"native": None if not flags else any(flag in flags for flag in names), **speed[dtype]}
        for dtype, names in _NATIVE_FLAGS.items()
    }


# a slowdown measured with a larger spread (interquartile range / median) is not trusted, unless
# even its lower quartile is above EMULATED_SLOWDOWN
MAX_SPREAD = 0.5
#: A matmul this many times slower than float32 (or more) is emulated.
EMULATED_SLOWDOWN = 1.5


def steady_slowdown(info: dict[str, float]) -> bool:
    """Whether a :func:`lowp_speed` measurement is a result to quote: its spread is small, or
    even its lower quartile is above :data:`EMULATED_SLOWDOWN` (a 41x slowdown measured between
    30x and 50x is no noise, however wide its band).

    Example:
        >>> steady_slowdown({"slowdown": 41.0, "low": 30.0, "high": 52.0, "spread": 0.54})
        True
        >>> steady_slowdown({"slowdown": 1.3, "low": 0.8, "high": 2.0, "spread": 0.9})
        False
    """
    return info.get("spread", 0.0) <= MAX_SPREAD or info.get("low", 0.0) > EMULATED_SLOWDOWN


def native_lowp(env: dict[str, Any]) -> dict[str, bool | None]:
    """Whether float16/bfloat16 matmuls are native where ``env`` (:func:`environment`) was taken:
    the one reading of the capability that the demo's estimate, notes and captions use.

    From the CPU flags where they were read; where they were not, ``False`` when the matmul was
    measured more than :data:`EMULATED_SLOWDOWN` times slower than float32, steadily
    (:func:`steady_slowdown`), else ``None`` (unknown).
    Empty off the CPU (a GPU's capability is not probed).

    Example:
        >>> native_lowp({"cpu_lowp": {"float16": {"native": True, "slowdown": 1.0, "spread": 0.1}}})
        {'float16': True}
    """
    out: dict[str, bool | None] = {}
    for dtype, info in env.get("cpu_lowp", {}).items():
        if info["native"] is not None:
            out[dtype] = bool(info["native"])
        elif steady_slowdown(info) and info["slowdown"] > EMULATED_SLOWDOWN:
            out[dtype] = False
        else:
            out[dtype] = None
    return out


def capability(env: dict[str, Any]) -> str:
    """:func:`native_lowp` in words, e.g. ``"native float16/bfloat16"``,
    ``"native bfloat16, no native float16"``, ``"unknown float16/bfloat16 support"``."""
    native = native_lowp(env)
    if not native:
        return "float16/bfloat16 support not probed" if "gpu" in env else "unknown float16/bfloat16 support"
    groups = {"native": [d for d, v in native.items() if v], "no native": [d for d, v in native.items() if v is False],
              "unknown": [d for d, v in native.items() if v is None]}
    return ", ".join(f"{label} {'/'.join(dtypes)}" for label, dtypes in groups.items() if dtypes)


def environment(device: torch.device, threads_reason: str = "") -> dict[str, Any]:
    """Versions and hardware of this run (``cores``: :func:`available_cores`; ``load``: the
    1-minute load average at the start, where the OS has one); on CPU, :func:`cpu_lowp_support`
    too."""
    env: dict[str, Any] = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "threads": torch.get_num_threads(),
        "cores": available_cores(),
    }
    load = load_average()
    if load is not None:
        env["load"] = load
    if threads_reason:
        env["threads_chosen_for"] = threads_reason
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    else:
        env["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
        env["cpu_lowp"] = cpu_lowp_support()
    return env
