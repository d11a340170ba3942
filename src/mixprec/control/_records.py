"""A Controller's layer records as plain data: the entries of its ``state_dict`` (written and
checked), the metadata a rank that has not run a layer decides with, its log as CSV, and the scale
each layer's gradient carried (what the loss cost divides out). Pure functions of records and
settings: the Controller's shell (:mod:`mixprec.control._controller`) calls them."""

from __future__ import annotations

import csv
import dataclasses
import io
import math
import os
import warnings
from typing import Any, Mapping

import torch
from torch import nn

from mixprec._modules import clean_name
from mixprec._scaled import Scaled, note_of
from mixprec.control._backward import TERMS, BackwardCost
from mixprec.control._cost import load_pool
from mixprec.control._ladder import GEMMS, Decision, LayerRecord
from mixprec.control._settings import LOW_RUNGS, RUNGS, ControllerSettings
from mixprec.control._trend import Trend
from mixprec.formats._fsdp import Float8AllGatherWeight
from mixprec.formats._grouped import GroupedExperts
from mixprec.formats._recipe import RECIPE_NAMES, Float8Recipe
from mixprec.formats._state import LayerState, layer_state

__all__ = ["all_gathered", "converted", "converted_experts", "grad_scale", "layer_data", "load_layer", "log_csv", "log_data",
           "parse_state_dict", "qualified", "start_rungs", "check_loss_scale", "warn_cost_blind",
           "warn_unscaled", "metadata", "detached_record", "flop_shares", "seen_compute", "untrack", "measures_backward", "set_measuring"]


def qualified(known: str, seen: str) -> str:
    """The name a layer's record keeps when the layer recorded as ``known`` is reached as
    ``seen`` (its name under the module called): ``seen`` when it qualifies ``known`` (the model
    called after one of its submodules), else ``known`` (a submodule called directly).

    Example:
        >>> qualified("attn.qkv", "blocks.0.attn.qkv"), qualified("blocks.0.attn.qkv", "attn.qkv")
        ('blocks.0.attn.qkv', 'blocks.0.attn.qkv')
    """
    return seen if known and seen.endswith("." + known) else known


def layer_data(settings: ControllerSettings, rec: LayerRecord, windows: bool = True) -> dict[str, Any]:
    """A layer's entry of ``Controller.state_dict()`` (without its open windows: ``windows=False``).

    .. warning:: with ``windows``, reads the device windows (a host sync).
    """
    ladder = settings.ladder
    data = {"rung": ladder[max(rec.rungs)], "clean": rec.clean, "switches": list(rec.switches),
            "trends": {key: [t.last, t.slope, list(t.recent)] for key, t in rec.trends.items()}}
    if settings.per_gemm:  # (a state_dict without them: the three GEMMs on "rung" together)
        data.update(gemms={g: ladder[r] for g, r in zip(GEMMS, rec.rungs)}, gemm_clean=list(rec.gemm_clean),
                    gemm_switches=[list(s) for s in rec.gemm_switches], stats_read=[list(k) for k in rec.stats_read],
                    backward_over=list(rec.back_over))
    if rec.cost is not None and (rec.cost_gap or rec.demoted_below is not None):  # (_estimate_gap)
        data["cost_gap"] = [rec.cost_gap, None if rec.demoted_below is None else list(rec.demoted_below)]
    if rec.cost is not None:  # (host data a decision reads: a peer's record takes it too, Controller._detached)
        data["loss_cost_plan"] = {"steps": list(rec.cost_plan), "variance": list(rec.cost_var),
                                  "now": list(rec.cost_now), "rung": rec.cost_rung,
                                  "cadence": [c.state() for c in rec.cost_cadence], "below": rec.cost_below,
                                  "pool": [[list(w) for w in p] for p in rec.cost_pool],
                                  "unresolved": list(rec.cost_unresolved), "over": rec.cost_over}
    if rec.backward is not None and not windows:  # (the same of the backward costs; with windows, in backward_cost)
        data["backward_plan"] = [[c.state() for c in rec.backward.cadence], [[list(w) for w in p] for p in rec.backward.pool]]
    if windows:
        data.update(state=rec.state.window.tolist(), shadow=rec.shadow.tolist(), range=rec.range.tolist(),
                    rounding_step=rec.state.rounding_step)
        if rec.gemm_windows is not None:
            data["gemm_windows"] = rec.gemm_windows.tolist()
        if rec.cost is not None:
            data["loss_cost"] = rec.cost.tolist()
        if rec.backward is not None:  # (its pending gradient is not kept: the gain of its update, once made, is)
            b = rec.backward
            (end_last, update), (gain, gained) = (float(b.end_last), b.settled_update()), b.settled_gain()
            data["backward_cost"] = [b.window.tolist(), gain.tolist(), [c.state() for c in b.cadence],
                                     [[list(w) for w in p] for p in b.pool], b.reach.state(),
                                     [b.end.tolist(), end_last if end_last > -math.inf else None,
                                      None if update is None else update.tolist()],
                                     None if gained is None else gained.tolist()]
    return data


