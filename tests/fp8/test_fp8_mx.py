"""MXFP8 (``Float8Recipe.mxfp8()``): bitwise torchao 0.18's emulated ``MXFP8Linear`` on CPU.

Oracle: ``torchao.prototype.moe_training.mxfp8_linear.MXFP8Linear(kernel_preference=
KernelPreference.EMULATED)`` (RCEIL scales, its default): output and the gradients of input,
weight and bias; and ``torchao.prototype.mx_formats.mx_tensor.to_mx`` for the cast itself.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import mixprec
from mixprec import Policy, fp8
from mixprec.formats._blocks import quantize

from _models import mlp

mxfp8_linear = pytest.importorskip("torchao.prototype.moe_training.mxfp8_linear")
from torchao.prototype.mx_formats.config import ScaleCalculationMode  # noqa: E402
from torchao.prototype.mx_formats.mx_tensor import to_mx  # noqa: E402
from torchao.quantization.quantize_.common.kernel_preference import KernelPreference  # noqa: E402

MX = fp8.Float8Recipe.mxfp8()


def _torchao(k: int, n: int, dtype: torch.dtype, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return mxfp8_linear.MXFP8Linear(k, n, kernel_preference=KernelPreference.EMULATED,
                                    scale_calculation_mode=ScaleCalculationMode.RCEIL).to(dtype)


def _run(layer_fn, x: torch.Tensor, g: torch.Tensor, params: list[torch.Tensor]):
    x = x.detach().clone().requires_grad_()
    y = layer_fn(x)
    y.backward(g)
    return y.detach(), x.grad, [p.grad.clone() for p in params]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(32, 32, 64), (64, 96, 32), (2, 48, 128, 160)])
def test_mxfp8_linear_bitwise_torchao_emulated(dtype, shape):
    *lead, k, n = shape
    ref = _torchao(k, n, dtype)
    x = torch.randn(*lead, k, generator=torch.Generator().manual_seed(1)).to(dtype) * 3
    g = torch.randn(*lead, n, generator=torch.Generator().manual_seed(2)).to(dtype)
    y0, gx0, (gw0, gb0) = _run(ref, x, g, [ref.weight, ref.bias])
    w, b = (nn.Parameter(p.detach().clone()) for p in (ref.weight, ref.bias))
    y1, gx1, (gw1, gb1) = _run(lambda t: fp8.linear(t, w, b, MX), x, g, [w, b])
    assert y1.dtype == dtype and gw1.dtype == dtype
    for a, e in ((y1, y0), (gx1, gx0), (gw1, gw0), (gb1, gb0)):
        assert torch.equal(a, e)


def test_mx_cast_bitwise_torchao_to_mx():
    # zeros, tiny, huge, subnormal-range and mixed-magnitude blocks, e4m3 and e5m2 elements
    x = torch.randn(8, 256, generator=torch.Generator().manual_seed(3))
    x[0, :32] = 0
    x[1, :32] *= 1e-30
    x[2, :32] *= 1e30
    x[3, 32:64] *= torch.logspace(-20, 20, 32)
    x[4, 64:96] = 448.0
    for fmt, dtype in (("e4m3fn", torch.float8_e4m3fn), ("e5m2", torch.float8_e5m2)):
        for hp in (torch.float32, torch.bfloat16):
            xs = x.to(hp)
            scale, data = to_mx(xs, dtype, 32, ScaleCalculationMode.RCEIL)
            q, deq, amax = quantize(xs, fp8.Cast(fmt, "1x32"), True)
            assert torch.equal(q.view(torch.uint8), data.view(torch.uint8))
            expected = torch.exp2(scale.view(torch.uint8).float() - 127)
            assert torch.equal(deq, expected)
            assert torch.equal(amax, xs.abs().reshape(8, 8, 32).amax(-1))


def test_mx_partial_token_block_is_zero_padding():
    """Tokens that are not a multiple of 32: the last block of the grad_weight GEMM holds the rest,
    as torchao on zero-padded tokens (which it requires)."""
    dtype = torch.bfloat16
    ref = _torchao(64, 32, dtype)
    x = torch.randn(40, 64, generator=torch.Generator().manual_seed(4)).to(dtype)
    g = torch.randn(40, 32, generator=torch.Generator().manual_seed(5)).to(dtype)
    pad = lambda t: torch.cat([t, t.new_zeros(24, t.shape[1])])  # noqa: E731
    y0, gx0, (gw0,) = _run(ref, pad(x), pad(g), [ref.weight])
    w = nn.Parameter(ref.weight.detach().clone())
    y1, gx1, (gw1,) = _run(lambda t: fp8.linear(t, w, ref.bias.detach(), MX), x, g, [w])
    assert torch.equal(y1, y0[:40])
    assert torch.equal(gx1, gx0[:40])
    torch.testing.assert_close(gw1, gw0, rtol=1e-2, atol=1e-2)  # the same blocks; the mm's K differs


def _sqnr(ref: torch.Tensor, y: torch.Tensor) -> float:
    ref, y = ref.detach().double(), y.detach().double()
    return float(20 * torch.log10(ref.norm() / (ref - y).norm()))


def _sqnrs(recipe: fp8.Float8Recipe, x: torch.Tensor, w: torch.Tensor) -> tuple[float, float, float]:
    g = torch.randn(x.shape[0], w.shape[0], generator=torch.Generator().manual_seed(9))
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    (xr @ wr.t()).backward(g)
    xq, wq = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = fp8.linear(xq, wq, None, recipe)
    y.backward(g)
    return _sqnr(x @ w.t(), y), _sqnr(xr.grad, xq.grad), _sqnr(wr.grad, wq.grad)


def test_mxfp8_sqnr_256():
    gen = torch.Generator().manual_seed(7)
    x, w = torch.randn(256, 256, generator=gen), torch.randn(256, 256, generator=gen)
    out, gi, gw = _sqnrs(MX, x, w)
    assert min(out, gi, gw) >= 27, (out, gi, gw)


def test_mxfp8_recipe_by_name_everywhere():
    assert fp8.Float8Recipe.from_name("mxfp8") == MX == fp8.as_recipe("mxfp8")
    assert all(c.granularity == "1x32" and c.scale_format == "e8m0" for pair in MX.gemms().values() for c in pair)
    assert MX.multiple == 32 and MX.blocked and not MX.save_fp8
    policy = Policy.parse("compute=bf16,fp8=mxfp8")
    assert "fp8 mxfp8=Linear" in str(policy)
    assert Policy.from_json(policy.to_json()) == policy
    assert Policy.fp8("mxfp8").fp8_rule.recipe_name == "mxfp8"


def test_mxfp8_recipe_validation():
    mx = fp8.Cast("e4m3fn", "1x32")
    with pytest.raises(ValueError, match="pow2_scales=True"):
        fp8.Float8Recipe(mx, mx, mx, mx, mx, mx, save_fp8=False)
    with pytest.raises(ValueError, match="cannot be mixed"):
        fp8.Float8Recipe(mx, mx, mx, mx, fp8.Cast("e4m3fn", "row"), fp8.Cast("e4m3fn", "row"),
                         pow2_scales=True, save_fp8=False)
    with pytest.raises(ValueError, match="contracted dimension"):
        fp8.Float8Recipe(mx, fp8.Cast("e4m3fn", "1x128"), mx, mx, mx, mx, pow2_scales=True, save_fp8=False)
    with pytest.raises(ValueError, match="save_fp8"):
        fp8.Float8Recipe(mx, mx, mx, mx, mx, mx, pow2_scales=True)
    with pytest.raises(ValueError, match="'1x32'"):
        fp8.Cast("e4m3fn", "2x32")
    with pytest.raises(ValueError, match="needs a CUDA device of compute capability 10.0 or newer"):
        fp8.linear(torch.randn(32, 32), torch.randn(32, 32), recipe=MX, backend="scaled_mm")


def _model() -> nn.Module:
    """Linear layers '0', '2', '4', '6', '8'; '4' and '6' have 48 features (not a multiple of 32)."""
    return mlp(64, 64, 64, 48, 64, 32)


def test_mxfp8_selection_leaves_non_multiples_of_32_with_a_reason():
    why = r"'4': out_features=48 is not a multiple of 32 \(the 'mxfp8' recipe's block\)"
    with pytest.warns(UserWarning, match=why):
        chosen = fp8.select_layers(_model(), recipe="mxfp8")
    assert chosen == ["2"]  # 0 and 8 are first and last; 4 and 6 have 48 features
    assert fp8.select_layers(_model()) == ["2", "4", "6"]  # tensorwise: multiples of 16
    with pytest.warns(UserWarning, match=r"no layer selected.*multiples of 128 \(the 'blockwise' recipe's block\)"):
        fp8.select_layers(_model(), recipe="blockwise")


def test_mxfp8_convert_and_policy_train_alike_with_stats_and_guard():
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        converted = fp8.convert(_model(), "mxfp8", guard=(guard := fp8.Guard()))
    assert [n for n, m in converted.named_modules() if isinstance(m, fp8.Float8Linear)] == ["2"]
    assert converted[2].recipe == MX
    routed = _model()
    policy = Policy.parse("compute=bf16").fp8("mxfp8", guard=fp8.Guard())
    losses = []
    for model, region in ((converted, lambda: torch.autocast("cpu", torch.bfloat16)),
                          (routed, lambda: mixprec.autocast("cpu", policy=policy))):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with region():
                loss = model(x).float().square().mean()
        loss.backward()
        losses.append((loss.detach(), model[2].weight.grad.clone()))
    assert torch.equal(losses[0][0], losses[1][0]) and torch.equal(losses[0][1], losses[1][1])
    rows = fp8.stats(routed).to_list()
    assert [r["layer"] for r in rows] == ["2"] * 3
    assert all(r["amax"] > 0 and r["underflow"] < 0.05 for r in rows)
    assert guard.step() == [] and not fp8.layer_state(converted[2]).fallback


def test_mxfp8_audit_option():
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(4)])
    x, y = torch.randn(16, 64), torch.randn(16, 64)
    report = mixprec.audit(model, (x, y), lambda m, b: nn.functional.mse_loss(m(b[0]).float(), b[1]),
                           dtypes=(torch.bfloat16,), fp8="mxfp8")
    assert report.fp8.recipe == "mxfp8" and report.fp8.layers == ("1.0", "2.0")
    assert report.policy.fp8_rule.recipe_name == "mxfp8"


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
@pytest.mark.parametrize("recipe", ["mxfp8", "blockwise"])
def test_block_recipes_compile_fullgraph_bitwise_eager(recipe, backend):
    r, st = fp8.as_recipe(recipe), fp8.LayerState()
    w = nn.Parameter(torch.randn(128, 128))
    x, g = torch.randn(128, 128), torch.randn(128, 128)
    f = lambda t: fp8.linear(t, w, None, r, state=st, backend="emulate")  # noqa: E731
    eager = _run(f, x, g, [w]), st.stats.clone()
    w.grad = None
    st.reset()
    compiled = _run(torch.compile(f, fullgraph=True, backend=backend), x, g, [w]), st.stats.clone()
    (y0, gx0, (gw0,)), s0 = eager
    (y1, gx1, (gw1,)), s1 = compiled
    for a, e in ((y1, y0), (gx1, gx0), (gw1, gw0), (s1, s0)):
        assert torch.equal(a, e)


@pytest.mark.slow
def test_fp8_formats_benchmark_quick_run():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from benchmarks import fp8_formats

    res = fp8_formats.run(quick=True)
    assert set(res["recipes"]) == {"tensorwise", "rowwise", "mxfp8", "blockwise"}
    assert res["recipes"]["blockwise"]["step_ratio"] is None  # torchao: Triton only
    assert res["recipes"]["mxfp8"]["saved_ratio"] == 1.0  # both save x and W in high precision
    assert res["recipes"]["tensorwise"]["saved_ratio"] < 1 and res["machine"]["cpu"]


@pytest.mark.parametrize("recipe", ["mxfp8", "blockwise"])
def test_block_recipes_fp16_compute_in_fp32(recipe):
    """fp16 (which torchao's MX refuses): the same casts, the GEMMs in fp32, the results in fp16."""
    r = fp8.as_recipe(recipe)
    gen = torch.Generator().manual_seed(6)
    x, w = torch.randn(128, 128, generator=gen).half(), (torch.randn(128, 128, generator=gen) * 0.1).half()
    g = torch.randn(128, 128, generator=gen).half()
    wh, wf = nn.Parameter(w.clone()), nn.Parameter(w.float())
    half = _run(lambda t: fp8.linear(t, wh, None, r), x, g, [wh])
    full = _run(lambda t: fp8.linear(t, wf, None, r), x.float(), g.float(), [wf])
    assert half[0].dtype == torch.float16 and half[2][0].dtype == torch.float16
    for a, e in ((half[0], full[0]), (half[1], full[1]), (half[2][0], full[2][0])):
        assert torch.equal(a, e.half())


def test_mxfp8_conv1d_bitwise_torchao_on_the_equivalent_linear():
    pytorch_utils = pytest.importorskip("transformers.pytorch_utils")
    dtype = torch.bfloat16
    ref = _torchao(64, 96, dtype)
    conv = pytorch_utils.Conv1D(96, 64).to(dtype)  # weight [in, out]
    conv.weight.data.copy_(ref.weight.detach().t())
    conv.bias.data.copy_(ref.bias.detach())
    layer = fp8.Float8Conv1D.from_conv1d(conv, "mxfp8")
    x = torch.randn(2, 32, 64, generator=torch.Generator().manual_seed(1)).to(dtype)
    g = torch.randn(2, 32, 96, generator=torch.Generator().manual_seed(2)).to(dtype)
    y0, gx0, (gw0,) = _run(ref, x, g, [ref.weight])
    y1, gx1, (gw1,) = _run(layer, x, g, [layer.weight])
    assert torch.equal(y1, y0) and torch.equal(gx1, gx0) and torch.equal(gw1, gw0.t())
