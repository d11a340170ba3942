"""mixprec.GradScaler: PyTorch's GradScaler behaviours run against both implementations, bitwise
agreement with torch.amp.GradScaler, and the options beyond it."""

from __future__ import annotations

import copy
import pickle
import warnings

import pytest
import torch
from torch import nn

import mixprec
from mixprec.scaling import CSVHistory, GradScaler, MinScaleError, TensorBoardHistory, skip_aware

IMPLS = ["torch", "mixprec"]
INF = float("inf")


def make_scaler(impl: str, **kwargs) -> GradScaler | torch.amp.GradScaler:
    cls = torch.amp.GradScaler if impl == "torch" else GradScaler
    return cls("cpu", **kwargs)


def autocast(dtype: torch.dtype):
    return mixprec.autocast("cpu", dtype=dtype)


def make_optimizer(kind: str, params) -> torch.optim.Optimizer:
    if kind == "plain":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, foreach=False)
    if kind == "foreach":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, foreach=True)
    if kind == "fused":
        return torch.optim.AdamW(params, lr=0.01, fused=True)
    raise ValueError(kind)


def scaling_case(kind: str = "plain", seed: int = 0):
    """Twin fp32 models (control, scaled), their optimizers, data and the iteration to skip."""
    torch.manual_seed(seed)
    control = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    scaled = copy.deepcopy(control)
    data = [(torch.randn(4, 8), torch.randn(4, 8)) for _ in range(4)]
    return control, scaled, make_optimizer(kind, control.parameters()), make_optimizer(kind, scaled.parameters()), data, 2


def run_scaling_case(impl, run, unskipped, skipped, kind="plain", exact=True, models=1):
    """Port of torch's _run_scaling_case: a scaled run with an injected inf equals a control run
    that skips that iteration by hand; the final scale is 128 * 2**unskipped * 0.5**skipped."""
    scaler = make_scaler(impl, init_scale=128.0, growth_factor=2.0, growth_interval=1)
    cases = [scaling_case(kind, seed) for seed in range(models)]
    control = [c[0] for c in cases], [c[2] for c in cases]
    scaled = [c[1] for c in cases], [c[3] for c in cases]
    data, skip_iter = cases[0][4], cases[0][5]
    run(data, *control, scaler, skip_iter, False)
    run(data, *scaled, scaler, skip_iter, True)
    assert scaler.get_scale() == 128.0 * 2.0**unskipped * 0.5**skipped
    for m_control, m_scaled in zip(*[control[0], scaled[0]]):
        for p_c, p_s in zip(m_control.parameters(), m_scaled.parameters()):
            if exact:
                assert torch.equal(p_c, p_s)
            else:
                torch.testing.assert_close(p_c, p_s, atol=1e-5, rtol=1e-5)
    return [p.detach().clone() for m in scaled[0] for p in m.parameters()], scaler


def both_agree(run, unskipped, skipped, **kwargs):
    """Runs the case with torch's scaler and with ours; checks the control and bitwise agreement."""
    theirs, _ = run_scaling_case("torch", run, unskipped, skipped, **kwargs)
    ours, scaler = run_scaling_case("mixprec", run, unskipped, skipped, **kwargs)
    for a, b in zip(theirs, ours):
        assert torch.equal(a, b)
    return scaler


# ---------------------------------------------------------------- ported torch behaviours


@pytest.mark.parametrize("kind", ["plain", "foreach", "fused"])
def test_default_training_matches_control_and_torch(kind):
    def run(data, models, optimizers, scaler, skip_iter, try_scaling_api):
        (model,), (optimizer,) = models, optimizers
        for i, (x, y) in enumerate(data):
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            if try_scaling_api:
                scaler.scale(loss).backward()
                if i == skip_iter:
                    model[2].weight.grad.fill_(INF)
                scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
                if i != skip_iter:
                    optimizer.step()

    both_agree(run, 3, 1, kind=kind)


def test_clipping_scaled_gradients():
    max_norm = 0.2

    def run(data, models, optimizers, scaler, skip_iter, try_scaling_api):
        (model,), (optimizer,) = models, optimizers
        for i, (x, y) in enumerate(data):
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            if try_scaling_api:
                scaler.scale(loss).backward()
                nn.utils.clip_grad_norm_(model.parameters(), max_norm * scaler.get_scale())
                if i == skip_iter:
                    model[2].weight.grad.fill_(INF)
                scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
                nn.utils.clip_grad_norm_(model.parameters(), max_norm)
                if i != skip_iter:
                    optimizer.step()

    both_agree(run, 3, 1, exact=False)