def _cost_gap(saved: Any, rungs: int) -> tuple[float, tuple[int, float] | None]:
    """A saved ``cost_gap`` entry (:mod:`._estimate_gap`: the gap, the last demotion's rung and
    below estimate or None), checked. Raises ValueError for another shape or value."""
    gap, demoted = saved if isinstance(saved, (list, tuple)) and len(saved) == 2 else (None, None)
    ok = isinstance(gap, (int, float)) and not isinstance(gap, bool) and math.isfinite(gap) and gap >= 0
    if demoted is not None:
        ok = ok and (isinstance(demoted, (list, tuple)) and len(demoted) == 2 and isinstance(demoted[0], int)
                     and not isinstance(demoted[0], bool) and 0 <= demoted[0] < rungs
                     and isinstance(demoted[1], (int, float)) and math.isfinite(demoted[1]))
    if not ok:
        raise ValueError(f"Controller.load_state_dict: cost_gap must be [a finite gap >= 0, None or [a rung index "
                         f"below {rungs}, a finite loss cost]], got {saved!r}")
    return float(gap), None if demoted is None else (int(demoted[0]), float(demoted[1]))


def load_layer(settings: ControllerSettings, rec: LayerRecord, data: Mapping[str, Any]) -> None:
    """Put a layer's saved entry (:func:`layer_data`) into ``rec``: rungs, counters, trends and,
    when saved, its windows and fp4 call count.

    Raises ValueError for a rung the layer cannot run or below its floor, or a window of another shape.
    """
    ladder = settings.ladder
    gemms = dict(data.get("gemms", {})) if settings.per_gemm else {}
    names = [gemms.get(g, data["rung"]) for g in GEMMS]
    for name in names:
        rung = ladder.index(name)
        if not rec.allowed[rung]:
            raise ValueError(f"Controller.load_state_dict: a layer at rung {name!r}, whose blocks its "
                             f"features are not multiples of")
        if rung < rec.floor:
            raise ValueError(f"Controller.load_state_dict: a layer at rung {name!r}, below its floor "
                             f"{ladder[rec.floor]!r} (its recipe, or Controller.floor)")
    rec.rungs = [ladder.index(name) for name in names]
    rec.clean, rec.switches = int(data["clean"]), [int(s) for s in data["switches"]]
    if settings.per_gemm:
        rec.gemm_clean = [int(c) for c in data.get("gemm_clean", [rec.clean] * len(GEMMS))]
        rec.gemm_switches = [[int(s) for s in sw] for sw in data.get("gemm_switches", [rec.switches] * len(GEMMS))]
        read = data.get("stats_read", [[True] * len(GEMMS)] * 2)  # (saved before it was: every cast measured)
        if (not isinstance(read, (list, tuple)) or len(read) != 2
                or any(not isinstance(k, (list, tuple)) or len(k) != len(GEMMS) or any(not isinstance(v, bool) for v in k)
                       for k in read)):
            raise ValueError(f"Controller.load_state_dict: stats_read must be 2 lists of {len(GEMMS)} booleans, got {read!r}")
        rec.stats_read = [list(k) for k in read]
        over = data.get("backward_over", [0] * len(GEMMS))  # (saved before it was: none over)
        if (not isinstance(over, (list, tuple)) or len(over) != len(GEMMS)
                or any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in over)):
            raise ValueError(f"Controller.load_state_dict: backward_over must be {len(GEMMS)} counts (ints >= 0), "
                             f"got {over!r}")
        rec.back_over = list(over)
    if rec.cost is not None:
        rec.cost_gap, rec.demoted_below = _cost_gap(data.get("cost_gap", (0.0, None)), len(settings.ladder))
    for key, (last, slope, recent) in data["trends"].items():
        if key in rec.trends:  # (a whole-layer record's operand trends are no GEMM's)
            rec.trends[key] = Trend(last, slope, tuple(recent))
    windows = ((rec.state.window, "state"), (rec.shadow, "shadow"), (rec.range, "range"),
               (rec.gemm_windows, "gemm_windows"), (rec.cost, "loss_cost"))
    for target, key in windows:
        if key not in data or target is None:  # a peer's record (Controller._detached): the windows stay empty
            continue
        t = torch.tensor(data[key], dtype=torch.float32)
        if key == "loss_cost" and target.shape[-1] - 2 <= t.shape[-1] < target.shape[-1]:  # saved before the squared estimates, or the index sums
            t = torch.cat([t, t.new_zeros(*t.shape[:-1], target.shape[-1] - t.shape[-1])], -1)
            t[:, 6] = (t[:, 4] - 1).clamp(min=0) / 2 * t[:, 3]  # (the window so far as flat: no rise read into it)
        if t.shape != target.shape:
            raise ValueError(f"Controller.load_state_dict: a window of shape {tuple(t.shape)}, expected "
                             f"{tuple(target.shape)}")
        target.copy_(t)
    plan = data.get("loss_cost_plan")
    if plan is not None and rec.cost is not None:  # (saved before the plan was: every step, as that code measured)
        rec.cost_plan, rec.cost_rung = list(plan["steps"]), int(plan["rung"])
        rec.cost_var = [v if v is None or isinstance(v, list) else [v] for v in plan["variance"]]  # (one, before)
        for r, now in enumerate(plan["now"]):
            rec.cost_gate[r].fill_(bool(now))
        rec.cost_now = [bool(n) for n in plan["now"]]
        for cadence, saved in zip(rec.cost_cadence, plan.get("cadence", ())):  # (saved before it was: every window)
            cadence.load(saved)
        rec.cost_below = bool(plan.get("below", True))
        rec.cost_pool = load_pool(plan.get("pool", ([], [])))  # (saved before it was: none yet)
        unresolved = plan.get("unresolved", [False, False])  # (saved before it was: none)
        if not isinstance(unresolved, (list, tuple)) or len(unresolved) != 2 or any(type(u) is not bool for u in unresolved):
            raise ValueError(f"Controller.load_state_dict: a loss-cost plan's 'unresolved' must be 2 booleans, got {unresolved!r}")
        rec.cost_unresolved = list(unresolved)
        over = plan.get("over", 0)  # (saved before it was: none)
        if type(over) is not int or over < 0:
            raise ValueError(f"Controller.load_state_dict: a loss-cost plan's 'over' must be a count (an int >= 0), got {over!r}")
        rec.cost_over = over
    if "backward_cost" in data and settings.max_backward_cost is not None:
        rec.backward = rec.backward or BackwardCost(rec.state.device)
        window, gain, *later = data["backward_cost"]  # (cadences, pools, end slopes: saved before they were, none)
        window = torch.tensor(window, dtype=torch.float32)
        if window.shape[-1] == TERMS:  # (saved before the shrink term was apart: in the first-order one)
            window = torch.cat([window[..., :1], torch.zeros_like(window[..., :1]), window[..., 1:]], -1)
        for target, saved in zip((rec.backward.window, rec.backward.gain), (window, torch.tensor(gain, dtype=torch.float32))):
            if saved.shape != target.shape:
                raise ValueError(f"Controller.load_state_dict: a backward_cost window of shape {tuple(saved.shape)}, "
                                 f"expected {tuple(target.shape)}")
            target.copy_(saved)
        _load_end(rec.backward, later[3] if len(later) > 3 else None)
        rec.backward.gained = _gained(later[4] if len(later) > 4 else None, rec.backward.gain.device)
        for target, saved in zip(rec.backward.cadence, later[0] if later else ()):
            target.load(saved)
        rec.backward.pool = load_pool(later[1], len(rec.backward.pool)) if len(later) > 1 else [[] for _ in rec.backward.pool]
        rec.backward.reach.load(later[2] if len(later) > 2 else None)
        rec.backward.loaded()
    elif "backward_plan" in data and settings.max_backward_cost is not None:  # (a peer's: its cadences and pools)
        rec.backward = rec.backward or BackwardCost(rec.state.device)
        cadences, pools = data["backward_plan"]
        for target, saved in zip(rec.backward.cadence, cadences):
            target.load(saved)
        rec.backward.pool = load_pool(pools, len(rec.backward.pool))
    if "state" in data and "rounding_step" in data:  # (saved before the count was: the model's state_dict's, or 0)
        rec.state.rounding_step = int(data["rounding_step"])


