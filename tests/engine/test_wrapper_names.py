"""Names under PyTorch's module wrappers: ``DistributedDataParallel`` (``module.``), ``DataParallel``,
FSDP1's and ``checkpoint_wrapper``'s attributes, torch.compile's ``_orig_mod``. A policy's
``keep(names=...)`` and ``fp8(names=...)`` rules, and the layer names of a Controller's or Guard's
state_dict, are those of the bare model with or without the wrapper: a state saved under DDP
loads into the bare model and the reverse (1-process gloo group for DDP)."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
from torch import nn

import mixprec
from mixprec import Policy, fp8
from mixprec._modules import clean_name, named_modules, unwrap

from _distributed import free_port, gloo_group

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.body, self.head = nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(torch.tanh(self.inp(x)))))


@pytest.fixture(scope="module")
def ddp() -> Iterator[Callable[[nn.Module], nn.Module]]:
    """Wraps a model in DistributedDataParallel, inside a 1-process gloo group."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialized")
    with gloo_group(0, free_port(), world_size=1):
        yield lambda m: nn.parallel.DistributedDataParallel(m)


def _checkpoint_wrapped(m: _Net) -> nn.Module:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    # a wrapper inside the model (body._checkpoint_wrapped_module), recomputed under the forward's policy
    m.body = checkpoint_wrapper(m.body, context_fn=mixprec.checkpoint_context_fn)
    return m


WRAPS: dict[str, Callable[..., nn.Module]] = {
    "bare": lambda m, ddp: m,
    "ddp": lambda m, ddp: ddp(m),
    "data_parallel": lambda m, ddp: nn.DataParallel(m),
    "checkpoint_wrapper": lambda m, ddp: _checkpoint_wrapped(m),
    "ddp_of_checkpoint_wrapper": lambda m, ddp: ddp(_checkpoint_wrapped(m)),
}


def _model(wrap: str, ddp: Any) -> tuple[_Net, nn.Module]:
    torch.manual_seed(0)
    bare = _Net()
    return bare, WRAPS[wrap](bare, ddp)


@pytest.mark.parametrize("wrap", list(WRAPS))
def test_a_keep_rule_by_name_selects_the_same_module_under_a_wrapper(wrap: str, ddp: Any) -> None:
    bare, model = _model(wrap, ddp)
    dtypes = {}
    for name in ("inp", "body", "head"):  # (the hooks on the Linears, inside a checkpoint_wrapper)
        unwrap(getattr(bare, name)).register_forward_hook(lambda m, a, out, name=name: dtypes.__setitem__(name, out.dtype))
    policy = Policy.parse("compute=bf16").keep(names=r"^(body|head)$")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the rule matches: no "selected no module" warning
        with mixprec.autocast("cpu", policy=policy):
            model(torch.randn(4, 32))
    assert dtypes == {"inp": torch.bfloat16, "body": torch.float32, "head": torch.float32}


def _controlled(wrap: str, ddp: Any, state: dict[str, Any] | None = None) -> tuple[mixprec.Controller, _Net]:
    """One training step of ``wrap``'s model under an fp8 policy with a Controller (loaded with ``state``)."""
    bare, model = _model(wrap, ddp)
    ctl = mixprec.Controller(every=1)
    if state is not None:
        ctl.load_state_dict(state)
    policy = Policy.parse("compute=bf16").fp8("tensorwise", names=r"^(body|head)$", first_last="fp8", controller=ctl)
    with mixprec.autocast("cpu", policy=policy):
        model(torch.randn(4, 32)).float().square().mean().backward()
    return ctl, bare


@pytest.mark.parametrize("saved, loaded", [("ddp", "bare"), ("bare", "ddp"), ("data_parallel", "bare")])
def test_a_controller_state_saved_under_a_wrapper_loads_without_it_and_the_reverse(saved: str, loaded: str,
                                                                                      ddp: Any) -> None:
    ctl, _ = _controlled(saved, ddp)
    state = ctl.state_dict()
    assert sorted(state["layers"]) == ["body", "head"]  # the fp8 rule's names=: the bare model's names
    state["layers"]["body"]["rung"] = "rowwise"  # as if the controller had promoted it
    ctl2, bare = _controlled(loaded, ddp, state)
    assert fp8.layer_state(bare.body).recipe.name == "rowwise"  # resumed on its rung, not its recipe
    assert ctl2.state_dict()["layers"]["body"]["rung"] == "rowwise"


@pytest.mark.parametrize("wrap", ["ddp", "data_parallel"])
def test_a_guard_names_the_bare_models_layers(wrap: str, ddp: Any) -> None:
    bare, model = _model(wrap, ddp)
    guard = fp8.Guard(every=1)
    policy = Policy.parse("compute=bf16").fp8("tensorwise", first_last="fp8", guard=guard)
    with mixprec.autocast("cpu", policy=policy):
        model(torch.randn(4, 32)).float().square().mean().backward()
    guard.step(model)
    assert sorted(guard.state_dict()["windows"]) == ["body", "head", "inp"]
    assert sorted(fp8.layer_states(model)) == ["body", "head", "inp"]


def test_names_without_wrappers() -> None:
    m = _checkpoint_wrapped(_Net())
    assert [n for n, _ in named_modules(nn.DataParallel(m))] == ["", "", "inp", "body", "body", "head"]
    assert unwrap(nn.DataParallel(m)) is m and unwrap(m.body) is not m.body
    assert clean_name("_orig_mod.layers.0._fsdp_wrapped_module.attn") == "layers.0.attn"
    assert fp8.select_layers(nn.DataParallel(m), names=r"^(body|head)$", first_last="fp8") == ["body", "head"]
    state = {"steps": 0, "log": [], "layers": {}}
    guard = fp8.Guard()
    guard.load_state_dict({"steps": 1, "decisions": {}, "windows": {
        "_orig_mod.body": {"stats": fp8.LayerState().window.tolist(), "output_sqnr_db": 30.0}}})
    assert list(guard.state_dict()["windows"]) == ["body"]  # torch.compile's name from an older save
    mixprec.Controller().load_state_dict(state)
