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
    'params=float32,compute=bfloat16,output=float32; ops fp32=softmax; keep float32=LayerNorm'
    >>> Policy.from_json(p.to_json()) == p   # the complete value, op edits and module rules
    True
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import sys
import warnings
import weakref
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Iterable, Mapping

import torch
from torch import nn

from mixprec import ops as _ops
from mixprec._modules import Fp8Rule, ModuleRule
from mixprec._ops_names import OpLike, canonical_names, check_castable, rule_names
from mixprec._policy_text import format_sections, parse_sections
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
         "fp8": "fp8_rule", "table": "device_type"}


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
        """The one validation of every policy, however it is made (constructor, ``replace``,
        :meth:`with_ops`, :meth:`parse`, :meth:`from_json`, :meth:`load`)."""
        _refuse_tracing("policies")
        _check_dtype("params", self.params, allow_none=False)
        _check_dtype("compute", self.compute, allow_none=True)
        _check_dtype("output", self.output, allow_none=True)
        if not isinstance(self.base, str) or self.base not in PRESETS:
            raise ValueError(_unknown_preset(self.base))
        if self.device_type is not None:
            if not isinstance(self.device_type, str):
                raise ValueError(f"Policy.device_type must be None, 'cpu' or 'cuda', got {self.device_type!r}")
            _ops.default_table(self.device_type)  # validates the device type
        object.__setattr__(self, "op_rules", _checked_rules(self.op_rules))
        rules = self.module_rules
        if isinstance(rules, ModuleRule) or not isinstance(rules, (tuple, list)):
            raise ValueError(f"Policy.module_rules must be a tuple of ModuleRules (build them with "
                             f"Policy.keep), got {type(rules).__name__}")
        for rule in rules:
            if not isinstance(rule, ModuleRule):
                raise ValueError(f"Policy.module_rules holds ModuleRules (Policy.keep), got {rule!r}")
        object.__setattr__(self, "module_rules", tuple(rules))
        if self.fp8_rule is not None and not isinstance(self.fp8_rule, Fp8Rule):
            raise ValueError(f"Policy.fp8_rule must be None or an Fp8Rule (Policy.fp8), got {self.fp8_rule!r}")
        object.__setattr__(self, "_canonical", _canonical(self))

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickle the fields; unpickling validates and interns again. A policy holding an fp8
        Guard or Controller is refused: they are runtime state bound to the model's layers (a
        pickled copy would be one nothing steps).

        Raises:
            TypeError: the policy holds a Guard or Controller; the message says what to save.
        """
        state = _state_of(self.fp8_rule)
        if state is not None:
            raise TypeError(
                f"cannot pickle a mixprec.Policy holding an fp8 {state} (runtime state bound to the model's "
                f"layers): save policy.to_json() (its settings) and policy.fp8_rule.{state}.state_dict(); "
                f"restore with Policy.from_json(text, {state}=my_{state}) and my_{state}.load_state_dict(...)")
        return _rebuild, (type(self), {f.name: getattr(self, f.name) for f in dataclasses.fields(self)})

    def __copy__(self) -> "Policy":
        return self  # an immutable value

    def __deepcopy__(self, memo: dict[int, Any]) -> "Policy":
        """A copy whose guard or controller (if any) is a deep copy too."""
        import copy

        return _rebuild(type(self), {f.name: copy.deepcopy(getattr(self, f.name), memo)
                                     for f in dataclasses.fields(self)})

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
        """Parse ``"params=float32,compute=bfloat16,output=float32"``, a preset name, or the
        complete one-line form ``str(policy)`` writes: ``Policy.parse(str(p)) == p``.

        Keys: ``params``/``p``, ``compute``/``c`` (``auto``: the region's dtype), ``output``/``o``,
        ``preset``/``ops``, ``table`` (whose op table: ``cpu``/``cuda``), ``fp8`` (a recipe);
        dtype names: ``float32``/``f32``/``fp32``, ``bfloat16``/``bf16``, ``float16``/``f16``/
        ``half``. A bare dtype means ``compute=`` that dtype; a bare preset name selects the
        preset. Then ``;``-separated sections: ``ops fp32=softmax,exp lower=bmm.default``
        (op edits, in order), ``keep float32=LayerNorm|/^head$/`` (a module rule: ``torch.nn``
        type names, other types by import path, already imported, and a ``/regex/``),
        ``fp8 rowwise=Linear|/blocks/ except first/last backend=emulate recipes b=mxfp8``. JSON
        text (``{...}``) goes to :meth:`from_json`.

        Example:
            >>> Policy.parse("bf16; ops fp32=exp; keep float32=LayerNorm; fp8 tensorwise=Linear").fp8_rule.recipe_name
            'tensorwise'

        Raises:
            ValueError: an unknown key, dtype, preset, section, op, kind, module type or option,
                a key given twice, or a malformed section (the message says where).
        """
        if not isinstance(spec, str):
            raise TypeError(f"Policy.parse takes a str, got {type(spec).__name__}")
        if spec.lstrip().startswith("{"):
            return cls.from_json(spec)
        header, sections = parse_sections(spec)
        values: dict[str, Any] = {}
        for part in filter(None, (s.strip() for s in header.split(","))):
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
        return cls(**{**values, **sections})

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
    def from_dict(cls, data: Mapping[str, Any], *, guard: Any = None, controller: Any = None) -> "Policy":
        """Rebuild a policy from :meth:`to_dict`'s data, validated as :meth:`with_ops` and
        :meth:`keep` validate (op names are expanded and checked: see ``op_rules``).

        Module types are looked up among the modules already imported; nothing is imported.
        An fp8 rule's guard or controller is runtime state the data holds only the settings of:
        pass yours (``guard=``/``controller=``, checked against the saved settings) to run the
        policy with it; without one, a new one is built from the settings, with a warning (it
        starts fresh, and only ``policy.fp8_rule.guard``/``.controller`` reaches it to step it).

        Raises:
            ValueError: data of the wrong shape or type, an unknown key, dtype, preset, op,
                cast kind, or a module type whose module is not imported (the message names it);
                a ``guard``/``controller`` the data has no settings for, or other settings.
        """
        _expect(data, Mapping, "a policy", "an object")
        fields = [f.name for f in dataclasses.fields(cls)]
        unknown = set(data) - set(fields)
        if unknown:
            raise ValueError(f"unknown policy field(s) {sorted(map(str, unknown))}; fields: {fields}")
        values = dict(data)
        for key in ("params", "compute", "output"):
            if values.get(key) is not None:
                values[key] = parse_dtype(_expect(values[key], str, f"policy {key!r}", "a dtype name"))
        for key in ("base", "device_type"):
            if values.get(key) is not None:
                _expect(values[key], str, f"policy {key!r}", "a str")
        values["op_rules"] = tuple(
            tuple(_expect(r, (list, tuple), "an op rule", "an [op, kind] pair"))
            for r in _expect(values.get("op_rules", []), (list, tuple), "policy 'op_rules'", "a list"))
        values["module_rules"] = tuple(
            _module_rule_from_dict(r)
            for r in _expect(values.get("module_rules", []), (list, tuple), "policy 'module_rules'", "a list"))
        given = {"guard": guard, "controller": controller}
        if values.get("fp8_rule") is not None:
            values["fp8_rule"] = _fp8_from_dict(values["fp8_rule"], given)
        else:
            _refuse_unused_state(given, "it has no fp8 rule")
        return cls(**values)

    def to_json(self, **json_kwargs: Any) -> str:
        """:meth:`to_dict` as JSON text; ``Policy.from_json(p.to_json()) == p``."""
        json_kwargs.setdefault("indent", 2)
        return json.dumps(self.to_dict(), **json_kwargs)

    @classmethod
    def from_json(cls, text: str | bytes, *, guard: Any = None, controller: Any = None) -> "Policy":
        """Rebuild a policy from :meth:`to_json`'s text, or from an audit's ``report.json``
        (its ``"policy"``); ``Policy.parse`` accepts it too. Validated as :meth:`from_dict`
        (``guard``/``controller``: yours, to run the policy with; see there).

        Raises:
            ValueError: text that is not JSON (or nested too deeply), or not a policy.
        """
        if not isinstance(text, (str, bytes, bytearray)):
            raise ValueError(f"Policy.from_json takes JSON text, got {type(text).__name__}")
        try:
            data = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"not a policy in JSON: {e}") from None
        except RecursionError:
            raise ValueError("not a policy in JSON: nested too deeply") from None
        if isinstance(data, Mapping) and "policy" in data:
            data = data["policy"]  # an audit's report.json
        return cls.from_dict(data, guard=guard, controller=controller)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write :meth:`to_json` to ``path``."""
        with open(path, "w", encoding="utf-8") as f:
            f.write(self.to_json() + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike[str], *, guard: Any = None, controller: Any = None) -> "Policy":
        """Read a policy saved by :meth:`save`, or the ``"policy"`` of an audit's ``report.json``.

        A saved fp8 guard or controller is settings only: pass your ``guard=``/``controller=``
        (the one your loop steps) to run with it; without, a new one is built and a warning says
        so (see :meth:`from_dict`).

        Example:
            >>> policy = mixprec.Policy.load("audit-report/report.json")
            >>> policy = mixprec.Policy.load("policy.json", controller=ctl)  # ctl.step() each step
        """
        with open(path, encoding="utf-8") as f:
            return cls.from_json(f.read(), guard=guard, controller=controller)

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
            ValueError: an unknown op (the message suggests close names), one op in two lists, an
                in-place or ``out=`` overload, or a view (``view``, ``t``, ``detach``, ...: any op
                whose schema returns an alias of an input; cast, it would be a copy).
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
                    rules.append((name, _rule_kind(name, kind)))
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
        controller: Any = None,
        recipes: Mapping[str, Any] | None = None,
    ) -> "Policy":
        """A copy whose selected ``nn.Linear`` layers run their GEMMs in fp8 (no module swap).

        Inside a region, each selected layer's ``linear`` runs :func:`mixprec.fp8.linear` with
        ``recipe`` (``"tensorwise"``, ``"rowwise"``, ``"rowwise_with_gw_hp"`` or a
        :class:`~mixprec.fp8.Float8Recipe`), its input in the compute dtype, its statistics in
        :func:`mixprec.fp8.layer_state` of the module; the rest of the model follows the policy.
        Layers: see :class:`mixprec.Fp8Rule`; ``keep`` rules win. A ``guard``
        (:class:`mixprec.fp8.Guard`) is checked as the model's outermost call starts, and moves
        layers that cross its thresholds back to the compute dtype. A ``controller``
        (:class:`mixprec.Controller`, not with ``guard``) moves each layer up and down a ladder of
        formats from the trend of its statistics, in ``controller.step()``; each layer starts at
        its recipe and is not demoted below it (unless ``Controller(floor=...)``). ``recipes``
        (``{qualified name: recipe}``) gives selected layers their own recipe (as
        :func:`mixprec.audit` with ``fp8="auto"`` recommends); a named layer must be selected and
        eligible for its recipe (ValueError as the model runs). Usable on the class
        too: ``Policy.fp8()`` is ``Policy().fp8()``.

        Example:
            >>> policy = Policy.parse("compute=bf16").fp8("rowwise", guard=mixprec.fp8.Guard(every=50))
            >>> str(Policy.fp8(names=r"^(0|2)$", first_last="fp8", recipes={"2": "mxfp8"}))
            'params=float32,compute=auto; fp8 tensorwise=Linear|/^(0|2)$/ recipes 2=mxfp8'
        """
        rule = Fp8Rule(recipe, types=types, names=names, first_last=first_last, guard=guard,
                       backend=backend, controller=controller, recipes={} if recipes is None else recipes)
        return dataclasses.replace(self, fp8_rule=rule)

    # ----------------------------------------------------------------- queries
    def table(self, device_type: str) -> Mapping[str, str]:
        """The resolved op table ``overload -> cast kind`` for a region on ``device_type``.

        A read-only mapping: a policy is a value, edit it with :meth:`with_ops`.
        """
        return _resolve_table(self.base, self.device_type or device_type, self.op_rules)

    @property
    def acts_on_modules(self) -> bool:
        """Whether the policy does anything per module call (module rules, fp8 layers, ``output=``):
        what needs mixprec's module hooks in a region."""
        return bool(self.module_rules) or self.output is not None or self.fp8_rule is not None

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
        """What the policy does, in one line: the dtypes and preset in :meth:`parse` syntax
        (``compute=auto``: the region's dtype), then ``; ``-separated op edits, module rules and
        the fp8 selection; :meth:`parse` reads it back (``Policy.parse(str(p)) == p``; a guard or
        controller comes back as a new one built from its settings, with a warning).

        Example:
            >>> str(Policy.parse("compute=bf16").with_ops(fp32=["softmax"]).keep(types=nn.LayerNorm))
            'params=float32,compute=bfloat16; ops fp32=softmax; keep float32=LayerNorm'
        """
        parts = [f"params={_dtype_name(self.params)}",
                 f"compute={'auto' if self.compute is None else _dtype_name(self.compute)}"]
        if self.output is not None:
            parts.append(f"output={_dtype_name(self.output)}")
        if self.base != "torch":
            parts.append(f"preset={self.base}")
        if self.device_type is not None:
            parts.append(f"table={self.device_type}")
        return "; ".join([",".join(parts), *format_sections(self)])


