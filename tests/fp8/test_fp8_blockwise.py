"""Blockwise fp8 (``Float8Recipe.blockwise()``, DeepSeek-V3 section 3.3) against references.

torchao's blockwise training path (``torchao.prototype.blockwise_fp8_training``) needs Triton
(a GPU), so the GEMMs are checked against an independent reference written here from the
published definition, and the casts also against torchao's pure-PyTorch helpers
(``torch_blockwise_scale_act_quant_lhs/_rhs``, ``torch_blockwise_scale_weight_quant``), read
from the installed torchao source (its module imports Triton at the top).
"""

from __future__ import annotations

import ast
import importlib.util
import math
import warnings
from pathlib import Path
from typing import Tuple

import pytest
import torch
from torch import nn

from mixprec import fp8
from mixprec.formats._blocks import quantize

BW = fp8.Float8Recipe.blockwise()
E4M3 = torch.float8_e4m3fn
FMAX = torch.finfo(E4M3).max


def _torchao_helpers() -> dict:
    spec = importlib.util.find_spec("torchao")
    if spec is None or spec.origin is None:
        pytest.skip("torchao is not installed")
    path = Path(spec.origin).parent / "prototype" / "blockwise_fp8_training" / "kernels.py"
    tree = ast.parse(path.read_text())
    wanted = {"torch_blockwise_scale_act_quant_lhs", "torch_blockwise_scale_act_quant_rhs",
              "torch_blockwise_scale_weight_quant"}
    nodes = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in wanted]
    assert {n.name for n in nodes} == wanted
    namespace = {"torch": torch, "Tuple": Tuple, "EPS": 1e-12, "e4m3_dtype": E4M3, "FP8_E4M3_DTYPES": (E4M3,)}
    exec(compile(ast.Module(body=nodes, type_ignores=[]), str(path), "exec"), namespace)
    return namespace


# --- the reference, from the definition: amax per tile/block, scale = 448 / max(amax, 1e-12)
# (float64, then float32), q = e4m3(clamp(x * scale)), dequantized with 1/scale; fp32 GEMM.

