"""Precision policies: immutable values that say which dtype each op and module computes in.

(Longer than our 500-line guide: a policy is one value, its construction, edits, parsing and
serialization belong together.)

A :class:`Policy` is a small frozen dataclass in the style of deepmind/jmp: the dtypes of
parameters, compute and outputs, a base op table (``"torch"``: PyTorch's autocast lists for the
region's device, or ``"fp32-numerics"``), edits to that table, and module rules. Every edit
returns a new policy; nothing is mutated.

Example:
    >>> import torch
    >>> from torch import nn
    >>> p = Policy.parse("params=float32,compute=bfloat16,output=float32")
    >>> p = p.with_ops(fp32=["softmax.int"]).keep(types=(nn.LayerNorm,))
    >>> str(p)
    'params=float32,compute=bfloat16,output=float32'
    >>> Policy.from_json(p.to_json()) == p   # the complete value, op edits and module rules
    True
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import json
import os
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Iterable, Mapping

import torch
from torch import nn

from mixprec import ops as _ops
from mixprec._modules import Fp8Rule, ModuleRule
from mixprec._ops_names import OpLike, canonical_names
from mixprec._tree import cast_tree, tracing as _tracing

__all__ = ["Policy", "PRESETS", "parse_dtype"]

PRESETS: dict[str, str] = {
    "torch": "PyTorch's autocast op lists for the region's device (the default)",
    "fp32-numerics": (
        "the device's lists plus CUDA's float32 list: softmax, log_softmax, norms, exp/log/pow, "
        "sums and losses in float32, on CPU too"
    ),
}

_DTYPE_NAMES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "f32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "single": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "f16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}
_KEYS = {"p": "params", "params": "params", "c": "compute", "compute": "compute",
         "o": "output", "output": "output", "ops": "base", "preset": "base", "base": "base",
         "fp8": "fp8_rule"}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """``"bf16"``, ``"bfloat16"``, ``"half"``, ``"f32"``, ... (or a dtype) -> ``torch.dtype``."""
    if isinstance(name, torch.dtype):
        return name
    key = str(name).strip().lower().removeprefix("torch.")
    try:
        return _DTYPE_NAMES[key]
    except KeyError:
        raise ValueError(
            f"unknown dtype {name!r}; use one of {', '.join(sorted(_DTYPE_NAMES))}"
        ) from None


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _check_dtype(what: str, dtype: object, allow_none: bool) -> None:
    if dtype is None and allow_none:
        return
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"Policy.{what} must be a floating torch.dtype, got {dtype!r}")


class _on_class_or_instance:
    """A method that, looked up on the class, runs on the default instance: ``Policy.fp8()``."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self.__doc__ = fn.__doc__

    def __get__(self, obj: Any, cls: Any) -> Any:
        return self.fn.__get__(obj if obj is not None else cls(), cls)


