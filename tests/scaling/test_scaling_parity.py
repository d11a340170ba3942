"""mixprec.GradScaler against torch.amp.GradScaler: torch's own GradScaler tests ported to run
on both, bitwise-equal trajectories, torch's error messages and private names, and the type."""

from __future__ import annotations

import copy
import pickle
from typing import Any

import pytest
import torch
from torch import nn

import mixprec
from mixprec.scaling import GradScaler

from _scaling_cases import IMPLS, INF, both_agree, make_optimizer, make_scaler, one_model_run, one_param_step, per_impl, same_tensors, snapshot, train


@pytest.mark.parametrize("kind", ["plain", "foreach", "fused"])
def test_default_training_matches_control_and_torch(kind):
    both_agree(one_model_run(), 3, 1, kind=kind)


def test_clipping_scaled_gradients():
    def clip(model, optimizer, scaler):
        max_norm = 0.2 * (1.0 if scaler is None else scaler.get_scale())
        nn.utils.clip_grad_norm_(model.parameters(), max_norm)

    both_agree(one_model_run(after_backward=clip), 3, 1, exact=False)


def test_unscale_then_clip():
    def unscale_and_clip(model, optimizer, scaler):
        if scaler is not None:
            scaler.unscale_(optimizer)
        nn.utils.clip_grad_norm_(model.parameters(), 0.2, error_if_nonfinite=False)

    both_agree(one_model_run(after_backward=unscale_and_clip), 3, 1, exact=False)


def test_gradient_penalty_double_backward():
    def penalised(model, x, y, scaler):
        loss = nn.functional.mse_loss(model(x), y)
        if scaler is None:
            grads = torch.autograd.grad(loss, list(model.parameters()), create_graph=True)
        else:
            grads = torch.autograd.grad(scaler.scale(loss), list(model.parameters()), create_graph=True)
            grads = [g * (1.0 / scaler.get_scale()) for g in grads]
        return loss + sum(g.pow(2).sum() for g in grads).sqrt()

    both_agree(one_model_run(loss_fn=penalised), 3, 1, exact=False)


def test_gradient_accumulation():
    def run(data, models, optimizers, scaler, skip_iter, try_scaling_api):
        (model,), (optimizer,) = models, optimizers
        for i, (x, y) in enumerate(data):
            loss = nn.functional.mse_loss(model(x), y) / 2
            (scaler.scale(loss) if try_scaling_api else loss).backward()
            if (i + 1) % 2 == 0:
                if try_scaling_api:
                    scaler.step(optimizer)
                    scaler.update()
                else:
                    optimizer.step()
                optimizer.zero_grad()

    both_agree(run, 2, 0)


@pytest.mark.parametrize("kind", ["plain", "foreach", "fused"])
def test_multiple_models_optimizers_losses(kind):
    def run(data, models, optimizers, scaler, skip_iter, try_scaling_api):
        (m0, m1), (o0, o1) = models, optimizers
        for i, (x, y) in enumerate(data):
            o0.zero_grad()
            o1.zero_grad()
            out0, out1 = m0(x), m1(x)
            loss0 = nn.functional.mse_loss(0.3 * out0 + 0.7 * out1, y)
            loss1 = nn.functional.mse_loss(0.6 * out0 - 0.4 * out1, y)
            if try_scaling_api:
                scaler.scale(loss0).backward(retain_graph=True)
                scaler.scale(loss1).backward()
                if i == skip_iter:
                    m1[2].weight.grad.fill_(INF)
                scaler.unscale_(o0)  # unscale one explicitly, as torch's test does
                scaler.step(o0)
                scaler.step(o1)
                scaler.update()
            else:
                loss0.backward(retain_graph=True)
                loss1.backward()
                o0.step()  # its own gradients are finite: it steps
                if i != skip_iter:
                    o1.step()

    both_agree(run, 3, 1, kind=kind, models=2)


