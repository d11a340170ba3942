"""FP8 as a policy: selected nn.Linear layers run in fp8 inside mixprec.autocast, no module swap,
bitwise torchao's emulated Float8Linear under autocast; keep wins; the guard moves layers back."""

from __future__ import annotations

import copy
import dataclasses
import warnings

import pytest
import torch
from torch import nn

import mixprec
from mixprec import Policy, fp8

torchao_float8 = pytest.importorskip("torchao.float8")


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 64), nn.GELU(),
                         nn.Linear(64, 32), nn.LayerNorm(32), nn.Linear(32, 16))


def _torchao(model: nn.Module, recipe: str, fqns: set[str]) -> nn.Module:
    config = dataclasses.replace(torchao_float8.Float8LinearConfig.from_recipe_name(recipe), emulate=True)
    return torchao_float8.convert_to_float8_training(
        model, config=config, module_filter_fn=lambda m, fqn: fqn in fqns)


def _step(model, ctx, x):
    with ctx:
        out = model(x)
    out.float().square().mean().backward()
    return out, [p.grad for p in model.parameters()]


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_policy_route_is_bitwise_torchao_under_autocast(recipe, dtype):
    model = _model()
    ref_model = _torchao(copy.deepcopy(model), recipe, {"2", "4"})  # first and last stay
    x = torch.randn(3, 5, 32)
    out, grads = _step(model, mixprec.autocast("cpu", dtype=dtype, policy=Policy.fp8(recipe)), x)
    ref, ref_grads = _step(ref_model, torch.autocast("cpu", dtype=dtype), x)
    assert out.dtype == ref.dtype == dtype
    assert torch.equal(out, ref)
    for a, b in zip(grads, ref_grads):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert type(model[2]) is nn.Linear  # no module swap
    assert set(model.state_dict()) == set(_model().state_dict())
    assert set(fp8.layer_states(model)) == {"2", "4"}


def test_fp8_layers_differ_from_the_compute_dtype_and_the_rest_follows_the_policy():
    model = _model()
    x = torch.randn(4, 32)
    with mixprec.autocast("cpu", policy="compute=bf16,output=f32"):
        plain = model(x)
    with mixprec.autocast("cpu", policy="compute=bf16,output=f32,fp8=tensorwise"):
        out = model(x)
    assert out.dtype == plain.dtype == torch.float32
    assert not torch.equal(out, plain)
    assert (out - plain).abs().max() < 0.1  # fp8 error, not a different computation


def test_keep_wins_over_fp8_and_first_last():
    x = torch.randn(4, 32)
    model = _model()
    with mixprec.autocast("cpu", policy=Policy.fp8(first_last="fp8").keep(names=r"^4$")):
        model(x).float().sum().backward()
    assert set(fp8.layer_states(model)) == {"0", "2", "6"}
    assert fp8.layer_state(model[4], create=False) is None


def test_names_select_layers_and_ineligible_dims_warn_once_by_name():
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 20), nn.Linear(20, 32), nn.Linear(32, 32))
    with pytest.warns(UserWarning, match="'1': out_features=20 is not a multiple of 16"):
        with mixprec.autocast("cpu", policy=Policy.fp8(first_last="fp8", names=r"^[0-2]$")):
            model(torch.randn(2, 32))
    assert set(fp8.layer_states(model)) == {"0"}


def test_guard_in_the_policy_moves_a_diverging_layer_back():
    model = _model()
    guard = fp8.Guard(max_underflow=0.05, max_nonfinite=None, every=1)
    policy = Policy.fp8(guard=guard)
    x = torch.randn(4, 32)
    with mixprec.autocast("cpu", policy=policy):
        model(x).float().sum().backward()
    with torch.no_grad():
        model[3].register_forward_hook(lambda m, i, o: o.index_fill(-1, torch.tensor([0]), 1e6))
    assert guard.step() == []
    with mixprec.autocast("cpu", policy=policy):
        model(x).float().sum().backward()  # layer 4's input has an outlier: the rest underflows
    with mixprec.autocast("cpu", policy=policy):
        model(x)  # forwards never check: only guard.step() does
    assert not fp8.layer_state(model[4]).fallback
    with pytest.warns(fp8.Float8FallbackWarning, match="'4'.*at step 2: input underflow"):
        guard.step()
    assert fp8.layer_state(model[4]).fallback and not fp8.layer_state(model[2]).fallback
    with mixprec.autocast("cpu", policy=Policy.fp8(names=r"^2$")):  # layer 4 in bf16
        ref = model(x)
    with mixprec.autocast("cpu", policy=policy):
        assert torch.equal(model(x), ref)
    restored = fp8.Guard()
    restored.load_state_dict(guard.state_dict())
    assert restored.state_dict() == guard.state_dict()


