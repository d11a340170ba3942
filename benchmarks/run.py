"""Run every benchmark of the project and print one table of ratios against the reference.

    python -m benchmarks [--quick] [--markdown]

Each benchmark module exposes ``run(quick=False)`` returning a dict (or a list of dicts) of
figures; an adapter here turns them into rows ``(benchmark, figure, ratio, reference, detail)``.
The ratio is mixprec's cost over the reference's (time or bytes; below 1 is better), measured
side by side. Each benchmark runs in a fresh process: once mixprec has registered a kernel,
``torch.autocast`` in that process runs through it, so a reference measured after another
benchmark would no longer be PyTorch's own. A benchmark that is missing or fails prints one line
on stderr (after the table of the others), and the exit status is then 1; one whose figures this
machine cannot take (it raises :class:`NotMeasurable`: the C++ kernels off or unbuilt) is logged
as skipped, with its reason, and is no failure.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import multiprocessing
import resource
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Sequence

__all__ = ["Row", "BENCHMARKS", "NotMeasurable", "run_all", "format_table", "main"]


class NotMeasurable(RuntimeError):
    """Raised by a benchmark's ``run`` whose figures this machine or configuration cannot take
    (what it compares is absent here, as the C++ kernels under ``MIXPREC_NATIVE_KERNELS=0``):
    :func:`run_all` logs it as skipped, not as a failure."""


@dataclass(frozen=True)
class Row:
    """One line of the table: ``ratio`` is mixprec / ``reference`` (lower is better)."""

    benchmark: str
    figure: str
    ratio: float
    reference: str
    detail: str = ""


def _autocast(res: dict[str, Any]) -> list[Row]:
    names = {"tiny": "tiny-op loop", "edited_op": "edited-op loop (softmax fp32)", "step": "transformer step"}
    what = {"default": "mixprec.autocast, default policy", "after": "torch.autocast after mixprec",
            "edited": "mixprec.autocast, softmax edited",
            "kept": "torch.autocast, mixprec's module hooks kept"}
    rows = []
    for (case, load), ratio in res["ratios"].items():
        if load == "edited_op" and case in ("default", "kept"):
            continue
        t, ref = res["seconds"][(case, load)], res["seconds"][("clean", load)]
        unit, k = ("ms", 1e3) if load == "step" else ("us/op", 1e6)
        rows.append(Row("autocast_overhead", f"{what[case]}: {names[load]}", ratio,
                        "clean torch.autocast (other process)", f"{t * k:.2f} vs {ref * k:.2f} {unit}"))
    return rows


def _scaler(res: dict[str, float]) -> list[Row]:
    return [
        Row("scaler_overhead", f"scale/step/update, {kind}", ratio, "torch.amp.GradScaler")
        for kind, ratio in res.items()
    ]


def _lowp(rows: list[dict[str, Any]]) -> list[Row]:
    ref = next(r for r in rows if r["recipe"] == "autocast")
    return [
        Row("lowp_memory", f"bytes/param, {r['label']}", r["bytes_per_param"] / ref["bytes_per_param"],
            f"{ref['label']} ({ref['bytes_per_param']:.1f} B)",
            f"{r['bytes_per_param']:.1f} B/param, loss {r['loss_vs_fp32']:.3f}x fp32's")
        for r in rows
    ]


def _diagnostics(res: dict[str, float]) -> list[Row]:
    return [
        Row("diagnostics_overhead", f"step time, {name}", ratio, "plain step",
            f"plain step {res['step_ms']:.2f} ms")
        for name, ratio in res.items()
        if name != "step_ms"
    ]


def _layerwise(res: dict[str, Any]) -> list[Row]:
    ref = "mixprec.GradScaler, one scale"
    detail = f"global step {res['step_ms']:.1f} ms; skipped {res['skipped'][0]} / {res['skipped'][1]}"
    return [
        Row("layerwise", "training step, per-layer scaling", res["ratio"], ref,
            f"{detail}; fastest rounds {res['ratio_of_fastest']:.3f}, CPU time {res['cpu_ratio']:.3f}"),
        Row("layerwise", "training step, per-layer factors pinned at 1", res["pinned_ratio"], ref, detail),
    ]


def _controller(res: dict[str, float]) -> list[Row]:
    ref = "same fp8 policy, no controller"
    return [
        Row("controller", "training step, fp8 + Controller(every=10)", res["controller"], ref,
            f"fp8 step {res['fp8_step_ms']:.1f} ms, ctl.step {res['ctl_step_ms']:.3f} ms, "
            f"{int(res['host_reads'])} host reads between checks"),
        Row("controller", "aten ops per 10 steps, Controller", res["ops"], ref),
        Row("controller", "training step, promoted layers (shadow)", res["promoted"],
            "fallen-back fp8 layers, no controller"),
    ]


def _fp8_formats(res: dict[str, Any]) -> list[Row]:
    rows = []
    for recipe, r in res["recipes"].items():
        if r["step_ratio"] is None:  # blockwise: torchao's needs Triton
            rows.append(Row("fp8_formats", f"training step, fp8 {recipe}", r["vs_fp32"],
                            "fp32 step (no torchao CPU reference)", f"{r['mixprec_ms']:.1f} ms"))
            continue
        rows.append(Row("fp8_formats", f"training step, fp8 {recipe}", r["step_ratio"],
                        f"torchao {recipe} (emulated)", f"{r['mixprec_ms']:.1f} vs {r['torchao_ms']:.1f} ms"))
        rows.append(Row("fp8_formats", f"saved activations, fp8 {recipe}", r["saved_ratio"],
                        f"torchao {recipe}", f"{r['saved_activations'] / 2**20:.2f} MiB"))
    for recipe, r in res.get("fp4", {}).items():  # fp4 against the fp8 recipes' emulation
        rows.append(Row("fp8_formats", f"training step, fp4 {recipe}", r["vs_mxfp8"], "mixprec mxfp8 (emulated)",
                        f"{r['mixprec_ms']:.1f} ms; vs tensorwise {r['vs_tensorwise']:.2f}"))
    return rows


#: module name under ``benchmarks`` -> adapter of its ``run()`` result to rows.
def _fp8_fsdp(res: dict[str, Any]) -> list[Row]:
    rows = []
    for params, modes in res["results"].items():
        ref = f"FSDP2 all-gather in {params}"
        for mode, r in modes.items():
            if mode == "weight dtype":
                continue
            rows.append(Row("fp8_fsdp", f"all-gather bytes, {params} params, {mode}", r["gather_ratio"], ref,
                            f"{r['gather_bytes'] / 2**20:.2f} MiB per step and rank"))
            rows.append(Row("fp8_fsdp", f"training step, {params} params, {mode}", r["step_ratio"], ref,
                            f"{r['step_ms']:.1f} ms, {r['reduces']} all-reduces (2 gloo ranks)"))
    return rows


BENCHMARKS: dict[str, Callable[[Any], list[Row]]] = {
    "autocast_overhead": _autocast,
    "scaler_overhead": _scaler,
    "lowp_memory": _lowp,
    "diagnostics_overhead": _diagnostics,
    "fp8": lambda res: [Row(*row) for row in res["rows"]],
    "optim": lambda res: [Row(*row) for row in res["rows"]],
    "layerwise": _layerwise,
    "controller": _controller,
    "fp8_formats": _fp8_formats,
    "fp8_fsdp": _fp8_fsdp,
    "fp4": lambda res: [Row(*row) for row in res["rows"]],
    "fp4_cast": lambda res: [Row(*row) for row in res["rows"]],
}


def run_all(
    quick: bool = False,
    benchmarks: dict[str, Callable[[Any], list[Row]]] | None = None,
    package: str = "benchmarks",
    log: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True),
) -> tuple[list[Row], list[str]]:
    """Run each benchmark in turn; return ``(rows, problems)``, one problem line per failure.

    ``log`` gets progress lines (which benchmark runs, how long it took: wall time, and the CPU
    time of its worker process and the worker's children); problems are only
    returned, so that the caller reports each once.
    """
    rows: list[Row] = []
    problems: list[str] = []
    spawn = multiprocessing.get_context("spawn")  # a fresh interpreter (sys.path is passed on)
    for name, adapt in (BENCHMARKS if benchmarks is None else benchmarks).items():
        if importlib.util.find_spec(f"{package}.{name}") is None:
            problems.append(f"{package}.{name}: not available (ModuleNotFoundError: No module named "
                            f"'{package}.{name}')")
            continue
        log(f"running {name}{' (quick)' if quick else ''} ...")
        start = time.perf_counter()
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)  # the worker's, once it is reaped
        cpu_start = usage.ru_utime + usage.ru_stime
        try:
            with ProcessPoolExecutor(max_workers=1, mp_context=spawn) as pool:
                result = pool.submit(_run_one, package, name, quick).result()
        except ImportError as e:
            problems.append(f"{package}.{name}: not available ({type(e).__name__}: {e})")
            continue
        except NotMeasurable as e:
            log(f"  {name}: skipped ({e})")
            continue
        except Exception as e:  # one broken benchmark must not hide the others
            problems.append(f"{package}.{name}: failed ({type(e).__name__}: {e})")
            continue
        try:
            new = adapt(result)
        except Exception as e:
            problems.append(f"{package}.{name}: failed ({type(e).__name__}: {e})")
            continue
        cpu = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu_s = cpu.ru_utime + cpu.ru_stime - cpu_start
        log(f"  {name}: {time.perf_counter() - start:.1f} s ({cpu_s:.1f} s of CPU)")
        rows.extend(new)
    return rows, problems


def _run_one(package: str, name: str, quick: bool) -> Any:
    """``{package}.{name}.run(quick)``, in the worker process."""
    return importlib.import_module(f"{package}.{name}").run(quick=quick)


def format_table(rows: Sequence[Row], markdown: bool = False) -> str:
    """The rows as an aligned text table, or as a markdown table."""
    header = ("benchmark", "figure", "ratio", "reference", "detail")
    cells = [header] + [(r.benchmark, r.figure, f"{r.ratio:.3f}", r.reference, r.detail) for r in rows]
    if markdown:
        lines = ["| " + " | ".join(c) + " |" for c in cells]
        lines.insert(1, "|---|---|---:|---|---|")
        return "\n".join(lines)
    widths = [max(len(c[i]) for c in cells) for i in range(len(header))]
    lines = ["  ".join(x.rjust(w) if i == 2 else x.ljust(w) for i, (x, w) in enumerate(zip(c, widths))).rstrip()
             for c in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds and steps (noisier)")
    parser.add_argument("--markdown", action="store_true", help="print a markdown table")
    args = parser.parse_args(argv)
    rows, problems = run_all(quick=args.quick)
    print(format_table(rows, markdown=args.markdown))
    for line in problems:
        print(f"python -m benchmarks: error: {line}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
