"""Module rules (keep, output=, fp8 layers) across nested regions, checkpoint recompute, root= and
the warning for rules that match nothing."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import mixprec
from mixprec import Policy

LN_F32 = Policy.parse("compute=bf16,output=f32").keep(types=nn.LayerNorm)


@pytest.fixture(autouse=True)
def fresh_rule_records(monkeypatch):
    """Each test starts as a fresh process: no rule has matched or been warned about yet, no
    module warned about a checkpoint, no region looked for reentrant checkpoints."""
    import weakref

    from mixprec.engine import module_calls, watch

    monkeypatch.setattr(watch, "_MATCHED", set())
    monkeypatch.setattr(watch, "_WARNED", set())
    monkeypatch.setattr(module_calls, "_REENTRANT_WARNED", weakref.WeakSet())
    monkeypatch.setattr(module_calls, "_LOOKED", set())


def _ln_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))


def test_nested_regions_with_an_equal_policy_keep_the_outer_rules():
    m, x = _ln_model(), torch.randn(2, 4)
    with mixprec.autocast("cpu", policy=LN_F32):
        assert m(x).dtype == torch.float32
        with mixprec.autocast("cpu", policy=LN_F32):
            assert m(x).dtype == torch.float32
        assert m(x).dtype == torch.float32  # the outer region's rules are still there


def test_decorated_forward_inside_a_region_with_the_same_policy():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = _ln_model()

        @mixprec.autocast("cpu", policy=LN_F32)
        def forward(self, x):
            return self.body(x)

    net, x = Net(), torch.randn(2, 4)
    with mixprec.autocast("cpu", policy=LN_F32):
        net(x)
        assert net.body(x).dtype == torch.float32


# --------------------------------------------------------------------- checkpoint recompute
class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class _Net(nn.Module):
    def __init__(self, checkpointed: bool):
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.block, self.norm, self.out = nn.Linear(32, 32), _Block(), nn.LayerNorm(32), nn.Linear(32, 32)
        self.checkpointed = checkpointed

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        x = self.inp(x)
        if self.checkpointed:
            x = checkpoint(self.block, x, use_reentrant=False, context_fn=mixprec.checkpoint_context_fn)
        else:
            x = self.block(x)
        return self.out(self.norm(x))


def _train_step(policy, checkpointed, whole=False):
    net = _Net(checkpointed and not whole)
    x = torch.randn(3, 32, requires_grad=True)
    with mixprec.autocast("cpu", policy=policy):
        if whole:
            from torch.utils.checkpoint import checkpoint

            out = checkpoint(net, x, use_reentrant=False, context_fn=mixprec.checkpoint_context_fn)
        else:
            out = net(x)
    out.float().square().mean().backward()
    return net, [out, x.grad, *(p.grad for p in net.parameters())]


CHECKPOINT_POLICIES = {
    "names": Policy().keep(names=r"^block\.fc1$"),
    "names-bf16-output": Policy(output=torch.float16).keep(names=r"^block\.fc1$").keep(types=nn.LayerNorm),
    "fp8": Policy.fp8(first_last="keep"),
    "fp8-names": Policy.fp8(first_last="fp8", names=r"^block\.").keep(names=r"^block\.fc2$"),
}


@pytest.mark.parametrize("whole", [False, True], ids=["submodule", "whole-model"])
@pytest.mark.parametrize("name", list(CHECKPOINT_POLICIES))
def test_checkpoint_recompute_replays_the_forward_context(name, whole):
    policy = CHECKPOINT_POLICIES[name]
    _, ref = _train_step(policy, checkpointed=False)
    _, got = _train_step(policy, checkpointed=True, whole=whole)
    for a, b in zip(ref, got):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert not torch.is_autocast_enabled("cpu") and mixprec.engine.runtime.top("cpu") is None


@pytest.mark.parametrize("policy, layers", [(Policy.parse("compute=bf16").fp8("tensorwise", first_last="fp8"), 2),
                                            (LN_F32, 1)], ids=["fp8", "keep"])
def test_a_checkpoint_without_mixprecs_context_fn_warns_once_where_its_recompute_would_differ(policy, layers):
    """An fp8 layer, or one a module rule casts, in ``checkpoint(..., use_reentrant=False)`` without
    ``context_fn=mixprec.checkpoint_context_fn``: PyTorch would recompute it under its own lists
    (a CheckpointError in backward): one warning per layer names the fix; with the fix, or
    without a checkpoint, none."""
    from torch.utils.checkpoint import checkpoint

    def model() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(32, 32), nn.LayerNorm(32), nn.Linear(32, 32))

    m, x = model(), torch.randn(8, 32, requires_grad=True)
    with pytest.warns(UserWarning, match=r"context_fn=mixprec\.checkpoint_context_fn") as seen:
        with mixprec.autocast("cpu", policy=policy):
            checkpoint(m, x, use_reentrant=False)
            checkpoint(m, x, use_reentrant=False)
    assert len([w for w in seen if "use_reentrant=False" in str(w.message)]) == layers
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fixed = model()
        with mixprec.autocast("cpu", policy=policy):
            y = checkpoint(fixed, x, use_reentrant=False, context_fn=mixprec.checkpoint_context_fn)
            model()(x)
        y.float().sum().backward()


class _CheckpointedBlock(nn.Module):
    """``inp``, a ``_Block`` under ``checkpoint(block, h, **checkpoint_kwargs)`` (none: not
    checkpointed), ``out``."""

    def __init__(self, **checkpoint_kwargs):
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.block, self.out = nn.Linear(32, 32), _Block(), nn.Linear(32, 32)
        self.checkpoint_kwargs = checkpoint_kwargs

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        h = self.inp(x)
        h = checkpoint(self.block, h, **self.checkpoint_kwargs) if self.checkpoint_kwargs else self.block(h)
        return self.out(h)


_RECOMPUTE_FIX = "Use checkpoint(..., use_reentrant=False, context_fn=mixprec.checkpoint_context_fn)"
REENTRANT_CASES = {  # policy, the start of its warning under a reentrant checkpoint (None: no warning)
    "keep": (Policy.parse("compute=bf16").keep(names=r"^block\.fc1$"),
             "mixprec: layer 'block.fc1', which a module rule runs in float32, runs inside "
             "torch.utils.checkpoint.checkpoint(..., use_reentrant=True), which recomputes it in backward outside "
             "mixprec's policy, without the rule"),
    "op edit": (Policy.parse("compute=bf16").with_ops(fp32=["linear"]),
                "mixprec: module 'block' runs inside torch.utils.checkpoint.checkpoint(..., use_reentrant=True), "
                "which recomputes it in backward outside mixprec's policy: the ops the policy edits (linear)"),
    "plain": (Policy.parse("compute=bf16"), None),
}


@pytest.mark.parametrize("checkpoint_kwargs", [{"use_reentrant": True},
                                               {"use_reentrant": False, "context_fn": mixprec.checkpoint_context_fn}],
                         ids=["reentrant", "context_fn"])
@pytest.mark.parametrize("case", list(REENTRANT_CASES))
def test_a_reentrant_checkpoint_warns_once_where_its_recompute_leaves_the_policy(case, checkpoint_kwargs):
    """``checkpoint(..., use_reentrant=True)`` recomputes its segment in backward outside every
    region: a module a keep rule casts, or a module in a region whose policy edits ops, silently
    gets other gradients than without the checkpoint. Over two training steps one warning names
    the module (once per module, and once per region for the edits) and the fix; a plain policy
    (its recompute is the forward's) and the non-reentrant checkpoint with mixprec's context_fn
    say nothing. (A policy with edits only looks in its first region with grad on: the
    checkpointed model trains first here.)"""
    policy, said = REENTRANT_CASES[case]
    x = torch.randn(3, 32)

    def train(model):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):
                model.zero_grad()
                with mixprec.autocast("cpu", policy=policy):
                    out = model(x.clone().requires_grad_())
                out.float().square().mean().backward()  # (outside the region, as torch.autocast advises)
        return [str(w.message) for w in caught], [p.grad for p in model.parameters()]

    messages, grads = train(_CheckpointedBlock(**checkpoint_kwargs))
    unwarned, reference = train(_CheckpointedBlock())
    reentrant = checkpoint_kwargs["use_reentrant"]
    assert unwarned == [] and [m for m in messages if "checkpoint" in m] == messages
    if said is not None and reentrant:
        assert len(messages) == 1 and messages[0].startswith(said) and messages[0].endswith(_RECOMPUTE_FIX)
    else:
        assert messages == []
    # what the warning says: only where it warns do the gradients differ from the un-checkpointed run
    assert all(torch.equal(a, b) for a, b in zip(grads, reference)) == (said is None or not reentrant)


def test_checkpoint_recompute_selects_no_fp8_layers_and_counts_no_forward(monkeypatch):
    from mixprec.engine import module_decision

    calls = []
    select = module_decision._fp8_layers
    monkeypatch.setattr(module_decision, "_fp8_layers",
                        lambda root, policy, region=None: calls.append(root) or select(root, policy, region))
    for whole in (False, True):
        calls.clear()
        net, _ = _train_step(Policy.fp8(), checkpointed=True, whole=whole)
        assert calls == [net]  # the forward's outermost call only; the recompute reuses its layers


# --------------------------------------------------------------------- root= and unmatched rules
class _LM(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
        self.lm_head = nn.Linear(4, 4)

    def forward(self, x):
        return self.lm_head(self.body(x))


class _Wrapped(_LM):
    """A forward that enters its region inside itself, as frameworks' wrappers do."""

    def __init__(self, policy, root):
        super().__init__()
        self.policy, self.use_root = policy, root

    def forward(self, x):
        with mixprec.autocast("cpu", policy=self.policy, root=self if self.use_root else None):
            return self.lm_head(self.body(x))


def _out_dtypes(model, fn):
    seen, hooks = {}, []
    for name, m in model.named_modules():
        if name:
            hooks.append(m.register_forward_hook(lambda m, a, out, name=name: seen.__setitem__(name, out.dtype)))
    try:
        fn()
    finally:
        for h in hooks:
            h.remove()
    return seen


def test_root_names_modules_from_the_model_inside_its_forward():
    names = r"^lm_head$|^body\.1$"
    x = torch.randn(2, 4)
    plain = _LM()
    with mixprec.autocast("cpu", policy=Policy().keep(names=names)):
        ref = _out_dtypes(plain, lambda: plain(x))
    assert ref["lm_head"] == ref["body.1"] == torch.float32 and ref["body.0"] == torch.bfloat16
    rooted = _Wrapped(Policy().keep(names=names), root=True)
    assert _out_dtypes(rooted, lambda: rooted(x)) == ref


def test_a_decorated_forward_names_modules_from_its_module():
    names = r"^lm_head$"

    class Decorated(_LM):
        @mixprec.autocast("cpu", policy=Policy().keep(names=names))
        def forward(self, x):
            return self.lm_head(self.body(x))

    m = Decorated()
    assert _out_dtypes(m, lambda: m(torch.randn(2, 4)))["lm_head"] == torch.float32


OUT_F32 = Policy.parse("compute=bf16,output=f32")


class _Mlp(nn.Module):
    """``fc2(gelu(fc1(x)) * 1.7)``: in a bfloat16 region, fc1's output and the activation are bfloat16."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 8)

    def body(self, x):
        return self.fc2(nn.functional.gelu(self.fc1(x)) * 1.7)

    def forward(self, x):
        return self.body(x)


class _DecoratedMlp(_Mlp):
    @mixprec.autocast("cpu", policy=OUT_F32)
    def forward(self, x):
        return self.body(x)


class _RootedMlp(_Mlp):
    def forward(self, x):
        with mixprec.autocast("cpu", policy=OUT_F32, root=self):
            return self.body(x)


class _TorchMlp(_Mlp):
    @torch.autocast("cpu", dtype=torch.bfloat16)
    def forward(self, x):
        return self.body(x)


_DISABLED_DECORATORS = {  # name: (decorator arguments, decorated a module's forward)
    "disabled forward": ({"enabled": False}, True),
    "disabled function": ({"enabled": False}, False),
    "cuda forward, no cuda": ({"device_type": "cuda"}, True),
    "cuda function, no cuda": ({"device_type": "cuda"}, False),
}


@pytest.mark.parametrize("case", _DISABLED_DECORATORS)
def test_a_disabled_decorator_region_casts_nothing(case):
    """A disabled region (enabled=False, a cuda region without cuda) decorating a forward or a
    function gives what the with-statement gives: nothing cast to ``output=`` (until 2026-12-07
    the decorator cast the result whatever the region's state). An enabled one casts the
    function's result (tests/policy/test_policy.py)."""
    kwargs, forward = _DISABLED_DECORATORS[case]
    device = kwargs.pop("device_type", "cpu")
    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("checks a cuda region that disables itself without cuda")
    policy = Policy.parse("compute=bf16,output=bf16")
    model, x = _Mlp(), torch.randn(4, 8)

    def step(x):
        y = model(x)
        return (y.float() - 1).pow(2).mean(), x

    class Decorated(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = model

        def forward(self, x):
            return self.inner(x)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "CUDA is not available": tested elsewhere
        with mixprec.autocast(device, policy=policy, **kwargs):
            want = (Decorated() if forward else step)(x)
        Decorated.forward = mixprec.autocast(device, policy=policy, **kwargs)(Decorated.forward)
        got = (Decorated() if forward else mixprec.autocast(device, policy=policy, **kwargs)(step))(x)
    for g, w in zip(*(torch.utils._pytree.tree_leaves(t) for t in (got, want))):
        assert g.dtype == w.dtype == torch.float32 and torch.equal(g, w)


@pytest.mark.parametrize("entry", ["decorated", "root", "decorated-compiled"])
def test_output_casts_the_models_result_not_its_submodules_when_the_region_is_inside_its_forward(entry):
    """``output=`` casts the outputs of the outermost module: in a region entered inside the model's
    forward (a decorated forward, ``root=self``), the model's, not those of the submodules its
    forward calls, whose outputs are torch.autocast's dtypes (before: each was cast to float32, and
    the result differed from the region around the model's). The decorator casts the forward's
    result: bitwise the region around the model, compiled too; a region inside the forward under
    root= does not see the forward's result: its values, in bfloat16."""
    x = torch.randn(4, 8)
    with mixprec.autocast("cpu", policy=OUT_F32):
        around = _Mlp()(x)
    reference = _TorchMlp()
    model = {"decorated": _DecoratedMlp, "root": _RootedMlp, "decorated-compiled": _DecoratedMlp}[entry]()
    call = torch.compile(model, backend="aot_eager", fullgraph=True) if entry.endswith("compiled") else model
    out = []
    seen = _out_dtypes(model, lambda: out.append(call(x)))
    assert seen == _out_dtypes(reference, lambda: reference(x)) == {"fc1": torch.bfloat16, "fc2": torch.bfloat16}
    assert out[0].dtype == (torch.bfloat16 if entry == "root" else torch.float32)
    assert torch.equal(out[0].float(), around)


def test_a_rule_that_matches_nothing_warns_once_with_the_names_seen():
    x, m = torch.randn(2, 4), _LM()
    policy = Policy().keep(names=r"^lm_haed$")
    with pytest.warns(UserWarning, match=r"selected no module.*did you mean 'lm_head'"):
        with mixprec.autocast("cpu", policy=policy):
            m(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with mixprec.autocast("cpu", policy=policy):  # once per rule
            m(x)


def test_the_first_pass_ends_when_an_outermost_module_is_called_again():
    x, m = torch.randn(2, 4), _LM()
    with mixprec.autocast("cpu", policy=Policy().keep(names=r"^head$")):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            m.body(x)
            m.lm_head(x)  # another outermost module: still the first pass
        with pytest.warns(UserWarning, match="names seen: '0', '1'"):
            m.body(x)  # called again: the pass is over


def test_rules_that_match_in_a_region_do_not_warn():
    x, m = torch.randn(2, 4), _LM()
    policy = Policy().keep(names=r"^body$").keep(types=nn.LayerNorm).keep(names=r"^lm_head$")
    wrapped = _Wrapped(Policy().keep(names=r"^lm_head$"), root=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with mixprec.autocast("cpu", policy=policy):
            m(x)
            m(x)
        with mixprec.autocast("cpu", policy=Policy().keep(names="^nothing$")):
            torch.mm(x, x.t())  # a region that calls no module judges no rule
        wrapped(x)


def test_unrooted_region_inside_a_forward_warns_and_says_to_pass_root():
    m = _Wrapped(Policy().keep(names=r"^lm_head$"), root=False)
    with pytest.warns(UserWarning, match="pass root=model"):
        m(torch.randn(2, 4))


def test_root_must_be_a_module():
    with pytest.raises(TypeError, match="root must be an nn.Module"):
        mixprec.autocast("cpu", root="model")


class _Stack(nn.Module):
    """Blocks in a ModuleList (not called themselves), each checkpointed, in a region with root."""

    def __init__(self, checkpointed):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([_Block(), _Block()])
        self.checkpointed = checkpointed

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        with mixprec.autocast("cpu", policy=Policy().keep(names=r"^blocks\.1\.fc1$"), root=self):
            for block in self.blocks:
                if self.checkpointed:
                    x = checkpoint(block, x, use_reentrant=False, context_fn=mixprec.checkpoint_context_fn)
                else:
                    x = block(x)
            return x


def test_checkpoint_recompute_in_a_region_with_root():
    results = []
    for checkpointed in (False, True):
        net, x = _Stack(checkpointed), torch.randn(3, 32, requires_grad=True)
        seen = _out_dtypes(net, lambda: results.append(net(x)))
        assert seen["blocks.1.fc1"] == torch.float32 and seen["blocks.0.fc1"] == torch.bfloat16
        results[-1].float().sum().backward()
        results.extend([x.grad, *(p.grad for p in net.parameters())])
    half = len(results) // 2
    for a, b in zip(results[:half], results[half:]):
        assert a.dtype == b.dtype and torch.equal(a, b)


class _DecoratedFp8(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(32, 32), nn.LayerNorm(32), nn.Linear(32, 32), nn.Linear(32, 32))
        self.lm_head = nn.Linear(32, 32)

    @mixprec.autocast("cpu", policy=Policy.fp8().keep(names=r"^lm_head$|^body\.1$"))
    def forward(self, x):
        return self.lm_head(self.body(x))


@pytest.mark.parametrize("make", [_DecoratedFp8, lambda: _Wrapped(Policy().keep(names=r"^lm_head$|^body\.1$"), True)],
                         ids=["decorated-fp8", "root"])
def test_root_compiles_with_fullgraph_bitwise_eager(make):
    model, x = make(), torch.randn(3, 32 if isinstance(make, type) else 4)

    def step(fn):
        model.zero_grad()
        seen = _out_dtypes(model, lambda: step.out.append(fn(x)))
        out = step.out.pop()
        out.float().sum().backward()
        return seen, [out, *(p.grad.clone() for p in model.parameters())]

    step.out = []
    eager_seen, eager = step(model)
    assert eager_seen["lm_head"] == eager_seen["body.1"] == torch.float32
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    seen, got = step(compiled)
    assert seen == eager_seen
    for a, b in zip(got, eager):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_a_rule_that_matches_nothing_warns_when_its_region_is_traced():
    model = _Wrapped(Policy().keep(names=r"^lm_haed$"), root=True)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    with pytest.warns(UserWarning, match="did you mean 'lm_head'"):
        compiled(torch.randn(2, 4))


_OUTER_POLICIES = {
    "keep fp16": Policy.parse("compute=bf16").keep(names="^0$", dtype=torch.float16),
    "fp8": Policy.parse("compute=bf16").fp8(first_last="fp8"),
    "output=bf16": Policy.parse("compute=bf16,output=bf16"),
}


@pytest.mark.parametrize("inner", ["mixprec", "torch"])
@pytest.mark.parametrize("outer", list(_OUTER_POLICIES))
def test_autocast_turned_off_inside_a_policy_region_runs_the_model_in_float32(outer: str, inner: str) -> None:
    """``enabled=False`` inside a region means float32: an enclosing policy's half-dtype module
    rule (which cast the inputs to fp16 against fp32 weights: a crash), fp8 layers (which warned
    that they ran in the compute dtype) and ``output=`` (mixprec's disabled region governs as a
    nested policy does) take no effect there; bitwise the plain model, no warning."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32))
    x = torch.randn(4, 32)
    ref = model(x)
    off = (lambda: mixprec.autocast("cpu", enabled=False)) if inner == "mixprec" else (
        lambda: torch.autocast("cpu", enabled=False))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with mixprec.autocast("cpu", policy=_OUTER_POLICIES[outer]):
            with off():
                y = model(x)
            again = model(x)  # the outer policy applies again after the inner region
    if inner == "mixprec" or outer != "output=bf16":  # torch.autocast is no policy: output= still applies
        assert y.dtype == torch.float32 and torch.equal(y, ref)
    assert again.dtype == torch.bfloat16


def test_a_disabled_region_inside_a_compiled_policy_region_matches_eager() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32))
    x = torch.randn(4, 32)
    policy = Policy.parse("compute=bf16").fp8(first_last="fp8")

    def run(x: torch.Tensor) -> torch.Tensor:
        with mixprec.autocast("cpu", policy=policy):
            with mixprec.autocast("cpu", enabled=False):
                return model(x)

    eager = run(x)
    compiled = torch.compile(run, backend="eager", fullgraph=True)(x)
    assert torch.equal(eager, model(x)) and torch.equal(compiled, eager)


@pytest.mark.parametrize("outer", ["keep fp16", "fp8"])
def test_autocast_turned_off_inside_a_compiled_policy_region_matches_eager(outer: str) -> None:
    """The same inside torch.compile (fullgraph): the traced hooks read the traced autocast state
    (before: the keep-fp16 rule crashed there, the fp8 layers ran in fp8 where eager ran float32)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32))
    x = torch.randn(4, 32)
    policy = _OUTER_POLICIES[outer]

    def run(x: torch.Tensor) -> torch.Tensor:
        with mixprec.autocast("cpu", policy=policy):
            with torch.autocast("cpu", enabled=False):
                return model(x)

    eager = run(x)
    torch._dynamo.reset()
    compiled = torch.compile(run, backend="eager", fullgraph=True)(x)
    assert torch.equal(eager, model(x)) and compiled.dtype == torch.float32 and torch.equal(compiled, eager)
