"""The one-line form of a policy: ``str(policy)`` writes it, :meth:`mixprec.Policy.parse` reads it.

``params=float32,compute=bfloat16; ops fp32=softmax,exp lower=bmm.default; keep float32=LayerNorm;
keep float16=/^head$/; fp8 rowwise=Linear|/blocks/ except first/last backend=emulate recipes 2=mxfp8``

Sections are separated by ``;``: the dtypes (``parse``'s ``key=value`` list), then any of

- ``ops KIND=op,op KIND=op ...``: op edits in order (``with_ops`` names: a bare packet name is
  every functional overload, ``mm.default`` the default one only); kinds ``lower``, ``fp32``,
  ``promote``, ``passthrough``, ``banned``.
- ``keep DTYPE=SELECTION``: a module rule. A selection is ``|``-separated items: module types
  (a ``torch.nn`` name such as ``LayerNorm``, else the import path
  ``package.module.Class``, looked up among imported modules, never imported) and at most one
  name regex, ``/regex/`` or a JSON string ``"regex"`` (written when the regex holds ``/`` before
  whitespace, ``|`` or ``;``, or a control character).
- ``fp8 RECIPE=SELECTION`` and options: ``except first/last``, ``backend=NAME``, ``recipes
  layer=recipe,layer=recipe``, ``guarded {...}`` or ``controlled {...}`` (JSON: the settings
  that differ from the defaults; reading them builds a new Guard/Controller, with a warning, as
  :meth:`Policy.load` does). A custom :class:`~mixprec.fp8.Float8Recipe` (one no recipe name
  gives) has no text form: it is written ``<custom NAME>`` (``str`` never raises: it is for
  display and logs), which reading refuses with a ValueError.
"""

from __future__ import annotations

import difflib
import json
import re
from typing import Any, Iterable, Mapping

from torch import nn

from mixprec import ops as _ops
from mixprec.policy._codec import DTYPE_NAMES, dtype_name, expect, import_type, parse_dtype
from mixprec._modules import ModuleRule
from mixprec._ops_names import canonical_names
from mixprec.formats._recipe import RECIPE_NAMES
from mixprec.policy._rule import Fp8Rule, named_recipe

__all__ = ["format_sections", "parse_sections", "parse_header"]

_KEYS = {"p": "params", "params": "params", "c": "compute", "compute": "compute",
         "o": "output", "output": "output", "ops": "base", "preset": "base", "base": "base",
         "fp8": "fp8_rule", "table": "device_type"}

_SECTIONS = ("ops", "keep", "fp8")
_PLAIN_NAME = re.compile(r"^[\w.\-]+$")


# ----------------------------------------------------------------- writing
def format_sections(policy: Any) -> list[str]:
    """The ``ops``, ``keep`` and ``fp8`` sections of ``policy`` (empty when it has none)."""
    sections = []
    if policy.op_rules:
        sections.append("ops " + " ".join(f"{kind}={','.join(names)}" for kind, names in _op_runs(policy.op_rules)))
    sections += [f"keep {dtype_name(r.dtype)}={_selection(r.types, r.names)}" for r in policy.module_rules]
    rule = policy.fp8_rule
    if rule is not None:
        text = f"fp8 {_recipe_text(rule.recipe)}={_selection(rule.types, rule.names)}"
        if rule.first_last == "keep":
            text += " except first/last"
        if rule.backend != "auto":
            text += f" backend={rule.backend}"
        for word, state in (("guarded", rule.guard), ("controlled", rule.controller)):
            if state is not None:  # the settings that differ from the defaults
                text += f" {word} " + json.dumps(state.changed(), separators=(",", ":"))
        if rule.recipes:
            text += " recipes " + ",".join(f"{_layer_name(n)}={_recipe_text(r)}" for n, r in rule.recipes)
        sections.append(text)
    return sections


