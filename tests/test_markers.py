"""Every test that starts a process is marked ``slow`` (pyproject: "end-to-end or subprocess
tests"), so that ``-m "not slow"`` runs no subprocess.

Read from the source (AST), not by running anything: a test starts a process when its body, a
function or class it calls (of its module, of a shared helper module ``tests/**/_*.py``, or of a
``conftest.py`` above it), or a per-test fixture it takes by name uses ``subprocess.``, calls
a ``spawn(...)`` (ours from ``_distributed``, ``torch.multiprocessing``'s), ``get_context(...)``,
``Process(...)``, ``os.system`` or ``os.popen``. A module- or session-scoped fixture (an oracle
computed once in a fresh process, as ``torch_reference``) does not make each test that takes it a
process test. It is marked slow by a ``pytest.mark.slow`` decorator on it or its class (or an
alias such as ``slow = pytest.mark.slow``), or by its module's ``pytestmark``.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

_SPAWN_CALLS = frozenset({"spawn", "get_context", "Process", "system", "popen"})


def _direct_spawn(node: ast.AST) -> bool:
    """Whether ``node`` itself (not the functions it calls) starts a process."""
    for sub in ast.walk(node):
        if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id == "subprocess":
            return True
        if isinstance(sub, ast.Call):
            func = sub.func
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
            if name in ("system", "popen"):
                if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "os":
                    return True
            elif name in _SPAWN_CALLS:
                return True
    return False


def _called_names(node: ast.AST) -> set[str]:
    """The plain names ``node`` calls or refers to (``helper(...)``, ``Pool``, ``key=helper``)."""
    return {sub.id for sub in ast.walk(node) if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Load)}


def _definitions(tree: ast.Module) -> dict[str, ast.AST]:
    """The module-level functions and classes of ``tree`` by name."""
    return {node.name: node for node in tree.body
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}


def _imports(tree: ast.Module) -> dict[str, tuple[str, str]]:
    """``from module import name [as alias]`` at module level: alias -> (module, name)."""
    out = {}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                out[alias.asname or alias.name] = (node.module, alias.name)
    return out


def spawning_names(tree: ast.Module, known: dict[str, set[str]]) -> set[str]:
    """The module-level functions and classes of ``tree`` that start a process, directly or
    through one another or through a name imported from a module of ``known`` (module name ->
    its spawning names)."""
    defs = _definitions(tree)
    imported = {alias for alias, (module, name) in _imports(tree).items() if name in known.get(module, ())}
    spawning = {name for name, node in defs.items() if _direct_spawn(node)}
    changed = True
    while changed:
        changed = False
        for name, node in defs.items():
            if name not in spawning and _called_names(node) & (spawning | imported):
                spawning.add(name)
                changed = True
    return spawning | imported


def _is_slow_mark(node: ast.AST, aliases: frozenset[str] = frozenset()) -> bool:
    """``pytest.mark.slow`` or ``pytest.mark.slow(...)`` (or a module-level alias of it, as in
    ``slow = pytest.mark.slow``), or a list/tuple holding one."""
    if isinstance(node, (ast.List, ast.Tuple)):
        return any(_is_slow_mark(e, aliases) for e in node.elts)
    if isinstance(node, ast.Call):
        node = node.func
    if isinstance(node, ast.Name):
        return node.id in aliases
    return isinstance(node, ast.Attribute) and node.attr == "slow" and isinstance(
        node.value, ast.Attribute) and node.value.attr == "mark"


def _slow_aliases(tree: ast.Module) -> frozenset[str]:
    """Module-level names bound to ``pytest.mark.slow`` (``slow = ...``, ``slow, d = ..., ...``)."""
    names = set()
    for node in tree.body:
        if isinstance(node, ast.Assign):
            for target in node.targets:
                pairs = (zip(target.elts, node.value.elts) if isinstance(target, ast.Tuple)
                         and isinstance(node.value, ast.Tuple) else [(target, node.value)])
                names |= {t.id for t, v in pairs if isinstance(t, ast.Name) and _is_slow_mark(v)}
    return frozenset(names)


def _module_slow(tree: ast.Module, aliases: frozenset[str]) -> bool:
    return any(isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark"
                                                    for t in node.targets) and _is_slow_mark(node.value, aliases)
               for node in tree.body)


def shared_fixtures(tree: ast.Module) -> set[str]:
    """Fixtures of ``tree`` with a scope wider than a test (module, package, session): computed
    once and shared, they do not make each test that takes them a process test."""
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for d in node.decorator_list:
                if isinstance(d, ast.Call) and any(
                        k.arg == "scope" and isinstance(k.value, ast.Constant) and k.value.value != "function"
                        for k in d.keywords):
                    names.add(node.name)
    return names


def _tests(tree: ast.Module, aliases: frozenset[str]) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef, bool]]:
    """Each test function: its name (``Class::test``), node, and whether a decorator on it or
    its class marks it slow."""
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
            yield node.name, node, any(_is_slow_mark(d, aliases) for d in node.decorator_list)
        elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            cls_slow = any(_is_slow_mark(d, aliases) for d in node.decorator_list)
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name.startswith("test"):
                    slow = cls_slow or any(_is_slow_mark(d, aliases) for d in item.decorator_list)
                    yield f"{node.name}::{item.name}", item, slow


def unmarked(tree: ast.Module, known: dict[str, set[str]], fixtures: set[str] = frozenset()) -> list[str]:
    """The tests of ``tree`` that start a process and are not marked slow. ``known``: the
    spawning names of importable helper modules; ``fixtures``: names of spawning fixtures from
    conftest files."""
    aliases = _slow_aliases(tree)
    if _module_slow(tree, aliases):
        return []
    spawning = spawning_names(tree, known)
    per_test = (spawning - shared_fixtures(tree)) | set(fixtures)
    out = []
    for name, node, slow in _tests(tree, aliases):
        args = {a.arg for a in [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]}
        if not slow and (_direct_spawn(node) or (_called_names(node) - args) & spawning or args & per_test):
            out.append(name)
    return out


def _parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def _helper_spawning(files: Iterable[Path]) -> dict[str, set[str]]:
    """Spawning names of the shared helper modules (``_*.py``), by module name; helpers that
    import one another are resolved by iterating to a fixed point."""
    trees = {path.stem: _parse(path) for path in files}
    known: dict[str, set[str]] = {name: set() for name in trees}
    changed = True
    while changed:
        changed = False
        for name, tree in trees.items():
            found = spawning_names(tree, known)
            if found != known[name]:
                known[name] = found
                changed = True
    return known


def _conftest_spawning(test_file: Path, known: dict[str, set[str]]) -> set[str]:
    names: set[str] = set()
    for folder in [test_file.parent, *test_file.parent.parents]:
        conftest = folder / "conftest.py"
        if conftest.exists():
            tree = _parse(conftest)
            names |= spawning_names(tree, known) - shared_fixtures(tree)
        if folder == TESTS:
            break
    return names


def test_every_test_that_starts_a_process_is_marked_slow() -> None:
    known = _helper_spawning(sorted(TESTS.rglob("_*.py")))
    assert "spawn" in known["_distributed"] and "RankPool" in known["_adv_ranks"]  # the walk sees them
    offenders = []
    files = sorted(TESTS.rglob("test_*.py"))
    assert len(files) > 80  # the whole tree, folders included
    for path in files:
        bad = unmarked(_parse(path), known, _conftest_spawning(path, known))
        offenders += [f"{path.relative_to(TESTS.parent)}::{name}" for name in bad]
    assert not offenders, "start a process but are not marked @pytest.mark.slow:\n" + "\n".join(offenders)


_SOURCE = '''
import subprocess
import pytest
from _distributed import spawn
from _helpers import start_ranks

def _python(code):
    return subprocess.run(["python", "-c", code]).stdout

def _twice(code):
    return _python(code) + _python(code)

@pytest.fixture
def server():
    yield subprocess.Popen(["sleep", "1"])

def test_direct():
    subprocess.run(["true"])

def test_through_helpers():
    _twice("pass")

def test_ranks():
    spawn(print)

def test_fixture(server):
    pass

def test_imported_helper():
    start_ranks()

def test_plain():
    assert 1 + 1 == 2

slow = pytest.mark.slow

@pytest.fixture(scope="module")
def oracle():
    return subprocess.run(["true"])

def test_shared_oracle(oracle):
    assert oracle

@slow
def test_alias():
    subprocess.run(["true"])

@pytest.mark.slow
def test_marked():
    subprocess.run(["true"])

@pytest.mark.slow
class TestMarked:
    def test_in_class(self):
        _python("pass")

class TestPlain:
    def test_in_class(self):
        _python("pass")
'''


def test_the_check_finds_unmarked_process_tests_and_accepts_marked_ones() -> None:
    known = {"_helpers": {"start_ranks"}}
    tree = ast.parse(_SOURCE)
    assert unmarked(tree, known) == ["test_direct", "test_through_helpers", "test_ranks", "test_fixture",
                                     "test_imported_helper", "TestPlain::test_in_class"]
    marked = ast.parse("import pytest\npytestmark = [pytest.mark.distributed, pytest.mark.slow]\n" + _SOURCE)
    assert unmarked(marked, known) == []
    # a helper module's function starts a process only if the helper's walk says so
    assert "test_imported_helper" not in unmarked(tree, {"_helpers": set()})


@pytest.mark.parametrize("code,expected", [
    ("import os\ndef test_a():\n    os.system('true')\n", ["test_a"]),
    ("import torch.multiprocessing as mp\ndef test_a():\n    mp.spawn(print, nprocs=2)\n", ["test_a"]),
    ("import multiprocessing\ndef test_a():\n    multiprocessing.get_context('spawn').Process(target=print)\n", ["test_a"]),
    ("import os\ndef test_a():\n    os.path.join('a', 'b')\n", []),
])
def test_the_check_knows_each_way_of_starting_a_process(code: str, expected: list[str]) -> None:
    assert unmarked(ast.parse(code), {}) == expected
