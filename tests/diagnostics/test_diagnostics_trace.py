"""trace_nonfinite: names the right module in forward and backward, in eager and deferred mode."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import mixprec
from mixprec.diagnostics import NonFiniteError, trace_nonfinite

torch.manual_seed(0)


class Blow(nn.Module):
    """Overflows float32 in forward."""

    def __init__(self, factor: float = 1e39) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor


class _InfGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # type: ignore[no-untyped-def]
        return x.clone()

    @staticmethod
    def backward(ctx, g):  # type: ignore[no-untyped-def]
        return g * float("inf")


class BwdBlow(nn.Module):
    """Identity in forward, infinite gradient in backward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _InfGrad.apply(x)


class _WeightInf(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):  # type: ignore[no-untyped-def]
        ctx.save_for_backward(w)
        return x * w

    @staticmethod
    def backward(ctx, g):  # type: ignore[no-untyped-def]
        (w,) = ctx.saved_tensors
        return g * w, torch.full_like(w, float("inf"))


class WeightInf(nn.Module):
    """Finite input gradient, infinite weight gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _WeightInf.apply(x, self.weight)


def chain(bad: nn.Module, at: int, n: int = 4) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i in range(n):
        layers.append(nn.Linear(8, 8))
        if i == at:
            layers.append(bad)
    return nn.Sequential(*layers)


def step(model: nn.Module, tracer, x: torch.Tensor | None = None):  # type: ignore[no-untyped-def]
    x = torch.randn(2, 8) if x is None else x
    model(x).float().sum().backward()
    return tracer.resolve()


def assert_no_hooks(model: nn.Module) -> None:
    for m in model.modules():
        assert not m._forward_hooks and not m._forward_pre_hooks
        assert not m._backward_hooks and not m._backward_pre_hooks
    for p in model.parameters():
        assert not p._backward_hooks


@pytest.mark.parametrize("deferred", [False, True], ids=["eager", "deferred"])
@pytest.mark.parametrize("at", [0, 1, 2, 3])
def test_forward_overflow_names_the_layer(at: int, deferred: bool) -> None:
    model = chain(Blow(), at)
    with trace_nonfinite(model, deferred=deferred) as tracer:
        resolved = step(model, tracer)
    ev = tracer.first
    assert ev is not None
    # the step's one event is the first: the layers the inf then reached add none
    assert resolved is ev and tracer.events == [ev]
    name = str(at + 1)  # Blow sits right after Linear number `at`
    assert isinstance(model[int(name)], Blow)
    assert (ev.module, ev.module_type, ev.phase, ev.tensor) == (name, "Blow", "forward", "output")
    assert ev.kind == "inf" and ev.dtype == torch.float32
    assert len(ev.input_ranges) == 1 and all(abs(v) < 1e3 for v in ev.input_ranges[0])


@pytest.mark.parametrize("deferred", [False, True], ids=["eager", "deferred"])
@pytest.mark.parametrize("at", [0, 1, 2, 3])
def test_backward_overflow_names_the_layer(at: int, deferred: bool) -> None:
    model = chain(BwdBlow(), at)
    with trace_nonfinite(model, deferred=deferred) as tracer:
        resolved = step(model, tracer)
    ev = tracer.first
    assert ev is not None and resolved is ev and tracer.events == [ev]
    assert (ev.module, ev.module_type, ev.phase, ev.tensor) == (
        str(at + 1), "BwdBlow", "backward", "grad_input")
    # the gradient arriving at the module's output was finite
    assert ev.input_ranges and all(abs(v) < 1e6 for r in ev.input_ranges for v in r)


@pytest.mark.parametrize("deferred", [False, True], ids=["eager", "deferred"])
def test_parameter_gradient_names_owner(deferred: bool) -> None:
    model = nn.Sequential(nn.Linear(8, 8), WeightInf(), nn.Linear(8, 8))
    with trace_nonfinite(model, deferred=deferred) as tracer:
        step(model, tracer)
    ev = tracer.first
    assert ev is not None and (ev.module, ev.phase, ev.tensor) == ("1", "backward", "grad:weight")


class Nested(nn.Module):
    def __init__(self, own_code: str | None = None) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 8)
        self.fc2 = nn.Linear(8, 8)
        self.own_code = own_code

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        if self.own_code == "forward":
            h = h * 1e39
        elif self.own_code == "backward":
            h = _InfGrad.apply(h)
        return self.fc2(h)


@pytest.mark.parametrize("deferred", [False, True], ids=["eager", "deferred"])
def test_nested_innermost_and_own_code(deferred: bool) -> None:
    model = nn.Sequential(Nested(), nn.Sequential(Nested(), chain(Blow(), 1, n=2)), Nested())
    with trace_nonfinite(model, deferred=deferred) as tracer:
        step(model, tracer)
    assert tracer.first is not None and tracer.first.module == "1.1.2"

    for phase in ("forward", "backward"):
        model = nn.Sequential(Nested(), Nested(own_code=phase), Nested())
        with trace_nonfinite(model, deferred=deferred) as tracer:
            step(model, tracer)
        ev = tracer.first
        assert ev is not None
        assert (ev.module, ev.phase, ev.tensor) == ("1", phase, "intermediate")


def test_nan_input_and_loss_gradient() -> None:
    model = chain(nn.Identity(), 0)
    with trace_nonfinite(model) as tracer:
        x = torch.randn(2, 8)
        x[0, 0] = float("nan")
        step(model, tracer, x)
    ev = tracer.first
    assert ev is not None and (ev.module, ev.tensor, ev.kind) == ("", "input", "nan")

    with trace_nonfinite(model) as tracer:
        (model(torch.randn(2, 8)).sum() * float("inf")).backward()
    ev = tracer.first
    assert ev is not None and (ev.module, ev.phase, ev.tensor) == ("", "backward", "grad_output")


def test_finite_run_reports_nothing_and_steps_count() -> None:
    blow = Blow(1.0)
    model = chain(blow, 1)
    with trace_nonfinite(model, deferred=True) as tracer:
        assert step(model, tracer) is None
        blow.factor = 1e39
        ev = step(model, tracer)
    assert ev is not None and ev.step == 1 and tracer.first is ev and tracer.events == [ev]


def test_raise_on_nonfinite() -> None:
    model = chain(Blow(), 2)
    with trace_nonfinite(model, raise_on_nonfinite=True):
        with pytest.raises(NonFiniteError, match="forward output of module '3'") as info:
            model(torch.randn(2, 8))
    assert info.value.event.module == "3"
    assert_no_hooks(model)

    model = chain(BwdBlow(), 0)
    with trace_nonfinite(model) as tracer:
        tracer.raise_on_nonfinite = True
        with pytest.raises(NonFiniteError, match="backward grad_input of module '1'"):
            model(torch.randn(2, 8)).sum().backward()

    model = chain(Blow(), 0)
    with trace_nonfinite(model, deferred=True, raise_on_nonfinite=True) as tracer:
        model(torch.randn(2, 8))  # deferred: nothing raised in the hooks
        with pytest.raises(NonFiniteError):
            tracer.resolve()


def test_precise_mode_names_the_op() -> None:
    model = chain(Blow(), 1)
    with trace_nonfinite(model, precise=True) as tracer:
        step(model, tracer)
    assert tracer.first is not None and tracer.first.op == "aten.mul.Tensor"
    assert tracer.first.module == "2"
    model = chain(BwdBlow(), 1)
    with trace_nonfinite(model, precise=True, deferred=True) as tracer:
        step(model, tracer)
    assert tracer.first is not None and tracer.first.module == "2"
    assert tracer.first.op == "aten.mul.Tensor"
    assert torch._C._len_torch_dispatch_stack() == 0


def test_hooks_removed_and_nothing_global() -> None:
    import torch.nn.modules.module as mm

    globals_before = [dict(d) for d in (mm._global_forward_hooks, mm._global_forward_pre_hooks,
                                        mm._global_backward_hooks, mm._global_backward_pre_hooks)]
    model = chain(Blow(1.0), 1)
    with trace_nonfinite(model, precise=True):
        assert model[0]._forward_hooks  # installed while active
        with pytest.raises(ZeroDivisionError):
            1 / 0
    assert_no_hooks(model)
    with pytest.raises(ZeroDivisionError):
        with trace_nonfinite(model, deferred=True):
            raise ZeroDivisionError
    assert_no_hooks(model)
    globals_after = [dict(d) for d in (mm._global_forward_hooks, mm._global_forward_pre_hooks,
                                       mm._global_backward_hooks, mm._global_backward_pre_hooks)]
    assert globals_after == globals_before
    # a graph built inside the block and run after it does not call back into the tracer
    with trace_nonfinite(model) as tracer:
        y = model(torch.randn(2, 8))
    (y * float("inf")).sum().backward()
    assert tracer.first is None


def test_deferred_mode_does_not_sync_per_module(monkeypatch: pytest.MonkeyPatch) -> None:
    model = chain(Blow(), 2)
    with trace_nonfinite(model, deferred=True) as tracer:
        def no_sync(*a, **k):  # type: ignore[no-untyped-def]
            raise AssertionError("host sync inside a deferred tracer's hooks")

        with monkeypatch.context() as m:
            for attr in ("item", "tolist", "__bool__", "cpu"):
                m.setattr(torch.Tensor, attr, no_sync)
            model(torch.randn(2, 8)).sum().backward()
        ev = tracer.resolve()
    assert ev is not None and ev.module == "3"


def test_deferred_event_keeps_the_step_it_was_checked_in() -> None:
    """``resolve()`` after several steps: the event said the step of the ``resolve()`` (2), not the
    forward where the inf came (0); eager mode says 0."""
    model = chain(Blow(), 2)
    steps = []
    for deferred in (False, True):
        with trace_nonfinite(model, deferred=deferred) as tracer:
            for _ in range(3):
                model(torch.randn(2, 8)).sum().backward()
            ev = tracer.resolve() if deferred else tracer.first
        steps.append(ev.step)
    assert steps == [0, 0]


class _TwoOutputs(nn.Module):
    """A finite float32 output, then a float16 one that overflows."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x * 2, x.half() * 1e5