def test_unscale_then_clip():
    max_norm = 0.2

    def run(data, models, optimizers, scaler, skip_iter, try_scaling_api):
        (model,), (optimizer,) = models, optimizers
        for i, (x, y) in enumerate(data):
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            if try_scaling_api:
                scaler.scale(loss).backward()
                if i == skip_iter:
                    model[2].weight.grad.fill_(INF)
                scaler.unscale_(optimizer)
                nn.utils.clip_grad_norm_(model.parameters(), max_norm, error_if_nonfinite=False)
                scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
                nn.utils.clip_grad_norm_(model.parameters(), max_norm)
                if i != skip_iter:
                    optimizer.step()

    both_agree(run, 3, 1, exact=False)


def test_gradient_penalty_double_backward():
    def run(data, models, optimizers, scaler, skip_iter, try_scaling_api):
        (model,), (optimizer,) = models, optimizers
        for i, (x, y) in enumerate(data):
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            if try_scaling_api:
                grads = torch.autograd.grad(scaler.scale(loss), list(model.parameters()), create_graph=True)
                inv_scale = 1.0 / scaler.get_scale()
                grads = [g * inv_scale for g in grads]
            else:
                grads = torch.autograd.grad(loss, list(model.parameters()), create_graph=True)
            loss = loss + sum(g.pow(2).sum() for g in grads).sqrt()
            if try_scaling_api:
                scaler.scale(loss).backward()
                if i == skip_iter:
                    model[2].weight.grad.fill_(INF)
                scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
                if i != skip_iter:
                    optimizer.step()

    both_agree(run, 3, 1, exact=False)


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
    results = {}
    for impl in IMPLS:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
        optimizer = make_optimizer(kind, model.parameters())
        scaler = make_scaler(impl, init_scale=2.0**20 if dtype == torch.float16 else 2.0**120, growth_interval=2)
        scales = []
        for i in range(10):
            x, y = torch.randn(4, 8), torch.randn(4, 4)
            optimizer.zero_grad()
            with autocast(dtype):
                out = model(x)
            # A loss spike at iteration 6 overflows bfloat16 too (float32's range).
            loss = nn.functional.mse_loss(out.float(), y) * (2.0**100 if i == 6 else 1.0)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            scales.append(scaler.get_scale())
        results[impl] = scales, [p.detach().clone() for p in model.parameters()]
    (s_torch, p_torch), (s_ours, p_ours) = results["torch"], results["mixprec"]
    assert s_torch == s_ours
    pairs = list(zip(s_torch, s_torch[1:]))
    assert any(b < a for a, b in pairs) and any(b > a for a, b in pairs)  # backed off and grew
    for a, b in zip(p_torch, p_ours):
        assert torch.equal(a, b)


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


@pytest.mark.parametrize("impl", IMPLS)
def test_pickle_round_trip(impl):
    scaler = make_scaler(impl, init_scale=3.0, growth_factor=4.0, backoff_factor=0.25, growth_interval=3)
    scaler.scale(torch.tensor(1.0))
    clone = pickle.loads(pickle.dumps(scaler))
    assert clone.get_scale() == 3.0
    assert (clone.get_growth_factor(), clone.get_backoff_factor(), clone.get_growth_interval()) == (4.0, 0.25, 3)
    assert clone.is_enabled()


@pytest.mark.parametrize("src", IMPLS)
@pytest.mark.parametrize("dst", IMPLS)
def test_state_dict_across_implementations(src, dst):
    a = make_scaler(src, init_scale=16.0, growth_factor=4.0, backoff_factor=0.25, growth_interval=3)
    model = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        scaler_loss = a.scale(model(torch.ones(1, 2)).sum())
        scaler_loss.backward()
        a.step(optimizer)
        a.update()
    b = make_scaler(dst)
    b.load_state_dict(a.state_dict())
    assert b.get_scale() == 16.0
    assert (b.get_growth_factor(), b.get_backoff_factor(), b.get_growth_interval()) == (4.0, 0.25, 3)
    assert b._get_growth_tracker() == 2
    b.scale(torch.tensor(1.0))  # the lazily created device state starts from the loaded values
    assert b.get_scale() == 16.0 and b._get_growth_tracker() == 2
    with pytest.raises(RuntimeError, match="empty"):
        b.load_state_dict({})


