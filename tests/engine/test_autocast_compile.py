"""torch.compile traces mixprec's kernels: no graph break, same results as eager."""

from __future__ import annotations

import dataclasses

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


pytestmark = pytest.mark.usefixtures("fresh_dynamo")  # tests/conftest.py


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


EDIT_SOFTMAX = mixprec.Policy().with_ops(fp32=["softmax"])


class Counter:
    """A backend that counts compilations and runs AOTAutograd (as inductor would)."""

    def __init__(self):
        from torch._dynamo.backends.common import aot_autograd

        self.graphs = 0

        def fw(gm, example_inputs):
            self.graphs += 1
            return gm.forward

        self.backend = aot_autograd(fw_compiler=fw)


@pytest.mark.parametrize("policy", [None, EDIT_SOFTMAX, "fp32-numerics"], ids=["default", "edited", "preset"])
def test_region_inside_a_compiled_function_traces_with_fullgraph(policy):
    torch.manual_seed(0)
    model = TinyTransformer()
    x = torch.randn(2, 5, 8)

    def step(x):
        with mixprec.autocast("cpu", policy=policy):
            out = model(x)
        return out.sum(), out

    def grads(fn):
        model.zero_grad()
        loss, out = fn(x)
        loss.backward()
        return out, [p.grad.clone() for p in model.parameters()]

    eager, eager_grads = grads(step)
    compiled, compiled_grads = grads(torch.compile(step, backend="aot_eager", fullgraph=True))
    assert compiled.dtype == eager.dtype
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
    for a, b in zip(compiled_grads, eager_grads):
        assert a.dtype == b.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert mixprec.engine.runtime.top("cpu") is None and not torch.is_autocast_enabled("cpu")


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(4))
def test_region_inside_compiled_function_with_inductor(seed):
    """Inductor's code for the region runs its GEMM in bfloat16 and its softmax in float32, as
    eager does: equal to eager within float32's rounding (Inductor's softmax is its own kernel,
    not ATen's: a last-bit difference on some inputs), and unlike the region-free float32 result
    by bfloat16's (the region took effect)."""
    torch.manual_seed(seed)
    lin = nn.Linear(4, 4)

    def f(x):
        with mixprec.autocast("cpu", policy=EDIT_SOFTMAX):
            return lin(x).softmax(-1)

    x = torch.randn(2, 4)
    out, eager = torch.compile(f, fullgraph=True)(x), f(x)
    assert out.dtype == eager.dtype == torch.float32
    torch.testing.assert_close(out, eager, rtol=1e-6, atol=1e-7)
    assert (out - lin(x).softmax(-1)).abs().max() > 1e-5


def test_no_stale_policy_when_the_region_is_around_the_compiled_call():
    torch.manual_seed(0)
    lin = nn.Linear(4, 4)
    x = torch.randn(2, 4)
    f = lambda x: lin(x).softmax(-1)  # noqa: E731
    counter = Counter()
    g = torch.compile(f, backend=counter.backend, fullgraph=True)
    expected = {None: torch.bfloat16, "edited": torch.float32}
    for _ in range(2):
        for name, policy in (("edited", EDIT_SOFTMAX), (None, None), ("edited", EDIT_SOFTMAX)):
            with mixprec.autocast("cpu", policy=policy):
                eager, out = f(x), g(x)
            assert out.dtype == eager.dtype == expected[name]
            assert torch.equal(out, eager)
    with torch.autocast("cpu"):  # plain torch.autocast shares the default policy's graph
        assert torch.equal(g(x), f(x))
    assert counter.graphs == 2  # one per policy, then cached: guards, not recompiles per call


def test_no_stale_policy_when_the_policy_is_an_argument():
    lin = nn.Linear(4, 4)
    x = torch.randn(2, 4)

    def f(x, policy):
        with mixprec.autocast("cpu", policy=policy):
            return lin(x).softmax(-1)

    g = torch.compile(f, backend="aot_eager", fullgraph=True)
    for policy in (EDIT_SOFTMAX, None, "fp32-numerics", EDIT_SOFTMAX, None):
        eager, out = f(x, policy), g(x, policy)
        assert out.dtype == eager.dtype and torch.equal(out, eager)


