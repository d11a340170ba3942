"""History writers for :class:`mixprec.GradScaler`'s ``history`` callback.

Each is a plain callable ``writer(step, scale, skipped, overflow_names)``; any other callable with
that signature works as well (for example a diagnostics tracer).
"""

from __future__ import annotations

import csv
import os
from typing import Any, TextIO

__all__ = ["CSVHistory", "TensorBoardHistory"]


class CSVHistory:
    """Appends one CSV row per :meth:`GradScaler.update`: ``step,scale,skipped,overflow``.

    ``overflow`` joins the names of the parameters with non-finite gradients with ``;``. The file
    is opened lazily in append mode (the header is written when it is new) and flushed after every
    row, so a crashed run keeps its history; pickling keeps the path, not the handle.

    Example:
        >>> scaler = mixprec.GradScaler("cpu", history=CSVHistory("scale.csv"))
    """

    header = ("step", "scale", "skipped", "overflow")

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self._file: TextIO | None = None
        self._writer: Any = None

    def __call__(self, step: int, scale: float, skipped: bool, overflow: tuple[str, ...]) -> None:
        if self._file is None:
            new = not os.path.exists(self.path) or os.path.getsize(self.path) == 0
            self._file = open(self.path, "a", newline="", encoding="utf-8")
            self._writer = csv.writer(self._file)
            if new:
                self._writer.writerow(self.header)
        self._writer.writerow((step, repr(float(scale)), int(bool(skipped)), ";".join(overflow)))
        self._file.flush()

    def close(self) -> None:
        """Closes the file (a later call reopens it in append mode)."""
        if self._file is not None:
            self._file.close()
            self._file = None
            self._writer = None

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path, "_file": None, "_writer": None}

    @staticmethod
    def read(path: str | os.PathLike[str]) -> list[tuple[int, float, bool, tuple[str, ...]]]:
        """Reads a file written by :class:`CSVHistory` back into ``(step, scale, skipped, names)``."""
        with open(path, newline="", encoding="utf-8") as handle:
            rows = list(csv.DictReader(handle))
        return [
            (
                int(r["step"]),
                float(r["scale"]),
                r["skipped"] == "1",
                tuple(n for n in r["overflow"].split(";") if n),
            )
            for r in rows
        ]


class TensorBoardHistory:
    """Writes the scale and skips to TensorBoard: ``{tag}/scale``, ``{tag}/skipped``.

    Needs the optional ``tensorboard`` package (``pip install tensorboard``), imported on
    construction. Pass ``log_dir`` or an existing ``torch.utils.tensorboard.SummaryWriter``.

    Raises:
        ImportError: if tensorboard is not installed (the message says what to install).
    """

    def __init__(self, log_dir: str | None = None, *, writer: Any = None, tag: str = "loss_scale") -> None:
        if writer is None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as error:  # tensorboard missing
                raise ImportError(
                    "TensorBoardHistory needs the tensorboard package: pip install "
                    "tensorboard (or use CSVHistory)."
                ) from error
            writer = SummaryWriter(log_dir=log_dir)
        self.writer = writer
        self.tag = tag

    def __call__(self, step: int, scale: float, skipped: bool, overflow: tuple[str, ...]) -> None:
        self.writer.add_scalar(f"{self.tag}/scale", scale, step)
        self.writer.add_scalar(f"{self.tag}/skipped", float(skipped), step)
        if overflow:
            self.writer.add_text(f"{self.tag}/overflow", ", ".join(overflow), step)

    def close(self) -> None:
        """Flushes and closes the writer."""
        self.writer.close()