def _fp32_forms() -> Mapping[str, str]:
    """The fp32 forms PyTorch uses for ops with a dtype argument (from the CUDA table)."""
    global _FP32_FORMS
    if _FP32_FORMS is None:
        _FP32_FORMS = MappingProxyType({
            name: kind for name, kind in _ops.default_table("cuda").items()
            if kind in ("fp32_set_opt_dtype", "fp32_append_dtype")})
    return _FP32_FORMS


_FP32_FORMS: Mapping[str, str] | None = None

_TABLE_CACHE: dict[tuple[str, str, tuple[tuple[str, str], ...]], Mapping[str, str]] = {}
_EDITS_CACHE: dict[tuple[str, str, tuple[tuple[str, str], ...], str, bool], Mapping[str, str]] = {}
_CANONICAL: "weakref.WeakValueDictionary[tuple[Policy, int, int], Policy]" = weakref.WeakValueDictionary()


def canonical(policy: "Policy") -> "Policy":
    """The one object that stands for ``policy``'s value (and its fp8 guard or controller): the
    object a region inside torch.compile passes to trace time, so that Dynamo's identity guard
    holds for every equal policy. Held weakly: it lives while a policy equal to it does."""
    return policy._canonical  # type: ignore[attr-defined]


def _canonical(policy: "Policy") -> "Policy":
    """One private object per policy value: a region inside torch.compile passes it to trace time,
    so that Dynamo's identity guard holds for every equal policy (see autocast._enter_traced).

    An fp8 rule's guard and controller are runtime state that policy equality leaves out: the key
    names them by identity, so a policy never runs with another policy's guard or controller.
    Interned weakly: the canonical object lives while a policy equal to it does (each holds it as
    ``_canonical``), and the key holds no guard or controller (the policy's stateless twin), so a
    policy rebuilt each step with a fresh Controller leaves nothing behind; while an entry lives,
    its canonical object holds the guard and controller, so their ids stay unique."""
    rule = policy.fp8_rule
    stateless = _twin(policy, _canonical=None)
    if rule is not None and (rule.guard is not None or rule.controller is not None):
        object.__setattr__(stateless, "fp8_rule", dataclasses.replace(rule, guard=None, controller=None))
    key = (stateless, id(rule.guard) if rule else 0, id(rule.controller) if rule else 0)
    try:
        found = _CANONICAL.get(key)
    except TypeError:  # an unhashable field (a custom recipe): guarded by identity
        return policy
    if found is None:
        found = _twin(policy)  # never the caller's object, which Dynamo would guard on
        object.__setattr__(found, "_canonical", found)
        found = _CANONICAL.setdefault(key, found)
    return found


