"""The demo's fp4 modes (``mixprec-fp4``, ``-all``, ``-hand``): per layer and GEMM the FLOPs that
ran in each format (:mod:`mixprec.demo.flops`), the three side by side with a winner
(:mod:`mixprec.demo.fp4`), and the report's paragraph and figure. The end-to-end runs use fp8
recipes in the place of NVFP4 (the bookkeeping is the same); tests/demo/test_demo_fp4_modes.py
runs the NVFP4 modes themselves."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from mixprec import fp8
from mixprec.demo import modes
from mixprec.demo.flops import GEMMS, GemmCounter, gemm_kind, share, shares
from mixprec.demo.fp4 import FP4_TARGET, fp4_paragraph, fp4_summary
from mixprec.demo.model import ModelConfig
from mixprec.demo.modes import DEFAULT_MODES, FP4_LADDER, FP4_MODES, FP4_RECIPE, MODES, Mode
from mixprec.demo.report import write_report
from mixprec.demo.results import DemoResult, ModeResult
from mixprec.demo.settings import Settings
from mixprec.demo.train import run_demo
from mixprec.demo.verdict import verdict

CPU = torch.device("cpu")
MICRO = ModelConfig(seq_len=16, d_model=32, n_layers=1, n_heads=2)
# the micro model's Linear layers: (in, out) features, in the order of named_modules
SHAPES = {"blocks.0.qkv": (32, 96), "blocks.0.proj": (32, 32), "blocks.0.fc": (32, 128), "blocks.0.out": (128, 32),
          "head": (32, 256)}
ROWS = 2 * 16  # batch x sequence


def micro(steps: int, seed: int = 0) -> Settings:
    return Settings(model=MICRO, steps=steps, batch_size=2, lr=3e-3, seed=seed, eval_batches=1)


def test_the_fp4_modes_are_registered_opt_in_with_their_ladder() -> None:
    assert FP4_MODES == ("mixprec-fp4", "mixprec-fp4-all", "mixprec-fp4-hand")
    assert FP4_RECIPE == "nvfp4" and FP4_LADDER == ("nvfp4", "tensorwise", "rowwise", "compute")
    for name in FP4_MODES:
        assert name not in DEFAULT_MODES
        assert "fp8.Float8Recipe.nvfp4" in MODES[name].requires
        assert MODES[name].cpu_cost > MODES["mixprec-fp8"].cpu_cost


def _three(recipe: str, ladder: tuple[str, ...]) -> dict[str, Mode]:
    """The three fp4 modes' setups with ``recipe`` and ``ladder`` in the place of NVFP4's."""
    return {name: Mode(name, MODES[name].summary, (), modes._setup_fp4(first_last, controlled, recipe, ladder))
            for name, first_last, controlled in zip(FP4_MODES, ("fp8", "fp8", "keep"), (True, False, False))}


@pytest.fixture(scope="module")
def stand_in() -> DemoResult:
    """fp32 and the three fp4 modes with fp8 tensorwise in the place of NVFP4, 12 steps, 2 seeds."""
    saved = {name: MODES[name] for name in FP4_MODES}
    MODES.update(_three("tensorwise", ("tensorwise", "rowwise", "compute")))
    try:
        return run_demo(micro(steps=12), ["fp32", *FP4_MODES], CPU, seeds=2)
    finally:
        MODES.update(saved)


def _expected_flops(name: str) -> int:
    fan_in, fan_out = SHAPES[name]
    return 2 * ROWS * fan_in * fan_out


def _counts_from_log(decisions: list[dict], layer: str, gemm: str, start: str, steps: int) -> dict[str, int]:
    """The steps a GEMM ran in each format, from the controller's decisions (a decision at step
    ``s`` applies from the ``s``-th forward on; ``gemm`` None: the whole layer)."""
    counts, fmt, last = {"fp4": 0, "fp8": 0, "high": 0}, start, 0
    for d in sorted((d for d in decisions if d["layer"] == layer and d.get("gemm") in (gemm, None)),
                    key=lambda d: d["step"]):
        counts[fmt] += d["step"] - last
        fmt, last = "fp8" if d["to"].startswith("fp8") else "high", d["step"]
    counts[fmt] += steps - last
    return counts


def test_every_gemm_of_every_linear_is_counted_in_the_format_it_ran(stand_in: DemoResult) -> None:
    assert "gemms" in stand_in.of("fp32")[0].to_json() and not stand_in.of("fp32")[0].gemms
    for name in FP4_MODES:
        for run in stand_in.of(name):
            trace = run.gemms
            decisions = run.fp8.get("decisions") or []
            assert trace["steps"] == 12 and list(trace["layers"]) == list(SHAPES)
            assert not decisions or name == "mixprec-fp4"
            for layer, entry in trace["layers"].items():
                assert entry["flops_per_gemm"] == _expected_flops(layer)
                kept = name == "mixprec-fp4-hand" and layer in ("blocks.0.qkv", "head")
                for gemm in GEMMS:  # as the controller's log says (the others: all steps in one format)
                    assert entry["gemms"][gemm] == _counts_from_log(decisions, layer, gemm, "high" if kept else "fp8", 12)
            assert trace["fp4_share"] == 0.0
    total = sum(map(_expected_flops, SHAPES))
    hand = stand_in.of("mixprec-fp4-hand")[0].gemms
    assert hand["fp8_share"] == pytest.approx((total - _expected_flops("blocks.0.qkv") - _expected_flops("head")) / total)
    assert stand_in.of("mixprec-fp4-all")[0].gemms["fp8_share"] == 1.0


def _linear_step(model: nn.Module, policy: mixprec.Policy) -> None:
    x = torch.randn(ROWS, 32)
    with mixprec.autocast("cpu", policy=policy):
        loss = F.mse_loss(model(x).float(), torch.zeros(ROWS, 32))
    loss.backward()


def test_the_counter_reads_the_fallback_and_a_per_gemm_recipe() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 32))
    policy = mixprec.Policy.parse("compute=bf16").fp8("tensorwise")  # keeps "0" and "2"
    counter = GemmCounter(model, policy.fp8_rule.recipe_for, ROWS)
    _linear_step(model, policy)
    counter.record()
    assert counter.kinds("1") == dict.fromkeys(GEMMS, "fp8")
    assert counter.kinds("0") == counter.kinds("2") == dict.fromkeys(GEMMS, "high")
    state = fp8.layer_state(model[1])
    state.recipe = fp8.Float8Recipe.rowwise_with_gw_hp()  # what a controller's rung does: grad_weight high
    _linear_step(model, policy)
    counter.record()
    assert counter.kinds("1") == {"output": "fp8", "grad_input": "fp8", "grad_weight": "high"}
    state.recipe, state.fallback = None, True  # a guard's fallback: every GEMM in the compute dtype
    _linear_step(model, policy)
    counter.record()
    trace = counter.to_json()
    assert trace["layers"]["1"]["gemms"] == {"output": {"fp4": 0, "fp8": 2, "high": 1},
                                             "grad_input": {"fp4": 0, "fp8": 2, "high": 1},
                                             "grad_weight": {"fp4": 0, "fp8": 1, "high": 2}}
    assert trace["per_gemm"] == dict.fromkeys(GEMMS, 0.0)
    assert shares(trace, "gemm", "fp8") == {"output": 2 / 9, "grad_input": 2 / 9, "grad_weight": 1 / 9}
    assert share(trace, "fp8", layer="1") == 5 / 9 and share(trace, "high", layer="0") == 1.0
    with pytest.raises(ValueError, match="by must be"):
        shares(trace, "operand")


def test_gemm_kind() -> None:
    assert gemm_kind(fp8.Cast("e5m2", "row")) == "fp8" and gemm_kind(fp8.Cast("none")) == "high"
    assert gemm_kind(fp8.Cast("e2m1", "1x32")) == gemm_kind(fp8.Cast("e2m1", "16x16")) == "fp4"
    assert {g: gemm_kind(a) for g, (a, _) in fp8.Float8Recipe.nvfp4().gemms().items()} == dict.fromkeys(GEMMS, "fp4")


def _run(mode: str, seed: int, final: float, fp4: float) -> ModeResult:
    """A run whose final loss is ``final`` and whose one layer ran ``fp4`` of its steps in fp4."""
    steps = 100
    on = round(fp4 * steps)
    trace = {"steps": steps, "layers": {"a": {"flops_per_gemm": 8, "gemms": {
        g: {"fp4": on, "fp8": 0, "high": steps - on} for g in GEMMS}}}}
    trace.update(fp4_share=share(trace), fp8_share=0.0, per_gemm=shares(trace, "gemm"), per_layer=shares(trace, "layer"))
    return ModeResult(mode, "", [final] * 10, final, 1.0, {"params": 8}, "", seed=seed, gemms=trace if mode != "fp32" else {})


def _result(rows: dict[str, tuple[list[float], float]]) -> DemoResult:
    """``{mode: (final loss per seed, fp4 share)}`` as a demo result over those seeds."""
    runs = [_run(mode, seed, final, fp4) for mode, (finals, fp4) in rows.items() for seed, final in enumerate(finals)]
    return DemoResult(Settings.for_size("tiny", steps=10), "cpu", {}, runs)


def test_the_winner_is_the_fp4_mode_within_fp32s_spread_with_the_most_fp4() -> None:
    # fp32's spread over the seeds: 0.1
    result = _result({"fp32": ([2.0, 2.1, 2.2], 0.0), "mixprec-fp4": ([2.05, 2.15, 2.25], 0.8),
                      "mixprec-fp4-all": ([2.3, 2.4, 2.5], 1.0), "mixprec-fp4-hand": ([2.0, 2.1, 2.2], 0.75)})
    summary = fp4_summary(result)
    assert summary["tolerance"] == pytest.approx(0.1) and summary["seeds"] == 3
    entries = summary["modes"]
    assert [entries[m]["within"] for m in FP4_MODES] == [True, False, True]
    assert entries["mixprec-fp4"]["difference"] == pytest.approx(0.05)
    assert entries["mixprec-fp4"]["fp4_share"] == pytest.approx(0.8)
    assert entries["mixprec-fp4"]["per_gemm"] == pytest.approx(dict.fromkeys(GEMMS, 0.8))
    assert summary["winner"] == "mixprec-fp4"  # all-fp4 has more fp4 but is not within
    assert summary["criterion"]["met"] is True
    text = fp4_paragraph(result)
    assert "Wins: mixprec-fp4" in text and "meets the bar" in text and "NOT within" in text
    assert text in verdict(result)


def test_a_missed_bar_says_by_how_much() -> None:
    result = _result({"fp32": ([2.0, 2.1, 2.2], 0.0), "mixprec-fp4": ([2.2, 2.3, 2.4], 0.5),
                      "mixprec-fp4-hand": ([2.0, 2.1, 2.2], 0.7)})
    summary = fp4_summary(result)
    crit = summary["criterion"]
    assert crit["met"] is False and crit["within"] is False
    assert crit["excess"] == pytest.approx(0.1) and crit["short"] == pytest.approx(FP4_TARGET - 0.5)
    assert summary["winner"] == "mixprec-fp4-hand" and "mixprec-fp4-all" not in summary["modes"]
    text = fp4_paragraph(result)
    assert "misses the bar" in text and "0.1000 beyond the spread" in text and "10.0 points short" in text
    none = _result({"fp32": ([2.0, 2.1, 2.2], 0.0), "mixprec-fp4-all": ([3.0, 3.1, 3.2], 1.0)})
    assert fp4_summary(none)["winner"] is None and fp4_summary(none)["criterion"] is None
    assert "No fp4 mode ends within fp32's spread, so none wins." in fp4_paragraph(none)


def test_one_seed_gives_no_verdict_and_no_fp4_mode_no_paragraph() -> None:
    one = _result({"fp32": ([2.0], 0.0), "mixprec-fp4": ([2.0], 0.9)})
    summary = fp4_summary(one)
    assert summary["modes"]["mixprec-fp4"]["within"] is None and summary["winner"] is None
    assert summary["criterion"]["met"] is None
    assert "From one seed fp32's spread is unknown" in fp4_paragraph(one)
    plain = _result({"fp32": ([2.0, 2.1], 0.0), "mixprec-fp8": ([2.0, 2.1], 0.0)})
    assert fp4_summary(plain) == {} and fp4_paragraph(plain) is None
    assert not any(line.startswith("For fp4") for line in verdict(plain))


def test_the_report_shows_the_three_and_draws_the_fp4_figure(stand_in: DemoResult, tmp_path) -> None:
    pytest.importorskip("matplotlib")
    paths = write_report(stand_in, tmp_path)
    assert paths["fp4"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads(paths["results"].read_text())
    assert set(data["fp4"]["modes"]) == set(FP4_MODES) and data["fp4"]["seeds"] == 2
    assert data["runs"][1]["gemms"] == stand_in.runs[1].gemms
    paragraph = next(line for line in data["verdict"] if line.startswith("For fp4"))
    assert all(name in paragraph for name in FP4_MODES)
    figure = next(f for f in data["figures"] if f["name"] == "fp4")
    assert figure["data"]["mixprec-fp4-hand"]["head"] == dict.fromkeys(GEMMS, 0.0)
    assert 'src="fp4.png"' in paths["index"].read_text()


def test_the_benchmark_is_registered_and_tabulates_its_figures() -> None:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from benchmarks import fp4 as bench
    from benchmarks.run import BENCHMARKS

    result = _result({"fp32": ([2.0, 2.1, 2.2], 0.0), "mixprec-fp4": ([2.25, 2.35, 2.45], 0.5),
                      "mixprec-fp4-all": ([2.3, 2.4, 2.5], 1.0), "mixprec-fp4-hand": ([2.0, 2.1, 2.2], 0.75)})
    timing = {"ratio": 1.5, "low": 1.4, "high": 1.6, "rounds": 9}
    res = {"sizes": {"tiny": {"steps": 10, "summary": fp4_summary(result),
                              "finals": {m: {r.seed: r.final_loss for r in result.of(m)} for m in ("fp32", *FP4_MODES)},
                              "timing": {m: dict.fromkeys(bench.FP8_REFERENCES, timing) for m in FP4_MODES}}},
           "machine_before": {"cpu": "X", "load": "1"}, "machine_after": {"cpu": "X", "load": "2"}, "threads": 1,
           "seconds": 60.0}
    rows = BENCHMARKS["fp4"]({"rows": bench._rows(res)})
    assert [(r.figure, r.ratio) for r in rows] == [(f"training step, {m}, tiny", 1.5) for m in FP4_MODES]
    assert "fp4 50.0% of GEMM FLOPs" in rows[0].detail
    table = bench.format_table(res)
    assert "| mixprec-fp4 | 2.3500 ± 0.1000 | +0.2500 ± 0.0000 | **no** | 50.0% | 50% / 50% / 50% | 1.50x" in table
    assert "**not met**: 0.1500 nats beyond the spread; 10.0 points below 60% in fp4" in table
    assert "Wins: mixprec-fp4-hand." in table and "load average before 1, after 2" in table