def _gained(saved: Any, device: torch.device) -> torch.Tensor | None:
    """A saved made update's ``[gain, 1]`` the next forward adds (None: none, or saved folded into the window's)."""
    if saved is not None and (not isinstance(saved, (list, tuple)) or len(saved) != 2):
        raise ValueError(f"Controller.load_state_dict: a layer's backward_cost pending gain must be [gain, 1] or None, "
                         f"got {saved!r:.200}")
    return None if saved is None else torch.tensor(saved, dtype=torch.float32, device=device)


def _load_end(backward: BackwardCost, saved: Any) -> None:
    """Put a saved ``[end slope sums, last mean end slope or None, the update whose end slope
    the next backward reads or None]`` into ``backward`` (None: saved before end slopes were,
    none measured). Raises ValueError for anything else."""
    if saved is None:
        return
    try:
        sums, last, update = saved
        sums = torch.tensor(sums, dtype=torch.float32)
        last = -math.inf if last is None else float(last)
        update = None if update is None else torch.tensor(update, dtype=torch.float32, device=backward.end.device)
    except (TypeError, ValueError, RuntimeError):
        sums = None
    if sums is None or sums.shape != (2,) or not bool(torch.isfinite(sums).all()) or last != last or last == math.inf:
        raise ValueError(f"Controller.load_state_dict: a layer's backward_cost end slopes must be [[sum, count], "
                         f"last mean or None, update (a weight-shaped list) or None] as state_dict() saves them, "
                         f"got {saved!r:.200}")
    backward.end.copy_(sums)
    backward.end_last.fill_(last)
    backward.ready = update


