"""The package's layering, read from the source with ``ast`` (nothing is imported): one table of
layers as data, bottom to top, and the rules every module of ``src/mixprec`` is checked against.

* Each module belongs to exactly one layer; it imports (at module level) only its own layer or
  those below; inside the engine, each module only the ones before it.
* No import cycle; no function-level import of a mixprec module outside ``cli.py`` and ``demo/``
  (how a cycle gets hidden); ``if TYPE_CHECKING:`` imports are for type checkers and allowed.
* The rooms: the formats import nothing of control, policy or engine; control only the formats;
  the policy value reaches control only for the settings values (``control._settings``), so
  ``from mixprec import Policy`` loads no Guard or Controller module. Above the policy, the formats
  and control are reached only through ``mixprec.fp8`` and its seam ``mixprec.fp8.internals``.
* No reach-in (``ctl._x``, ``owner._x``) and no function of control taking the whole controller;
  one writer of a layer's routing state (``LayerState.route``).
* Sizes: no module in src over 600 lines, none of the three rooms over 450, the controller's
  shell at most 350.
* docs/architecture.md's table names the same layers, in the same order, with the same modules.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import mixprec

SRC = Path(mixprec.__file__).resolve().parent.parent
DOCS = SRC.parent / "docs" / "architecture.md"

#: bottom to top: (layer, its packages and top-level modules, relative to ``mixprec``; "" is ``mixprec`` itself)
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("op data", ("ops", "_ops_names")),
    ("leaves", ("_tree", "_modules", "_moved", "_paths", "_quiet", "_scaled", "_dtype_names", "_groups", "")),
    ("native build", ("_native",)),
    ("formats", ("formats",)),
    ("control", ("control",)),
    ("policy", ("policy",)),
    ("seam", ("fp8",)),
    ("engine", ("engine",)),
    ("scaling", ("scaling", "_unscale")),
    ("low precision", ("lowp", "optim")),
    ("tools", ("diagnostics", "export", "integrations")),
    ("front ends", ("cli", "__main__", "demo")),
)
#: inside a layer, a module may import only those before it
ORDER_WITHIN = {"engine": ("dynamo", "runtime", "watch", "casts", "kernels", "compile", "module_decision", "module_calls", "region")}
#: the only modules of control the policy value may import (values, no state machine)
POLICY_REACHES = ("mixprec.control._settings",)
#: packages reached from above the seam only through it
SEALED = ("mixprec.formats", "mixprec.control")
#: functions of control's public API that take a live Guard or Controller from the user
PUBLIC_TAKERS = ("convert",)
#: where function-level mixprec imports are allowed (front ends load their parts on demand)
LAZY_OK = ("mixprec.cli", "mixprec.demo")
#: the largest modules allowed
MAX_LINES, ROOM_LINES, SHELL_LINES = 600, 450, 350
ROOMS = ("mixprec.formats", "mixprec.control", "mixprec.policy")
SHELL = "mixprec.control._controller"


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


def _entry(name: str) -> str:
    """The entry of :data:`LAYERS` that module ``name`` belongs to (its first part under mixprec)."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else ""


