"""The demo's speed panel: where mixed precision pays on this machine.

A few timed training steps (AdamW, one fixed batch) of fp32, ``torch.autocast`` bf16,
``torch.autocast`` fp16 and emulated fp8 (``mixprec.autocast`` with
``Policy.parse("compute=bf16").fp8("tensorwise")``) at the demo's model sizes, so the report
shows at which size a low-precision kind starts to beat fp32 here (the size the demo trains is
timed first, whatever the budget). The kinds are timed in turn,
round after round (the first round untimed: allocations, kernel selection, optimizer state);
each ratio is the median of the per-round ratios ``time / fp32 time``, so a machine whose load
changes during the panel still compares like with like. A size whose expected cost (from the
last timed size's, scaled by the floating-point work) does not fit what is left of the time
budget is skipped; the panel says so.

Example:
    >>> panel = {"threads": 1, "batch_size": 8, "sizes": [
    ...     {"size": "tiny", "ratio": {"bf16": 1.8}}, {"size": "base", "ratio": {"bf16": 0.62}}]}
    >>> crossover(panel, "bf16")
    'bf16 autocast is 1.6x faster than fp32 from the `base` size up; below it fp32 is faster (tiny 1.80x the time)'
"""

from __future__ import annotations

import contextlib
import statistics
import time
from typing import Any, Callable, ContextManager

import torch

import mixprec
from mixprec.demo.corpus import batch_offsets, make_batch
from mixprec.demo.estimate import step_work
from mixprec.demo.model import SIZES, TransformerLM, lm_loss

__all__ = ["KINDS", "kind_name", "SPEED_SIZES", "SPEED_BATCH", "SPEED_BUDGET_S", "measure", "crossover", "speed_sentence"]

#: What the panel times, with the words the report uses for each (fp8 is emulated on a CPU;
#: on CUDA it runs ``torch._scaled_mm`` where the GPU has fp8 units, sm89+).
KINDS: dict[str, str] = {"fp32": "fp32", "bf16": "bf16 autocast", "fp16": "fp16 autocast", "fp8": "fp8 (emulated)"}
#: The sizes it times (the demo's presets), the batch of every step, and its default time budget.
SPEED_SIZES: tuple[str, ...] = ("tiny", "small", "base")
SPEED_BATCH = 8
SPEED_BUDGET_S = 45.0
# a kind is faster (slower) than fp32 when its time ratio is below 1/_MARGIN (above _MARGIN)
_MARGIN = 1.1


def _autocast(kind: str, device: torch.device) -> Callable[[], ContextManager[Any]]:
    if kind == "fp32":
        return contextlib.nullcontext
    if kind == "fp8":
        policy = mixprec.Policy.parse("compute=bf16").fp8("tensorwise")
        return lambda: mixprec.autocast(device.type, policy=policy)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[kind]
    return lambda: torch.autocast(device.type, dtype=dtype)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_size(size: str, train: torch.Tensor, device: torch.device, rounds: int) -> dict[str, Any]:
    cfg = SIZES[size]
    x, y = make_batch(train, batch_offsets(len(train), 1, SPEED_BATCH, cfg.seq_len, 0)[0], cfg.seq_len, device)
    steps = {}
    for kind in KINDS:
        torch.manual_seed(0)
        model = TransformerLM(cfg).to(device)
        steps[kind] = (model, torch.optim.AdamW(model.parameters(), lr=1e-4), _autocast(kind, device))
    times: dict[str, list[float]] = {kind: [] for kind in KINDS}
    for round_ in range(rounds + 1):
        for kind, (model, opt, autocast) in steps.items():
            _sync(device)
            start = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            with autocast():
                loss = lm_loss(model(x), y)
            loss.backward()
            opt.step()
            _sync(device)
            if round_:  # round 0 warms up
                times[kind].append(time.perf_counter() - start)
    ratios = {kind: [t / f for t, f in zip(times[kind], times["fp32"])] for kind in KINDS}
    return {
        "size": size,
        "seconds": {kind: statistics.median(ts) for kind, ts in times.items()},
        "ratio": {kind: statistics.median(r) for kind, r in ratios.items()},
        "spread": {kind: (max(r) - min(r)) / statistics.median(r) for kind, r in ratios.items()},
    }


