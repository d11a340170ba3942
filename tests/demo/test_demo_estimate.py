"""The demo's estimate, speed panel order, slowdown note and alternated timing, on synthetic
inputs (issue 30 item 11: on a loaded 2-core EPYC the demo estimated 64 s and took 4 min, timed
only `tiny` with `--size small`, called a 41-48x matmul slowdown too noisy to quote and showed
mixprec-fp16 at 1.32x torch-amp's time although both run the same kernels)."""

from __future__ import annotations

import pytest
import torch

from mixprec.demo import estimate as estimate_module
from mixprec.demo import speed
from mixprec.demo.alternate import pair_ratio, pair_words, time_pair
from mixprec.demo.corpus import load_tokens
from mixprec.demo.environment import native_lowp, steady_slowdown
from mixprec.demo.estimate import Estimate, guess_seconds, load_factor
from mixprec.demo.model import ModelConfig
from mixprec.demo.report import format_checks, format_table, hardware_note
from mixprec.demo.results import DemoResult, ModeResult
from mixprec.demo.settings import Settings

CPU = torch.device("cpu")


class _Notes:
    def __init__(self) -> None:
        self.notes: list[str] = []

    def start(self, mode: str, total: int) -> None: ...
    def update(self, step: int, loss: float, scale: float | None) -> None: ...
    def finish(self, result: object) -> None: ...

    def note(self, text: str) -> None:
        self.notes.append(text)


