"""Diagnostics on a wrapped model name modules as mixprec's rules match them (the bare model's
names, without DataParallel's/DDP's ``module.`` or torch.compile's ``_orig_mod.``): the audit's
policy keeps the culprit when used with that same wrapped model, and trace_nonfinite, the range
collector and the audit's module table name the same layers as for the bare model."""

from __future__ import annotations

import warnings
from typing import Any, Callable

import pytest
import torch
from torch import nn

import mixprec
from mixprec.diagnostics import collect_ranges, trace_nonfinite


class Attention(nn.Module):
    """Scores that overflow float16 (docs/diagnostics.md's example)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.q, self.k = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.q(x) @ self.k(x).transpose(-1, -2) * 1e5
        return torch.softmax(s, -1) @ x


class Blow(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 1e39


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 16), Attention(16), nn.Linear(16, 4))


#: how the model is wrapped: (case id, wrap)
WRAPS: tuple[tuple[str, Callable[[nn.Module], nn.Module]], ...] = (
    ("plain", lambda m: m),
    ("data_parallel", nn.DataParallel),  # on CPU: forwards to .module
    ("compile", lambda m: torch.compile(m, backend="eager")),
)


def _loss(m: nn.Module, b: Any) -> torch.Tensor:
    return nn.functional.mse_loss(m(b[0]).float(), b[1])


def _audit(wrap: Callable[[nn.Module], nn.Module]) -> tuple[nn.Module, Any, Any, list[str]]:
    model = wrap(_model())
    batch = (torch.randn(8, 16), torch.randn(8, 4))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        report = mixprec.audit(model, batch, _loss, dtypes=(torch.float16,))
        with mixprec.autocast("cpu", policy=report.full_policy):
            loss = _loss(model, batch)
    mine = [str(w.message) for w in seen if "mixprec" in str(w.message)]
    assert torch.isfinite(loss), loss
    return model, batch, report, mine


def test_the_audit_of_a_wrapped_model_recommends_the_bare_models_policy() -> None:
    results = {case: _audit(wrap) for case, wrap in WRAPS}
    for case, (_, _, report, mine) in results.items():
        assert str(report.full_policy.module_rules[0].names) == "^(?:1)$", case
        assert report.verified == {"float16": True}, (case, report.reason)
        assert report.keep == {"float16": ("1",)}, case
        assert "module." not in str(report) and "_orig_mod" not in str(report), case
        assert not [w for w in mine if "selected no module" in w], (case, mine)
        assert "module" not in report.modules and "_orig_mod" not in report.modules, case
        assert set(report.modules) == {"", "0", "1", "1.q", "1.k", "2"}, case
    plain = results["plain"][2]
    for case, (_, _, report, _) in results.items():
        assert (str(report.policy), str(report.full_policy)) == (str(plain.policy), str(plain.full_policy)), case


@pytest.mark.parametrize("deferred", [False, True], ids=["eager", "deferred"])
def test_trace_nonfinite_names_the_layer_a_policy_would_match(deferred: bool) -> None:
    named = {}
    for case, wrap in WRAPS:
        inner = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), Blow(), nn.Linear(8, 8))
        model = wrap(inner)
        with trace_nonfinite(model, deferred=deferred) as tracer:
            model(torch.randn(2, 8)).sum().backward()
            tracer.resolve()
        ev = tracer.first
        assert ev is not None, case
        named[case] = (ev.module, ev.module_type, ev.phase, ev.tensor)
        for m in inner.modules():  # the hooks are gone
            assert not m._forward_hooks and not m._forward_pre_hooks, case
    assert set(named.values()) == {("2", "Blow", "forward", "output")}, named


def test_collected_ranges_are_named_as_in_the_bare_model() -> None:
    for case, wrap in WRAPS:
        model = wrap(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)))
        with collect_ranges(model) as rc:
            model(torch.randn(2, 8)).sum().backward()
        assert list(rc.results()) == ["", "0", "1", "2"], case
