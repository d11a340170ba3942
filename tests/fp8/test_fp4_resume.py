"""An fp4 run with stochastic rounding resumed from plain-data checkpoints is bitwise the straight
run: each layer's fp4 call count (``LayerState.rounding_step``, which seeds the rounding) is saved
by ``fp8.rounding_steps``, ``Guard.state_dict`` and ``Controller.state_dict``, and old checkpoints
without it still load (count 0)."""

from __future__ import annotations

import io
import pickle
import warnings
from typing import Any, Callable

import pytest
import torch
from _models import fp8_stack

import mixprec
from mixprec import Policy, fp8

NVFP4 = fp8.Float8Recipe.nvfp4()  # stochastic rounding on (grad_output's casts)
STEPS, SPLIT = 4, 2
FP4_LADDER = ("nvfp4", "tensorwise", "compute")


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(16, 32, generator=gen), torch.randn(16, 32, generator=gen)


class _Route:
    """One way of running fp4 layers: builds the model (and its guard or controller), steps it,
    and saves / loads everything a resume needs besides the model and optimizer."""

    def __init__(self, kind: str) -> None:
        self.kind = kind

    def build(self, seed: int) -> None:
        self.model = fp8_stack(seed=seed)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9)
        self.aux: Any = None
        if self.kind == "convert":
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                self.model = fp8.convert(self.model, NVFP4, filter_fn=lambda m, fqn: True)
            self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9)
            self.region: Callable[[], Any] = lambda: torch.autocast("cpu", torch.bfloat16)
            return
        if self.kind == "guard":
            self.aux = fp8.Guard(every=2, max_underflow=None, max_nonfinite=None)
        elif self.kind == "controller":
            self.aux = mixprec.Controller(every=2, ladder=FP4_LADDER)
        policy = Policy.parse("compute=bf16").fp8(NVFP4, first_last="fp8", **({self.kind: self.aux} if self.aux else {}))
        self.region = lambda: mixprec.autocast("cpu", policy=policy)

    def step(self, i: int) -> torch.Tensor:
        x, y = _data(i)
        self.opt.zero_grad()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with self.region():
                loss = (self.model(x).float() - y).square().mean()
        loss.backward()
        self.opt.step()
        if self.aux is not None:
            self.aux.step()
        return loss.detach()

    def save(self) -> dict[str, Any]:
        extra = fp8.rounding_steps(self.model) if self.aux is None else self.aux.state_dict()
        return {"model": self.model.state_dict(), "opt": self.opt.state_dict(), "fp8": extra}

    def load(self, ckpt: dict[str, Any]) -> None:
        self.model.load_state_dict(ckpt["model"])
        self.opt.load_state_dict(ckpt["opt"])
        if self.aux is None:
            fp8.load_rounding_steps(self.model, ckpt["fp8"])
        else:
            self.aux.load_state_dict(ckpt["fp8"])


