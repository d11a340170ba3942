"""The ``mixprec`` command: ``mixprec demo``, ``mixprec audit`` and ``mixprec build-kernels``.

``mixprec demo`` trains the demo language model in every precision mode side by side and writes
a report (see ``docs/demo.md``); ``mixprec audit`` is :mod:`mixprec.diagnostics.cli`'s;
``mixprec build-kernels`` builds the C++ kernels ahead of time (:mod:`mixprec._native`);
``mixprec --version`` prints mixprec's and torch's versions. Also ``python -m mixprec ...``.
Usage errors print one line on stderr and exit with status 2; errors found before training
(an unwritable ``--out``, a missing API) one line and status 1; Ctrl-C during ``mixprec demo``
writes the report of the modes that finished, one line, and status 130.

Example:
    $ mixprec demo --modes fp32,torch-amp,mixprec-fp16 --steps 50 --out report/
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, NoReturn, Sequence

from mixprec._paths import folder_problem

__all__ = ["main", "build_parser"]


class _Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors are one line on stderr and exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


#: The most ``--steps`` the demo takes (a run's batch offsets are drawn up front).
MAX_STEPS = 1_000_000


def _steps(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if not 1 <= value <= MAX_STEPS:
        raise argparse.ArgumentTypeError(f"expected a positive integer up to {MAX_STEPS:,}, got {value}")
    return value


def _seed(text: str) -> int:
    from mixprec.demo.settings import MAX_SEED

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer seed, got {text!r}") from None
    if not 0 <= value < MAX_SEED:
        raise argparse.ArgumentTypeError(f"expected a seed from 0 to 2**63 - 1, got {value}")
    return value


def _modes(text: str) -> tuple[str, ...]:
    from mixprec.demo.modes import check_modes

    names = tuple(n.strip() for n in text.split(",") if n.strip())
    try:
        check_modes(names)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    except RuntimeError:  # a missing mixprec API: reported by the command, not as a usage error
        pass
    return names


#: The most ``--seeds`` and ``--threads`` the demo takes.
MAX_SEEDS = 100
MAX_THREADS = 1024
#: Without ``--seeds``: this many seeds, on CPU only as many as end within ``CPU_BUDGET_S``
#: seconds (speed panel included; the first seed always runs): with the start-up and the report,
#: about 3 minutes in all.
DEFAULT_SEEDS = 3
CPU_BUDGET_S = 165.0


def _count(most: int) -> Any:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
        if not 1 <= value <= most:
            raise argparse.ArgumentTypeError(f"expected a positive integer up to {most}, got {value}")
        return value

    return parse


def _device(text: str) -> Any:
    import torch

    try:
        device = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"not a device: {text!r} (try cpu or cuda)") from None
    if device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"the demo runs on cpu or cuda, got {text!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError("CUDA is not available here; use --device cpu")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise argparse.ArgumentTypeError(
            f"no device {text!r}: this machine has {torch.cuda.device_count()} CUDA device(s), "
            f"cuda:0 to cuda:{torch.cuda.device_count() - 1}"
        )
    return device


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _check_writable(out: Path) -> str | None:
    """Create ``out`` and try a file in it; the reason it cannot be written, or None."""
    problem = folder_problem(out)
    if problem is not None:
        return problem
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as e:
        return f"cannot write the report to {str(out)!r} ({e.strerror or e}); give --out a writable folder"
    return None


def _out(text: str) -> Path:
    if not text.strip():
        raise argparse.ArgumentTypeError("expected a folder, got an empty path")
    return Path(text)


def _demo(args: argparse.Namespace) -> int:
    import torch

    from mixprec.demo.environment import choose_threads
    from mixprec.demo.modes import check_modes
    from mixprec.demo.progress import progress_display
    from mixprec.demo.report import format_checks, format_table, format_verdict, hardware_note, write_report
    from mixprec.demo.settings import MAX_SEED, Settings
    from mixprec.demo.speed import SPEED_SIZES
    from mixprec.demo.train import run_demo

    prog = "mixprec demo"
    if importlib.util.find_spec("matplotlib") is None:
        print(f"{prog}: error: the report needs matplotlib: pip install matplotlib rich (from a checkout: pip install -e '.[report]')", file=sys.stderr)
        return 1
    out = args.out
    problem = _check_writable(out)
    if problem:
        print(f"{prog}: error: {problem}", file=sys.stderr)
        return 1
    try:
        check_modes(args.modes)
    except (ValueError, RuntimeError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 1
    device = args.device if args.device is not None else torch.device(_default_device())
    budget = None
    if args.seeds is not None:
        seeds = args.seeds
    elif device.type == "cpu":
        seeds, budget = DEFAULT_SEEDS, CPU_BUDGET_S
    else:
        seeds = DEFAULT_SEEDS
    if args.seed + seeds > MAX_SEED:
        print(f"{prog}: error: --seed {args.seed} with --seeds {seeds} passes 2**63 - 1; lower --seed", file=sys.stderr)
        return 1
    settings = dataclasses.replace(Settings.for_size(args.size, steps=args.steps, seed=args.seed),
                                   fp8_accumulate=args.fp8_accumulate)
    if args.threads is not None:
        threads, why = args.threads, "--threads"
    else:
        threads, why = choose_threads()
    torch.set_num_threads(threads)
    cfg = settings.model
    count = f"up to {seeds} seeds as {budget:.0f} s allow" if budget else f"{seeds} seed{'s' if seeds > 1 else ''}"
    print(
        f"mixprec demo: {len(args.modes)} modes x {settings.steps} steps x {count} "
        f"on {device} ({threads} thread{'s' if threads > 1 else ''}: {why}); model {cfg.n_layers} layers, "
        f"d={cfg.d_model}, seq {cfg.seq_len}, batch {settings.batch_size}",
        flush=True,
    )
    speed_sizes = () if args.no_speed_panel else SPEED_SIZES
    try:
        with progress_display() as progress:
            result = run_demo(settings, args.modes, device, progress, seeds=seeds, threads_reason=why,
                              speed_sizes=speed_sizes, budget_s=budget)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted (Ctrl-C) before a mode finished; no report written", file=sys.stderr)
        return 130
    try:
        note = hardware_note(result)
        if note:
            print(f"note: {note}")
        for line in format_verdict(result):
            print(line)
        print(format_table(result))
        for line in format_checks(result):
            print(line)
        paths = write_report(result, out)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted (Ctrl-C) while writing the report into {out}", file=sys.stderr)
        return 130
    if result.interrupted:
        print(f"{prog}: interrupted (Ctrl-C): {result.interrupted}; report of those: {paths['index']}", file=sys.stderr)
        return 130
    print(f"report: {paths['index']}  (data: {paths['results']})")
    return 0


def _build_kernels(args: argparse.Namespace) -> int:
    """Build (or find) this environment's C++ kernels, with progress lines; exit status 1 if they
    cannot be built (mixprec then runs its Python kernels: same results, slower)."""
    import threading
    import time

    from mixprec import _native

    prog = "mixprec build-kernels"
    if not _native.enabled():
        print(f"{prog}: MIXPREC_NATIVE_KERNELS=0: nothing to build, mixprec uses its Python kernels")
        return 0
    done, start = threading.Event(), time.monotonic()

    def tick() -> None:
        while not done.wait(15):
            print(f"{prog}: still building ({time.monotonic() - start:.0f} s)...", flush=True)

    threading.Thread(target=tick, daemon=True).start()
    try:
        built = _native.build(retry=True, say=lambda line: print(line, flush=True))
    except _native.BuildError as e:
        print(f"{prog}: error: {e}. mixprec will use its Python kernels and torch's fused optimizer "
              "kernels on float32 copies (same results, slower)", file=sys.stderr)
        return 1
    finally:
        done.set()
    if built.seconds is None:
        print(f"{prog}: already built for this environment: {built.directory}")
    else:
        print(f"{prog}: built in {built.seconds:.1f} s: {built.directory}")
    return 0


def _version() -> str:
    """``mixprec X (torch Y)``, read from the installed metadata (no torch import)."""
    import importlib.metadata

    import mixprec

    try:
        torch_version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch_version = "not installed"
    return f"mixprec {mixprec.__version__} (torch {torch_version})"


def build_parser() -> argparse.ArgumentParser:
    """The ``mixprec`` argument parser, with ``demo`` and (when available) ``audit``."""
    from mixprec.demo.model import SIZES
    from mixprec.demo.modes import DEFAULT_MODES, MODES

    parser = _Parser(prog="mixprec", description="Automatic mixed precision for PyTorch.")
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", metavar="{demo,audit,build-kernels,export}", required=True)
    demo = sub.add_parser(
        "demo",
        help="train a small language model in every precision mode and write a report",
        description="Train a small decoder-only transformer on a bundled public-domain text in "
        "each precision mode, from the same seed, and write index.html, PNG figures and "
        "results.json into --out.",
    )
    demo.add_argument("--steps", type=_steps, default=None,
                      help="optimizer steps per mode (default: the size's; tiny: 120)")
    demo.add_argument("--size", choices=tuple(SIZES), default="tiny", help="model size (default: tiny)")
    demo.add_argument("--modes", type=_modes, default=DEFAULT_MODES,
                      help=f"comma-separated modes (default: all but torch-amp-bf16): {','.join(MODES)}")
    demo.add_argument("--device", type=_device, default=None,
                      help="cpu or cuda (default: cuda when available)")
    demo.add_argument("--out", type=_out, default=Path("mixprec-report"),
                      help="report folder, created if needed (default: mixprec-report/)")
    demo.add_argument("--seed", type=_seed, default=0,
                      help="seed of weights and batches, 0 to 2**63 - 1 (default: 0)")
    demo.add_argument("--seeds", type=_count(MAX_SEEDS), default=None,
                      help="train every mode from this many seeds (--seed, --seed + 1, ...) and report "
                      "mean and spread (default: 3; on cpu as many of them as end within about 3 minutes, at least 1)")
    demo.add_argument("--threads", type=_count(MAX_THREADS), default=None,
                      help="CPU threads (default: the cores not busy with other work, at least 1)")
    demo.add_argument("--fp8-accumulate", choices=("float32", "tensor_core"), default="float32",
                      help="how the fp8/fp4 modes' emulated GEMMs accumulate: float32 (default) or as an fp8 "
                      "tensor core (about 14 bits, promoted every 128 elements of K; docs/cuda.md)")
    demo.add_argument("--no-speed-panel", action="store_true",
                      help="skip the speed panel (fp32, bf16, fp16 and fp8 steps timed before training: the "
                      "trained size first, then the other sizes within 45 s)")
    demo.set_defaults(func=_demo)
    kernels = sub.add_parser(
        "build-kernels",
        help="build mixprec's C++ kernels for this environment now (else at first use: about 30 s)",
        description="Build mixprec's C++ kernels (the autocast kernel and the fused optimizer step) "
        "for this Python environment, torch and compiler, or report that they are built; retries a "
        "failed build. Exit status 1 if they cannot be built (mixprec then uses its Python kernels).",
    )
    kernels.set_defaults(func=_build_kernels)
    if importlib.util.find_spec("mixprec.diagnostics.cli") is not None:
        from mixprec.diagnostics.cli import add_audit_parser

        add_audit_parser(sub)
    from mixprec.export.cli import add_export_parser

    add_export_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``mixprec`` command with ``argv`` (``sys.argv[1:]`` when None); return the exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["demo"]:
        # idle OpenMP threads sleep instead of spinning: read when torch loads, so set it first
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    args = build_parser().parse_args(argv)
    from mixprec._quiet import quiet_imports

    with quiet_imports():  # torchao's import-time log lines, through a model's transformers
        return int(args.func(args))
