"""A policy's op tables, resolved once per value: the base table of a device with the policy's op
edits (:func:`resolve_table`), and what a region must change of PyTorch's own table
(:func:`resolve_edits`). Caches keyed by the parts of the value that decide them."""

from __future__ import annotations

import difflib
from types import MappingProxyType
from typing import Any, Mapping

from mixprec import ops as _ops

__all__ = ["PRESETS", "resolve_edits", "resolve_table", "unknown_preset"]

PRESETS: dict[str, str] = {
    "torch": "PyTorch's autocast op lists for the region's device (the default)",
    "fp32-numerics": (
        "the device's lists plus CUDA's float32 list: softmax, log_softmax, norms, exp/log/pow, "
        "sums and losses in float32, on CPU too"
    ),
}

_TABLE_CACHE: dict[tuple[str, str, tuple[tuple[str, str], ...]], Mapping[str, str]] = {}
_EDITS_CACHE: dict[tuple[str, str, tuple[tuple[str, str], ...], str, bool], Mapping[str, str]] = {}


def resolve_table(base: str, device_type: str, rules: tuple[tuple[str, str], ...]) -> Mapping[str, str]:
    """The op table ``overload -> cast kind`` of preset ``base`` on ``device_type`` with ``rules`` applied."""
    key = (base, device_type, rules)
    table = _TABLE_CACHE.get(key)
    if table is None:
        start = _ops.default_table(device_type) if base == "torch" else _ops.fp32_numerics_table(device_type)
        resolved = dict(start)
        for name, kind in rules:
            resolved[name] = kind
        table = _TABLE_CACHE[key] = MappingProxyType(resolved)
    return table


def resolve_edits(base: str, table_device: str, rules: tuple[tuple[str, str], ...],
                   region_device: str, fp8: bool) -> Mapping[str, str]:
    """What a region on ``region_device`` runs differently from PyTorch's own table (``fp8``: the
    linear ops route to fp8 too)."""
    key = (base, table_device, rules, region_device, fp8)
    edits = _EDITS_CACHE.get(key)
    if edits is None:
        table = resolve_table(base, table_device, rules)
        native = _ops.default_table(region_device)
        names = set(table) | set(native)
        resolved = {n: table.get(n, "passthrough") for n in sorted(names)
                    if table.get(n, "passthrough") != native.get(n, "passthrough")}
        if fp8:  # linear (addmm: transformers' Conv1D) routes to fp8 for the selected layers
            resolved["linear"] = resolved["addmm"] = "fp8"
        edits = _EDITS_CACHE[key] = MappingProxyType(resolved)
    return edits


def unknown_preset(base: Any) -> str:
    """The error message for an unknown preset, with the closest name."""
    close = difflib.get_close_matches(str(base), list(PRESETS), n=1, cutoff=0.6)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return f"unknown op preset {base!r}.{hint} Presets: {', '.join(PRESETS)}"