def _twin(policy: "Policy", **changes: Any) -> "Policy":
    """A shallow copy of ``policy`` (its fields as they are: no validation, no interning)."""
    twin = object.__new__(type(policy))
    twin.__dict__.update(policy.__dict__, **changes)
    return twin


def _rebuild(cls: type, values: dict[str, Any]) -> "Policy":
    """Unpickle (or deep-copy) a policy: through the constructor, so it is validated and interned."""
    return cls(**values)


def _state_of(rule: Fp8Rule | None) -> str | None:
    """``"guard"`` or ``"controller"``: the runtime state an fp8 rule holds, if any."""
    if rule is None:
        return None
    return "guard" if rule.guard is not None else "controller" if rule.controller is not None else None


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
        if fp8:  # linear (addmm: transformers' Conv1D) routes to fp8 for the selected layers
            resolved["linear"] = resolved["addmm"] = "fp8"
        edits = _EDITS_CACHE[key] = MappingProxyType(resolved)
    return edits


def _fp8_to_dict(rule: Fp8Rule) -> dict[str, Any]:
    from mixprec import fp8

    from mixprec.fp8._recipe import RECIPE_NAMES

    def named(recipe: Any) -> str:
        if isinstance(recipe, str):
            return recipe
        if recipe.name not in RECIPE_NAMES or fp8.Float8Recipe.from_name(recipe.name) != recipe:
            raise ValueError(f"cannot serialize the custom fp8 recipe {recipe!r}: use a named recipe "
                             f"({', '.join(map(repr, RECIPE_NAMES))})")
        return recipe.name

    recipe = named(rule.recipe)
    guard = None
    if rule.guard is not None:
        guard = {f.name: getattr(rule.guard, f.name) for f in dataclasses.fields(rule.guard) if f.init}
    out = {"recipe": recipe, "types": [_type_path(t) for t in rule.types], "names": rule.names,
           "first_last": rule.first_last, "backend": rule.backend, "guard": guard}
    if rule.controller is not None:  # its settings; its rungs and log are runtime state
        out["controller"] = rule.controller.config()
    if rule.recipes:
        out["recipes"] = {n: named(r) for n, r in rule.recipes}
    return out


