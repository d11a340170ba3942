"""The harness's export programs: train a converted model while a ``Recorder`` records, export it,
and check every number written against references computed here from what the run itself fed
each layer (its own forward hooks), never from another mixprec run: a defect every run shares
(a margin ignored, the oldest windows kept, a scale not inverted) cannot pass by agreement.

References (compressed-tensors' and vLLM's definitions, docs/export.md):

* the recorded windows: per window of ``every`` optimizer steps, the max over its steps of each
  layer's input amax; the last ``keep`` windows kept;
* the rule's amax: the max (or the percentile, linear interpolation) of the last ``windows``
  windows, times ``margin``;
* fp8: ``input_scale = float32(amax / 448)``; ``weight_scale = 1 / s`` with
  ``s = float32(448 / amax(w))`` (per tensor or per output row) and
  ``weight = e4m3(clamp(w * s))``, bitwise; :func:`mixprec.export.load_static`'s layer computes
  ``linear(e4m3(clamp(x / input_scale)) * input_scale, weight * weight_scale, bias)``, bitwise;
* NVFP4: ``input_global_scale = float32(448 * 6 / amax)``; MXFP4: none (dynamic input scales).
"""

from __future__ import annotations

import copy
import math
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import mixprec
from _adv_profile import profile

pytest.importorskip("safetensors")
pytest.importorskip("compressed_tensors")


@dataclass(frozen=True)
class Format:
    """What an exported recipe writes, as data: its recipe name, the widths its blocks allow, the
    weight strategies it takes, and which input scale the export must write."""

    recipe: str
    widths: tuple[int, ...]
    strategies: tuple[str, ...]
    input_scale: str  # "fp8": input_scale; "nvfp4": input_global_scale; "none": dynamic


FORMATS = (
    Format("tensorwise", (16, 32), ("tensor", "channel"), "fp8"),
    Format("nvfp4", (16, 32), ("tensor",), "nvfp4"),
    Format("mxfp4", (32,), ("tensor",), "none"),
)


@dataclass(frozen=True)
class ExportProgram:
    fmt: Format
    width: int
    depth: int  # linears (the first and last stay high precision: convert's default selection)
    steps: int
    every: int  # Recorder(every=): steps per window
    keep: int  # Recorder(keep=): windows kept
    windows: int | None  # ScaleRule(windows=)
    percentile: float
    margin: float
    strategy: str
    drift: float  # the input is multiplied by drift ** step: the windows differ (no saturating activation)
    seed: int


@st.composite
def export_programs(draw: st.DrawFn) -> ExportProgram:
    fmt = draw(st.sampled_from(FORMATS))
    every = draw(st.integers(1, 2))
    closed = draw(st.integers(1, 5))  # windows closed; a partial one may follow
    steps = every * closed + draw(st.integers(0, every - 1))
    keep = draw(st.integers(1, max(1, closed - 1)))  # fewer kept than recorded, where there are several
    return ExportProgram(
        fmt, draw(st.sampled_from(fmt.widths)), draw(st.integers(3, 4)), steps, every, keep,
        draw(st.sampled_from([None, 1, 2, 8])), draw(st.sampled_from([100.0, 50.0])),
        draw(st.sampled_from([1.0, 1.25, 2.0])), draw(st.sampled_from(fmt.strategies)),
        draw(st.sampled_from([0.5, 0.8, 1.5, 2.0])), draw(st.integers(0, 2**16)))


def _train(p: ExportProgram) -> tuple[nn.Module, mixprec.export.Recorder, dict[str, list[float]]]:
    """The converted model trained for ``p.steps`` SGD steps under a Recorder; per layer, the
    input amax of each step, measured by this test's own hooks."""
    torch.manual_seed(p.seed)
    # linear layers only (each layer's input amax follows the data's drift, no saturating activation)
    model = mixprec.fp8.convert(nn.Sequential(*[nn.Linear(p.width, p.width) for _ in range(p.depth)]), p.fmt.recipe)
    seen: dict[str, list[float]] = {}
    step_amax: dict[str, float] = {}

    def hook(name: str):
        def pre(module: nn.Module, args: tuple) -> None:
            step_amax[name] = max(step_amax.get(name, 0.0), float(args[0].detach().abs().amax()))
        return pre

    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            module.register_forward_pre_hook(hook(name))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    rec = mixprec.export.Recorder(model, every=p.every, keep=p.keep)
    g = torch.Generator().manual_seed(p.seed)
    for step in range(p.steps):
        x = torch.randn(8, p.width, generator=g) * p.drift ** step
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        rec.step()
        for name, amax in step_amax.items():
            seen.setdefault(name, []).append(amax)
        step_amax.clear()
    return model, rec, seen


