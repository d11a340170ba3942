"""The backend ``"emulate_tc"``: GEMMs accumulated as an fp8 tensor core does (formats/_accumulate.py;
DeepSeek-V3: about 14 bits kept on H800, partial sums promoted to float32 every 128 elements of K).

Expectations follow from the model, measured against float64 in this run: on long K the tensor
core's result errs by about ``2**-13`` relative, toward zero (truncation), while float32
accumulation errs by orders of magnitude less; without the promotion the error grows with K.
"""

from __future__ import annotations

import pytest
import torch

from mixprec import Policy, fp8
from mixprec.formats._accumulate import GROUP, INTERVAL, KEPT_BITS, tensor_core_mm


def _positive(m: int, k: int, n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(m, k, generator=g), torch.rand(k, n, generator=g)


def _relative(out: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    return (out.double() - exact) / exact


@pytest.mark.parametrize("k", [1024, 8192])
def test_long_k_loses_about_14_bits_toward_zero(k):
    a, b = _positive(32, k, 32)
    exact = a.double() @ b.double()
    tc, fp32 = _relative(tensor_core_mm(a, b), exact), _relative(a @ b, exact)
    # truncation: every sum of positive products is cut toward zero, each cut below 2**-13 relative
    assert float(tc.max()) <= 2 ** -22
    assert 2 ** -16 < -float(tc.mean()) < 2 ** -12 and float(tc.abs().max()) < 4 * 2 ** -(KEPT_BITS - 1)
    # float32 accumulation: errs far less, not biased
    assert float(fp32.abs().max()) < 2 ** -18 < -float(tc.mean()) / 16
    assert abs(float(fp32.mean())) < 2 ** -24


def test_the_promotion_bounds_the_error_on_long_k():
    """Without promotion (fast accumulation) the error grows with K; with it, it does not."""
    errors = {}
    for k in (1024, 8192):
        a, b = _positive(16, k, 16, seed=k)
        exact = a.double() @ b.double()
        errors[k] = (-float(_relative(tensor_core_mm(a, b), exact).mean()),
                     -float(_relative(tensor_core_mm(a, b, interval=k), exact).mean()))
    assert errors[8192][1] > 4 * errors[1024][1] > 4 * errors[1024][0]
    assert errors[8192][0] < 2 * errors[1024][0]
    with pytest.raises(ValueError, match=f"multiple of {GROUP}"):
        tensor_core_mm(*_positive(2, 64, 2), interval=INTERVAL + 1)


def test_short_sums_are_exact_where_14_bits_hold_them():
    """Sums that fit 14 bits (small integers) lose nothing: the model drops only what is beyond."""
    a = torch.randint(0, 4, (8, 256)).float()
    b = torch.randint(0, 4, (256, 8)).float()
    assert torch.equal(tensor_core_mm(a, b), a @ b)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "mxfp8", "blockwise", "mxfp4", "nvfp4"])
def test_linear_under_emulate_tc_errs_toward_zero_against_emulate_fp32(recipe):
    """The same casts, another accumulation: on K = 4096 with positive operands the three GEMMs
    under ``"emulate_tc"`` come out slightly smaller than under ``"emulate_fp32"`` (float32
    accumulation), by about 2**-13 relative. Except MXFP4: a 32-element block is one MMA group, so a
    group's sum is a small integer (e2m1 codes hold 2 significant bits) times one power of 2, and
    four of them fit 14 bits: nothing is lost, the two backends agree bitwise."""
    r = fp8.as_recipe(recipe)
    if r.fp4:  # (no stochastic rounding: the two runs must cast alike)
        import dataclasses
        r = dataclasses.replace(r, stochastic_rounding=False)
    g = torch.Generator().manual_seed(1)
    x = torch.rand(32, 4096, generator=g).requires_grad_()
    w = torch.rand(128, 4096, generator=g).requires_grad_()
    outs = {}
    for backend in ("emulate_fp32", "emulate_tc"):
        y = fp8.linear(x, w, recipe=r, backend=backend)
        gx, gw = torch.autograd.grad(y, (x, w), torch.ones_like(y))
        outs[backend] = (y, gx, gw)
    for fp32, tc in zip(outs["emulate_fp32"], outs["emulate_tc"]):
        fp32, tc = fp32.detach(), tc.detach()
        if recipe == "mxfp4":
            assert torch.equal(tc, fp32)
            continue
        rel = (tc.double() - fp32.double()) / fp32.double()
        assert not torch.equal(tc, fp32)
        # (fp4: with the Hadamard transform, grad_weight's dequantized operands are not all positive)
        assert -2 ** -11 < float(rel.mean()) < (0 if r.hadamard else -2 ** -17), recipe


def test_the_policy_carries_emulate_tc():
    policy = Policy(compute=torch.bfloat16).fp8("mxfp8", backend="emulate_tc")
    assert "backend=emulate_tc" in str(policy)
    assert Policy.parse(str(policy)) == policy
    assert Policy.from_json(policy.to_json()) == policy
    with pytest.raises(ValueError, match="emulate_tc"):
        fp8.linear(torch.randn(2, 32), torch.randn(32, 32), backend="emulate_tcx")


def test_the_demo_shows_both_accumulations():
    """``mixprec demo --fp8-accumulate tensor_core``: the fp8 and fp4 modes' GEMMs under
    ``"emulate_tc"``; by default their own backends (fp8: ``"auto"``, fp4: ``"emulate_fp32"``)."""
    import dataclasses

    from mixprec.cli import build_parser
    from mixprec.demo.model import ModelConfig, TransformerLM
    from mixprec.demo.modes import FP4_BACKEND, MODES
    from mixprec.demo.settings import Settings
    from mixprec.demo.train import run_mode

    micro = Settings(model=ModelConfig(seq_len=16, d_model=32, n_layers=1, n_heads=2), steps=1, batch_size=2,
                     lr=3e-3, eval_batches=1)
    tc = dataclasses.replace(micro, fp8_accumulate="tensor_core")
    low = [name for name in MODES if "fp8" in name or "fp4" in name]
    assert len(low) >= 4
    for name in low:
        default = FP4_BACKEND if "fp4" in name else "auto"
        torch.manual_seed(0)
        assert MODES[name].setup(TransformerLM(micro.model), micro, torch.device("cpu")).fp8_policy.fp8_rule.backend \
            == default
        assert MODES[name].setup(TransformerLM(micro.model), tc, torch.device("cpu")).fp8_policy.fp8_rule.backend \
            == "emulate_tc"
    losses = [run_mode("mixprec-fp8", s, torch.device("cpu")).losses for s in (micro, tc)]
    assert all(torch.isfinite(torch.tensor(v)).all() for v in losses)
    with pytest.raises(ValueError, match="fp8_accumulate"):
        dataclasses.replace(micro, fp8_accumulate="bf16")
    args = build_parser().parse_args(["demo", "--fp8-accumulate", "tensor_core"])
    assert args.fp8_accumulate == "tensor_core"