# ---------------------------------------------------------------- bitwise trajectory


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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_trajectory_bitwise_equal_to_torch():
    runs = {}
    for cls in (torch.amp.GradScaler, GradScaler):
        torch.manual_seed(0)
        model = nn.Linear(8, 8).cuda()
        optimizer = torch.optim.AdamW(model.parameters(), fused=True)
        scaler = cls("cuda", init_scale=2.0**24, growth_interval=2)
        scales = []
        for _ in range(8):
            with mixprec.autocast("cuda", dtype=torch.float16):
                loss = model(torch.randn(4, 8, device="cuda")).float().pow(2).sum() * 1e3
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
            scales.append(scaler.get_scale())
        runs[cls] = scales, [p.detach().clone() for p in model.parameters()]
    (a, pa), (b, pb) = runs.values()
    assert a == b and all(torch.equal(x, y) for x, y in zip(pa, pb))


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


# ---------------------------------------------------------------- beyond torch.amp


def one_param_step(scaler, optimizer, param, bad: bool) -> None:
    scale = scaler.scale(torch.tensor(1.0))
    param.grad = torch.ones_like(param) * scale
    if bad:
        param.grad[0] = INF
    scaler.step(optimizer)
    scaler.update()


def test_hysteresis_skips_but_keeps_scale():
    p = nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([p], lr=1.0)
    scaler = GradScaler("cpu", init_scale=64.0, hysteresis=2, growth_interval=100)
    scales, skipped = [], []
    for bad in (True, True, True, False):
        one_param_step(scaler, opt, p, bad)
        scales.append(scaler.get_scale())
        skipped.append(bool(scaler.last_step_skipped))
    assert scales == [64.0, 32.0, 16.0, 16.0]
    assert skipped == [True, True, True, False]
    assert scaler.skipped_steps.item() == 3
    assert torch.equal(p.detach(), torch.tensor([-1.0, -1.0]))


def test_skip_signal_tensors():
    p = nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([p], lr=1.0)
    scaler = GradScaler("cpu")
    assert scaler.skipped_steps.item() == 0 and not scaler.last_step_skipped
    one_param_step(scaler, opt, p, True)
    assert scaler.last_step_skipped.dtype == torch.bool and scaler.last_step_skipped.shape == ()
    assert scaler.skipped_steps.dtype == torch.int64 and scaler.skipped_steps.item() == 1
    one_param_step(scaler, opt, p, False)
    assert not scaler.last_step_skipped.item() and scaler.skipped_steps.item() == 1


def test_min_scale_raise_names_parameters_step_and_history():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler("cpu", init_scale=4.0, min_scale=2.0).watch(model)
    for step in range(3):
        scaler.scale(model(torch.ones(1, 2)).sum()).backward()
        model[1].bias.grad[0] = INF
        if step < 1:
            scaler.step(opt)
            scaler.update()
            assert scaler.last_overflow == ("1.bias",)
            opt.zero_grad()
            continue
        scaler.step(opt)
        with pytest.raises(MinScaleError) as info:
            scaler.update()
        break
    message = str(info.value)
    assert "1.bias" in message and "step 1" in message and "[4, 2]" in message and "Try" in message
    assert scaler.get_scale() == 2.0
    # After the error the scaler is usable (the iteration was closed).
    opt.zero_grad()
    scaler.scale(model(torch.ones(1, 2)).sum()).backward()
    scaler.step(opt)
    scaler.update()


def test_min_scale_raise_without_watch_uses_optimizer_labels():
    p = nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([p], lr=1.0)
    scaler = GradScaler("cpu", init_scale=1.0, min_scale=1.0)
    with pytest.raises(MinScaleError, match=r"param_groups\[0\]\['params'\]\[0\] \(3,\)"):
        one_param_step(scaler, opt, p, True)


