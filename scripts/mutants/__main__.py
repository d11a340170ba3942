"""``python -m scripts.mutants``: apply each mutant of ``mutants.toml`` to a temporary copy of the
repository (``src/``, ``tests/``, ``pyproject.toml``), run the tests mapped to it there, and print
which test caught it, in the fast adversarial harness and in the rest of the default run.

Run from the repository root; not part of the default test run (docs/mutants.md). A run of the
whole list took 12 to 25 minutes on 2 shared cores when it held 35 mutants (2026-12-03; it holds
139 now); ``--only ID`` (repeatable, or comma-separated) or ``--area AREA`` runs a subset.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from .catalog import AREAS, Mutant, apply, load

ROOT = Path(__file__).resolve().parents[2]
_COPIED = ("src", "tests", "pyproject.toml")
#: Where the mutated copy lives: always the same folder for this checkout, because mixprec's C++
#: kernels are built per package folder (``mixprec._native.environment``): a new folder per
#: mutant would rebuild them (minutes) every time; one folder builds them once.
WORKDIR = Path(tempfile.gettempdir()) / f"mixprec-mutants-{hashlib.sha1(str(ROOT).encode()).hexdigest()[:8]}"
_FAILED = re.compile(r"^(?:FAILED|ERROR) (\S+)", re.M)


@dataclass(frozen=True)
class Outcome:
    """What one group of mapped tests did on a mutant: ``status`` is ``caught`` (a test failed,
    ``test`` names the first), ``timeout`` (counted as caught: the default run's timeout would
    stop it), ``missed``, ``error`` (pytest could not run them: a bad node id; ``test`` says
    what), or ``none`` (no test mapped)."""

    status: str
    test: str = ""
    seconds: float = 0.0

    @property
    def caught(self) -> bool:
        return self.status in ("caught", "timeout")

    def cell(self) -> str:
        if self.status == "caught":
            return self.test
        return {"timeout": "timeout (hang)", "none": "-", "missed": "MISSED"}.get(self.status, f"error: {self.test}")


def copy_tree(dest: Path) -> None:
    """Copy what the tests need into ``dest`` (no caches, no build outputs)."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".hypothesis", "*.so", ".pytest_cache")
    for name in _COPIED:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=ignore)
        else:
            shutil.copy2(src, dest / name)


def run_tests(root: Path, tests: tuple[str, ...], timeout: float) -> Outcome:
    """Run ``tests`` with pytest in the tree ``root`` (``PYTHONPATH=root/src``), stopping at the
    first failure; the whole group is killed after ``timeout`` seconds."""
    if not tests:
        return Outcome("none")
    env = {**os.environ, "PYTHONPATH": str(root / "src"), "MIXPREC_ADVERSARIAL": "fast"}
    env.setdefault("OMP_NUM_THREADS", "1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-rfE", "--no-header",
           f"--timeout={int(timeout)}", *tests]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # its own group: a hung test's ranks die with it
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return Outcome("timeout", seconds=time.monotonic() - start)
    seconds = time.monotonic() - start
    if proc.returncode == 0:
        return Outcome("missed", seconds=seconds)
    failed = _FAILED.findall(out)
    if proc.returncode in (1, 2):  # tests failed, or collection failed (the mutant broke an import)
        return Outcome("caught", failed[0] if failed else f"pytest exit {proc.returncode}", seconds)
    tail = out.strip().splitlines()[-1:] or [""]
    return Outcome("error", f"pytest exit {proc.returncode}: {tail[0][:120]}", seconds)


def run_mutant(mutant: Mutant | None, selected: tuple[str, ...] | None, timeout: float, harness_only: bool,
               keep: bool) -> tuple[Outcome, Outcome]:
    """Apply ``mutant`` (None: the baseline, nothing applied) to a fresh copy in :data:`WORKDIR`
    and run its groups."""
    tmp = WORKDIR / "tree"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        copy_tree(tmp)
        if mutant is not None:
            apply(mutant, tmp)
        harness = mutant.harness if mutant is not None else selected or ()
        package = mutant.package if mutant is not None else ()
        h = run_tests(tmp, harness, timeout)
        p = Outcome("none") if harness_only else run_tests(tmp, package, timeout)
        return h, p
    finally:
        if keep:
            print(f"  (kept {tmp})", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)


