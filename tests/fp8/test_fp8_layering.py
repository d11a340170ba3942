"""Import layering, read from the source with ``ast`` (nothing is imported).

* fp8, optim, diagnostics and export import mixprec modules at module level only: a
  function-level ``import mixprec...`` is how an import cycle gets hidden. Lazy imports stay
  allowed for heavy optional third-party packages (torchao, transformers, safetensors), never
  for our own modules; ``if TYPE_CHECKING:`` imports are for type checkers only and allowed.
* No import cycle among mixprec's modules (module-level imports, the whole package).
* Other packages reach fp8 through ``mixprec.fp8`` or its seam ``mixprec.fp8.internals``,
  never through a private ``mixprec.fp8._*`` module.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import mixprec

SRC = Path(mixprec.__file__).resolve().parent.parent
CHECKED = ("mixprec.fp8", "mixprec.optim", "mixprec.diagnostics", "mixprec.export")
#: packages that may import fp8's private modules besides fp8 itself
FP8_PRIVATE_OK = ("mixprec.fp8",)


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted((SRC / "mixprec").rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _in(name: str, packages: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _targets(name: str, package: bool, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The modules an import statement of module ``name`` (``package``: an ``__init__``) loads
    (``from pkg import sub``: the submodule; ``from mod import obj``: the module)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = node.module or ""
    if node.level:
        parts = name.split(".") if package else name.split(".")[:-1]
        parts = parts[:len(parts) - node.level + 1]
        base = ".".join(parts + ([node.module] if node.module else []))
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]


def _parse(source: str, name: str, package: bool = False) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """``(module level, nested)``: the mixprec modules the source of module ``name`` imports, with
    line numbers. Module level includes a top-level ``try``/``if`` (it runs at import); nested is
    inside a function or class; ``if TYPE_CHECKING:`` blocks are left out."""
    top: list[tuple[str, int]] = []
    nested: list[tuple[str, int]] = []

    def walk(node: ast.AST, level: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                for target in _targets(name, package, child):
                    if target.split(".")[0] == "mixprec":
                        (top if level else nested).append((target, child.lineno))
            elif isinstance(child, ast.If) and _is_type_checking(child):
                continue
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
                walk(child, False)
            else:
                walk(child, level)

    walk(ast.parse(source), True)
    return top, nested


def _imports(name: str) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    path = MODULES[name]
    return _parse(path.read_text(), name, path.name == "__init__.py")


def _graph() -> dict[str, set[str]]:
    return {name: {t for t, _ in _imports(name)[0] if t in MODULES and t != name} for name in MODULES}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


@pytest.mark.parametrize("package", CHECKED)
def test_no_function_level_import_of_mixprec(package):
    bad = [f"{name}:{line} imports {target}" for name in MODULES if _in(name, (package,))
           for target, line in _imports(name)[1]]
    assert not bad, "function-level imports of mixprec modules (import at the top; move the shared piece " \
                    "to the lower module if it is a cycle):\n" + "\n".join(bad)


def test_no_import_cycle_among_mixprec_modules():
    assert not _cycles(_graph())


def test_fp8_private_modules_stay_inside_fp8():
    bad = [f"{name}:{line} imports {target}" for name in MODULES if _in(name, CHECKED)
           and not _in(name, FP8_PRIVATE_OK)
           for target, line in sum(_imports(name), []) if target.startswith("mixprec.fp8._")]
    assert not bad, "use mixprec.fp8 or mixprec.fp8.internals:\n" + "\n".join(bad)


def test_the_checks_see_a_cycle_and_a_nested_import():
    """The checks themselves, on made-up input: a cycle and a function-level import are found,
    a top-level ``try`` counts as module level, ``TYPE_CHECKING`` and third-party imports not at all."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set(), "c": {"b"}}) == []
    source = ("import torch\nimport mixprec.fp8\nif TYPE_CHECKING:\n    from mixprec.policy import Policy\n"
              "try:\n    from . import _quant\nexcept ImportError:\n    pass\n"
              "def f():\n    import transformers\n    from mixprec.formats._state import OPERANDS\n")
    top, nested = _parse(source, "mixprec.fp8._x")
    assert top == [("mixprec.fp8", 2), ("mixprec.formats._quant", 6)]
    assert nested == [("mixprec.formats._state", 11)]
