"""Every ```python block of README.md and docs/*.md runs.

Each block runs in a fresh namespace, in a temporary folder, after :data:`PRELUDE`: the names that
fragments use without defining them (``model``, ``x``, ``batch``, ``loss_fn``, ``optimizer``...).
A complete example does not need it and redefines what it uses. Two explicit rules, no silent skips:

- a block that autocasts or scales on CUDA (``autocast("cuda"``, ``GradScaler("cuda"``) runs only
  where CUDA is available (skipped with that reason elsewhere);
- a block that trains the demo or a framework end to end is marked ``slow``.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

#: What documentation fragments may use without defining it.
PRELUDE = '''
import torch
from torch import nn
import mixprec
from mixprec import Policy

class Net(nn.Module):
    """A small model: a Linear body, a LayerNorm and an lm_head."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.norm, self.lm_head = nn.Linear(16, 16), nn.LayerNorm(16), nn.Linear(16, 4)

    def forward(self, x):
        return self.lm_head(self.norm(self.body(x)))

def loss_fn(model, batch):
    inputs, target = batch
    return nn.functional.cross_entropy(model(inputs), target)

model = Net()
x = torch.randn(8, 16)
batch = (x, torch.randint(0, 4, (8,)))
loader = [batch, batch]
optimizer = opt = torch.optim.SGD(model.parameters(), lr=0.1)
loss = loss_fn(model, batch)
torch.save({"model": Net().state_dict(), "optimizer": torch.optim.AdamW(Net().parameters()).state_dict()}, "fp32.pt")
'''

_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
_CUDA_ONLY = re.compile(r"""(autocast|GradScaler)\(\s*["']cuda["']""")
_SLOW = re.compile(r"mixprec\.demo|Trainer\(|\.fit\(|\.train\(\)")


def _blocks() -> list[pytest.param]:
    params = []
    for path in DOCS:
        text = path.read_text(encoding="utf-8")
        for match in _BLOCK.finditer(text):
            line = text[: match.start()].count("\n") + 1
            code = match.group(1)
            marks = []
            if _CUDA_ONLY.search(code):
                marks.append(pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA-only block"))
            if _SLOW.search(code):
                marks.append(pytest.mark.slow)
            params.append(pytest.param(code, id=f"{path.relative_to(ROOT)}:{line}", marks=marks))
    return params


def test_docs_have_python_blocks() -> None:
    assert len(_blocks()) >= 15


@pytest.mark.parametrize("code", _blocks())
def test_block_runs(code: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    if "accelerate" in sys.modules:  # Accelerate's process-wide state holds the last block's precision
        sys.modules["accelerate"].state.AcceleratorState._reset_state(True)
    namespace: dict = {"__name__": "__docs__"}
    exec(compile(PRELUDE, "<prelude>", "exec"), namespace)
    exec(compile(code, "<block>", "exec"), namespace)


def test_the_cuda_rule_is_explicit() -> None:
    assert _CUDA_ONLY.search('scaler = mixprec.GradScaler("cuda")')
    assert _CUDA_ONLY.search("with mixprec.autocast('cuda', dtype=torch.float16):")
    assert not _CUDA_ONLY.search('p = Policy.default("cuda")')  # a CUDA table runs on CPU tensors


def test_masterweights_bytes_per_parameter_as_docs_lowp_says() -> None:
    from mixprec.lowp import memory_bytes

    text = (ROOT / "docs" / "lowp.md").read_text(encoding="utf-8")
    assert "20 (14 after `zero_grad()`)" in text and "16 after it" in text
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))
    import mixprec

    mixprec.to_low_precision(model, torch.bfloat16)
    n = sum(p.numel() for p in model.parameters())
    opt = mixprec.MasterWeights(torch.optim.AdamW(model.parameters(), lr=1e-3))
    model(torch.randn(4, 32).bfloat16()).float().pow(2).mean().backward()
    opt.step()
    # + a 4-byte step counter per tensor in the AdamW state
    assert memory_bytes(model, opt)["total"] / n == pytest.approx(16, abs=0.01)
    opt.zero_grad()
    assert memory_bytes(model, opt)["total"] / n == pytest.approx(14, abs=0.01)