def test_policy_with_fp8_round_trips_and_parses():
    p = Policy.parse("compute=bf16,fp8=rowwise").keep(types=nn.LayerNorm)
    assert str(p) == "params=float32,compute=bfloat16; keep float32=LayerNorm; fp8 rowwise=Linear except first/last"
    assert Policy.from_json(p.to_json()) == p
    g = Policy.fp8("tensorwise", names=r"blocks", first_last="fp8", guard=fp8.Guard(every=7))
    back = Policy.from_json(g.to_json())
    assert back == g and back.fp8_rule.guard.every == 7
    assert Policy.fp8() == Policy().fp8()
    with pytest.raises(ValueError, match="unknown fp8 recipe"):
        Policy.parse("fp8=rowwize")
    with pytest.raises(ValueError, match="first_last"):
        Policy.fp8(first_last="bf16")


@pytest.mark.parametrize("where", ["around", "inside"])
def test_fp8_policy_compiles_fullgraph_bitwise_eager_without_recompiles(where):
    policy = Policy.fp8("tensorwise").keep(types=nn.LayerNorm)
    eager_model, compiled_model = _model(), _model()

    def region(model):
        def f(x):
            with mixprec.autocast("cpu", policy=policy):
                return model(x)
        return f

    if where == "inside":
        compiled = torch.compile(region(compiled_model), backend="aot_eager", fullgraph=True)
    else:
        compiled = region(torch.compile(compiled_model, backend="aot_eager", fullgraph=True))
    torch._dynamo.reset()
    for step in range(3):
        x = torch.randn(4, 32, generator=torch.Generator().manual_seed(step))
        eager_model.zero_grad(), compiled_model.zero_grad()
        e = region(eager_model)(x)
        e.float().square().mean().backward()
        with torch._dynamo.config.patch(error_on_recompile=step > 0):
            c = compiled(x)
        c.float().square().mean().backward()
        assert c.dtype == e.dtype and torch.equal(c, e)
        for a, b in zip(compiled_model.parameters(), eager_model.parameters()):
            assert torch.equal(a.grad, b.grad)
    for name in ("2", "4"):  # statistics recorded in the compiled forward and backward
        assert torch.equal(fp8.layer_state(compiled_model[int(name)]).stats,
                           fp8.layer_state(eager_model[int(name)]).stats)
    assert fp8.layer_state(compiled_model[4]).stats[2, 0] > 0


