"""Checks on the folders the command line writes reports into (shared by ``mixprec demo`` and
``mixprec audit``)."""

from __future__ import annotations

from pathlib import Path

__all__ = ["folder_problem"]


def folder_problem(out: str | Path) -> str | None:
    """Why ``out`` cannot become the report folder (it is a file, or under one), or None.

    Example:
        >>> folder_problem("/") is None
        True
    """
    shown = str(out)
    path = Path(out).absolute()
    if path.exists() and not path.is_dir():
        return f"--out {shown!r} is a file, not a folder; give a folder for the report"
    blocker = next((p for p in path.parents if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        return f"cannot create the report folder {shown!r}: {str(blocker)!r} is a file, not a folder"
    return None