# Policies with the same op edits (none) that differ in what the module hooks do: module rules
# (plain against keep, keep 0 against keep 2), output= or an fp8 rule alone (against keep 0).
BF16 = mixprec.Policy(compute=torch.bfloat16)
AROUND_POLICIES = {
    "plain": BF16,
    "keep 0": BF16.keep(names=r"^0$"),
    "keep 2": BF16.keep(names=r"^2$"),
    "keep 0, output=f32": dataclasses.replace(BF16, output=torch.float32).keep(names=r"^0$"),
    "keep 0, fp8 2": BF16.keep(names=r"^0$").fp8(names=r"^2$", first_last="fp8"),
}
# A model of ops no policy edits, so no mixprec kernel runs in its trace (the kernels' guard on the
# policy, once linear has one, would hide a missing guard in the hooks): bfloat16 inputs, which
# keep 0 runs in float32 and output= casts to float16.
ACTIVATIONS_POLICIES = {"plain": BF16, "keep 0": AROUND_POLICIES["keep 0"],
                        "output=f16": dataclasses.replace(BF16, output=torch.float16)}
AROUND_MODELS = {  # name: (model, input, policies)
    "linears": (lambda: nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32)), lambda: torch.randn(4, 32),
                AROUND_POLICIES),
    "activations": (lambda: nn.Sequential(nn.Hardtanh(), nn.Hardtanh()), lambda: torch.randn(4, 32).bfloat16(),
                    ACTIVATIONS_POLICIES),
}


@pytest.mark.parametrize("model, form", [("linears", "module"), ("linears", "function"), ("activations", "function")])
def test_policies_that_differ_in_module_rules_around_a_compiled_call_recompile_never_stale(model, form):
    """A region around a compiled call, its policy alternating between values that differ only in
    module rules, output= or an fp8 rule: each call is bitwise its eager run, and a policy seen
    before does not recompile (before: the graph traced under the first policy served every other,
    with no recompile: the kept layer ran in bfloat16, output= and the fp8 layer did nothing).
    The plain policy comes first: its graph, traced before any module hook existed, is dropped
    once, as the hooks come to stay (round 2 traces it again)."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    make_net, make_input, policies = AROUND_MODELS[model]
    net, x = make_net(), make_input()

    def run(fn, policy):
        with mixprec.autocast("cpu", policy=policy):
            return fn(x)

    eager = {name: run(net, policy) for name, policy in policies.items()}  # (fp8's kernels first)
    outs = list(eager.values())  # each policy tells: no two results alike
    assert all(a.dtype != b.dtype or not torch.equal(a, b) for i, a in enumerate(outs) for b in outs[i + 1:])
    compiled = torch.compile(net if form == "module" else lambda x: net(x), backend="aot_eager", fullgraph=True)
    for round_ in range(3):
        for name, policy in policies.items():
            out = run(compiled, policy)
            assert out.dtype == eager[name].dtype and torch.equal(out, eager[name]), (round_, name)
        if round_ == 1:
            graphs = counters["stats"]["unique_graphs"]  # (the fixture cleared Dynamo's counters)
    assert graphs <= len(policies) + 1 and counters["stats"]["unique_graphs"] == graphs


@pytest.mark.slow
def test_a_graph_traced_before_the_module_hooks_existed_never_runs_under_a_rule():
    """A fresh process, where no module hook was ever installed: a compiled model called under a
    plain policy, then under a keep rule, then plain again, each call bitwise eager (before: the
    plain graph, traced without hooks and guarding on no policy, served the keep rule). The hooks
    come to stay at the rule's region, dropping that graph: three graphs, then none."""
    import subprocess
    import sys

    code = """
import torch, mixprec
from torch import nn
from torch._dynamo.utils import counters
torch.set_num_threads(1)
torch.manual_seed(0)
model, x = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8)), torch.randn(8, 16)
plain = mixprec.Policy(compute=torch.bfloat16)
compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
for policy in (plain, plain.keep(names=r"^2$"), plain) * 2:
    with mixprec.autocast("cpu", policy=policy):
        eager, out = model(x), compiled(x)
    assert out.dtype == eager.dtype == (torch.bfloat16 if policy is plain else torch.float32), out.dtype
    assert torch.equal(out, eager)
assert counters["stats"]["unique_graphs"] == 3, counters["stats"]["unique_graphs"]
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.stdout.strip() == "ok", out.stderr[-2000:]


class Tower(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 4))
        self.norm = nn.LayerNorm(4)
        self.head = nn.Linear(4, 4)

    def forward(self, x):
        return self.head(self.norm(self.body(x)))


RULES = (mixprec.Policy(output=torch.float32).with_ops(fp32=["gelu"])
         .keep(types=nn.LayerNorm).keep(names=r"^head$", dtype="fp16"))
# Around a compiled call, PyTorch itself traces the backward under the outer autocast region: a
# module that switches autocast off or to another dtype gets lowered backward matmuls, unlike
# eager (plain torch.autocast around a compiled model with a nested torch.autocast(enabled=False)
# shows it too). So there the rules select modules without matmuls (the LayerNorm, by name).
RULES_AROUND = (mixprec.Policy(output=torch.float32).with_ops(fp32=["gelu"])
                .keep(names=r"^norm$"))


def _eager_and_grads(model, fn, x):
    model.zero_grad()
    out = fn(x)
    out.float().sum().backward()
    return out, [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("where", ["inside", "around"])
def test_module_rules_and_output_compile_with_fullgraph(where):
    """keep by type and by name, an fp16 rule, output= and an op edit, traced with no graph
    break: values, dtypes and gradients bitwise eager's, no recompile on later calls."""
    torch.manual_seed(0)
    model = Tower()
    x = torch.randn(3, 4)
    rules = RULES if where == "inside" else RULES_AROUND

    def region(x):
        with mixprec.autocast("cpu", policy=rules):
            return model(x)

    eager, eager_grads = _eager_and_grads(model, region, x)
    counter = Counter()
    if where == "inside":
        compiled = torch.compile(region, backend=counter.backend, fullgraph=True)
    else:
        inner = torch.compile(model, backend=counter.backend, fullgraph=True)
        compiled = lambda x: _around(inner, x, rules)  # noqa: E731
    for step in range(3):
        out, grads = _eager_and_grads(model, compiled, x)
        assert out.dtype == eager.dtype == torch.float32
        torch.testing.assert_close(out, eager, rtol=0, atol=0)
        for a, b in zip(grads, eager_grads):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        if step == 0:
            graphs = counter.graphs  # forward and backward
    assert counter.graphs == graphs
    assert mixprec.engine.runtime.top("cpu") is None and not torch.is_autocast_enabled("cpu")


