"""Run the test suite (or its ``cross_isa`` subset) under every instruction-set cap this CPU can
lower itself to, so that a test whose result follows one CPU's bf16 rounding fails here, not in
CI on another machine.

bf16 GEMMs and reductions round differently on AVX2, AVX-512, AVX-512 with native bf16 and AMX.
oneDNN (``ONEDNN_MAX_CPU_ISA``) and ATen's vectorized kernels (``ATEN_CPU_CAPABILITY``) both cap
what they use at start-up, so one machine reproduces every CPU below its own. Inductor's C++
kernels follow ``ATEN_CPU_CAPABILITY`` too (``torch._inductor.cpu_vec_isa.pick_vec_isa``), but its
on-disk cache does not key on it: a kernel generated for AVX-512 by a native run is reloaded and
built for AVX2 by a capped one, and computes garbage (all-NaN outputs, a failure no AVX2 machine
has). So each cap below native gets its own ``TORCHINDUCTOR_CACHE_DIR``, beside the usual one.

Usage (from the repository root, after ``bash scripts/venv.sh``)::

    .venv/bin/python scripts/cross_isa.py                  # whole suite, every cap this CPU allows
    .venv/bin/python scripts/cross_isa.py --subset         # only tests marked cross_isa
    .venv/bin/python scripts/cross_isa.py --subset --caps lowest -- -x   # what the default run does
    .venv/bin/python scripts/cross_isa.py --list           # the caps, and exit

Arguments after ``--`` go to pytest. Exit status: 0 when every cap passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import getpass
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclasses.dataclass(frozen=True)
class Cap:
    """One instruction-set cap: ``onednn`` is ``ONEDNN_MAX_CPU_ISA`` (None: not set), ``aten``
    is ``ATEN_CPU_CAPABILITY`` (None: not set); ``needs`` the /proc/cpuinfo flags it needs."""

    name: str
    onednn: str | None
    aten: str | None
    needs: tuple[str, ...]

    def env(self) -> dict[str, str]:
        """This process's environment with the cap set, and (below native) inductor's cache in a
        folder of the cap's own: ``<TORCHINDUCTOR_CACHE_DIR or torch's default>-<name>``."""
        env = dict(os.environ)
        for key, value in (("ONEDNN_MAX_CPU_ISA", self.onednn), ("ATEN_CPU_CAPABILITY", self.aten)):
            if value is None:
                env.pop(key, None)
            else:
                env[key] = value
        if self.name != "native":
            env["TORCHINDUCTOR_CACHE_DIR"] = f"{inductor_cache_dir(env)}-{self.name}"
        return env


def inductor_cache_dir(env: dict[str, str]) -> str:
    """Inductor's cache folder for ``env``: ``TORCHINDUCTOR_CACHE_DIR``, else torch's default
    (``torch._inductor.runtime.cache_dir_utils.default_cache_dir``, without importing torch)."""
    if env.get("TORCHINDUCTOR_CACHE_DIR"):
        return env["TORCHINDUCTOR_CACHE_DIR"]
    try:
        user = getpass.getuser()
    except (KeyError, ModuleNotFoundError, OSError):
        user = f"uid_{os.getuid()}" if hasattr(os, "getuid") else "unknown_user"
    return os.path.join(tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user))


#: lowest first; "native" is the CPU as it is
CAPS = (
    Cap("avx2", "AVX2", "avx2", ("avx2", "fma")),
    Cap("avx512", "AVX512_CORE", "avx512", ("avx512f", "avx512bw", "avx512vl", "avx512dq")),
    Cap("avx512-bf16", "AVX512_CORE_BF16", "avx512", ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16")),
    Cap("amx", "AVX512_CORE_AMX", None, ("amx_bf16", "amx_tile")),
    Cap("native", None, None, ()),
)


def cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def available(flags: set[str] | None = None) -> list[Cap]:
    """The caps this CPU can run, lowest first, ending with ``native``. A cap equal to the CPU's
    own top (AMX on an AMX CPU) is still listed: it pins oneDNN, which ``native`` leaves free.

    Example:
        >>> [c.name for c in available({"avx2", "fma"})]
        ['avx2', 'native']
    """
    flags = cpu_flags() if flags is None else flags
    return [c for c in CAPS if set(c.needs) <= flags]


def run(cap: Cap, subset: bool, extra: list[str]) -> tuple[int, float]:
    """Run pytest under ``cap``; returns its exit status and wall time in seconds."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    if subset:
        cmd += ["-m", "cross_isa"]
    cmd += extra
    print(f"== {cap.name}: ONEDNN_MAX_CPU_ISA={cap.onednn or '(unset)'} "
          f"ATEN_CPU_CAPABILITY={cap.aten or '(unset)'}: {' '.join(cmd[1:])}", flush=True)
    env = cap.env()
    print(f"   TORCHINDUCTOR_CACHE_DIR={env.get('TORCHINDUCTOR_CACHE_DIR', '(unset)')}", flush=True)
    start = time.monotonic()
    status = subprocess.call(cmd, cwd=ROOT, env=env)
    return status, time.monotonic() - start


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra: list[str] = []
    if "--" in argv:
        extra = argv[argv.index("--") + 1:]
        argv = argv[:argv.index("--")]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--subset", action="store_true", help="only the tests marked cross_isa")
    parser.add_argument("--caps", default="all",
                        help="'all' (default), 'lowest' (the lowest cap below native), or names, comma-separated")
    parser.add_argument("--list", action="store_true", help="print the caps this CPU allows and exit")
    args = parser.parse_args(argv)
    caps = available()
    if args.list:
        for cap in caps:
            print(cap.name, cap.onednn or "-", cap.aten or "-")
        return 0
    if args.caps == "lowest":
        caps = caps[:1] if len(caps) > 1 else caps
    elif args.caps != "all":
        names = args.caps.split(",")
        unknown = [n for n in names if n not in {c.name for c in caps}]
        if unknown:
            parser.error(f"caps {unknown} are not available on this CPU: choose from {[c.name for c in caps]}")
        caps = [c for c in caps if c.name in names]
    results = [(cap, *run(cap, args.subset, extra)) for cap in caps]
    print("\ncap           status   seconds")
    for cap, status, seconds in results:
        print(f"{cap.name:13} {'passed' if status == 0 else f'FAILED ({status})':8} {seconds:7.0f}")
    return 0 if all(status == 0 for _, status, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
