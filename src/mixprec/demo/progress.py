"""Progress display for the demo: a rich or tqdm bar per mode on a terminal, plain lines otherwise.

Each class implements :class:`mixprec.demo.results.Progress`; :func:`progress_display` picks one.
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from typing import Any, Iterator, TextIO

from mixprec.demo.results import ModeResult

__all__ = ["RichProgress", "TqdmProgress", "LineProgress", "progress_display"]


def _postfix(loss: float, scale: float | None) -> str:
    return f"loss {loss:.3f}" + ("" if scale is None else f"  scale {scale:g}")


def _done(result: ModeResult) -> str:
    return (
        f"{result.mode}: final loss {result.final_loss:.3f}, eval {result.eval_loss:.3f}, "
        f"{result.tokens_per_s:,.0f} tokens/s, {result.wall_s:.1f} s"
    )


class LineProgress:
    """Plain lines, about ten per mode: for logs, pipes and terminals without rich or tqdm."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self._mode = ""
        self._total = 1
        self._next = 0

    def start(self, mode: str, total: int) -> None:
        self._mode, self._total, self._next = mode, total, 0
        print(f"{mode}: training {total} steps", file=self.stream, flush=True)

    def update(self, step: int, loss: float, scale: float | None) -> None:
        if step * 10 >= self._next * self._total or step == self._total:
            self._next = step * 10 // self._total + 1
            print(f"  {self._mode} step {step}/{self._total}  {_postfix(loss, scale)}",
                  file=self.stream, flush=True)

    def finish(self, result: ModeResult) -> None:
        print(f"  {_done(result)}", file=self.stream, flush=True)

    def note(self, text: str) -> None:
        print(text, file=self.stream, flush=True)


class TqdmProgress:
    """One ``tqdm`` bar per mode, with the loss and the scale as postfix."""

    def __init__(self, stream: TextIO) -> None:
        from tqdm import tqdm

        self._tqdm = tqdm
        self._stream = stream
        self._bar: Any = None

    def start(self, mode: str, total: int) -> None:
        self._bar = self._tqdm(total=total, desc=f"{mode:16s}", unit="step", file=self._stream)

    def update(self, step: int, loss: float, scale: float | None) -> None:
        self._bar.update(step - self._bar.n)
        self._bar.set_postfix_str(_postfix(loss, scale), refresh=True)

    def finish(self, result: ModeResult) -> None:
        self._bar.set_postfix_str(f"final loss {result.final_loss:.3f}  {result.tokens_per_s:,.0f} tok/s")
        self._bar.close()

    def note(self, text: str) -> None:
        self._tqdm.write(text, file=self._stream)


class RichProgress:
    """One ``rich`` progress bar per mode, with the loss and the scale, on a running
    ``rich.progress.Progress`` (see :func:`progress_display`)."""

    def __init__(self, progress: Any) -> None:
        self._progress = progress
        self._task: Any = None

    def start(self, mode: str, total: int) -> None:
        self._task = self._progress.add_task(mode, total=total, info="")

    def update(self, step: int, loss: float, scale: float | None) -> None:
        self._progress.update(self._task, completed=step, info=_postfix(loss, scale))

    def finish(self, result: ModeResult) -> None:
        self._progress.update(
            self._task,
            completed=len(result.losses),
            info=f"final loss {result.final_loss:.3f}  {result.tokens_per_s:,.0f} tok/s",
        )

    def note(self, text: str) -> None:
        self._progress.console.print(text, highlight=False, markup=False)


@contextlib.contextmanager
def progress_display(stream: TextIO | None = None) -> Iterator[RichProgress | TqdmProgress | LineProgress]:
    """rich bars when ``stream`` (stderr by default) is a terminal and rich is installed, else
    tqdm bars under the same condition, else plain lines."""
    stream = stream if stream is not None else sys.stderr
    if stream.isatty() and importlib.util.find_spec("rich") is not None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        columns = (TextColumn("{task.description:16s}"), BarColumn(), MofNCompleteColumn(),
                   TimeElapsedColumn(), TextColumn("{task.fields[info]}"))
        with Progress(*columns, console=Console(file=stream)) as progress:
            yield RichProgress(progress)
    elif stream.isatty() and importlib.util.find_spec("tqdm") is not None:
        yield TqdmProgress(stream)
    else:
        yield LineProgress(stream)
