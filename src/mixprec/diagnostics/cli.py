"""``mixprec audit package.module:factory``: the command behind the ``audit`` subcommand.

The factory is called with no arguments and returns ``(model, batch, loss_fn)`` as
:func:`mixprec.audit` takes them (``loss_fn(model, batch) -> scalar loss``). The command writes
``index.html`` and ``report.json`` (whose ``"policy"`` ``mixprec.Policy.load`` reads back) into
``--out`` and prints the summary, whose "use it" line loads the policy from that
``report.json``; while the audit runs, a progress line goes to stderr before every pass (each
pass takes a forward and a backward of the model: minutes for a large one). A bad target (module not found, no such attribute, not
callable, factory raising, wrong return shape) or a bad option prints one line on stderr and
returns 2; an ``--out`` that cannot hold the report (a file, a folder under a file, not writable)
or an audit that fails while running the model (inf/NaN already in float32, an exception in the
model or ``loss_fn``) prints one line and returns 1, as ``mixprec demo`` does.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
from typing import Any

from mixprec._paths import folder_problem
from mixprec._quiet import quiet_imports
from mixprec.diagnostics.audit import audit, check_device, dtype_names
from mixprec.fp8 import as_recipe

__all__ = ["add_audit_parser", "audit_command"]


def _one_line(e: BaseException) -> str:
    """``Type: message`` on one line (PyTorch messages often span several)."""
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _fail(message: str, code: int = 2) -> int:
    print(f"mixprec audit: {message}", file=sys.stderr)
    return code


def _load(target: str) -> tuple[Any, Any, Any] | str:
    """The factory's ``(model, batch, loss_fn)``, or an error message."""
    from torch import nn

    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        return f"target must look like package.module:factory, got {target!r}"
    if os.getcwd() not in sys.path:  # like `python -m`: modules in the current directory
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        return f"cannot import {module_name!r}: {' '.join(str(e).split())}"
    except Exception as e:  # the module itself failed while importing
        return f"importing {module_name!r} raised {_one_line(e)}"
    factory = module
    for part in attr.split("."):
        if not hasattr(factory, part):
            return f"module {module_name!r} has no attribute {attr!r}"
        factory = getattr(factory, part)
    if not callable(factory):
        return f"{target} is not a callable factory (it is of type {type(factory).__name__})"
    try:
        result = factory()
    except (Exception, SystemExit) as e:  # (sys.exit in a factory: not the audit's exit)
        return f"factory {target} raised {_one_line(e)}"
    if not (isinstance(result, (tuple, list)) and len(result) == 3):
        got = f"a {len(result)}-tuple" if isinstance(result, (tuple, list)) else type(result).__name__
        return f"factory {target} must return (model, batch, loss_fn), got {got}"
    model, batch, loss_fn = result
    if not isinstance(model, nn.Module):
        return f"factory {target} returned a {type(model).__name__} as model, not an nn.Module"
    if not callable(loss_fn):
        return f"factory {target} returned a {type(loss_fn).__name__} as loss_fn, not a callable"
    return model, batch, loss_fn