def test_min_scale_warn_once_and_ignore():
    p = nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([p], lr=1.0)
    scaler = GradScaler("cpu", init_scale=1.0, min_scale=1.0, on_min_scale="warn")
    with pytest.warns(RuntimeWarning, match="min_scale"):
        one_param_step(scaler, opt, p, True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        one_param_step(scaler, opt, p, True)
        quiet = GradScaler("cpu", init_scale=1.0, min_scale=1.0, on_min_scale="ignore")
        one_param_step(quiet, opt, p, True)
    assert scaler.skipped_steps.item() == 2 and scaler.get_scale() == 1.0


def test_bounds_and_no_subnormal_scale():
    p = nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([p], lr=1.0)
    capped = GradScaler("cpu", init_scale=4.0, max_scale=8.0, growth_interval=1)
    for _ in range(3):
        one_param_step(capped, opt, p, False)
    assert capped.get_scale() == 8.0
    floor = GradScaler("cpu", init_scale=2.0**-120)
    for _ in range(10):
        one_param_step(floor, opt, p, True)
    assert floor.get_scale() == 2.0**-126


def test_watch_attributes_only_on_skipped_steps(monkeypatch):
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler("cpu")
    assert scaler.last_overflow is None
    scaler.watch(model, prefix="net.")
    calls = []
    original = scaler._watched_nonfinite
    monkeypatch.setattr(scaler, "_watched_nonfinite", lambda: calls.append(1) or original())
    for bad in (False, True, False):
        opt.zero_grad()
        scaler.scale(model(torch.ones(1, 2)).sum()).backward()
        if bad:
            model[0].weight.grad[0, 0] = float("nan")
        scaler.step(opt)
        scaler.update()
        assert scaler.last_overflow == (("net.0.weight",) if bad else ())
    assert len(calls) == 1


@pytest.mark.parametrize("kind", ["plain", "fused"])
def test_watch_attributes_before_clipping_spreads_nan(kind, monkeypatch):
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    opt = make_optimizer(kind, model.parameters())
    scaler = GradScaler("cpu").watch(model)
    scaler.scale(model(torch.ones(1, 2)).sum()).backward()
    model[1].weight.grad[0, 0] = float("nan")
    syncs = CountingSyncs(monkeypatch)
    scaler.unscale_(opt)
    nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    assert torch.isnan(model[0].weight.grad).all()  # clipping spread the NaN
    clean = syncs.count
    scaler.step(opt)
    scaler.update()
    monkeypatch.undo()
    assert scaler.last_overflow == ("1.weight",)
    assert syncs.count == clean  # the step reused the flag read in unscale_


def test_history_callback_and_csv(tmp_path):
    rows = []
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    csv_path = tmp_path / "scale.csv"
    writer = CSVHistory(csv_path)
    scaler = GradScaler("cpu", init_scale=8.0, history=lambda *row: (rows.append(row), writer(*row)))
    scaler.watch(model)
    for bad in (False, True, False):
        opt.zero_grad()
        scaler.scale(model(torch.ones(1, 2)).sum()).backward()
        if bad:
            model.bias.grad[1] = INF
        scaler.step(opt)
        scaler.update()
    writer.close()
    assert rows == [(0, 8.0, False, ()), (1, 8.0, True, ("bias",)), (2, 4.0, False, ())]
    assert CSVHistory.read(csv_path) == rows
    clone = pickle.loads(pickle.dumps(writer))
    clone(3, 4.0, False, ())
    clone.close()
    assert CSVHistory.read(csv_path)[-1] == (3, 4.0, False, ())


def test_tensorboard_history_with_a_writer():
    class Recorder:
        def __init__(self):
            self.calls = []

        def add_scalar(self, tag, value, step):
            self.calls.append((tag, value, step))

        def add_text(self, tag, text, step):
            self.calls.append((tag, text, step))

        def close(self):
            self.calls.append("closed")

    recorder = Recorder()
    history = TensorBoardHistory(writer=recorder)
    history(5, 2.0, True, ("w",))
    history.close()
    assert recorder.calls == [
        ("loss_scale/scale", 2.0, 5),
        ("loss_scale/skipped", 1.0, 5),
        ("loss_scale/overflow", "w", 5),
        "closed",
    ]


def test_tensorboard_history_without_tensorboard_says_what_to_install(tmp_path):
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="pip install"):
            TensorBoardHistory(str(tmp_path))
    else:
        TensorBoardHistory(str(tmp_path))(0, 1.0, False, ())


def test_skip_aware_scheduler_does_not_advance_or_warn():
    p = nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([p], lr=1.0)
    scaler = GradScaler("cpu")
    sched = skip_aware(torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5), scaler)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for bad in (True, False, True, False):
            one_param_step(scaler, opt, p, bad)
            sched.step()
    assert sched.last_epoch == 2 and sched.get_last_lr() == [0.25]
    # Control: the unwrapped scheduler warns on the same sequence.
    opt2 = torch.optim.SGD([p], lr=1.0)
    plain = torch.optim.lr_scheduler.StepLR(opt2, step_size=1)
    with pytest.warns(UserWarning, match="before `optimizer.step\\(\\)`"):
        one_param_step(GradScaler("cpu"), opt2, p, True)
        plain.step()
    with pytest.raises(TypeError):
        skip_aware(object(), scaler)