def _expect(value: Any, types: type | tuple[type, ...], what: str, shape: str) -> Any:
    """``value`` if it is an instance of ``types``, else a ValueError saying what was expected."""
    if isinstance(value, types) and not isinstance(value, bool):
        return value
    raise ValueError(f"{what} must be {shape}, got {type(value).__name__} {_short(value)}")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _checked_rules(rules: Any) -> tuple[tuple[str, str], ...]:
    """``op_rules`` validated as :meth:`Policy.with_ops` validates: every name an aten op this
    PyTorch has (expanded with :func:`mixprec._ops_names.rule_names`), no in-place or ``out=``
    overload (autocast never casts them: the op would write into a temporary), no view
    (:func:`mixprec._ops_names.check_castable`: a cast view is a copy), a known kind;
    ``"fp32"`` becomes the op's dtype-argument form where PyTorch has one (as ``with_ops`` does).
    """
    if isinstance(rules, (str, bytes)) or not isinstance(rules, (tuple, list)):
        raise ValueError(f"Policy.op_rules must be a tuple of (op, kind) pairs (build them with "
                         f"Policy.with_ops), got {type(rules).__name__}")
    out: list[tuple[str, str]] = []
    for rule in rules:
        if not (isinstance(rule, (tuple, list)) and len(rule) == 2
                and all(isinstance(x, str) for x in rule)):
            raise ValueError(f"an op rule is an (op name, cast kind) pair of strings, got {_short(rule)}")
        name, kind = rule
        if kind not in _ops.CAST_KINDS:
            raise ValueError(f"unknown cast kind {kind!r} for {name}; kinds: {', '.join(_ops.CAST_KINDS)}")
        for overload in rule_names(name):
            check_castable(overload)
            out.append((overload, _rule_kind(overload, kind)))
    return tuple(out)