def _op_runs(rules: tuple[tuple[str, str], ...]) -> list[tuple[str, list[str]]]:
    """The edits as runs of one kind, in order (``fp32`` for the dtype-argument forms); a packet
    whose functional overloads stand together in a run is written by its packet name, a default
    overload alone as ``packet.default``."""
    runs: list[tuple[str, list[str]]] = []
    for name, kind in rules:
        shown = "fp32" if kind.startswith("fp32") else kind
        if not runs or runs[-1][0] != shown:
            runs.append((shown, []))
        runs[-1][1].append(name)
    out = []
    for kind, names in runs:
        written, i = [], 0
        while i < len(names):
            packet = names[i].split(".")[0]
            overloads = canonical_names(packet)
            if names[i:i + len(overloads)] == overloads:
                written.append(packet)
                i += len(overloads)
            else:
                written.append(names[i] if "." in names[i] else f"{names[i]}.default")
                i += 1
        out.append((kind, written))
    return out


def _selection(types: tuple[type, ...], names: str | None) -> str:
    items = [t.__name__ if getattr(nn, t.__name__, None) is t else f"{t.__module__}.{t.__qualname__}"
             for t in types]
    if names is not None:
        items.append(f"/{names}/" if _slashes_safe(names) else json.dumps(names))
    return "|".join(items)


def _slashes_safe(regex: str) -> bool:
    """Whether ``/regex/`` reads back as ``regex``: no ``/`` before what ends a ``/regex/`` for
    :meth:`_Reader.regex` (``|``, ``;``, any ``str.isspace()`` character), no control character."""
    if any(ord(c) < 32 for c in regex) or regex.startswith('"'):
        return False
    return not any(regex[i] == "/" and _ends_regex(regex[i + 1]) for i in range(len(regex) - 1))


def _ends_regex(char: str) -> bool:
    """Whether ``char`` after a ``/`` closes a ``/regex/`` (the writer and the reader share this)."""
    return char in "|;" or char.isspace()


def _recipe_text(recipe: Any) -> str:
    """A recipe's name, or ``<custom NAME>`` for a custom recipe: no text form, :func:`parse_sections`
    refuses it (written, not raised, as ``str(policy)`` is for display and logs)."""
    name = named_recipe(recipe)
    if name is not None:
        return name
    return f"<custom {recipe.name}>" if _PLAIN_NAME.match(recipe.name) else "<custom>"


def _layer_name(name: str) -> str:
    return name if _PLAIN_NAME.match(name) else json.dumps(name)


# ----------------------------------------------------------------- reading
class _Reader:
    """A cursor over a policy string, with errors that show where reading stopped."""

    def __init__(self, text: str) -> None:
        self.text, self.pos = text, 0

    def error(self, what: str) -> ValueError:
        return ValueError(f"policy {self.text!r}, at character {self.pos} ({self.text[self.pos:self.pos + 20]!r}): "
                          f"{what}. The one-line syntax: see help(mixprec.Policy.parse)")

    def skip_spaces(self) -> None:
        while self.pos < len(self.text) and self.text[self.pos].isspace():
            self.pos += 1

    def at_end_of_section(self) -> bool:
        self.skip_spaces()
        return self.pos >= len(self.text) or self.text[self.pos] == ";"

    def word(self, stops: str) -> str:
        start = self.pos
        while self.pos < len(self.text) and not self.text[self.pos].isspace() and self.text[self.pos] not in stops:
            self.pos += 1
        if self.pos == start:
            raise self.error("expected a name")
        return self.text[start:self.pos]

    def expect(self, char: str) -> None:
        if not self.text.startswith(char, self.pos):
            raise self.error(f"expected {char!r}")
        self.pos += len(char)

    def recipe(self, stops: str) -> str:
        """A recipe name; the ``<custom ...>`` marker of a custom recipe is refused."""
        if self.text.startswith("<", self.pos):
            raise self.error(
                "a custom fp8 recipe (a Float8Recipe no recipe name gives) has no text form: str(policy) "
                "writes it as '<custom ...>' for display only. Build the policy in Python "
                "(Policy.fp8(recipe=Float8Recipe(...)), or pickle it), or use a named recipe ("
                + ", ".join(RECIPE_NAMES) + ")")
        return self.word(stops)

    def json_value(self) -> Any:
        try:
            value, self.pos = json.JSONDecoder().raw_decode(self.text, self.pos)
        except json.JSONDecodeError as e:
            raise self.error(f"bad JSON: {e.msg}") from None
        except RecursionError:
            raise self.error("JSON nested too deeply") from None
        return value

    def regex(self) -> str:
        """``/regex/`` (ends at the first ``/`` before whitespace, ``|``, ``;`` or the end)."""
        start = self.pos + 1
        end = start
        while True:
            end = self.text.find("/", end)
            if end < 0:
                raise self.error("a /regex/ without its closing '/'")
            if end + 1 == len(self.text) or _ends_regex(self.text[end + 1]):
                break
            end += 1
        self.pos = end + 1
        return self.text[start:end]