class CountingSyncs:
    """Counts Tensor methods that read device memory on the host."""

    names = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__")

    def __init__(self, monkeypatch):
        self.count = 0
        for name in self.names:
            original = getattr(torch.Tensor, name)

            def counted(*args, _original=original, **kwargs):
                self.count += 1
                return _original(*args, **kwargs)

            monkeypatch.setattr(torch.Tensor, name, counted)


@pytest.mark.parametrize("impl", IMPLS)
def test_fused_path_has_no_host_sync_and_plain_path_one(impl, monkeypatch):
    params = [nn.Parameter(torch.randn(3, 3)) for _ in range(3)]
    fused = torch.optim.AdamW(params, fused=True)
    plain = torch.optim.SGD(params, lr=0.1)
    scaler = make_scaler(impl)
    scaler.scale(torch.tensor(1.0))
    syncs = CountingSyncs(monkeypatch)
    counts = []
    for optimizer in (fused, plain, fused):
        for p in params:
            p.grad = torch.ones_like(p)
        params[0].grad[0, 0] = INF if len(counts) == 2 else 1.0
        syncs.count = 0
        scaler.step(optimizer)
        scaler.update()
        counts.append(syncs.count)
    monkeypatch.undo()
    assert counts == [0, 1, 0]
    assert scaler.get_scale() == 2.0**15


def test_master_weights_fp16_params_protocol():
    torch.manual_seed(0)
    model = nn.Linear(4, 4).half()
    opt = mixprec.MasterWeights(torch.optim.SGD(model.parameters(), lr=0.1))
    scaler = GradScaler("cpu", init_scale=2.0**10)
    scaler.watch(model)
    x = torch.randn(2, 4)
    loss = nn.functional.linear(x, model.weight.float(), model.bias.float()).sum()
    scaler.scale(loss).backward()
    assert model.weight.grad.dtype == torch.float16
    before = model.weight.detach().clone()
    scaler.unscale_(opt)  # no "Attempting to unscale FP16 gradients"
    masters = [p for g in opt.param_groups for p in g["params"]]
    assert all(m.dtype == torch.float32 for m in masters)
    torch.testing.assert_close(masters[1].grad, torch.full((4,), 2.0))
    scaler.step(opt)
    scaler.update()
    assert not torch.equal(before, model.weight)
    # An overflow in the fp16 model gradients skips the step and is attributed to the model.
    opt.zero_grad()
    loss = nn.functional.linear(x, model.weight.float(), model.bias.float()).sum()
    scaler.scale(loss).backward()
    model.bias.grad[0] = INF
    before = model.weight.detach().clone()
    scaler.step(opt)
    scaler.update()
    assert torch.equal(before, model.weight) and scaler.last_overflow == ("bias",)


def test_prepare_grads_runs_before_gradients_are_read():
    calls = []

    class Prepared(torch.optim.SGD):
        def prepare_grads(self):
            calls.append("prepare")
            for group in self.param_groups:
                for p in group["params"]:
                    p.grad = torch.full_like(p, 8.0)

    p = nn.Parameter(torch.zeros(2))
    opt = Prepared([p], lr=1.0)
    scaler = GradScaler("cpu", init_scale=4.0)
    scaler.scale(torch.tensor(1.0))
    scaler.unscale_(opt)
    assert calls == ["prepare"] and torch.equal(p.grad, torch.full((2,), 2.0))


def test_state_dict_and_pickle_keep_non_default_options(tmp_path):
    p = nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([p], lr=1.0)
    kwargs = dict(init_scale=64.0, hysteresis=3, consecutive_hysteresis=True, min_scale=0.5, max_scale=2.0**20)
    scaler = GradScaler("cpu", **kwargs, on_min_scale="warn", history=CSVHistory(tmp_path / "h.csv"))
    one_param_step(scaler, opt, p, True)
    state = scaler.state_dict()
    assert state["mixprec"] == dict(
        hysteresis=3,
        consecutive_hysteresis=True,
        min_scale=0.5,
        max_scale=2.0**20,
        on_min_scale="warn",
        hysteresis_left=2,
        skipped_steps=1,
        step=1,
    )
    loaded = GradScaler("cpu")
    loaded.load_state_dict(state)
    for restored in (pickle.loads(pickle.dumps(scaler)), loaded):
        assert restored.state_dict() == state
        one_param_step(restored, opt, p, True)  # hysteresis_left 2 -> 1: still tolerated
        assert restored.get_scale() == 64.0
        one_param_step(restored, opt, p, True)  # exhausted: back off
        assert restored.get_scale() == 32.0
    torch_scaler = torch.amp.GradScaler("cpu")
    torch_scaler.load_state_dict(state)
    assert torch_scaler.get_scale() == 64.0