def _rule_kind(name: str, kind: str) -> str:
    forms = _fp32_forms()
    if kind == "fp32":
        return forms.get(name, "fp32")
    if kind in ("fp32_set_opt_dtype", "fp32_append_dtype") and forms.get(name) != kind:
        raise ValueError(f"{name} has no {kind} form (PyTorch uses it for "
                         f"{', '.join(n for n, k in sorted(forms.items()) if k == kind)}); use 'fp32'")
    return kind


def _unknown_preset(base: Any) -> str:
    close = difflib.get_close_matches(str(base), list(PRESETS), n=1, cutoff=0.6)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return f"unknown op preset {base!r}.{hint} Presets: {', '.join(PRESETS)}"


def _module_rule_from_dict(data: Any) -> ModuleRule:
    _expect(data, Mapping, "a module rule", "an object with dtype, types, names")
    unknown = set(data) - {"dtype", "types", "names"}
    if unknown:
        raise ValueError(f"unknown module rule field(s) {sorted(map(str, unknown))}; fields: dtype, types, names")
    names = data.get("names")
    return ModuleRule(
        parse_dtype(_expect(data.get("dtype", "float32"), str, "a module rule's dtype", "a dtype name")),
        types=tuple(_import_type(t) for t in _expect(data.get("types", []), (list, tuple),
                                                     "a module rule's types", "a list of type paths")),
        names=None if names is None else _expect(names, str, "a module rule's names", "a regex str"),
    )


