"""The numbers an export writes: fp8 weights with their scales, static input scales, KV scales."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from mixprec.export._fp4 import Fp4Layer, contradicts, forward_recipe, quantize_fp4, recipe_format
from mixprec.export._layers import LayerPlan, fused_groups, kv_sources, linear_layers, weight_out_in
from mixprec.export._rules import ScaleRule, check_finite_amax, has_statistics
from mixprec.fp8 import Cast, Float8Recipe, layer_state
from mixprec.fp8.internals import INPUT, cast_to_fp8

__all__ = ["QuantizedLayer", "Quantized", "quantize_weight", "quantize_model"]

STRATEGIES = ("tensor", "channel")


def quantize_weight(weight: torch.Tensor, strategy: str = "tensor") -> tuple[torch.Tensor, torch.Tensor]:
    """mixprec's own fp8 e4m3 cast of an ``(out, in)`` weight: ``(q, weight_scale)``, where
    ``q = clamp(w * s)`` with mixprec's current scale ``s = 448 / amax`` (per tensor, or per output
    channel for ``"channel"``) and ``weight_scale = 1 / s`` (float32, ``(1,)`` or ``(out, 1)``): the
    dequantization factor compressed-tensors, vLLM and ``torch._scaled_mm`` multiply by.

    Example:
        >>> q, s = quantize_weight(torch.tensor([[1.0, -2.0]]))
        >>> q.dtype, s
        (torch.float8_e4m3fn, tensor([0.0045]))
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"weight strategy must be one of {STRATEGIES}, got {strategy!r}")
    cast = Cast("e4m3fn", "tensor" if strategy == "tensor" else "row")
    q, scale, _ = cast_to_fp8(weight.detach(), cast, -1, False)
    inv = scale.reciprocal()
    return q, inv.reshape(1) if strategy == "tensor" else inv.reshape(-1, 1)


@dataclass
class QuantizedLayer:
    """One fp8 layer of an export: ``q`` ``(out, in)`` e4m3, ``weight_scale``, ``input_scale`` ``(1,)``."""

    q: torch.Tensor
    weight_scale: torch.Tensor
    input_scale: torch.Tensor
    input_amax: float
    source: str  # where the input statistic came from


@dataclass
class Quantized:
    """Everything an export writes besides the untouched tensors: ``layers`` in fp8, ``fp4`` layers
    (NVFP4/MXFP4), ``kept`` ones (high precision, with the reason)."""

    layers: dict[str, QuantizedLayer]
    kept: dict[str, str]
    kv_scales: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    kv_sites: dict[str, str] = field(default_factory=dict)  # "<attention>:k" -> where it was measured
    strategy: str = "tensor"
    rule: ScaleRule = field(default_factory=ScaleRule)
    fp4: dict[str, Fp4Layer] = field(default_factory=dict)


def _series(stats: Any) -> dict[str, torch.Tensor]:
    if stats is None:
        return {}
    if not hasattr(stats, "series"):
        raise TypeError(f"export: stats must be a mixprec.export.Recorder (or what load_stats read), got {type(stats).__name__}")
    return stats.series()


def quantize_model(model: nn.Module, plan: LayerPlan, stats: Any = None, rule: ScaleRule | None = None,
                   strategy: str = "tensor", kv_cache: bool = True, recipe: Float8Recipe | None = None) -> Quantized:
    """The fp8 (or fp4: NVFP4, MXFP4, by the layer's forward recipe) weights and static scales of
    the ``plan``'s layers.

    Input scales: ``rule`` over the layer's recorded windows (``stats``, a :class:`Recorder`),
    else over the single window of its fp8 ``LayerState`` (the input amax since the last Guard
    check). Each layer exports in the recipe it ran (:func:`forward_recipe`, else the one
    ``stats`` recorded); ``recipe``: that of layers with none (warning where it contradicts one).
    Layers a serving engine fuses share one scheme (:func:`_unify_fused`) and one input scale.
    KV scales: ``rule`` over the windows of the keys and values, when ``stats`` has them.

    Raises ValueError naming the layer when neither holds a nonzero amax for it, or naming the layer
    or attention when the rule's amax is inf or NaN (:func:`check_finite_amax`). Warns when the
    model has attention layers and no KV statistics (a serving engine then uses a KV scale of 1.0).
    One host sync per layer.
    """
    rule = rule or ScaleRule()
    series = _series(stats)
    linears = linear_layers(model)
    kept = dict(plan.kept)
    for fqn, why in (getattr(stats, "fallback", None) or {}).items():  # saved statistics: why it was kept
        if kept.get(fqn) == "not an fp8 layer":
            kept[fqn] = why
    recipes = _recipes(linears, plan.fp8, getattr(stats, "recipes", None) or {}, recipe)
    scheme = {fqn: recipe_format(r) for fqn, r in recipes.items()} | {fqn: "kept" for fqn in kept}
    groups = _unify_fused(linears, scheme, kept, recipes)
    history = {fqn: _input_history(linears[fqn], series.get(f"{fqn}:input")) for fqn in scheme if scheme[fqn] != "kept"}
    for group in groups:  # one input, one static input scale: the max over the shards' (vLLM takes the max)
        hists = [history[n][0] for n in group if n in history]
        if len(hists) == len(group) and all(h is not None and h.shape == hists[0].shape for h in hists):
            shared = torch.stack(hists).amax(0)
            for n in group:
                history[n] = (shared, history[n][1])
    layers, fp4 = {}, {}
    done: set[str] = set()
    by_layer = {n: g for g in groups for n in g}
    for fqn in plan.fp8:
        if scheme[fqn] == "kept" or fqn in done:
            continue
        hist, source = history[fqn]
        if scheme[fqn] != "fp8":
            members = by_layer.get(fqn, (fqn,))
            fp4.update(quantize_fp4(members, recipes[fqn], [weight_out_in(linears[n]) for n in members], hist,
                                    source, rule))
            done.update(members)
            continue
        if not has_statistics(hist):
            raise ValueError(f"export: no statistics for the input of layer {fqn!r}: record them during training "
                             f"with mixprec.export.Recorder, or run batches under mixprec.export.calibrate(model)")
        amax = rule.amax(hist)
        check_finite_amax(amax, f"the input of layer {fqn!r}", source)
        q, ws = quantize_weight(weight_out_in(linears[fqn]), strategy)
        layers[fqn] = QuantizedLayer(q.cpu(), ws.cpu(), rule.scale(hist), float(amax), source)
    kv: dict[str, dict[str, torch.Tensor]] = {}
    sites: dict[str, str] = {}
    sources = kv_sources(model)
    recorded_sites = getattr(stats, "kv_sites", {})
    if kv_cache and recorded_sites is None and any(f"{s.attention}:{s.which}" in series for s in sources):
        warnings.warn("export: these statistics were saved by a mixprec that measured the keys before RoPE (no "
                      "'kv_sites' in the file): no k_scale/v_scale written; record them again with "
                      "mixprec.export.Recorder (or calibrate) to have KV scales", stacklevel=3)
    elif kv_cache:
        for src in sources:
            name = f"{src.attention}:{src.which}"
            hist = series.get(name)
            if has_statistics(hist):
                check_finite_amax(rule.amax(hist), f"the {'keys' if src.which == 'k' else 'values'} of attention "
                                  f"{src.attention!r}", "recorded windows")
                kv.setdefault(src.attention, {})[f"{src.which}_scale"] = rule.scale(hist.cpu())
                sites[name] = recorded_sites.get(name, src.site)
        if sources and not kv:
            warnings.warn("export: no key/value statistics recorded (record them with mixprec.export.Recorder or "
                          "calibrate): no k_scale/v_scale written, a serving engine's fp8 KV cache then uses 1.0",
                          stacklevel=3)
    return Quantized(layers, kept, kv, sites, strategy, rule, fp4)