@pytest.mark.parametrize("kind", ["plain", "foreach", "fused"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_autocast_training_bitwise_equal_to_torch(kind, dtype):
    """Real overflows from a too-large scale in a float16/bfloat16 autocast forward."""

    def loss_fn(model, batch):
        (x, y), spike = batch
        with mixprec.autocast("cpu", dtype=dtype):
            out = model(x)
        return nn.functional.mse_loss(out.float(), y) * spike

    def run(impl):
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
        scaler = make_scaler(impl, init_scale=2.0**20 if dtype == torch.float16 else 2.0**120, growth_interval=2)
        # A loss spike at iteration 6 overflows bfloat16 too (float32's range).
        batches = [((torch.randn(4, 8), torch.randn(4, 4)), 2.0**100 if i == 6 else 1.0) for i in range(10)]
        scales = train(model, make_optimizer(kind, model.parameters()), scaler, batches, loss_fn=loss_fn)
        return scales, snapshot(model.parameters())

    (s_torch, p_torch), (s_ours, p_ours) = per_impl(run)
    assert s_torch == s_ours
    pairs = list(zip(s_torch, s_torch[1:]))
    assert any(b < a for a, b in pairs) and any(b > a for a, b in pairs)  # backed off and grew
    assert same_tensors(p_torch, p_ours)


@pytest.mark.parametrize("impl", IMPLS)
def test_scale_will_not_overflow(impl):
    model = nn.Linear(5, 1)
    optimizer = torch.optim.Adam(model.parameters())
    scaler = make_scaler(impl, growth_interval=1, growth_factor=2.0**4, init_scale=1e38)
    optimizer.zero_grad()
    loss = nn.functional.mse_loss(model(torch.randn(1, 5)), 1e38 * torch.randn(1, 1))
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    scale = scaler.get_scale()
    assert scale != INF and scale == scale and scale > 0


@pytest.mark.parametrize("impl", IMPLS)
def test_unscale_values_and_found_inf(impl):
    scaler = make_scaler(impl, init_scale=4.0)
    params = [nn.Parameter(torch.zeros(3)) for _ in range(3)]
    optimizer = torch.optim.SGD(params, lr=1.0)
    scaler.scale(torch.tensor(1.0))
    for p in params:
        p.grad = torch.full((3,), 8.0)
    scaler.unscale_(optimizer)
    assert all(torch.equal(p.grad, torch.full((3,), 2.0)) for p in params)
    scaler.step(optimizer)
    scaler.update()
    params[1].grad = torch.tensor([1.0, INF, 2.0])
    params[2].grad = torch.tensor([float("nan"), 1.0, 2.0])
    before = [p.detach().clone() for p in params]
    scaler.step(optimizer)
    scaler.update()
    assert all(torch.equal(a, b) for a, b in zip(before, params))
    assert scaler.get_scale() == 2.0


@pytest.mark.parametrize("impl", IMPLS)
def test_scale_nested_outputs(impl):
    scaler = make_scaler(impl, init_scale=2.0)
    t = torch.ones(2)
    out = scaler.scale([t, (t, [t]), t])
    assert isinstance(out, list) and isinstance(out[1], tuple) and isinstance(out[1][1], list)
    assert torch.equal(out[1][1][0], 2 * t)
    assert [torch.equal(x, 2 * t) for x in scaler.scale(iter([t, t]))] == [True, True]
    with pytest.raises(ValueError, match="Tensor"):
        scaler.scale([t, 1.0])


@pytest.mark.parametrize("impl", IMPLS)
def test_sparse_gradients(impl):
    torch.manual_seed(0)
    emb = nn.Embedding(10, 4, sparse=True)
    opt = torch.optim.SGD(emb.parameters(), lr=0.1)
    scaler = make_scaler(impl, init_scale=8.0)
    loss = emb(torch.tensor([1, 2, 2])).sum()
    scaler.scale(loss).backward()
    ref = emb.weight.detach().clone()
    scaler.step(opt)
    scaler.update()
    expected = ref.clone()
    expected[1] -= 0.1
    expected[2] -= 0.2
    torch.testing.assert_close(emb.weight.detach(), expected)


@pytest.mark.parametrize("impl", IMPLS)
def test_stage_errors(impl):
    model = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = make_scaler(impl)
    scaler.scale(model(torch.ones(1, 2)).sum()).backward()
    scaler.unscale_(optimizer)
    with pytest.raises(RuntimeError, match="already been called"):
        scaler.unscale_(optimizer)
    scaler.step(optimizer)
    with pytest.raises(RuntimeError, match="after step"):
        scaler.unscale_(optimizer)
    with pytest.raises(RuntimeError, match="already been called"):
        scaler.step(optimizer)
    with pytest.raises(RuntimeError, match="Closure"):
        scaler.step(optimizer, closure=lambda: None)
    scaler.update()
    scaler.step(optimizer)  # a fresh iteration after update() works again
    scaler.update()


@pytest.mark.parametrize("impl", IMPLS)
def test_fp16_gradients_are_refused(impl):
    param = nn.Parameter(torch.zeros(2, dtype=torch.float16))
    param.grad = torch.ones(2, dtype=torch.float16)
    scaler = make_scaler(impl)
    scaler.scale(torch.tensor(1.0))
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
        scaler.unscale_(torch.optim.SGD([param], lr=0.1))


@pytest.mark.parametrize("impl", IMPLS)
def test_disabled_scaler_is_transparent(impl):
    model = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = make_scaler(impl, enabled=False)
    loss = model(torch.ones(1, 2)).sum()
    assert scaler.scale(loss) is loss
    loss.backward()
    before = model.weight.detach().clone()
    scaler.unscale_(optimizer)
    scaler.step(optimizer)
    scaler.update()
    assert not torch.equal(before, model.weight)
    assert scaler.get_scale() == 1.0 and scaler.state_dict() == {} and not scaler.is_enabled()


@pytest.mark.parametrize("growth_interval", [1, 3])
def test_scale_trajectory_skips_and_weights_bitwise_equal_to_torch(growth_interval):
    torch.manual_seed(1)
    pattern = [i % 5 == 2 or i % 7 == 0 or 30 <= i < 34 for i in range(60)]
    grads = [[torch.randn(4, 3), torch.randn(3)] for _ in pattern]
    runs = {}
    for impl in IMPLS:
        params = [nn.Parameter(torch.ones(4, 3)), nn.Parameter(torch.zeros(3))]
        optimizer = torch.optim.SGD(params, lr=0.01, momentum=0.9)
        scaler = make_scaler(impl, init_scale=2.0**10, growth_interval=growth_interval, backoff_factor=0.3)
        scales, steps = [], []
        for bad, (g0, g1) in zip(pattern, grads):
            scale = scaler.scale(torch.tensor(1.0))
            params[0].grad = g0 * scale
            params[1].grad = g1 * scale
            if bad:
                params[1].grad[1] = float("nan") if len(scales) % 2 else INF
            before = params[0].detach().clone()
            scaler.step(optimizer)
            scaler.update()
            steps.append(torch.equal(before, params[0]))
            scales.append(scaler.get_scale())
        runs[impl] = scales, steps, [p.detach().clone() for p in params]
    assert runs["torch"][0] == runs["mixprec"][0]
    assert runs["torch"][1] == runs["mixprec"][1] == pattern
    assert all(torch.equal(a, b) for a, b in zip(runs["torch"][2], runs["mixprec"][2]))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_trajectory_bitwise_equal_to_torch():
    def loss_fn(model, x):
        with mixprec.autocast("cuda", dtype=torch.float16):
            return model(x).float().pow(2).sum() * 1e3

    def run(impl):
        model = nn.Linear(8, 8).cuda()
        optimizer = torch.optim.AdamW(model.parameters(), fused=True)
        scaler = (torch.amp.GradScaler if impl == "torch" else GradScaler)("cuda", init_scale=2.0**24, growth_interval=2)
        batches = [torch.randn(4, 8, device="cuda") for _ in range(8)]
        return train(model, optimizer, scaler, batches, loss_fn=loss_fn), snapshot(model.parameters())

    (a, pa), (b, pb) = per_impl(run)
    assert a == b and same_tensors(pa, pb)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_fused_path_never_synchronises():
    """CUDA's own sync detector: step() + update() on the fused path, with the skip signals,
    hysteresis and a max_scale, never wait for the device (torch's scaler is the control)."""
    for impl in IMPLS:
        torch.manual_seed(0)
        model = nn.Linear(8, 8).cuda()
        optimizer = torch.optim.AdamW(model.parameters(), fused=True)
        cls, extra = (torch.amp.GradScaler, {}) if impl == "torch" else (GradScaler, dict(hysteresis=2, max_scale=2.0**30))
        scaler = cls("cuda", init_scale=2.0**8, growth_interval=2, **extra)  # no real overflow
        signals = []
        for step in range(6):
            with mixprec.autocast("cuda", dtype=torch.float16):
                loss = model(torch.randn(4, 8, device="cuda")).float().pow(2).sum()
            scaler.scale(loss).backward()
            if step == 3:
                model.weight.grad[0, 0] = INF
            if step > 0:  # the first step creates the optimizer state
                torch.cuda.set_sync_debug_mode("error")
            try:
                scaler.step(optimizer)
                scaler.update()
                if impl == "mixprec":
                    signals.append((scaler.last_step_skipped, scaler.skipped_steps))
            except RuntimeError as error:
                if impl == "torch":
                    pytest.skip(f"torch's own fused path synchronises on this build: {error}")
                raise
            finally:
                torch.cuda.set_sync_debug_mode(0)
            optimizer.zero_grad()
    assert all(flag.is_cuda and count.is_cuda for flag, count in signals)
    assert [bool(flag) for flag, _ in signals] == [False, False, False, True, False, False]
    assert int(signals[-1][1]) == 1


def stage_errors(impl):
    """The message of every per-optimizer stage error, in order."""
    model = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = make_scaler(impl)
    messages = []

    def expect(call):
        with pytest.raises(Exception) as info:
            call()
        messages.append((type(info.value), str(info.value)))

    scaler.scale(model(torch.ones(1, 2)).sum()).backward()
    scaler.unscale_(optimizer)
    expect(lambda: scaler.unscale_(optimizer))
    scaler.step(optimizer)
    expect(lambda: scaler.unscale_(optimizer))
    expect(lambda: scaler.step(optimizer))
    expect(lambda: scaler.step(optimizer, closure=lambda: None))
    scaler.update()
    half = nn.Parameter(torch.zeros(2, dtype=torch.float16))
    half.grad = torch.ones(2, dtype=torch.float16)
    expect(lambda: scaler.unscale_(torch.optim.SGD([half], lr=0.1)))
    return messages


def test_stage_error_messages_match_torch():
    theirs, ours = stage_errors("torch"), stage_errors("mixprec")
    assert len(theirs) == len(ours) == 5
    for (t_type, t_msg), (o_type, o_msg) in zip(theirs, ours):
        assert o_type is t_type
        assert o_msg.startswith(t_msg.rstrip(".")), (t_msg, o_msg)
    assert "MasterWeights" in ours[-1][1]  # ours also says what to do about float16 gradients


def test_positional_closure_is_forwarded_like_torch():
    """torch refuses ``closure=`` but passes a positional closure to optimizer.step()."""
    results = {}
    for impl in IMPLS:
        p = nn.Parameter(torch.ones(2))
        opt = torch.optim.SGD([p], lr=0.5)
        scaler = make_scaler(impl, init_scale=4.0)
        calls = []
        scaler.scale(p.sum()).backward()
        out = scaler.step(opt, lambda: calls.append(1) or torch.tensor(7.0))
        scaler.update()
        results[impl] = (out, calls, p.detach().clone())
    assert results["torch"][0] == results["mixprec"][0] == 7.0
    assert results["torch"][1] == results["mixprec"][1] == [1]
    assert torch.equal(results["torch"][2], results["mixprec"][2])


@pytest.mark.parametrize("new_scale", [8.0, 3.0, torch.tensor(256.0), torch.tensor(0.5, dtype=torch.float64)])
def test_update_new_scale_like_torch(new_scale):
    runs = {}
    for impl in IMPLS:
        scaler = make_scaler(impl, init_scale=64.0, growth_interval=2)
        p = nn.Parameter(torch.zeros(2))
        opt = torch.optim.SGD([p], lr=1.0)
        one_param_step(scaler, opt, p, False)  # growth tracker 1
        scaler.update(new_scale=new_scale)
        scales = [scaler.get_scale()]
        for bad in (False, False, True):
            one_param_step(scaler, opt, p, bad)
            scales.append(scaler.get_scale())
        runs[impl] = scales
    assert runs["torch"] == runs["mixprec"]
    assert runs["mixprec"][0] == float(new_scale)


@pytest.mark.parametrize("impl", IMPLS)
def test_disabled_scaler_is_a_true_no_op(impl):
    """enabled=False: the same weights as no scaler at all, nothing created, nothing touched."""
    torch.manual_seed(0)
    ref = nn.Linear(3, 2)
    model = copy.deepcopy(ref)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scaler = make_scaler(impl, enabled=False)
    for i in range(3):
        x = torch.randn(2, 3)
        ref(x).sum().backward()
        ref_opt.step()
        ref_opt.zero_grad()
        outputs = [model(x).sum()]
        assert scaler.scale(outputs) is outputs
        outputs[0].backward()
        grads = [p.grad.clone() for p in model.parameters()]
        scaler.unscale_(opt)
        assert all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters()))
        scaler.step(opt)
        scaler.update()
        scaler.update(new_scale=2.0)
        opt.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(ref.parameters(), model.parameters()))
    assert scaler.get_scale() == 1.0 and scaler.state_dict() == {}
    scaler.load_state_dict({})  # no-op, no error
    clone = pickle.loads(pickle.dumps(scaler))
    assert not clone.is_enabled()
    if impl == "mixprec":
        assert scaler.state is None
        assert not scaler.last_step_skipped and scaler.skipped_steps.item() == 0


