"""MasterWeights: fp32 masters around any optimizer; schedulers, scalers, checkpoints."""

import io
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from mixprec import MasterWeights


def _model(dtype=torch.bfloat16):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.Linear(8, 3))
    return mixprec.to_low_precision(model, dtype)


def _loss(model, seed):
    g = torch.Generator().manual_seed(seed)
    dtype = model[0].weight.dtype
    x, y = torch.randn(16, 6, generator=g).to(dtype), torch.randn(16, 3, generator=g)
    return F.mse_loss(model(x).float(), y)


def _backward(model, seed, scale=1.0):
    loss = _loss(model, seed)
    (loss * scale).backward()
    return loss.detach()


def test_steps_the_inner_optimizer_on_fp32_masters():
    model = _model()
    opt = MasterWeights(torch.optim.AdamW(model.parameters(), lr=1e-2))
    ref = [p.detach().float().clone() for p in model.parameters()]
    ref_opt = torch.optim.AdamW(ref, lr=1e-2)
    norm = model[1].weight
    assert any(m is norm for m in opt.masters)  # fp32 params are their own master
    for step in range(4):
        _backward(model, step)
        grads = [p.grad.clone() for p in model.parameters()]
        for r, g in zip(ref, grads):
            r.grad = g.float()
        opt.step()
        ref_opt.step()
        for p, g in zip(model.parameters(), grads):
            assert torch.equal(p.grad, g)  # model gradients are read, not written
        opt.zero_grad()
    for p, m, r in zip(model.parameters(), opt.masters, ref):
        assert m.dtype == torch.float32
        assert torch.equal(m, r)
        assert torch.equal(p, r.to(p.dtype))
        assert m.grad is None and p.grad is None


@pytest.mark.parametrize(
    "make_scheduler,factor",
    [
        (lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5), 0.25),
        (lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 1.0 / (1 + epoch)), 0.2),
    ],
)
def test_param_groups_schedulers_and_hooks(make_scheduler, factor):
    model = _model()
    inner = torch.optim.SGD(
        [{"params": model[0].parameters()}, {"params": model[2].parameters(), "lr": 0.1}], lr=1.0, momentum=0.9
    )
    opt = MasterWeights(inner)
    assert isinstance(opt, torch.optim.Optimizer)
    assert opt.param_groups is inner.param_groups and opt.state is inner.state
    scheduler = make_scheduler(opt)
    calls = []
    opt.register_step_post_hook(lambda o, args, kwargs: calls.append(o))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. "lr_scheduler.step() before optimizer.step()"
        for step in range(4):
            _backward(model, step)
            opt.step()
            scheduler.step()
            opt.zero_grad()
    assert calls == [opt] * 4
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([factor, 0.1 * factor])
    assert all("momentum_buffer" in opt.state[m] for m in opt.masters[:2])


def test_add_param_group_and_existing_state():
    model = _model()
    inner = torch.optim.Adam(model[0].parameters(), lr=1e-2)
    _backward(model, 0)
    inner.step()  # state on the bf16 params, in bf16
    opt = MasterWeights(inner)
    opt.add_param_group({"params": model[2].parameters(), "lr": 1e-3})
    assert len(opt.masters) == 4 and all(m.dtype == torch.float32 for m in opt.masters)
    for m in opt.masters[:2]:
        assert opt.state[m]["exp_avg"].dtype == torch.float32
    before = [p.detach().clone() for p in model[2].parameters()]
    opt.zero_grad()
    _backward(model, 1)
    opt.step()
    assert all(not torch.equal(p, b) for p, b in zip(model[2].parameters(), before))


@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad(set_to_none):
    model = _model()
    opt = MasterWeights(torch.optim.SGD(model.parameters(), lr=0.1))
    _backward(model, 0)
    opt.prepare_grads()
    opt.zero_grad(set_to_none=set_to_none)
    for t in [*model.parameters(), *opt.masters]:
        if set_to_none:
            assert t.grad is None
        else:
            assert t.grad is None or not t.grad.any()


def test_prepare_grads_is_idempotent_until_the_model_grads_change():
    model = _model()
    opt = MasterWeights(torch.optim.SGD(model.parameters(), lr=0.1))
    _backward(model, 0)
    opt.prepare_grads()
    master = opt.masters[0]
    assert torch.equal(master.grad, model[0].weight.grad.float())
    master.grad.mul_(0.5)  # what a scaler's unscale_ does
    opt.prepare_grads()
    assert torch.equal(master.grad, model[0].weight.grad.float() * 0.5)  # kept
    _backward(model, 1)  # accumulates into the model's .grad
    opt.prepare_grads()
    assert torch.equal(master.grad, model[0].weight.grad.float())  # refreshed
    model[0].weight.grad = None
    opt.prepare_grads()
    assert master.grad is None


