"""The op tables against the running PyTorch: membership read from the dispatcher, the version
stamp, and a warning (never silence) when either differs."""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest
import torch

import mixprec
from mixprec import ops
from mixprec.ops import TABLES_TORCH, OpTableWarning, check_tables, default_table


def test_the_tables_are_the_running_torchs() -> None:
    assert tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) == TABLES_TORCH
    assert check_tables("cpu") is None and check_tables("cuda") is None


def test_ops_only_mixprec_registered_do_not_count() -> None:
    with mixprec.autocast("cpu", dtype=torch.float16, policy=mixprec.Policy.default("cuda")):
        torch.mv(torch.randn(3, 3), torch.randn(3))  # mv: on the CUDA table, not on the CPU one
    key_ops = {n.removeprefix("aten::")
               for n in torch._C._dispatch_get_registrations_for_dispatch_key("AutocastCPU")}
    assert "mv" in key_ops and "mv" not in default_table("cpu")
    assert check_tables("cpu") is None


def test_other_autocast_ops_are_named() -> None:
    table = set(default_table("cpu"))
    message = check_tables("cpu", registered=(table - {"mm", "bmm"}) | {"new_op"}, version=TABLES_TORCH)
    assert message is not None
    assert "not autocast here: bmm, mm" in message and "not in mixprec's table: new_op" in message
    assert "install torch==2.13.*" in message


def test_another_version_is_unverified() -> None:
    message = check_tables("cuda", registered=set(default_table("cuda")), version=(2, 14))
    assert message is not None and "torch 2.14" in message and "not verified" in message


def test_the_first_use_of_a_table_warns_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ops, "_checked", set())
    monkeypatch.setattr(ops, "_torch_version", lambda: (2, 12))
    with pytest.warns(OpTableWarning, match="torch 2.12.*not verified"):
        default_table("cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        default_table("cpu")  # checked once per device


@pytest.mark.slow
def test_importing_and_using_mixprec_on_the_tested_torch_warns_nothing() -> None:
    code = ("import warnings; warnings.simplefilter('error', RuntimeWarning)\n"
            "import torch, mixprec\n"
            "with mixprec.autocast('cpu', policy=mixprec.Policy().with_ops(fp32=['mm'])):\n"
            "    torch.mm(torch.ones(2, 2), torch.ones(2, 2))\n"
            "mixprec.Policy.default('cuda').table('cuda')\n"
            "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