def _fp8_from_dict(data: Any, given: Mapping[str, Any]) -> Fp8Rule:
    _expect(data, Mapping, "policy 'fp8_rule'", "an object")
    known = {f.name for f in dataclasses.fields(Fp8Rule)}
    unknown = set(data) - known
    if unknown:
        raise ValueError(f"unknown fp8_rule field(s) {sorted(map(str, unknown))}; fields: {sorted(known)}")
    values = dict(data)
    for key in ("recipe", "first_last", "backend"):
        if key in values:
            _expect(values[key], str, f"fp8_rule {key!r}", "a str")
    if values.get("names") is not None:
        _expect(values["names"], str, "fp8_rule 'names'", "a regex str")
    values["types"] = tuple(_import_type(t) for t in _expect(
        values.get("types", ["torch.nn.modules.linear.Linear"]), (list, tuple), "fp8_rule 'types'",
        "a list of type paths"))
    for state, build in (("guard", _guard_from_settings), ("controller", _controller_from_settings)):
        mine = given[state]
        if values.get(state) is None:
            if mine is not None:
                raise ValueError(f"the policy's fp8 rule has no {state}: attach yours with "
                                 f"policy.fp8(..., {state}=...), not from_json/load({state}=...)")
            continue
        saved = build(values[state])
        if mine is None:
            _warn_new_state(state, saved, "Policy.load/from_json")
            values[state] = saved
            continue
        if type(mine) is not type(saved) or _settings(mine) != _settings(saved):
            raise ValueError(f"the {state} passed has other settings than the policy's saved {state}: "
                             f"{_settings(mine)} != {_settings(saved)}; pass one built with the saved settings")
        values[state] = mine
    if "recipes" in values:
        recipes = _expect(values["recipes"], Mapping, "fp8_rule 'recipes'", "an object {layer name: recipe name}")
        for name, recipe in recipes.items():
            _expect(recipe, str, f"fp8_rule recipes[{name!r}]", "a recipe name")
        values["recipes"] = dict(recipes)
    return Fp8Rule(**values)