def parse_state_dict(settings: ControllerSettings, state_dict: Mapping[str, Any]
                     ) -> tuple[int, list[Decision], dict[str, dict[str, Any]]]:
    """``(steps, log, {layer: entry})`` of a ``Controller.state_dict()``, the names without a
    wrapper's prefix, every rung checked against the ladder.

    Raises ValueError for anything but such a dict for the same ladder.
    """
    try:
        steps = state_dict["steps"]
        log = [Decision(**{**d, "layer": clean_name(d["layer"])}) for d in state_dict["log"]]
        layers = {clean_name(str(n)): dict(d) for n, d in state_dict["layers"].items()}
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise TypeError(steps)
        for d in layers.values():
            for rung in (d["rung"], *dict(d.get("gemms", {})).values()):
                if rung not in settings.ladder:
                    raise ValueError(f"rung {rung!r} is not on the ladder {settings.ladder}")
    except (KeyError, TypeError, AttributeError, ValueError) as exc:
        raise ValueError(f"Controller.load_state_dict expects the dict of Controller.state_dict() (steps, log, "
                         f"layers) for the same ladder: {exc}") from exc
    return steps, log, layers


def log_data(log: list[Decision]) -> list[dict[str, Any]]:
    """The log as ``state_dict()`` saves it (a whole layer's decision without its ``gemm``)."""
    return [{k: v for k, v in dataclasses.asdict(d).items() if k != "gemm" or v is not None} for d in log]


