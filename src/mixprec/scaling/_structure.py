"""The canonical structure of per-layer scaling (which region each cut point and parameter
belongs to), by name, for :meth:`mixprec.scaling.layerwise.Layerwise.state_dict`.

The graph walks learn it step by step (a skipped block joins where the step that first ran it
found it), so a run resumed from a checkpoint cannot learn it again from its next step: the
checkpoint carries it. Regions are named by their cut point (``None``: the top region, above
every cut point); region ``r > 0`` lies under cut point ``r - 1``.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence


class Structure(NamedTuple):
    """``parents[k]``: the region cut point ``k``'s output arrives in; ``known``: the cut points
    a walk reached; ``regular``: those one regular forward runs; ``shared``: a parameter reached
    from several regions (walk every step); ``regions``: parameter name -> region; ``placed``:
    the parameters whose region a walk saw (not guessed from the module that owns them)."""

    parents: list[int]
    known: set[int]
    regular: list[int]
    shared: bool
    regions: dict[str, int]
    placed: set[str]


def encode(structure: Structure, cuts: Sequence[str]) -> dict[str, Any]:
    """``structure`` with cut points and regions by name (plain lists, dicts, str, bool, None)."""

    def region(r: int) -> str | None:
        return None if r == 0 else cuts[r - 1]

    return {
        "parent": [region(p) for p in structure.parents],
        "known": [cuts[k] for k in sorted(structure.known)],
        "regular": [cuts[k] for k in structure.regular],
        "shared": bool(structure.shared),
        "regions": {name: region(r) for name, r in structure.regions.items()},
        "placed": sorted(structure.placed),
    }


def decode(saved: Any, cuts: Sequence[str]) -> Structure:
    """The :class:`Structure` of :func:`encode`'s output over the cut points ``cuts``.

    Raises:
        ValueError: a key is missing, a name is not one of ``cuts``, or the parents do not form
            a tree under the top region (a corrupted or hand-edited checkpoint).
    """
    keys = ("parent", "known", "regular", "shared", "regions", "placed")
    if not isinstance(saved, dict) or set(saved) != set(keys):
        raise ValueError(f"the 'layerwise' 'structure' must be a dict with the keys {', '.join(keys)}.")
    index = {name: k for k, name in enumerate(cuts)}

    def cut(name: Any) -> int:
        if name not in index:
            raise ValueError(f"the 'layerwise' 'structure' names {name!r}, not one of the cut points {list(cuts)!r}.")
        return index[name]

    def region(name: Any) -> int:
        return 0 if name is None else cut(name) + 1

    parents = [region(p) for p in saved["parent"]]
    if len(parents) != len(cuts):
        raise ValueError(f"the 'layerwise' 'structure' gives {len(parents)} parents for {len(cuts)} cut points.")
    for k in range(len(parents)):
        seen, r = {k}, parents[k]
        while r:
            if r - 1 in seen:
                raise ValueError(f"the 'layerwise' 'structure' nests cut point {cuts[k]!r} under itself.")
            seen.add(r - 1)
            r = parents[r - 1]
    if not isinstance(saved["regions"], dict) or not isinstance(saved["shared"], bool):
        raise ValueError("the 'layerwise' 'structure' must hold 'regions' as a dict and 'shared' as a bool.")
    return Structure(
        parents=parents,
        known={cut(n) for n in saved["known"]},
        regular=sorted(cut(n) for n in saved["regular"]),
        shared=saved["shared"],
        regions={str(name): region(r) for name, r in saved["regions"].items()},
        placed={str(name) for name in saved["placed"]},
    )
