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

Which PyTorch: the tables are 2.13's (``TABLES_TORCH``). The first time a device's table is
used, :func:`check_tables` compares it with the overloads the running PyTorch registers at that
autocast key (one dispatcher query, about a millisecond) and warns (:class:`OpTableWarning`) when
they differ, or when the running version is another one (then the kinds are unverified: only
membership can be read from the dispatcher).
"""

from __future__ import annotations

import sys
import warnings
from types import MappingProxyType
from typing import Literal, Mapping

import torch

from mixprec.ops import cpu, cuda

CastKind = Literal[
    "lower", "fp32", "fp32_set_opt_dtype", "fp32_append_dtype", "promote", "banned", "passthrough"
]
CAST_KINDS: tuple[str, ...] = CastKind.__args__  # type: ignore[attr-defined]

__all__ = ["CAST_KINDS", "CastKind", "default_table", "fp32_numerics_table", "BANNED_MESSAGES",
           "TABLES_TORCH", "OpTableWarning", "check_tables"]

#: The PyTorch release whose ``autocast_mode.cpp`` the tables copy (major, minor).
TABLES_TORCH: tuple[int, int] = (2, 13)
_KEYS = {"cpu": "AutocastCPU", "cuda": "AutocastCUDA"}


class OpTableWarning(RuntimeWarning):
    """The running PyTorch's autocast ops differ from mixprec's tables, or are unverified."""


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
    """PyTorch's autocast table for ``device_type`` (``"cpu"`` or ``"cuda"``): overload -> kind.

    The first call per device checks the table against the running PyTorch (:func:`check_tables`).
    """
    try:
        table = MappingProxyType(_DEFAULTS[device_type])
    except (KeyError, TypeError):
        raise ValueError(
            f"mixprec has op tables for {sorted(_DEFAULTS)}, not {device_type!r}"
        ) from None
    if device_type not in _checked:
        _checked.add(device_type)
        message = check_tables(device_type)
        if message is not None:
            warnings.warn(message, OpTableWarning, stacklevel=2)
    return table


_checked: set[str] = set()


def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def _registered(device_type: str) -> set[str]:
    """The overloads the running PyTorch registers at the device's autocast key, without the
    ones only mixprec registered there (an edit of an op PyTorch's table lacks)."""
    key = _KEYS[device_type]
    names = {n.removeprefix("aten::") for n in torch._C._dispatch_get_registrations_for_dispatch_key(key)
             if n.startswith("aten::")}
    kernels = sys.modules.get("mixprec.engine.kernels")  # loaded once a region edited ops
    return names - (set() if kernels is None else kernels.added(device_type))


def check_tables(device_type: str, *, registered: set[str] | None = None,
                 version: tuple[int, int] | None = None) -> str | None:
    """Why the ``device_type`` table may not be the running PyTorch's, or ``None`` when it is.

    Compares the table's overloads with ``registered`` (default: what PyTorch registers at the
    device's autocast key) and ``version`` (default: the running ``torch.__version__``) with
    :data:`TABLES_TORCH`. Cast kinds cannot be read from the dispatcher: on another version they
    are reported unverified.

    Example:
        >>> check_tables("cpu") is None   # on PyTorch 2.13
        True
    """
    table = _DEFAULTS[device_type]
    registered = _registered(device_type) if registered is None else registered
    version = _torch_version() if version is None else version
    missing, extra = sorted(set(table) - registered), sorted(registered - set(table))
    tables = f"mixprec's {device_type} op tables are PyTorch {TABLES_TORCH[0]}.{TABLES_TORCH[1]}'s"
    running = f"torch {version[0]}.{version[1]}"
    if missing or extra:
        def listed(names: list[str]) -> str:
            return ", ".join(names[:8]) + (f" (+{len(names) - 8} more)" if len(names) > 8 else "")

        return (f"{tables}, but {running} registers other {_KEYS[device_type]} ops"
                + (f"; not autocast here: {listed(missing)}" if missing else "")
                + (f"; autocast here, not in mixprec's table: {listed(extra)}" if extra else "")
                + ". Policy edits of these ops, the fp32-numerics preset and Policy.table() may not "
                "match this PyTorch; install torch==2.13.* (the tested version)")
    if version != TABLES_TORCH:
        return (f"{tables}; {running} registers the same autocast ops, but their cast kinds are "
                "not verified on it (mixprec's tests compare every op with torch.autocast on "
                "2.13); install torch==2.13.* or run tests/engine/test_autocast_ops.py on this version")
    return None


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
