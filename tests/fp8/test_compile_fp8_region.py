"""A model compiled without fullgraph, called inside a region with fp8 layers, module rules or
``output=`` entered outside the compiled call (issue 30 item 3): the module hooks are traced, with
no graph break and no recompile, and the results are eager's.

Before, the hooks graph-broke at every module (29 breaks for this model) and hit the recompile
limit on the guard on each module's type, on the first call."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

import mixprec

POLICIES = {
    "tensorwise": lambda: mixprec.Policy.parse("compute=bf16").fp8("tensorwise"),
    "rowwise": lambda: mixprec.Policy.parse("compute=bf16").fp8("rowwise"),
    # GELU and the head (by name) in float32: the head's float32 output shows the rule took effect
    "keep": lambda: mixprec.Policy.parse("compute=bf16").keep(types=(nn.GELU,)).keep(names=r"^4$"),
    "output=f32": lambda: mixprec.Policy.parse("compute=bf16,output=f32"),
}


pytestmark = pytest.mark.usefixtures("fresh_dynamo")  # tests/conftest.py


def _model() -> nn.Module:
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(4)]
    return nn.Sequential(*blocks, nn.Linear(64, 16))


def _run(fn, model, x, policy):
    model.zero_grad()
    with mixprec.autocast("cpu", policy=policy):
        out = fn(x)
    out.float().square().sum().backward()
    return out, [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("name", list(POLICIES))
def test_a_region_around_a_compiled_model_traces_its_hooks_without_graph_breaks(name):
    policy = POLICIES[name]()
    model = _model()
    x = torch.randn(8, 64)
    eager, eager_grads = _run(model, model, x, policy)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain = model(x)
    assert eager.dtype != plain.dtype or not torch.equal(eager, plain)  # the policy takes effect

    counter = CompileCounterWithBackend("aot_eager")  # AOTAutograd, as inductor; counts frames
    compiled = torch.compile(model, backend=counter)
    for call in range(3):
        out, grads = _run(compiled, model, x, policy)
        assert out.dtype == eager.dtype
        torch.testing.assert_close(out, eager, rtol=0, atol=0)  # same kernels, same casts
        for got, want in zip(grads, eager_grads):
            # (around a compiled call, AOTAutograd traces the backward under the region's autocast:
            # the float32 head's backward matmuls run in bf16 there, unlike eager's)
            tol = dict(rtol=0, atol=0) if name != "keep" else dict(rtol=2e-2, atol=1e-2)
            torch.testing.assert_close(got, want, **tol)
        if call == 0:
            assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
            assert counter.frame_count == 1
    assert counter.frame_count == 1  # no recompile
    assert sum(counters["graph_break"].values()) == 0
    assert mixprec.engine.runtime.top("cpu") is None and not torch.is_autocast_enabled("cpu")


def test_a_region_around_a_model_compiled_with_inductor_is_the_fullgraph_compile():
    """With inductor, the hooks traced without fullgraph give the graph ``fullgraph=True`` gives:
    bitwise its outputs. Neither is bitwise eager with fp8 (inductor fuses the tensorwise scale
    into the cast, and a few elements round to the neighbouring fp8 value: here about 1e-3 on
    outputs of about 0.3, as large as fp8's own difference from bf16), hence the loose bound."""
    policy = POLICIES["tensorwise"]()
    model = _model()
    x = torch.randn(8, 64)
    with torch.no_grad(), mixprec.autocast("cpu", policy=policy):
        eager = model(x)
        compiled = torch.compile(model)
        first, second = compiled(x), compiled(x)
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1
    torch._dynamo.reset()
    with torch.no_grad(), mixprec.autocast("cpu", policy=policy):
        fullgraph = torch.compile(model, fullgraph=True)(x)
    assert first.dtype == eager.dtype == fullgraph.dtype == torch.bfloat16
    assert torch.equal(first, second) and torch.equal(first, fullgraph)
    bound = 4 * torch.finfo(torch.bfloat16).eps * eager.float().abs().max()
    assert (first.float() - eager.float()).abs().max() <= bound


class _BreakingModel(nn.Module):
    """Its forward graph-breaks between its submodules, inside its own hooks."""

    def __init__(self):
        super().__init__()
        model = _model()
        self.blocks, self.head = model[:4], model[4]

    def forward(self, x):
        y = self.blocks(x)
        torch._dynamo.graph_break()
        return self.head(y)


@pytest.mark.parametrize("name", ["tensorwise", "keep", "output=f32"])
def test_a_graph_break_inside_a_hooked_module_matches_eager(name):
    """A module whose forward graph-breaks runs its hooks eagerly (its traced pre-hook's state
    would not reach its post-hook, traced after the break). Those hook frames, compiled per
    module, pass Dynamo's recompile limit, which then runs them uncompiled: before, they took
    the traced path there (output= lost, keep rules and fp8 layers left on: not eager's)."""
    policy = POLICIES[name]()
    model = _BreakingModel()
    x = torch.randn(8, 64)
    with mixprec.autocast("cpu", policy=policy):
        eager = model(x)
        compiled = torch.compile(model, backend="aot_eager")
        outs = [compiled(x) for _ in range(2)]
    assert mixprec.engine.runtime.top("cpu") is None and not torch.is_autocast_enabled("cpu")
    for out in outs:
        assert out.dtype == eager.dtype
        torch.testing.assert_close(out, eager, rtol=0, atol=0)