@dataclass(frozen=True)
class Policy:
    """Which dtype parameters, compute and outputs use, op by op and module by module.

    Args:
        params: dtype parameters are stored in (used by :func:`mixprec.to_low_precision`).
        compute: low-precision dtype of an autocast region; ``None`` takes the region's
            ``dtype`` argument or the device default (bf16 on CPU, fp16 on CUDA).
        output: dtype the region's outermost module outputs are cast to; ``None`` leaves them.
        base: op table the edits apply to: ``"torch"`` or ``"fp32-numerics"`` (see ``PRESETS``).
        device_type: whose table ``base`` names; ``None`` means the region's device.
        op_rules: edits ``(overload, kind)``, applied in order; build them with :meth:`with_ops`.
        module_rules: modules that run in another dtype; build them with :meth:`keep`.
        fp8_rule: ``nn.Linear`` layers whose GEMMs run in fp8; build it with :meth:`fp8`.
    """

    params: torch.dtype = torch.float32
    compute: torch.dtype | None = None
    output: torch.dtype | None = None
    base: str = "torch"
    device_type: str | None = None
    op_rules: tuple[tuple[str, str], ...] = ()
    module_rules: tuple[ModuleRule, ...] = field(default=())
    fp8_rule: Fp8Rule | None = None

    def __post_init__(self) -> None:
        _refuse_tracing("policies")
        _check_dtype("params", self.params, allow_none=False)
        _check_dtype("compute", self.compute, allow_none=True)
        _check_dtype("output", self.output, allow_none=True)
        if self.base not in PRESETS:
            raise ValueError(f"unknown op preset {self.base!r}; presets: {', '.join(PRESETS)}")
        if self.device_type is not None:
            _ops.default_table(self.device_type)  # validates the device type
        for name, kind in self.op_rules:
            if kind not in _ops.CAST_KINDS:
                raise ValueError(f"unknown cast kind {kind!r} for {name}; kinds: {_ops.CAST_KINDS}")
        object.__setattr__(self, "op_rules", tuple(tuple(r) for r in self.op_rules))
        object.__setattr__(self, "module_rules", tuple(self.module_rules))

    # ----------------------------------------------------------------- constructors
    @classmethod
    def default(cls, device_type: str) -> "Policy":
        """PyTorch's autocast behaviour on ``device_type`` (``"cpu"`` or ``"cuda"``)."""
        return cls(device_type=device_type)

    @classmethod
    def preset(cls, name: str, device_type: str | None = None) -> "Policy":
        """A named preset: ``"torch"`` or ``"fp32-numerics"``."""
        return cls(base=name, device_type=device_type)

    @classmethod
    def parse(cls, spec: str) -> "Policy":
        """Parse ``"params=float32,compute=bfloat16,output=float32"`` or a preset name.

        Keys: ``params``/``p``, ``compute``/``c``, ``output``/``o``, ``preset``/``ops``; dtype
        names: ``float32``/``f32``/``fp32``, ``bfloat16``/``bf16``, ``float16``/``f16``/``half``.
        A bare dtype means ``compute=`` that dtype; a bare preset name selects the preset.

        Raises:
            ValueError: an unknown key, dtype or preset, or a key given twice.
        """
        if not isinstance(spec, str):
            raise TypeError(f"Policy.parse takes a str, got {type(spec).__name__}")
        if spec.lstrip().startswith("{"):
            return cls.from_json(spec)
        values: dict[str, Any] = {}
        for part in filter(None, (s.strip() for s in spec.split(","))):
            if "=" not in part:
                if part in PRESETS:
                    key, value = "base", part
                elif part.lower().removeprefix("torch.") in _DTYPE_NAMES:
                    key, value = "compute", part
                else:
                    raise ValueError(_unknown_word(part, spec))
            else:
                raw_key, value = (s.strip() for s in part.split("=", 1))
                if raw_key.lower() not in _KEYS:
                    raise ValueError(
                        f"unknown policy key {raw_key!r} in {spec!r}; keys: params (p), "
                        "compute (c), output (o), preset, fp8"
                    )
                key = _KEYS[raw_key.lower()]
            if key in values:
                raise ValueError(f"policy key {key!r} given twice in {spec!r}")
            if key == "fp8_rule":
                values[key] = Fp8Rule(recipe=value)
            else:
                values[key] = value if key == "base" else parse_dtype(value)
        return cls(**values)

    @classmethod
    def coerce(cls, value: "Policy | str | None", where: str = "policy") -> "Policy":
        """``value`` as a policy: a Policy as is, a string through :meth:`parse`, ``None`` the
        default.

        Raises:
            TypeError: anything else (``where`` names the argument in the message).
        """
        if isinstance(value, Policy):
            return value
        if isinstance(value, str):
            return cls.parse(value)
        if value is None:
            if cls is Policy and not _tracing():
                return _DEFAULT  # a region's default: no validation per region
            return cls()
        raise TypeError(f"{where} must be a mixprec.Policy, a str or None, got {type(value).__name__}")

    # ----------------------------------------------------------------- serialization
    def to_dict(self) -> dict[str, Any]:
        """The complete policy as plain JSON-able data (inverse: :meth:`from_dict`).

        Module types are stored by import path (``"torch.nn.modules.normalization.LayerNorm"``).

        Raises:
            ValueError: a module rule names a type that cannot be imported back (defined inside
                a function); select it with ``names=`` instead.
        """
        return {
            "params": _dtype_name(self.params),
            "compute": None if self.compute is None else _dtype_name(self.compute),
            "output": None if self.output is None else _dtype_name(self.output),
            "base": self.base,
            "device_type": self.device_type,
            "op_rules": [list(r) for r in self.op_rules],
            "module_rules": [
                {"dtype": _dtype_name(r.dtype), "types": [_type_path(t) for t in r.types],
                 "names": r.names}
                for r in self.module_rules
            ],
            "fp8_rule": None if self.fp8_rule is None else _fp8_to_dict(self.fp8_rule),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Policy":
        """Rebuild a policy from :meth:`to_dict`'s data.

        Raises:
            ValueError: an unknown key, dtype, preset, cast kind or module type.
        """
        if not isinstance(data, Mapping):
            raise TypeError(f"Policy.from_dict takes a mapping, got {type(data).__name__}")
        unknown = set(data) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"unknown policy field(s) {sorted(unknown)}; fields: "
                             f"{[f.name for f in dataclasses.fields(cls)]}")
        values = dict(data)
        for key in ("params", "compute", "output"):
            if values.get(key) is not None:
                values[key] = parse_dtype(values[key])
        values["op_rules"] = tuple(tuple(r) for r in values.get("op_rules", ()))
        values["module_rules"] = tuple(
            ModuleRule(parse_dtype(r.get("dtype", "float32")),
                       types=tuple(_import_type(t) for t in r.get("types", ())),
                       names=r.get("names"))
            for r in values.get("module_rules", ())
        )
        if values.get("fp8_rule") is not None:
            values["fp8_rule"] = _fp8_from_dict(values["fp8_rule"])
        return cls(**values)

    def to_json(self, **json_kwargs: Any) -> str:
        """:meth:`to_dict` as JSON text; ``Policy.from_json(p.to_json()) == p``."""
        json_kwargs.setdefault("indent", 2)
        return json.dumps(self.to_dict(), **json_kwargs)

    @classmethod
    def from_json(cls, text: str) -> "Policy":
        """Rebuild a policy from :meth:`to_json`'s text (``Policy.parse`` accepts it too)."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"not a policy in JSON: {e}") from None
        if isinstance(data, Mapping) and isinstance(data.get("policy"), Mapping):
            data = data["policy"]  # an audit's report.json
        return cls.from_dict(data)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write :meth:`to_json` to ``path``."""
        with open(path, "w", encoding="utf-8") as f:
            f.write(self.to_json() + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> "Policy":
        """Read a policy saved by :meth:`save`, or the ``"policy"`` of an audit's ``report.json``.

        Example:
            >>> policy = mixprec.Policy.load("audit-report/report.json")
        """
        with open(path, encoding="utf-8") as f:
            return cls.from_json(f.read())

    # ----------------------------------------------------------------- edits
    def with_ops(
        self,
        *,
        lower: Iterable[OpLike] = (),
        fp32: Iterable[OpLike] = (),
        promote: Iterable[OpLike] = (),
        passthrough: Iterable[OpLike] = (),
    ) -> "Policy":
        """A copy with ops moved between lists.

        Ops are named by aten name (``"mm"``, ``"softmax.int"``; a bare name covers every
        functional overload), by torch callable (``torch.mm``, ``F.softmax``) or by
        ``torch.ops.aten.<op>.<overload>``. ``fp32`` keeps an op's dtype-argument form where
        PyTorch has one (softmax, sum, norm: computed in fp32 without copying the input).

        Raises:
            ValueError: an unknown op (the message suggests close names), or one op in two lists.
        """
        rules: list[tuple[str, str]] = []
        seen: dict[str, str] = {}
        for kind, items in (("lower", lower), ("fp32", fp32), ("promote", promote),
                            ("passthrough", passthrough)):
            if isinstance(items, (str, bytes)) or callable(items):
                items = [items]
            for item in items:
                for name in canonical_names(item):
                    if name in seen and seen[name] != kind:
                        raise ValueError(f"op {name} is listed as both {seen[name]} and {kind}")
                    seen[name] = kind
                    rules.append((name, _FP32_FORMS.get(name, "fp32") if kind == "fp32" else kind))
        return dataclasses.replace(self, op_rules=self.op_rules + tuple(rules))

    def keep(
        self,
        types: type[nn.Module] | tuple[type[nn.Module], ...] = (),
        names: str | None = None,
        dtype: torch.dtype | str = torch.float32,
    ) -> "Policy":
        """A copy where matching modules run in ``dtype`` inside an autocast region.

        A module matches if it is an instance of ``types`` or ``re.search(names, its qualified
        name)`` matches. Its floating inputs are cast to ``dtype``; for ``float32`` no op inside it
        is lowered, for a half dtype its ops lower to that dtype instead of the region's.
        """
        rule = ModuleRule(parse_dtype(dtype), types=types, names=names)
        return dataclasses.replace(self, module_rules=self.module_rules + (rule,))

    @_on_class_or_instance
    def fp8(
        self,
        recipe: Any = "tensorwise",
        types: type[nn.Module] | tuple[type[nn.Module], ...] = (nn.Linear,),
        names: str | None = None,
        first_last: str = "keep",
        guard: Any = None,
        backend: str = "auto",
    ) -> "Policy":
        """A copy whose selected ``nn.Linear`` layers run their GEMMs in fp8 (no module swap).

        Inside a region, each selected layer's ``linear`` runs :func:`mixprec.fp8.linear` with
        ``recipe`` (``"tensorwise"``, ``"rowwise"``, ``"rowwise_with_gw_hp"`` or a
        :class:`~mixprec.fp8.Float8Recipe`), its input in the compute dtype, its statistics in
        :func:`mixprec.fp8.layer_state` of the module; the rest of the model follows the policy.
        Layers: see :class:`mixprec.Fp8Rule`; ``keep`` rules win. A ``guard``
        (:class:`mixprec.fp8.Guard`) is checked as the model's outermost call starts, and moves
        layers that cross its thresholds back to the compute dtype. Usable on the class too:
        ``Policy.fp8()`` is ``Policy().fp8()``.

        Example:
            >>> policy = Policy.parse("compute=bf16").fp8("rowwise", guard=mixprec.fp8.Guard(every=50))
        """
        rule = Fp8Rule(recipe, types=types, names=names, first_last=first_last, guard=guard,
                       backend=backend)
        return dataclasses.replace(self, fp8_rule=rule)

    # ----------------------------------------------------------------- queries
    def table(self, device_type: str) -> Mapping[str, str]:
        """The resolved op table ``overload -> cast kind`` for a region on ``device_type``.

        A read-only mapping: a policy is a value, edit it with :meth:`with_ops`.
        """
        return _resolve_table(self.base, self.device_type or device_type, self.op_rules)

    def edits(self, device_type: str) -> Mapping[str, str]:
        """The overloads whose cast kind differs from PyTorch's own on ``device_type``.

        These are the only ops a region with this policy runs through mixprec's kernels; every
        other op runs PyTorch's autocast kernel directly.

        Example:
            >>> dict(Policy().with_ops(fp32=["mm"]).edits("cpu"))
            {'mm': 'fp32'}
        """
        return _resolve_edits(self.base, self.device_type or device_type, self.op_rules, device_type,
                              self.fp8_rule is not None)

    def kind(self, op: OpLike, device_type: str) -> str:
        """Cast kind of ``op`` (one overload) in a region on ``device_type``."""
        names = canonical_names(op)
        table = self.table(device_type)
        kinds = {table.get(n, "passthrough") for n in names}
        if len(kinds) != 1:
            raise ValueError(f"{op!r} covers overloads of several kinds; name one overload")
        return kinds.pop()

    # jmp-style casts of trees of tensors
    def cast_to_param(self, tree: Any) -> Any:
        """Cast the floating tensors (not float64) in a (nested) container to ``params``."""
        return cast_tree(tree, self.params)

    def cast_to_compute(self, tree: Any) -> Any:
        """Cast the floating tensors (not float64) in a (nested) container to ``compute`` (if set)."""
        return tree if self.compute is None else cast_tree(tree, self.compute)

    def cast_to_output(self, tree: Any) -> Any:
        """Cast the floating tensors (not float64) in a (nested) container to ``output`` (if set)."""
        return tree if self.output is None else cast_tree(tree, self.output)

    def __str__(self) -> str:
        """The dtypes and preset in :meth:`parse` syntax (op edits and module rules are in
        :meth:`to_json`, which round-trips the whole policy)."""
        parts = [f"params={_dtype_name(self.params)}"]
        if self.compute is not None:
            parts.append(f"compute={_dtype_name(self.compute)}")
        if self.output is not None:
            parts.append(f"output={_dtype_name(self.output)}")
        if self.base != "torch":
            parts.append(f"preset={self.base}")
        if self.fp8_rule is not None:
            parts.append(f"fp8={self.fp8_rule.recipe_name}")
        return ",".join(parts)


# fp32 forms PyTorch uses for ops with a dtype argument
_FP32_FORMS: dict[str, str] = {
    name: kind
    for name, kind in _ops.default_table("cuda").items()
    if kind in ("fp32_set_opt_dtype", "fp32_append_dtype")
}

_TABLE_CACHE: dict[tuple[str, str, tuple[tuple[str, str], ...]], Mapping[str, str]] = {}
_EDITS_CACHE: dict[tuple[str, str, tuple[tuple[str, str], ...], str, bool], Mapping[str, str]] = {}


def _resolve_table(base: str, device_type: str, rules: tuple[tuple[str, str], ...]) -> Mapping[str, str]:
    key = (base, device_type, rules)
    table = _TABLE_CACHE.get(key)
    if table is None:
        start = _ops.default_table(device_type) if base == "torch" else _ops.fp32_numerics_table(device_type)
        resolved = dict(start)
        for name, kind in rules:
            resolved[name] = kind
        table = _TABLE_CACHE[key] = MappingProxyType(resolved)
    return table


def _resolve_edits(base: str, table_device: str, rules: tuple[tuple[str, str], ...],
                   region_device: str, fp8: bool) -> Mapping[str, str]:
    key = (base, table_device, rules, region_device, fp8)
    edits = _EDITS_CACHE.get(key)
    if edits is None:
        table = _resolve_table(base, table_device, rules)
        native = _ops.default_table(region_device)
        names = set(table) | set(native)
        resolved = {n: table.get(n, "passthrough") for n in sorted(names)
                    if table.get(n, "passthrough") != native.get(n, "passthrough")}
        if fp8:  # linear routes to fp8 for the selected layers
            resolved["linear"] = "fp8"
        edits = _EDITS_CACHE[key] = MappingProxyType(resolved)
    return edits


def _fp8_to_dict(rule: Fp8Rule) -> dict[str, Any]:
    from mixprec import fp8

    recipe = rule.recipe
    if not isinstance(recipe, str):
        if fp8.Float8Recipe.from_name(recipe.name) != recipe:
            raise ValueError(f"cannot serialize the custom fp8 recipe {recipe!r}: use a named recipe "
                             "('tensorwise', 'rowwise', 'rowwise_with_gw_hp')")
        recipe = recipe.name
    guard = None
    if rule.guard is not None:
        guard = {f.name: getattr(rule.guard, f.name) for f in dataclasses.fields(rule.guard) if f.init}
    return {"recipe": recipe, "types": [_type_path(t) for t in rule.types], "names": rule.names,
            "first_last": rule.first_last, "backend": rule.backend, "guard": guard}


def _fp8_from_dict(data: Mapping[str, Any]) -> Fp8Rule:
    from mixprec import fp8

    values = dict(data)
    values["types"] = tuple(_import_type(t) for t in values.get("types", ["torch.nn.modules.linear.Linear"]))
    if values.get("guard") is not None:
        values["guard"] = fp8.Guard(**values["guard"])
    return Fp8Rule(**values)


def _refuse_tracing(what: str) -> None:
    """Policies are values built once, outside compiled code: Dynamo's emulation of a frozen
    dataclass drops fields, which would silently lose op edits or module rules. Raising here
    makes Dynamo run the construction eagerly (a graph break; an error under fullgraph=True)."""
    if _tracing():
        raise RuntimeError(
            f"build mixprec {what} outside torch.compile (a global, an argument, or a string "
            "policy= that mixprec.autocast parses at trace time)"
        )


def _unknown_word(word: str, spec: str) -> str:
    words = [*PRESETS, *_DTYPE_NAMES]
    close = difflib.get_close_matches(word.lower(), words, n=3, cutoff=0.6)
    hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    return (f"{word!r} in policy {spec!r} is neither a preset nor a dtype.{hint} Presets: "
            f"{', '.join(PRESETS)}; dtypes: {', '.join(sorted(_DTYPE_NAMES))}; or key=value "
            "pairs with keys params, compute, output, preset")


def _type_path(t: type) -> str:
    path = f"{t.__module__}.{t.__qualname__}"
    if "<locals>" in t.__qualname__ or _import_type(path, strict=False) is not t:
        raise ValueError(
            f"cannot serialize module rule type {t.__qualname__}: it is not importable as "
            f"{path!r}; define it at module level or select the modules with names=r'...'"
        )
    return path


def _import_type(path: str, strict: bool = True) -> Any:
    """Import ``"package.module.Class"`` (or a nested ``Outer.Inner``) back to the type."""
    parts, obj = str(path).split("."), None
    for i in range(len(parts) - 1, 0, -1):  # the longest importable module prefix
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr, None)
        break
    if strict and not (isinstance(obj, type) and issubclass(obj, nn.Module)):
        raise ValueError(f"module rule type {path!r} is not an importable nn.Module subclass")
    return obj


_DEFAULT = Policy()
