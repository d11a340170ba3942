"""What the Controller costs (issue 39): its measurements at four operand sizes, and its training
step against the same model's step without it, at four model sizes and on the demo's presets.

* ``measure``: one :func:`mixprec.control._ladder.measure` of an NVFP4 cast (as the probe takes
  it: ``sample`` = 4096 elements, with and without the Hadamard transform of weight-gradient
  operands) on operands of 64 to 32768 rows of 256, against the NVFP4 cast of the whole operand
  (:func:`mixprec.formats._fp4.quantize`, what the training step itself does to it). A
  measurement on a true sample costs about the same at every size: its ratio to the whole cast
  falls as the operand grows.
* ``fp4``: one training step of the demo's ``mixprec-fp4`` mode (every Linear NVFP4, a
  Controller per GEMM with ``max_loss_cost``) against ``mixprec-fp4-all`` (the same, no
  controller). ``fp8``: the demo's ``mixprec-fp8`` (tensorwise, a per-layer Controller) against
  the same fp8 policy alone (no controller, no guard).
* Each pair is timed after the controller's first windows: a throwaway model of each mode first
  trains one step (the process's first-call work, which would land on whichever model steps
  first: with ``--warm 0`` it read 2.8x on tiny's first step), then both models train :data:`WARM`
  steps (three windows: the first ones measure the loss costs on every step, later ones on the
  steps their plans name; ``--warm 60`` times the state after the cadences settle, where at width
  384 a window measures about a third as many forward costs as in steps 30-60:
  benchmarks/RESULTS.md) on the run's own batches, then whole windows of ``every`` steps,
  one step of each in turn, the order alternating (AB, BA, ...), on the next batches (the same
  for both). The figure is the ratio of the summed times (the controller measures on a few
  steps of each window, so a typical step hides its cost: the median per-step ratio is printed
  beside it) and the least and greatest window's, of wall time and of the thread's CPU time
  (``time.thread_time``: one thread, so the work itself, which a machine shared with other
  jobs stretches less than the wall clock).
* The fp4 Controller's figure splits in two: a third model, the Controller's choices at the
  end of the warm-up run fixed without it (:func:`frozen`: each layer's recipe per GEMM, as
  ``Policy.fp8(recipes=...)``), timed in the same rounds. Controlled / frozen is what the
  measurements cost; frozen / all-fp4 is what the precisions it chose cost (on CPU an emulated
  fp8 or bf16 GEMM can be cheaper than an emulated NVFP4 one; on a GPU with fp4 GEMMs, dearer).
* Model sizes: the demo's ``TransformerLM`` with 2 blocks of width 64, 128, 256, 384 (sequences
  of 64 tokens, batches of 8): what the controller costs should stay flat as the model grows.
  Headlines: the demo's ``tiny`` and ``small`` presets; with ``--llama STEPS``, the HF Llama of
  :mod:`benchmarks.controller_quality` over a whole run (:func:`llama_pair`), at the hidden sizes
  ``--llama-hidden`` lists (64, the quality benchmark's; 128, 256: where its per-call work weighs less).

The CPU (with its bf16/AMX flags) and the load average are printed before and after. One thread.

    .venv/bin/python benchmarks/controller_fp4.py [--quick] [--widths 64,128,256,384] [--presets tiny,small]
        [--warm 30] [--pairs fp4,fp8] [--llama STEPS] [--llama-hidden 64,128,256]
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._machine import machine  # noqa: E402
import mixprec  # noqa: E402
from mixprec.control._measure import measure  # noqa: E402
from mixprec.demo.alternate import pair_ratio  # noqa: E402
from mixprec.demo.corpus import batch_offsets, load_tokens, make_batch  # noqa: E402
from mixprec.demo.model import ModelConfig, TransformerLM, lm_loss  # noqa: E402
from mixprec.demo.modes import FP4_BACKEND, FP8_EVERY, MODES, Setup, _adamw  # noqa: E402
from mixprec.demo.settings import Settings  # noqa: E402
from mixprec.formats._fp4 import quantize  # noqa: E402
from mixprec.formats._recipe import Cast  # noqa: E402
from mixprec.formats._state import new_window  # noqa: E402

ROWS = (64, 1024, 8192, 32768)
COLS = 256
SAMPLE = 4096  # ControllerSettings.sample's default
#: steps each model trains before the timed windows: three windows of the demo's every=10
WARM = 30
#: the pairs: (what is timed, its reference), each a demo mode or the fp8 policy alone
PAIRS = {"fp4": ("mixprec-fp4", "mixprec-fp4-all"), "fp8": ("mixprec-fp8", "fp8-policy")}


def _median_s(fn: Any, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_costs(repeats: int = 9) -> list[dict[str, float]]:
    """Per operand size: the measurement's time (with and without Hadamard) and the whole cast's."""
    cast = Cast("e2m1", "1x16")
    out = []
    for rows in ROWS:
        x = torch.randn(rows, COLS, dtype=torch.bfloat16)
        window = new_window()
        plain = _median_s(lambda: measure(window, 0, x, cast, False, SAMPLE), repeats)
        rotated = _median_s(lambda: measure(window, 0, x, cast, False, SAMPLE, hadamard_seed=0), repeats)
        whole = _median_s(lambda: quantize(x, cast), repeats)
        out.append({"rows": rows, "measure_ms": plain * 1e3, "hadamard_ms": rotated * 1e3, "cast_ms": whole * 1e3})
    return out


def _setup(mode: str, model: torch.nn.Module, settings: Settings) -> Setup:
    if mode == "fp8-policy":  # mixprec-fp8's policy without its controller (and without a guard)
        return dataclasses.replace(MODES["mixprec-fp8-guard"].setup(model, settings, torch.device("cpu")),
                                   fp8_guard=None)
    return MODES[mode].setup(model, settings, torch.device("cpu"))


def _stepper(mode: str, settings: Settings) -> tuple[Callable[[torch.Tensor, torch.Tensor], None], Setup]:
    """One training step of a fresh model in ``mode`` (as ``mixprec.demo.train`` takes it), and its setup."""
    torch.manual_seed(settings.seed)
    model = TransformerLM(settings.model)
    setup = _setup(mode, model, settings)
    return _step_of(setup), setup


def _step_of(setup: Setup) -> Callable[[torch.Tensor, torch.Tensor], None]:
    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        setup.optimizer.zero_grad(set_to_none=True)
        with setup.autocast():
            loss = lm_loss(setup.model(x), y)
        loss.backward()
        setup.optimizer.step()
        if setup.fp8_controller is not None:
            setup.fp8_controller.step()

    return step


def frozen(setup: Setup, settings: Settings) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """A training step of a copy of ``setup``'s model (its weights, a fresh AdamW) whose layers
    run the recipes its Controller chose so far, fixed, with no Controller: the same GEMM
    precisions without the measurements (a layer whose three GEMMs are on the compute rung runs
    in the compute dtype)."""
    ctl, model = setup.fp8_controller, setup.model
    copy = TransformerLM(settings.model)
    copy.load_state_dict({k: v for k, v in model.state_dict().items() if k in copy.state_dict()})
    states = {name: rec.state for name, rec in ctl._layers.items()}
    recipes = {name: st.recipe for name, st in states.items() if not st.fallback and st.recipe is not None}
    names = "^(?:" + "|".join(re.escape(n) for n in recipes) + ")$"
    policy = mixprec.Policy.parse("compute=bf16").fp8(setup.fp8_recipe, names=names, first_last="fp8",
                                                     backend=FP4_BACKEND, recipes=recipes)
    fixed = Setup(copy, _adamw(copy.parameters(), settings), lambda: mixprec.autocast("cpu", policy=policy))
    return _step_of(fixed)


def steady_pair(pair: str, settings: Settings, train: torch.Tensor, windows: int, budget_s: float,
                warm: int = WARM) -> dict[str, Any]:
    """``pair`` (a key of :data:`PAIRS`) timed as the module says: ``warm`` untimed steps, then
    whole windows of ``FP8_EVERY`` steps (at least 1, at most ``windows``, stopping after
    ``budget_s`` seconds), one step of each model in turn, the order alternating. Returns the
    ratio of the two models' summed times (``ratio``, CPU time under ``cpu``; ``low``/``high``:
    the least and greatest window's), and under ``step`` the median per-step ratio: the typical
    step, which does not see the few steps of each window that measure more. The fp4 pair is
    timed against a third model too (:func:`frozen`: the Controller's choices at the end of the
    warm-up, without it; not with ``warm=0``): ``frozen["overhead"]`` (controlled / frozen, CPU time) is what the
    measurements cost, ``frozen["mix"]`` (frozen / reference) what the precisions it chose cost."""
    mode, reference = PAIRS[pair]
    steps_n = warm + windows * FP8_EVERY
    offsets = batch_offsets(len(train), steps_n, settings.batch_size, settings.model.seq_len, settings.seed)
    batches = [make_batch(train, o, settings.model.seq_len, torch.device("cpu")) for o in offsets]
    for name in (mode, reference):  # the process's first-call work (lazy imports, kernels' set-up): on no timed model
        _stepper(name, settings)[0](*batches[0])
    (step, setup), (ref_step, _) = _stepper(mode, settings), _stepper(reference, settings)
    steps = {mode: step, reference: ref_step}
    for x, y in batches[:warm]:
        for step in steps.values():
            step(x, y)
    if pair == "fp4" and warm > 0:  # (before its first step a Controller has chosen nothing to freeze)
        steps["frozen"] = frozen(setup, settings)
    times: dict[str, list[float]] = {name: [] for name in steps}
    cpu: dict[str, list[float]] = {name: [] for name in steps}
    names = list(steps)
    start = time.perf_counter()
    for round_, (x, y) in enumerate(batches[warm:]):
        for name in (names if round_ % 2 == 0 else names[::-1]):
            begin, begin_cpu = time.perf_counter(), time.thread_time()
            steps[name](x, y)
            times[name].append(time.perf_counter() - begin)
            cpu[name].append(time.thread_time() - begin_cpu)
        if (round_ + 1) % FP8_EVERY == 0 and time.perf_counter() - start > budget_s:
            break
    out = {**window_ratio(times[mode], times[reference]), "cpu": window_ratio(cpu[mode], cpu[reference]),
           "step": pair_ratio(cpu[mode], cpu[reference])}
    if "frozen" in cpu:
        out["frozen"] = {"overhead": window_ratio(cpu[mode], cpu["frozen"])["ratio"],
                         "mix": window_ratio(cpu["frozen"], cpu[reference])["ratio"]}
    return out


def llama_pair(steps: int, seed: int = 0, hidden: int = 64) -> dict[str, Any]:
    """The per-GEMM fp4 Controller on the HF Llama of :mod:`benchmarks.controller_quality` (at
    ``hidden``: :func:`~benchmarks.controller_quality.llama_hidden`; its ``controller`` config: the
    demo's limits, a quarter of the rows) against the same model all NVFP4 (``all-fp4``), a whole
    run of ``steps`` from its first step, one step of each in turn (the order alternating), after a
    throwaway step of each (the process's first-call work).
    Returns :func:`window_ratio` of the CPU times over the whole run, over its first 3 windows
    (``first``) and over the rest (``later``), and the Controller's ``stats()``."""
    from benchmarks import controller_quality as quality

    train, _ = load_tokens()
    offsets = batch_offsets(len(train), steps, 8, quality.SEQ, seed)
    batches = [make_batch(train, o, quality.SEQ, torch.device("cpu")) for o in offsets]

    def stepper(config: str) -> tuple[Callable[[torch.Tensor, torch.Tensor], None], Any]:
        train_step, _, _, ctl = quality.trainer(f"llama-{hidden}", config, seed, steps)

        def step(x: torch.Tensor, y: torch.Tensor) -> None:
            train_step(x, y)
            if ctl is not None:
                ctl.step()

        return step, ctl

    for config in ("controller", "all-fp4"):
        stepper(config)[0](*batches[0])
    (controlled, ctl), (reference, _) = stepper("controller"), stepper("all-fp4")
    cpu: dict[str, list[float]] = {"controller": [], "all-fp4": []}
    for round_, (x, y) in enumerate(batches):
        pair = (("controller", controlled), ("all-fp4", reference))
        for name, step in (pair if round_ % 2 == 0 else pair[::-1]):
            begin = time.thread_time()
            step(x, y)
            cpu[name].append(time.thread_time() - begin)
    first = 3 * FP8_EVERY
    a, b = cpu["controller"], cpu["all-fp4"]
    out = {"whole": window_ratio(a, b), "first": window_ratio(a[:first], b[:first]), "stats": ctl.stats()}
    if len(a) >= first + FP8_EVERY:
        out["later"] = window_ratio(a[first:], b[first:])
    return out


def window_ratio(mode_s: list[float], reference_s: list[float], every: int = FP8_EVERY) -> dict[str, Any]:
    """The ratio of two alternated timings' sums over whole windows of ``every`` steps
    (``ratio``), the least and greatest window's (``low``, ``high``), the windows, and the
    reference's mean step (``reference_s``).

    Example:
        >>> r = window_ratio([1.0] * 9 + [11.0], [1.0] * 10)  # one costly step of ten
        >>> r["ratio"], r["windows"]
        (2.0, 1)
    """
    n = len(mode_s) // every * every
    per = [sum(mode_s[i:i + every]) / sum(reference_s[i:i + every]) for i in range(0, n, every)]
    return {"ratio": sum(mode_s[:n]) / sum(reference_s[:n]), "low": min(per), "high": max(per), "windows": len(per),
            "reference_s": sum(reference_s[:n]) / n}


def width_settings(width: int) -> Settings:
    """The demo's model with 2 blocks of ``width`` (4 heads, 64-token sequences, batches of 8)."""
    return Settings(model=ModelConfig(seq_len=64, d_model=width, n_layers=2, n_heads=4), steps=WARM, batch_size=8,
                    lr=1.25e-3)


def cpu_flags() -> str:
    """The CPU's bf16/AMX flags (``lscpu``), as ``avx512_bf16 amx_bf16 ...`` or ``none``."""
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("Flags")), [])
    return " ".join(f for f in flags if f in ("avx512_bf16", "amx_bf16", "amx_tile", "amx_int8")) or "none"