def audit_command(target: str, out: str, *, device_type: str, dtypes: list[str],
                  steps: int, fp8: str | None = None, full: bool = False) -> int:
    """Run :func:`mixprec.audit` on a factory's model; write the report; return an exit code.

    Args:
        target: ``"package.module:factory"`` (importable from the current directory too).
        out: report folder (``index.html`` and ``report.json``), created if missing.
        device_type: ``"cpu"`` or ``"cuda"``.
        dtypes: candidate dtype names, e.g. ``["float16", "bfloat16"]`` (``fp16``/``bf16`` ok).
        steps: passes per configuration.
        fp8: an fp8 recipe name (``tensorwise``, ``rowwise``, ``rowwise_with_gw_hp``, ``mxfp8``,
            ``blockwise``, or ``auto``: a format per layer): also
            recommend the Linear layers that run in fp8; ``None``: no fp8.
        full: print the policy by exact module names and name every module (``--full``); else
            its shortest equivalent form, groups of more than 4 modules counted.

    Returns:
        0 on success; 2 for a bad target or bad options; 1 for an ``out`` that cannot hold the
        report or an audit that fails while running the model. Every failure prints one line on
        stderr.
    """
    if not dtypes:  # the options first: a typo should not cost a model build
        return _fail("--dtypes is empty; pass e.g. --dtypes float16,bfloat16")
    try:
        names = dtype_names(dtypes, fp8_option="--fp8 tensorwise")
    except (ValueError, TypeError) as e:
        return _fail(str(e))
    if not isinstance(steps, int) or steps < 1:
        return _fail(f"--steps must be an integer >= 1, got {steps!r}")
    if fp8 is not None and fp8 != "auto":
        try:
            as_recipe(fp8)
        except ValueError as e:
            return _fail(f"--fp8: {e}")
    problem = folder_problem(out)
    if problem:
        return _fail(problem, code=1)
    with quiet_imports():  # a factory that imports transformers: torchao's log lines
        loaded = _load(target)
    if isinstance(loaded, str):
        return _fail(loaded)
    model, batch, loss_fn = loaded
    try:
        check_device(model, batch, device_type, option="--device")
    except (ValueError, TypeError) as e:
        return _fail(str(e))
    created = not os.path.isdir(out)
    try:  # before the audit, which may take a while
        os.makedirs(out, exist_ok=True)
    except OSError as e:
        return _fail(f"cannot write the report to {out!r} ({e.strerror or e}); give --out a writable folder",
                     code=1)
    start = time.monotonic()

    def progress(line: str) -> None:
        print(f"mixprec audit: [{time.monotonic() - start:5.1f} s] {line}", file=sys.stderr, flush=True)

    try:
        report = audit(model, batch, loss_fn, device_type=device_type, dtypes=names,
                       steps=steps, fp8=fp8, progress=progress)
    except Exception as e:  # the model or loss_fn failed while running: one line, exit 1
        if created:
            os.rmdir(out)
        return _fail(f"the audit failed: {_one_line(e)}", code=1)
    progress("writing the report (figures: a few seconds)")
    try:
        report.save(out)
    except OSError as e:
        return _fail(f"cannot write the report to {out!r}: {e.strerror or e}", code=1)
    progress("done")
    report.summary(policy_file=os.path.join(out, "report.json"), full=full)
    print(f"report written to {os.path.join(out, 'index.html')} and report.json")
    return 0


def add_audit_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``audit`` on an ``argparse`` subparsers object.

    The parser sets ``func`` to a callable taking the parsed namespace and returning the exit
    code, so a main program can end with ``return args.func(args)``.
    """
    p = subparsers.add_parser(
        "audit",
        help="audit a model's numerics and recommend a mixed-precision policy",
        description="Run a model in float32 and in each candidate dtype, name the layers that "
        "overflow or underflow, and recommend a mixprec.Policy and an initial loss scale. "
        "TARGET is package.module:factory; factory() returns (model, batch, loss_fn) with "
        "loss_fn(model, batch) -> scalar loss.",
    )
    p.add_argument("target", help="package.module:factory")
    p.add_argument("--out", default="mixprec-audit", help="report folder (default: %(default)s)")
    p.add_argument("--device", default="cpu", help="device type (default: %(default)s)")
    p.add_argument("--dtypes", default="float16,bfloat16",
                   help="comma-separated candidate dtypes (default: %(default)s)")
    p.add_argument("--steps", type=int, default=1, help="passes per configuration (default: 1)")
    p.add_argument("--fp8", default=None, metavar="RECIPE",
                   help="also recommend the Linear layers that run in fp8 with this recipe "
                   "(tensorwise, rowwise, rowwise_with_gw_hp, mxfp8, blockwise; auto: a format per layer)")
    p.add_argument("--full", action="store_true",
                   help="print the policy by exact module names and name every module (default: its "
                   "shortest equivalent form, e.g. a rule over module types or name parts)")
    p.set_defaults(func=lambda a: audit_command(
        a.target, a.out, device_type=a.device,
        dtypes=[d for d in a.dtypes.split(",") if d.strip()], steps=a.steps, fp8=a.fp8, full=a.full))
    return p