def layer_of(name: str) -> int:
    """The index in :data:`LAYERS` of module ``name``'s layer (KeyError: in none)."""
    found = [i for i, (_, entries) in enumerate(LAYERS) if _entry(name) in entries]
    if len(found) != 1:
        raise KeyError(f"{name} is in {len(found)} layers of the table")
    return found[0]


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _targets(name: str, package: bool, node: ast.Import | ast.ImportFrom, modules: dict) -> list[str]:
    """The modules an import statement of module ``name`` (``package``: an ``__init__``) loads
    (``from pkg import sub``: the submodule; ``from mod import obj``: the module)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = node.module or ""
    if node.level:
        parts = name.split(".") if package else name.split(".")[:-1]
        parts = parts[:len(parts) - node.level + 1]
        base = ".".join(parts + ([node.module] if node.module else []))
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]


def parse_imports(source: str, name: str, package: bool = False, modules: dict | None = None
                  ) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """``(module level, nested)``: the mixprec modules the source of module ``name`` imports, with
    line numbers. Module level includes a top-level ``try``/``if`` (it runs at import); nested is
    inside a function or class; ``if TYPE_CHECKING:`` blocks are left out."""
    modules = MODULES if modules is None else modules
    top: list[tuple[str, int]] = []
    nested: list[tuple[str, int]] = []

    def walk(node: ast.AST, level: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                for target in _targets(name, package, child, modules):
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
    return parse_imports(path.read_text(), name, path.name == "__init__.py")


def _graph() -> dict[str, set[str]]:
    return {name: {t for t, _ in _imports(name)[0] if t in MODULES and t != name} for name in MODULES}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
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


def closure(name: str, graph: dict[str, set[str]]) -> set[str]:
    """Every module importing ``name`` loads (module-level imports, transitively; parents too)."""
    seen, todo = set(), [name]
    while todo:
        mod = todo.pop()
        if mod in seen or mod not in graph:
            continue
        seen.add(mod)
        parts = mod.split(".")
        todo.extend(".".join(parts[:i]) for i in range(1, len(parts)))  # a submodule's packages run first
        todo.extend(graph[mod])
    return seen


# ------------------------------------------------------------------ the table itself
def test_every_module_is_in_exactly_one_layer():
    missing = []
    for name in MODULES:
        try:
            layer_of(name)
        except KeyError as e:
            missing.append(str(e))
    assert not missing, "add each to one layer of LAYERS (and to docs/architecture.md):\n" + "\n".join(missing)
    listed = {e for _, entries in LAYERS for e in entries}
    present = {_entry(n) for n in MODULES}
    assert listed <= present | {"_dtype_names"}, f"LAYERS names modules that do not exist: {listed - present}"


def test_each_module_imports_only_its_layer_and_those_below():
    bad = []
    for name in MODULES:
        mine = layer_of(name)
        for target, line in _imports(name)[0]:
            if target in MODULES and layer_of(target) > mine:
                bad.append(f"{name}:{line} ({LAYERS[mine][0]}) imports {target} ({LAYERS[layer_of(target)][0]})")
    assert not bad, "imports from a higher layer (move the shared piece down):\n" + "\n".join(bad)


@pytest.mark.parametrize("package", sorted(ORDER_WITHIN))
def test_modules_inside_a_layer_import_only_those_before_them(package):
    order = ORDER_WITHIN[package]
    bad = []
    for i, module in enumerate(order):
        for target, line in _imports(f"mixprec.{package}.{module}")[0]:
            parts = target.split(".")
            if parts[:2] == ["mixprec", package] and len(parts) > 2 and parts[2] not in order[:i]:
                bad.append(f"{package}/{module}.py:{line} imports {target}")
    assert not bad and set(order) == {n.split(".")[-1] for n in MODULES if n.startswith(f"mixprec.{package}.")}, bad


def test_no_import_cycle_among_mixprec_modules():
    assert not cycles(_graph())


def test_no_function_level_import_of_mixprec_outside_the_front_ends():
    bad = [f"{name}:{line} imports {target}" for name in MODULES if not _in(name, LAZY_OK)
           for target, line in _imports(name)[1]]
    assert not bad, "function-level imports of mixprec modules (import at the top; move the shared piece " \
                    "to the lower module if it is a cycle):\n" + "\n".join(bad)


# ------------------------------------------------------------------ the rooms
def test_the_policy_reaches_control_only_for_its_settings():
    bad = [f"{name}:{line} imports {target}" for name in MODULES if _in(name, ("mixprec.policy",))
           for target, line in _imports(name)[0] if _in(target, ("mixprec.control",)) and target not in POLICY_REACHES]
    assert not bad, "\n".join(bad)


def test_importing_the_policy_loads_no_guard_or_controller():
    loaded = closure("mixprec.policy", _graph())
    assert not loaded & {"mixprec.control._guard", "mixprec.control._controller", "mixprec.control._ladder",
                         "mixprec.control._decide", "mixprec.engine.region"}, sorted(loaded)
    assert "mixprec.control._settings" in loaded


def test_above_the_seam_formats_and_control_are_reached_through_fp8():
    seam = layer_of("mixprec.fp8")
    bad = [f"{name}:{line} imports {target}" for name in MODULES if layer_of(name) > seam
           for target, line in sum(_imports(name), []) if _in(target, SEALED)]
    assert not bad, "use mixprec.fp8 or mixprec.fp8.internals:\n" + "\n".join(bad)


_REACH_IN = re.compile(r"\b(?:ctl|owner|controller|guard)\._[a-z]\w*")


def test_no_reach_into_a_guard_or_controller_and_no_function_takes_one():
    bad = []
    for name, path in MODULES.items():
        text = path.read_text()
        bad += [f"{name}:{text[:m.start()].count(chr(10)) + 1}: {m.group()}" for m in _REACH_IN.finditer(text)]
        if not _in(name, ("mixprec.control",)):
            continue
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name not in PUBLIC_TAKERS:
                for arg in node.args.args + node.args.kwonlyargs:
                    note = ast.unparse(arg.annotation) if arg.annotation is not None else ""
                    if arg.arg in ("ctl", "owner") or re.search(r"\b(Controller|Guard)\b", note):
                        bad.append(f"{name}:{node.lineno}: {node.name}({arg.arg}: {note})")
    assert not bad, "pass the values a function needs (settings, a Check, a record), not the object:\n" + \
                    "\n".join(bad)


def test_one_writer_of_a_layers_routing_state():
    bad = []
    for name, path in MODULES.items():
        if name == "mixprec.formats._state":
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#")[0]
            if re.search(r"\b(?:st|state|rec\.state)\.(?:fallback|recipe)\b\s*(?:,[\w. ]*)?=(?!=)", code):
                bad.append(f"{name}:{i}: {line.strip()}")
    assert not bad, "route a layer through LayerState.route:\n" + "\n".join(bad)


# ------------------------------------------------------------------ sizes
def test_module_sizes():
    bad = []
    for name, path in MODULES.items():
        lines = len(path.read_text().splitlines())
        limit = SHELL_LINES if name == SHELL else ROOM_LINES if _in(name, ROOMS) else MAX_LINES
        if lines > limit:
            bad.append(f"{name}: {lines} lines > {limit}")
    assert not bad, "\n".join(bad)


# ------------------------------------------------------------------ the docs
def _doc_rows() -> list[tuple[str, str]]:
    rows = []
    for line in DOCS.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) >= 2 and cells[0] not in ("layer", "---") and not set(cells[0]) <= {"-"}:
            rows.append((cells[0], cells[1]))
    return rows


def _doc_entry(entry: str) -> str:
    if entry == "":
        return "__init__.py"
    return f"{entry}/" if (SRC / "mixprec" / entry).is_dir() else f"{entry}.py"


def test_the_architecture_doc_shows_this_table():
    rows = _doc_rows()
    assert [layer for layer, _ in rows] == [layer for layer, _ in LAYERS], \
        "docs/architecture.md's layer table names other layers, or in another order"
    for (layer, cell), (_, entries) in zip(rows, LAYERS):
        named = set(re.findall(r"`([^`]+)`", cell))
        expected = {_doc_entry(e) for e in entries if e == "" or (SRC / "mixprec" / _doc_entry(e)).exists()}
        assert expected <= named, f"{layer}: the doc's row lacks {sorted(expected - named)}"


# ------------------------------------------------------------------ the checks themselves
def test_the_checks_see_a_cycle_a_nested_import_and_a_reach_in():
    """On made-up input: a cycle and a function-level import are found, a top-level ``try``
    counts as module level, ``TYPE_CHECKING`` and third-party imports not at all."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set(), "c": {"b"}}) == []
    modules = {"mixprec.fp8": None, "mixprec.fp8._quant": None, "mixprec.formats._state": None}
    source = ("import torch\nimport mixprec.fp8\nif TYPE_CHECKING:\n    from mixprec.policy import Policy\n"
              "try:\n    from . import _quant\nexcept ImportError:\n    pass\n"
              "def f():\n    import transformers\n    from mixprec.formats._state import OPERANDS\n")
    top, nested = parse_imports(source, "mixprec.fp8._x", modules=modules)
    assert top == [("mixprec.fp8", 2), ("mixprec.fp8._quant", 6)]
    assert nested == [("mixprec.formats._state", 11)]
    assert _REACH_IN.search("x = ctl._compute") and not _REACH_IN.search("ctl.settings")
    assert closure("a.b", {"a.b": {"c"}, "a": set(), "c": {"d"}, "d": set()}) == {"a.b", "a", "c", "d"}
    assert layer_of("mixprec.formats._recipe") < layer_of("mixprec.control._guard") < layer_of("mixprec.policy")


def test_the_seam_names_are_exported_by_fp8_internals():
    from mixprec import fp8
    from mixprec.fp8 import internals

    assert {"Fp8Target", "select_targets", "traced_output"} <= set(internals.__all__)
    assert not {"Fp8Target", "select_targets", "traced_output"} & set(fp8.__all__)  # the engine's, not users'