def test_update_new_scale_validation():
    p = nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([p], lr=1.0)
    scaler = GradScaler("cpu", max_scale=2.0**20)
    one_param_step(scaler, opt, p, False)
    scaler.update(new_scale=8.0)
    assert scaler.get_scale() == 8.0
    scaler.update(new_scale=torch.tensor(2.0**30))
    assert scaler.get_scale() == 2.0**20  # tensors are clamped into the bounds
    for bad, error in ((0.0, ValueError), (2.0**21, ValueError), ("2", TypeError), (torch.ones(2), ValueError)):
        with pytest.raises(error):
            scaler.update(new_scale=bad)


@pytest.mark.parametrize(
    "kwargs",
    [dict(growth_factor=1.0), dict(backoff_factor=1.5), dict(init_scale=0.0), dict(on_min_scale="x"), dict(hysteresis=0)],
)
def test_constructor_validation(kwargs):
    with pytest.raises(ValueError):
        GradScaler("cpu", **kwargs)


def test_setters_validate():
    scaler = GradScaler("cpu")
    scaler.set_growth_factor(3.0)
    scaler.set_backoff_factor(0.25)
    scaler.set_growth_interval(7)
    assert (scaler.get_growth_factor(), scaler.get_backoff_factor(), scaler.get_growth_interval()) == (3.0, 0.25, 7)
    with pytest.raises(ValueError):
        scaler.set_backoff_factor(2.0)


def test_update_before_scale_or_step_says_what_to_do():
    scaler = GradScaler("cpu")
    with pytest.raises(RuntimeError, match="scaler.scale"):
        scaler.update()
    scaler.scale(torch.tensor(1.0))
    with pytest.raises(RuntimeError, match="No inf checks"):
        scaler.update()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA fallback")
def test_cuda_device_without_cuda_warns_and_disables():
    with pytest.warns(UserWarning, match="CUDA is not available"):
        scaler = GradScaler()
    assert not scaler.is_enabled()


def test_public_names():
    assert mixprec.GradScaler is GradScaler
    assert mixprec.skip_aware is skip_aware
    import mixprec.scaling as scaling

    assert all(not name.startswith("_") for name in scaling.__all__)
    assert {"GradScaler", "skip_aware", "update_scale", "ScaleState", "CSVHistory", "TensorBoardHistory"} <= set(
        scaling.__all__
    )


def test_init_and_loaded_scale_are_clamped_into_the_bounds():
    capped = GradScaler("cpu", max_scale=1024.0)  # default init_scale 2**16 is above the cap
    assert capped.get_scale() == 1024.0
    assert capped.scale(torch.tensor(1.0)).item() == 1024.0
    floored = GradScaler("cpu", init_scale=0.25, min_scale=1.0)
    assert floored.get_scale() == 1.0
    capped.load_state_dict(torch.amp.GradScaler("cpu").state_dict())  # torch's 2**16
    assert capped.get_scale() == 1024.0 and capped.state.scale.item() == 1024.0


def test_bad_state_dict_leaves_the_scaler_unchanged():
    scaler = GradScaler("cpu", init_scale=8.0, growth_factor=4.0)
    good = torch.amp.GradScaler("cpu").state_dict()
    for bad in (
        {**good, "scale": 0.0},
        {**good, "growth_factor": 0.5},
        {**good, "mixprec": {"hysteresis": 2, "hysteresis_left": 5}},
        {**good, "mixprec": {"on_min_scale": "explode"}},
    ):
        with pytest.raises(ValueError):
            scaler.load_state_dict(bad)
        assert scaler.get_scale() == 8.0 and scaler.get_growth_factor() == 4.0
        assert scaler.config.hysteresis == 1


def test_nan_new_scale_tensor_keeps_the_scale():
    p = nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([p], lr=1.0)
    scaler = GradScaler("cpu", init_scale=16.0)
    one_param_step(scaler, opt, p, False)
    scaler.update(new_scale=torch.tensor(float("nan")))
    assert scaler.get_scale() == 16.0
    scaler.update(new_scale=torch.tensor(0.0))
    assert scaler.get_scale() == 2.0**-126  # never 0
    scaler.update(new_scale=torch.tensor(INF))
    assert scaler.get_scale() == torch.finfo(torch.float32).max  # never inf