def log_csv(log: list[Decision], per_gemm: bool, path: str | os.PathLike[str] | None = None) -> str:
    """The log as CSV (columns: step, layer, operand, action, from, to, statistic, value,
    threshold, reason, and ``gemm`` under ``per_gemm``: empty for the whole layer); written to
    ``path`` when given. Returns the text."""
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(["step", "layer", "operand", "action", "from", "to", "statistic", "value", "threshold",
                     "reason"] + ["gemm"] * per_gemm)
    for d in log:
        writer.writerow([d.step, d.layer, d.operand, d.action, d.from_, d.to, d.statistic, repr(d.value),
                         repr(d.threshold), d.reason] + [d.gemm or ""] * per_gemm)
    text = buf.getvalue()
    if path is not None:
        with open(path, "w", encoding="utf-8", newline="") as f:
            f.write(text)
    return text


def grad_scale(rec: LayerRecord, loss_scale: float | torch.Tensor | None,
               scaled: Scaled | None) -> float | torch.Tensor:
    """The scale the gradient at ``rec``'s output carried this step: a GradScaler's note (``scaled``, the
    thread's last; the one the layer's backward took, :func:`~mixprec._scaled.note_of`, none for another
    model's loss; its loss scale times the layer's region's factors) with an explicit ``loss_scale`` in place
    of its loss scale; else ``loss_scale``, or 1."""
    if (scaled := note_of(scaled, *rec.scaled_by)) is None:  # (rec.scaled_by: noted by the probe)
        return 1.0 if loss_scale is None else loss_scale
    module = rec.module()
    carried = scaled.of(getattr(module, "weight", None) if module is not None else None)
    if loss_scale is None:
        return carried
    return carried / scaled.regions[0] * loss_scale  # (the factors are powers of 2: exact)


def all_gathered(module: nn.Module) -> bool:
    """Whether FSDP2 all-gathers ``module``'s weight in fp8 (``fp8.convert(...,
    fsdp_fp8_all_gather=True)``, sharded or not yet)."""
    weight = getattr(module, "weight", None)
    return isinstance(getattr(weight, "_local_tensor", weight), Float8AllGatherWeight)


def converted(module: nn.Module) -> bool:
    """Whether ``module`` is a layer :func:`mixprec.fp8.convert` made (``Float8Linear``,
    ``Float8Conv1D``): one that holds its own fp8 recipe and layer state."""
    return isinstance(getattr(module, "recipe", None), Float8Recipe) and layer_state(module, create=False) is not None


def converted_experts(modules: Mapping[str, nn.Module]) -> dict[str, tuple[nn.Module, Float8Recipe]]:
    """``{"<fqn>.w1[0]": (ExpertLayer, recipe), ...}``: each expert of each ``GroupedExperts`` of
    ``modules`` (``{fqn: module}``) with a recipe of its own (``fp8.convert``'s), named as a policy
    names it for its Controller: one layer per weight and expert."""
    return {f"{fqn}.{key}" if fqn else key: (layer, mod.recipe) for fqn, mod in modules.items()
            if isinstance(mod, GroupedExperts) and mod.recipe is not None
            for key, layer in mod.expert_layers().items()}