def test_checkpoint_recomputes_the_fp8_forward_bitwise():
    from torch.utils.checkpoint import checkpoint

    x = torch.randn(4, 32, requires_grad=True)
    grads = []
    for use_checkpoint in (False, True):
        model = _model()
        with mixprec.autocast("cpu", policy=Policy.fp8(first_last="fp8")), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = (checkpoint(model, x, use_reentrant=False, context_fn=mixprec.checkpoint_context_fn)
                   if use_checkpoint else model(x))
        out.float().sum().backward()
        grads.append([x.grad.clone(), *(p.grad for p in model.parameters())])
        x.grad = None
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_layers_an_fp8_policy_keeps_run_the_policy_table_through_the_route():
    """fp8's linear goes through the C++ kernel's route op; a Linear the policy keeps out of fp8
    (first/last) runs the policy's own kind for linear, here passthrough (PyTorch's fallthrough:
    linear's own addmm is lowered): bitwise the same policy without fp8."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 32))
    x = torch.randn(4, 32)
    seen: dict[str, list[torch.Tensor]] = {"plain": [], "fp8": []}
    table = Policy().with_ops(passthrough=["linear"])
    for label, policy in (("plain", table), ("fp8", table.fp8())):
        hook = model[0].register_forward_hook(lambda m, a, out, label=label: seen[label].append(out))
        with mixprec.autocast("cpu", policy=policy):
            model(x)
        hook.remove()
    assert seen["fp8"][0].dtype == torch.bfloat16 and torch.equal(seen["fp8"][0], seen["plain"][0])


def test_a_policy_over_a_converted_model_leaves_the_converted_layers_to_their_recipe():
    """fp8.convert's layers run fp8 in their own recipe: a policy's fp8 rule does not select them
    again (it warned that they ran in the compute dtype), and selects the other layers."""
    import warnings

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32))
    model = fp8.convert(model, "rowwise", filter_fn=lambda mod, fqn: fqn == "2")
    assert fp8.select_layers(model, first_last="fp8") == ["0", "4"]
    policy = Policy.parse("compute=bf16").fp8("tensorwise", first_last="fp8")
    x = torch.randn(4, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with mixprec.autocast("cpu", policy=policy):
            out = model(x)
    assert out.dtype == torch.bfloat16
    only = fp8.convert(nn.Sequential(nn.Linear(32, 32)), "tensorwise", filter_fn=lambda mod, fqn: True)
    with pytest.warns(UserWarning, match="converted by fp8.convert and run in their own recipe"):
        assert fp8.select_layers(only, first_last="fp8") == []


class _Checkpointed(nn.Module):
    """A block of two Linears run through ``torch.utils.checkpoint.checkpoint(**kwargs)``."""

    def __init__(self, **kwargs) -> None:
        super().__init__()
        self.kwargs = kwargs
        self.block = nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 32))
        self.head = nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        return self.head(checkpoint(self.block, x, **self.kwargs))


@pytest.mark.parametrize("reentrant", [True, False])
def test_a_reentrant_checkpoint_around_an_fp8_layer_warns_once_naming_it(reentrant: bool) -> None:
    torch.manual_seed(0)
    kwargs = {"use_reentrant": True} if reentrant else {"use_reentrant": False,
                                                        "context_fn": mixprec.checkpoint_context_fn}
    model, x = _Checkpointed(**kwargs), torch.randn(4, 32, requires_grad=True)
    policy = Policy.parse("compute=bf16").fp8("tensorwise", names=r"^block\.2$", first_last="fp8")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            with mixprec.autocast("cpu", policy=policy):
                model(x).float().square().mean().backward()
        with torch.no_grad(), mixprec.autocast("cpu", policy=policy):
            model(x)  # evaluation: grad off, no checkpoint: no warning
    said = [str(w.message) for w in caught if "use_reentrant=True" in str(w.message)]
    assert said == (["fp8: layer 'block.2' runs inside torch.utils.checkpoint.checkpoint(..., use_reentrant=True), "
                     "which recomputes it in backward outside mixprec's policy: its backward is not fp8 and records "
                     "no grad_output statistics (a Guard or Controller cannot see its gradients). Use "
                     "checkpoint(..., use_reentrant=False, context_fn=mixprec.checkpoint_context_fn)"]
                    if reentrant else [])
    # what the warning says: under use_reentrant=True the layer's grad_output is never recorded
    assert (fp8.layer_state(model.block[2]).stats[2, 0] > 0).item() == (not reentrant)


def test_a_recipe_named_in_a_policy_is_one_frozen_value():
    """A policy asks for its layers' recipes at every call: a name gives the same frozen
    recipe each time (equal to a fresh one), an unknown name raises each time."""
    from mixprec.formats._layers import as_recipe

    rule = Policy.parse("compute=bf16").fp8("nvfp4").fp8_rule
    assert rule.recipe_for("a") is rule.recipe_for("b") is as_recipe("nvfp4")
    assert as_recipe("nvfp4") == fp8.Float8Recipe.nvfp4() and as_recipe("tensorwise") is not as_recipe("nvfp4")
    with pytest.raises(dataclasses.FrozenInstanceError):
        as_recipe("nvfp4").name = "other"  # type: ignore[misc]
    for _ in range(2):
        with pytest.raises(ValueError, match="unknown fp8 recipe"):
            as_recipe("nvfp5")


LOST_IN_FLOAT32 = {  # a policy in float32 (autocast off): what it asked for the modules runs nothing
    "an fp8 rule": Policy(compute=torch.float32).fp8("tensorwise", first_last="fp8"),
    "a keep rule": Policy(compute=torch.float32).keep(types=(nn.LayerNorm,), dtype=torch.bfloat16),
}


@pytest.mark.parametrize("policy", LOST_IN_FLOAT32.values(), ids=LOST_IN_FLOAT32.keys())
def test_a_float32_policy_says_its_module_rules_do_nothing(policy):
    """torch turns autocast off for float32 and warns in general terms; the warning also says that
    the policy's fp8 and module rules do nothing, and how to get fp8 layers in a float32 model
    (before, the rule was silently dropped: no layer state, nothing in fp8). A plain float32
    policy keeps torch's words alone."""
    model = nn.Sequential(nn.Linear(32, 32), nn.LayerNorm(32), nn.Linear(32, 32))
    with pytest.warns(UserWarning, match=r"is not supported\. Disabling autocast\..*rules then do nothing"):
        with mixprec.autocast("cpu", policy=policy):
            out = model(torch.randn(4, 32))
    assert out.dtype == torch.float32 and not fp8.layer_states(model)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with mixprec.autocast("cpu", policy=Policy(compute=torch.float32)):
            model(torch.randn(4, 32))
    assert [str(w.message) for w in seen] == [
        "In CPU autocast, but the target dtype torch.float32 is not supported. Disabling autocast. "
        "Autocast only supports torch.bfloat16 and torch.float16."]
