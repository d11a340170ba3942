"""What the audit tells a new user (issue 42.1): a progress line before every pass, the policy in
its shortest equivalent form (the full one a flag away), and that speed was not judged."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

import mixprec
from mixprec.diagnostics import audit
from mixprec.diagnostics._shortest import fp8_layers, kept_modules

WIDTH = 32


class Blow(nn.Module):
    """Overflows float16 inside, but its (normalised) output is small."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * 1e6
        return h / h.norm(dim=-1, keepdim=True)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(WIDTH, 2 * WIDTH), nn.Linear(2 * WIDTH, WIDTH)
        self.norm = Blow()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.norm(self.down(torch.relu(self.up(x))))


def make(blocks: int = 4) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), *[Block() for _ in range(blocks)], nn.Linear(WIDTH, WIDTH))


def loss_fn(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).float().square().mean()


def batch() -> torch.Tensor:
    return torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("steps", [1, 2])
def test_no_forward_of_the_model_runs_unannounced(steps: int) -> None:
    """Before: the float32 reference's two passes (ranges, then the gradients at the float16 loss
    scale) shared one line, 47 s of silence on a 4-layer Llama. Now each pass (each step of it)
    says what it is before it runs: between two lines the model runs at most one forward."""
    model = make(2)
    calls = [0]
    model.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    seen: list[tuple[int, str]] = []
    audit(model, batch(), loss_fn, steps=steps, fp8="auto", progress=lambda line: seen.append((calls[0], line)))
    counts = [c for c, _ in seen] + [calls[0]]
    assert all(b - a <= 1 for a, b in zip(counts, counts[1:])), seen
    lines = [line for _, line in seen]
    assert calls[0] >= len(lines) >= 2 * steps  # 1 line per forward
    assert any(line.startswith("float32 reference: gradients at the float16 loss scale") for line in lines)
    if steps == 2:
        assert "float32 reference: ranges and gradients (step 2 of 2)" in lines


def test_the_shortest_equivalent_form_and_the_full_one(tmp_path: Path) -> None:
    """Every Blow kept in float32, every Linear but the first and last in one fp8 format: the
    policy says so in a name pattern and fp8's own selection (before: two regexes of every name),
    decides exactly as the full form on the model, and the summary states the format once."""
    model = make(4)
    report = audit(model, batch(), loss_fn, dtypes=("float16",), fp8="auto")
    full = report.full_policy
    assert report.keep["float16"] == tuple(f"{i}.norm" for i in range(1, 5))
    assert str(report.policy) == ("params=float32,compute=float16; keep float32=/(?:^|\\.)norm$/; "
                                  "fp8 tensorwise=Linear except first/last")
    assert len(str(report.policy)) < len(str(full)) and "|" in str(full)
    assert kept_modules(model, report.policy) == kept_modules(model, full) == set(report.keep["float16"])
    assert fp8_layers(model, report.policy) == fp8_layers(model, full) == dict(report.fp8.recipes)
    assert len(report.fp8.layers) == 8
    text = report.summary_text()
    assert f"policy: {report.policy}" in text.splitlines()
    assert "fp8 (auto): tensorwise for all 8 layer(s)" in text and "'1.up' tensorwise" not in text
    assert "keep in float32: '1.norm', '2.norm', '3.norm', '4.norm'" in text
    assert "  stay '0', '5': first or last Linear" in text
    whole = report.summary_text(full=True)
    assert f"policy: {full}" in whole.splitlines() and "'1.up' tensorwise, '1.down' tensorwise" in whole
    assert "  stays '0': first or last" in whole and "shortest form" not in whole
    report.save(tmp_path)
    data = json.loads((tmp_path / "report.json").read_text())
    assert mixprec.Policy.load(tmp_path / "report.json") == report.policy
    assert mixprec.Policy.from_dict(data["policy_full"]) == full and data["policy_full_text"] == str(full)
    with mixprec.autocast("cpu", policy=report.policy):  # the short form runs clean too
        assert torch.isfinite(loss_fn(model, batch()))


def test_an_irregular_choice_keeps_exact_names() -> None:
    """Only the second block's norm overflows: no shorter rule selects it alone, so the
    names stay exact (the shortest form is never a different choice)."""
    model = make(3)
    with torch.no_grad():
        for i in (1, 3):
            model[i].norm = nn.Tanh()
    report = audit(model, batch(), loss_fn, dtypes=("float16",))
    assert report.keep["float16"] == ("2.norm",)
    (rule,) = report.policy.module_rules
    assert kept_modules(model, report.policy) == {"2.norm"} and rule.names == r"^(?:2\.norm)$"


def test_the_summary_says_speed_was_not_judged() -> None:
    """float16 is chosen on numerics (3 more mantissa bits); the summary says the audit timed
    nothing (before: a float16 recommendation on a CPU where fp16 ran 1.5-2.1x slower than fp32,
    with no word on speed)."""
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    report = audit(model, torch.randn(4, 8), lambda m, x: m(x).float().square().mean())
    assert report.dtype == "float16"
    text = report.summary_text()
    assert "speed: not measured; the audit judges numerics only" in text
    assert "faster" not in report.reason and "speed" not in report.reason