def _line(label: str, r: dict[str, Any]) -> str:
    c, step = r["cpu"], r["step"]
    fixed = r.get("frozen")
    split = "" if fixed is None else (f"; against its choices without it {fixed['overhead']:.3f}x (measurements), "
                                      f"those choices {fixed['mix']:.3f}x (precisions)")
    return (f"{label}: CPU time {c['ratio']:.3f}x (windows {c['low']:.3f}-{c['high']:.3f}), wall {r['ratio']:.3f}x; "
            f"median step {step['ratio']:.3f}x; {c['windows']} windows, {c['reference_s'] * 1e3:.0f} ms CPU per "
            f"reference step{split}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="widths 64,128, preset tiny, 1 window (a smoke run)")
    parser.add_argument("--widths", default=None, help="comma-separated model widths (default: 64,128,256,384)")
    parser.add_argument("--presets", default=None, help="comma-separated demo presets (default: tiny,small)")
    parser.add_argument("--windows", type=int, default=None, help="timed windows of 10 steps per pair (default 3)")
    parser.add_argument("--warm", type=int, default=WARM,
                        help=f"untimed steps before the timed windows (default {WARM}; later, most costs are far "
                             f"from their limits and measured in fewer windows: the steady state)")
    parser.add_argument("--budget", type=float, default=None,
                        help="seconds of timed windows per pair, after which no further window starts "
                             "(default 90; 5 with --quick): --warm 0 with many windows times a whole run")
    parser.add_argument("--pairs", default=",".join(PAIRS), help=f"comma-separated pairs (default {','.join(PAIRS)})")
    parser.add_argument("--llama", type=int, default=0, metavar="STEPS",
                        help="also time the fp4 pair on benchmarks/controller_quality.py's HF Llama over a whole run of "
                             "STEPS steps from its first (0: not)")
    parser.add_argument("--llama-hidden", default=None, metavar="SIZES",
                        help="comma-separated hidden sizes of the --llama runs, multiples of 64 (default 64: the "
                             "quality benchmark's; its MLP 11/4 of it)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    widths = [int(w) for w in (("64,128" if args.quick else "64,128,256,384") if args.widths is None else args.widths
                               ).split(",") if w]  # ("": none)
    presets = [p for p in (("tiny" if args.quick else "tiny,small") if args.presets is None else args.presets).split(",") if p]
    windows = args.windows or (1 if args.quick else 3)
    from benchmarks import controller_quality as quality

    if args.llama_hidden is not None and not args.llama:
        parser.error("--llama-hidden sets the widths of the --llama runs: pass --llama STEPS too")
    try:
        hiddens = [quality.llama_hidden(f"llama-{h}") for h in (args.llama_hidden or "64").split(",")]
    except ValueError as e:
        parser.error(f"--llama-hidden: {e}")
    budget = args.budget if args.budget is not None else 5.0 if args.quick else 90.0
    before = machine()
    print(f"CPU: {before['cpu']} (flags: {cpu_flags()}); load before: {before['load']}")
    print(f"measure (NVFP4, sample={SAMPLE}) against the whole operand's NVFP4 cast, {COLS} columns:")
    for r in measure_costs(3 if args.quick else 9):
        print(f"  {r['rows']:>6} rows: measure {r['measure_ms']:.3f} ms, with Hadamard {r['hadamard_ms']:.3f} ms, "
              f"whole cast {r['cast_ms']:.3f} ms ({r['measure_ms'] / r['cast_ms']:.3f}x)")
    train, _ = load_tokens()
    pairs = [p for p in args.pairs.split(",") if p]
    if unknown := set(pairs) - set(PAIRS):
        parser.error(f"--pairs: unknown {sorted(unknown)}; known: {', '.join(PAIRS)}")
    print(f"step ratios by model width (2 blocks, batch 8x64 tokens), after {args.warm} untimed steps, alternated:")
    for width in widths:
        for pair in pairs:
            mode, reference = PAIRS[pair]
            print("  " + _line(f"width {width}, {mode} / {reference}",
                               steady_pair(pair, width_settings(width), train, windows, budget, args.warm)), flush=True)
    print("headlines (demo presets):")
    for preset in presets:
        for pair in pairs:
            mode, reference = PAIRS[pair]
            print("  " + _line(f"{preset}, {mode} / {reference}",
                               steady_pair(pair, Settings.for_size(preset), train, windows, budget, args.warm)),
                  flush=True)
    for hidden in (hiddens if args.llama else []):
        r = llama_pair(args.llama, hidden=hidden)
        parts = [f"{k} {r[k]['ratio']:.3f}x ({r[k]['windows']} windows, {r[k]['low']:.3f}-{r[k]['high']:.3f})"
                 for k in ("whole", "first", "later") if k in r]
        print(f"  HF Llama (4 layers, hidden {hidden}), controller / all-fp4 from the first step, CPU time: "
              f"{'; '.join(parts)}; {r['whole']['reference_s'] * 1e3:.0f} ms CPU per reference step; stats {r['stats']}",
              flush=True)
    print(f"load after: {machine()['load']}")


if __name__ == "__main__":
    main()
