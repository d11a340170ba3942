"""The mutant list (``mutants.toml``) as values, and how one mutant is applied to a tree.

Pure functions of the data file and a tree's files: no subprocess, no test run (see
``__main__`` for the runner). ``tests/test_mutants.py`` uses this module in the default run.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path

__all__ = ["AREAS", "CATALOG", "Mutant", "MutantRotted", "load", "mutate", "apply"]

#: The file of the list, next to this module.
CATALOG = Path(__file__).with_name("mutants.toml")
#: The areas a mutant belongs to (issue 40's six: scaling, formats, precision control, collectives,
#: export, the engine; then the optimizers, the non-finite tracer, the integrations).
AREAS = ("scaling", "formats", "control", "collectives", "export", "engine", "optim", "diagnostics", "integrations")
_FIELDS = {"id", "area", "file", "original", "replacement", "description", "harness", "package", "issue"}
_REQUIRED = _FIELDS - {"issue"}


class MutantRotted(ValueError):
    """A mutant's ``original`` text does not occur exactly once in its file: the source moved
    on; update the mutant (the same defect against the new code), do not drop it."""


@dataclass(frozen=True)
class Mutant:
    """One planted defect: replace ``original`` (exactly once in ``file``) by ``replacement``.
    ``harness``/``package``: the pytest node ids (files or ``file::test``) mapped to it, in the
    fast adversarial harness and in the rest of the default run."""

    id: str
    area: str
    file: str
    original: str
    replacement: str
    description: str
    harness: tuple[str, ...]
    package: tuple[str, ...]
    issue: int | None = None


def load(path: Path = CATALOG) -> tuple[Mutant, ...]:
    """The mutants of ``path``, in file order.

    Raises:
        ValueError: a mutant with a missing or unknown field, an unknown area, a duplicate id,
            or a replacement equal to its original.
    """
    data = tomllib.loads(path.read_text(encoding="utf-8"))
    out: list[Mutant] = []
    seen: set[str] = set()
    for i, raw in enumerate(data.get("mutant", [])):
        where = f"{path.name}: mutant #{i + 1} ({raw.get('id', '?')})"
        missing, unknown = _REQUIRED - raw.keys(), raw.keys() - _FIELDS
        if missing or unknown:
            raise ValueError(f"{where}: missing fields {sorted(missing)}, unknown fields {sorted(unknown)}")
        if raw["area"] not in AREAS:
            raise ValueError(f"{where}: area must be one of {AREAS}, got {raw['area']!r}")
        if raw["id"] in seen:
            raise ValueError(f"{where}: duplicate id")
        if raw["original"] == raw["replacement"] or not raw["original"]:
            raise ValueError(f"{where}: the original must be non-empty and differ from the replacement")
        seen.add(raw["id"])
        out.append(Mutant(**{**raw, "harness": tuple(raw["harness"]), "package": tuple(raw["package"])}))
    return tuple(out)


def mutate(text: str, mutant: Mutant) -> str:
    """``text`` (the content of ``mutant.file``) with the mutant applied.

    Raises:
        MutantRotted: ``mutant.original`` occurs zero or several times in ``text``.
    """
    count = text.count(mutant.original)
    if count != 1:
        raise MutantRotted(f"mutant {mutant.id!r}: its original text occurs {count} times in {mutant.file} "
                           f"(expected exactly once): {mutant.original!r}; update the mutant to the current source")
    return text.replace(mutant.original, mutant.replacement)


def apply(mutant: Mutant, root: Path) -> None:
    """Apply ``mutant`` in place to the tree at ``root`` (a temporary copy, never the checkout)."""
    path = root / mutant.file
    path.write_text(mutate(path.read_text(encoding="utf-8"), mutant), encoding="utf-8")
