"""The demo's per-layer scaling panel: ``mixprec-fp16-layerwise`` records each cut point's factor
per step in ``results.json`` and the report draws them (``layer_scales.png``)."""

from __future__ import annotations

import json
import math

import pytest

from mixprec.demo.model import ModelConfig
from mixprec.demo.report import write_report
from mixprec.demo.settings import Settings
from mixprec.demo.train import run_demo

pytest.importorskip("matplotlib")

TWO_BLOCKS = ModelConfig(seq_len=16, d_model=32, n_layers=2, n_heads=2)


def test_layerwise_mode_records_and_draws_the_factors_per_step(tmp_path) -> None:
    settings = Settings(model=TWO_BLOCKS, steps=5, batch_size=2, lr=3e-3, seed=0, eval_batches=1)
    result = run_demo(settings, ["mixprec-fp16", "mixprec-fp16-layerwise"], "cpu")
    plain, layered = result.modes
    assert plain.layer_scales == {}
    assert list(layered.layer_scales) == ["blocks.0", "blocks.1"]
    for series in layered.layer_scales.values():
        assert len(series) == 5 and all(math.log2(f) == int(math.log2(f)) for f in series)
    assert any(f != 1.0 for series in layered.layer_scales.values() for f in series)

    paths = write_report(result, tmp_path)
    assert paths["layer_scales"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads(paths["results"].read_text())
    assert data["modes"][1]["layer_scales"] == layered.layer_scales
    figure = next(f for f in data["figures"] if f["name"] == "layer_scales")
    assert figure["data"] == {"mixprec-fp16-layerwise": layered.layer_scales}
    assert "mixprec-fp16-layerwise: after 5 steps the factors run from 2^" in figure["caption"]
    assert 'src="layer_scales.png"' in paths["index"].read_text()


def test_no_panel_without_a_per_layer_mode(tmp_path) -> None:
    settings = Settings(model=TWO_BLOCKS, steps=2, batch_size=2, lr=3e-3, seed=0, eval_batches=1)
    paths = write_report(run_demo(settings, ["mixprec-fp16"], "cpu"), tmp_path)
    assert "layer_scales" not in paths and not (tmp_path / "layer_scales.png").exists()