def test_closure_and_stochastic_write_back():
    def run(rounding, seed):
        model = _model()
        opt = MasterWeights(
            torch.optim.SGD(model.parameters(), lr=1e-3), rounding=rounding, generator=torch.Generator().manual_seed(seed)
        )

        def closure():
            opt.zero_grad()
            return _backward(model, 0)

        for _ in range(3):
            loss = opt.step(closure)
        assert loss.ndim == 0
        return model, opt

    a, opt_a = run("stochastic", 0)
    b, _ = run("stochastic", 0)
    c, opt_c = run("nearest", 0)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not all(torch.equal(p, q) for p, q in zip(a.parameters(), c.parameters()))
    for p, m in zip(a.parameters(), opt_a.masters):  # each write-back is a neighbour of the master
        gap = torch.finfo(p.dtype).eps * m.abs().clamp_min(1e-30)
        assert torch.all((p.float() - m).abs() <= 2 * gap)


# clipping code a closure runs after backward, as Lightning's gradient_clip_val does (on param_groups)
CLOSURE_CLIPS = {
    "norm": lambda params: torch.nn.utils.clip_grad_norm_(params, 1e-3),
    "value": lambda params: torch.nn.utils.clip_grad_value_(params, 1e-4),
    "none": lambda params: None,
}


@pytest.mark.parametrize("clip", CLOSURE_CLIPS)
def test_clipping_param_groups_inside_the_closure_clips_the_stepped_master_grads(clip):
    """Until 2026-12-07 the masters had no gradient until step() copied it after the closure: a
    clip in the closure (Lightning's gradient_clip_val) clipped nothing. It is now bitwise the
    hand-written prepare_grads() + clip(opt.masters) loop; without a clip, bitwise the plain step."""

    def run(in_closure):
        model = _model()
        opt = MasterWeights(torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9))
        for step in range(3):
            _backward(model, 10 + step)  # an accumulated micro-batch before the closure's
            if in_closure:
                def closure():
                    loss = _backward(model, step)
                    CLOSURE_CLIPS[clip]([p for g in opt.param_groups for p in g["params"]])
                    return loss

                opt.step(closure)
            else:
                _backward(model, step)
                if clip != "none":
                    opt.prepare_grads()
                    CLOSURE_CLIPS[clip](opt.masters)
                opt.step()
            opt.zero_grad()
        return model, opt

    assert _same_weights_and_masters(run(True), run(False))
    assert not any(p._post_accumulate_grad_hooks for p in run(True)[0].parameters())  # hooks removed


def _train(steps, *runs):
    """Steps every ``(model, opt)`` of ``runs`` on the batches of ``steps``, in lockstep."""
    for step in steps:
        for model, opt in runs:
            _backward(model, step)
            opt.step()
            opt.zero_grad()


def _same_weights_and_masters(a, b):
    (model_a, opt_a), (model_b, opt_b) = a, b
    pairs = zip([*model_a.parameters(), *opt_a.masters], [*model_b.parameters(), *opt_b.masters])
    return all(torch.equal(p, q) for p, q in pairs)


def _save_load(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf)


def test_state_dict_round_trip_holds_fp32_masters():
    def make():
        model = _model()
        return model, MasterWeights(torch.optim.AdamW(model.parameters(), lr=3e-3))

    model_a, opt_a = make()
    _train(range(3), (model_a, opt_a))
    ckpt = _save_load({"model": model_a.state_dict(), "opt": opt_a.state_dict()})
    masters = ckpt["opt"]["master_params"]
    assert [m.dtype for m in masters] == [torch.float32] * len(masters)
    assert any(not torch.equal(m, m.to(torch.bfloat16).float()) for m in masters)  # low bits kept

    model_b, opt_b = make()
    model_b.load_state_dict(ckpt["model"])
    opt_b.load_state_dict(ckpt["opt"])
    _train(range(3, 5), (model_a, opt_a), (model_b, opt_b))
    assert _same_weights_and_masters((model_a, opt_a), (model_b, opt_b))

    bad = dict(ckpt["opt"], master_params=ckpt["opt"]["master_params"][:-1])
    with pytest.raises(ValueError, match="master params"):
        opt_b.load_state_dict(bad)


def test_refresh_masters_after_loading_model_weights():
    model = _model()
    opt = MasterWeights(torch.optim.SGD(model.parameters(), lr=0.1))
    with torch.no_grad():
        model[0].weight.fill_(0.25)
    opt.refresh_masters()
    assert torch.all(opt.masters[0] == 0.25)