def measure(
    train: torch.Tensor,
    device: torch.device | str = "cpu",
    sizes: tuple[str, ...] = SPEED_SIZES,
    rounds: int = 3,
    budget_s: float = SPEED_BUDGET_S,
    note: Callable[[str], None] | None = None,
    first: str | None = None,
) -> dict[str, Any]:
    """Time every kind of :data:`KINDS` at each of ``sizes``, ``rounds`` timed rounds after one
    warm-up round, batches of :data:`SPEED_BATCH` sequences from ``train``; ``note`` is told each
    size's result.

    ``first`` (the size the demo trains, one of ``sizes``) is timed first, whatever the budget;
    then the other sizes, smallest first, each only when its expected cost (the last timed
    size's, scaled by the floating-point work) fits what is left of ``budget_s``.

    Returns ``{"device", "threads", "batch_size", "rounds", "budget_s", "seconds" (the panel's wall time),
    "sizes": [{"size", "seconds": {kind: median s/step}, "ratio": {kind: median time / fp32},
    "spread": {kind: (max - min) / median of the ratios}}, ...] (in the order of ``sizes``),
    "skipped": {size: why}}``.

    Raises:
        ValueError: an unknown size, ``first`` not among ``sizes``, or ``rounds < 1``.
    """
    unknown = [s for s in sizes if s not in SIZES]
    if unknown or rounds < 1 or (first is not None and first not in sizes):
        raise ValueError(f"sizes must be among {', '.join(SIZES)}, first among them and rounds >= 1, "
                         f"got {sizes}, first {first!r}, {rounds}")
    device = torch.device(device)
    start = time.perf_counter()
    out: dict[str, Any] = {"device": str(device), "threads": torch.get_num_threads(), "batch_size": SPEED_BATCH,
                           "rounds": rounds,
                           "budget_s": budget_s, "sizes": [], "skipped": {}}
    order = ([first] if first is not None else []) + [s for s in sizes if s != first]
    timed: dict[str, dict[str, Any]] = {}
    previous: tuple[str, float] | None = None  # (size, seconds of one round)
    for size in order:
        left = budget_s - (time.perf_counter() - start)
        if previous is not None:
            expected = previous[1] * step_work(SIZES[size], SPEED_BATCH) / step_work(SIZES[previous[0]], SPEED_BATCH)
            if expected * (rounds + 1) > left:
                out["skipped"][size] = (f"expected {expected * (rounds + 1):.0f} s, more than the "
                                        f"{max(left, 0):.0f} s left of the panel's {budget_s:.0f} s")
                if note is not None:
                    note(f"speed panel: {size} not timed ({out['skipped'][size]})")
                continue
        entry = _time_size(size, train, device, rounds)
        timed[size] = entry
        previous = (size, sum(entry["seconds"].values()))
        if note is not None:
            note(f"speed panel, {size}: " + ", ".join(
                f"{kind} {entry['ratio'][kind]:.2f}x" for kind in KINDS if kind != "fp32") + " the time of fp32")
    out["sizes"] = [timed[s] for s in sizes if s in timed]
    out["skipped"] = {s: out["skipped"][s] for s in sizes if s in out["skipped"]}
    out["seconds"] = time.perf_counter() - start
    return out


def kind_name(kind: str, device: str = "cpu") -> str:
    """The report's words for ``kind`` on ``device``: :data:`KINDS`, but plain "fp8" on CUDA."""
    return "fp8" if kind == "fp8" and device.startswith("cuda") else KINDS[kind]


def _times(entries: list[dict[str, Any]], kind: str) -> str:
    return ", ".join(f"{e['size']} {e['ratio'][kind]:.2f}x" for e in entries)


def crossover(panel: dict[str, Any], kind: str) -> str:
    """Where ``kind`` beats fp32 in ``panel`` (see :func:`measure`), in one computed phrase.

    Faster means a time ratio below 1/1.1, slower above 1.1; the sizes are those measured. A
    kind that is faster from some size up and not faster below it has a crossover; otherwise the
    phrase gives the ratio at every size.
    """
    name = kind_name(kind, panel.get("device", "cpu"))
    entries = [e for e in panel["sizes"] if kind in e["ratio"]]
    if not entries:
        return f"{name} was not measured"
    faster = [e["ratio"][kind] < 1 / _MARGIN for e in entries]
    slower = [e["ratio"][kind] > _MARGIN for e in entries]
    if all(faster):
        best = min(e["ratio"][kind] for e in entries)
        return f"{name} is faster than fp32 at every size measured (up to {1 / best:.1f}x: {_times(entries, kind)} the time)"
    if not any(faster):
        if all(slower):
            return f"{name} is slower than fp32 at every size measured ({_times(entries, kind)} the time)"
        return f"{name} is faster than fp32 at no size measured ({_times(entries, kind)} the time)"
    first = faster.index(True)
    if all(faster[first:]):
        at = entries[first]
        below = "fp32 is faster" if all(slower[:first]) else "fp32 is as fast or faster"
        return (f"{name} is {1 / at['ratio'][kind]:.1f}x faster than fp32 from the `{at['size']}` size up; "
                f"below it {below} ({_times(entries[:first], kind)} the time)")
    return f"{name} against fp32, no single crossover: {_times(entries, kind)} the time"


def speed_sentence(panel: dict[str, Any], device: str = "cpu") -> str:
    """The panel in one sentence (lower case, to follow other words): bf16's crossover, then
    fp16's and fp8's, with the threads and batch it was measured with, and the sizes skipped for
    time."""
    where = "this CPU" if device.startswith("cpu") else "this GPU"
    threads = panel["threads"]
    parts = [crossover(panel, kind) for kind in KINDS if kind != "fp32"]
    skipped = f"; not timed: {', '.join(panel['skipped'])} (time budget)" if panel["skipped"] else ""
    return (f"on {where} ({threads} thread{'s' if threads > 1 else ''}, batch {panel['batch_size']}, "
            f"time per training step, lower is faster): " + "; ".join(parts) + skipped + ".")