def _around(compiled, x, rules):
    with mixprec.autocast("cpu", policy=rules):
        return compiled(x)


def test_policies_built_inside_compiled_code_are_refused_not_silently_changed():
    """Dynamo's emulation of frozen dataclasses drops fields (here the keep rule): building a
    policy while tracing raises instead, with what to do."""
    lin = nn.Linear(4, 4)

    def f(x):
        with mixprec.autocast("cpu", policy=mixprec.Policy().keep(types=nn.Linear)):
            return lin(x)

    with pytest.raises(Exception, match="outside torch.compile"):
        torch.compile(f, backend="aot_eager", fullgraph=True)(torch.randn(2, 4))


def test_module_rules_around_a_compiled_model_with_graph_breaks_match_eager():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 4))
    policy = mixprec.Policy(output=torch.float32).keep(types=nn.LayerNorm).keep(names=r"^2$", dtype="fp16")
    x = torch.randn(2, 4)
    with mixprec.autocast("cpu", policy=policy):
        eager = model(x)
        compiled = torch.compile(model, backend="aot_eager")(x)  # not fullgraph: eager hooks
    assert compiled.dtype == eager.dtype == torch.float32
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)


# ----------------------------------------------------------------------- equal policies, one graph
def _fresh_policies():
    """Twelve distinct but equal policies of each form a caller might build per step."""
    forms = [lambda: mixprec.Policy().with_ops(fp32=["softmax"]),
             lambda: mixprec.Policy(compute=torch.bfloat16).keep(types=nn.LayerNorm),
             lambda: "compute=bf16,preset=fp32-numerics"]
    return [[make() for _ in range(12)] for make in forms]


@pytest.mark.parametrize("form", [0, 1, 2], ids=["op-edit", "module-rule", "string"])
def test_equal_policies_inside_a_compiled_function_compile_once(form):
    """A fresh but equal policy per call: guarded by value, so 12 calls compile one graph (before,
    by the object's identity: call 9 hit the recompile limit under fullgraph=True)."""
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    x = torch.randn(2, 4)

    def f(x, policy):
        with mixprec.autocast("cpu", policy=policy):
            return model(x).softmax(-1)

    counter = Counter()
    g = torch.compile(f, backend=counter.backend, fullgraph=True)
    for policy in _fresh_policies()[form]:
        out, eager = g(x, policy), f(x, policy)
        assert out.dtype == eager.dtype and torch.equal(out, eager)
    assert counter.graphs == 1
    other = mixprec.Policy().with_ops(fp32=["softmax"], lower=["exp"])  # another value recompiles
    assert torch.equal(g(x, other), f(x, other)) and counter.graphs == 2