def _select(mutants: tuple[Mutant, ...], only: list[str], areas: list[str]) -> list[Mutant]:
    ids = [i for arg in only for i in arg.split(",") if i]
    known = {m.id for m in mutants}
    unknown = [i for i in ids if i not in known]
    if unknown:
        raise SystemExit(f"scripts.mutants: unknown mutant id(s) {unknown}; `python -m scripts.mutants --list` lists them")
    return [m for m in mutants if (not ids or m.id in ids) and (not areas or m.area in areas)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m scripts.mutants", description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", action="append", default=[], metavar="ID", help="run only these mutants (repeatable, or ID,ID)")
    ap.add_argument("--area", action="append", default=[], choices=AREAS, help="run only the mutants of this area")
    ap.add_argument("--list", action="store_true", help="list the mutants and their mapped tests, run nothing")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per group of mapped tests (default 900)")
    ap.add_argument("--harness-only", action="store_true", help="run only the mapped harness tests")
    ap.add_argument("--baseline", action="store_true",
                    help="first run every selected mutant's mapped tests on the unmutated copy: they must pass")
    ap.add_argument("--json", type=Path, help="also write the results to this file")
    ap.add_argument("--keep", action="store_true", help="leave the last mutated copy in place (to debug a mutant)")
    args = ap.parse_args(argv)
    WORKDIR.mkdir(parents=True, exist_ok=True)
    lock = open(WORKDIR / "lock", "w")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held until this process ends
    except BlockingIOError:
        raise SystemExit(f"scripts.mutants: another run uses {WORKDIR}; wait for it to finish") from None

    chosen = _select(load(), args.only, args.area)
    if args.list:
        for m in chosen:
            print(f"{m.id:44} {m.area:12} {m.file}\n    {m.description}\n"
                  f"    harness: {', '.join(m.harness) or '-'}\n    package: {', '.join(m.package) or '-'}")
        return 0
    if args.baseline:
        tests = tuple(dict.fromkeys(t for m in chosen for t in (*m.harness, *(() if args.harness_only else m.package))))
        base, _ = run_mutant(None, tests, args.timeout * 4, True, args.keep)
        print(f"baseline ({len(tests)} test groups, unmutated): {base.status} in {base.seconds:.0f} s"
              + (f" ({base.test})" if base.test else ""), flush=True)
        if base.status != "missed":  # "missed" here: every test passed
            return 2

    rows = []
    width = max(len(m.id) for m in chosen) if chosen else 10
    print(f"{'mutant':{width}}  {'fast harness':50}  {'package tests':50}  default run", flush=True)
    for m in chosen:
        h, p = run_mutant(m, None, args.timeout, args.harness_only, args.keep)
        default = "caught" if (h.caught or p.caught) else "MISSED"
        print(f"{m.id:{width}}  {h.cell():50}  {p.cell():50}  {default}  ({h.seconds + p.seconds:.0f} s)", flush=True)
        rows.append({"id": m.id, "area": m.area, "issue": m.issue, "harness": asdict(h), "package": asdict(p),
                     "default": default == "caught"})
    n = len(rows)
    if n:
        fast = sum(Outcome(**r["harness"]).caught for r in rows)
        default_n = sum(r["default"] for r in rows)
        print(f"\n{n} mutants: caught by the fast harness {fast}/{n} ({100 * fast / n:.0f}%), "
              f"by the default run {default_n}/{n} ({100 * default_n / n:.0f}%)")
        missed = [r["id"] for r in rows if not r["default"]]
        if missed:
            print("survivors of the default run: " + ", ".join(missed))
    if args.json:
        args.json.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "results": rows}, indent=1) + "\n")
    return 0 if all(r["default"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
