"""Every ```python block of README.md and docs/*.md runs as written, or says it is a fragment.

Each block runs in a fresh, empty namespace, in a temporary folder: it imports and defines what
it uses. Three explicit rules, no silent skips:

- a block whose first line is ``# fragment: ...`` (saying what it takes from the reader: "your
  model, loss_fn and batch") is part of a training loop the reader has; it is compiled (syntax),
  not run;
- a block that autocasts or scales on CUDA (``autocast("cuda"``, ``GradScaler("cuda"``) runs only
  where CUDA is available (skipped with that reason elsewhere);
- a block that trains the demo or a framework end to end is marked ``slow``.

Install commands must work from a checkout: mixprec is not on a package index, so
``pip install 'mixprec[...]'`` is refused in favour of ``pip install -e '.[...]'``.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
_FRAGMENT = re.compile(r"\A# fragment: \S")
_CUDA_ONLY = re.compile(r"""(autocast|GradScaler)\(\s*["']cuda["']""")
_SLOW = re.compile(r"mixprec\.demo|Trainer\(|\.fit\(|\.train\(\)")
_INDEX_INSTALL = re.compile(r"pip install\s+(?:-U\s+)?['\"]?mixprec\b")


def _blocks() -> list[tuple[str, str]]:
    """``(id, code)`` of every python block: ``README.md:LINE``."""
    out = []
    for path in DOCS:
        text = path.read_text(encoding="utf-8")
        for match in _BLOCK.finditer(text):
            line = text[: match.start()].count("\n") + 1
            out.append((f"{path.relative_to(ROOT)}:{line}", match.group(1)))
    return out


def _runnable() -> list[pytest.param]:
    params = []
    for name, code in _blocks():
        if _FRAGMENT.match(code):
            continue
        marks = []
        if _CUDA_ONLY.search(code):
            marks += [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA-only block")]
        if _SLOW.search(code):
            marks.append(pytest.mark.slow)
        params.append(pytest.param(code, id=name, marks=marks))
    return params


def test_docs_have_python_blocks() -> None:
    assert len(_blocks()) >= 15 and len(_runnable()) >= 15


@pytest.mark.parametrize("code", _runnable())
def test_block_runs_as_written(code: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    if "accelerate" in sys.modules:  # Accelerate's process-wide state holds the last block's precision
        sys.modules["accelerate"].state.AcceleratorState._reset_state(True)
    exec(compile(code, "<block>", "exec"), {"__name__": "__docs__"})


@pytest.mark.parametrize("name, code", [(n, c) for n, c in _blocks() if _FRAGMENT.match(c)])
def test_fragment_compiles(name: str, code: str) -> None:
    compile(code, name, "exec")


def test_the_rules_are_explicit() -> None:
    assert _CUDA_ONLY.search('scaler = mixprec.GradScaler("cuda")')
    assert _CUDA_ONLY.search("with mixprec.autocast('cuda', dtype=torch.float16):")
    assert not _CUDA_ONLY.search('p = Policy.default("cuda")')  # a CUDA table runs on CPU tensors
    assert _FRAGMENT.match("# fragment: your model and optimizer\nx = 1\n")
    assert not _FRAGMENT.match("import torch\n# fragment: too late\n")


def test_install_commands_work_from_a_checkout() -> None:
    for path in [*DOCS, *sorted((ROOT / "src" / "mixprec" / "demo").glob("*.py")), ROOT / "src" / "mixprec" / "cli.py"]:
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            assert not _INDEX_INSTALL.search(line), f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
    assert _INDEX_INSTALL.search("pip install 'mixprec[report]'") and not _INDEX_INSTALL.search("pip install -e '.[report]'")


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