@pytest.mark.parametrize("form", [0, 1, 2], ids=["op-edit", "module-rule", "string"])
def test_equal_policies_around_a_compiled_call_share_its_graph(form):
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    x = torch.randn(2, 4)
    counter = Counter()
    g = torch.compile(model, backend=counter.backend, fullgraph=True)
    for policy in _fresh_policies()[form]:
        with mixprec.autocast("cpu", policy=policy):
            out, eager = g(x), model(x)
        assert out.dtype == eager.dtype and torch.equal(out, eager)
    assert counter.graphs == 1


def test_a_graph_break_inside_a_region_leaves_no_region_behind():
    """Dynamo's trace ends at a graph break inside the region: the region it entered while tracing
    is left when the compile ends (before: it stayed on the thread's stack, and plain
    torch.autocast's softmax ran in float32 afterwards)."""
    lin = nn.Linear(4, 4)

    def f(x):
        with mixprec.autocast("cpu", policy=EDIT_SOFTMAX):
            y = lin(x)
            torch._dynamo.graph_break()
            return y.softmax(-1)

    x = torch.randn(2, 4)
    out = torch.compile(f, backend="aot_eager")(x)
    assert out.dtype == torch.float32  # (values: linear is not lowered there, unlike eager)
    assert mixprec.engine.runtime.top("cpu") is None and mixprec.engine.runtime.RUNTIME.depth == 0
    with torch.autocast("cpu"):
        assert torch.softmax(x.bfloat16(), -1).dtype == torch.bfloat16


def test_a_region_traced_inside_compile_runs_with_its_own_controller():
    """Policies equal but for the live controller they carry (equality leaves the object out)
    trace distinct regions: before, the second traced region ran with the first policy's
    controller, which then saw the layers in place of the second's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32))
    x = torch.randn(4, 32)
    ctl, other = mixprec.Controller(), mixprec.Controller()
    first = mixprec.Policy.parse("compute=bf16").fp8(controller=other, first_last="fp8")
    controlled = mixprec.Policy.parse("compute=bf16").fp8(controller=ctl, first_last="fp8")
    assert first == controlled
    for policy in (first, controlled):
        torch._dynamo.reset()

        def f(x, policy=policy):
            with mixprec.autocast("cpu", policy=policy):
                return model(x)

        torch.compile(f, backend="eager", fullgraph=True)(x)
    assert ctl.precision("0") == "fp8-tensorwise" and ctl.precision("2") == "fp8-tensorwise"
    assert other.precision("0") == "fp8-tensorwise"


@pytest.mark.parametrize("rule", ["fp8", "keep fp16", "output=f32"])
def test_a_region_with_module_rules_inside_a_compiled_function_without_fullgraph_matches_eager(rule):
    """Without fullgraph a region whose policy needs the module hooks is entered eagerly (its
    modules' hooks graph-break and run eagerly, where a traced region was not seen: fp8 layers
    ran in bf16, keep rules and output= did nothing), with or without a user hook on a layer."""
    policies = {"fp8": mixprec.Policy.parse("compute=bf16").fp8(first_last="fp8"),
                "keep fp16": mixprec.Policy.parse("compute=bf16").keep(names="^0$", dtype=torch.float16),
                "output=f32": mixprec.Policy.parse("compute=bf16,output=f32")}
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 32))
    x = torch.randn(4, 32)

    def f(x):
        with mixprec.autocast("cpu", policy=policies[rule]):
            return model(x)

    eager = f(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain = model(x)
    for hooked in (False, True):
        handle = model[0].register_forward_hook(lambda m, a, o: None) if hooked else None
        torch._dynamo.reset()
        out = torch.compile(f, backend="eager")(x)
        assert out.dtype == eager.dtype and torch.equal(out, eager), (rule, hooked)
        assert out.dtype != plain.dtype or not torch.equal(out, plain)  # the rule took effect
        if handle is not None:
            handle.remove()


class _RegionInForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with mixprec.autocast("cpu", dtype=torch.bfloat16):
            return self.fc(x)


@pytest.mark.parametrize("strict", [False, True])
def test_torch_export_of_a_region_is_refused(strict):
    """torch.export recorded nothing of a mixprec.autocast region: the exported program ran it in
    float32, silently (strict and not). It is refused (non-strict: our RuntimeError; strict: Dynamo
    reports the exception it met); torch.compile is unaffected."""
    model, x = _RegionInForward(), torch.randn(2, 4)
    error = RuntimeError if not strict else Exception
    with pytest.raises(error, match="torch.export does not record" if not strict else None):
        torch.export.export(model, (x,), strict=strict)
    assert torch.compile(model, backend="eager")(x).dtype == torch.bfloat16