def _recipes(linears: dict[str, nn.Module], names: tuple[str, ...], recorded: dict[str, Float8Recipe],
             asked: Float8Recipe | None) -> dict[str, Float8Recipe | None]:
    """Each layer's export recipe: the one it ran (:func:`forward_recipe`, else the one the saved
    statistics recorded for it), else ``asked``, else None (fp8). Warns when ``asked`` contradicts
    what a layer ran (the layer exports as it ran)."""
    out, against = {}, []
    for fqn in names:
        ran = forward_recipe(linears[fqn]) or recorded.get(fqn)
        out[fqn] = ran if ran is not None else asked
        if ran is not None and asked is not None and contradicts(ran, asked):
            against.append(f"{fqn} ran {ran.name}")
    if against:
        warnings.warn(f"export: recipe={asked.name!r} contradicts what {len(against)} layers ran "
                      f"({', '.join(against[:4])}{' ...' if len(against) > 4 else ''}): they export in the format "
                      f"they ran; recipe= applies only to layers that recorded none", stacklevel=4)
    return out


#: a fused group takes its most precise member's scheme
_PRECISION = {"kept": 3, "fp8": 2, "nvfp4": 1, "mxfp4": 0}


def _unify_fused(linears: dict[str, nn.Module], scheme: dict[str, str], kept: dict[str, str],
                 recipes: dict[str, Float8Recipe | None]) -> list[tuple[str, ...]]:
    """Give every group of layers a serving engine fuses (:func:`fused_groups`) one scheme, its most
    precise member's (high precision, then fp8, NVFP4, MXFP4), updating ``scheme``, ``kept`` and
    ``recipes`` in place with a warning naming the layers moved; an fp4 group takes its first
    member's recipe (warning when the members' weight casts differ). Returns the groups."""
    groups = fused_groups(list(linears))
    for group in groups:
        formats = {n: scheme[n] for n in group}
        target = max(formats.values(), key=_PRECISION.__getitem__)
        moved = [n for n in group if formats[n] != target]
        if moved:
            lead = next(n for n in group if formats[n] == target)
            says = ", ".join(f"{n.rpartition('.')[2]} {f}" for n, f in formats.items())
            warnings.warn(f"export: {', '.join(group)} are fused into one layer by serving engines (vLLM refuses "
                          f"shards of one fused layer in different schemes), and they ran as {says}: "
                          f"{', '.join(moved)} export as {'high precision' if target == 'kept' else target}, "
                          f"as {lead} does", stacklevel=4)
            for n in moved:
                scheme[n] = target
                if target == "kept":
                    kept[n] = f"fused with {lead} (kept: {kept[lead]})"
                else:
                    recipes[n] = recipes[lead]
        if target in ("nvfp4", "mxfp4"):
            casts = {recipes[n].weight for n in group}
            if len(casts) > 1:
                warnings.warn(f"export: {', '.join(group)} (fused by serving engines) ran with different fp4 "
                              f"weight casts {sorted(map(str, casts))}: they export with {group[0]}'s "
                              f"({recipes[group[0]].weight})", stacklevel=4)
            for n in group:
                recipes[n] = recipes[group[0]]
    return groups


def _input_history(module: nn.Module, recorded: torch.Tensor | None) -> tuple[torch.Tensor | None, str]:
    """The input's window amaxes (on the CPU) and where they came from: the recorded windows, else the
    one window of the layer's ``LayerState``; None when neither exists."""
    if has_statistics(recorded):
        return recorded.cpu(), "recorded windows"
    st = layer_state(module, create=False)
    return (st.window_amax(INPUT).detach().cpu() if st is not None else None), "fp8 LayerState (one window)"
