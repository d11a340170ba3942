"""The layout of ``mixprec.scaling``, read from the source with ``ast``: modules of at most 600
lines, no function-level import of a mixprec module (how a cycle gets hidden), and the names
``mixprec.scaling.layerwise`` offered before it became a package still import from it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import mixprec.scaling
import mixprec.scaling.layerwise as layerwise

PACKAGE = Path(mixprec.scaling.__file__).resolve().parent
MODULES = sorted(PACKAGE.rglob("*.py"))


def test_the_package_is_found():
    names = {str(p.relative_to(PACKAGE)) for p in MODULES}
    assert {"grad_scaler.py", "unscaling.py", "layerwise/rule.py", "layerwise/scaler.py"} <= names


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_modules_are_at_most_600_lines(path):
    assert len(path.read_text().splitlines()) <= 600


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_function_level_import_of_a_mixprec_module(path):
    tree = ast.parse(path.read_text())
    nested = []
    for function in ast.walk(tree):
        if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(function):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("mixprec")):
                nested.append(node.lineno)
            elif isinstance(node, ast.Import) and any(a.name.startswith("mixprec") for a in node.names):
                nested.append(node.lineno)
    assert nested == []


def test_the_names_layerwise_offered_as_a_module_still_import_from_it():
    before = {
        "LayerState", "Layerwise", "Topology", "choose_cut_points", "clean_step", "layer_rule", "overflow_step",
        "host_rule", "pow2", "topology", "walk", "Walk", "DEFAULT_BOUNDS", "HEADROOM", "ZERO_JUMP", "HISTORY_LEN",
        "TOTAL_BOUND",
    }
    assert before <= set(layerwise.__all__)
    assert all(hasattr(layerwise, name) for name in before | {"_CutHook"})
