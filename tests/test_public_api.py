"""The public surface: every exported name resolves, nothing private leaks, the import is light."""

from __future__ import annotations

import subprocess
import sys

import pytest

import mixprec

CONTRACT = [
    "autocast", "is_autocast_enabled", "get_autocast_dtype", "custom_fwd", "custom_bwd", "Policy",
    "GradScaler", "skip_aware", "to_low_precision", "MasterWeights", "optim",
    "trace_nonfinite", "collect_ranges", "audit", "AuditReport", "DeviceTypeError",
]


@pytest.mark.parametrize("name", CONTRACT)
def test_contract_names_exist(name):
    assert name in mixprec.__all__
    assert getattr(mixprec, name) is not None


def test_all_is_public_and_resolves():
    for name in mixprec.__all__:
        assert not name.startswith("_")
        getattr(mixprec, name)
    assert set(mixprec.__all__) <= set(dir(mixprec))
    with pytest.raises(AttributeError, match="no attribute"):
        mixprec.does_not_exist  # noqa: B018


def test_optim_names():
    assert {"AdamW", "SGD"} <= set(mixprec.optim.__all__)


@pytest.mark.slow
def test_import_is_light():
    # tqdm is left out: torch itself imports it (torch.hub)
    code = ("import sys, mixprec; mixprec.autocast; mixprec.GradScaler; mixprec.Policy;"
            "mixprec.MasterWeights; mixprec.optim.AdamW; mixprec.trace_nonfinite;"
            "print(sorted(m for m in ('matplotlib', 'rich', 'tensorboard', 'hypothesis', 'numpy.testing')"
            " if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_dir_lists_the_public_surface_only():
    """``dir(mixprec)``: ``__all__``, the public submodules and dunders (before: ``Any``,
    ``TYPE_CHECKING``, ``annotations``, ``importlib`` and every private module loaded so far)."""
    with mixprec.autocast("cpu"):  # loads private modules (mixprec.engine, ...)
        pass
    names = [n for n in dir(mixprec) if not (n.startswith("__") and n.endswith("__"))]
    assert not {"Any", "TYPE_CHECKING", "annotations", "importlib"} & set(names)
    assert set(names) == set(mixprec.__all__) | set(mixprec._SUBMODULES)
    assert not [n for n in names if n.startswith("_")]


_COMPILE_IMPORTS = """
import sys, torch, mixprec
with mixprec.autocast("cpu"):
    torch.ones(2, 2) @ torch.ones(2, 2)
with mixprec.autocast("cpu", policy=mixprec.Policy().with_ops(fp32=["softmax"])):
    torch.softmax(torch.ones(2), 0)
before = sorted(m for m in ("torch._dynamo", "sympy") if m in sys.modules)
from mixprec.engine import module_calls, region
assert not hasattr(module_calls._pre_eager, "_torchdynamo_disable")
torch.compile(lambda x: x * 2, backend="eager")(torch.ones(2))  # Dynamo now: the decorators apply
marks = [getattr(f, "_torchdynamo_disable", False) for f in (module_calls._pre_eager, module_calls._post_eager,
         region._enter_eagerly, region._exit_eagerly)]
marks += [getattr(f, "_dynamo_marked_constant", False) for f in (module_calls.traced_region,
          module_calls.traced_without_fullgraph, region._traced_region, region._traced_eagerly)]
print(before, marks)
"""


@pytest.mark.slow
def test_autocast_leaves_dynamo_and_sympy_unimported_until_compile():
    """First use of ``mixprec.autocast`` imported ``torch._dynamo`` and sympy (about 3 s of CPU,
    as much as torch itself) for its ``torch.compiler`` decorators: now they are applied when
    Dynamo is imported, before anything can be compiled."""
    out = subprocess.run([sys.executable, "-c", _COMPILE_IMPORTS], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[] " + str([True] * 8)
