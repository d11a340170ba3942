"""The controller's quality benchmark (benchmarks/controller_quality.py: its hand recipes and its
verdict) and the fp4 controller's decisions in the demo's report (which GEMM, when, why, what it
cost)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from mixprec.demo.flops import GEMMS, share, shares
from mixprec.demo.fp4 import fp4_decisions, fp4_paragraph
from mixprec.demo.results import DemoResult, ModeResult
from mixprec.demo.settings import Settings

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks import controller_quality as bench  # noqa: E402

NAMES = [f"blocks.{b}.{p}" for b in range(3) for p in ("qkv", "proj")] + ["head"]


def _fp4_layers(config: str) -> set[str]:
    import re

    policy, ctl = bench.policy_for(config, NAMES, steps=300)
    pattern = re.compile(policy.fp8_rule.names)
    return {n for n in NAMES if pattern.search(n)}


def test_the_hand_recipes_keep_the_layers_they_name_in_bf16():
    assert _fp4_layers("all-fp4") == set(NAMES)
    assert _fp4_layers("head-bf16") == set(NAMES) - {"head"}
    assert _fp4_layers("last-bf16") == set(NAMES) - {"blocks.2.qkv", "blocks.2.proj", "head"}
    assert _fp4_layers("alt-bf16") == set(NAMES[1::2])
    policy, ctl = bench.policy_for("controller", NAMES)
    assert ctl.settings.per_gemm and ctl.settings.max_backward_cost == bench.MAX_BACKWARD_COST
    assert ctl.settings.cost_row_share == 0.25 == bench.FP4_COST_ROW_SHARE  # (the demo's mixprec-fp4)
    assert bench.policy_for("controller", NAMES, row_share=1.0)[1].settings.cost_row_share == 1.0
    assert bench.policy_for("controller-flush", NAMES)[1].settings.max_backward_cost is None
    late = bench.policy_for("controller-late", NAMES, steps=300)[1].settings  # the controller's, tightened at 80%
    assert (late.late_start, late.late_factor, late.max_backward_cost) == (240, bench.LATE_FACTOR, bench.MAX_BACKWARD_COST)
    assert _fp4_layers("controller-late") == set(NAMES) and ctl.settings.late_start is None
    with pytest.raises(ValueError, match="pass steps="):  # (without the run's length, no late phase to place)
        bench.policy_for("controller-late", NAMES)
    assert bench.policy_for("fp32", NAMES) == (None, None)


def _summary(rows: dict[str, tuple[float, float]], spread: float = 0.01) -> dict:
    return {"spread": spread, "base": 2.0, "rows": {c: {"gap": g, "gap_sd": 0.0, "gap_median": g, "share": s, "within": abs(g) <= spread,
                                                         "seconds": 1.0} for c, (g, s) in rows.items()}}


def test_the_verdict_compares_with_the_best_hand_recipe_and_the_85_percent_bar():
    rows = {"fp32": (0.0, 0.0), "head-bf16": (0.005, 0.9), "last-bf16": (0.002, 0.7), "alt-bf16": (0.03, 0.5)}
    text = bench.verdict(_summary({**rows, "controller": (0.004, 0.95)}))
    assert "best hand recipe head-bf16" in text and "beats it" in text and "NOT" not in text
    text = bench.verdict(_summary({**rows, "controller": (0.006, 0.95)}))  # more fp4, a larger gap
    assert "does NOT beat it" in text and ">= 85% within fp32's spread: met" in text
    text = bench.verdict(_summary({**rows, "controller": (0.02, 0.95)}))
    assert ">= 85% within fp32's spread: NOT met" in text
    # no hand recipe within fp32's spread: the best is the one with the smallest gap
    far = {c: (g + 0.1, s) for c, (g, s) in rows.items() if c != "fp32"}
    assert "best hand recipe last-bf16" in bench.verdict(_summary({"fp32": (0.0, 0.0), **far, "controller": (0.0, 0.9)}))


def test_the_summary_gives_each_configs_gap_seed_by_seed_with_its_median():
    """A chaotic seed (the 60-step Llama has them) moves the mean and spread, not the median."""
    finals = {"fp32": [2.0, 2.1, 2.2, 2.3, 2.4], "controller": [2.01, 2.12, 2.21, 2.52, 2.41]}
    results = {c: {seed: {"final": f, "fp4_share": 0.9, "seconds": 1.0} for seed, f in enumerate(v)} for c, v in finals.items()}
    row = bench.summarize(results)["rows"]["controller"]
    assert row["gap"] == pytest.approx(0.054) and row["gap_median"] == pytest.approx(0.010)
    assert row["gap_sd"] == pytest.approx(0.0929, abs=1e-4)
    assert "| controller | +0.0540 ± 0.0929 | +0.0100 |" in bench.table("m", bench.summarize(results))


def _controlled(decisions: list[dict], fp4_steps: dict[str, int], seed: int = 0) -> ModeResult:
    steps = 100
    layers = {"a": {"flops_per_gemm": 8, "gemms": {g: {"fp4": steps, "fp8": 0, "high": 0} for g in GEMMS}},
              "head": {"flops_per_gemm": 8, "gemms": {g: {"fp4": fp4_steps.get(g, steps), "fp8": steps - fp4_steps.get(
                  g, steps), "high": 0} for g in GEMMS}}}
    trace = {"steps": steps, "layers": layers}
    trace.update(fp4_share=share(trace), fp8_share=share(trace, "fp8"), per_gemm=shares(trace, "gemm"),
                 per_layer=shares(trace, "layer"))
    return ModeResult("mixprec-fp4", "", [2.0] * 10, 2.0, 1.0, {}, "", seed=seed, gemms=trace,
                      fp8={"decisions": decisions})


def test_the_report_names_each_decision_its_reason_and_what_it_cost():
    up = {"step": 10, "layer": "head", "gemm": "output", "action": "promote", "from": "nvfp4", "to": "fp8-tensorwise",
          "reason": "output GEMM: output loss cost 0.008862 > 0.001"}
    back = {**up, "step": 40, "gemm": "grad_weight", "reason": "grad_weight GEMM: output backward cost 0.0031 > 0.001"}
    run = _controlled([up, back], {"output": 90, "grad_weight": 60})
    fp32 = ModeResult("fp32", "", [2.0] * 10, 2.0, 1.0, {}, "", seed=0)
    result = DemoResult(Settings.for_size("tiny", steps=100), "cpu", {}, [fp32, run])
    lines = fp4_decisions(result)
    # the head's forward: 10 of 100 steps out of fp4, of 2 layers x 3 GEMMs x 100 steps of equal FLOPs
    assert lines == [
        "seed 0: head forward GEMM: step 10 nvfp4 -> fp8-tensorwise (output loss cost 0.008862 > 0.001); out of fp4 "
        f"for {10 / 600:.1%} of the run's GEMM FLOPs",
        "seed 0: head weight gradient GEMM: step 40 nvfp4 -> fp8-tensorwise (output backward cost 0.0031 > 0.001); "
        f"out of fp4 for {40 / 600:.1%} of the run's GEMM FLOPs"]
    assert "; ".join(lines) in fp4_paragraph(result)
    quiet = DemoResult(result.settings, "cpu", {}, [fp32, _controlled([], {})])
    assert fp4_decisions(quiet) == [] and "made no decision" in fp4_paragraph(quiet)


@pytest.mark.parametrize("model", ["tiny"])
def test_the_benchmark_runs_a_short_configuration(model):
    from mixprec.demo.corpus import load_tokens

    train, _ = load_tokens()
    out = bench.run(model, "controller", 0, 3, 2, train)
    # 3 steps, before the first check: only early promotions (the head's forward from the 3rd step, its backward along)
    assert out["fp4_share"] == pytest.approx(1.0) and all("early: 3 steps" in d for d in out["decisions"])
    assert out["final"] > 0


def test_the_heads_input_gradient_error_reaches_every_earlier_layer_a_hidden_ones_only_its_branch():
    """benchmarks/gradient_reach.py (the measurement behind the backward cost's next step): after
    20 steps, the head's NVFP4 input-gradient error reaches every earlier layer's weight gradient
    at least 10x stronger than ``blocks.1.out``'s reaches any layer past its block's residual add;
    ``blocks.1.out``'s reaches ``blocks.1.fc`` (its branch) at least 10x stronger than those."""
    from benchmarks import gradient_reach

    out = gradient_reach.main(["--steps", "20", "--batches", "1", "--targets", "head,blocks.1.out"])
    head, hidden = out["head"][1], out["blocks.1.out"][1]
    past = max(v for n, v in hidden.items() if n not in ("blocks.1.fc", "head"))
    assert min(head.values()) >= 10 * past and hidden["blocks.1.fc"] >= 10 * past
    assert out["head"][0] > 0 and hidden["head"] == 0.0  # (a later layer sees nothing of it)


def test_each_model_trains_its_own_length_and_an_unknown_model_is_refused():
    """small at its preset's 300 steps (at 120 it is on its plateau), tiny at 120, the Llama at 60;
    a model the benchmark does not build is an argparse error before any run."""
    assert bench.STEPS == {"tiny": 120, "small": 300, "llama": 60}
    with pytest.raises(SystemExit):
        bench.main(["--models", "tiny,gpt2"])
    for bad in ("llama-100", "llama-", "llama-x", "llama-0"):  # (a Llama at a width it cannot build)
        with pytest.raises(SystemExit):
            bench.main(["--models", f"tiny,{bad}"])


@pytest.mark.parametrize("name, hidden", [("llama", 64), ("llama-64", 64), ("llama-128", 128), ("tiny", None)])
def test_a_llama_at_another_width_keeps_the_benchmarks_shape(name, hidden):
    """``llama-<hidden>`` (the cost benchmark's --llama-hidden): the benchmark's Llama at that width,
    its MLP 11/4 of it (176 at 64), 4 layers and heads, the Llama's training length."""
    assert bench.llama_hidden(name) == hidden
    if hidden is None:
        return
    assert bench.steps_of(name) == bench.STEPS["llama"]
    model, _, _ = bench.build(name, 0)
    cfg = model.config
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, cfg.num_attention_heads) == (
        hidden, hidden * 11 // 4, 4, 4)
    assert model.model.layers[0].mlp.gate_proj.weight.shape == (hidden * 11 // 4, hidden)
    if name == "llama-64":  # (the benchmark's Llama itself, the same weights from a seed)
        import torch

        same = bench.build("llama", 0)[0]
        assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), same.state_dict().values()))