def _roundtrip(ckpt: dict[str, Any]) -> dict[str, Any]:
    buf = io.BytesIO()
    torch.save(ckpt, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _straight(kind: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    run = _Route(kind)
    run.build(seed=0)
    losses = [run.step(i) for i in range(STEPS)]
    return losses, [p.detach().clone() for p in run.model.parameters()]


def _resumed(kind: str, restore_counts: bool = True) -> tuple[list[torch.Tensor], list[torch.Tensor], dict]:
    first = _Route(kind)
    first.build(seed=0)
    losses = [first.step(i) for i in range(SPLIT)]
    ckpt = _roundtrip(first.save())
    if not restore_counts:  # a checkpoint of the code before the counts were saved
        ckpt["fp8"] = {} if first.aux is None else _without_counts(ckpt["fp8"])
    second = _Route(kind)
    second.build(seed=1)  # other initial weights: everything comes from the checkpoint
    second.load(ckpt)
    losses += [second.step(i) for i in range(SPLIT, STEPS)]
    return losses, [p.detach().clone() for p in second.model.parameters()], ckpt


def _without_counts(state: dict[str, Any]) -> dict[str, Any]:
    entries = state["windows"] if "windows" in state else state["layers"]
    for entry in entries.values():
        entry.pop("rounding_step")
    return state


@pytest.mark.parametrize("kind", ["policy", "convert", "guard", "controller"])
def test_resumed_nvfp4_run_is_bitwise_the_straight_run(kind):
    losses, params = _straight(kind)
    got_losses, got_params, ckpt = _resumed(kind)
    assert all(torch.equal(a, b) for a, b in zip(losses, got_losses)), (losses, got_losses)
    assert all(torch.equal(a, b) for a, b in zip(params, got_params))
    counts = ckpt["fp8"] if kind in ("policy", "convert") else {
        n: e["rounding_step"] for n, e in (ckpt["fp8"].get("windows") or ckpt["fp8"]["layers"]).items()}
    assert counts == {"0": SPLIT, "2": SPLIT, "4": SPLIT, "6": SPLIT}  # one fp4 call per layer per step


@pytest.mark.parametrize("kind", ["policy", "guard", "controller"])
def test_a_checkpoint_without_the_counts_loads_and_draws_from_zero(kind):
    """What the code before saved the counts wrote: it loads, each count restarts at 0 (the
    draws of a run resumed by that code), so the run is not the straight one."""
    losses, params = _straight(kind)
    got_losses, got_params, _ = _resumed(kind, restore_counts=False)
    assert all(torch.equal(a, b) for a, b in zip(losses[:SPLIT + 1], got_losses[:SPLIT + 1]))  # the forward has no SR
    assert not all(torch.equal(a, b) for a, b in zip(params, got_params))


def test_rounding_steps_round_trip_and_errors():
    model = fp8_stack()
    with pytest.raises(ValueError, match=r"the model has no module 'nope'"):
        fp8.load_rounding_steps(model, {"nope": 3})
    fp8.load_rounding_steps(model, {"2": 7})  # a layer without a state gets one
    assert fp8.rounding_steps(model) == {"2": 7}
    with pytest.raises(ValueError, match="rounding_step must be an int >= 0"):
        fp8.load_rounding_steps(model, {"2": -1})
    st = fp8.layer_state(model[2])
    step = st.next_rounding_step()
    assert step.dtype == torch.int64 and int(step) == 7 and st.rounding_step == 8
    assert int(step) == 7  # the step a backward reads is not changed by the count going on


def test_a_layer_state_pickled_with_an_int_count_unpickles():
    """A LayerState pickled when the count was the Python int ``rounding_step`` (or before it
    existed) unpickles with it as the device counter."""
    st = fp8.LayerState()
    state = dict(st.__dict__)
    del state["_rounding"]
    old = pickle.loads(pickle.dumps(st))
    old.__dict__.clear()
    old.__setstate__({**state, "rounding_step": 5})
    assert old.rounding_step == 5 and int(old.next_rounding_step()) == 5
    older = fp8.LayerState.__new__(fp8.LayerState)
    older.__setstate__(state)
    assert older.rounding_step == 0


@pytest.mark.parametrize("reentrant", [False, True])
def test_an_activation_checkpoints_recompute_draws_what_the_forward_drew(reentrant):
    """``torch.utils.checkpoint`` recomputes each NVFP4 layer's forward in the backward: the
    recompute takes the step its forward drew (not the next), so the gradients are the
    uncheckpointed run's, bitwise, and each layer counts one fp4 call per step."""
    from torch.utils.checkpoint import checkpoint

    x, y = _data(0)
    runs = []
    for checkpointed in (False, True):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = fp8.convert(fp8_stack(seed=0), NVFP4, filter_fn=lambda m, fqn: True, backend="emulate_fp32")
        grads = []
        for _ in range(2):
            model.zero_grad()
            with torch.autocast("cpu", torch.bfloat16):
                h = x.clone().requires_grad_()  # (a reentrant checkpoint needs an input that does)
                for block in (model[:4], model[4:]):
                    h = checkpoint(block, h, use_reentrant=reentrant) if checkpointed else block(h)
                loss = (h.float() - y).square().mean()
            loss.backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        runs.append((grads, fp8.rounding_steps(model)))
    (plain, plain_steps), (ckpt, ckpt_steps) = runs
    assert plain_steps == ckpt_steps == {"0": 2, "2": 2, "4": 2, "6": 2}
    for a, b in zip(plain, ckpt):
        assert all(torch.equal(p, q) for p, q in zip(a, b))


def _ordinary(kind: str) -> tuple[list[torch.Tensor], list[torch.Tensor], dict]:
    """Resume from nothing but the model's and the optimizer's ``state_dict()`` (and, for a Guard
    or Controller, theirs without the counts): the counts ride in the model's."""
    runs = []
    for seed in (0, 1):
        run = _Route(kind)
        run.build(seed=seed)
        if kind != "convert":  # (the policy route's states come at the first forward)
            fp8.keep_rounding_state(run.model)
        runs.append(run)
    first, second = runs
    losses = [first.step(i) for i in range(SPLIT)]
    ckpt = _roundtrip({"model": first.model.state_dict(), "opt": first.opt.state_dict(),
                       **({"aux": _without_counts(first.aux.state_dict())} if first.aux is not None else {})})
    second.model.load_state_dict(ckpt["model"])  # strict
    second.opt.load_state_dict(ckpt["opt"])
    if second.aux is not None:
        second.aux.load_state_dict(ckpt["aux"])
    losses += [second.step(i) for i in range(SPLIT, STEPS)]
    return losses, [p.detach().clone() for p in second.model.parameters()], ckpt


@pytest.mark.parametrize("kind", ["policy", "convert", "guard", "controller"])
def test_an_ordinary_checkpoint_resumes_the_draws_bitwise(kind):
    losses, params = _straight(kind)
    got_losses, got_params, ckpt = _ordinary(kind)
    assert all(torch.equal(a, b) for a, b in zip(losses, got_losses)), (losses, got_losses)
    assert all(torch.equal(a, b) for a, b in zip(params, got_params))
    counts = {k: int(v) for k, v in ckpt["model"].items() if k.endswith(fp8.ROUNDING_KEY)}
    assert counts == {f"{n}.{fp8.ROUNDING_KEY}": SPLIT for n in ("0", "2", "4", "6")}


@pytest.mark.parametrize("kept", [True, False])
def test_the_count_is_in_the_state_dict_only_once_a_call_rounded_stochastically(kept):
    """On the policy route, only in a model ``keep_rounding_state`` marked (a plain model's keys
    never change by itself), and only once a call rounded stochastically."""
    x = torch.randn(8, 32)
    for recipe, has in ((fp8.Float8Recipe.nvfp4(stochastic_rounding=False), False), ("tensorwise", False),
                        (NVFP4, kept)):
        model = fp8_stack()
        if kept:
            fp8.keep_rounding_state(model)
        keys = set(model.state_dict())
        policy = Policy.parse("compute=bf16").fp8(recipe, first_last="fp8")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with mixprec.autocast("cpu", policy=policy):
                model(x).float().sum().backward()
        extra = set(model.state_dict()) - keys
        assert extra == ({f"{n}.{fp8.ROUNDING_KEY}" for n in ("0", "2", "4", "6")} if has else set()), recipe
        if has:
            plain = fp8_stack()  # a model mixprec never ran: the entries are unexpected there (torch's strict load)
            with pytest.raises(RuntimeError, match=fp8.ROUNDING_KEY):
                plain.load_state_dict(model.state_dict())
            plain.load_state_dict(model.state_dict(), strict=False)
            assert fp8.layer_state(plain[0], create=False) is None


def test_a_hostile_count_is_refused_naming_the_entry():
    model = fp8.keep_rounding_state(fp8_stack())
    sd = model.state_dict()
    for bad in (torch.tensor(2.0), torch.tensor(-1), torch.tensor([1, 2]), 3):
        with pytest.raises(RuntimeError, match=r"'2\._mixprec_rounding_step' is mixprec's fp4 call count"):
            model.load_state_dict({**sd, f"2.{fp8.ROUNDING_KEY}": bad})
    assert fp8.layer_state(model[2]).rounding_step == 0  # nothing half-loaded


def test_the_count_loads_into_a_layer_that_is_the_model_and_survives_copies():
    lin = fp8.keep_rounding_state(torch.nn.Linear(32, 32))  # (the model is the layer)
    lin.load_state_dict({**lin.state_dict(), fp8.ROUNDING_KEY: torch.tensor(5)})
    st = fp8.layer_state(lin, create=False)
    assert st.rounding_step == 5 and lin.state_dict()[fp8.ROUNDING_KEY].item() == 5
    for copy in (pickle.loads(pickle.dumps(lin)), __import__("copy").deepcopy(lin)):
        assert copy.state_dict()[fp8.ROUNDING_KEY].item() == 5
        copy.load_state_dict({**copy.state_dict(), fp8.ROUNDING_KEY: torch.tensor(9)})
        assert fp8.layer_state(copy).rounding_step == 9 and st.rounding_step == 5


def test_a_compiled_model_saves_its_counts():
    """Under ``torch.compile`` the count still reaches the state dict (the flag is written in the
    traced call, never read there: no guard, no recompile)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = fp8.convert(fp8_stack(seed=0), NVFP4, filter_fn=lambda m, fqn: True)
    compiled = torch.compile(model, backend="aot_eager")
    x, _ = _data(0)
    for _ in range(2):
        with torch.autocast("cpu", torch.bfloat16):
            compiled(x).float().sum().backward()
    sd = compiled.state_dict()
    assert {k: int(v) for k, v in sd.items() if k.endswith(fp8.ROUNDING_KEY)} == {
        f"_orig_mod.{n}.{fp8.ROUNDING_KEY}": 2 for n in ("0", "2", "4", "6")}
