"""Op tables: which aten overloads autocast runs in lower precision, in float32, or promoted.

One module per device (``cpu``, ``cuda``), each a plain listing of ``aten`` overload names in the
order and grouping of PyTorch's ``aten/src/ATen/autocast_mode.cpp``, so a diff against a new
PyTorch release is a diff of two lists. ``"mm"`` names the default overload, ``"softmax.int"``
a named one.

The cast kinds (``CastKind``) are PyTorch's cast policies:

- ``lower``: cast eligible floating inputs to the region's low-precision dtype.
- ``fp32``: cast eligible floating inputs to float32.
- ``fp32_set_opt_dtype``: if the first input is eligible and the op's ``dtype`` argument is unset,
  set it to float32 (softmax, sum, cumsum, ...: computed in fp32 without a copy of the input).
- ``fp32_append_dtype``: redispatch to the overload with a ``dtype`` argument, set to float32
  (``norm``).
- ``promote``: cast eligible inputs to the widest floating dtype among them.
- ``banned``: raise (``binary_cross_entropy`` on CUDA: unsafe in fp16).
- ``passthrough``: run in the dtypes the op is given (what every op on no list does).
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Literal, Mapping

from mixprec.ops import cpu, cuda

CastKind = Literal[
    "lower", "fp32", "fp32_set_opt_dtype", "fp32_append_dtype", "promote", "banned", "passthrough"
]
CAST_KINDS: tuple[str, ...] = CastKind.__args__  # type: ignore[attr-defined]

__all__ = ["CAST_KINDS", "CastKind", "default_table", "fp32_numerics_table", "BANNED_MESSAGES"]


def _table(module) -> dict[str, str]:
    table: dict[str, str] = {}
    for kind, names in (
        ("lower", module.LOWER),
        ("fp32", module.FP32),
        ("fp32_set_opt_dtype", getattr(module, "FP32_SET_OPT_DTYPE", ())),
        ("fp32_append_dtype", tuple(getattr(module, "FP32_APPEND_DTYPE", {}))),
        ("promote", module.PROMOTE),
        ("banned", tuple(getattr(module, "BANNED", {}))),
    ):
        for name in names:
            if name in table:
                raise RuntimeError(f"op table {module.__name__}: {name} listed twice")
            table[name] = kind
    return table


_DEFAULTS = {"cpu": _table(cpu), "cuda": _table(cuda)}

#: ``fp32_append_dtype`` ops: registered overload -> overload with the dtype argument.
APPEND_DTYPE_TARGETS: Mapping[str, str] = MappingProxyType(dict(cuda.FP32_APPEND_DTYPE))
#: ``banned`` ops: overload -> the error message raised.
BANNED_MESSAGES: Mapping[str, str] = MappingProxyType(dict(cuda.BANNED))


def default_table(device_type: str) -> Mapping[str, str]:
    """PyTorch's autocast table for ``device_type`` (``"cpu"`` or ``"cuda"``): overload -> kind."""
    try:
        return MappingProxyType(_DEFAULTS[device_type])
    except KeyError:
        raise ValueError(
            f"mixprec has op tables for {sorted(_DEFAULTS)}, not {device_type!r}"
        ) from None


def fp32_numerics_table(device_type: str) -> Mapping[str, str]:
    """The ``"fp32-numerics"`` preset: the device's table plus CUDA's float32 list.

    On CPU this adds what the CUDA list keeps in fp32 and the CPU list does not: softmax and
    log_softmax, layer/group/rms norms, exp/log/pow and friends, sums, products and the losses.
    """
    table = dict(_DEFAULTS[device_type] if device_type in _DEFAULTS else default_table(device_type))
    for name, kind in _DEFAULTS["cuda"].items():
        if kind.startswith("fp32") and table.get(name) not in ("lower",):
            table[name] = kind
    return MappingProxyType(table)
