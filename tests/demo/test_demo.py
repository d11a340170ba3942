"""The demo: corpus, model, every precision mode, determinism, and the report files."""

from __future__ import annotations

import dataclasses
import html
import io
import json
import math
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from mixprec.demo import corpus, modes
from mixprec.demo.environment import choose_threads, lowp_speed
from mixprec.demo.estimate import guess_seconds
from mixprec.demo.model import SIZES, ModelConfig, TransformerLM, lm_loss
from mixprec.demo.modes import DEFAULT_MODES, MODES, Mode, check_modes
from mixprec.demo.progress import LineProgress
from mixprec.demo.report import MEMORY_PARTS, format_checks, format_table, hardware_note, write_report
from mixprec.demo.results import DemoResult, ModeResult, Summary, compare, rank, summarize
from mixprec.demo.settings import Settings
from mixprec.demo.train import run_demo, run_mode

CPU = torch.device("cpu")
MICRO = ModelConfig(seq_len=16, d_model=32, n_layers=1, n_heads=2)


def micro(steps: int = 3, seed: int = 0) -> Settings:
    return Settings(model=MICRO, steps=steps, batch_size=2, lr=3e-3, seed=seed, eval_batches=1)


def test_corpus_ships_with_the_package_and_splits() -> None:
    text = corpus.load_text()
    assert 50_000 < len(text.encode()) < 300_000
    assert "In the beginning God created the heaven and the earth." in text
    train, val = corpus.load_tokens(0.1)
    assert train.dtype == torch.uint8 and len(train) + len(val) == len(text.encode())
    assert abs(len(val) / (len(train) + len(val)) - 0.1) < 1e-3
    with pytest.raises(ValueError, match="val_fraction"):
        corpus.load_tokens(1.0)


def test_batches_are_next_token_windows() -> None:
    data = torch.arange(100, dtype=torch.uint8)
    offsets = corpus.batch_offsets(len(data), steps=3, batch_size=4, seq_len=8, seed=1)
    assert offsets.shape == (3, 4)
    assert torch.equal(offsets, corpus.batch_offsets(len(data), 3, 4, 8, seed=1))
    x, y = corpus.make_batch(data, offsets[0], 8, CPU)
    assert x.shape == y.shape == (4, 8) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    with pytest.raises(ValueError, match="more than"):
        corpus.batch_offsets(9, 1, 1, seq_len=8, seed=0)


def test_model_shapes_and_initial_loss() -> None:
    torch.manual_seed(0)
    model = TransformerLM(MICRO)
    tokens = torch.randint(0, 256, (3, 16))
    logits = model(tokens)
    assert logits.shape == (3, 16, 256)
    # small init: the first loss is close to a uniform guess over 256 bytes
    assert abs(lm_loss(logits, tokens).item() - math.log(256)) < 0.1
    with pytest.raises(ValueError, match="seq_len"):
        model(torch.zeros(1, 17, dtype=torch.long))


