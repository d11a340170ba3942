"""The unscaling strategies a GradScaler holds (``mixprec.scaling.unscaling``): both implement the
whole interface, the global one is torch's unscale bit for bit, the scaler delegates to the one
its options chose, scalers and hooks pickled before the strategies existed load, and masters are
found through the optimizer protocol (``master_pairs``)."""

from __future__ import annotations

import inspect
import pickle
import warnings

import pytest
import torch
from torch import nn

import mixprec
from mixprec.scaling import GradScaler
from mixprec.scaling.layerwise import Layerwise
from mixprec.scaling.layerwise.planning import CutHook
from mixprec.scaling.protocol import master_pairs
from mixprec.scaling.rule import ScaleConfig, init_state, update_scale
from mixprec.scaling.unscaling import GlobalUnscaling, Unscaling

STRATEGIES = [GlobalUnscaling, Layerwise]


def _interface() -> list[str]:
    return [name for name, _ in inspect.getmembers(Unscaling, inspect.isfunction) if not name.startswith("_")]


def test_the_interface_names_what_the_scaler_asks():
    assert set(_interface()) == {
        "watch", "check_ready", "observe", "unscale", "update", "skip_update", "carried", "scales", "factors", "history",
        "last_overflow", "state_dict", "load_state_dict", "stage_device",
    }


@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda c: c.__name__)
def test_every_strategy_implements_every_method_of_the_interface(strategy):
    for name in _interface():
        method = getattr(strategy, name)
        assert method is not getattr(Unscaling, name), f"{strategy.__name__}.{name} is the interface's empty body"
        assert list(inspect.signature(method).parameters) == list(inspect.signature(getattr(Unscaling, name)).parameters)
    assert isinstance(strategy.unscale_before_step, bool)


def test_the_scaler_holds_the_strategy_its_options_chose():
    assert type(GradScaler("cpu")._unscaling) is GlobalUnscaling
    assert type(GradScaler("cpu", per_layer=True)._unscaling) is Layerwise
    assert type(GradScaler("cpu", per_layer=True, enabled=False)._unscaling) is GlobalUnscaling
    assert GradScaler("cpu")._layerwise is None
    scaler = GradScaler("cpu", per_layer=True)
    assert scaler._layerwise is scaler._unscaling


def test_global_unscaling_is_torchs_unscale_bit_for_bit():
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(5, generator=gen) * 1e3, torch.randn(3, 2, generator=gen).double(), torch.randn(4, generator=gen)]
    grads[2][1] = float("inf")
    ours = [g.clone() for g in grads]
    theirs = [g.clone() for g in grads]
    params = [nn.Parameter(torch.zeros_like(g)) for g in grads]
    scale = torch.tensor(3.0)
    found = GlobalUnscaling().unscale(None, params, ours, scale)
    for p, g in zip(params, theirs):
        p.grad = g
    optimizer = torch.optim.SGD(params, lr=0.1)
    inv = scale.double().reciprocal().float()
    expected = torch.amp.GradScaler("cpu")._unscale_grads_(optimizer, inv, torch.zeros(()), False)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
    assert {d: float(f) for d, f in found.items()} == {d: float(f) for d, f in expected.items()} == {torch.device("cpu"): 1.0}