@pytest.mark.parametrize("kind", ["plain", "fused"])
def test_step_without_gradients_says_what_to_do(kind):
    model = nn.Linear(2, 2)
    optimizer = make_optimizer(kind, model.parameters())
    scaler = GradScaler("cpu").watch(model)
    scaler.scale(torch.tensor(1.0))
    scaler.unscale_(optimizer)  # like torch: unscaling nothing is fine, even when watching
    with pytest.raises(RuntimeError, match="none of its parameters has a gradient"):
        scaler.step(optimizer)


# ---------------------------------------------------------------- more torch equivalence


def grads_trajectory(impl, grads_per_step, make_opt, scaler_kwargs=None, scaler=None, params=None):
    """Feeds precomputed gradients (inf where given) through scale/step/update; returns scales,
    whether each step moved the weights, and the scaler, params and optimizer."""
    if params is None:
        params = [nn.Parameter(torch.ones(3, 2)), nn.Parameter(torch.zeros(2))]
    optimizer = make_opt(params)
    scaler = scaler or make_scaler(impl, **(scaler_kwargs or {}))
    scales, moved = [], []
    for step_grads in grads_per_step:
        scale = scaler.scale(torch.tensor(1.0))
        for p, g in zip(params, step_grads):
            p.grad = g * scale
        before = params[0].detach().clone()
        scaler.step(optimizer)
        scaler.update()
        scales.append(scaler.get_scale())
        moved.append(not torch.equal(before, params[0]))
    return scales, moved, scaler, params, optimizer


def gradient_sequence(n, seed=0, bad=(2, 5, 6)):
    gen = torch.Generator().manual_seed(seed)
    seq = []
    for i in range(n):
        g = [torch.randn(3, 2, generator=gen), torch.randn(2, generator=gen)]
        if i in bad:
            g[i % 2].view(-1)[0] = INF if i % 3 else float("nan")
        seq.append(g)
    return seq


@pytest.mark.parametrize("src, dst", [("torch", "mixprec"), ("mixprec", "torch")])
def test_state_dict_mid_training_continues_bitwise(src, dst):
    """Train 6 steps with one implementation, checkpoint (non-default options), continue 8 steps
    with the other: the continuation equals running the first implementation throughout."""
    kwargs = dict(init_scale=2.0**12, growth_factor=4.0, backoff_factor=0.25, growth_interval=3)
    seq = gradient_sequence(14, bad=(1, 4, 9, 10))

    def opt(params):
        return torch.optim.SGD(params, lr=0.01, momentum=0.9)

    ref_scales, ref_moved, _, ref_params, _ = grads_trajectory(src, seq, opt, kwargs)
    scales, moved, first, params, optimizer = grads_trajectory(src, seq[:6], opt, kwargs)
    assert first._get_growth_tracker() == 1  # mid-interval: the tracker must travel
    checkpoint = {"scaler": first.state_dict(), "optimizer": optimizer.state_dict()}
    second = make_scaler(dst)
    second.load_state_dict(checkpoint["scaler"])
    more_scales, more_moved, _, params, _ = grads_trajectory(
        dst, seq[6:], lambda ps: _loaded(opt(ps), checkpoint["optimizer"]), scaler=second, params=params
    )
    assert scales + more_scales == ref_scales
    assert moved + more_moved == ref_moved
    assert all(torch.equal(a, b) for a, b in zip(params, ref_params))


def _loaded(optimizer, state):
    optimizer.load_state_dict(state)
    return optimizer


def test_state_dict_round_trips_through_torch_save(tmp_path):
    scaler = GradScaler("cpu", hysteresis=2, min_scale=0.5, max_scale=2.0**20, on_min_scale="warn")
    p = nn.Parameter(torch.zeros(2))
    one_param_step(scaler, torch.optim.SGD([p], lr=1.0), p, True)
    torch.save(scaler.state_dict(), tmp_path / "scaler.pt")
    state = torch.load(tmp_path / "scaler.pt", weights_only=True)  # plain values only
    restored = GradScaler("cpu")
    restored.load_state_dict(state)
    assert restored.state_dict() == scaler.state_dict()


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
    runs = {}
    for impl in IMPLS:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
        optimizer = make_optimizer(kind, model.parameters())
        scaler = make_scaler(impl, init_scale=2.0**8, growth_interval=2)
        scales = []
        for i in range(12):
            x = torch.randn(3, 4)
            with autocast(torch.bfloat16):
                loss = model(x).float().pow(2).mean() / 3
            scaler.scale(loss).backward()
            if i == 4:  # an overflow in one micro-batch spoils the whole accumulated step
                model[0].bias.grad[0] = INF
            if (i + 1) % 3 == 0:
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad()
                scales.append(scaler.get_scale())
        runs[impl] = scales, [p.detach().clone() for p in model.parameters()]
    assert runs["torch"][0] == runs["mixprec"][0] == [256.0, 128.0, 128.0, 256.0]
    assert all(torch.equal(a, b) for a, b in zip(runs["torch"][1], runs["mixprec"][1]))


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


