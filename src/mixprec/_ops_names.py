"""Naming aten ops: ``"softmax.int"``, ``"mm"``, ``torch.mm`` or ``torch.ops.aten.mm.default``.

Canonical names are ``packet`` for the default overload and ``packet.overload`` otherwise, the
spelling of PyTorch's ``autocast_mode.cpp``.
"""

from __future__ import annotations

import difflib
import functools
import operator
from typing import Any, Callable, Union

import torch

OpLike = Union[str, Callable[..., Any], "torch._ops.OpOverload", "torch._ops.OpOverloadPacket"]

__all__ = ["OpLike", "canonical_names", "check_castable", "op_overload", "rule_names"]

# Python callables whose ``__name__`` differs from the aten op they call.
_ALIASES: dict[str, tuple[str, ...]] = {  # a callable's __name__ -> the aten ops it reaches
    "cross_entropy": ("cross_entropy_loss",),
    "__matmul__": ("matmul",),
    "__rmatmul__": ("matmul",),
    "norm": ("norm", "linalg_vector_norm"),  # torch.norm, Tensor.norm: linalg_vector_norm since torch 2.0
}


@functools.lru_cache(maxsize=1)
def _dispatcher_names() -> frozenset[str]:
    """Canonical names of every aten overload the dispatcher knows (not TorchScript-only ones)."""
    return frozenset(
        n[len("aten::") :] for n in torch._C._dispatch_get_all_op_names() if n.startswith("aten::")
    )


@functools.lru_cache(maxsize=1)
def _aten_packets() -> frozenset[str]:
    return frozenset(n.split(".")[0] for n in _dispatcher_names())


def _is_functional(overload: "torch._ops.OpOverload") -> bool:
    schema = overload._schema
    return not schema.is_mutable and not schema.name.endswith("_")


def _check_functional(name: str, overload: "torch._ops.OpOverload") -> None:
    if not _is_functional(overload):
        raise ValueError(
            f"{name} writes into its arguments (in-place or out=); autocast never casts such ops. "
            f"Name the functional overload instead"
        )


def check_castable(name: str) -> None:
    """Refuse an edit of an overload whose output aliases an input (a view: ``view``, ``select``,
    ``t``, ``detach``, ``split``, ...), read from the op's schema (an alias annotation on a
    return, ``-> Tensor(a)``): autocast would cast its input, so the "view" would be a copy and
    writes through it (``.data`` updates, ``x.view(-1)[0] = ...``) would be lost.

    Raises:
        ValueError: the overload returns an alias of an input.
    """
    overload = op_overload(name)
    if overload is not None and any(r.alias_info is not None for r in overload._schema.returns):
        raise ValueError(
            f"{name} returns a view of its input ({overload._schema}); a policy cannot cast it: the "
            f"view would become a cast copy and writes through it would be lost. Views run in their "
            f"input's dtype; edit the op that computes on them instead"
        )


def op_overload(name: str) -> "torch._ops.OpOverload | None":
    """The ``OpOverload`` of a canonical name, or ``None`` if this PyTorch lacks it."""
    if name not in _dispatcher_names():
        return None
    packet_name, _, overload = name.partition(".")
    packet = getattr(torch.ops.aten, packet_name, None)
    if packet is None:
        return None
    try:
        return getattr(packet, overload or "default")
    except AttributeError:
        return None


def _unknown(what: object) -> ValueError:
    text = str(what)
    close = difflib.get_close_matches(text.split(".")[0], sorted(_aten_packets()), n=5)
    hint = f" Did you mean: {', '.join(close)}?" if close else ""
    return ValueError(
        f"unknown op {what!r}: name an aten op such as 'mm' or 'softmax.int', a torch callable "
        f"such as torch.mm, or torch.ops.aten.<op>.<overload>.{hint}"
    )


def _packet_overloads(packet_name: str) -> list[str]:
    packet = getattr(torch.ops.aten, packet_name)
    names = []
    known = _dispatcher_names()
    for ov in packet.overloads():
        name = packet_name if ov == "default" else f"{packet_name}.{ov}"
        if name in known and _is_functional(getattr(packet, ov)):
            names.append(name)
    return names


def _strip_prefix(name: str) -> str:
    name = name.strip()
    for prefix in ("aten::", "aten.", "torch.ops.aten."):
        if name.startswith(prefix):
            name = name[len(prefix) :]
    return name


def rule_names(name: str) -> list[str]:
    """The overloads a name in a policy's ``op_rules`` (its stored and JSON form) stands for.

    There a canonical overload name is that one overload (``"mm"`` is ``mm.default``, as in
    :func:`mixprec.ops.default_table`); a packet name without a default overload
    (``"softmax"``) stands for all its functional overloads, as in :meth:`Policy.with_ops`.

    Example:
        >>> rule_names("mm"), rule_names("softmax")
        (['mm'], ['softmax.int'])

    Raises:
        ValueError: not a str, an unknown op, or an in-place/``out=`` overload.
    """
    if not isinstance(name, str):
        raise ValueError(f"an op rule names its op with a str, got {type(name).__name__} {name!r}")
    bare = _strip_prefix(name)
    if "." not in bare and op_overload(bare) is not None:
        return canonical_names(f"{bare}.default")
    return canonical_names(bare)


def canonical_names(op: OpLike) -> list[str]:
    """Canonical overload names an op reference stands for.

    A bare packet name (``"softmax"``, ``torch.softmax``) stands for all its functional overloads;
    ``"softmax.int"`` or ``torch.ops.aten.softmax.int`` for that one overload.

    Raises:
        ValueError: the name is not an aten op; the message lists close matches.
    """
    if isinstance(op, torch._ops.OpOverload):
        if op.namespace != "aten":
            raise ValueError(f"only aten ops can be listed in a policy, got {op}")
        packet, ov = op._schema.name.split("::")[1], op._overloadname
        name = packet if ov == "default" else f"{packet}.{ov}"
        _check_functional(name, op)
        return [name]
    if isinstance(op, torch._ops.OpOverloadPacket):
        return _packet_overloads(op._qualified_op_name.split("::")[1])
    if isinstance(op, str):
        name = _strip_prefix(op)
        packet, _, ov = name.partition(".")
        if packet not in _aten_packets():
            raise _unknown(op)
        if not ov:
            names = _packet_overloads(packet)
            if not names:
                raise ValueError(f"aten op {packet!r} has no functional overload to cast")
            return names
        if ov == "default":
            name = packet
        overload = op_overload(name)
        if overload is None:
            raise ValueError(
                f"aten op {packet!r} has no overload {ov!r}; overloads: "
                f"{', '.join(getattr(torch.ops.aten, packet).overloads())}"
            )
        _check_functional(name, overload)
        return [name]
    if op is operator.matmul:
        return canonical_names("matmul")
    if callable(op):
        fname = getattr(op, "__name__", None)
        if fname is None:
            raise _unknown(op)
        targets = _ALIASES.get(fname, (fname,))
        if targets[0].split(".")[0] not in _aten_packets():
            raise _unknown(fname)
        return [name for target in targets for name in canonical_names(target)]
    raise TypeError(f"an op is a str, a torch callable or an OpOverload, got {type(op).__name__}")