def parse_header(header: str, sections: dict[str, Any], spec: str, presets: Iterable[str]) -> dict[str, Any]:
    """The policy fields of the one-line form ``spec`` (see :meth:`mixprec.Policy.parse`): the
    dtypes and preset of its ``header`` (``presets``: the known names) with the fields of its
    ``sections`` (as :func:`parse_sections` returns them).

    Raises:
        ValueError: an unknown key, dtype or preset, a key given twice, fp8 given twice.
    """
    values: dict[str, Any] = {}
    for part in filter(None, (s.strip() for s in header.split(","))):
        if "=" not in part:
            if part in presets:
                key, value = "base", part
            elif part.lower().removeprefix("torch.") in DTYPE_NAMES:
                key, value = "compute", part
            else:
                raise ValueError(_unknown_word(part, spec, presets))
        else:
            raw_key, value = (s.strip() for s in part.split("=", 1))
            if raw_key.lower() not in _KEYS:
                raise ValueError(
                    f"unknown policy key {raw_key!r} in {spec!r}; keys: params (p), "
                    "compute (c), output (o), preset, table, fp8 (op edits and module rules: "
                    "Policy.with_ops, Policy.keep, or the JSON form)"
                )
            key = _KEYS[raw_key.lower()]
        if key in values:
            raise ValueError(f"policy key {key!r} given twice in {spec!r}")
        if key == "fp8_rule":
            values[key] = Fp8Rule(recipe=value)
        elif key in ("base", "device_type"):
            values[key] = value
        elif key == "compute" and value.lower() == "auto":
            values[key] = None
        else:
            values[key] = parse_dtype(value)
    if "fp8_rule" in values and "fp8_rule" in sections:
        raise ValueError(f"policy {spec!r} gives fp8= and an fp8 section: give one")
    return {**values, **sections}


def _unknown_word(word: str, spec: str, presets: Iterable[str]) -> str:
    words = [*presets, *DTYPE_NAMES]
    close = difflib.get_close_matches(word.lower(), words, n=3, cutoff=0.6)
    hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    return (f"{word!r} in policy {spec!r} is neither a preset nor a dtype.{hint} Presets: "
            f"{', '.join(presets)}; dtypes: {', '.join(sorted(DTYPE_NAMES))}; or key=value "
            "pairs with keys params, compute, output, preset")


def parse_sections(text: str) -> tuple[str, dict[str, Any]]:
    """Split ``text`` into its dtype list (returned as is, for :meth:`Policy.parse`) and the
    policy fields its sections give: ``op_rules``, ``module_rules``, ``fp8_rule``.

    Raises:
        ValueError: a malformed section (the message says where), an unknown op, dtype, kind,
            module type (or one whose module is not imported), recipe or option.
    """
    reader = _Reader(text)
    header_end = text.find(";")
    first = text[: len(text) if header_end < 0 else header_end].strip()
    header = "" if first.split(" ", 1)[0] in _SECTIONS and " " in first else first
    if header:
        reader.pos = len(text) if header_end < 0 else header_end + 1
    fields: dict[str, Any] = {"op_rules": [], "module_rules": []}
    while True:
        reader.skip_spaces()
        if reader.pos >= len(text):
            break
        keyword = reader.word(";=")
        if keyword not in _SECTIONS:
            raise reader.error(f"unknown section {keyword!r}; sections: dtypes first, then ops, keep, fp8")
        reader.skip_spaces()
        {"ops": _read_ops, "keep": _read_keep, "fp8": _read_fp8}[keyword](reader, fields)
        if not reader.at_end_of_section():
            raise reader.error("expected ';' or the end")
        reader.pos += 1
    fields["op_rules"], fields["module_rules"] = tuple(fields["op_rules"]), tuple(fields["module_rules"])
    return header, fields


