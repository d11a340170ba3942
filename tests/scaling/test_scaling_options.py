"""mixprec.GradScaler beyond torch.amp: hysteresis, bounds, skip signals, the skip-aware
scheduler, the optimizer protocol (MasterWeights, prepare_grads), argument validation."""

from __future__ import annotations

import pickle
import warnings

import pytest
import torch
from torch import nn

import mixprec
from mixprec.scaling import GradScaler, skip_aware
from mixprec.scaling.rule import FLOAT32_MAX

from _scaling_cases import INF, make_optimizer, one_param_step


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


def test_equal_bounds_pin_the_scale():
    """``min_scale == max_scale`` is a fixed loss scale: accepted, and neither growth nor an
    overflow moves it (the overflowed step is still skipped; ``on_min_scale="ignore"``: an overflow
    at the pinned scale is no error)."""
    p = nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([p], lr=1.0)
    pinned = GradScaler("cpu", init_scale=16.0, min_scale=16.0, max_scale=16.0, growth_interval=1,
                        on_min_scale="ignore")
    scales = []
    for bad in (False, False, True, False):
        before = p.detach().clone()
        one_param_step(pinned, opt, p, bad)
        scales.append(pinned.get_scale())
        assert torch.equal(p, before) == bad
    assert scales == [16.0] * 4
    with pytest.raises(ValueError, match="must not exceed"):
        GradScaler("cpu", min_scale=32.0, max_scale=16.0)


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


def test_skip_signals_are_device_tensors_and_cost_no_sync(syncs):
    params = [nn.Parameter(torch.randn(3)) for _ in range(2)]
    opt = torch.optim.AdamW(params, fused=True)
    scaler = GradScaler("cpu", init_scale=4.0)
    scaler.scale(torch.tensor(1.0))
    syncs.start()
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
    syncs.stop()
    device = scaler.state.scale.device
    assert all(f.device == device and f.dtype == torch.bool and f.shape == () for f in flags)
    assert all(c.device == device and c.dtype == torch.int64 and c.shape == () for c in counts)
    assert [bool(f) for f in flags] == [False, True, True, False]
    assert [int(c) for c in counts] == [0, 1, 2, 2]


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


# Bounds float32 cannot hold: the nearest float32 of 3e38 is above it, of 0.7 below it. Each case:
# the scaler's options and what drives the scale onto a bound (steps: True overflows).
UNROUNDABLE_BOUNDS = {
    "growth onto max_scale": (dict(init_scale=2e38, growth_factor=1.6, growth_interval=1, max_scale=3e38), [False]),
    "init_scale at max_scale": (dict(init_scale=3e38, max_scale=3e38), []),
    "init_scale just below max_scale": (dict(init_scale=2.99999999e38, max_scale=3e38), []),
    "update(new_scale=max_scale)": (dict(max_scale=3e38), [3e38]),
    "update(new_scale=tensor above)": (dict(max_scale=3e38), [torch.tensor(FLOAT32_MAX)]),
    "a loaded scale above": (dict(max_scale=3e38), [{"scale": FLOAT32_MAX}]),
    "backoff onto min_scale": (dict(init_scale=1.0, min_scale=0.7, on_min_scale="ignore"), [True, True]),
    "update(new_scale=min_scale)": (dict(min_scale=0.7), [0.7]),
}


@pytest.mark.parametrize("options, steps", UNROUNDABLE_BOUNDS.values(), ids=UNROUNDABLE_BOUNDS.keys())
def test_the_scale_never_leaves_bounds_float32_cannot_hold(options, steps):
    """``max_scale=3e38`` let the scale reach 3.0000000054977558e+38: the clamp bound was rounded
    to the nearest float32."""
    p = nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([p], lr=0.0)
    scaler = GradScaler("cpu", **options)
    lower, upper = options.get("min_scale", 0.0), options.get("max_scale", INF)
    assert lower <= scaler.get_scale() <= upper
    scaler.scale(torch.tensor(1.0))
    for step in [None, *steps]:
        if isinstance(step, bool):
            one_param_step(scaler, opt, p, step)
        elif isinstance(step, dict):
            scaler.load_state_dict({**scaler.state_dict(), **step})
        elif step is not None:
            scaler.update(new_scale=step)
        assert lower <= scaler.get_scale() <= upper and lower <= scaler._scale.item() <= upper, step


def test_bounds_with_no_float32_between_them_are_refused():
    with pytest.raises(ValueError, match="no float32 number lies in"):
        GradScaler("cpu", min_scale=0.1, max_scale=0.1)


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
    if kind == "fused":  # like torch: a fused step without gradients is a no-op; update finds no check
        scaler.step(optimizer)
        with pytest.raises(RuntimeError, match="No inf checks were recorded"):
            scaler.update()
        return
    with pytest.raises(RuntimeError, match="none of its parameters has a gradient"):
        scaler.step(optimizer)


def test_skip_aware_is_an_lr_scheduler_frameworks_accept():
    from lightning.pytorch.utilities.types import LRSchedulerTypeTuple

    p = nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([p], lr=1.0)
    inner = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    sched = skip_aware(inner, GradScaler("cpu"))
    assert isinstance(sched, torch.optim.lr_scheduler.LRScheduler)
    assert isinstance(sched, LRSchedulerTypeTuple)
    assert opt.param_groups[0]["lr"] == 1.0 and inner.last_epoch == 0  # wrapping changed nothing
    assert sched.optimizer is opt and sched.get_last_lr() == inner.get_last_lr() == [1.0]
    saved = sched.state_dict()
    assert saved == inner.state_dict()
    sched.last_epoch = 5  # attributes are the wrapped scheduler's, also when set
    assert inner.last_epoch == 5
    sched.load_state_dict(saved)
    assert inner.last_epoch == 0
    clone = pickle.loads(pickle.dumps(sched))
    assert isinstance(clone, type(sched)) and clone.state_dict() == saved


def test_sync_counter_counts_host_copies(syncs):
    """The counter the sync tests rely on sees every way of bringing a value to the host."""
    t = torch.ones(2)
    syncs.start()
    t.to("cpu")
    t.to("cpu", non_blocking=True)
    t.to(device="cpu", dtype=torch.float64)
    t.cpu()
    t.tolist()
    t[0].item()
    bool(t[0])
    t.to(t.device)  # a move to another tensor's device is not a host transfer
    t.to(torch.float16)
    assert syncs.stop() == 7