@pytest.mark.parametrize(
    "kwargs, match",
    [({"d_model": 30, "n_heads": 4}, "divisible"), ({"n_layers": 0}, "positive"), ({"d_ff": -1}, "d_ff")],
)
def test_model_config_rejects_bad_shapes(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ModelConfig(**kwargs)


def test_settings_presets_and_validation() -> None:
    tiny = Settings.for_size("tiny")
    assert tiny.model == SIZES["tiny"] and tiny.steps == 120
    assert Settings.for_size("small", steps=7, seed=3).steps == 7
    with pytest.raises(ValueError, match="unknown size"):
        Settings.for_size("huge")
    with pytest.raises(ValueError, match="steps"):
        Settings(model=MICRO, steps=0, batch_size=1, lr=1e-3)
    for seed in (-1, 2**63, 1.5, True):
        with pytest.raises(ValueError, match=r"seed must be an integer in \[0, 2\*\*63\)"):
            Settings(model=MICRO, steps=1, batch_size=1, lr=1e-3, seed=seed)
    with pytest.raises(ValueError, match="untimed_steps"):
        Settings(model=MICRO, steps=1, batch_size=1, lr=1e-3, untimed_steps=-1)


def test_settings_take_numpy_seeds_as_int() -> None:
    np = pytest.importorskip("numpy")
    seed = Settings(model=MICRO, steps=1, batch_size=1, lr=1e-3, seed=np.int64(3)).seed
    assert type(seed) is int and seed == 3


@pytest.mark.parametrize("steps, untimed, timed", [(10, 1, range(1, 10)), (10, 3, range(3, 10)),
                                                   (3, 3, range(0, 3)), (1, 1, range(0, 1)), (4, 0, range(0, 4))])
def test_timed_steps_leave_out_the_warm_up(steps: int, untimed: int, timed: range) -> None:
    settings = Settings(model=MICRO, steps=steps, batch_size=1, lr=1e-3, untimed_steps=untimed)
    assert settings.timed_steps == timed


def test_check_modes_refuses_unknown_and_missing_apis(monkeypatch: pytest.MonkeyPatch) -> None:
    check_modes(DEFAULT_MODES)  # every mixprec API the demo needs is there
    with pytest.raises(ValueError, match="unknown mode"):
        check_modes(["fp32", "fp8"])
    with pytest.raises(ValueError, match="no modes"):
        check_modes([])
    with pytest.raises(ValueError, match="more than once: fp32"):
        check_modes(["fp32", "torch-amp", "fp32"])
    fake = Mode("needs-missing", "test", ("optim.DoesNotExist",), MODES["fp32"].setup)
    monkeypatch.setitem(MODES, fake.name, fake)
    with pytest.raises(RuntimeError, match=r"needs-missing needs mixprec\.optim\.DoesNotExist"):
        run_mode("needs-missing", micro(), CPU)


@pytest.mark.parametrize("name", list(MODES))
def test_every_mode_trains(name: str, data: tuple[torch.Tensor, torch.Tensor]) -> None:
    result = run_mode(name, micro(), CPU, data=data)
    assert len(result.losses) == 3 and all(math.isfinite(v) for v in result.losses)
    assert math.isfinite(result.eval_loss) and result.tokens_per_s > 0
    assert set(result.memory) == set(MEMORY_PARTS)
    assert result.memory["activations"] > 0
    fp32_params = sum(p.numel() * 4 for p in TransformerLM(MICRO).parameters())
    lowp = name.startswith(("bf16-", "fp16-"))
    assert (result.memory["params"] < 0.6 * fp32_params) == lowp
    assert (result.memory["master"] > 0) == (name == "fp16-master")
    scaled = name in ("torch-amp", "mixprec-fp16", "fp16-master", "mixprec-fp16-layerwise")
    assert len(result.scales) == (3 if scaled else 0)


def test_same_seed_same_run_other_seed_other_run(data: tuple[torch.Tensor, torch.Tensor]) -> None:
    a = run_mode("fp32", micro(seed=1), CPU, data=data)
    b = run_mode("fp32", micro(seed=1), CPU, data=data)
    c = run_mode("fp32", micro(seed=2), CPU, data=data)
    assert a.losses == b.losses and a.eval_loss == b.eval_loss
    assert a.losses != c.losses


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_mixprec_fp16_is_bitwise_torch_amp(
    fused: bool, data: tuple[torch.Tensor, torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Same weights, batches and scale rule: mixprec's autocast + scaler reproduce torch.amp's
    losses and loss scales exactly, through skipped steps, back-offs and growth."""
    # a scale that overflows at first and grows every 3 clean steps: skips, back-offs and growth
    monkeypatch.setattr(modes, "_INIT_SCALE", 2.0**19)
    monkeypatch.setattr(modes, "_GROWTH_INTERVAL", 3)
    settings = dataclasses.replace(micro(steps=12), fused=fused)
    ref = run_mode("torch-amp", settings, CPU, data=data)
    ours = run_mode("mixprec-fp16", settings, CPU, data=data)
    moves = [b / a for a, b in zip(ref.scales, ref.scales[1:])]
    assert len(ref.skipped_steps) >= 2 and 0.5 in moves and 2.0 in moves  # backed off and grew
    assert ours.losses == ref.losses and ours.eval_loss == ref.eval_loss
    assert ours.scales == ref.scales and ours.skipped_steps == ref.skipped_steps
    assert ours.memory == ref.memory


def test_scheduler_warning_is_silenced_when_the_first_step_is_skipped(
    data: tuple[torch.Tensor, torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(modes, "_INIT_SCALE", 2.0**40)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = run_mode("torch-amp", micro(steps=2), CPU, data=data)
    assert result.skipped_steps == [0, 1]


def test_demo_is_deterministic_in_every_mode(data: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Two runs with the same seed give bitwise the same losses and loss scales in every mode."""
    for name in DEFAULT_MODES:
        a, b = (run_mode(name, micro(steps=2, seed=3), CPU, data=data) for _ in range(2))
        assert a.losses == b.losses and a.eval_loss == b.eval_loss and a.scales == b.scales, name
        assert a.memory == b.memory, name


def test_autocast_saves_smaller_activations(data: tuple[torch.Tensor, torch.Tensor]) -> None:
    settings = Settings(model=MICRO, steps=1, batch_size=32, lr=1e-3, eval_batches=1)
    fp32, bf16, ref = (run_mode(m, settings, CPU, data=data) for m in ("fp32", "mixprec-bf16", "torch-amp-bf16"))
    assert bf16.memory["activations"] < 0.8 * fp32.memory["activations"]
    assert bf16.memory["activations"] == ref.memory["activations"]


def test_line_progress_prints_steps_and_summary(data: tuple[torch.Tensor, torch.Tensor]) -> None:
    out = io.StringIO()
    run_mode("torch-amp", micro(steps=20), CPU, progress=LineProgress(out), data=data)
    lines = out.getvalue().splitlines()
    assert lines[0] == "torch-amp: training 20 steps"
    assert "step 20/20" in lines[-2] and "scale" in lines[-2]
    assert lines[-1].strip().startswith("torch-amp: final loss")
    assert 5 <= len(lines) <= 14


@pytest.fixture(scope="module")
def demo_result() -> DemoResult:
    return run_demo(micro(steps=4), ["fp32", "torch-amp", "bf16-naive"], "cpu")


def test_report_files(demo_result: DemoResult, tmp_path) -> None:
    paths = write_report(demo_result, tmp_path / "report")
    for name in ("loss", "scale", "memory", "throughput"):
        assert paths[name].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    page = paths["index"].read_text()
    data = json.loads(paths["results"].read_text())
    assert [m["mode"] for m in data["modes"]] == ["fp32", "torch-amp", "bf16-naive"]
    assert data["settings"]["steps"] == 4 and len(data["modes"][1]["scales"]) == 4
    assert {f["name"] for f in data["figures"]} == {"loss", "scale", "memory", "throughput"}
    for fig in data["figures"]:
        assert f'src="{fig["file"]}"' in page and (paths["index"].parent / fig["file"]).is_file()
        assert html.escape(fig["caption"]) in page
        assert fig["caption"].count(". ") + fig["caption"].count("; ") >= 1 and fig["data"]
    figs = {f["name"]: f["data"] for f in data["figures"]}
    modes = {m.mode: m for m in demo_result.modes}
    # every series each figure draws is in results.json
    assert figs["loss"]["raw"] == {name: m.losses for name, m in modes.items()}
    assert figs["loss"]["minus"] == "fp32" and figs["loss"]["difference"]["fp32"] == [0.0] * 4
    for name, m in modes.items():
        assert len(figs["loss"]["smoothed"][name]) == 4
        assert figs["loss"]["smoothed"][name][0] == m.losses[0]
    assert figs["scale"].keys() == {"torch-amp"}
    assert figs["scale"]["torch-amp"] == {"scales": modes["torch-amp"].scales,
                                          "skipped_steps": modes["torch-amp"].skipped_steps}
    assert figs["memory"] == {name: m.memory for name, m in modes.items()}
    assert figs["throughput"]["ratio_to"] == "torch-amp" and figs["throughput"]["ratio"]["torch-amp"] == 1.0
    assert figs["throughput"]["tokens_per_s"] == {name: m.tokens_per_s for name, m in modes.items()}
    assert "first step excluded" in data["figures"][3]["caption"]


def test_terminal_table(demo_result: DemoResult) -> None:
    lines = format_table(demo_result).splitlines()
    assert lines[0].split()[:3] == ["mode", "final", "loss"] and "time / torch-amp" in lines[0]
    assert [line.split()[0] for line in lines[2:-1]] == ["fp32", "torch-amp", "bf16-naive"]
    assert lines[3].split()[4] == "1.00x"  # torch-amp against itself
    fp32, amp = demo_result.modes[:2]
    assert lines[2].split()[4] == f"{amp.tokens_per_s / fp32.tokens_per_s:.2f}x"  # time ratio: lower is faster
    assert lines[-1] == "(seed 0; time / torch-amp: time per token relative to torch-amp, lower is faster)"


def test_hardware_note_names_emulated_dtypes(demo_result: DemoResult) -> None:
    env = dict(demo_result.environment)
    env["cpu_lowp"] = {"float16": {"native": False, "slowdown": 20.0, "spread": 0.1},
                       "bfloat16": {"native": True, "slowdown": 0.5, "spread": 0.1}}
    note = hardware_note(DemoResult(demo_result.settings, "cpu", env, demo_result.runs))
    assert note is not None and "no native float16 matmul" in note and "float16 20.0x slower" in note
    # a noisy measurement (busy machine) is not quoted, nor used where the flags are unknown
    env["cpu_lowp"]["float16"]["spread"] = 0.9
    note = hardware_note(DemoResult(demo_result.settings, "cpu", env, demo_result.runs))
    assert note is not None and "20.0x" not in note and "too noisy to quote" in note
    env["cpu_lowp"] = {"float16": {"native": None, "slowdown": 30.0, "spread": 0.9},
                       "bfloat16": {"native": None, "slowdown": 1.0, "spread": 0.1}}
    assert hardware_note(DemoResult(demo_result.settings, "cpu", env, demo_result.runs)) is None


def test_each_figure_plots_its_own_data(demo_result: DemoResult, tmp_path, monkeypatch) -> None:
    from matplotlib.figure import Figure

    drawn: dict[str, list[str]] = {}
    save = Figure.savefig

    def record(fig, path, *args, **kwargs):
        drawn[Path(path).stem] = [ax.get_xlabel() for ax in fig.axes]
        return save(fig, path, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", record)
    write_report(demo_result, tmp_path)
    assert drawn == {
        "loss": ["", "step"],  # loss curves over the difference to fp32, sharing the step axis
        "scale": ["step"],
        "memory": ["MiB"],
        "throughput": ["tokens / s (label: time / torch-amp, lower is faster)"],
    }


@pytest.mark.slow
def test_progress_and_report_do_not_import_the_trainer() -> None:
    code = ("import sys, mixprec.demo.progress, mixprec.demo.report; "
            "assert 'mixprec.demo.train' not in sys.modules, sorted(m for m in sys.modules if 'demo' in m)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_every_mode_declares_a_reference_that_exists() -> None:
    for mode in MODES.values():
        assert mode.reference is None or mode.reference in MODES, mode.name
        assert mode.cpu_cost > 0
    assert DEFAULT_MODES == tuple(m.name for m in MODES.values() if m.default)
    assert MODES["mixprec-fp16"].reference == "torch-amp" and "torch-amp-bf16" not in DEFAULT_MODES


def test_compare_names_the_first_difference(data: tuple[torch.Tensor, torch.Tensor]) -> None:
    ref = run_mode("torch-amp", micro(steps=4), CPU, data=data)
    assert compare(ref, ref) == "identical (losses, scales, skipped steps)"
    other = dataclasses.replace(ref, losses=[*ref.losses[:2], ref.losses[2] + 1e-6, ref.losses[3]])
    assert compare(other, ref).startswith(f"losses differ from step 3: {other.losses[2]!r} against")
    other = dataclasses.replace(ref, scales=[*ref.scales[:3], ref.scales[3] / 2])
    assert compare(other, ref) == f"loss scales differ from step 4: {ref.scales[3] / 2:g} against {ref.scales[3]:g}"
    other = dataclasses.replace(ref, skipped_steps=[1])
    assert compare(other, ref) == f"skipped steps differ: [1] against {ref.skipped_steps}"


def test_seeds_give_one_run_per_mode_and_seed_and_a_computed_check() -> None:
    out = io.StringIO()
    result = run_demo(micro(steps=6, seed=4), ["torch-amp", "mixprec-fp16"], "cpu", LineProgress(out), seeds=2)
    assert [(r.mode, r.seed) for r in result.runs] == [
        ("torch-amp", 4), ("mixprec-fp16", 4), ("torch-amp", 5), ("mixprec-fp16", 5)]
    assert [m.seed for m in result.modes] == [4, 4] and result.seeds == [4, 5]
    assert result.runs[0].losses != result.runs[2].losses
    check, timing = format_checks(result)
    assert check == "mixprec-fp16 = torch-amp: identical (losses, scales, skipped steps) over 2 seeds"
    assert timing.startswith("mixprec-fp16 against torch-amp, steps timed in alternation: ")
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("expected duration: about ") and lines[-2].startswith("trained 4 runs in ")
    assert lines[-1] == timing  # after training, the pair's steps timed in alternation
    summary = {s.mode: s for s in summarize(result)}
    evals = [r.eval_loss for r in result.of("torch-amp")]
    assert summary["torch-amp"].seeds == 2 and summary["torch-amp"].eval_loss == sum(evals) / 2
    assert summary["torch-amp"].eval_spread == pytest.approx(abs(evals[0] - evals[1]) / math.sqrt(2))
    data = result.to_json()
    assert len(data["runs"]) == 4 and len(data["modes"]) == 2 and data["seeds"] == [4, 5]
    assert data["checks"] == {"mixprec-fp16 = torch-amp": "identical (losses, scales, skipped steps) over 2 seeds"}
    with pytest.raises(ValueError, match="seeds must be >= 1"):
        run_demo(micro(), ["fp32"], "cpu", seeds=0)


def test_a_differing_run_is_reported_not_hidden(demo_result: DemoResult) -> None:
    amp = next(r for r in demo_result.runs if r.mode == "torch-amp")
    bad = dataclasses.replace(amp, mode="mixprec-fp16", losses=[*amp.losses[:-1], amp.losses[-1] * 2])
    result = DemoResult(demo_result.settings, "cpu", demo_result.environment, [*demo_result.runs, bad])
    assert format_checks(result) == [f"mixprec-fp16 = torch-amp: losses differ from step 4: {bad.losses[-1]!r} "
                                     f"against {amp.losses[-1]!r}"]


def _summary(mode: str, vs_base: float, spread: float, seeds: int = 3) -> Summary:
    return Summary(mode, seeds, 2.7 + vs_base, 0.05, 2.6 + vs_base, 0.05, "fp32", vs_base, spread)


def test_rank_never_separates_modes_by_less_than_the_spread() -> None:
    one_seed = [_summary("fp32", 0.0, 0.0, seeds=1), _summary("bf16-kahan", -0.01, 0.0, seeds=1)]
    assert rank(one_seed) == ("Validation loss minus fp32's, one seed: within the band (at most 0.1% above fp32's, "
                              "or below it): bf16-kahan (-0.0100). From 1 seed the seed-to-seed spread is not "
                              "measured, so no mode is ranked (--seeds 3 measures it).")
    text = rank([_summary("fp32", 0.0, 0.0), _summary("bf16-kahan", -0.0002, 0.0196),
                 _summary("bf16-naive", 0.0138, 0.0107), _summary("bf16-stochastic", 0.05, 0.01),
                 _summary("fp16-master", -0.03, 0.01)])
    assert text == (
        "Validation loss minus fp32's, seed by seed, over 3 seeds (mean ± standard deviation): "
        "lower: fp16-master (-0.0300 ± 0.0100); higher: bf16-stochastic (+0.0500 ± 0.0100); "
        "not distinguishable from fp32 (difference within the band: twice the seed-to-seed standard deviation, "
        "at least 0.1%): bf16-kahan (-0.0002 ± 0.0196), bf16-naive (+0.0138 ± 0.0107). Within the band (a loss below "
        "fp32's is within it): bf16-kahan, bf16-naive, fp16-master.")


def test_a_negligible_difference_with_no_spread_is_not_ranked() -> None:
    # a run that is not chaotic: bf16 ends 0.0001 below fp32 on every seed (spread 0), fp16 0.009 above
    text = rank([_summary("fp32", 0.0, 0.0), _summary("mixprec-bf16", -0.0001, 0.0),
                 _summary("mixprec-fp16", 0.009, 0.002)])
    assert "higher: mixprec-fp16 (+0.0090 ± 0.0020)" in text and "lower" not in text
    assert "at least 0.1%): mixprec-bf16 (-0.0001 ± 0.0000)" in text
    from mixprec.demo.verdict import verdict

    runs = [*_runs("fp32", [2.70, 2.75, 2.72]), *_runs("mixprec-bf16", [2.6999, 2.7499, 2.7199])]
    lines = verdict(DemoResult(Settings.for_size("tiny", steps=20), "cpu", {}, sorted(runs, key=lambda r: r.seed)))
    assert "use fp32 or any mode that matches it. Matching fp32: mixprec-bf16 (" in lines[0]
    assert "better: none; worse: none" in lines[0]


def test_summaries_pair_each_seed_with_the_base_modes(demo_result: DemoResult) -> None:
    runs = [dataclasses.replace(r, seed=r.seed + offset, eval_loss=r.eval_loss + offset * (r.mode == "bf16-naive"))
            for offset in (0, 1) for r in demo_result.runs]
    summary = {s.mode: s for s in summarize(DemoResult(demo_result.settings, "cpu", {}, runs))}
    naive = next(r for r in demo_result.runs if r.mode == "bf16-naive")
    fp32 = demo_result.runs[0]
    assert summary["fp32"].eval_vs_base == 0.0 and summary["bf16-naive"].base == "fp32"
    assert summary["bf16-naive"].eval_vs_base == pytest.approx(naive.eval_loss - fp32.eval_loss + 0.5)
    assert summary["bf16-naive"].eval_vs_base_spread == pytest.approx(math.sqrt(0.5))


def test_captions_rank_only_beyond_the_spread_and_state_the_check(demo_result: DemoResult, tmp_path: Path) -> None:
    write_report(demo_result, tmp_path)
    captions = {f["name"]: f["caption"] for f in json.loads((tmp_path / "results.json").read_text())["figures"]}
    assert "no mode is ranked" in captions["loss"] and "Lowest validation loss" not in captions["loss"]
    assert "should" not in captions["scale"]


@pytest.mark.parametrize("cores, load, threads", [(2, 0.1, 2), (2, 2.7, 1), (2, 9.0, 1), (16, 3.2, 13), (4, 1.5, 3), (4, 1.6, 2)])
def test_threads_are_the_cores_not_busy(cores: int, load: float, threads: int) -> None:
    assert choose_threads(cores, load) == (threads, f"{cores} cores, load {load:.1f}")


def test_lowp_speed_is_a_median_with_its_spread() -> None:
    speed = lowp_speed(CPU, n=32, rounds=4)
    assert set(speed) == {"float16", "bfloat16"}
    for info in speed.values():
        assert info["slowdown"] > 0 and info["spread"] >= 0


def test_estimate_first_guess_scales_with_steps_size_and_mode() -> None:
    tiny = Settings.for_size("tiny", steps=100)
    assert guess_seconds(tiny, "mixprec-fp16") > 5 * guess_seconds(tiny, "fp32")
    assert guess_seconds(Settings.for_size("small", steps=100), "fp32") > 4 * guess_seconds(tiny, "fp32")
    assert guess_seconds(Settings.for_size("tiny", steps=200), "fp32") > 1.5 * guess_seconds(tiny, "fp32")


class _Notes:
    def __init__(self) -> None:
        self.notes: list[str] = []

    def start(self, mode: str, total: int) -> None: ...
    def update(self, step: int, loss: float, scale: float | None) -> None: ...
    def finish(self, result: object) -> None: ...

    def note(self, text: str) -> None:
        self.notes.append(text)


def test_estimate_without_a_first_guess_measures_then_tells() -> None:
    from mixprec.demo.estimate import Estimate

    notes = _Notes()
    est = Estimate.start(Settings.for_size("tiny", steps=100), ["fp32", "mixprec-fp16"], torch.device("cuda"), notes)
    assert notes.notes == ["2 runs; the time they take is estimated after the first steps"]
    assert est.left() is None
    est._step_time("fp32", 0.01, step=4)  # 96 steps left of fp32, and fp16 at fp32's pace: about 2.5 s
    assert est.left("fp32", 4) == pytest.approx(96 * 0.01 + 0.5 + 100 * 0.01 + 0.5)
    assert notes.notes[-1].startswith("estimate from the first steps of fp32: about 3 s left")


def test_estimate_corrects_the_modes_not_started_by_the_measured_ratio() -> None:
    from mixprec.demo.estimate import Estimate

    settings = Settings.for_size("tiny", steps=100)
    est = Estimate.start(settings, ["fp32", "bf16-naive"], CPU, None)
    guess = guess_seconds(settings, "fp32") - 0.5
    est._step_time("fp32", 2 * guess / 100, step=4)  # twice as slow as guessed
    assert est.left("fp32", 4) == pytest.approx(96 * 2 * guess / 100 + 0.5 + 2 * guess_seconds(settings, "bf16-naive"))


def test_every_progress_display_prints_notes_verbatim() -> None:
    from mixprec.demo.progress import RichProgress, TqdmProgress

    rich_progress = pytest.importorskip("rich.progress")
    from rich.console import Console

    out = io.StringIO()
    with rich_progress.Progress(console=Console(file=out, force_terminal=False, width=120)) as bars:
        RichProgress(bars).note("expected duration: about 2 s [first guess]")
    assert "expected duration: about 2 s [first guess]" in out.getvalue()
    pytest.importorskip("tqdm")
    out = io.StringIO()
    TqdmProgress(out).note("trained 1 runs in 2 s")
    assert out.getvalue() == "trained 1 runs in 2 s\n"
    out = io.StringIO()
    LineProgress(out).note("x")
    assert out.getvalue() == "x\n"


# --- where mixed precision pays, the verdict, Ctrl-C (issue 18) ---------------------------------

NATIVE = {"float16": {"native": True, "slowdown": 1.03, "spread": 0.04},
          "bfloat16": {"native": True, "slowdown": 0.23, "spread": 0.05}}


def test_one_capability_reading_for_the_estimate_the_note_and_the_caption(demo_result: DemoResult, tmp_path: Path) -> None:
    from mixprec.demo.environment import capability, native_lowp
    from mixprec.demo.estimate import Estimate

    env = {**demo_result.environment, "cpu_lowp": NATIVE}
    assert native_lowp(env) == {"float16": True, "bfloat16": True} and capability(env) == "native float16/bfloat16"
    mixed = {"cpu_lowp": {"float16": {"native": None, "slowdown": 40.0, "spread": 0.1},
                          "bfloat16": {"native": True, "slowdown": 0.3, "spread": 0.1}}}
    assert capability(mixed) == "native bfloat16, no native float16"
    notes = _Notes()
    Estimate.start(Settings.for_size("tiny", steps=10), ["fp32"], CPU, notes, env)
    assert "this CPU: native float16/bfloat16" in notes.notes[0]  # it said "without native fp16/bf16"
    result = DemoResult(demo_result.settings, "cpu", env, demo_result.runs)
    assert hardware_note(result) is None
    write_report(result, tmp_path)
    caption = next(f["caption"] for f in json.loads((tmp_path / "results.json").read_text())["figures"]
                   if f["name"] == "throughput")
    assert "This CPU's flags list native float16/bfloat16 matmul units" in caption  # then what the run measured
    assert "faster where the device has native" not in caption
    unknown = {"cpu_lowp": {d: {"native": None, "slowdown": 9.0, "spread": 0.9} for d in ("float16", "bfloat16")}}
    write_report(DemoResult(demo_result.settings, "cpu", unknown, demo_result.runs), tmp_path)
    caption = next(f["caption"] for f in json.loads((tmp_path / "results.json").read_text())["figures"]
                   if f["name"] == "throughput")
    assert "Whether this CPU has native float16/bfloat16 matmul units is unknown" in caption


def _panel(**ratios: list[float]) -> dict:
    sizes = ("tiny", "small", "base")[:len(next(iter(ratios.values())))]
    return {"threads": 1, "batch_size": 8, "rounds": 3, "seconds": 1.0, "skipped": {}, "sizes": [
        {"size": size, "ratio": {"fp32": 1.0, **{k: v[i] for k, v in ratios.items()}},
         "seconds": {"fp32": 0.01, **{k: 0.01 * v[i] for k, v in ratios.items()}}} for i, size in enumerate(sizes)]}


def test_crossover_is_computed_from_the_panel() -> None:
    from mixprec.demo.speed import crossover, speed_sentence

    assert crossover(_panel(bf16=[1.8, 1.0, 0.61]), "bf16") == (
        "bf16 autocast is 1.6x faster than fp32 from the `base` size up; below it fp32 is as fast or faster "
        "(tiny 1.80x, small 1.00x the time)")
    assert crossover(_panel(bf16=[1.8, 1.3, 0.61]), "bf16").endswith("below it fp32 is faster (tiny 1.80x, small 1.30x the time)")
    assert crossover(_panel(bf16=[0.8, 0.5, 0.4]), "bf16") == (
        "bf16 autocast is faster than fp32 at every size measured (up to 2.5x: tiny 0.80x, small 0.50x, base 0.40x the time)")
    assert crossover(_panel(fp16=[2.0, 1.5, 1.2]), "fp16") == (
        "fp16 autocast is slower than fp32 at every size measured (tiny 2.00x, small 1.50x, base 1.20x the time)")
    assert crossover(_panel(fp8=[1.2, 1.0, 1.05]), "fp8") == (
        "fp8 (emulated) is faster than fp32 at no size measured (tiny 1.20x, small 1.00x, base 1.05x the time)")
    assert "no single crossover" in crossover(_panel(bf16=[0.5, 1.5, 0.5]), "bf16")
    panel = _panel(bf16=[1.8, 0.6], fp16=[2.0, 1.5], fp8=[4.0, 3.0])
    panel["skipped"] = {"base": "expected 90 s"}
    text = speed_sentence(panel)
    assert text.startswith("on this CPU (1 thread, batch 8, time per training step, lower is faster): bf16 autocast is")
    assert text.endswith("; not timed: base (time budget).")


def test_speed_panel_times_every_kind_and_keeps_to_its_budget(data: tuple[torch.Tensor, torch.Tensor]) -> None:
    from mixprec.demo.speed import KINDS, measure

    notes: list[str] = []
    panel = measure(data[0], CPU, sizes=("tiny", "small"), rounds=1, budget_s=0.0, note=notes.append)
    assert [e["size"] for e in panel["sizes"]] == ["tiny"]  # the first size always runs
    assert set(panel["skipped"]) == {"small"} and "more than the 0 s left" in panel["skipped"]["small"]
    tiny = panel["sizes"][0]
    assert tiny["ratio"]["fp32"] == 1.0 and set(tiny["ratio"]) == set(KINDS)
    assert all(t > 0 for t in tiny["seconds"].values())
    assert notes[0].startswith("speed panel, tiny: bf16 ") and panel["threads"] == torch.get_num_threads()
    assert notes[1].startswith("speed panel: small not timed (expected ")
    with pytest.raises(ValueError, match="sizes must be among"):
        measure(data[0], CPU, sizes=("huge",))


def _runs(mode: str, evals: list[float], tps: float = 100.0, losses: list[float] | None = None) -> list:
    from mixprec.demo.results import ModeResult

    return [ModeResult(mode, "", losses or [3.0] * 20, e, tps, {"params": 100 if mode == "fp32" else 60}, "",
                       seed=seed) for seed, e in enumerate(evals)]


def test_verdict_names_the_mode_for_accuracy_speed_and_memory_with_its_noise_band() -> None:
    from mixprec.demo.verdict import verdict

    runs = [*_runs("fp32", [2.70, 2.75, 2.72], 500.0), *_runs("bf16-kahan", [2.70, 2.76, 2.71], 300.0),
            *_runs("bf16-naive", [2.90, 2.96, 2.93], 900.0)]
    runs.sort(key=lambda r: r.seed)
    lines = verdict(DemoResult(Settings.for_size("tiny", steps=20), "cpu", {}, runs))
    assert lines[0].startswith("For accuracy (3 seeds; noise band: twice the seed-to-seed standard deviation")
    assert "use fp32 or any mode that matches it. Matching fp32: bf16-kahan (" in lines[0]
    assert "better: none; worse: bf16-naive (+0.207 ± 0.006)" in lines[0]
    # the fastest mode within fp32's band, not the fastest overall (bf16-naive is worse)
    assert lines[1] == "For speed at this size (tiny, 20 steps): fp32 (seed 0, 500 tokens/s)."
    assert lines[2] == "For memory: bf16-kahan (0.00 MiB, 60% of fp32's)."
    for seeds in (1, 2):  # the spread of two values is mostly noise: no band either
        few = verdict(DemoResult(Settings.for_size("tiny", steps=20), "cpu", {}, [r for r in runs if r.seed < seeds]))
        assert "noise band" not in few[0].split("(the seed-to-seed noise band takes 3 seeds")[0]
        assert "so no mode is called better or worse than fp32 (the reference)" in few[0]
        # the fastest mode overall (bf16-naive) fails the accuracy bar: never recommended, and
        # fp32 itself never carries "accuracy not established"
        assert few[1] == f"For speed at this size (tiny, 20 steps): fp32 ({'seed 0, ' if seeds > 1 else ''}500 tokens/s)."
        assert "not established" not in " ".join(few)


def test_verdict_from_one_seed_says_what_it_can_and_cannot_tell() -> None:
    """Issue 30 item 11: from one seed the verdict recommended bf16-naive (ended worst, +0.012)
    for memory and called fp32's own accuracy "not established"."""
    from mixprec.demo.verdict import verdict

    def run(mode: str, e: float, tps: float, params: int) -> ModeResult:
        return ModeResult(mode, "", [3.0] * 20, e, tps, {"params": params}, "", seed=0)

    runs = [run("fp32", 2.7714, 46_510.0, 100), run("mixprec-bf16", 2.7712, 33_053.0, 77),
            run("bf16-naive", 2.7834, 34_336.0, 54), run("bf16-kahan", 2.7716, 34_901.0, 65),
            run("torch-amp", 2.7804, 21_633.0, 77)]
    result = DemoResult(Settings.for_size("tiny", steps=20), "cpu", {}, runs,
                        seeds_note="1 seed of at most 3: another (about 240 s) would end past the 165 s budget")
    lines = verdict(result)
    assert lines[0] == (
        "For accuracy, from 1 seed (seed 0): validation loss minus fp32's, within the band (at most 0.1% above "
        "fp32's 2.771, or below it): mixprec-bf16 (-0.000), bf16-kahan (+0.000); above it: bf16-naive (+0.012), "
        "torch-amp (+0.009). "
        "One seed cannot tell whether a difference is systematic or this seed's chance (the seed-to-seed noise band "
        "takes 3 seeds: --seeds 3), so no mode is called better or worse than fp32 (the reference); speed and "
        "memory below consider only fp32 and the modes within the band (1 seed of at most 3: another (about 240 s) "
        "would end past the 165 s budget).")
    assert lines[1] == "For speed at this size (tiny, 20 steps): fp32 (46,510 tokens/s)."
    # the least memory among the modes within the bar: bf16-kahan, not bf16-naive
    assert lines[2] == ("For memory: bf16-kahan (0.00 MiB, 65% of fp32's, within the band of fp32's loss, "
                        "not shown to match it).")
    # nothing within the bar: no memory recommendation at all
    alone = verdict(DemoResult(result.settings, "cpu", {}, [runs[0], runs[2]]))
    assert alone[2] == "For memory: no mode passes the accuracy bar above, so none is recommended over fp32 (0.00 MiB)."
    assert "not established" not in " ".join(lines + alone)


def test_a_mode_far_above_fp32_gets_its_departure_explained() -> None:
    from mixprec.demo.verdict import verdict

    base = [3.0 - 0.01 * i for i in range(100)]
    jumped = [b + (0.0 if i < 30 else 0.3) + (1.0 if i == 36 else 0.0) for i, b in enumerate(base)]
    runs = [*_runs("fp32", [2.7], losses=base), *_runs("bf16-stochastic", [2.9], losses=jumped),
            *_runs("bf16-kahan", [2.7], losses=[b + 0.001 for b in base])]
    lines = verdict(DemoResult(Settings.for_size("tiny", steps=100), "cpu", {}, runs))
    assert lines[-1] == (
        "Far above fp32's final training loss (seed 0): bf16-stochastic +14.6% (leaves the curve at step 31, "
        "jumps to 3.94 at step 37 against 2.64); each leaves it after the warm-up to the peak learning rate "
        "(0.00125, reached at step 10): in that phase a run of this small model is tipped off course by any "
        "rounding difference and stays on a higher plateau, so one seed does not rank these modes. "
        "Compare over seeds (docs/demo.md, 'Far above fp32 from one seed').")
    assert not any("bf16-kahan +" in line for line in lines)


def test_per_mode_lines_are_not_cut_off_in_the_page(data: tuple[torch.Tensor, torch.Tensor], tmp_path: Path) -> None:
    result = run_demo(micro(steps=2), ["fp32", "mixprec-fp8"], "cpu")
    page = write_report(result, tmp_path)["index"].read_text()
    table = page.split("<pre>")[1].split("</pre>")[0]
    assert "mixprec-fp8 (tensorwise" not in table and max(len(line) for line in table.splitlines()) < 100
    fp8_line = format_table(result).splitlines()[-1]
    assert fp8_line.endswith("--seeds 3 measures the spread)") and f"<li>{html.escape(fp8_line)}</li>" in page
    verdict_lines = json.loads((tmp_path / "results.json").read_text())["verdict"]
    assert verdict_lines[0].startswith("For accuracy") and all(html.escape(v) in page for v in verdict_lines)


class _InterruptAt(_Notes):
    """Raises KeyboardInterrupt (as Ctrl-C does) when the ``n``-th run starts."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n, self.started = n, 0

    def start(self, mode: str, total: int) -> None:
        self.started += 1
        if self.started == self.n:
            raise KeyboardInterrupt


def test_ctrl_c_keeps_the_runs_that_finished(tmp_path: Path) -> None:
    result = run_demo(micro(steps=2), ["fp32", "bf16-naive", "torch-amp"], "cpu", _InterruptAt(2))
    assert [r.mode for r in result.runs] == ["fp32"]
    assert result.interrupted == "finished fp32; not run: bf16-naive, torch-amp"
    page = write_report(result, tmp_path)["index"].read_text()
    assert "<b>Interrupted</b> (Ctrl-C): finished fp32; not run: bf16-naive, torch-amp." in page
    assert json.loads((tmp_path / "results.json").read_text())["interrupted"] == result.interrupted
    # during a later seed: every seed in the report has every mode
    result = run_demo(micro(steps=2), ["fp32", "bf16-naive"], "cpu", _InterruptAt(4), seeds=2)
    assert [(r.mode, r.seed) for r in result.runs] == [("fp32", 0), ("bf16-naive", 0)]
    assert result.interrupted.startswith("during seed 1: its finished runs (fp32) are left out")
    with pytest.raises(KeyboardInterrupt):
        run_demo(micro(steps=2), ["fp32"], "cpu", _InterruptAt(1))


def test_a_time_budget_trains_as_many_seeds_as_fit() -> None:
    result = run_demo(micro(steps=2), ["fp32"], "cpu", seeds=3, budget_s=0.0)
    assert result.seeds == [0] and result.seeds_note.startswith("1 seed of at most 3: another (about ")
    result = run_demo(micro(steps=2), ["fp32"], "cpu", seeds=2, budget_s=600.0)
    assert result.seeds == [0, 1] and result.seeds_note == "2 seeds, the most, within the 600 s budget"


def test_the_speed_panel_is_a_figure_with_the_computed_sentence(demo_result: DemoResult, tmp_path: Path) -> None:
    panel = _panel(bf16=[1.8, 1.0, 0.61], fp16=[2.0, 1.5, 1.2], fp8=[4.0, 3.0, 1.9])
    result = dataclasses.replace(demo_result, speed=panel, environment={**demo_result.environment, "cpu_lowp": NATIVE})
    paths = write_report(result, tmp_path)
    assert paths["speed"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads(paths["results"].read_text())
    fig = next(f for f in data["figures"] if f["name"] == "speed")
    assert fig["data"]["ratio"]["bf16"] == [1.8, 1.0, 0.61] and fig["data"]["sizes"] == ["tiny", "small", "base"]
    assert "On this CPU (1 thread, batch 8" in fig["caption"]
    assert "bf16 autocast is 1.6x faster than fp32 from the `base` size up" in fig["caption"]
    assert data["speed"] == panel
    throughput = next(f for f in data["figures"] if f["name"] == "throughput")
    assert throughput["caption"].endswith("whether they pay depends on the model's size: the speed panel "
                                          "(speed.png) times it.")
    assert "At other sizes (the speed panel), on this CPU" in data["verdict"][1]