class _Clock:
    """A fake ``time.perf_counter``: ``advance`` moves it."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def test_load_factor_is_runnable_threads_over_cores() -> None:
    assert load_factor(1, 2, 0.0) == 1.0 and load_factor(2, 2, 0.0) == 1.0
    assert load_factor(1, 2, 4.6) == 2.8 and load_factor(1, 2, 9.0) == 5.0
    with pytest.raises(ValueError, match="cores >= 1"):
        load_factor(1, 0, 1.0)


def test_first_guess_uses_the_load_it_prints() -> None:
    settings = Settings.for_size("tiny", steps=120)
    planned = ["fp32", "mixprec-fp16"]
    idle = sum(guess_seconds(settings, m) for m in planned)
    notes = _Notes()
    est = Estimate.start(settings, list(planned), CPU, notes, {"cores": 2, "load": 4.6, "threads": 1})
    assert est.announced == pytest.approx(2.8 * idle)
    assert "x2.8 for load 4.6 on 2 cores" in notes.notes[0]
    assert notes.notes[0].startswith(f"expected duration: about {estimate_module._words(2.8 * idle)} for 2 runs")


def test_first_guess_from_the_speed_panel_at_the_trained_size() -> None:
    settings = Settings.for_size("small", steps=300)  # batch 16
    panel = {"batch_size": 8, "sizes": [{"size": "small", "seconds": {"fp32": 0.1, "fp16": 4.0, "bf16": 0.2,
                                                                       "fp8": 0.5}}]}
    # fp32: the panel's step at batch 16; fp16-master: fp16's step times its cost over torch-amp's
    assert guess_seconds(settings, "fp32", panel) == pytest.approx(0.5 + 300 * 0.2)
    assert guess_seconds(settings, "fp16-master", panel) == pytest.approx(0.5 + 300 * 8.0 * 8.0 / 7.5)
    notes = _Notes()
    est = Estimate.start(settings, ["fp32"], CPU, notes, {"cores": 2, "load": 9.0, "threads": 1}, panel)
    assert est.announced == pytest.approx(0.5 + 300 * 0.2)  # measured under the load: no factor on top
    assert "from the speed panel's steps at `small` on this machine" in notes.notes[0]
    # a panel that did not time the trained size: the project's CPU times the load
    other = {"batch_size": 8, "sizes": [{"size": "tiny", "seconds": {"fp32": 0.01}}]}
    assert guess_seconds(settings, "fp32", other, 2.0) == pytest.approx(2 * guess_seconds(settings, "fp32"))


def test_estimate_corrects_itself_after_every_run(monkeypatch) -> None:
    clock = _Clock()
    monkeypatch.setattr(estimate_module.time, "perf_counter", clock)
    settings = Settings.for_size("tiny", steps=100)
    notes = _Notes()
    planned = ["fp32", "bf16-naive", "fp32", "bf16-naive"]  # two seeds
    est = Estimate.start(settings, list(planned), CPU, notes, {"cores": 2, "load": 0.0, "threads": 1})
    guess = {m: guess_seconds(settings, m) for m in ("fp32", "bf16-naive")}
    # the first run takes 4x its guess: the next fp32 takes as long, bf16-naive is scaled by 4
    watch = est.watch("fp32")
    clock.advance(4 * guess["fp32"])
    watch.finish(ModeResult("fp32", "", [1.0], 1.0, 1.0, {}, ""))
    assert est.left() == pytest.approx(4 * guess["bf16-naive"] + 4 * guess["fp32"] + 4 * guess["bf16-naive"])
    assert notes.notes[-1].startswith("estimate after 1 of 4 runs (fp32: ")
    # the second run as long as now expected: no new announcement
    count = len(notes.notes)
    watch = est.watch("bf16-naive")
    clock.advance(4 * guess["bf16-naive"])
    watch.finish(ModeResult("bf16-naive", "", [1.0], 1.0, 1.0, {}, ""))
    assert len(notes.notes) == count
    assert est.left() == pytest.approx(4 * guess["fp32"] + 4 * guess["bf16-naive"])
    # the machine gets busier: the third run takes 3x its measured time, the estimate follows
    watch = est.watch("fp32")
    clock.advance(12 * guess["fp32"])
    watch.finish(ModeResult("fp32", "", [1.0], 1.0, 1.0, {}, ""))
    assert est.left() == pytest.approx(4 * guess["bf16-naive"])  # bf16-naive's own last run
    assert notes.notes[-1].startswith("estimate after 3 of 4 runs (fp32: ")


def _fake_time_size(order: list[str]):
    def fake(size: str, train: torch.Tensor, device: torch.device, rounds: int) -> dict:
        order.append(size)
        return {"size": size, "seconds": {k: 0.001 for k in speed.KINDS}, "ratio": {k: 1.0 for k in speed.KINDS},
                "spread": {k: 0.0 for k in speed.KINDS}}

    return fake


def test_speed_panel_times_the_trained_size_first_whatever_the_budget(monkeypatch) -> None:
    order: list[str] = []
    monkeypatch.setattr(speed, "_time_size", _fake_time_size(order))
    train = torch.zeros(10, dtype=torch.long)
    panel = speed.measure(train, CPU, first="small", budget_s=0.0)
    assert order == ["small"] and [e["size"] for e in panel["sizes"]] == ["small"]
    assert list(panel["skipped"]) == ["tiny", "base"]
    order.clear()
    panel = speed.measure(train, CPU, first="small", budget_s=1e6)
    assert order == ["small", "tiny", "base"]
    assert [e["size"] for e in panel["sizes"]] == ["tiny", "small", "base"] and panel["skipped"] == {}
    with pytest.raises(ValueError, match="first among them"):
        speed.measure(train, CPU, sizes=("tiny",), first="small")


def test_a_large_steady_slowdown_is_quoted_with_its_band() -> None:
    """A 41x slowdown measured between 30x and 52x is no noise, however wide its relative band."""
    emulated = {"native": False, "slowdown": 41.0, "low": 30.0, "high": 52.0, "spread": 22 / 41}
    assert steady_slowdown(emulated) and not steady_slowdown({**emulated, "slowdown": 1.3, "low": 0.9})
    runs = [ModeResult("fp32", "", [1.0], 1.0, 1.0, {}, "")]
    env = {"cpu_lowp": {"float16": emulated, "bfloat16": {**emulated, "slowdown": 48.0, "low": 44.0, "high": 60.0}}}
    note = hardware_note(DemoResult(Settings.for_size("tiny", steps=1), "cpu", env, runs))
    assert note is not None and "too noisy" not in note
    assert "a matmul is float16 41.0x (30.0-52.0x), bfloat16 48.0x (44.0-60.0x) slower than float32" in note
    # where the CPU flags are unknown, the same measurement says "emulated"
    unknown = {d: {**info, "native": None} for d, info in env["cpu_lowp"].items()}
    assert native_lowp({"cpu_lowp": unknown}) == {"float16": False, "bfloat16": False}


def test_identical_kernels_are_the_same_within_their_noise_band() -> None:
    same = pair_ratio([0.050, 0.071, 0.049, 0.052, 0.066], [0.051, 0.050, 0.055, 0.050, 0.070])
    assert same["rounds"] == 5 and same["low"] <= 1.0 <= same["high"]
    assert pair_words(same, "torch-amp").endswith("the same within the noise")
    slower = pair_ratio([0.13, 0.14, 0.13, 0.135], [0.10, 0.10, 0.101, 0.099])
    assert slower["low"] > 1.0 and pair_words(slower, "torch-amp").endswith("different beyond the noise")
    with pytest.raises(ValueError, match="positive step times"):
        pair_ratio([0.1], [0.1, 0.2])


def test_table_and_check_show_the_alternated_ratio_not_the_sequential_one() -> None:
    def run(mode: str, tps: float) -> ModeResult:
        return ModeResult(mode, "", [2.0] * 4, 2.0, tps, {"params": 8}, "", scales=[4.0] * 4)

    runs = [run("fp32", 400.0), run("torch-amp", 300.0), run("mixprec-fp16", 227.0)]  # 1.32x sequentially
    timing = pair_ratio([0.050, 0.071, 0.049, 0.052, 0.066], [0.051, 0.050, 0.055, 0.050, 0.070])
    result = DemoResult(Settings.for_size("tiny", steps=4), "cpu", {}, runs, pairs={"mixprec-fp16 = torch-amp": timing})
    row = next(line for line in format_table(result).splitlines() if line.startswith("mixprec-fp16"))
    assert f"{timing['ratio']:.2f}x ({timing['low']:.2f}-{timing['high']:.2f})" in row and "1.32x" not in row
    assert format_checks(result) == [
        "mixprec-fp16 = torch-amp: identical (losses, scales, skipped steps)",
        "mixprec-fp16 against torch-amp, steps timed in alternation: " + pair_words(timing, "torch-amp")]


def test_time_pair_alternates_real_steps() -> None:
    settings = Settings(model=ModelConfig(seq_len=16, d_model=32, n_layers=1, n_heads=2), steps=3, batch_size=2,
                        lr=1e-3, eval_batches=1)
    timing = time_pair("mixprec-fp16", "torch-amp", settings, CPU, load_tokens()[0], rounds=3)
    assert timing["rounds"] == 3 and timing["mode_s"] > 0 and timing["reference_s"] > 0
    with pytest.raises(ValueError, match="rounds >= 3"):
        time_pair("mixprec-fp16", "torch-amp", settings, CPU, load_tokens()[0], rounds=2)