def _rule_amax(p: ExportProgram, per_step: list[float]) -> float:
    """The reference amax of one layer's input: windows of ``every`` steps (complete ones only),
    the last ``keep``, the last ``windows`` of those, max or percentile, times the margin."""
    n = len(per_step) // p.every
    history = [max(per_step[i * p.every:(i + 1) * p.every]) for i in range(n)][-p.keep:]
    if p.windows is not None:
        history = history[-p.windows:]
    h = np.asarray(history, dtype=np.float32)
    amax = float(h.max()) if p.percentile == 100 else float(np.percentile(h.astype(np.float64), p.percentile))
    return amax * p.margin


def _close(actual: float, expected: float, exact: bool) -> bool:
    return actual == expected if exact else math.isclose(actual, expected, rel_tol=1e-6)


@profile(fast_examples=8)
@given(p=export_programs())
def test_export_writes_the_scales_of_the_run(p: ExportProgram) -> None:
    model, rec, seen = _train(p)
    folder = Path(tempfile.mkdtemp(prefix="mixprec-adv-export-"))
    try:
        _check_export(p, model, rec, seen, folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _check_export(p: ExportProgram, model: nn.Module, rec: mixprec.export.Recorder, seen: dict[str, list[float]],
                  folder: Path) -> None:
    rule = mixprec.export.ScaleRule(windows=p.windows, percentile=p.percentile, margin=p.margin)
    out = mixprec.export.export(model, folder, stats=rec, rule=rule, weight_strategy=p.strategy)
    written = {**out.layers, **out.fp4}
    assert sorted(written) == [str(i) for i in range(1, p.depth - 1)], (sorted(written), out.kept)
    exact = p.percentile == 100  # (a percentile interpolates in float64: numpy's and torch's may differ in the last bit)
    for fqn, layer in written.items():
        amax = _rule_amax(p, seen[fqn])
        if p.fmt.input_scale == "fp8":
            expected = float(torch.tensor(max(amax, 1e-12), dtype=torch.float64).div(448.0).float())
            assert _close(float(layer.input_scale), expected, exact), (fqn, float(layer.input_scale), expected, seen[fqn])
            w = model.get_submodule(fqn).weight.detach().float()
            w_amax = w.abs().amax() if p.strategy == "tensor" else w.abs().amax(dim=1, keepdim=True)
            s = (448.0 / w_amax.double().clamp(min=1e-12)).float()
            assert torch.equal(layer.weight_scale.reshape(s.shape) if p.strategy == "channel" else layer.weight_scale,
                               s.reciprocal().reshape(-1, 1) if p.strategy == "channel" else s.reciprocal().reshape(1)), fqn
            q = (w * s).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
            assert torch.equal(layer.q.view(torch.uint8), q.view(torch.uint8)), fqn
        elif p.fmt.input_scale == "nvfp4":
            expected = float(torch.tensor(448.0 * 6.0, dtype=torch.float64).div(amax).float())
            assert _close(float(layer.input_global_scale), expected, exact), (fqn, float(layer.input_global_scale),
                                                                              expected, seen[fqn])
        else:
            assert layer.input_global_scale is None, fqn
    if p.fmt.input_scale != "fp8":
        return
    # mixprec's own static fp8 forward of the files written: the compressed-tensors definition
    served = mixprec.export.load_static(copy.deepcopy(model), folder)
    x = torch.randn(5, p.width, generator=torch.Generator().manual_seed(p.seed + 1))
    for fqn, layer in out.layers.items():
        mod = served.get_submodule(fqn)
        assert isinstance(mod, mixprec.export.StaticFloat8Linear), fqn
        xs, ws = layer.input_scale, layer.weight_scale
        xq = (x / xs).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).to(torch.float32) * xs
        ref = F.linear(xq, layer.q.to(torch.float32) * ws, mod.bias)
        assert torch.equal(mod(x), ref), fqn
