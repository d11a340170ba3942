"""The collectives of a Guard or Controller check: the same calls, in the same order, on every rank.

A check's statistics are one row per layer, all-reduced (MAX). The rows must be the same layers
in the same order on every rank, whatever each rank's forwards were: a rank that has not run a
forward yet (it skipped its first micro-batches) may know fewer layers, or none. So a check,
when ``torch.distributed`` is initialized with more than one rank, always issues:

1. one all-reduce (MAX) of a small int64 header: the number of layers the rank knows, a CRC of
   their names (both also negated, so the MAX gives the minimum too) and a code the caller adds
   (the controller's compute dtype);
2. only when the header shows that the ranks know different layers (every rank sees the same
   reduced header, so every rank takes this branch or none): one ``all_gather_object`` of each
   rank's layer names and their per-layer metadata; every rank then uses the union of the names;
3. one all-reduce (MAX) of the rows, for the union (a layer a rank does not know contributes
   its neutral row), unless no rank knows any layer.

"Every rank" is every rank of the group the caller agrees over (``group``: ``"default"``, the
world, or a ProcessGroup, or ``(DeviceMesh, dim_name)``: :mod:`mixprec._groups`); ranks outside
it issue none of these, and a rank that calls with a group it is not in gets a ValueError.
"""

from __future__ import annotations

import zlib
from typing import Any, Callable, Mapping

import torch

from mixprec._groups import DEFAULT, resolve, size

__all__ = ["all_reduce_max", "agree_on_layers", "distributed"]


def distributed(group: Any = DEFAULT) -> bool:
    """Whether more than one rank agrees over ``group`` (the default group: ``torch.distributed``
    is initialized with more than one rank)."""
    return size(group) > 1


def all_reduce_max(t: torch.Tensor, group: Any = DEFAULT) -> torch.Tensor:
    """``t`` all-reduced (MAX) over ``group`` (``t`` itself when it has one rank); a copy, on
    ``t``'s device (through the CPU on gloo)."""
    import torch.distributed as dist

    if not distributed(group):
        return t
    pg = resolve(group, "all_reduce_max")
    on_cpu = dist.get_backend(pg) == "gloo" and t.device.type != "cpu"
    buf = t.cpu() if on_cpu else t.clone()
    dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=pg)
    return buf.to(t.device) if on_cpu else buf


def _header_device(pg: Any) -> torch.device:
    import torch.distributed as dist

    if dist.get_backend(pg) == "gloo" or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def agree_on_layers(names: list[str], metadata: Callable[[], Mapping[str, Any]], code: int = 0,
                    group: Any = DEFAULT) -> tuple[list[str], dict[str, Any], int]:
    """The layer names every rank of ``group`` uses at this check (sorted), the metadata of the names this
    rank did not know (from the lowest rank that knows each, ``metadata()`` there: called only
    when the ranks disagree) and ``code`` reduced (MAX). Not distributed: ``names``, ``{}``,
    ``code``, no collective. Distributed: collectives 1 and 2 of the module docstring.

    Example:
        >>> agree_on_layers(["b", "a"], dict, 3)
        (['a', 'b'], {}, 3)
    """
    import torch.distributed as dist

    names = sorted(names)
    if not distributed(group):
        return names, {}, code
    pg = resolve(group, "agree_on_layers")
    crc = zlib.crc32("\0".join(names).encode())
    header = torch.tensor([len(names), crc, -len(names), -crc, code], dtype=torch.int64, device=_header_device(pg))
    dist.all_reduce(header, op=dist.ReduceOp.MAX, group=pg)
    count, crc_max, count_min, crc_min, code = header.tolist()
    if count == -count_min and crc_max == -crc_min:
        return names, {}, code
    gathered: list[Any] = [None] * dist.get_world_size(pg)
    dist.all_gather_object(gathered, (names, dict(metadata())), group=pg)
    known, missing = set(names), {}
    for rank_names, rank_meta in gathered:
        for name in rank_names:
            if name not in known and name not in missing:
                missing[name] = rank_meta.get(name)
    return sorted(known | set(missing)), missing, code
