"""torch.compile traces mixprec's kernels: no graph break, same results as eager."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import mixprec


class TinyTransformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Linear(8, 16)
        self.layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        return self.head(self.layer(self.emb(x))).float().softmax(-1)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("policy", [None, mixprec.Policy().with_ops(fp32=["scaled_dot_product_attention"])],
                         ids=["torch-lists", "edited"])
def test_compile_aot_eager_fullgraph_matches_eager(policy):
    torch.manual_seed(0)
    model = TinyTransformer()
    x = torch.randn(2, 5, 8)
    with mixprec.autocast("cpu", policy=policy):
        eager = model(x)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    with mixprec.autocast("cpu", policy=policy):
        got = compiled(x)
    assert got.dtype == eager.dtype
    torch.testing.assert_close(got, eager, rtol=0, atol=0)
    if policy is not None:  # the edit changed the numerics, and compile kept the edit
        with mixprec.autocast("cpu"):
            assert not torch.equal(model(x), eager)
    got.sum().backward()
    assert model.emb.weight.grad.dtype == torch.float32


def test_compiled_forward_graph_contains_the_casts_of_the_policy():
    from torch._dynamo.backends.common import aot_autograd

    def captured(policy):
        torch._dynamo.reset()
        graphs = []

        def fw(gm, example_inputs):
            graphs.append(gm)
            return gm.forward

        lin = nn.Linear(4, 4)
        with mixprec.autocast("cpu", policy=policy):
            out = torch.compile(lambda x: lin(x).softmax(-1), backend=aot_autograd(fw_compiler=fw),
                                fullgraph=True)(torch.randn(2, 4))
        casts = [n.kwargs.get("dtype") for n in graphs[0].graph.nodes
                 if n.target is torch.ops.aten._to_copy.default]
        return out.dtype, casts

    dtype, casts = captured(None)
    assert dtype == torch.bfloat16 and casts.count(torch.bfloat16) == 3  # x, weight, bias
    dtype, casts = captured(mixprec.Policy().with_ops(fp32=["softmax"]))
    assert dtype == torch.float32 and torch.float32 in casts or dtype == torch.float32


def test_torch_autocast_under_compile_after_mixprec_registered_kernels():
    torch.manual_seed(0)
    model = TinyTransformer()
    x = torch.randn(2, 5, 8)
    with mixprec.autocast("cpu", policy=mixprec.Policy.default("cuda"), dtype=torch.float16):
        model(x)  # registers mixprec kernels for the CPU and CUDA lists at AutocastCPU
    with torch.autocast("cpu"):
        eager = model(x)
        got = torch.compile(model, backend="aot_eager", fullgraph=True)(x)
    torch.testing.assert_close(got, eager, rtol=0, atol=0)


def test_region_inside_a_compiled_function_is_never_silently_dropped():
    torch.manual_seed(0)
    lin = nn.Linear(4, 4)
    x = torch.randn(2, 4)

    def f(x):
        with mixprec.autocast("cpu"):
            return lin(x)

    out = torch.compile(f, backend="aot_eager")(x)  # graph break: the region runs eagerly
    assert out.dtype == torch.bfloat16 and torch.equal(out, f(x))
    torch._dynamo.reset()
    with pytest.raises(Exception, match="disable"):
        torch.compile(f, backend="aot_eager", fullgraph=True)(x)
