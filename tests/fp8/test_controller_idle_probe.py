"""A controlled layer's probe call that measures nothing returns at once (``Probe._idle``: most
calls of most steps, issue 39's cost): no timing, no measurement code. It must be exactly the
calls on which the full probe would do nothing: each thing a call may have to measure or carry
(a shadow step, the backward costs' step, a loss cost, a pending update's gain, an end slope, a
loaded update, a tapped forward, fp16's range, a first call, tensor parallelism) sends it the
full way, and whole runs with the fast path are bitwise the runs without it."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.utils.checkpoint

import mixprec
from mixprec.control._probe import Probe

SETTINGS = dict(per_gemm=True, every=5, ladder=("nvfp4", "tensorwise", "rowwise", "compute"), max_loss_cost=1e-3,
                max_backward_cost=3e-5, cost_row_share=0.25, shadow_steps=2)


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(*(m for _ in range(4) for m in (nn.Linear(64, 64), nn.GELU())), nn.Linear(64, 32))


def _run(steps: int = 40, seed: int = 0, micro_batches: int = 1, checkpointed: bool = False,
         resume_at: int | None = None, **changes) -> tuple:
    """Train under an NVFP4 controller (``SETTINGS`` with ``changes``; ``resume_at``: a step after
    which the run goes on in a fresh controller, model and optimizer from their state_dicts); returns
    the losses, the decisions, the controller's and the model's state."""

    def build(state: tuple | None = None) -> tuple:
        ctl, model = mixprec.fp8.Controller(**(SETTINGS | changes)), _model(seed)
        ctl.attach(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        if state is not None:
            for part, saved in zip((ctl, model, opt), state):
                part.load_state_dict(saved)
        return ctl, model, opt

    ctl, model, opt = build()
    policy = mixprec.Policy.parse("compute=bf16").fp8("nvfp4", first_last="fp8", controller=ctl.settings,
                                                      backend="emulate_fp32")
    gen = torch.Generator().manual_seed(seed + 1)
    target = torch.randn(32, 32, generator=gen)
    losses = []
    for step in range(steps):
        if step == resume_at:
            ctl, model, opt = build(tuple(copy.deepcopy(p.state_dict()) for p in (ctl, model, opt)))
        for _ in range(micro_batches):
            x = torch.randn(32, 64, generator=gen)
            with mixprec.autocast("cpu", policy=policy):
                out = (torch.utils.checkpoint.checkpoint(model, x, use_reentrant=False,
                                                         context_fn=mixprec.checkpoint_context_fn)
                       if checkpointed else model(x))
                loss = (out.float() - target).square().mean()
            (loss / micro_batches).backward()
            losses.append(loss.item())
        opt.step()
        opt.zero_grad()
        ctl.step()
    return losses, ctl.log, ctl.state_dict(), model.state_dict()


RUNS = {
    "per-GEMM, loss and backward costs": {},
    "two micro-batches a step": {"micro_batches": 2},
    "activation checkpointing": {"checkpointed": True},
    "per-layer records": {"per_gemm": False, "max_backward_cost": None},
    "every row, raw updates": {"cost_row_share": 1.0, "normalized_updates": False},
    # (the measured backward on a window's last step: the update's gain and end slope are read by
    # the next window's first forward, where nothing else is measured)
    "one shadow step": {"shadow_steps": 1},
    "one shadow step, two micro-batches": {"shadow_steps": 1, "micro_batches": 2},  # (the slope: each micro-batch's)
    # (saved after the step whose backward was measured: the update whose end slope the next
    # forward reads comes back from the checkpoint, ``BackwardCost.ready``)
    "one shadow step, resumed": {"shadow_steps": 1, "resume_at": 15},
}


@pytest.mark.parametrize("case", RUNS.values(), ids=RUNS.keys())
def test_a_run_with_the_fast_path_is_bitwise_the_run_without(monkeypatch, case):
    calls = {"idle": 0, "all": 0}
    idle = Probe._idle

    def counted(self, x, tp):
        calls["all"] += 1
        calls["idle"] += (out := idle(self, x, tp))
        return out

    monkeypatch.setattr(Probe, "_idle", counted)
    fast = _run(**case)
    assert 0.3 * calls["all"] < calls["idle"] < calls["all"]  # (the fast path taken, and not always)
    monkeypatch.setattr(Probe, "_idle", lambda self, x, tp: False)
    full = _run(**case)
    assert fast[0] == full[0] and fast[1] == full[1] and fast[1]  # (bitwise losses, the same decisions: some)
    assert repr(fast[2]) == repr(full[2])  # (the controller's windows, pools, pending updates: all plain data)
    for name, value in fast[3].items():
        assert torch.equal(value, full[3][name]), name


class _Record:
    """What ``Probe._idle`` reads of a record, idle by default."""

    def __init__(self) -> None:
        self.measuring_now = self.backward_now = False
        self.cost = torch.zeros(2, 7)
        self.cost_now, self.forward_below = [False, False], object()
        self.backward = _Backward()

    def cost_rows_now(self) -> tuple[bool, bool]:
        return self.cost_now[0], self.cost_now[1] and self.forward_below is not None


class _Backward:
    def __init__(self) -> None:
        self.pending = self.ready = self.slope = self._open = self.gained = None


# each thing a probe call may have to do, set on an idle record (and the call's input and sharding)
BUSY = {
    "a shadow step": lambda r, p: setattr(r, "measuring_now", True),
    "the backward costs' step": lambda r, p: setattr(r, "backward_now", True),
    "its own loss cost this step": lambda r, p: r.cost_now.__setitem__(0, True),
    "the rung below's loss cost this step": lambda r, p: r.cost_now.__setitem__(1, True),
    "an update's gain pending": lambda r, p: setattr(r.backward, "pending", [None] * 5),
    "an end slope to read": lambda r, p: setattr(r.backward, "slope", [None] * 5),
    "a loaded update": lambda r, p: setattr(r.backward, "ready", torch.zeros(1)),
    "a made update's gain": lambda r, p: setattr(r.backward, "gained", torch.zeros(2)),
    "a tapped forward": lambda r, p: setattr(r.backward, "_open", object()),
    "the first call (its dtype unknown)": lambda r, p: setattr(p, "dtype", None),
}


def _probe(rec: _Record) -> Probe:
    probe = object.__new__(Probe)
    probe.rec, probe.dtype = rec, torch.bfloat16
    return probe


@pytest.mark.parametrize("busy", BUSY.values(), ids=BUSY.keys())
def test_each_thing_to_measure_or_carry_takes_the_full_probe(busy):
    rec = _Record()
    probe = _probe(rec)
    x = torch.zeros(2, 4, dtype=torch.bfloat16)
    assert probe._idle(x, None)
    busy(rec, probe)
    assert not probe._idle(x, None)


def test_fp16_inputs_tensor_parallel_layers_and_no_rung_below_to_measure():
    rec = _Record()
    probe = _probe(rec)
    assert not probe._idle(torch.zeros(2, 4, dtype=torch.float16), None)  # (fp16: the range is recorded)
    assert not probe._idle(torch.zeros(2, 4, dtype=torch.bfloat16), object())  # (a sharded layer: the full way)
    rec.cost_now[1], rec.forward_below = True, None  # (the rung below's cost wanted, no rung below: nothing)
    assert probe._idle(torch.zeros(2, 4, dtype=torch.bfloat16), None)
    rec.cost, rec.backward = None, None  # (no loss cost, no backward costs)
    assert probe._idle(torch.zeros(2, 4, dtype=torch.bfloat16), None)