SCHEDULERS = {
    "StepLR": lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5),
    "OneCycleLR": lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=1.0, total_steps=6),
    "LambdaLR": lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda epoch: 1.0 / (epoch + 1)),
    "ReduceLROnPlateau": lambda o: torch.optim.lr_scheduler.ReduceLROnPlateau(o, patience=0, factor=0.5),
}


@pytest.mark.parametrize("kind", ["plain", "fused"])
@pytest.mark.parametrize("name", sorted(SCHEDULERS))
def test_skip_aware_schedulers_follow_the_clean_steps_without_warning(name, kind):
    """The wrapped schedule equals an unwrapped one stepped by hand on the clean iterations only
    (OneCycleLR would raise past total_steps if skipped iterations counted)."""
    bad = (0, 3, 4)  # the very first step is skipped: torch's order warning would fire
    p = nn.Parameter(torch.zeros(2))
    control_p = nn.Parameter(torch.zeros(2))
    opt, control_opt = make_optimizer(kind, [p]), make_optimizer(kind, [control_p])
    scaler = GradScaler("cpu", init_scale=4.0)
    sched, control = skip_aware(SCHEDULERS[name](opt), scaler), SCHEDULERS[name](control_opt)
    plateau = name == "ReduceLROnPlateau"
    lrs, control_lrs = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for i in range(9):
            one_param_step(scaler, opt, p, i in bad)
            sched.step(1.0) if plateau else sched.step()
            if i not in bad:
                control_p.grad = torch.ones(2)
                control_opt.step()
                control.step(1.0) if plateau else control.step()
            lrs.append(opt.param_groups[0]["lr"])
            control_lrs.append(control_opt.param_groups[0]["lr"])
    assert lrs == control_lrs
    assert len(set(lrs)) > 1  # the schedule did move
    assert sched.state_dict() == sched.scheduler.state_dict()  # other attributes pass through


def test_skip_signals_are_device_tensors_and_cost_no_sync(monkeypatch):
    params = [nn.Parameter(torch.randn(3)) for _ in range(2)]
    opt = torch.optim.AdamW(params, fused=True)
    scaler = GradScaler("cpu", init_scale=4.0)
    scaler.scale(torch.tensor(1.0))
    syncs = CountingSyncs(monkeypatch)
    flags, counts = [], []
    for bad in (False, True, True, False):
        for p in params:
            p.grad = torch.ones(3)
        if bad:
            params[1].grad[2] = float("nan")
        scaler.step(opt)
        scaler.update()
        flags.append(scaler.last_step_skipped)
        counts.append(scaler.skipped_steps)
    assert syncs.count == 0  # producing (and keeping) the signals costs nothing
    monkeypatch.undo()
    device = scaler.state.scale.device
    assert all(f.device == device and f.dtype == torch.bool and f.shape == () for f in flags)
    assert all(c.device == device and c.dtype == torch.int64 and c.shape == () for c in counts)
    assert [bool(f) for f in flags] == [False, True, True, False]
    assert [int(c) for c in counts] == [0, 1, 2, 2]


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


def test_non_optimizer_and_repeated_watch():
    model = nn.Linear(2, 2)
    scaler = GradScaler("cpu").watch(model).watch(model)  # watching twice names each once
    scaler.scale(torch.tensor(1.0))
    for call in (scaler.unscale_, scaler.step):
        with pytest.raises(TypeError, match="Pass the optimizer"):
            call(list(model.parameters()))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.ones(1, 2)).sum().backward()
    model.bias.grad[0] = INF
    scaler.step(opt)
    scaler.update()
    assert scaler.last_overflow == ("bias",)


@pytest.mark.parametrize("impl", IMPLS)
def test_torch_private_scale_tensors_for_ported_code(impl):
    scaler = make_scaler(impl, init_scale=8.0)
    assert scaler._scale is None and scaler._growth_tracker is None
    t = torch.ones(2)
    scaler.scale(t)
    assert scaler._scale.device == t.device and scaler._scale.item() == 8.0
    assert scaler._growth_tracker.dtype == torch.int32 and scaler._get_scale_async() is scaler._scale
