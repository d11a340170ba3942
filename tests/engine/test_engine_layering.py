"""The engine's layering, read from the source: module-level imports only, each engine module
importing only the ones below it, fp8 reached through ``mixprec.fp8`` alone and never the other way."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import mixprec

SRC = Path(mixprec.__file__).parent
# bottom to top: a module may import only those before it
ENGINE = ["dynamo", "runtime", "watch", "casts", "kernels", "compile", "module_calls", "region"]


def _imports(path: Path) -> list[tuple[str, int, bool]]:
    """``(module imported, line, at module level)`` of each ``mixprec`` import in ``path``."""
    tree = ast.parse(path.read_text())
    top = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("mixprec"):
            names = [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names if a.name.startswith("mixprec")]
        else:
            continue
        found += [(name, node.lineno, id(node) in top) for name in names]
    return found


def _engine_files() -> list[Path]:
    return sorted((SRC / "engine").glob("*.py")) + [SRC / "fp8" / "_target.py"]


@pytest.mark.parametrize("path", _engine_files(), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_no_function_level_mixprec_imports(path):
    inner = [(name, line) for name, line, top in _imports(path) if not top]
    assert not inner, f"{path.name}: function-level imports {inner}"


@pytest.mark.parametrize("name", ENGINE)
def test_engine_modules_import_only_the_layers_below(name):
    below = set(ENGINE[: ENGINE.index(name)])
    for imported, line, _ in _imports(SRC / "engine" / f"{name}.py"):
        parts = imported.split(".")
        if parts[:2] == ["mixprec", "engine"] and len(parts) > 2:
            assert parts[2] in below, f"engine/{name}.py:{line} imports {imported} (not below it)"
        assert not (parts[:2] == ["mixprec", "fp8"] and len(parts) > 2 and parts[2].startswith("_")), (
            f"engine/{name}.py:{line} imports fp8's private {imported}: use mixprec.fp8's names")


def test_fp8_never_imports_the_engine():
    for path in sorted((SRC / "fp8").glob("*.py")):
        for imported, line, _ in _imports(path):
            assert not imported.startswith("mixprec.engine"), f"fp8/{path.name}:{line}: {imported}"


def test_the_native_build_sits_below_the_values():
    """``_native.py`` builds the C++ extension that the engine, fp8's casts and the optimizers use:
    it imports nothing of mixprec but the op data."""
    imported = {name for name, _, _ in _imports(SRC / "_native.py") if name.startswith("mixprec")}
    assert all(name.startswith("mixprec.ops.") for name in imported), imported


def test_the_seam_names_are_exported_by_fp8_internals():
    from mixprec import fp8
    from mixprec.fp8 import internals

    assert {"Fp8Target", "select_targets", "traced_output"} <= set(internals.__all__)
    assert not {"Fp8Target", "select_targets", "traced_output"} & set(fp8.__all__)  # the engine's, not users'