def test_step_slopes_reads_the_first_adamw_step_gain_and_the_next_batch_slope():
    """benchmarks/step_slopes.py: AdamW's first update is ``-lr * (sign(G) + wd * W)`` (its moments
    hold one gradient), so its first-order gain on the gradient that made it is ``lr * (|G|_1 +
    wd <G, W>)``, recomputed here from the same model and batch; the end slope is another batch's
    (it differs)."""
    import torch

    import mixprec
    from benchmarks import step_slopes
    from mixprec.demo.corpus import batch_offsets, load_tokens, make_batch

    rows = step_slopes.slopes("tiny", 0, 2)
    model, logits_of, lr = bench.build("tiny", 0)
    data, _ = load_tokens()
    x, y = make_batch(data, batch_offsets(len(data), 2, 8, bench.SEQ, 0)[0], bench.SEQ, torch.device("cpu"))
    with mixprec.autocast("cpu", dtype=torch.bfloat16):
        bench.lm_loss(logits_of(model, x).float(), y).backward()
    lr0 = lr * bench.lr_factor(0, 2)
    for name in bench.linears(model):
        w = dict(model.named_modules())[name].weight
        expected = lr0 * float(w.grad.abs().sum() + 0.01 * (w.grad * w.detach()).sum())
        (step, own, end), = rows[name]
        assert step == 0 and own == pytest.approx(expected, rel=1e-3), name
        assert end != pytest.approx(own, rel=1e-3)


