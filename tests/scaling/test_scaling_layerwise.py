"""Per-layer gradient scaling: ``mixprec.GradScaler(device, per_layer=True).watch(model)``.

The acceptance networks: a chain of 8 ``Shrink -> Linear -> tanh`` blocks whose weight gradients
span 44 binades (no single fp16 loss scale holds them), and a pre-norm residual network with a
gradient-shrinking op on the stream and inside each block's branch. Both under
``mixprec.autocast("cpu", dtype=torch.float16)``, against float32 gradients of the same weights.
"""

from __future__ import annotations

import copy
import os
import pickle
from unittest import mock

import pytest
from hypothesis import given, settings, strategies as st
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import mixprec
from mixprec.scaling.layerwise import (
    LayerState,
    Layerwise,
    choose_cut_points,
    host_rule,
    layer_rule,
    pow2,
    topology,
)
from mixprec.scaling.rule import ScaleConfig

SHRINK = 2.0**-6


class _ShrinkFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


class Shrink(nn.Module):
    """The identity; its backward multiplies the gradient by ``factor`` (2**-6)."""

    def __init__(self, factor: float = SHRINK) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x):
        return _ShrinkFn.apply(x, self.factor)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.shrink = Shrink()
        self.lin = nn.Linear(32, 32)

    def forward(self, x):
        return torch.tanh(self.lin(self.shrink(x)))


def chain() -> nn.Sequential:
    """8 blocks and a head; fp32 weight-gradient amax from 2**-1 (top) to 2**-44 (bottom)."""
    torch.manual_seed(1)
    return nn.Sequential(*[Block() for _ in range(8)], nn.Linear(32, 1))


class ResBlock(nn.Module):
    """Pre-norm residual block; the gradient shrinks on the stream and again inside the branch."""

    def __init__(self) -> None:
        super().__init__()
        self.shrink = Shrink()
        self.ln = nn.LayerNorm(32)
        self.fc1 = nn.Linear(32, 64)
        self.branch_shrink = Shrink()
        self.fc2 = nn.Linear(64, 32)

    def forward(self, x):
        x = self.shrink(x)
        return x + self.fc2(self.branch_shrink(torch.tanh(self.fc1(self.ln(x)))))


class ResNet(nn.Module):
    def __init__(self, skip_around: bool = False) -> None:
        super().__init__()
        torch.manual_seed(2)
        self.inp = nn.Linear(16, 32)
        self.blocks = nn.ModuleList(ResBlock() for _ in range(6))
        self.ln_f = nn.LayerNorm(32)
        self.head = nn.Linear(32, 1)
        self.skip_around = skip_around

    def forward(self, x):
        x = self.inp(x)
        first = None
        for block in self.blocks:
            x = block(x)
            first = x if first is None else first
        if self.skip_around:  # a skip connection from block 0's output past the other blocks
            x = x + first
        return self.head(self.ln_f(x))