@pytest.mark.parametrize("deferred", [False, True])
def test_event_dtype_is_the_non_finite_tensors(deferred: bool) -> None:
    """The event gave the dtype of the module's first output (float32), not the non-finite one's."""
    model = nn.Sequential(_TwoOutputs())
    with trace_nonfinite(model, deferred=deferred) as tracer:
        model(torch.ones(2, 8))
        ev = tracer.resolve() if deferred else tracer.first
    assert ev is not None and ev.module == "0" and ev.dtype == torch.float16


def test_inplace_ops_on_traced_outputs_still_work() -> None:
    class Residual(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)
            self.act = nn.ReLU(inplace=True)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = self.fc(x)
            out += x
            return self.act(out)

    model = nn.Sequential(Residual(), Residual())
    x = torch.randn(2, 8, requires_grad=True)
    with trace_nonfinite(model) as tracer:
        model(x).sum().backward()
    assert tracer.first is None and x.grad is not None


def test_float16_overflow_under_autocast_is_named() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), Blow(1e5), nn.Linear(8, 8))
    with trace_nonfinite(model, deferred=True) as tracer:
        with mixprec.autocast("cpu", dtype=torch.float16):
            y = model(torch.randn(2, 8) + 3)
        ev = tracer.resolve()
    assert y.dtype == torch.float16
    assert ev is not None and (ev.module, ev.dtype) == ("2", torch.float16)