@pytest.mark.parametrize(
    "inner,fused",
    [
        (lambda ps: torch.optim.AdamW(ps, lr=1e-2), False),
        (lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True), True),
        (lambda ps: mixprec.optim.AdamW(ps, lr=1e-2), True),  # implements the fused protocol
    ],
)
def test_fp16_params_with_mixprec_grad_scaler(inner, fused):
    model = _model(torch.float16)
    opt = MasterWeights(inner(model.parameters()))
    assert opt._step_supports_amp_scaling  # the scalers hand it grad_scale and found_inf
    scaler = mixprec.GradScaler("cpu", init_scale=2.0**10)
    losses = []
    for step in range(6):
        loss = _loss(model, 0)
        scaler.scale(loss).backward()
        losses.append(loss.item())
        if step == 3:  # an overflow: the step is skipped, the scale halves
            model[0].weight.grad[0, 0] = float("inf")
            before = [p.detach().clone() for p in model.parameters()]
        if not fused:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(opt.masters, 100.0)  # clip fp32 master grads
        scaler.step(opt)
        if step == 3:
            assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
        scaler.update()
        opt.zero_grad()
    assert scaler.get_scale() == 2.0**9
    assert losses[-1] < losses[0]
    assert all(p.dtype == torch.float16 for p in model[0].parameters())


def test_skipped_fused_step_keeps_stochastically_rounded_params():
    model = _model(torch.float16)
    opt = MasterWeights(
        torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True),
        rounding="stochastic",
        generator=torch.Generator().manual_seed(0),
    )
    scaler = mixprec.GradScaler("cpu", init_scale=2.0**10)
    for step in range(3):
        scaler.scale(_loss(model, step)).backward()
        before = [p.detach().clone() for p in model.parameters()]
        if step == 2:
            model[0].weight.grad[0, 0] = float("nan")
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        changed = [not torch.equal(p, b) for p, b in zip(model.parameters(), before)]
        assert not any(changed) if step == 2 else all(changed)


def test_unscale_divides_the_master_grads_once():
    model = _model(torch.float16)
    opt = MasterWeights(torch.optim.SGD(model.parameters(), lr=0.1))
    scaler = mixprec.GradScaler("cpu", init_scale=64.0)
    scaler.scale(_loss(model, 0)).backward()
    scaler.unscale_(opt)
    expected = model[0].weight.grad.float() / 64.0
    assert torch.equal(opt.masters[0].grad, expected)
    opt.prepare_grads()  # as step does: no second copy over the unscaled grads
    assert torch.equal(opt.masters[0].grad, expected)


