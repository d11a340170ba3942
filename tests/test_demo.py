"""The demo: corpus, model, every precision mode, determinism, and the report files."""

from __future__ import annotations

import dataclasses
import html
import io
import json
import math
import warnings
from pathlib import Path

import pytest
import torch

from mixprec.demo import corpus, train
from mixprec.demo.model import SIZES, ModelConfig, TransformerLM, lm_loss
from mixprec.demo.progress import LineProgress
from mixprec.demo.report import MEMORY_PARTS, format_table, hardware_note, write_report
from mixprec.demo.train import (
    DEFAULT_MODES,
    MODES,
    DemoResult,
    Mode,
    Settings,
    check_modes,
    run_demo,
    run_mode,
)

CPU = torch.device("cpu")
MICRO = ModelConfig(seq_len=16, d_model=32, n_layers=1, n_heads=2)


def micro(steps: int = 3, seed: int = 0) -> Settings:
    return Settings(model=MICRO, steps=steps, batch_size=2, lr=3e-3, seed=seed, eval_batches=1)


@pytest.fixture(scope="module")
def data() -> tuple[torch.Tensor, torch.Tensor]:
    return corpus.load_tokens()


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
    scaled = name in ("torch-amp", "mixprec-fp16", "fp16-master")
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
    monkeypatch.setattr(train, "_INIT_SCALE", 2.0**19)
    monkeypatch.setattr(train, "_GROWTH_INTERVAL", 3)
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
    monkeypatch.setattr(train, "_INIT_SCALE", 2.0**40)
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
    assert lines[0].split()[:3] == ["mode", "final", "loss"] and "vs torch-amp" in lines[0]
    assert [line.split()[0] for line in lines[2:]] == ["fp32", "torch-amp", "bf16-naive"]
    assert lines[3].split()[4] == "1.00x"  # torch-amp against itself


def test_hardware_note_names_emulated_dtypes(demo_result: DemoResult) -> None:
    env = dict(demo_result.environment)
    env["cpu_lowp"] = {"float16": {"native": False, "slowdown": 20.0},
                       "bfloat16": {"native": True, "slowdown": 0.5}}
    note = hardware_note(DemoResult(demo_result.settings, "cpu", env, demo_result.modes))
    assert note is not None and "no native float16 matmul" in note and "20.0x" in note
    env["cpu_lowp"] = {"float16": {"native": None, "slowdown": 1.1},
                       "bfloat16": {"native": None, "slowdown": 1.0}}
    assert hardware_note(DemoResult(demo_result.settings, "cpu", env, demo_result.modes)) is None


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
        "throughput": ["tokens / s"],
    }