def start_rungs(settings: ControllerSettings, name: str, recipe: Float8Recipe, features: tuple[int, ...]
                ) -> tuple[int, int, tuple[bool, ...]]:
    """``(start, floor, allowed)`` of a layer named ``name`` that runs ``recipe`` and has
    ``features``: the rung it starts on (its recipe's), the lowest it may be demoted to (its
    recipe's, or ``settings.floor``), and per rung of the ladder whether it can run it (a block
    recipe needs features that are multiples of its blocks; the layer's own recipe it runs).

    Raises ValueError for a recipe that is not a named one, not on the ladder, or below the floor.
    """
    ladder, named = settings.ladder, [r for r in LOW_RUNGS if r in RECIPE_NAMES]
    if recipe.name not in named or Float8Recipe.from_name(recipe.name) != recipe:
        raise ValueError(f"Controller: layer {name!r}'s fp8 recipe {recipe.name!r} is not a named recipe "
                         f"({', '.join(named)}): a controller's rungs are named recipes; give the layer "
                         f"one of them, or leave the controller out")
    if recipe.name not in ladder:
        wanted = tuple(r for r in RUNGS if r in ladder or r == recipe.name)
        raise ValueError(f"Controller: layer {name!r}'s fp8 recipe {recipe.name!r} is not on the controller's "
                         f"ladder {ladder} (a layer starts on its ladder at its recipe): pass "
                         f"Controller(ladder={wanted!r})")
    start = ladder.index(recipe.name)
    floor = start if settings.floor is None else ladder.index(settings.floor)
    if floor > start:
        raise ValueError(f"Controller: layer {name!r}'s fp8 recipe {recipe.name!r} is below the controller's "
                         f"floor {settings.floor!r}; pass floor=None (each layer's recipe) or a rung at or below "
                         f"{recipe.name!r}")
    allowed = tuple(r not in LOW_RUNGS or i == start
                    or all(f % Float8Recipe.from_name(r).multiple == 0 for f in features)
                    for i, r in enumerate(ladder))
    return start, floor, allowed


def check_loss_scale(loss_scale: Any) -> None:
    """Raise ValueError unless ``loss_scale`` (``Controller.step``'s) is None, a positive finite number or a tensor."""
    if loss_scale is None:
        return
    if isinstance(loss_scale, bool) or not (isinstance(loss_scale, torch.Tensor) or (
            isinstance(loss_scale, (int, float)) and 0 < loss_scale < math.inf)):
        raise ValueError(f"Controller.step: loss_scale must be a positive finite number or a tensor (the "
                         f"scale the loss was multiplied by), or None, got {loss_scale!r}")


def warn_cost_blind(blind: list[str]) -> None:
    """Warn that the loss cost of the layers ``blind`` cannot be measured (FSDP2's fp8 all-gather)."""
    warnings.warn(f"fp8: Controller(max_loss_cost=...) cannot measure the loss cost of {blind}: FSDP2 "
                  f"all-gathers their weights in fp8 (fp8.convert(..., fsdp_fp8_all_gather=True)), so no "
                  f"rank holds the high-precision weight the cost's reference GEMM needs; their rungs follow "
                  f"their casts' statistics alone. Convert them without fsdp_fp8_all_gather to measure it",
                  UserWarning, stacklevel=3)


def warn_unscaled() -> None:
    """Warn that a loss cost under fp16 compute got no loss scale (the gradients it reads are scaled)."""
    warnings.warn("fp8: Controller(max_loss_cost=...) under fp16 compute got no loss_scale: the loss cost is "
                  "measured on the gradients backward computed, which a loss scaler multiplies (a "
                  "mixprec.GradScaler says its scale itself; another does not): pass "
                  "ctl.step(loss_scale=scaler.get_scale()) before scaler.update() (or loss_scale=1.0 "
                  "without a scaler)", UserWarning, stacklevel=3)


def metadata(settings: ControllerSettings, rec: LayerRecord) -> dict[str, Any]:
    """What a rank that has not run the layer of ``rec`` needs to decide as this one does
    (:func:`detached_record`): its record without the windows, its floor and allowed rungs."""
    return {**layer_data(settings, rec, windows=False), "floor": rec.floor, "allowed": rec.allowed, "size": rec.size,
            "order": rec.order}