@pytest.mark.parametrize("fused", [False, True])
def test_fp16_params_with_torch_grad_scaler_after_prepare_grads(fused):
    model = _model(torch.float16)
    opt = MasterWeights(torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    first = None
    for step in range(4):
        loss = _loss(model, 0)
        scaler.scale(loss).backward()
        first = loss if first is None else first
        opt.prepare_grads()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    assert loss < first


def test_composes_with_mixprec_autocast():
    model = _model(torch.bfloat16)
    opt = MasterWeights(torch.optim.AdamW(model.parameters(), lr=1e-2))
    x = torch.randn(4, 6)
    with mixprec.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
    out.float().square().mean().backward()
    opt.step()
    assert model[0].weight.dtype == torch.bfloat16 and opt.masters[0].dtype == torch.float32


def test_errors():
    model = _model()
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        MasterWeights(list(model.parameters()))
    opt = MasterWeights(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(TypeError, match="already wrapped"):
        MasterWeights(opt)
    with pytest.raises(TypeError, match="LBFGS"):
        MasterWeights(torch.optim.LBFGS(_model().parameters()))
    with pytest.raises(ValueError, match="rounding"):
        MasterWeights(torch.optim.SGD(_model().parameters(), lr=0.1), rounding="up")


def test_fused_inner_optimizer_gets_the_scale_forwarded():
    """SGD is not scale invariant: a fused step only matches if grad_scale reached it."""

    def run(fused):
        model = _model(torch.float16)
        opt = MasterWeights(torch.optim.SGD(model.parameters(), lr=0.1, fused=fused))
        scaler = mixprec.GradScaler("cpu", init_scale=2.0**8)
        for step in range(3):
            scaler.scale(_loss(model, step)).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        return opt.masters

    for a, b in zip(run(True), run(False)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fused", [False, True])
def test_real_loop_with_overflow_skips_keeps_weights_and_masters(fused):
    """fp16 weights, mixprec.autocast, a scale large enough that backward overflows by itself."""
    model = _model(torch.float16)
    opt = MasterWeights(torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused))
    scaler = mixprec.GradScaler("cpu", init_scale=2.0**19, growth_interval=2)
    skipped = stepped = 0
    for step in range(12):
        with mixprec.autocast("cpu", dtype=torch.float16):
            loss = _loss(model, step)
        scaler.scale(loss).backward()
        params = [p.detach().clone() for p in model.parameters()]
        masters = [m.detach().clone() for m in opt.masters]
        scale = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        unchanged = all(torch.equal(a, b) for a, b in zip(params, model.parameters())) and all(
            torch.equal(a, b) for a, b in zip(masters, opt.masters)
        )
        if scaler.get_scale() < scale:  # a skipped step
            skipped += 1
            assert unchanged
        else:
            stepped += 1
            assert not unchanged
    assert skipped >= 1 and stepped >= 1, (skipped, stepped)
    assert all(torch.isfinite(m).all() for m in opt.masters)


@pytest.mark.parametrize("fused", [False, True])
def test_torch_grad_scaler_without_prepare_grads_is_an_error(fused):
    """torch.amp.GradScaler cannot see the master gradients: never step on what it missed."""
    model = _model(torch.float16)
    opt = MasterWeights(torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    scaler.scale(_loss(model, 0)).backward()
    model[0].weight.grad[0, 0] = float("inf")  # an overflow only the master grads would show
    with pytest.raises(RuntimeError, match="prepare_grads"):
        scaler.step(opt)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_torch_grad_scaler_with_prepare_grads_skips_overflow_and_unscales():
    model = _model(torch.float16)
    opt = MasterWeights(torch.optim.SGD(model.parameters(), lr=0.1))
    ref = _model(torch.float16)
    ref_opt = MasterWeights(torch.optim.SGD(ref.parameters(), lr=0.1))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    for step in range(3):
        scaler.scale(_loss(model, step)).backward()
        _backward(ref, step)
        if step == 1:
            model[0].weight.grad[0, 0] = float("nan")
            before = [m.detach().clone() for m in opt.masters]
        opt.prepare_grads()
        scaler.step(opt)
        scaler.update()
        if step == 1:
            assert all(torch.equal(a, b) for a, b in zip(before, opt.masters))
        else:
            ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    for a, b in zip(opt.masters, ref_opt.masters):  # a power-of-two scale is exact
        assert torch.equal(a, b)


@pytest.mark.filterwarnings("ignore:optimizer contains a parameter group with duplicate parameters")
def test_add_param_group_rejects_a_parameter_already_held():
    model = _model()
    opt = MasterWeights(torch.optim.SGD(model[0].parameters(), lr=0.1))
    with pytest.raises(ValueError, match="more than once"):
        opt.add_param_group({"params": [model[0].weight]})
    with pytest.raises(ValueError, match="more than once"):
        opt.add_param_group({"params": [model[2].weight, model[2].weight]})
    assert len(opt.param_groups) == 1  # nothing was added
    with pytest.raises(ValueError, match="more than once"):
        MasterWeights(torch.optim.SGD([{"params": [model[2].weight]}, {"params": [model[2].bias, model[2].bias]}], lr=0.1))


@pytest.mark.parametrize("model_first", [True, False])
def test_stochastic_write_back_resumes_bitwise(model_first):
    def make():
        model = _model()
        gen = torch.Generator().manual_seed(0)
        return model, MasterWeights(torch.optim.AdamW(model.parameters(), lr=1e-2), rounding="stochastic", generator=gen)

    model_a, opt_a = make()
    _train(range(3), (model_a, opt_a))
    ckpt = _save_load({"model": model_a.state_dict(), "opt": opt_a.state_dict()})
    assert "master_generator_state" in ckpt["opt"]
    model_b, opt_b = make()
    if model_first:
        model_b.load_state_dict(ckpt["model"])
    opt_b.load_state_dict(ckpt["opt"])
    if not model_first:
        model_b.load_state_dict(ckpt["model"])
    _train(range(3, 6), (model_a, opt_a), (model_b, opt_b))
    assert _same_weights_and_masters((model_a, opt_a), (model_b, opt_b))


def test_speaks_the_documented_scaler_protocol():
    """MasterWeights is a PreparesGrads and a ScalesItself; what a scaler lends lives only for
    the step, and a lent scale unscales the masters as the scalers' unscale_ does."""
    from mixprec.scaling.protocol import PreparesGrads, lend_scale, lent_scale

    model = _model()
    opt = MasterWeights(torch.optim.SGD(model.parameters(), lr=1.0))
    assert isinstance(opt, PreparesGrads) and opt._step_supports_amp_scaling
    assert lent_scale(opt) is None
    _backward(model, 0, scale=8.0)
    opt.prepare_grads()
    expected = [m.detach() - m.grad / 8.0 for m in opt.masters]
    with lend_scale(opt, torch.tensor(8.0), torch.tensor(0.0)):
        assert lent_scale(opt).grad_scale.item() == 8.0
        opt.step()
    assert lent_scale(opt) is None and not hasattr(opt, "found_inf")
    assert all(torch.equal(m, e) for m, e in zip(opt.masters, expected))


NO_GRADIENT = {  # how the first Linear gets no gradient on steps 3-5
    "frozen": lambda model, step: model[0].requires_grad_(step < 3),
    "skipped": lambda model, step: None,  # (its output replaced by a constant in the loss below)
}


@pytest.mark.parametrize("rounding", ["stochastic", "nearest"])
@pytest.mark.parametrize("inner", ["AdamW", "AdamW fused", "SGD momentum"])
@pytest.mark.parametrize("how", NO_GRADIENT.keys())
def test_a_parameter_without_a_gradient_stays_as_it_is(how, inner, rounding):
    """A parameter with no gradient this step (frozen, or its layer skipped) is not stepped by
    the wrapped optimizer, and its low-precision value stays, bitwise: a fresh stochastic
    rounding of its unchanged master would move it between its two bfloat16 neighbours (before,
    a quarter of a frozen layer's weights moved on every step)."""
    model = _model()
    make = {"AdamW": lambda ps: torch.optim.AdamW(ps, lr=1e-2),
            "AdamW fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
            "SGD momentum": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9)}[inner]
    opt = MasterWeights(make(model.parameters()), rounding=rounding, generator=torch.Generator().manual_seed(1))
    kept = {}
    for step in range(6):
        NO_GRADIENT[how](model, step)
        if step < 3 or how == "frozen":
            loss = _loss(model, step)
        else:
            x = torch.ones(16, 8, dtype=model[0].weight.dtype)
            loss = model[2](model[1](x)).float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step == 2:
            kept = {n: p.detach().clone() for n, p in model[0].named_parameters()}
            moving = model[2].weight.detach().clone()
    for name, p in model[0].named_parameters():
        assert torch.equal(p, kept[name]), name
    assert not torch.equal(model[2].weight, moving)  # (the rest trains)


def test_state_dict_hooks_run_as_torch_optimizers_run_them():
    """Hooks registered on the wrapper (not on the wrapped optimizer) ran only for step."""
    opt = MasterWeights(torch.optim.AdamW(_model().parameters()))
    calls = []
    opt.register_state_dict_pre_hook(lambda o: calls.append(("sd_pre", o)))
    opt.register_state_dict_post_hook(lambda o, sd: {**sd, "extra": 1})
    opt.register_load_state_dict_pre_hook(lambda o, sd: calls.append(("load_pre", sd.pop("extra"))))
    opt.register_load_state_dict_post_hook(lambda o: calls.append(("load_post", o)))
    saved = opt.state_dict()
    assert saved["extra"] == 1 and "master_params" in saved
    opt.load_state_dict(saved)
    assert calls == [("sd_pre", opt), ("load_pre", 1), ("load_post", opt)]


def test_wrapped_before_the_cast_gets_masters_at_the_first_step():
    """to_low_precision after MasterWeights(...) keeps the parameter objects, which the wrapped
    optimizer then stepped in bf16 (lr 2**-18 never moved 1.5): now they get fp32 masters, and
    the masters are torch's fp32 run bitwise."""
    model = nn.Linear(4, 1)
    nn.init.constant_(model.weight, 1.5)
    ref = model.weight.detach().clone().requires_grad_()
    opt = MasterWeights(torch.optim.AdamW(model.parameters(), lr=2**-18, weight_decay=0))
    ref_opt = torch.optim.AdamW([ref], lr=2**-18, weight_decay=0)
    mixprec.to_low_precision(model)
    for _ in range(1000):
        model.weight.grad = torch.ones_like(model.weight)
        model.bias.grad = torch.ones_like(model.bias)
        ref.grad = torch.ones_like(ref)
        opt.step()
        ref_opt.step()
    assert len(opt.master_pairs()) == 2 and all(m.dtype == torch.float32 for m in opt.masters)
    assert torch.equal(opt.master_pairs()[0][1], ref.detach()) and ref[0, 0].item() < 1.4962
    assert torch.equal(model.weight, ref.detach().bfloat16())
