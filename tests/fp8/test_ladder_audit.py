"""audit(..., fp8="auto-fp4"): a format per layer with the fp4 formats tried first, each judged
by fp4's limits (the controller's fp4_max_underflow, an SQNR floor of 13 dB); a layer whose
input has an outlier feature among ordinary ones stays in fp8. fp8="auto" is unchanged."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import mixprec
from mixprec import Policy

from mixprec.diagnostics._fp8_audit import FP4_MIN_SQNR_DB


class Net(nn.Module):
    """``inp -> a -> b -> c -> out``; ``b``'s input feature 0 is shifted by 1e3: an e2m1 block
    holding it flushes the rest of its block (MXFP4: 31 of 32 features), an fp8 tensor scale
    does not (ordinary values ~0.5 sit well above e4m3's floor at 448 / 1e3)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.a, self.b, self.c = nn.Linear(32, 128), nn.Linear(128, 128), nn.Linear(128, 128), nn.Linear(128, 128)
        self.out = nn.Linear(128, 16)
        shift = torch.zeros(128)
        shift[0] = 1e3
        self.register_buffer("shift", shift)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(torch.tanh(self.inp(x)))) + self.shift
        return self.out(torch.tanh(self.c(torch.tanh(self.b(h)))))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(16, 32, generator=g), torch.randn(16, 16, generator=g)


def _loss(m: nn.Module, b) -> torch.Tensor:
    return nn.functional.mse_loss(m(b[0]).float(), b[1])


@pytest.fixture(scope="module")
def report():
    return mixprec.audit(Net(), _batch(), _loss, dtypes=(torch.bfloat16,), fp8="auto-fp4")


def test_auto_fp4_puts_ordinary_layers_in_mxfp4_and_the_outlier_layer_in_fp8(report):
    advice = report.fp8
    assert advice.verified and advice.recipes == {"a": "mxfp4", "b": "tensorwise", "c": "mxfp4"}
    assert list(advice.rejected["b"]) == ["mxfp4", "nvfp4"]
    assert all(why.startswith("input underflow = ") and why.endswith("> 0.15") for why in advice.rejected["b"].values())
    assert all(advice.stats[n]["output_sqnr_db"] >= FP4_MIN_SQNR_DB for n in ("a", "c"))
    rule = report.policy.fp8_rule
    assert rule.recipe_for("a").name == "mxfp4" and rule.recipe_for("b").name == "tensorwise"


def test_auto_without_fp4_is_unchanged_and_a_bad_name_says_what_to_pass():
    report = mixprec.audit(Net(), _batch(), _loss, dtypes=(torch.bfloat16,), fp8="auto")
    assert not any(r.endswith("fp4") for r in report.fp8.recipes.values())
    assert all("mxfp4" not in why for why in report.fp8.rejected.values())
    with pytest.raises(ValueError, match="or 'auto'"):
        mixprec.audit(Net(), _batch(), _loss, dtypes=(torch.bfloat16,), fp8="auto-fp5")
    assert isinstance(report.policy, Policy)