def detached_record(settings: ControllerSettings, meta: Mapping[str, Any], data: Mapping[str, Any]) -> LayerRecord:
    """The record of a layer this rank has not run yet but a peer has (``meta``: the peer's
    :func:`metadata`): the rung, trends and counters of ``data`` (``meta`` itself, or this rank's
    loaded state of the layer), empty windows, no module yet."""
    rec = LayerRecord(None, LayerState(), settings.ladder.index(meta["rung"]), int(meta["floor"]),
                      tuple(meta["allowed"]), settings.per_gemm, settings.max_loss_cost is not None, int(meta.get("order", 0)))
    load_layer(settings, rec, data)
    rec.size = int(meta.get("size", 0))
    return rec


def flop_shares(settings: ControllerSettings, records: Mapping[str, LayerRecord]) -> dict[str, float]:
    """Under ``cost_scope="model"``, each layer's share of the controlled layers' GEMM work per
    row (``LayerRecord.size``: ``in_features * out_features``), what ``Check.for_layer`` shares the
    loss-cost limits out by; ``{}`` under ``"gemm"``. Equal shares while no size is known.

    Example:
        >>> from types import SimpleNamespace as R
        >>> s = ControllerSettings(max_loss_cost=1e-3, cost_scope="model")
        >>> flop_shares(s, {"a": R(size=32 * 64), "b": R(size=64 * 64 * 3)})
        {'a': 0.14285714285714285, 'b': 0.8571428571428571}
    """
    if settings.cost_scope == "gemm" or not records:
        return {}
    total = sum(r.size for r in records.values())
    return {n: r.size / total if total > 0 else 1 / len(records) for n, r in records.items()}


def seen_compute(records: Any) -> torch.dtype | None:
    """The compute dtype the probes of ``records`` saw first (None: no probe ran yet). Traced code
    reads no controller state: its probes keep the dtype, the controller takes it from them."""
    return next((r.probe.dtype for r in records if r.probe is not None and r.probe.dtype is not None), None)


def untrack(rec: LayerRecord | None) -> None:
    """Stop measuring the layer of ``rec`` (another record took its name over), if any."""
    if rec is not None:
        rec.state.probe = None


def set_measuring(records: Any, measuring: bool, changed: bool, step: int, settings: ControllerSettings) -> None:
    """Whether the step after ``step`` feeds the shadows of ``records`` (``measuring``, written
    when ``changed``): the flag eager code reads, and each record's device copy that compiled
    code reads (no host sync); whether it measures each loss cost (``LayerRecord.cost_phase``,
    in windows of ``settings.every``); and the backward GEMMs' (``LayerRecord.backward_now``:
    :func:`measures_backward`)."""
    backward = measures_backward(step, measuring, settings)
    for rec in records:
        rec.scaled_by = [None, None]  # (the step after ``step`` notes its own: _probe)
        if changed:
            rec.measuring.fill_(measuring)
            rec.measuring_now = measuring
        rec.backward_now = backward
        rec.cost_phase(step, settings.every, settings.cost_row_share < 1)


def measures_backward(step: int, measuring: bool, settings: ControllerSettings) -> bool:
    """Whether the step after ``step`` (``measuring``: one that feeds the shadows) measures the
    backward GEMMs' costs: the first of the window's ``shadow_steps``, whose update's gain the
    next step reads (a layer first reached mid-window asks too: ``Controller._probe``).

    Example:
        >>> s = ControllerSettings(every=5, per_gemm=True, max_backward_cost=1e-5, shadow_steps=2)
        >>> [n + 1 for n in range(10) if measures_backward(n, n % 5 >= 3, s)]
        [4, 9]
    """
    every = settings.every
    return measuring and every - 1 - step % every == min(settings.shadow_steps, every) - 1