def test_the_per_region_loop_is_torchs_unscale_of_each_region_bit_for_bit():
    """Per-layer scaling divides by the plain loop with one scale per region: each region's
    gradients come out as torch's unscale by that region's scale gives them."""
    from mixprec._unscale import unscale_

    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(5, generator=gen) * 1e3, torch.randn(3, 2, generator=gen).double(),
             torch.randn(4, generator=gen), torch.randn(6, generator=gen).half(), torch.randn(2, generator=gen)]
    grads[3][1] = float("inf")
    regions = [2, 0, 1, 2, 0]
    scales = torch.tensor([3.0, 3.0 * 2**7, 3.0 * 2**-5])
    ours = [g.clone() for g in grads]
    found = unscale_(ours, scales, regions)
    flags = []
    for region, scale in enumerate(scales):
        params = [nn.Parameter(torch.zeros_like(g)) for g, r in zip(grads, regions) if r == region]
        for p, g in zip(params, [g.clone() for g, r in zip(grads, regions) if r == region]):
            p.grad = g
        inv = scale.double().reciprocal().float()
        expected = torch.amp.GradScaler("cpu")._unscale_grads_(torch.optim.SGD(params, lr=0.1), inv, torch.zeros(()), True)
        flags.append(float(expected[torch.device("cpu")]))
        mine = [g for g, r in zip(ours, regions) if r == region]
        assert all(torch.equal(a, p.grad) for a, p in zip(mine, params)), region
    assert flags == [0.0, 0.0, 1.0] and {d: float(f) for d, f in found.items()} == {torch.device("cpu"): 1.0}
    with pytest.raises(ValueError, match="one region per gradient"):
        unscale_(ours, scales, regions[:-1])


def test_global_unscaling_leaves_the_rule_alone_and_warns_on_per_layer_state():
    config = ScaleConfig()
    state = init_state(8.0, config)
    proposed = update_scale(state, torch.tensor(1.0), config)
    strategy = GlobalUnscaling()
    assert strategy.update(state, proposed, torch.tensor(1.0), None, config, True) is proposed
    assert strategy.state_dict() == {} and strategy.scales() == {} and strategy.factors() is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        strategy.load_state_dict({"scale": 8.0})
    with pytest.warns(UserWarning, match=r"per-layer scaling state \(cut points \['0'\]\)"):
        strategy.load_state_dict({"scale": 8.0, "layerwise": {"cut_points": ["0"]}})


def _chain() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 1))


def _train(scaler: GradScaler, model: nn.Module, steps: int = 2) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        optimizer.zero_grad()
        scaler.scale(model(torch.ones(3, 2)).pow(2).sum()).backward()
        scaler.step(optimizer)
        scaler.update()


@pytest.mark.parametrize("per_layer", [False, True], ids=["global", "per-layer"])
def test_a_scaler_pickled_before_the_strategies_existed_loads(per_layer):
    model = _chain()
    scaler = GradScaler("cpu", init_scale=8.0, per_layer=per_layer).watch(model)
    _train(scaler, model)
    old = scaler.__getstate__()
    unscaling = old.pop("_unscaling")
    old["_layerwise"] = unscaling if per_layer else None  # the attribute it had then
    loaded = GradScaler.__new__(GradScaler)
    loaded.__setstate__(old)
    assert "_layerwise" not in vars(loaded)
    assert type(loaded._unscaling) is (Layerwise if per_layer else GlobalUnscaling)
    assert loaded.state_dict() == scaler.state_dict()


def test_a_cut_hook_pickled_before_the_package_split_unpickles_as_an_inert_hook():
    blob = pickle.dumps(CutHook(), protocol=2)
    assert b"cmixprec.scaling.layerwise.planning\nCutHook\n" in blob
    old = blob.replace(b"cmixprec.scaling.layerwise.planning\nCutHook\n", b"cmixprec.scaling.layerwise\n_CutHook\n")
    hook = pickle.loads(old)
    assert type(hook) is CutHook and hook.owner is None
    output = torch.ones(2, requires_grad=True) * 2
    assert hook(nn.Identity(), (), output) is None and not output._backward_hooks


def test_masters_are_found_through_the_protocol():
    model = nn.Sequential(nn.Linear(2, 2).half(), nn.LayerNorm(2))
    optimizer = mixprec.MasterWeights(torch.optim.SGD(model.parameters(), lr=0.1))
    pairs = master_pairs(optimizer)
    assert [(p.dtype, m.dtype) for p, m in pairs] == [(torch.float16, torch.float32)] * 2
    assert [p for p, _ in pairs] == list(model[0].parameters())
    assert isinstance(pairs, tuple) and master_pairs(optimizer) is not pairs  # a new sequence each call
    assert master_pairs(torch.optim.SGD(model.parameters(), lr=0.1)) == ()
