"""The mutant list of ``python -m scripts.mutants`` (docs/mutants.md) stays applicable: every
mutant's original text occurs exactly once in the current source, its mapped tests exist, and
the list covers what issue 40 asks (25 or more mutants, every area, its five planted defects).
The mutants themselves run only under that command, not here."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _catalog():
    spec = importlib.util.spec_from_file_location("_mutants_catalog", ROOT / "scripts" / "mutants" / "catalog.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (dataclasses resolve the module by name)
    spec.loader.exec_module(module)
    return module


catalog = _catalog()
MUTANTS = catalog.load()


@pytest.mark.parametrize("mutant", MUTANTS, ids=[m.id for m in MUTANTS])
def test_each_mutant_applies_to_the_current_source(mutant) -> None:
    text = (ROOT / mutant.file).read_text(encoding="utf-8")
    mutated = catalog.mutate(text, mutant)  # raises MutantRotted unless the original occurs exactly once
    assert mutated != text
    if mutant.file.endswith(".py"):  # (a C++ mutant is compiled by the kernels' build when it runs)
        compile(mutated, mutant.file, "exec")  # the mutant is a defect, not a syntax error
    for node in (*mutant.harness, *mutant.package):
        path = ROOT / node.split("::")[0]
        assert path.is_file(), f"mutant {mutant.id!r} maps to {node!r}, which does not exist"
        if "::" in node:
            assert f"def {node.split('::')[1].split('[')[0]}(" in path.read_text(encoding="utf-8"), node
    assert all(n.startswith("tests/adversarial/") for n in mutant.harness)
    assert not any(n.startswith("tests/adversarial/") for n in mutant.package)


def test_the_list_covers_the_issue() -> None:
    assert len(MUTANTS) >= 25
    assert {m.area for m in MUTANTS} == set(catalog.AREAS)
    planted = {m.id for m in MUTANTS if m.issue == 40}
    assert planted == {"layerwise-skipped-block-factor", "agreement-header-compares-count",
                       "controller-state-drops-gemm-clean", "nvfp4-rounding-ignores-step",
                       "export-nvfp4-input-scale-ignores-margin"}
    assert all(m.package for m in MUTANTS), "every mutant maps to tests of the default run"


def test_a_rotted_mutant_fails_loudly() -> None:
    m = MUTANTS[0]
    with pytest.raises(catalog.MutantRotted, match="occurs 0 times"):
        catalog.mutate("nothing here", m)
    with pytest.raises(catalog.MutantRotted, match="occurs 2 times"):
        catalog.mutate(m.original + m.original, m)
