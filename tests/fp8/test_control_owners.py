"""One Guard or Controller per model (``control/_owners.py``): a second model whose layers share the
first's names (a GAN's generator and discriminator, a teacher and its student) is refused when the
shell tracks it (its forward under the policy; the Guard's ``step(model)``), with a ValueError that
says to build one per model. Before, each model's forward took the other's records over: the
Controller's decisions were undone (the log promoting the same layer from the same rung again and
again), the Guard never read the first model's windows or fell back the other model's layer. What
legitimately brings another module under a known name is taken over: a layer replaced on purpose,
a model handed over (detached from the old one), a copy carrying its own shell; a submodule called
directly reaches the records of the model that holds it (docs/controller.md, "One record per layer")."""

from __future__ import annotations

import copy
import warnings
from typing import Any, Callable

import pytest
import torch
import torch.nn as nn

import mixprec
from mixprec import Controller, Policy, fp8


class _Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 32))])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks[0](x)


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 32))


def _policy(shell: Any, legacy: bool = False) -> Policy:
    kind = "controller" if isinstance(shell, Controller) else "guard"
    return Policy.parse("compute=bf16").fp8("tensorwise", first_last="fp8",
                                             **{kind: shell if legacy else shell.settings})


def _forward(model: nn.Module, policy: Policy) -> None:
    with mixprec.autocast("cpu", policy=policy):
        model(torch.randn(4, 32)).float().sum().backward()


def _holds(shell: Any, name: str, module: nn.Module) -> bool:
    """Whether ``shell``'s record of ``name`` is ``module``'s."""
    if isinstance(shell, Controller):
        return shell._layers[name].module() is module
    return shell._states[name] is fp8.layer_state(module)


#: the two shells, each fresh
SHELLS: dict[str, Callable[[], Any]] = {"Controller": Controller, "Guard": lambda: fp8.Guard(every=2)}


# scenarios: (shell, the first model a) -> (the call that brings the second, the module record "0" must hold
# after, or None)
def _two_attached(shell: Any, a: nn.Module) -> tuple:
    b = _net()
    shell.attach(b)
    return lambda: _forward(b, _policy(shell)), None


def _two_legacy(shell: Any, a: nn.Module) -> tuple:
    type(shell).detach(a)
    b = _net()
    return lambda: _forward(b, _policy(shell, legacy=True)), None


def _two_stepped(shell: Any, a: nn.Module) -> tuple:
    b = _net()
    _forward(b, Policy.parse("compute=bf16").fp8("tensorwise", first_last="fp8"))
    return lambda: shell.step(b), None


def _two_models_disjoint_names(shell: Any, a: nn.Module) -> tuple:
    b = _Blocks()  # ("blocks.0.0", "blocks.0.2": no name of a's)
    shell.attach(b)
    return lambda: _forward(b, _policy(shell)), a[0]


def _replaced_layer(shell: Any, a: nn.Module) -> tuple:
    a[0] = nn.Linear(32, 32)
    return lambda: _forward(a, _policy(shell)), a[0]


def _handed_over(shell: Any, a: nn.Module) -> tuple:
    b = _net()
    type(shell).detach(a)
    shell.attach(b)
    return lambda: _forward(b, _policy(shell)), b[0]


def _copy_with_its_own(shell: Any, a: nn.Module) -> tuple:
    b = copy.deepcopy(a)  # (the copy carries a copy of the shell)
    return lambda: _forward(b, _policy(shell)), a[0]


#: (shell, scenario, the error's words or None)
CASES = [
    ("Controller", _two_attached, "one Controller per model"),
    ("Controller", _two_legacy, "one Controller per model"),
    ("Controller", _two_models_disjoint_names, None),
    ("Controller", _replaced_layer, None),
    ("Controller", _handed_over, None),
    ("Controller", _copy_with_its_own, None),
    ("Guard", _two_attached, "one Guard per model"),
    ("Guard", _two_legacy, "one Guard per model"),
    ("Guard", _two_stepped, "one Guard per model"),
    ("Guard", _replaced_layer, None),
    ("Guard", _handed_over, None),
    ("Guard", _copy_with_its_own, None),
]


@pytest.mark.parametrize("shell_name,second,error", CASES,
                         ids=[f"{s}-{f.__name__.strip('_')}" for s, f, _ in CASES])
def test_a_second_model_under_the_same_names_is_refused(shell_name: str, second: Callable, error: str | None) -> None:
    warnings.simplefilter("ignore")
    a = _net()
    shell = SHELLS[shell_name]().attach(a)
    _forward(a, _policy(shell))
    call, holder = second(shell, a)
    if error is not None:
        with pytest.raises(ValueError, match=error):
            call()
        assert _holds(shell, "0", a[0])  # (a's records are kept)
        return
    call()
    if holder is not None:
        assert _holds(shell, "0", holder)


def test_a_new_model_after_the_old_one_is_gone_takes_over() -> None:
    warnings.simplefilter("ignore")
    a = _net()
    ctl = Controller()
    _forward(a, _policy(ctl, legacy=True))
    b = _net()
    b.load_state_dict(a.state_dict())
    del a
    _forward(b, _policy(ctl, legacy=True))
    assert _holds(ctl, "0", b[0])


def test_a_submodule_called_directly_reaches_the_models_records() -> None:
    warnings.simplefilter("ignore")
    m = _Blocks()
    ctl = Controller().attach(m)
    policy = _policy(ctl)
    _forward(m, policy)
    _forward(m.blocks[0], policy)  # (before: ValueError, no controller attached to Sequential)
    assert sorted(ctl._layers) == ["blocks.0.0", "blocks.0.2"]
    assert _holds(ctl, "blocks.0.0", m.blocks[0][0])
