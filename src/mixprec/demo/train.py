"""Train the demo language model in every precision mode, side by side, from the same seeds.

Every mode starts from the same initial weights (``torch.manual_seed(seed)`` before the model is
built) and sees the same batches in the same order, so their loss curves differ only by numerics;
with several seeds every mode is trained once per seed. The modes are in
:mod:`mixprec.demo.modes`, the settings in :mod:`mixprec.demo.settings`, the result types in
:mod:`mixprec.demo.results`, the environment probing in :mod:`mixprec.demo.environment`.

Example:
    >>> settings = Settings.for_size("tiny", steps=5)
    >>> result = run_mode("fp32", settings, torch.device("cpu"))
    >>> len(result.losses)
    5
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import time
import warnings
from typing import Any, Iterator

import torch
from torch import nn

from mixprec import fp8
from mixprec.demo.corpus import batch_offsets, load_tokens, make_batch
from mixprec.demo.environment import environment
from mixprec.demo.estimate import Estimate
from mixprec.demo.flops import GemmCounter
from mixprec.demo.model import TransformerLM, lm_loss
from mixprec.demo.modes import DEFAULT_MODES, MODES, Mode, Setup, check_modes
from mixprec.demo.results import DemoResult, ModeResult, Progress
from mixprec.demo.settings import MAX_SEED, Settings, lr_factor
from mixprec.lowp import memory_bytes

__all__ = [
    # defined here
    "run_mode",
    "run_demo",
    # re-exported from the modules above (benchmarks/gpu.py and older code import them from here)
    "MODES",
    "DEFAULT_MODES",
    "MAX_SEED",
    "Mode",
    "Settings",
    "ModeResult",
    "DemoResult",
    "Progress",
    "check_modes",
]


@contextlib.contextmanager
def _saved_tensor_bytes(exclude: set[int]) -> Iterator[dict[int, int]]:
    """Collect ``{storage pointer: bytes}`` of every tensor autograd saves for backward."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in exclude:
            seen.setdefault(ptr, storage.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield seen

def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_mode(
    name: str,
    settings: Settings,
    device: torch.device,
    progress: Progress | None = None,
    data: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> ModeResult:
    """Train a fresh model in mode ``name`` and measure it.

    Args:
        name: a key of :data:`MODES`.
        settings: the run's settings; ``settings.seed`` fixes weights and batches.
        device: where to train.
        progress: told about the run every few steps (each report reads the loss: a host sync).
        data: ``(train, validation)`` byte tokens; the packaged corpus when None.

    Raises:
        ValueError, RuntimeError: see :func:`check_modes`.

    Peak activations are the bytes of the tensors saved for backward during the first step
    (distinct storages, parameters excluded) on CPU, and the growth of
    ``torch.cuda.max_memory_allocated`` over the first forward pass on CUDA (which resets the
    device's peak memory statistics). Throughput leaves out the first ``settings.untimed_steps``
    steps (warm-up and the activation measurement; see :attr:`Settings.timed_steps`), with the
    device synchronised at both ends of the timed span.
    """
    check_modes([name])
    mode = MODES[name]
    train, val = load_tokens() if data is None else data
    cfg = settings.model
    offsets = batch_offsets(len(train), settings.steps, settings.batch_size, cfg.seq_len, settings.seed)
    torch.manual_seed(settings.seed)
    model = TransformerLM(cfg).to(device)
    setup = mode.setup(model, settings, device)
    gemms = None if setup.fp8_policy is None else GemmCounter(
        model, setup.fp8_policy.fp8_rule.recipe_for, settings.tokens_per_step)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        setup.optimizer, lambda step: lr_factor(step, settings.steps)
    )
    report_every = max(1, settings.steps // 30)
    if progress is not None:
        progress.start(name, settings.steps)

    losses: list[torch.Tensor] = []
    fp8_windows: list[tuple[int, list[dict]]] = []
    scale_trace: list[tuple[torch.Tensor, torch.Tensor]] = []
    layer_trace: list[torch.Tensor] = []  # per-layer scaling: the cut points' factors per step
    activations = 0
    timed = settings.timed_steps
    _sync(device)
    wall_start = time.perf_counter()
    timed_from = wall_start
    for step in range(settings.steps):
        if step == timed.start and step:
            _sync(device)
            timed_from = time.perf_counter()
        x, y = make_batch(train, offsets[step], cfg.seq_len, device)
        setup.optimizer.zero_grad(set_to_none=True)
        measuring = step == 0
        if measuring and device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        param_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()} if measuring else set()
        hooks = _saved_tensor_bytes(param_ptrs) if measuring and device.type != "cuda" else contextlib.nullcontext({})
        with hooks as saved, setup.autocast():
            loss = lm_loss(model(x), y)
        if measuring:
            if device.type == "cuda":
                activations = torch.cuda.max_memory_allocated(device) - base
            else:
                activations = sum(saved.values())
        if setup.scaler is None:
            loss.backward()
            setup.optimizer.step()
        else:
            setup.scaler.scale(loss).backward()
            setup.scaler.step(setup.optimizer)
            setup.scaler.update()
        with warnings.catch_warnings():
            # a loss scaler that skips the first step never calls optimizer.step(): expected here
            warnings.filterwarnings("ignore", re.escape("Detected call of `lr_scheduler.step()`"), UserWarning)
            schedule.step()
        losses.append(loss.detach())
        if gemms is not None:
            gemms.record()  # the formats this step ran in, before a guard or controller switches
        if setup.fp8_guard is not None or setup.fp8_controller is not None:
            _fp8_step(model, setup, step, settings.steps, fp8_windows)
        if setup.scale_state is not None:
            scale_trace.append(setup.scale_state())
        factors = getattr(setup.scaler, "layer_scales_async", lambda: None)()
        if factors is not None:
            layer_trace.append(factors)
        if progress is not None and (step % report_every == 0 or step == settings.steps - 1):
            scale = scale_trace[-1][0].item() if scale_trace else None
            progress.update(step + 1, losses[-1].item(), scale)
    _sync(device)
    end = time.perf_counter()
    tokens_per_s = len(timed) * settings.tokens_per_step / max(end - timed_from, 1e-9)

    held = memory_bytes(model, setup.optimizer)
    memory = {key: held[key] for key in ("params", "grads", "master", "optimizer_state")}
    memory["activations"] = activations
    result = ModeResult(
        mode=name,
        summary=mode.summary,
        losses=torch.stack(losses).float().cpu().tolist(),
        eval_loss=_evaluate(model, setup, val, settings, device),
        tokens_per_s=tokens_per_s,
        memory=memory,
        activation_method="cuda peak over forward" if device.type == "cuda" else "saved for backward",
        wall_s=end - wall_start,
        seed=settings.seed,
    )
    if scale_trace:
        scales, skipped = (torch.stack(t).cpu() for t in zip(*scale_trace))
        result.scales = scales.float().tolist()
        result.skipped_steps = torch.nonzero(skipped.bool()).flatten().tolist()
    if setup.fp8_guard is not None or setup.fp8_controller is not None:
        result.fp8 = _fp8_trace(setup, fp8_windows, settings.steps)
    if gemms is not None:
        result.gemms = gemms.to_json()
    if layer_trace:
        names = list(setup.scaler.layer_scales())
        result.layer_scales = dict(zip(names, torch.stack(layer_trace).cpu().T.tolist()))
    if progress is not None:
        progress.finish(result)
    return result


def _fp8_step(model: nn.Module, setup: Setup, step: int, steps: int, windows: list[tuple[int, list[dict]]]) -> None:
    """After step ``step`` of an fp8 mode: at the end of each window of its guard or controller
    (and at the last step) read every fp8 layer's statistics (one host sync), then let the guard
    or controller judge the window (a check resets the windows)."""
    judge = setup.fp8_guard if setup.fp8_guard is not None else setup.fp8_controller
    if (step + 1) % judge.every == 0 or step == steps - 1:
        windows.append((step + 1, fp8.stats(model).to_list()))
    if setup.fp8_guard is not None:
        setup.fp8_guard.step(model)  # once per optimizer step: its step + 1
    else:
        setup.fp8_controller.step()


def _fp8_trace(setup: Setup, windows: list[tuple[int, list[dict]]], steps: int) -> dict[str, Any]:
    """The fp8 statistics of a run as series: per layer and operand, each statistic's worst value
    over each window (the window ending after ``steps[i]`` steps); the guard's fallbacks or the
    controller's decisions (``decisions``, each with ``from``/``to``); and per layer the training
    steps it ran in an fp8 format (``fp8_steps``), ``fp8_fraction`` their share of all layer-steps.

    A decision (or fallback) at step ``s`` takes effect from the step of index ``s`` on.
    """
    layers: dict[str, dict[str, dict[str, list[float]]]] = {}
    for _, rows in windows:
        for row in rows:
            series = layers.setdefault(row["layer"], {}).setdefault(row["operand"], {})
            # a window in which nothing was recorded (the layer fell back) reads as the last
            # closed one (``window == "last"``): this window saw no fp8 cast
            empty = row.get("window") == "last"
            for stat in _FP8_STATS:
                series.setdefault(stat, []).append(0.0 if empty else row[stat])
    trace: dict[str, Any] = {"recipe": setup.fp8_recipe, "steps": [end for end, _ in windows], "layers": layers}
    if setup.fp8_guard is not None:
        guard = setup.fp8_guard
        trace.update(
            every=guard.every, judge="guard",
            thresholds={"max_underflow": guard.max_underflow, "max_nonfinite": guard.max_nonfinite,
                        "max_saturated": guard.max_saturated, "min_sqnr_db": guard.min_sqnr_db},
            fallbacks=[dataclasses.asdict(d) for d in guard.decisions.values()], decisions=[],
        )
        switches = [(f["step"], f["layer"], False) for f in trace["fallbacks"]]
    else:
        ctl = setup.fp8_controller
        decisions = [{("from" if k == "from_" else k): v for k, v in dataclasses.asdict(d).items()} for d in ctl.log]
        trace.update(
            every=ctl.every, judge="controller", controller=ctl.config(),
            thresholds={"max_underflow": ctl.max_underflow, "max_nonfinite": ctl.max_nonfinite,
                        "max_saturated": None, "min_sqnr_db": None},
            fallbacks=[], decisions=decisions,
        )
        # a layer's precision is its forward GEMM's (a per-GEMM controller's backward switches
        # are counted exactly in ModeResult.gemms); an fp4 rung is low precision too
        switches = [(d["step"], d["layer"], _low_precision(d["to"])) for d in decisions
                    if d.get("gemm") in (None, "", "output")]
    trace["fp8_steps"] = fp8_steps(list(layers), switches, steps)
    total = len(layers) * steps
    trace["fp8_fraction"] = sum(trace["fp8_steps"].values()) / total if total else 0.0
    return trace


def _low_precision(rung: str) -> bool:
    """Whether the controller's rung name ``rung`` is an fp8 (``"fp8-tensorwise"``, ...) or fp4
    (``"nvfp4"``, ``"mxfp4"``) format rather than a high-precision dtype."""
    if rung.startswith("fp8"):
        return True
    try:
        return fp8.Float8Recipe.from_name(rung).fp4  # a controller names its fp4 rungs by recipe
    except ValueError:  # "bf16", "fp16", "fp32": not a recipe
        return False


def fp8_steps(layers: list[str], switches: list[tuple[int, str, bool]], steps: int) -> dict[str, int]:
    """Per layer, how many of the steps ``0 .. steps - 1`` it ran in an fp8 format, starting in
    one, given ``switches`` ``(step, layer, in fp8 after)`` in step order (each taking effect from
    the step of index ``step`` on).

    Example:
        >>> fp8_steps(["a", "b"], [(10, "a", False), (40, "a", True)], 100)
        {'a': 70, 'b': 100}
    """
    out = {}
    for layer in layers:
        count, since, on = 0, 0, True
        for step, name, after in switches:
            if name != layer or after == on:
                continue
            if on:
                count += min(step, steps) - since
            since, on = min(step, steps), after
        out[layer] = count + (steps - since if on else 0)
    return out


#: the statistics of ``fp8.stats`` the demo keeps (see docs/fp8.md)
_FP8_STATS = ("amax", "underflow", "saturated", "nonfinite")


@torch.no_grad()
def _evaluate(
    model: nn.Module, setup: Setup, val: torch.Tensor, settings: Settings, device: torch.device
) -> float:
    seq = settings.model.seq_len
    offsets = batch_offsets(len(val), settings.eval_batches, settings.batch_size, seq, settings.seed + 1)
    total = torch.zeros((), device=device)
    for row in offsets:
        x, y = make_batch(val, row, seq, device)
        with setup.autocast():
            total += lm_loss(model(x), y)
    return total.item() / settings.eval_batches


def run_demo(
    settings: Settings,
    modes: tuple[str, ...] | list[str] = DEFAULT_MODES,
    device: torch.device | str = "cpu",
    progress: Progress | None = None,
    seeds: int = 1,
    threads_reason: str = "",
    speed_sizes: tuple[str, ...] = (),
    budget_s: float | None = None,
) -> DemoResult:
    """Train every mode in ``modes`` in turn with the same settings, once per seed
    (``settings.seed``, ``settings.seed + 1``, ...); see :func:`run_mode`.

    ``progress`` is also told the expected duration before training and a corrected one after
    the first steps of each mode and after each run (:class:`mixprec.demo.estimate.Estimate`).
    After training, each mode that trained bitwise like its reference is timed against it in
    alternation (``DemoResult.pairs``; :mod:`mixprec.demo.alternate`).

    Args:
        speed_sizes: the model sizes of the speed panel (:func:`mixprec.demo.speed.measure`),
            timed before training (``settings.size`` first when among them); no panel when empty.
        budget_s: with it, ``seeds`` is the most: a seed after the first is trained only when it
            is expected to end within ``budget_s`` seconds of the start (expected: as long as the
            slowest seed so far); ``DemoResult.seeds_note`` says how many ran and why.

    A ``KeyboardInterrupt`` (Ctrl-C) ends the demo early: the result holds the runs that
    finished (those of a seed left incomplete are dropped when an earlier seed is complete) and
    ``interrupted`` says where it stopped; when no run had finished, the interrupt is raised again.

    Raises:
        ValueError: ``seeds < 1`` or past the last seed, an unknown speed size; see
            :func:`check_modes` (checked before anything trains).
        RuntimeError: see :func:`check_modes`.
        KeyboardInterrupt: interrupted before a run finished.
    """
    from mixprec.demo import speed

    check_modes(list(modes))
    if seeds < 1 or settings.seed + seeds > MAX_SEED:
        raise ValueError(f"seeds must be >= 1 with seed + seeds <= 2**63, got seed {settings.seed}, seeds {seeds}")
    device = torch.device(device)
    data = load_tokens()
    start = time.perf_counter()
    env = environment(device, threads_reason)
    result = DemoResult(settings=settings, device=str(device), environment=env, runs=[])
    note = progress.note if progress is not None else None
    try:
        if speed_sizes:
            result.speed = speed.measure(data[0], device, speed_sizes, note=note,
                                         first=settings.size if settings.size in speed_sizes else None)
        estimate = Estimate.start(settings, list(modes) * (1 if budget_s is not None else seeds), device, progress, env,
                                  result.speed)
        seed_s: list[float] = []  # wall time of each seed
        for offset in range(seeds):
            if offset and budget_s is not None:
                elapsed = time.perf_counter() - start
                if elapsed + max(seed_s) > budget_s:
                    result.seeds_note = (f"{offset} seed{'s' if offset > 1 else ''} of at most {seeds}: another "
                                         f"(about {max(seed_s):.0f} s) would end past the {budget_s:.0f} s budget")
                    break
                estimate.plan(list(modes))
            seeded = dataclasses.replace(settings, seed=settings.seed + offset)
            seed_start = time.perf_counter()
            for name in modes:
                result.runs.append(run_mode(name, seeded, device, estimate.watch(name), data))
            seed_s.append(time.perf_counter() - seed_start)
        else:
            if budget_s is not None:
                result.seeds_note = f"{seeds} seeds, the most, within the {budget_s:.0f} s budget"
        estimate.done()
        _time_identical_pairs(result, settings, device, data[0], note)
    except KeyboardInterrupt:
        if not result.runs:
            raise
        _keep_complete_seeds(result, list(modes))
    return result


def _time_identical_pairs(result: DemoResult, settings: Settings, device: torch.device, train: torch.Tensor,
                          note: Any) -> None:
    """For each mode that trained bitwise like its reference (every seed), time their steps in
    alternation (:func:`mixprec.demo.alternate.time_pair`): sequential runs differ by the load."""
    from mixprec.demo.alternate import pair_words, time_pair
    from mixprec.demo.results import checks

    for pair, verdict in checks(result).items():
        if not verdict.startswith("identical"):
            continue
        mode, reference = pair.split(" = ")
        result.pairs[pair] = time_pair(mode, reference, settings, device, train)
        if note is not None:
            note(f"{mode} against {reference}, steps timed in alternation: {pair_words(result.pairs[pair], reference)}")


def _keep_complete_seeds(result: DemoResult, modes: list[str]) -> None:
    """After an interrupt: say what finished, and drop the runs of an incomplete seed when an
    earlier seed is complete."""
    done = [r.mode for r in result.runs if r.seed == result.runs[-1].seed]
    last = result.runs[-1].seed
    if len(done) < len(modes) and last != result.runs[0].seed:
        result.runs = [r for r in result.runs if r.seed != last]
        result.interrupted = (f"during seed {last}: its finished runs ({', '.join(done)}) are left out so that "
                              "every seed has every mode")
    else:
        names = ", ".join(dict.fromkeys(r.mode for r in result.runs))
        missing = [m for m in modes if m not in done]
        result.interrupted = f"finished {names}" + (f"; not run: {', '.join(missing)}" if missing else "")