def _read_ops(reader: _Reader, fields: dict[str, Any]) -> None:
    while not reader.at_end_of_section():
        kind = reader.word("=;")
        if kind not in _ops.CAST_KINDS:
            raise reader.error(f"unknown cast kind {kind!r}; kinds: {', '.join(_ops.CAST_KINDS)}")
        reader.expect("=")
        while True:
            for name in canonical_names(reader.word(",;")):
                fields["op_rules"].append((name, kind))
            if not reader.text.startswith(",", reader.pos):
                break
            reader.pos += 1


def _read_selection(reader: _Reader) -> tuple[tuple[type, ...], str | None]:
    types, names = [], None
    while True:
        if reader.text.startswith("/", reader.pos) or reader.text.startswith('"', reader.pos):
            if names is not None:
                raise reader.error("a rule has one name regex (give several with '|' inside it)")
            names = reader.regex() if reader.text[reader.pos] == "/" else reader.json_value()
            if not isinstance(names, str):
                raise reader.error("a name regex in JSON is a string")
        else:
            types.append(_module_type(reader, reader.word("|;")))
        if not reader.text.startswith("|", reader.pos):
            return tuple(types), names
        reader.pos += 1


def _module_type(reader: _Reader, name: str) -> type:
    if "." in name:
        return import_type(name)
    found = getattr(nn, name, None)
    if not (isinstance(found, type) and issubclass(found, nn.Module)):
        raise reader.error(f"{name!r} is no torch.nn module type; name other types by import path "
                           f"(package.module.Class)")
    return found


def _read_keep(reader: _Reader, fields: dict[str, Any]) -> None:
    dtype = parse_dtype(reader.word("=;"))
    reader.expect("=")
    types, names = _read_selection(reader)
    fields["module_rules"].append(ModuleRule(dtype, types=types, names=names))


def _read_fp8(reader: _Reader, fields: dict[str, Any]) -> None:
    if "fp8_rule" in fields:
        raise reader.error("one fp8 section per policy")
    recipe = reader.recipe("=;")
    reader.expect("=")
    types, names = _read_selection(reader)
    options: dict[str, Any] = {"first_last": "fp8", "recipes": {}}
    while not reader.at_end_of_section():
        option = reader.word("=;")
        if option == "except":
            reader.skip_spaces()
            reader.expect("first/last")
            options["first_last"] = "keep"
        elif option == "backend":
            reader.expect("=")
            options["backend"] = reader.word(";")
        elif option in ("guarded", "controlled"):
            reader.skip_spaces()
            settings = reader.json_value()
            expect(settings, Mapping, f"the {option} settings", "an object {setting: value}")
            options["guard" if option == "guarded" else "controller"] = settings  # (Fp8Rule checks them)
        elif option == "recipes":
            reader.skip_spaces()
            while True:
                layer = reader.json_value() if reader.text.startswith('"', reader.pos) else reader.word("=,;")
                reader.expect("=")
                options["recipes"][layer] = reader.recipe(",;")
                if not reader.text.startswith(",", reader.pos):
                    break
                reader.pos += 1
        else:
            raise reader.error(f"unknown fp8 option {option!r}; options: except first/last, backend=, "
                               "recipes, guarded {...}, controlled {...}")
    fields["fp8_rule"] = Fp8Rule(recipe, types=types, names=names, **options)