def _ref_quant(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Dequantized float32 copy of the 2-D ``x`` cast by (rows x cols) blocks."""
    out = torch.empty(x.shape, dtype=torch.float32)
    for i in range(0, x.shape[0], rows):
        for j in range(0, x.shape[1], cols):
            blk = x[i:i + rows, j:j + cols].float()
            amax = max(float(blk.abs().max()), 1e-12)
            scale = torch.tensor(FMAX / amax, dtype=torch.float64).float()
            q = (blk * scale).clamp(-FMAX, FMAX).to(E4M3)
            out[i:i + rows, j:j + cols] = q.float() * (1.0 / scale)
    return out


def _reference(x: torch.Tensor, w: torch.Tensor, g: torch.Tensor):
    """(output, grad_input, grad_weight) of ``x @ w.t()``: x by 1x128 tiles along K, w by 128x128
    blocks; grad_output by 1x128 tiles along N (grad_input) and along the tokens (grad_weight),
    x by 128x1 tiles along the tokens (grad_weight)."""
    dt = x.dtype
    out = (_ref_quant(x, 1, 128) @ _ref_quant(w, 128, 128).t()).to(dt)
    grad_input = (_ref_quant(g, 1, 128) @ _ref_quant(w.t(), 128, 128).t()).to(dt)
    grad_weight = (_ref_quant(g.t(), 1, 128) @ _ref_quant(x.t(), 1, 128).t()).to(dt)
    return out, grad_input, grad_weight


def _ours(x: torch.Tensor, w: torch.Tensor, g: torch.Tensor, recipe=BW):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = fp8.linear(x, w, None, recipe)
    y.backward(g)
    return y.detach(), x.grad, w.grad


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("mkn", [(128, 128, 128), (256, 128, 384), (200, 256, 128)])
def test_blockwise_bitwise_reference(dtype, mkn):
    m, k, n = mkn  # 200 tokens: the last tile of the grad_weight GEMM holds 72
    gen = torch.Generator().manual_seed(m + k + n)
    x = (torch.randn(m, k, generator=gen) * torch.logspace(-3, 3, k)).to(dtype)  # features of every scale
    w = torch.randn(n, k, generator=gen).to(dtype) * 0.05
    g = torch.randn(m, n, generator=gen).to(dtype)
    for got, expected in zip(_ours(x, w, g), _reference(x, w, g)):
        assert got.dtype == dtype
        assert torch.equal(got, expected)


def test_blockwise_casts_bitwise_torchao_helpers():
    h = _torchao_helpers()
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(256, 384, generator=gen) * torch.logspace(-4, 4, 384)).to(torch.bfloat16)
    x[:128, :128] = 0  # an all-zero block: scale 448 / 1e-12
    tile, block = fp8.Cast("e4m3fn", "1x128"), fp8.Cast("e4m3fn", "128x128")
    for ours, (q, inv) in (
        (quantize(x, tile, False), h["torch_blockwise_scale_act_quant_lhs"](x, 128)),
        (quantize(x, block, False), h["torch_blockwise_scale_weight_quant"](x, 128)),
    ):
        assert torch.equal(ours[0].view(torch.uint8), q.view(torch.uint8))
        assert torch.equal(ours[1], inv)
    # 128x1 tiles (x in the grad_weight GEMM): ours cast x.t() by 1x128 tiles
    q, inv = h["torch_blockwise_scale_act_quant_rhs"](x.contiguous(), 128)
    ours = quantize(x.t().contiguous(), tile, False)
    assert torch.equal(ours[0].t().view(torch.uint8), q.view(torch.uint8))
    # all-zero tiles aside: this helper clamps the amax to 1e-12 in bfloat16 before float64 (its
    # lhs sibling, and we, in float64); their q is 0 either way
    nonzero = ours[2].t() > 0
    assert torch.equal(ours[1].t()[nonzero], inv[nonzero]) and not nonzero.all()


def _sqnr(ref: torch.Tensor, y: torch.Tensor) -> float:
    ref, y = ref.detach().double(), y.detach().double()
    return float(20 * torch.log10(ref.norm() / (ref - y).norm()))


def _sqnrs(recipe, x, w) -> list[float]:
    g = torch.randn(x.shape[0], w.shape[0], generator=torch.Generator().manual_seed(9))
    ref = (x @ w.t(), g @ w, g.t() @ x)
    return [_sqnr(r, y) for r, y in zip(ref, _ours(x, w, g, recipe))]


def test_blockwise_sqnr_256():
    gen = torch.Generator().manual_seed(7)
    x, w = torch.randn(256, 256, generator=gen), torch.randn(256, 256, generator=gen)
    assert min(_sqnrs(BW, x, w)) >= 27


def _outlier_case() -> tuple[torch.Tensor, torch.Tensor]:
    """Feature 0 of the input is 1e6 times the others; the weight reads only features 128..255
    (its first 128 columns are 0), so the output depends only on the block without the outlier."""
    gen = torch.Generator().manual_seed(8)
    x, w = torch.randn(256, 256, generator=gen), torch.randn(256, 256, generator=gen)
    x[:, 0] *= 1e6
    w[:, :128] = 0
    return x, w


def test_outlier_feature_flushes_tensorwise_not_blockwise():
    x, w = _outlier_case()
    ref = x @ w.t()
    sqnr = {}
    for name in ("tensorwise", "blockwise", "mxfp8"):
        st = fp8.LayerState()
        sqnr[name] = _sqnr(ref, fp8.linear(x, w, None, fp8.as_recipe(name), state=st))
        sqnr[name, "underflow"] = st.read()["input"]["underflow"]
    assert sqnr["blockwise"] >= 27 and sqnr["mxfp8"] >= 27
    assert sqnr["tensorwise"] < 1  # every value but the outlier's flushed: the output is ~0
    assert sqnr["tensorwise", "underflow"] > 0.99
    # blockwise flushes only (some of) the outlier's own tiles: 127 of every 256 values at most
    assert 0.2 < sqnr["blockwise", "underflow"] < 127 / 256


def test_guard_by_output_sqnr_moves_back_the_tensorwise_layer_only():
    """The underflow statistic counts the outlier's own tiles too (above the default 5%), so the
    guard that tells the two apart is the output SQNR's."""
    x, w = _outlier_case()
    fallen = {}
    for name in ("tensorwise", "blockwise"):
        model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(3)])
        model[1].weight.data.copy_(w)
        guard = fp8.Guard(max_underflow=None, min_sqnr_db=20)
        model = fp8.convert(model, name, guard=guard, filter_fn=lambda m, fqn: fqn == "1")
        model[1](x).sum().backward()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fallen[name] = [f.layer for f in guard.step()]
        messages = [str(c.message) for c in caught if c.category is fp8.Float8FallbackWarning]
        assert len(messages) == len(fallen[name]) and all("'1'" in m and "sqnr" in m for m in messages)
    assert fallen == {"tensorwise": ["1"], "blockwise": []}


def test_blockwise_recipe_everywhere():
    assert fp8.as_recipe("blockwise") == BW and BW.multiple == 128 and not BW.pow2_scales
    assert (BW.input.granularity, BW.weight.granularity, BW.input_for_grad_weight.granularity) == \
        ("1x128", "128x128", "1x128")
    assert all(c.scale_format == "float32" for pair in BW.gemms().values() for c in pair)
    model = nn.Sequential(*[nn.Linear(128, 128) for _ in range(3)], nn.Linear(128, 64), nn.Linear(64, 128))
    with pytest.warns(UserWarning, match=r"'3': out_features=64 is not a multiple of 128"):
        # first_last="keep" keeps the model's first and last matmul layers ('0', and '4', ineligible
        # itself): of the eligible '0', '1', '2' ('3' is not), '1' and '2' run fp8
        assert fp8.select_layers(model, recipe="blockwise") == ["1", "2"]
    # the fp8 "after scaling" view of collect_ranges takes the block recipe too
    import mixprec

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with mixprec.collect_ranges(model, fp8_recipe="blockwise") as ranges:
            model(torch.randn(4, 128)).sum().backward()
    view = ranges.results()["0"]["activation"].fp8_scaled
    assert view.granularity == "1x128" and math.isfinite(view.underflow["float8_e4m3fn"])