def test_event_str_and_dict() -> None:
    model = chain(Blow(), 0)
    with trace_nonfinite(model) as tracer:
        model(torch.randn(2, 8))
    ev = tracer.first
    assert ev is not None
    assert "module '1' (Blow)" in str(ev) and "forward output" in str(ev)
    d = ev.to_dict()
    assert d["dtype"] == "float32" and d["module"] == "1"
    with pytest.raises(TypeError):
        trace_nonfinite("not a module")  # type: ignore[arg-type]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_deferred_no_sync_until_resolve() -> None:
    model = chain(Blow(), 1).cuda()
    x = torch.randn(2, 8, device="cuda")
    model(x).sum().backward()  # warm up
    with trace_nonfinite(model, deferred=True) as tracer:
        torch.cuda.set_sync_debug_mode("error")
        try:
            model(x).sum().backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        ev = tracer.resolve()
    assert ev is not None and ev.module == "2"


def test_deferred_tracer_resolved_by_grad_scaler_history() -> None:
    model = chain(BwdBlow(), 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    found: list[tuple[int, bool, object]] = []
    with trace_nonfinite(model, deferred=True) as tracer:
        def on_update(step, scale, skipped, names):  # type: ignore[no-untyped-def]
            found.append((step, skipped, tracer.resolve() if skipped else None))

        scaler = mixprec.GradScaler("cpu", init_scale=2.0 ** 8, history=on_update)
        for _ in range(2):
            scaler.scale(model(torch.randn(2, 8)).sum()).backward()
            scaler.step(opt)
            scaler.update()
            assert bool(scaler.last_step_skipped)
            tracer.clear()
    assert [(s, k) for s, k, _ in found] == [(0, True), (1, True)]
    assert all(ev is not None and ev.module == "3" and ev.phase == "backward"
               for _, _, ev in found)


def test_parameter_passed_as_input_keeps_no_hook() -> None:
    from mixprec.diagnostics import collect_ranges

    class Mul(nn.Module):
        def forward(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return x * w

    class Gate(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(8))
            self.mul = Mul()
            self.get = nn.Identity()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.mul(x, self.get(self.w))  # a leaf enters and leaves modules

    model = nn.Sequential(nn.Linear(8, 8), Gate())
    for tool in (trace_nonfinite(model), collect_ranges(model)):
        with tool:
            model(torch.randn(2, 8)).sum().backward()
        assert_no_hooks(model)


class Branches(nn.Module):
    """Two sibling modules take the same input; ``bad`` picks which one blows up."""

    def __init__(self, bad: str, phase: str) -> None:
        super().__init__()
        blow = BwdBlow() if phase == "backward" else Blow()
        self.a = blow if bad == "a" else nn.Linear(8, 8)
        self.b = blow if bad == "b" else nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) + self.b(x) + x  # two consumers and a skip connection


@pytest.mark.parametrize("deferred", [False, True], ids=["eager", "deferred"])
@pytest.mark.parametrize("phase", ["forward", "backward"])
@pytest.mark.parametrize("bad", ["a", "b"])
def test_sibling_consumers_of_one_tensor(bad: str, phase: str, deferred: bool) -> None:
    model = nn.Sequential(nn.Linear(8, 8), Branches(bad, phase), nn.Linear(8, 8))
    x = torch.randn(2, 8)
    with trace_nonfinite(model, deferred=deferred) as tracer:
        step(model, tracer, x)
    ev = tracer.first
    assert ev is not None and (ev.module, ev.phase) == (f"1.{bad}", phase)
    # the aliases change nothing in the results
    model = nn.Sequential(nn.Linear(8, 8), Branches("none", "forward"), nn.Linear(8, 8))
    x = torch.randn(2, 8, requires_grad=True)
    model(x).sum().backward()
    ref = (model(x).detach(), x.grad.clone())
    x.grad = None
    with trace_nonfinite(model, deferred=deferred):
        y = model(x)
        y.sum().backward()
    assert torch.equal(y, ref[0]) and torch.equal(x.grad, ref[1])


class InplaceBlow(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mul_(1e39)


class InplaceParent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(1e39)  # the parent's own code, in place, then a child
        return self.fc(x)


@pytest.mark.parametrize("deferred", [False, True], ids=["eager", "deferred"])
def test_inplace_overflow_names_the_module_that_did_it(deferred: bool) -> None:
    model = nn.Sequential(nn.Linear(8, 8), InplaceBlow(), nn.Linear(8, 8))
    with trace_nonfinite(model, deferred=deferred) as tracer:
        model(torch.randn(2, 8))
        tracer.resolve()
    ev = tracer.first
    assert ev is not None and (ev.module, ev.phase, ev.tensor) == ("1", "forward", "output")
    model = nn.Sequential(nn.Linear(8, 8), InplaceParent(), nn.Linear(8, 8))
    with trace_nonfinite(model, deferred=deferred) as tracer:
        model(torch.randn(2, 8))
        tracer.resolve()
    ev = tracer.first
    assert ev is not None and (ev.module, ev.tensor) == ("1", "intermediate")
    with trace_nonfinite(model), torch.inference_mode():  # no version counters: still works
        model(torch.randn(2, 8))


def test_raise_carries_module_phase_dtype_and_ranges() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), Blow(1e5), nn.Linear(8, 8))
    x = torch.full((2, 8), 0.5)
    with trace_nonfinite(model, raise_on_nonfinite=True):
        with pytest.raises(NonFiniteError) as info, mixprec.autocast("cpu", dtype=torch.float16):
            with torch.no_grad():
                model[1].weight.fill_(100.0)
            model(x)
    ev = info.value.event
    assert (ev.module, ev.phase, ev.dtype, ev.kind) == ("2", "forward", torch.float16, "inf")
    lo, hi = ev.input_ranges[0]
    assert 1.0 < max(-lo, hi) < 65504  # Linear 1's finite, large output went in
    message = str(info.value)
    assert "module '2' (Blow)" in message and "forward" in message and "float16" in message
    assert f"[{lo:.4g}, {hi:.4g}]" in message


