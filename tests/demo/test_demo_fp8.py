"""The demo's fp8 modes with a guard (``mixprec-fp8-guard``, ``mixprec-fp8-rowwise-guard``): they
train through ``Policy.fp8``, record the layers' fp8 statistics, report fallbacks, and draw the fp8
figure (the controller modes: tests/demo/test_demo_controller.py)."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from torch import nn

from mixprec import fp8
from mixprec.demo import modes
from mixprec.demo.model import ModelConfig, TransformerLM
from mixprec.demo.modes import MODES, Mode
from mixprec.demo.report import format_table, write_report
from mixprec.demo.results import DemoResult, fp8_summary, format_fp8
from mixprec.demo.settings import Settings
from mixprec.demo.train import run_demo, run_mode

CPU = torch.device("cpu")
MICRO = ModelConfig(seq_len=16, d_model=32, n_layers=1, n_heads=2)
FP8_MODES = ("mixprec-fp8-guard", "mixprec-fp8-rowwise-guard")


def micro(steps: int, seed: int = 0) -> Settings:
    return Settings(model=MICRO, steps=steps, batch_size=2, lr=3e-3, seed=seed, eval_batches=1)


@pytest.fixture(scope="module")
def fp8_demo(data: tuple[torch.Tensor, torch.Tensor]) -> DemoResult:
    """fp32 and both fp8 modes, 12 steps (one full guard window of 10 and a partial one), 2 seeds."""
    return run_demo(micro(steps=12), ["fp32", *FP8_MODES], CPU, seeds=2)


def test_fp8_modes_are_registered_with_their_recipes() -> None:
    assert MODES["mixprec-fp8"].cpu_cost > MODES["mixprec-bf16"].cpu_cost
    torch.manual_seed(0)
    for name, recipe in zip(FP8_MODES, ("tensorwise", "rowwise")):
        setup = MODES[name].setup(TransformerLM(MICRO), micro(1), CPU)
        assert isinstance(setup.fp8_guard, fp8.Guard) and setup.fp8_guard.every == modes.FP8_EVERY
        assert setup.fp8_recipe == recipe and setup.scaler is None
        assert isinstance(setup.optimizer, torch.optim.AdamW)


def test_fp8_runs_record_statistics_of_the_selected_layers(fp8_demo: DemoResult) -> None:
    # the layers the policy selects: every eligible Linear but the first and the last
    expected = fp8.select_layers(TransformerLM(MICRO), (nn.Linear,), None, "keep")
    assert expected == ["blocks.0.proj", "blocks.0.fc", "blocks.0.out"]
    assert not fp8_demo.of("fp32")[0].fp8
    for name, recipe in zip(FP8_MODES, ("tensorwise", "rowwise")):
        for run in fp8_demo.of(name):
            trace = run.fp8
            assert trace["recipe"] == recipe and trace["every"] == 10 and trace["fallbacks"] == []
            assert trace["steps"] == [10, 12] and list(trace["layers"]) == expected
            for layer in expected:
                assert set(trace["layers"][layer]) == {"input", "weight", "grad_output"}
                for operand, series in trace["layers"][layer].items():
                    assert set(series) == {"amax", "underflow", "saturated", "nonfinite"}
                    assert all(len(v) == 2 for v in series.values())
                    # the layer ran fp8 in both windows: finite, nonzero amax, no inf/NaN
                    assert all(0 < a < float("inf") for a in series["amax"]), (layer, operand)
                    assert series["nonfinite"] == [0.0, 0.0]
                    assert all(0 <= u < 0.05 for u in series["underflow"])
    # the same seed trains the same in both fp8 modes up to the first fp8 cast: different recipes
    # give different losses, while fp8 and fp32 start from the same first loss
    first = {name: fp8_demo.of(name)[0].losses for name in ("fp32", *FP8_MODES)}
    assert first["mixprec-fp8-guard"] != first["mixprec-fp8-rowwise-guard"]
    assert abs(first["mixprec-fp8-guard"][0] - first["fp32"][0]) < 0.01


def test_fp8_modes_are_deterministic(data: tuple[torch.Tensor, torch.Tensor]) -> None:
    for name in FP8_MODES:
        a, b = (run_mode(name, micro(steps=3, seed=5), CPU, data=data) for _ in range(2))
        assert a.losses == b.losses and a.eval_loss == b.eval_loss and a.fp8 == b.fp8, name


def test_fp8_summary_compares_final_loss_with_fp32(fp8_demo: DemoResult) -> None:
    summary = fp8_summary(fp8_demo)
    assert list(summary) == list(FP8_MODES)
    for name in FP8_MODES:
        vs = summary[name]["final_vs_base"]
        diffs = [a.final_loss - b.final_loss for a, b in zip(fp8_demo.of(name), fp8_demo.of("fp32"))]
        assert vs["difference"] == pytest.approx(sum(diffs) / 2)
        assert vs["difference_spread"] == pytest.approx(abs(diffs[0] - diffs[1]) / 2**0.5)
        fp32 = [r.final_loss for r in fp8_demo.of("fp32")]
        assert vs["tolerance"] == pytest.approx(abs(fp32[0] - fp32[1]) / 2**0.5)  # fp32's spread over the seeds
        assert vs["within"] == (vs["difference"] <= vs["tolerance"])  # a loss below fp32's is within
        worst = summary[name]["worst_underflow"]
        assert worst["layer"] in summary[name]["layers"] and worst["seed"] in (0, 1)
    lines = format_fp8(fp8_demo)
    assert lines[0].startswith("mixprec-fp8-guard (tensorwise, 3 fp8 layers): no layer fell back over 2 seeds; in fp8 100.0% of layer-steps; final loss ")
    vs = fp8_summary(fp8_demo)["mixprec-fp8-guard"]["final_vs_base"]
    assert f"seed by seed: {'within' if vs['within'] else 'NOT within'} fp32's spread {vs['tolerance']:.4f})" in lines[0]
    assert format_table(fp8_demo).splitlines()[-2:] == lines


def test_report_draws_the_fp8_figure(fp8_demo: DemoResult, tmp_path) -> None:
    pytest.importorskip("matplotlib")
    paths = write_report(fp8_demo, tmp_path)
    assert paths["fp8"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads(paths["results"].read_text())
    assert set(data["fp8"]) == set(FP8_MODES)
    figure = next(f for f in data["figures"] if f["name"] == "fp8")
    assert set(figure["data"]["series"]) == set(FP8_MODES)
    assert figure["data"]["series"]["mixprec-fp8-guard"] == fp8_demo.of("mixprec-fp8-guard")[0].fp8
    assert "mixprec-fp8-guard: no layer fell back over 2 seeds" in figure["caption"]
    rule = "when an operand's underflow exceeds 0.05 (dotted red line) or an operand has an inf/NaN;"
    assert rule in figure["caption"]
    assert 'src="fp8.png"' in paths["index"].read_text()
    # no fp8 mode, no fp8 figure
    plain = DemoResult(fp8_demo.settings, "cpu", {}, fp8_demo.of("fp32"))
    assert "fp8" not in write_report(plain, tmp_path / "plain") and fp8_summary(plain) == {}


def test_a_layer_crossing_the_guard_falls_back_and_is_reported(
    data: tuple[torch.Tensor, torch.Tensor], monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    """A guard asking for a sampled output SQNR of 200 dB (more than fp8 gives) moves every fp8
    layer back to bf16 at the first check; the run reports it and the layers record nothing after."""
    strict = Mode("fp8-strict", "fp8 with an impossible SQNR floor", (),
                  modes._setup_fp8("tensorwise", min_sqnr_db=200.0))
    monkeypatch.setitem(MODES, "fp8-strict", strict)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = run_demo(micro(steps=12), ["fp32", "fp8-strict"], CPU, seeds=1)
    run = result.of("fp8-strict")[0]
    names = ["blocks.0.proj", "blocks.0.fc", "blocks.0.out"]
    falls = run.fp8["fallbacks"]
    assert [f["layer"] for f in falls] == sorted(names)
    assert all(f["operand"] == "output" and f["statistic"] == "sqnr_db" and f["step"] == 10 for f in falls)
    assert all(f["value"] < 200.0 for f in falls) and run.fp8["thresholds"]["min_sqnr_db"] == 200.0
    messages = [str(w.message) for w in caught if issubclass(w.category, fp8.Float8FallbackWarning)]
    assert len(messages) == 3 and all("falls back to the compute dtype at step 10" in m for m in messages)
    for layer in names:  # in bf16 after the fallback: the second window saw no fp8 cast
        assert [s["amax"][1] for s in run.fp8["layers"][layer].values()] == [0.0, 0.0, 0.0]
    line = format_fp8(result)[0]
    assert line.startswith("fp8-strict (tensorwise, 3 fp8 layers): 3 fallback(s) to bf16: "
                           "blocks.0.fc at step 10 (output sqnr_db = ")
    assert "< 200)" in line and "; in fp8 83.3% of layer-steps; " in line
    # each layer ran fp8 on steps 0-9 of 12, then bf16
    assert run.fp8["fp8_steps"] == dict.fromkeys(names, 10) and run.fp8["fp8_fraction"] == 10 / 12
    assert line.endswith("one seed: no verdict, --seeds 3 measures the spread)")  # no spread from one seed
    assert fp8_summary(result)["fp8-strict"]["final_vs_base"]["within"] is None
    pytest.importorskip("matplotlib")
    caption = next(f for f in json.loads(write_report(result, tmp_path)["results"].read_text())["figures"]
                   if f["name"] == "fp8")["caption"]
    assert "fp8-strict: the guard moved blocks.0.fc at step 10 (output sqnr_db" in caption
    assert "or the sampled output SQNR falls below 200 dB;" in caption
