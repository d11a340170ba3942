"""Precision policies: immutable values that say which dtype each op and module computes in.

A :class:`Policy` is a small frozen dataclass in the style of deepmind/jmp: the dtypes of
parameters, compute and outputs, a base op table (``"torch"``: PyTorch's autocast lists for the
region's device, or ``"fp32-numerics"``), edits to that table, and module rules. Every edit
returns a new policy; nothing is mutated.

Where the parts live: the fp8 rule and its Guard/Controller attachment in :mod:`mixprec.policy._rule`,
the checked JSON codec in :mod:`mixprec.policy._codec`, the one-line text form in
:mod:`mixprec.policy._text`; :func:`canonical` gives the one object standing for a policy's value.

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

import copy
import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

import torch
from torch import nn

from mixprec import ops as _ops
from mixprec.policy._codec import check_dtype, checked_op_rules, dtype_name, module_types, parse_dtype, rule_kind
from mixprec._modules import ModuleRule
from mixprec._ops_names import OpLike, canonical_names
from mixprec.policy._text import format_sections, parse_header, parse_sections
from mixprec._tree import cast_tree, refuse_tracing, tracing as _tracing
from mixprec.policy._interning import canonical, intern
from mixprec.policy._json import policy_to_dict, policy_values
from mixprec.policy._rule import Fp8Rule
from mixprec.policy._tables import PRESETS, resolve_edits, resolve_table, unknown_preset

__all__ = ["Policy", "PRESETS", "parse_dtype", "canonical"]


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
        refuse_tracing("policies")
        check_dtype("params", self.params, allow_none=False)
        check_dtype("compute", self.compute, allow_none=True)
        check_dtype("output", self.output, allow_none=True)
        if not isinstance(self.base, str) or self.base not in PRESETS:
            raise ValueError(unknown_preset(self.base))
        if self.device_type is not None:
            if not isinstance(self.device_type, str):
                raise ValueError(f"Policy.device_type must be None, 'cpu' or 'cuda', got {self.device_type!r}")
            _ops.default_table(self.device_type)  # validates the device type
        object.__setattr__(self, "op_rules", checked_op_rules(self.op_rules))
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
        object.__setattr__(self, "_canonical", intern(self))

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickle the fields (a guard's or controller's settings with them); unpickling validates and
        interns again. A policy built with a live Guard or Controller (``Policy.fp8(controller=ctl)``)
        is refused: that object is runtime state bound to the model's layers (a pickled copy would
        be one nothing steps).

        Raises:
            TypeError: the policy carries a Guard or Controller; the message says what to save.
        """
        rule = self.fp8_rule
        if rule is not None and rule.live is not None:
            state = rule.kind
            raise TypeError(
                f"cannot pickle a mixprec.Policy carrying a live fp8 {state} (runtime state bound to the model's "
                f"layers): pickle Policy.from_json(policy.to_json()) (its settings), and save the {state}'s "
                f"state_dict(); restore by attaching it to the model ({state}.attach(model)) and "
                f"{state}.load_state_dict(...)")
        return _rebuild, (type(self), {f.name: getattr(self, f.name) for f in dataclasses.fields(self)})

    def __copy__(self) -> "Policy":
        return self  # an immutable value

    def __deepcopy__(self, memo: dict[int, Any]) -> "Policy":
        """A copy whose guard or controller (if any) is a deep copy too."""
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
        return cls(**parse_header(header, sections, spec, PRESETS))

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
        return policy_to_dict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, guard: Any = None, controller: Any = None) -> "Policy":
        """Rebuild a policy from :meth:`to_dict`'s data, validated as :meth:`with_ops` and
        :meth:`keep` validate (op names are expanded and checked: see ``op_rules``).

        Module types are looked up among the modules already imported; nothing is imported.
        An fp8 rule's guard or controller is held as its settings: the live one a run steps is
        attached to the model (``ctl.attach(model)``, checked against these settings as the model
        runs). ``guard=``/``controller=`` (the older spelling) gives the policy yours to carry,
        checked against the saved settings.

        Raises:
            ValueError: data of the wrong shape or type, an unknown key, dtype, preset, op,
                cast kind, or a module type whose module is not imported (the message names it);
                a ``guard``/``controller`` the data has no settings for, or other settings.
        """
        return cls(**policy_values(data, [f.name for f in dataclasses.fields(cls)], guard, controller))

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

        A saved fp8 guard or controller is settings only: build the live one from them and
        attach it to the model (see :meth:`from_dict`).

        Example:
            >>> policy = mixprec.Policy.load("policy.json")  # doctest: +SKIP
            >>> ctl = mixprec.Controller(policy.fp8_rule.controller).attach(model)  # doctest: +SKIP

        Raises:
            OSError: the file cannot be read.
            ValueError: it is not UTF-8 text, or not a policy's JSON (the message names the field).
        """
        with open(path, "rb") as f:
            raw = f.read()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"Policy.load: {os.fspath(path)!r} is not a UTF-8 text file ({e.reason} at byte "
                             f"{e.start}): pass a policy saved by Policy.save or an audit's report.json") from None
        return cls.from_json(text, guard=guard, controller=controller)

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
                    rules.append((name, rule_kind(name, kind)))
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
        is lowered, for a half dtype its ops lower to that dtype instead of the region's. A
        ``ValueError`` says what to pass for ``types`` that are no module classes (a str, a module).
        """
        rule = ModuleRule(parse_dtype(dtype), types=module_types(types, "Policy.keep"), names=names)
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
        Layers: see :class:`mixprec.Fp8Rule`; ``keep`` rules win. ``guard``/``controller`` (one
        at most): the settings (:class:`mixprec.fp8.GuardSettings`,
        :class:`mixprec.fp8.ControllerSettings`, a dict of them, or ``live.settings``) of the
        Guard or Controller the model runs under: the live one is attached to the model
        (``ctl.attach(model)``) and checked against them as the model runs. A Guard moves layers
        that cross its thresholds back to the compute dtype; a Controller moves each layer up and
        down a ladder of formats, in ``ctl.step()``; each layer starts at its recipe and is not
        demoted below it (unless ``floor=``). Given the live object itself (the older spelling),
        the policy carries it beside its value for a model without one attached. ``recipes``
        (``{qualified name: recipe}``) gives selected layers their own recipe (as
        :func:`mixprec.audit` with ``fp8="auto"`` recommends); a named layer must be selected and
        eligible for its recipe (ValueError as the model runs). Usable on the class
        too: ``Policy.fp8()`` is ``Policy().fp8()``.

        Example:
            >>> policy = Policy.parse("compute=bf16").fp8("rowwise", guard={"every": 50})
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
        return resolve_table(self.base, self.device_type or device_type, self.op_rules)

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
            {'mm': 'fp32', 'mm.dtype': 'fp32'}
        """
        return resolve_edits(self.base, self.device_type or device_type, self.op_rules, device_type,
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
        controller comes back as a new one built from its settings, with a warning; a custom fp8
        recipe as ``<custom NAME>``, which :meth:`parse` refuses: it has no text form).

        Example:
            >>> str(Policy.parse("compute=bf16").with_ops(fp32=["softmax"]).keep(types=nn.LayerNorm))
            'params=float32,compute=bfloat16; ops fp32=softmax; keep float32=LayerNorm'
        """
        parts = [f"params={dtype_name(self.params)}",
                 f"compute={'auto' if self.compute is None else dtype_name(self.compute)}"]
        if self.output is not None:
            parts.append(f"output={dtype_name(self.output)}")
        if self.base != "torch":
            parts.append(f"preset={self.base}")
        if self.device_type is not None:
            parts.append(f"table={self.device_type}")
        return "; ".join([",".join(parts), *format_sections(self)])


def _rebuild(cls: type, values: dict[str, Any]) -> "Policy":
    """Unpickle (or deep-copy) a policy: through the constructor, so it is validated and interned."""
    return cls(**values)


_DEFAULT = Policy()