def test_cost_bias_straddles_the_truth_of_a_quadratic_loss():
    """benchmarks/cost_bias.py on a loss quadratic in a layer's output (``mean((y - t)**2)``: its
    Hessian is ``2 / numel`` times the identity, exact, and ``g1 - g0 = H e``): the truth is the
    two losses' difference, ``(g1 - g0) e`` reads ``2 |e|**2 / numel``, and the Controller's
    estimates (its ``loss_cost``) lie ``(e'He - e'Fe) / 2`` over (own) and under (below) it."""
    import torch

    from benchmarks import cost_bias
    from mixprec.formats._recipe import Float8Recipe

    torch.manual_seed(0)
    layer = torch.nn.Linear(32, 16)
    x, target = torch.randn(24, 32), torch.randn(24, 16)
    r = cost_bias.estimates(layer, lambda m: (m(x) - target).square().mean(), layer, Float8Recipe.from_name("nvfp4"))
    with torch.no_grad():
        y = layer(x)
        e = cost_bias.local_linear(x, layer.weight, layer.bias, Float8Recipe.from_name("nvfp4"), "emulate_fp32", None) - y
        true = float((y + e - target).square().mean() - (y - target).square().mean())
    assert r["true"] == pytest.approx(true, rel=1e-4) and abs(true) > 0
    assert r["eHe"] == pytest.approx(2 * float(e.square().sum()) / e.numel(), rel=1e-3)
    assert r["own"] - r["true"] == pytest.approx(r["eHe"] / 2 - r["eFe_own"], rel=1e-3, abs=1e-9)
    assert r["below"] - r["true"] == pytest.approx(r["eFe_below"] - r["eHe"] / 2, rel=1e-3, abs=1e-9)
    assert r["eHe"] > 2 * max(r["eFe_own"], r["eFe_below"])  # (a quadratic loss's Fisher: far from its Hessian here)


