"""The `mixprec audit` command: report folder on success, one clear line on bad targets."""

from __future__ import annotations

import argparse
import logging
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import mixprec
from mixprec.diagnostics.cli import add_audit_parser, audit_command

FACTORIES = textwrap.dedent(
    """
    import torch
    from torch import nn

    def good():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        return model, torch.randn(3, 4), lambda m, x: m(x).float().square().mean()

    def raising():
        raise KeyError("no data")

    def exiting():
        import sys
        sys.exit(0)

    def two():
        return 1, 2

    def not_a_model():
        return "model", None, print

    def crashing_loss():
        return nn.Linear(4, 1), torch.randn(3, 4), lambda m, x: m(x)[7].sum()

    def nan_model():
        model = nn.Linear(4, 1)
        with torch.no_grad():
            model.weight.fill_(float("nan"))
        return model, torch.randn(3, 4), lambda m, x: m(x).sum()

    VALUE = 3
    """
)


@pytest.fixture()
def targets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "diag_factories.py").write_text(FACTORIES)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def run(target: str, out: Path, **kw) -> int:  # type: ignore[no-untyped-def]
    opts = dict(device_type="cpu", dtypes=["bfloat16"], steps=1)
    opts.update(kw)
    return audit_command(target, str(out), **opts)


def test_success_writes_report(targets: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = targets / "report"
    assert run("diag_factories:good", out, dtypes=["fp16", "bfloat16"]) == 0
    assert (out / "index.html").exists()
    data = json.loads((out / "report.json").read_text())
    assert data["dtypes"] == ["float16", "bfloat16"]
    policy = mixprec.Policy.load(out / "report.json")  # the recommendation, ready to use
    assert policy.compute == getattr(torch, data["dtype"]) and str(policy) == data["policy_text"]
    printed = capsys.readouterr().out
    assert "mixprec audit (cpu)" in printed and "index.html" in printed


@pytest.mark.parametrize(
    "target, message",
    [
        ("no_such_pkg_xyz.mod:factory", "cannot import 'no_such_pkg_xyz.mod'"),
        ("diag_factories:missing", "has no attribute 'missing'"),
        ("diag_factories:VALUE", "not a callable factory"),
        ("diag_factories:raising", "raised KeyError"),
        ("diag_factories:exiting", "raised SystemExit: 0"),  # (it ended the command with 0, no report)
        ("diag_factories:two", "must return (model, batch, loss_fn), got a 2-tuple"),
        ("diag_factories:not_a_model", "not an nn.Module"),
        ("diag_factories", "must look like package.module:factory"),
    ],
)
def test_bad_targets_give_one_line(targets: Path, capsys: pytest.CaptureFixture[str],
                                   target: str, message: str) -> None:
    assert run(target, targets / "out") == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and err.startswith("mixprec audit: ")
    assert not (targets / "out").exists()


def test_bad_dtype_is_one_line(targets: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run("diag_factories:good", targets / "out", dtypes=["float32"]) == 2
    assert "float16 and bfloat16" in capsys.readouterr().err


def test_argparse_registration(targets: Path) -> None:
    parser = argparse.ArgumentParser(prog="mixprec")
    add_audit_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["audit", "diag_factories:good", "--out", str(targets / "r"),
                              "--dtypes", "bfloat16", "--steps", "1"])
    assert (args.command, args.device, args.steps) == ("audit", "cpu", 1)
    assert args.func(args) == 0 and (targets / "r" / "report.json").exists()


def test_fp8_option(targets: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run("diag_factories:good", targets / "out", fp8="fp2") == 2
    assert "--fp8: unknown fp8 recipe 'fp2'" in capsys.readouterr().err
    parser = argparse.ArgumentParser(prog="mixprec")
    add_audit_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["audit", "diag_factories:good", "--out", str(targets / "r"),
                              "--dtypes", "bfloat16", "--fp8", "rowwise"])
    assert args.func(args) == 0
    fp8 = json.loads((targets / "r" / "report.json").read_text())["fp8"]
    assert fp8["recipe"] == "rowwise" and fp8["layers"] == []  # 4 -> 8 -> 1: no dims of 16
    assert fp8["stay"]["0"] == "in_features=4 and out_features=8 are not multiples of 16"
    assert "fp8 (rowwise): (no layer)" in capsys.readouterr().out


MAIN = Path(__file__).resolve().parents[2] / "src" / "mixprec" / "__main__.py"


@pytest.mark.slow
@pytest.mark.skipif(not MAIN.exists(), reason="mixprec/__main__.py not there yet")
def test_python_dash_m_bad_target_is_one_line(targets: Path) -> None:
    """Through the interpreter (each message is checked in-process above): one line, exit 2,
    no traceback, nothing written."""
    env = dict(os.environ, PYTHONPATH=str(targets))
    proc = subprocess.run([sys.executable, "-m", "mixprec", "audit", "diag_factories:raising"],
                          capture_output=True, text=True, env=env, cwd=targets, timeout=180)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == "mixprec audit: factory diag_factories:raising raised KeyError: 'no data'\n"
    assert proc.stdout == "" and not (targets / "mixprec-audit").exists()


@pytest.mark.parametrize(
    "target, options, code, message",
    [
        ("diag_factories:good", dict(device_type="cuda"), 2,
         "the model is on cpu but --device cuda: autocast for 'cuda' would leave it in float32; "
         "pass --device cpu or move the model"),
        ("diag_factories:good", dict(dtypes=[]), 2, "--dtypes is empty"),
        ("diag_factories:good", dict(steps=0), 2, "--steps must be"),
        ("diag_factories:crashing_loss", {}, 1, "the audit failed: IndexError: index 7"),
        ("diag_factories:nan_model", {}, 1, "already in float32"),
    ],
)
def test_bad_options_and_failing_models_give_one_line(
        targets: Path, capsys: pytest.CaptureFixture[str], target: str, options: dict,
        code: int, message: str) -> None:
    assert run(target, targets / "out", **options) == code
    *progress, last = capsys.readouterr().err.splitlines()
    assert message in last and last.startswith("mixprec audit: ") and "] " not in last[:30]
    assert all(re.match(r"mixprec audit: \[ *\d+\.\d s\] ", line) for line in progress)  # the steps run
    assert not (targets / "out").exists()  # nothing left behind


@pytest.mark.parametrize(
    "out, message",
    [
        ("file", "--out '{out}' is a file, not a folder; give a folder for the report"),
        ("file/out", "cannot create the report folder '{out}': '{file}' is a file, not a folder"),
    ],
)
def test_out_that_cannot_hold_the_report_is_one_line_exit_1(
        targets: Path, capsys: pytest.CaptureFixture[str], out: str, message: str) -> None:
    """As ``mixprec demo``: one clear line and exit status 1, before the model is built."""
    (targets / "file").write_text("")
    path = targets / out
    assert run("diag_factories:raising", path) == 1  # the factory would raise: not reached
    err = capsys.readouterr().err
    assert err == f"mixprec audit: {message.format(out=path, file=targets / 'file')}\n"


@pytest.mark.slow
@pytest.mark.skipif(not MAIN.exists(), reason="mixprec/__main__.py not there yet")
def test_python_dash_m(targets: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(targets))
    good = subprocess.run([sys.executable, "-m", "mixprec", "audit", "diag_factories:good",
                           "--out", "r", "--dtypes", "bfloat16"],
                          capture_output=True, text=True, env=env, cwd=targets, timeout=120)
    assert good.returncode == 0, good.stderr
    assert (targets / "r" / "index.html").exists()


LONG_NAMES = textwrap.dedent(
    """
    import torch
    from torch import nn

    class Blow(nn.Module):  # overflows float16 inside
        def forward(self, x):
            h = x * 1e6
            return h / h.norm(dim=-1, keepdim=True)

    def long_names():
        torch.manual_seed(0)
        model = nn.Sequential()
        model.add_module("an_input_projection_with_a_long_descriptive_name", nn.Linear(4, 8))
        model.add_module("a_normalisation_that_overflows_in_half_precision", Blow())
        model.add_module("the_output_head_with_another_long_descriptive_name", nn.Linear(8, 1))
        return model, torch.randn(3, 4), lambda m, x: m(x).float().square().mean()
    """
)


def test_the_command_reports_progress_and_prints_a_pasteable_shell_recommendation(
        targets: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Progress lines on stderr, one per step (before: silent for the whole run, 92 s for GPT-2
    with --fp8 auto); the "use it" line loads the policy file it wrote (before: it spoke of
    ``report.policy``, an object a shell user does not have); the policy line is not wrapped at 80
    columns (before: rich wrapped it, so it could not be pasted)."""
    (targets / "diag_long.py").write_text(LONG_NAMES)
    out = targets / "report"
    assert run("diag_long:long_names", out, dtypes=["float16"], full=True) == 0
    captured = capsys.readouterr()
    steps = [re.sub(r"^mixprec audit: \[ *\d+\.\d s\] ", "", line) for line in captured.err.splitlines()]
    assert steps[0].startswith("float32 reference") and steps[-1] == "done"
    assert "float16: the default policy" in steps
    assert any(step.startswith("float16: verifying with 1 module(s) kept in float32") for step in steps)
    policy = mixprec.Policy.load(out / "report.json")
    lines = captured.out.splitlines()
    assert f"policy: {policy}" not in lines  # --full: by exact names, not the short form saved
    full = mixprec.Policy.from_dict(json.loads((out / "report.json").read_text())["policy_full"])
    assert len(str(full)) > 80 and f"policy: {full}" in lines  # whole, on one line
    assert steps[-2:] == ["writing the report (figures: a few seconds)", "done"]
    use = next(line for line in lines if line.startswith("use it: "))
    assert f"mixprec.Policy.load({str(out / 'report.json')!r})" in use and "report.policy" not in use


def test_an_fp8_dtype_names_the_command_line_option(targets: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--dtypes float8_e4m3fn`` points to ``--fp8 tensorwise`` (before: ``pass fp8='tensorwise'``,
    the Python keyword, to a shell user)."""
    assert run("diag_factories:good", targets / "out", dtypes=["float8_e4m3fn"]) == 2
    err = capsys.readouterr().err
    assert "pass --fp8 tensorwise (or another recipe)" in err and "fp8=" not in err
    with pytest.raises(ValueError, match="pass fp8='tensorwise'"):  # the Python API keeps its own
        mixprec.audit(torch.nn.Linear(2, 1), torch.randn(1, 2), lambda m, x: m(x).sum(), dtypes=["float8_e4m3fn"])


def test_quiet_imports_drops_torchaos_import_noise_and_nothing_else(caplog: pytest.LogCaptureFixture) -> None:
    """Issue 42: importing transformers logged torchao's "Failed to load ... .so" lines (CPU torch)
    and torch's KernelPreference deprecation before the command's first line. Only those go."""
    from mixprec._quiet import quiet_imports

    ao, pytree = logging.getLogger("torchao"), logging.getLogger("torch.utils._pytree")
    deprecation = ("<enum 'KernelPreference'> is an Enum subclass and is now natively supported by "
                   "torch.compile as an opaque value type. Calling register_constant() ...")
    with caplog.at_level(logging.WARNING):
        with quiet_imports():
            pytree.warning(deprecation)
            ao.warning("something torchao means")
            pytree.warning("another pytree warning")
            if torch.version.cuda is None:
                ao.warning("Failed to load /x/torchao/_C_mxfp8.so: Could not load this library")
        pytree.warning(deprecation)  # outside: as before
    assert [r.getMessage() for r in caplog.records] == [
        "something torchao means", "another pytree warning", deprecation]
    assert not ao.filters and not pytree.filters  # removed on exit


TRANSFORMERS_FACTORY = textwrap.dedent(
    """
    import torch
    import transformers

    def tiny_llama():
        torch.manual_seed(0)
        cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                       num_hidden_layers=1, num_attention_heads=2,
                                       num_key_value_heads=1, head_dim=16, max_position_embeddings=16)
        ids = torch.randint(0, 64, (2, 8))
        return transformers.LlamaForCausalLM(cfg), ids, lambda m, x: m(input_ids=x, labels=x).loss
    """
)


@pytest.mark.slow
def test_the_audit_of_a_transformers_model_starts_with_its_own_lines(targets: Path) -> None:
    """``mixprec audit`` on a factory importing transformers: no torchao/pytree import noise on
    stderr, where a plain import of transformers in the same environment logs it."""
    pytest.importorskip("transformers")
    (targets / "diag_hf.py").write_text(TRANSFORMERS_FACTORY)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(targets), str(MAIN.parents[1])]))
    plain = subprocess.run([sys.executable, "-c", "import diag_hf; diag_hf.tiny_llama()"], capture_output=True,
                           text=True, env=env, cwd=targets, timeout=300)
    noise = ["Failed to load", "KernelPreference", "Skipping import of cpp extensions"]
    if not any(n in plain.stderr for n in noise):
        pytest.skip("this environment's transformers imports without torchao's noise")
    run = subprocess.run([sys.executable, "-m", "mixprec", "audit", "diag_hf:tiny_llama", "--out", "r",
                          "--dtypes", "bfloat16"], capture_output=True, text=True, env=env, cwd=targets,
                         timeout=600)
    assert run.returncode == 0, run.stderr
    assert not any(n in run.stderr for n in noise), run.stderr
    assert run.stderr.startswith("mixprec audit: [")