@pytest.mark.parametrize("kind", ["plain", "foreach", "fused"])
def test_gradient_accumulation_with_overflow_bitwise_equal_to_torch(kind):
    def loss_fn(model, x):
        with mixprec.autocast("cpu", dtype=torch.bfloat16):
            return model(x).float().pow(2).mean() / 3

    def run(impl):
        model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
        scaler = make_scaler(impl, init_scale=2.0**8, growth_interval=2)

        def spoil(i):  # an overflow in one micro-batch spoils the whole accumulated step
            if i == 4:
                model[0].bias.grad[0] = INF

        batches = [torch.randn(3, 4) for _ in range(12)]
        optimizer = make_optimizer(kind, model.parameters())
        scales = train(model, optimizer, scaler, batches, loss_fn=loss_fn, spoil=spoil, accumulate=3)
        return scales, snapshot(model.parameters())

    theirs, ours = per_impl(run)
    assert theirs[0] == ours[0] == [256.0, 128.0, 128.0, 256.0]
    assert same_tensors(theirs[1], ours[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_sparse_gradients_with_overflow_bitwise_equal_to_torch(dtype):
    runs = {}
    for impl in IMPLS:
        torch.manual_seed(0)
        emb = nn.Embedding(10, 4, sparse=True).to(dtype)
        dense = nn.Linear(4, 1)
        sparse_opt = torch.optim.SGD(emb.parameters(), lr=0.1)
        dense_opt = torch.optim.SGD(dense.parameters(), lr=0.1)
        scaler = make_scaler(impl, init_scale=2.0**10, growth_interval=1)
        scales = []
        for i in range(4):
            loss = dense(emb(torch.tensor([1, 2, 2, i])).float()).sum()
            scaler.scale(loss).backward()
            if i == 2:
                emb.weight.grad._values()[0, 0] = INF
            if dtype == torch.float32:
                scaler.step(sparse_opt)
            scaler.step(dense_opt)
            scaler.update()
            sparse_opt.zero_grad()
            dense_opt.zero_grad()
            scales.append(scaler.get_scale())
        runs[impl] = scales, [p.detach().clone() for p in (*emb.parameters(), *dense.parameters())]
    if dtype == torch.float32:  # the sparse optimizer's overflow skips both optimizers
        assert runs["torch"][0] == runs["mixprec"][0] == [2.0**11, 2.0**12, 2.0**11, 2.0**12]
    assert runs["torch"][0] == runs["mixprec"][0]
    assert all(torch.equal(a, b) for a, b in zip(runs["torch"][1], runs["mixprec"][1]))


@pytest.mark.parametrize("impl", IMPLS)
def test_an_fp16_sparse_gradient_overflowing_only_once_summed_is_found(impl):
    """torch's check of a float16 sparse gradient coalesces it first: two finite values at one
    index whose sum overflows float16 are an overflow (the fused path's inf check)."""
    p = nn.Parameter(torch.zeros(4, 2, dtype=torch.float16))
    opt = torch.optim.SGD([p], lr=0.1)
    scaler = make_scaler(impl)
    scaler.scale(torch.tensor(1.0))
    flags = []
    for index in ([[0, 0], [1, 1]], [[0, 1], [1, 1]]):  # (duplicates, then distinct entries)
        p.grad = torch.sparse_coo_tensor(torch.tensor(index), torch.tensor([6e4, 6e4], dtype=torch.float16),
                                         (4, 2), check_invariants=True)
        found = scaler._check_inf_per_device(opt)
        flags.append(float(sum(f.item() for f in found.values())))
    assert flags == [1.0, 0.0]


def test_old_grad_scaler_keyword_protocol():
    """An optimizer whose step takes ``grad_scaler`` gets the scaler (torch's deprecated
    protocol), and can use ``_get_scale_async`` and ``_check_inf_per_device`` as with torch's."""

    class OldProtocol(torch.optim.SGD):
        _step_supports_amp_scaling = True

        def step(self, closure=None, grad_scaler=None):
            scale = grad_scaler._get_scale_async()
            found_inf = sum(grad_scaler._check_inf_per_device(self).values())
            if not found_inf.item():
                for group in self.param_groups:
                    for q in group["params"]:
                        q.grad.div_(scale)
                super().step()

    results = {}
    for impl in IMPLS:
        p = nn.Parameter(torch.zeros(2))
        opt = OldProtocol([p], lr=1.0)
        scaler = make_scaler(impl, init_scale=4.0)
        scales = []
        for bad in (False, True, False):
            with pytest.warns(FutureWarning, match="passing itself as a keyword"):
                one_param_step(scaler, opt, p, bad)
            scales.append(scaler.get_scale())
        results[impl] = scales, p.detach().clone()
    assert results["torch"][0] == results["mixprec"][0] == [4.0, 2.0, 2.0]
    assert torch.equal(results["torch"][1], results["mixprec"][1])


@pytest.mark.parametrize("impl", IMPLS)
def test_fused_path_has_no_host_sync_and_plain_path_one(impl, syncs):
    params = [nn.Parameter(torch.randn(3, 3)) for _ in range(3)]
    fused = torch.optim.AdamW(params, fused=True)
    plain = torch.optim.SGD(params, lr=0.1)
    scaler = make_scaler(impl)
    scaler.scale(torch.tensor(1.0))
    syncs.start()
    counts = []
    for optimizer in (fused, plain, fused):
        for p in params:
            p.grad = torch.ones_like(p)
        params[0].grad[0, 0] = INF if len(counts) == 2 else 1.0
        syncs.count = 0
        scaler.step(optimizer)
        scaler.update()
        counts.append(syncs.count)
    syncs.stop()
    assert counts == [0, 1, 0]
    assert scaler.get_scale() == 2.0**15


def test_a_fused_optimizers_own_grad_scale_multiplies_the_loss_scale_like_torch():
    """A fused optimizer that already carries a ``grad_scale`` (its user's own factor) steps on
    the product of the two scales, as torch's GradScaler lends it: the same weights bitwise."""
    results = {}
    for impl in IMPLS:
        torch.manual_seed(0)
        p = nn.Parameter(torch.randn(4, 4))
        opt = torch.optim.SGD([p], lr=0.1, fused=True)  # (SGD: the step's size follows the scale)
        opt.grad_scale = torch.tensor(4.0)
        scaler = make_scaler(impl, init_scale=8.0)
        for _ in range(2):
            p.grad = scaler.scale(torch.full_like(p, 1.0)) * 32.0  # 32: the user's factor of 4, loss-scaled
            scaler.step(opt)
            scaler.update()
            opt.grad_scale = torch.tensor(4.0)  # (a step lends and takes back the attribute)
        results[impl] = p.detach().clone()
    assert torch.equal(results["torch"], results["mixprec"])


@pytest.mark.parametrize("impl", IMPLS)
def test_torch_private_scale_tensors_for_ported_code(impl):
    scaler = make_scaler(impl, init_scale=8.0)
    assert scaler._scale is None and scaler._growth_tracker is None
    t = torch.ones(2)
    scaler.scale(t)
    assert scaler._scale.device == t.device and scaler._scale.item() == 8.0
    assert scaler._growth_tracker.dtype == torch.int32 and scaler._get_scale_async() is scaler._scale



@pytest.mark.parametrize("impl", IMPLS)
def test_torch_per_optimizer_state_layout_for_ported_code(impl):
    """The expressions torch's GradScaler (and Lightning's tests) use on
    ``_per_optimizer_states[id(opt)]``: a mapping with an ``OptState`` "stage" (compared with
    ``is``) and a "found_inf_per_device" dict of device flags."""
    from torch.amp.grad_scaler import OptState

    param = nn.Parameter(torch.ones(2))
    optimizer = make_optimizer("plain", [param])
    scaler = make_scaler(impl, init_scale=4.0)
    states = scaler._per_optimizer_states
    assert states[id(optimizer)]["stage"] is OptState.READY
    param.grad = scaler.scale(torch.tensor(1.0)) * torch.tensor([1.0, INF])
    scaler.unscale_(optimizer)
    state = states[id(optimizer)]
    assert state["stage"] is OptState.UNSCALED and state["stage"] == OptState.UNSCALED
    found = state["found_inf_per_device"]
    assert list(found) == [param.device]
    assert sum(v.item() for v in found.values()) == 1.0
    assert scaler._found_inf_per_device(optimizer) is found
    assert set(dict(state)) == {"stage", "found_inf_per_device"}
    scaler.step(optimizer)
    assert states[id(optimizer)]["stage"] is OptState.STEPPED
    state["stage"] = OptState.READY  # what ported code writes is what the scaler reads
    scaler.step(optimizer)
    scaler.update()
    assert scaler.get_scale() == 2.0

@pytest.mark.parametrize("fused", [False, True])
def test_master_weights_fp16_training_loop_under_mixprec_autocast(fused):
    """float16 parameters + mixprec.MasterWeights + mixprec.GradScaler under mixprec.autocast:
    a too-high scale overflows the float16 gradients, the scaler backs off and skips (weights
    untouched), the loss goes down, and everything is bit for bit what torch's scaler gives
    when ``prepare_grads()`` is called by hand."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 1))
    x = torch.randn(16, 8)
    y = x[:, :1] * 0.5
    runs = {}
    for impl in IMPLS:
        model = mixprec.to_low_precision(copy.deepcopy(base), torch.float16)
        dtypes = {name: p.dtype for name, p in model.named_parameters()}
        assert dtypes["0.weight"] == torch.float16 and dtypes["1.weight"] == torch.float32
        opt = mixprec.MasterWeights(torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused))
        scaler = make_scaler(impl, init_scale=2.0**26, growth_interval=3)
        if impl == "mixprec":
            scaler.watch(model)
        losses, scales, skipped = [], [], []
        for _ in range(18):
            opt.zero_grad()
            with mixprec.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.mse_loss(model(x).float(), y)
            scaler.scale(loss).backward()
            if impl == "torch":
                opt.prepare_grads()
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(opt.masters, 1.0)
            before = [p.detach().clone() for p in model.parameters()]
            scaler.step(opt)
            scaler.update()
            moved = any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
            was_skipped = scales[-1] > scaler.get_scale() if scales else scaler.get_scale() < 2.0**26
            assert moved != was_skipped
            if impl == "mixprec":
                assert bool(scaler.last_step_skipped) == was_skipped
                if was_skipped:
                    assert scaler.last_overflow and set(scaler.last_overflow) <= set(dtypes)
            losses.append(loss.item())
            scales.append(scaler.get_scale())
            skipped.append(was_skipped)
        assert {name: p.dtype for name, p in model.named_parameters()} == dtypes
        assert all(torch.isfinite(p).all() for p in model.parameters())
        runs[impl] = scales, losses, [p.detach().clone() for p in model.parameters()], scaler
    scales, losses, params, scaler = runs["mixprec"]
    assert scales == runs["torch"][0] and losses == runs["torch"][1]
    assert all(torch.equal(a, b) for a, b in zip(params, runs["torch"][2]))
    assert scaler.skipped_steps.item() >= 5 and min(scales) <= 2.0**18  # backed off a lot
    assert any(b > a for a, b in zip(scales, scales[1:]))  # and grew again
    assert losses[-1] < 0.5 * losses[0]


# ---------------------------------------------------------------- a torch.amp.GradScaler


def test_is_a_torch_grad_scaler_overriding_every_stateful_method():
    """Frameworks check ``isinstance(scaler, torch.amp.GradScaler)``; every method torch defines
    is ours, except ``_unscale_grads_``, which uses only its arguments."""
    scaler = GradScaler("cpu")
    assert isinstance(scaler, torch.amp.GradScaler)
    inherited = [
        name
        for name, value in vars(torch.amp.GradScaler).items()
        if callable(value) and name not in ("__init__", "__dict__", "__weakref__")
        and getattr(GradScaler, name) is value
    ]
    assert inherited == ["_unscale_grads_"]


def test_torch_methods_drive_it_like_torch():
    """The loop a framework writes against torch's API (including Accelerate's
    ``_lazy_init_scale_growth_tracker(scaler._device)`` after loading, and torch's own
    ``_unscale_grads_``), on both scalers: the same scales, skips and weights."""

    def run(impl):
        model = nn.Linear(4, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = make_scaler(impl, init_scale=2.0**4, growth_interval=2)
        scaler.load_state_dict(make_scaler("torch", init_scale=2.0**6, growth_interval=2).state_dict())
        scaler._lazy_init_scale_growth_tracker(scaler._device)
        scales = []
        for i in range(6):
            optimizer.zero_grad()
            scaler.scale(model(torch.randn(3, 4)).pow(2).sum()).backward()
            if i == 2:
                model.bias.grad[0] = INF
            scaler.unscale_(optimizer)
            scales.append((scaler.get_scale(), scaler._get_growth_tracker(), scaler._get_scale_async().item()))
            scaler.step(optimizer)
            scaler.update()
        found = scaler._unscale_grads_(optimizer, torch.ones(()), torch.zeros(()), False)
        return scales, snapshot(model.parameters()), sorted(found), scaler.state_dict()["scale"]

    theirs, ours = per_impl(run)
    assert theirs[0] == ours[0] and theirs[2:] == ours[2:]
    assert same_tensors(theirs[1], ours[1])


@pytest.mark.parametrize("per_layer", [False, True], ids=["global", "per-layer"])
def test_a_fused_optimizer_without_gradients_steps_as_a_no_op_like_torch(per_layer):
    """A fused optimizer none of whose parameters got a gradient (a task head unused this
    iteration): torch's step() is a no-op and update() goes on; mixprec's step raised "No inf
    checks were recorded for this optimizer". Same weights, scales and skips as torch."""

    def run(impl: str) -> tuple[Any, ...]:
        used, unused = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1)), nn.Linear(4, 1)
        layerwise = per_layer and impl == "mixprec"
        scaler = make_scaler(impl, growth_interval=2, **({"per_layer": True} if layerwise else {}))
        if layerwise:
            scaler.watch(used)
        first = torch.optim.AdamW(used.parameters(), lr=0.1, fused=True)
        second = torch.optim.AdamW(unused.parameters(), lr=0.1, fused=True)
        scales = []
        for step in range(3):
            first.zero_grad()
            scaler.scale(used(torch.full((2, 4), float(step + 1))).sum()).backward()
            scaler.step(first)
            scaler.step(second)
            scaler.update()
            scales.append(scaler.get_scale())
        return scales, [p.detach().clone() for p in [*used.parameters(), *unused.parameters()]]

    (torch_scales, torch_weights), (scales, weights) = per_impl(run)
    assert scales == torch_scales
    assert same_tensors(weights, torch_weights)
