"""The demo's NVFP4 modes themselves (the bookkeeping around them: tests/demo/test_demo_fp4.py):
every GEMM of the fp4 layers counted in fp4, the hand recipe's first and last layers in bf16, the
controller's mode on the fp4 ladder."""

from __future__ import annotations

import pytest
import torch

from mixprec import Controller
from mixprec.demo.flops import GEMMS
from mixprec.demo.model import ModelConfig, TransformerLM
from mixprec.demo.modes import FP4_LADDER, FP4_MODES, MODES
from mixprec.demo.settings import Settings
from mixprec.demo.train import run_mode

CPU = torch.device("cpu")
MICRO = ModelConfig(seq_len=16, d_model=32, n_layers=1, n_heads=2)
KEPT = ("blocks.0.qkv", "head")  # the first and last Linear layers


def micro(steps: int) -> Settings:
    return Settings(model=MICRO, steps=steps, batch_size=2, lr=3e-3, eval_batches=1)


def test_the_setups_run_nvfp4_with_the_controller_only_in_mixprec_fp4() -> None:
    torch.manual_seed(0)
    for name in FP4_MODES:
        setup = MODES[name].setup(TransformerLM(MICRO), micro(1), CPU)
        rule = setup.fp8_policy.fp8_rule
        assert setup.fp8_recipe == "nvfp4" and rule.recipe_for("blocks.0.fc").fp4
        assert rule.first_last == ("keep" if name == "mixprec-fp4-hand" else "fp8")
        assert (setup.fp8_controller is not None) == (name == "mixprec-fp4") and setup.fp8_guard is None
        assert rule.live is setup.fp8_controller
    ctl = MODES["mixprec-fp4"].setup(TransformerLM(MICRO), micro(1), CPU).fp8_controller
    assert isinstance(ctl, Controller) and ctl.ladder == FP4_LADDER
    assert ctl.settings.cost_row_share == 0.25 and ctl.settings.max_loss_cost == 1e-3  # (docs/controller.md)


@pytest.mark.parametrize("name", FP4_MODES)
def test_each_gemm_runs_in_fp4_but_the_hand_recipes_first_and_last(name: str) -> None:
    run = run_mode(name, micro(3), CPU)
    for layer, entry in run.gemms["layers"].items():
        kept = name == "mixprec-fp4-hand" and layer in KEPT
        # 3 steps, before the controller's first check (every 10): nothing has moved
        assert entry["gemms"] == {g: {"fp4": 0 if kept else 3, "fp8": 0, "high": 3 if kept else 0} for g in GEMMS}
    flops = {layer: e["flops_per_gemm"] for layer, e in run.gemms["layers"].items()}
    expected = 1.0 if name != "mixprec-fp4-hand" else 1 - sum(flops[k] for k in KEPT) / sum(flops.values())
    assert run.gemms["fp4_share"] == pytest.approx(expected)