def _guard_from_settings(data: Any) -> Any:
    from mixprec import fp8

    guard = _expect(data, Mapping, "fp8_rule 'guard'", "an object")
    fields = {f.name for f in dataclasses.fields(fp8.Guard) if f.init}
    if set(guard) - fields:
        raise ValueError(f"unknown fp8 guard field(s) {sorted(map(str, set(guard) - fields))}; "
                         f"fields: {sorted(fields)}")
    return fp8.Guard(**guard)


def _controller_from_settings(data: Any) -> Any:
    from mixprec import fp8

    return fp8.Controller.from_config(_expect(data, Mapping, "fp8_rule 'controller'", "an object"))


def _warn_new_state(state: str, built: Any, where: str) -> None:
    """Say that a guard or controller was built from saved settings (nothing of the caller's steps it)."""
    fix = (f"pass {state}=your_{state} to Policy.load/from_json to run with yours" if where != "Policy.parse"
           else f"to run with yours, attach it: policy.fp8(..., {state}=your_{state})")
    warnings.warn(
        f"mixprec.Policy: {where} built a new {type(built).__name__} from the policy's saved {state} "
        f"settings (fresh: no decisions yet, and nothing of yours steps it; step it as "
        f"policy.fp8_rule.{state}.step()); {fix}", UserWarning, stacklevel=5)


def _settings(state: Any) -> dict[str, Any]:
    """A guard's or controller's settings, as saved in a policy file."""
    if hasattr(state, "config"):
        return state.config()
    return {f.name: getattr(state, f.name) for f in dataclasses.fields(state) if f.init}


def _refuse_unused_state(given: Mapping[str, Any], why: str) -> None:
    for state, value in given.items():
        if value is not None:
            raise ValueError(f"{state}= given, but the policy cannot use it: {why}; attach it with "
                             f"policy.fp8(..., {state}=...)")


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


def _import_type(path: Any, strict: bool = True) -> Any:
    """The type ``"package.module.Class"`` (or a nested ``Outer.Inner``) names, looked up in the
    modules already imported (``sys.modules``): a policy file never imports (runs) a module.

    Raises (``strict``):
        ValueError: not a dotted str, its module is not imported (the message names the import
            to run first), or it names no ``nn.Module`` subclass.
    """
    if not isinstance(path, str) or "." not in path:
        if not strict:
            return None
        raise ValueError(f"a module rule type is a dotted path such as "
                         f"'torch.nn.modules.normalization.LayerNorm', got {_short(path)}")
    parts, obj = path.split("."), None
    for i in range(len(parts) - 1, 0, -1):  # the longest imported module prefix
        module = sys.modules.get(".".join(parts[:i]))
        if module is None:
            continue
        obj = module
        for attr in parts[i:]:  # no getattr: a module's __getattr__ may import
            obj = vars(obj).get(attr) if hasattr(obj, "__dict__") else None
        break
    else:
        if strict:
            raise ValueError(
                f"module rule type {path!r}: module {'.'.join(parts[:-1])!r} is not imported; "
                f"mixprec does not import modules named in a policy: run "
                f"`import {'.'.join(parts[:-1])}` before loading it")
    if strict and not (isinstance(obj, type) and issubclass(obj, nn.Module)):
        raise ValueError(f"module rule type {path!r} is not an importable nn.Module subclass (looked "
                         f"up in the imported module {'.'.join(parts[:i])!r})")
    return obj


_DEFAULT = Policy()
