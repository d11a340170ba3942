"""The public surface: every exported name resolves, nothing private leaks, the import is light."""

from __future__ import annotations

import subprocess
import sys

import pytest

import mixprec

CONTRACT = [
    "autocast", "is_autocast_enabled", "get_autocast_dtype", "custom_fwd", "custom_bwd", "Policy",
    "GradScaler", "skip_aware", "to_low_precision", "MasterWeights", "optim",
    "trace_nonfinite", "collect_ranges", "audit", "AuditReport", "DeviceTypeError",
]


@pytest.mark.parametrize("name", CONTRACT)
def test_contract_names_exist(name):
    assert name in mixprec.__all__
    assert getattr(mixprec, name) is not None


def test_all_is_public_and_resolves():
    for name in mixprec.__all__:
        assert not name.startswith("_")
        getattr(mixprec, name)
    assert set(mixprec.__all__) <= set(dir(mixprec))
    with pytest.raises(AttributeError, match="no attribute"):
        mixprec.does_not_exist  # noqa: B018


def test_optim_names():
    assert {"AdamW", "SGD"} <= set(mixprec.optim.__all__)


@pytest.mark.slow
def test_import_is_light():
    # tqdm is left out: torch itself imports it (torch.hub)
    code = ("import sys, mixprec; mixprec.autocast; mixprec.GradScaler; mixprec.Policy;"
            "mixprec.MasterWeights; mixprec.optim.AdamW; mixprec.trace_nonfinite;"
            "print(sorted(m for m in ('matplotlib', 'rich', 'tensorboard', 'hypothesis', 'numpy.testing')"
            " if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