def _data(n_in: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(64, n_in, generator=g), 100 * torch.randn(64, 1, generator=g)


def _loss(model, x, t, fp16: bool = True):
    with mixprec.autocast("cpu", dtype=torch.float16, enabled=fp16):
        out = model(x)
    return F.mse_loss(out.float(), t)


def _reference_grads(model, x, t) -> dict[str, torch.Tensor]:
    ref = copy.deepcopy(model)
    ref.zero_grad()
    _loss(ref, x, t, fp16=False).backward()
    return {n: p.grad.clone() for n, p in ref.named_parameters()}


def _flushed(ref: torch.Tensor, got: torch.Tensor) -> float:
    """Fraction of elements non-zero in fp32 but zero here."""
    return ((ref != 0) & (got == 0)).float().mean().item()


def _rel_err(ref: torch.Tensor, got: torch.Tensor) -> float:
    return ((got - ref).norm() / ref.norm()).item()


def _weights(model) -> list[str]:
    return [n for n, p in model.named_parameters() if p.dim() == 2]


def _train_and_check(model, n_in, scaler, steps=40, warmup=30, lr=1e-3):
    """Trains on a fresh batch each step; after ``warmup`` steps checks every weight matrix's
    gradient against float32 gradients of the same weights and batch."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    worst_flush, worst_err, skipped = 0.0, 0.0, []
    for step in range(steps):
        x, t = _data(n_in, seed=step)
        ref = _reference_grads(model, x, t) if step >= warmup else None
        optimizer.zero_grad()
        scaler.scale(_loss(model, x, t)).backward()
        scaler.unscale_(optimizer)
        if ref is not None:
            for name in _weights(model):
                grad = model.get_parameter(name).grad
                worst_flush = max(worst_flush, _flushed(ref[name], grad))
                worst_err = max(worst_err, _rel_err(ref[name], grad))
        scaler.step(optimizer)
        scaler.update()
        if step >= warmup:
            skipped.append(bool(scaler.last_step_skipped))
    return worst_flush, worst_err, skipped


# ------------------------------------------------------------------ the 44-binade chain


def test_chain_spans_44_binades_and_no_global_scale_fits():
    model = chain()
    x, t = _data(32)
    ref = _reference_grads(model, x, t)
    names = [f"{i}.lin.weight" for i in range(8)]
    amax = [torch.log2(ref[n].abs().max()).item() for n in names]
    assert -45 < amax[0] < -43 and -1.5 < amax[-1] < 0

    def fp16_grads(scale):
        model.zero_grad()
        (_loss(model, x, t) * scale).backward()
        return {n: p.grad / scale for n, p in model.named_parameters()}

    finite = [e for e in range(8, 17) if all(torch.isfinite(g).all() for g in fp16_grads(2.0**e).values())]
    assert max(finite) == 12 and 13 not in finite  # the best single scale is 2**12
    grads = fp16_grads(2.0**12)
    flushed = [_flushed(ref[n], grads[n]) for n in names]
    assert flushed[0] == flushed[1] == 1.0
    assert 0.2 < flushed[2] < 0.5 and 0.001 < flushed[3] < 0.05
    assert flushed[4:] == [0.0] * 4


def test_per_layer_holds_the_chain_in_fp16():
    model = chain()
    scaler = mixprec.GradScaler("cpu", per_layer=True).watch(model)  # starts at 2**16, too high
    assert scaler.layer_scales() == {str(i): 1.0 for i in range(8)}
    flush, err, skipped = _train_and_check(model, 32, scaler)
    assert flush < 0.01 and err < 1e-2
    assert skipped == [False] * 10
    factors = scaler.layer_scales()
    assert all(factors[str(i)] >= 2.0**4 for i in range(7))  # each cut undoes most of a Shrink


# ------------------------------------------------------------------ the residual network


def test_per_layer_holds_a_residual_network_in_fp16():
    model = ResNet()
    x, t = _data(16)
    ref = _reference_grads(model, x, t)
    scaler = mixprec.GradScaler("cpu", per_layer=True).watch(model)
    assert scaler._layerwise.names == [f"blocks.{i}" for i in range(6)]
    # The global scaler alone flushes the bottom block (baseline):
    model.zero_grad()
    (_loss(model, x, t) * 2.0**10).backward()
    assert _flushed(ref["blocks.0.fc1.weight"], model.blocks[0].fc1.weight.grad) > 0.5
    flush, err, skipped = _train_and_check(model, 16, scaler)
    # Every parameter, branch (fc1, fc2, ln) and stream alike, carries exactly its own scale:
    # a double scaling where the branch and the skip path merge would be off by powers of two.
    assert flush < 0.01 and err < 1e-2
    assert skipped == [False] * 10


def test_a_cut_point_inside_a_residual_branch_is_refused():
    model = ResNet()
    x, t = _data(16)
    scaler = mixprec.GradScaler("cpu", per_layer=True, cut_points=["blocks.0.fc1", "blocks.1"]).watch(model)
    with pytest.raises(ValueError, match="cross different cut points.*'blocks.0.fc1'"):
        scaler.scale(_loss(model, x, t))


def test_a_skip_connection_around_cut_points_is_refused():
    model = ResNet(skip_around=True)
    x, t = _data(16)
    scaler = mixprec.GradScaler("cpu", per_layer=True).watch(model)
    with pytest.raises(ValueError, match="skip connection"):
        scaler.scale(_loss(model, x, t))


# ------------------------------------------------------------------ exactness and parity


def _run(model, scaler, optimizer_factory, steps=12):
    x, t = _data(32)
    optimizer = optimizer_factory(model.parameters())
    trace = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = _loss(model, x, t)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        trace.append((loss.item(), scaler.get_scale(), bool(scaler.last_step_skipped)))
    return trace, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize(
    "factory",
    [lambda p: torch.optim.SGD(p, lr=1e-3, momentum=0.9), lambda p: torch.optim.AdamW(p, lr=1e-3, fused=True)],
    ids=["sgd", "fused-adamw"],
)
def test_factors_pinned_at_one_are_bitwise_the_global_scaler(factory):
    """layer_bounds=(1, 1): the hooks, the per-region unscale and the rule run, every factor
    stays 1, and losses, scales, skips, weights and checkpoints are those of the plain scaler."""
    plain = mixprec.GradScaler("cpu", init_scale=2.0**16, growth_interval=3)
    trace_a, weights_a = _run(chain(), plain, factory)
    model = chain()
    pinned = mixprec.GradScaler("cpu", init_scale=2.0**16, growth_interval=3, per_layer=True, layer_bounds=(1.0, 1.0))
    pinned.watch(model)
    trace_b, weights_b = _run(model, pinned, factory)
    assert any(skipped for *_, skipped in trace_a)  # the run has overflows and growth
    assert trace_a == trace_b
    assert all(torch.equal(a, b) for a, b in zip(weights_a, weights_b))
    saved = pinned.state_dict()
    assert set(pinned.layer_scales().values()) == {1.0}
    assert saved.pop("layerwise")["cut_points"] == [str(i) for i in range(8)]
    assert saved == plain.state_dict()


def test_without_per_layer_nothing_changes():
    scaler = mixprec.GradScaler("cpu").watch(chain())
    assert scaler._layerwise is None and scaler.last_overflow_cuts == ()
    with pytest.raises(RuntimeError, match="per_layer=True"):
        scaler.layer_scales()
    with pytest.raises(ValueError, match="per_layer=True"):
        mixprec.GradScaler("cpu", cut_points=["0"])
    assert not any(m._forward_hooks for m in chain().modules())


def test_unscale_divides_each_gradient_by_its_own_power_of_two():
    """After warm-up the factors differ per cut point; the unscaled gradients equal the scaled
    ones divided by scale * prod(factors above), bit for bit."""
    model = chain()
    x, t = _data(32)
    scaler = mixprec.GradScaler("cpu", per_layer=True).watch(model)
    _train_and_check(model, 32, scaler, steps=8, warmup=8, lr=0.0)
    factors = scaler.layer_scales()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    optimizer.zero_grad()
    scaler.scale(_loss(model, x, t)).backward()
    scaled = {n: p.grad.clone() for n, p in model.named_parameters()}
    scaler.unscale_(optimizer)
    total = scaler.get_scale()
    for block in reversed(range(8)):
        total *= factors[str(block)]
        for kind in ("weight", "bias"):
            name = f"{block}.lin.{kind}"
            assert torch.equal(dict(model.named_parameters())[name].grad, scaled[name] / total)
    scaler.step(optimizer)
    scaler.update()


def test_pow2_is_exact():
    e = torch.arange(-126, 128)
    assert torch.equal(pow2(e).double(), torch.tensor([2.0**int(k) for k in e], dtype=torch.float64))


# ------------------------------------------------------------------ the rule: host and device


_STAT = st.sampled_from([-1.0, 0.0, 2.0**-149, 3 * 2.0**-140, 2.0**-20, 0.3, 1.0, 1.5, 7e4, 3e38,
                         float("inf"), float("nan")])


@st.composite
def _rule_inputs(draw):
    n = draw(st.integers(1, 5))
    # a tree: each cut point's region hangs from the top or from a cut point above it
    parents = [draw(st.sampled_from([0] + [j + 1 for j in range(k + 1, n)])) for k in range(n)]
    bounds = draw(st.sampled_from([(-14, 15), (0, 0), (-2, 4), (1, 3)]))
    config = ScaleConfig(
        growth_interval=draw(st.integers(1, 4)), hysteresis=draw(st.integers(1, 3)),
        consecutive_hysteresis=draw(st.booleans()), backoff_factor=draw(st.sampled_from([0.5, 0.25])),
        growth_factor=draw(st.sampled_from([2.0, 4.0])),
    )
    ints = st.lists(st.integers(0, 4), min_size=n, max_size=n)
    exponent = draw(st.lists(st.integers(min(bounds[0], 0), bounds[1]), min_size=n, max_size=n))
    state = LayerState(exponent, draw(ints), draw(ints), draw(ints))
    stats = torch.tensor(draw(st.lists(_STAT, min_size=n + 1, max_size=n + 1)), dtype=torch.float32)
    return state, stats, parents, config, bounds, draw(st.booleans())


@settings(max_examples=300, deadline=None)
@given(_rule_inputs())
def test_the_host_rule_is_the_device_rule_bit_for_bit(inputs):
    """``host_rule`` (the CPU's) against ``layer_rule`` (the device ops), with the overflow flag
    known on the host and as a device tensor: zeros, subnormals, inf/NaN, trees, all options."""
    state, stats, parents, config, bounds, overflow = inputs
    topo = topology(parents, "cpu")
    tensors = LayerState(*(torch.tensor(v, dtype=torch.int32) for v in state))
    totals = topo.membership @ tensors.exponent.float()
    host, host_culprit, host_absorbed = host_rule(state, stats.tolist(), overflow, parents, config, bounds)
    for flag in (overflow, torch.tensor(overflow)):
        new, culprit, absorbed = layer_rule(tensors, stats, totals, flag, topo, config, bounds)
        assert [t.tolist() for t in new] == [list(v) for v in host]
        assert all(t.dtype == torch.int32 for t in new)
        assert (culprit.tolist() if culprit is not None else [False] * len(parents)) == host_culprit
        assert (bool(absorbed) if absorbed is not None else False) == host_absorbed


def test_the_host_and_device_updates_train_the_same_bits(monkeypatch):
    """The whole per-layer step with the rule on the host (the CPU default) and as device ops:
    same factors, margins, skipped steps and weights, overflows included."""
    runs = []
    for devices in (("cpu",), ()):
        monkeypatch.setattr(Layerwise, "host_devices", devices)
        model = chain()
        scaler = mixprec.GradScaler("cpu", init_scale=2.0**24, hysteresis=2, growth_interval=3, per_layer=True)
        scaler.watch(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        trace = []
        for step in range(25):
            x, t = _data(32, seed=step)
            optimizer.zero_grad()
            scaler.scale(_loss(model, x, t)).backward()
            scaler.step(optimizer)
            scaler.update()
            trace.append((scaler.get_scale(), scaler.state_dict()["layerwise"], bool(scaler.last_step_skipped)))
        runs.append((trace, [p.detach().clone() for p in model.parameters()]))
    (trace_a, weights_a), (trace_b, weights_b) = runs
    assert trace_a == trace_b and sum(skipped for *_, skipped in trace_a) >= 3
    assert all(torch.equal(a, b) for a, b in zip(weights_a, weights_b))


def test_two_optimizers_update_as_one():
    """The model's parameters split over two plain optimizers (each step reads its overflow flag
    on the host): the same loss scales and factors after every update as one optimizer over all
    of them, overflows included (an overflow in one optimizer's gradients is the iteration's,
    though each optimizer skips on its own flags, as under torch's GradScaler)."""
    runs = []
    for split in (False, True):
        model = chain()
        scaler = mixprec.GradScaler("cpu", init_scale=2.0**24, hysteresis=2, growth_interval=3, per_layer=True)
        scaler.watch(model)
        params = list(model.parameters())
        halves = [params[: len(params) // 2], params[len(params) // 2:]] if split else [params]
        optimizers = [torch.optim.SGD(h, lr=1e-3) for h in halves]
        trace, skips = [], 0
        for step in range(25):
            x, t = _data(32, seed=step)
            for optimizer in optimizers:
                optimizer.zero_grad()
            scaler.scale(_loss(model, x, t)).backward()
            for optimizer in optimizers:
                scaler.step(optimizer)
                skips += bool(scaler.last_step_skipped)
            scaler.update()
            trace.append((scaler.get_scale(), scaler.state_dict()["layerwise"]))
        runs.append((trace, skips))
    (trace_a, skips_a), (trace_b, skips_b) = runs
    assert trace_a == trace_b and skips_a >= 3 and skips_b >= skips_a


# ------------------------------------------------------------------ overflow, state


def test_an_overflow_below_the_top_backs_off_its_cut_point_not_the_loss_scale():
    model = chain()
    x, t = _data(32)
    scaler = mixprec.GradScaler("cpu", init_scale=2.0**10, per_layer=True).watch(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    for step in range(6):
        model[3].shrink.factor = 2.0**20 if step == 5 else SHRINK  # block 3's input gradient blows up
        before_scale, before = scaler.get_scale(), scaler.layer_scales()
        optimizer.zero_grad()
        scaler.scale(_loss(model, x, t)).backward()
        scaler.step(optimizer)
        scaler.update()
    assert bool(scaler.last_step_skipped)
    assert scaler.last_overflow_cuts == ("3",)
    assert scaler.get_scale() == before_scale  # absorbed by the cut point
    after = scaler.layer_scales()
    assert after["3"] == before["3"] / 2
    assert all(after[k] == before[k] for k in after if k != "3")
    assert scaler.state_dict()["layerwise"]["margin"][3] == 1
    history = scaler.layer_scale_history()
    assert len(history) == 6 and history[-1] == after and history[-2] == before


def test_a_deep_copy_of_the_watched_model_is_not_scaled():
    """copy.deepcopy copies the forward hooks; on the copy they must do nothing."""
    model = chain()
    scaler = mixprec.GradScaler("cpu", per_layer=True).watch(model)
    _train_and_check(model, 32, scaler, steps=6, warmup=6, lr=0.0)
    assert max(scaler.layer_scales().values()) > 1
    x, t = _data(32)
    twin, fresh = copy.deepcopy(model), chain()
    for m in (twin, fresh):
        _loss(m, x, t, fp16=False).backward()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(twin.parameters(), fresh.parameters()))


def test_state_dict_resumes_the_same_trajectory_and_torch_checkpoints_load():
    x, t = _data(32)

    def run(scaler, model, optimizer, steps):
        out = []
        for _ in range(steps):
            optimizer.zero_grad()
            scaler.scale(_loss(model, x, t)).backward()
            scaler.step(optimizer)
            scaler.update()
            out.append((scaler.get_scale(), tuple(scaler.layer_scales().values())))
        return out

    model = chain()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = mixprec.GradScaler("cpu", per_layer=True).watch(model)
    first = run(scaler, model, optimizer, 4)
    saved, model_state, opt_state = scaler.state_dict(), copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict())
    straight = run(scaler, model, optimizer, 4)

    model2 = chain()
    model2.load_state_dict(model_state)
    optimizer2 = torch.optim.SGD(model2.parameters(), lr=1e-3)
    optimizer2.load_state_dict(opt_state)
    resumed = mixprec.GradScaler("cpu", per_layer=True)
    resumed.load_state_dict(saved)  # before watch: kept until the cut points are known
    resumed.watch(model2)
    assert resumed.layer_scales() == dict(zip(map(str, range(8)), first[-1][1]))
    assert run(resumed, model2, optimizer2, 4) == straight
    # Pickling keeps the factors (watch again after unpickling).
    clone = pickle.loads(pickle.dumps(scaler))
    clone.watch(model)
    assert clone.layer_scales() == scaler.layer_scales()

    torch_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**9)
    torch_scaler.load_state_dict(saved)  # ours loads in torch's
    assert torch_scaler.get_scale() == saved["scale"]
    fresh = mixprec.GradScaler("cpu", per_layer=True).watch(chain())
    fresh.load_state_dict(torch_scaler.state_dict())  # and torch's in ours: factors stay 1
    assert fresh.get_scale() == saved["scale"] and set(fresh.layer_scales().values()) == {1.0}
    other = mixprec.GradScaler("cpu", per_layer=True, cut_points=["0", "1"]).watch(chain())
    with pytest.raises(ValueError, match="cut points"):
        other.load_state_dict(saved)


def test_cut_point_choice_and_errors():
    assert choose_cut_points(chain()) == [str(i) for i in range(8)]
    assert choose_cut_points(ResNet()) == [f"blocks.{i}" for i in range(6)]
    with pytest.raises(ValueError, match="Did you mean 'blocks.1'"):
        choose_cut_points(ResNet(), ["blocks.1x"])
    with pytest.raises(ValueError, match="cut_points="):
        choose_cut_points(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="power of two"):
        mixprec.GradScaler("cpu", per_layer=True, layer_bounds=(0.3, 2.0))


@pytest.mark.parametrize("host_devices", [(), ("cpu",)], ids=["device rule", "host rule"])
def test_steps_cost_no_host_sync_beyond_the_global_scaler(syncs, host_devices):
    """With the rule as device ops (as on an accelerator): no read beyond the global scaler's.
    With the CPU's host rule: two reads of host memory per update (no syncs on the CPU)."""
    with mock.patch.object(Layerwise, "host_devices", host_devices):
        counts = _counted_syncs(syncs)
    assert counts[1] == counts[0] + (2 if host_devices else 0)


def _counted_syncs(syncs) -> list[int]:
    counts = []
    for per_layer in (False, True):
        model = chain()
        x, t = _data(32)
        scaler = mixprec.GradScaler("cpu", per_layer=per_layer).watch(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        for step in range(3):
            optimizer.zero_grad()
            scaler.scale(_loss(model, x, t)).backward()
            if step == 2:
                syncs.start()
            scaler.step(optimizer)
            scaler.update()
        counts.append(syncs.stop())
    return counts


# ------------------------------------------------------------------ compile, checkpointing, masters


class CheckpointedChain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = chain()

    def forward(self, x):
        for block in self.blocks[:-1]:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        return self.blocks[-1](x)


def _grads_after(model, scaler, steps=5):
    x, t = _data(32)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    for _ in range(steps):
        optimizer.zero_grad()
        scaler.scale(_loss(model, x, t)).backward()
        scaler.unscale_(optimizer)
        grads = [p.grad.clone() for p in model.parameters()]
        scaler.step(optimizer)
        scaler.update()
    return grads, scaler.layer_scales()


def test_activation_checkpointing_gives_the_same_bits():
    model = chain()
    scaler = mixprec.GradScaler("cpu", per_layer=True)
    scaler.watch(model)
    grads_a, factors_a = _grads_after(model, scaler)
    ckpt = CheckpointedChain()
    cuts = [f"blocks.{i}" for i in range(8)]  # blocks.8, the head, would be chosen too
    scaler_b = mixprec.GradScaler("cpu", per_layer=True, cut_points=cuts).watch(ckpt)
    grads_b, factors_b = _grads_after(ckpt, scaler_b)
    assert list(factors_a.values()) == list(factors_b.values()) and max(factors_a.values()) > 1
    assert all(torch.equal(a, b) for a, b in zip(grads_a, grads_b))


def test_master_weights_with_fp16_weights():
    model = chain()
    x, t = _data(32)
    ref = _reference_grads(model, x, t)
    mixprec.to_low_precision(model, torch.float16)
    optimizer = mixprec.MasterWeights(torch.optim.SGD(model.parameters(), lr=0.0))
    scaler = mixprec.GradScaler("cpu", per_layer=True).watch(model)
    for _ in range(8):
        optimizer.zero_grad()
        with mixprec.autocast("cpu", dtype=torch.float16):
            loss = F.mse_loss(model(x.half()).float(), t)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        names = [n for n, _ in model.named_parameters()]
        grads = {n: m.grad.clone() for n, m in zip(names, optimizer.masters)}
        scaler.step(optimizer)
        scaler.update()
    for name in _weights(model):
        # fp16 weights and inputs differ from the fp32 reference by rounding, not by flushing
        assert _flushed(ref[name], grads[name]) < 0.01
        assert _rel_err(ref[name], grads[name]) < 5e-2


@pytest.mark.slow
def test_torch_compile_around_the_model():
    eager = chain()
    grads_a, factors_a = _grads_after(eager, mixprec.GradScaler("cpu", per_layer=True).watch(eager), steps=10)
    model = chain()
    compiled = torch.compile(model)
    scaler = mixprec.GradScaler("cpu", per_layer=True).watch(compiled)
    assert scaler._layerwise.names == [f"_orig_mod.{i}" for i in range(8)]  # the head left out
    grads_b, factors_b = _grads_after(compiled, scaler, steps=10)
    assert list(factors_a.values()) == list(factors_b.values()) and max(factors_a.values()) > 1
    for a, b in zip(grads_a, grads_b):
        assert _rel_err(a, b) < 1e-2 and _flushed(a, b) < 0.01


# ------------------------------------------------------------------ DDP, 2 gloo ranks


def _distributed_worker(rank: int, port: int, out_dir: str, kind: str) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from _distributed import gloo_group

    torch.set_num_threads(1)
    with gloo_group(rank, port, 2):
        if kind == "ddp":
            model = DDP(chain())
        else:  # FSDP2: each block sharded, then the root
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (2,))
            model = chain()
            for block in list(model)[:-1]:
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
        scaler = mixprec.GradScaler("cpu", init_scale=2.0**12, per_layer=True, process_group="default").watch(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        x, t = _data(32, seed=10 + rank)  # each rank its own batch: different activation gradients
        trace = []
        for _ in range(6):
            optimizer.zero_grad()
            scaler.scale(_loss(model, x, t)).backward()
            scaler.step(optimizer)
            scaler.update()
            trace.append((scaler.get_scale(), tuple(scaler.layer_scales().values()), bool(scaler.last_step_skipped)))
        weights = [(p.full_tensor() if kind == "fsdp" else p).detach().clone() for p in model.parameters()]
        torch.save({"trace": trace, "weights": weights}, os.path.join(out_dir, f"{rank}.pt"))


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_ranks_agree_on_the_factors(tmp_path, kind):
    """DDP and FSDP2 fully_shard, 2 gloo ranks, each its own batch."""
    from _distributed import spawn

    spawn(_distributed_worker, str(tmp_path), kind)
    r0, r1 = (torch.load(tmp_path / f"{rank}.pt") for rank in range(2))
    assert r0["trace"] == r1["trace"]
    assert max(r0["trace"][-1][1]) > 1  # the factors moved, identically on both ranks
    assert all(torch.equal(a, b) for a, b in zip(r0["weights"], r1["weights"]))


def _ungrouped_worker(rank: int, port: int, out_dir: str, kind: str) -> None:
    """``per_layer=True`` without ``process_group`` on 2 ranks: what the first steps say."""
    import warnings

    from torch.nn.parallel import DistributedDataParallel as DDP

    from _distributed import gloo_group

    torch.set_num_threads(1)
    with gloo_group(rank, port, 2):
        if kind == "ddp":
            model = DDP(chain())
        else:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            model = fully_shard(chain(), mesh=init_device_mesh("cpu", (2,)))
        scaler = mixprec.GradScaler("cpu", init_scale=2.0**12, per_layer=True).watch(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        x, t = _data(32, seed=10 + rank)
        said = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                for _ in range(3):
                    optimizer.zero_grad()
                    scaler.scale(_loss(model, x, t)).backward()
                    scaler.step(optimizer)
                    scaler.update()
            except ValueError as e:
                said.append(f"ValueError: {e}")
        said += [str(w.message) for w in caught if "per_layer" in str(w.message)]
        torch.save(said, os.path.join(out_dir, f"{rank}.pt"))


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
@pytest.mark.parametrize("kind,said", [("ddp", "GradScaler(per_layer=True) on 2 ranks without process_group"),
                                       ("fsdp", "ValueError: GradScaler(per_layer=True) on FSDP2 or DTensor")])
def test_ranks_without_a_process_group_are_told(tmp_path, kind, said):
    """Without ``process_group`` each rank picked its own factors: under DDP the ranks' weights
    diverged silently (4.9e-2 against 1.2e-3 of the single-process run), under FSDP2 the unscale
    crashed inside scatter_reduce_. DDP warns once (ranks that train apart may mean it), FSDP2's
    sharded gradients are refused, each saying to pass ``process_group``."""
    from _distributed import spawn

    spawn(_ungrouped_worker, str(tmp_path), kind)
    for rank in range(2):
        messages = torch.load(tmp_path / f"{rank}.pt")
        assert len(messages) == 1 and messages[0].startswith(said), messages
        assert "process_group='default'" in messages[0]


# ------------------------------------------------------------------ Lightning


@pytest.mark.slow
def test_lightning_with_a_per_layer_scaler():
    """MixprecPrecision(scaler=...) takes a per-layer scaler: the Trainer's loop scales, unscales,
    steps and updates through it, and the 44-binade chain's gradients stay within fp16."""
    pl = pytest.importorskip("lightning.pytorch")
    from mixprec.integrations.lightning import MixprecPrecision

    class Chain(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = chain()
            self.worst = 0.0

        def training_step(self, batch, batch_idx):
            self.batch = batch
            x, t = batch
            return F.mse_loss(self.net(x).float(), t)

        def on_before_optimizer_step(self, optimizer):  # after the plugin's unscale_, outside autocast
            if self.global_step >= 20:
                ref = _reference_grads(self.net, *self.batch)
                for name in _weights(self.net):
                    self.worst = max(self.worst, _rel_err(ref[name], self.net.get_parameter(name).grad))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-3)

        def train_dataloader(self):
            batches = [_data(32, seed=s) for s in range(30)]
            data = torch.utils.data.TensorDataset(torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches]))
            return torch.utils.data.DataLoader(data, batch_size=64)

    module = Chain()
    scaler = mixprec.GradScaler("cpu", per_layer=True).watch(module)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=30, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
        plugins=[MixprecPrecision("16-mixed", scaler=scaler, device="cpu")],
    )
    trainer.fit(module)
    assert scaler._layerwise.names == [f"net.{i}" for i in range(8)]
    assert min(scaler.layer_scales()[f"net.{i}"] for i in range(7)) >= 2.0**4
    assert module.worst < 1e-2


# ------------------------------------------------------------------ update(new_scale), checkpoints


def _one_step(model, scaler, optimizer, x, t, new_scale=None):
    optimizer.zero_grad()
    scaler.scale(_loss(model, x, t)).backward()
    scaler.step(optimizer)
    scaler.update(new_scale)


def test_update_with_new_scale_keeps_the_factors_and_discards_the_step_statistics():
    """A step ended by update(new_scale=...) leaves the factors as they were and its amax does
    not reach the next update: that update gives the factors of a scaler that never saw the step."""
    x, t = _data(32)
    model = chain()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = mixprec.GradScaler("cpu", init_scale=2.0**10, per_layer=True).watch(model)
    model[3].shrink.factor = 2.0**10  # the regions below block 3 see gradients 2**16 larger
    _one_step(model, scaler, optimizer, x, t, new_scale=2.0**8)
    assert set(scaler.layer_scales().values()) == {1.0} and scaler.get_scale() == 2.0**8
    assert scaler.last_overflow_cuts == ()
    history_after_first = len(scaler.layer_scale_history())
    model[3].shrink.factor = SHRINK
    _one_step(model, scaler, optimizer, x, t)

    fresh_model = chain()
    fresh = mixprec.GradScaler("cpu", init_scale=2.0**8, per_layer=True).watch(fresh_model)
    _one_step(fresh_model, fresh, torch.optim.SGD(fresh_model.parameters(), lr=0.0), x, t)
    assert max(fresh.layer_scales().values()) > 1
    assert scaler.layer_scales() == fresh.layer_scales()
    assert scaler.get_scale() == fresh.get_scale()
    assert history_after_first == 1  # every update, new_scale or not, records the factors


def _trained_per_layer_scaler():
    model = chain()
    scaler = mixprec.GradScaler("cpu", per_layer=True).watch(model)
    _train_and_check(model, 32, scaler, steps=6, warmup=6, lr=0.0)
    assert max(scaler.layer_scales().values()) > 1
    return scaler


def test_a_per_layer_checkpoint_in_a_plain_scaler_warns_what_to_pass():
    saved = _trained_per_layer_scaler().state_dict()
    plain = mixprec.GradScaler("cpu")
    with pytest.warns(UserWarning, match=r"per_layer=True, cut_points=\['0', '1'"):
        plain.load_state_dict(saved)
    assert plain.get_scale() == saved["scale"]
    assert "layerwise" not in plain.state_dict()


def test_a_plain_checkpoint_resets_a_per_layer_scaler_to_factors_one():
    """A checkpoint without per-layer state (per_layer=False, or torch's) loads the loss scale
    and puts every factor back to 1, margins 0: the scaler then runs as a fresh per-layer one
    that loaded the same checkpoint."""
    x, t = _data(32)
    plain_model = chain()
    plain = mixprec.GradScaler("cpu", init_scale=2.0**12)
    _one_step(plain_model, plain, torch.optim.SGD(plain_model.parameters(), lr=0.0), x, t)
    checkpoint = plain.state_dict()

    trained = _trained_per_layer_scaler()
    trained.load_state_dict(checkpoint)
    assert set(trained.layer_scales().values()) == {1.0}
    assert trained.state_dict()["layerwise"]["margin"] == [0] * 8
    assert trained.layer_scale_history() == []
    before_watch = mixprec.GradScaler("cpu", per_layer=True)
    before_watch.load_state_dict(_trained_per_layer_scaler().state_dict())
    before_watch.load_state_dict(checkpoint)  # a later plain checkpoint replaces the pending one
    fresh = mixprec.GradScaler("cpu", per_layer=True)
    fresh.load_state_dict(checkpoint)
    models = [chain() for _ in range(3)]
    scalers = [trained, before_watch, fresh]
    trails = []
    for model, scaler in zip(models, scalers):
        scaler.watch(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        trail = []
        for _ in range(3):
            _one_step(model, scaler, optimizer, x, t)
            trail.append((scaler.get_scale(), scaler.layer_scales()))
        trails.append(trail)
    assert trails[0] == trails[1] == trails[2]