def test_deferred_resolve_is_one_host_read(monkeypatch: pytest.MonkeyPatch) -> None:
    model = chain(BwdBlow(), 1)
    calls: list[str] = []
    for attr in ("item", "tolist", "cpu", "__bool__"):
        orig = getattr(torch.Tensor, attr)

        def counted(self, *a, _orig=orig, _attr=attr, **k):  # type: ignore[no-untyped-def]
            calls.append(_attr)
            return _orig(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, attr, counted)
    with trace_nonfinite(model, deferred=True) as tracer:
        model(torch.randn(2, 8)).sum().backward()
        assert calls == []  # nothing read during forward and backward
        ev = tracer.resolve()
    assert ev is not None and ev.module == "2"
    # one copy finds the event, one more describes it (its input ranges); no per-value reads
    assert calls.count("cpu") == 2 and "item" not in calls and "__bool__" not in calls
    with trace_nonfinite(chain(nn.Identity(), 1), deferred=True) as tracer:
        tracer.model(torch.randn(2, 8)).sum().backward()
        calls.clear()
        assert tracer.resolve() is None
    assert calls.count("cpu") == 1 and "item" not in calls and "__bool__" not in calls


def test_deferred_tracer_resolved_on_last_step_skipped() -> None:
    blow = BwdBlow()
    model = chain(blow, 0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = mixprec.GradScaler("cpu", init_scale=2.0 ** 8)
    seen = []
    with trace_nonfinite(model, deferred=True) as tracer:
        for i in range(3):
            x = torch.randn(2, 8)
            model[1] = blow if i == 1 else nn.Identity()  # only step 1 overflows
            opt.zero_grad()
            scaler.scale(model(x).sum()).backward()
            scaler.step(opt)
            scaler.update()
            if scaler.last_step_skipped.item():  # one sync per step
                seen.append((i, tracer.resolve()))
            else:
                tracer.clear()  # no sync
    assert [(i, ev.module, ev.phase) for i, ev in seen] == [(1, "1", "backward")]


class OwnCodeOnShared(nn.Module):
    """Hands its input to a child and also uses it in its own code; ``bad`` picks which of the
    two makes the gradient infinite."""

    def __init__(self, bad: str) -> None:
        super().__init__()
        self.child = BwdBlow() if bad == "child" else nn.Linear(8, 8)
        self.bad = bad

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        own = _InfGrad.apply(x) if self.bad == "own" else x * 2
        return self.child(x) + own


@pytest.mark.parametrize("deferred", [False, True], ids=["eager", "deferred"])
@pytest.mark.parametrize("bad", ["own", "child"])
def test_parent_code_on_a_tensor_it_shares_with_a_child(bad: str, deferred: bool) -> None:
    model = nn.Sequential(nn.Linear(8, 8), OwnCodeOnShared(bad), nn.Linear(8, 8))
    with trace_nonfinite(model, deferred=deferred) as tracer:
        step(model, tracer)
    ev = tracer.first
    assert ev is not None and ev.phase == "backward"
    assert ev.module == ("1" if bad == "own" else "1.child"), ev


class _Attention(nn.Module):
    """q and k projections of one input (the tracer aliases the shared tensor), a softmax."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.out = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = torch.softmax(self.q(x) @ self.k(x).transpose(-1, -2), -1)
        return self.out(nn.functional.gelu(scores @ x))


def _outputs_and_grads(model_dtype, autocast_dtype, tool):
    torch.manual_seed(0)
    model = _Attention().to(model_dtype)
    x = torch.randn(3, 8, dtype=model_dtype, requires_grad=True)
    with tool(model):
        with torch.autocast("cpu", dtype=autocast_dtype):
            y = model(x)
        y.float().square().sum().backward()
    return [y, x.grad, *(p.grad for p in model.parameters())]


@pytest.mark.parametrize("precise", [False, True], ids=["hooks", "precise"])
@pytest.mark.parametrize("autocast_dtype", [torch.float16, torch.bfloat16], ids=["fp16-autocast", "bf16-autocast"])
@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16], ids=["fp32-model", "bf16-model"])
def test_tracing_changes_nothing_the_model_computes(model_dtype, autocast_dtype, precise):
    """Outputs and gradients are bitwise the untraced run's (before: a bfloat16 model under
    float16 autocast crashed once traced, 'Unexpected floating ScalarType in
    at::autocast::prioritize': the hooks' own stack ran under the user's autocast)."""
    import contextlib

    plain = _outputs_and_grads(model_dtype, autocast_dtype, lambda m: contextlib.nullcontext())
    traced = _outputs_and_grads(model_dtype, autocast_dtype, lambda m: trace_nonfinite(m, precise=precise))
    for a, b in zip(plain, traced):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_a_copy_taken_inside_the_block_is_not_traced_and_the_model_pickles():
    """An EMA copy (``copy.deepcopy``) taken inside ``trace_nonfinite`` carries the module hooks,
    inert: its overflow is not reported as the traced model's, under the traced model's names;
    and the traced model pickles inside the block (its hooks pickle as inert ones)."""
    import copy
    import pickle

    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 4))
    with trace_nonfinite(model) as tracer:
        model(torch.randn(2, 8)).sum().backward()
        ema = copy.deepcopy(model)
        twin = pickle.loads(pickle.dumps(model))
        with torch.no_grad():
            ema[2].weight[0, 0] = twin[2].weight[0, 0] = float("inf")
        ema(torch.randn(2, 8))
        twin(torch.randn(2, 8))
        assert tracer.first is None
        with torch.no_grad():
            model[2].weight[0, 0] = float("inf")
        model(torch.randn(2, 8))
    assert tracer.first is not None and tracer.first.module == "2" and tracer.first.step == 1
