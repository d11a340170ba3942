"""Export an fp8-trained model for serving, with static scales from the training statistics.

* :func:`export`: write a compressed-tensors checkpoint (what vLLM and transformers load: fp8 e4m3
  weights with ``weight_scale``, static ``input_scale``, ``k_scale``/``v_scale``) or a torchao one.
* :class:`Recorder`: the per-window amax history of every linear layer's input and of the keys and
  values, recorded on the device during training (``rec.step()`` after each optimizer step).
* :func:`calibrate`: the same statistics from a short pass over a model trained without fp8.
* :class:`ScaleRule`: max (or a percentile) over the last N windows, times a margin.
* :func:`load_static`: mixprec's own fp8 inference forward of a compressed-tensors export.

compressed-tensors' and safetensors' code is imported only when an export runs (extra ``export``).
See docs/export.md.

Example:
    >>> import torch, tempfile, mixprec
    >>> model = mixprec.fp8.convert(torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(3)]))
    >>> with mixprec.export.Recorder(model) as rec:
    ...     model(torch.randn(4, 32)).sum().backward(); rec.step()
    >>> out = mixprec.export.export(model, tempfile.mkdtemp(), stats=rec)
    >>> sorted(out.layers), out.kept
    (['1'], {'0': 'not an fp8 layer', '2': 'not an fp8 layer'})
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path
from typing import Any

from torch import nn

from mixprec._modules import unwrap
from mixprec.export._atomic import MANIFEST, check_folder, staged
from mixprec.export._ct import write_compressed_tensors
from mixprec.export._layers import plan_layers
from mixprec.export._quant import Quantized, QuantizedLayer, quantize_model, quantize_weight
from mixprec.export._record import Recorder, calibrate, load_stats
from mixprec.export._rules import ScaleRule, static_scale
from mixprec.export._static import StaticFloat8Linear, fake_quantize, load_static
from mixprec.export._torchao import write_torchao
from mixprec.fp8 import Float8Recipe, as_recipe
from mixprec.fp8.internals import gathered_copy

__all__ = ["FORMATS", "KV_NOTE", "Quantized", "QuantizedLayer", "Recorder", "ScaleRule", "StaticFloat8Linear", "calibrate",
           "export", "fake_quantize", "load_static", "load_stats", "quantize_weight", "static_scale"]

FORMATS = ("compressed-tensors", "torchao")
#: why transformers' LOAD REPORT lists the k/v scales as UNEXPECTED (the CLI prints it; the manifest keeps it)
KV_NOTE = ("transformers reports k_scale/v_scale as UNEXPECTED when it loads this folder: its attention modules "
           "take `cache`, not the `past_key_values` compressed-tensors 0.20 looks for, so it runs the KV cache "
           "unquantized; vLLM reads them (docs/export.md)")


def export(model: nn.Module, folder: str | Path, format: str = "compressed-tensors", *, stats: object = None,
           rule: ScaleRule | None = None, layers: list[str] | None = None, weight_strategy: str = "tensor",
           kv_cache: bool = True, recipe: Float8Recipe | str | None = None) -> Quantized:
    """Write ``model`` to ``folder`` for serving in fp8 (fp4 layers in NVFP4/MXFP4), with static
    scales from its statistics.

    ``model``: trained under ``Policy.fp8`` or converted with ``mixprec.fp8.convert`` (its fp8
    layers export in fp8; those a Guard or Controller left in fallback stay in high precision and
    are listed in ``ignore``), or any model with ``layers=[...]`` naming the layers to quantize;
    one wrapped by torch.compile, DDP or DataParallel is written as the bare model (its names and
    tensors).
    ``stats``: a :class:`Recorder` (or :func:`load_stats`) whose windows give the static input
    scales and the KV scales through ``rule`` (default :class:`ScaleRule`: max over the last 8
    windows, margin 1); without it an fp8 layer's input scale comes from its ``LayerState``
    window and no KV scales are written (warning). ``weight_strategy``: ``"tensor"`` or
    ``"channel"`` (one scale per output row). A layer whose forward recipe casts its weight to fp4
    (``Float8Recipe.nvfp4()``, ``.mxfp4()``, a Controller's fp4 rung) exports in compressed-tensors'
    ``nvfp4-pack-quantized`` or ``mxfp4-pack-quantized`` format, in its own config group: each
    layer exports in the recipe it ran (a Controller's rung, a converted layer's recipe, the
    ``Policy.fp8`` recipe recorded on its ``LayerState``, else the one ``stats`` recorded);
    ``recipe``: that of layers with none (e.g. a model given ``layers=[...]``; default: fp8
    tensorwise); where it contradicts what a layer ran, the layer exports as it ran (warning).
    ``format``: ``"compressed-tensors"`` (any device) or ``"torchao"`` (a CUDA device of
    capability 8.9+). Also writes ``mixprec_export.json``: the
    rule, each fp8 layer's amax, scale and where the statistic came from, the kept layers and why.
    Layers a serving engine fuses (q/k/v, gate/up) export in one scheme (warning when that moves one).

    Atomic: the files are written into a hidden folder beside ``folder`` and renamed into place at
    the end; an exception or interrupt leaves ``folder`` as it was. An earlier export in ``folder``
    is replaced whole (files that are not checkpoint files, e.g. a tokenizer, are carried over); a
    ``folder`` holding another checkpoint's files (weights, shard index, configs) is refused.

    Returns the :class:`Quantized` numbers written. Raises ValueError for an unknown format or
    strategy, a layer without statistics, an inf or NaN statistic (the layer or attention named), a
    layer the format cannot store (named: a Conv1D, a tied weight, an fp4 layer for ``"torchao"``),
    or a ``folder`` under a file or holding another checkpoint (named).
    Host syncs: one per layer.
    """
    if format not in FORMATS:
        raise ValueError(f"export format must be one of {FORMATS}, got {format!r}")
    folder = Path(folder)
    check_folder(folder)  # before the work: staged() checks it again
    model = gathered_copy(unwrap(model))  # tensor parallelism: the full tensors (every rank calls export)
    plan = plan_layers(model, layers)
    q = quantize_model(model, plan, stats, rule, weight_strategy, kv_cache,
                       None if recipe is None else as_recipe(recipe))
    manifest = {
        "format": format, "rule": q.rule.describe(), "weight_strategy": q.strategy,
        "layers": {n: {"input_amax": l.input_amax, "input_scale": float(l.input_scale), "statistic": l.source}
                   for n, l in q.layers.items()},
        "kept": q.kept,
        "kv_scales": {a: {k: float(v) for k, v in s.items()} for a, s in q.kv_scales.items()},
        "kv_statistics": q.kv_sites,
    }
    if q.kv_scales and format == "compressed-tensors":
        manifest["kv_scales_note"] = KV_NOTE
    if q.fp4:
        manifest["fp4_layers"] = {n: {"format": l.format, "input_amax": l.input_amax, "statistic": l.source}
                                  for n, l in q.fp4.items()}
    with staged(folder) as tmp:
        if format == "compressed-tensors":
            write_compressed_tensors(model, tmp, q)
        else:
            write_torchao(model, tmp, q)
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, allow_nan=False) + "\n")
    return q


class _CallableModule(types.ModuleType):
    """``mixprec.export(...)`` is :func:`export`; ``mixprec.export.calibrate`` etc. stay attributes."""

    def __call__(self, *args: Any, **kwargs: Any) -> Quantized:
        return export(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