def test_the_loss_limit_is_a_setting_the_backward_limit_follows(tmp_path):
    """``--max-loss-cost`` sets the controller configs' limit, and the backward GEMMs' follows it
    as the demo's does (``max_loss_cost / (every * horizon)``) unless ``--max-backward-cost`` says."""
    import json

    policy, ctl = bench.policy_for("controller", NAMES, loss_cost=4e-3)
    assert ctl.settings.max_loss_cost == 4e-3
    for extra, backward in (([], 4e-3 * bench.MAX_BACKWARD_COST / bench.MAX_LOSS_COST), (["--max-backward-cost", "1e-4"], 1e-4)):
        out = tmp_path / "q.json"
        bench.main(["--models", "tiny", "--steps", "2", "--seeds", "0", "--configs", "controller", "--max-loss-cost", "4e-3",
                    "--json", str(out), *extra])
        saved = json.loads(out.read_text())
        assert saved["max_loss_cost"] == 4e-3 and saved["max_backward_cost"] == pytest.approx(backward, rel=1e-12)


def test_the_verdict_gives_the_paired_difference_the_seeds_resolve():
    finals = {"fp32": [2.0, 2.1, 2.2], "head-bf16": [2.01, 2.13, 2.20], "controller": [2.02, 2.12, 2.23]}
    results = {c: {seed: {"final": f, "fp4_share": 0.0 if c == "fp32" else 0.9, "seconds": 1.0} for seed, f in enumerate(v)}
               for c, v in finals.items()}
    text = bench.verdict(bench.summarize(results))
    # seed by seed: +0.01, -0.01, +0.03: mean +0.01, standard deviation 0.02, standard error 0.0115
    assert "best hand recipe head-bf16" in text and "(paired, seed by seed: +0.0100 ± 0.0115 standard error)" in text


@pytest.mark.parametrize("argv", [["--llama-hidden", "128"], ["--llama", "10", "--llama-hidden", "64,100"]])
def test_the_cost_benchmark_refuses_llama_widths_it_cannot_run(argv):
    """--llama-hidden without --llama would time nothing; a width that is not a multiple of 64 is
    not the benchmark's Llama: both argparse errors before any run."""
    from benchmarks import controller_fp4

    with pytest.raises(SystemExit):
        controller_fp4.main(argv)


def test_the_cost_benchmark_times_the_llama_from_its_first_step():
    """benchmarks/controller_fp4.py --llama: the controlled Llama and the all-NVFP4 one, alternated
    over a whole run; ratios of whole windows, the first three apart from the rest."""
    from benchmarks import controller_fp4

    out = controller_fp4.llama_pair(40)
    assert out["whole"]["windows"] == 4 and out["first"]["windows"] == 3 and out["later"]["windows"] == 1
    assert all(0.2 < out[k]["ratio"] < 20 for k in ("whole", "first", "later"))
    assert out["stats"]["checks"] == 4
