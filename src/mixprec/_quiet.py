"""Known noise of third-party imports, kept out of mixprec's commands' output.

Importing transformers imports torchao when it is installed, and every torchao on the package
index logs at import on a CPU-only torch 2.13 (checked 2026-12-03, issue 42: 0.18.0 and 0.17.0
log two ``Failed to load .../_C_mxfp8....so`` lines, its CUDA kernels, and two
``<enum 'KernelPreference'> is an Enum subclass ... register_constant() ... is deprecated``
warnings through ``torch.utils._pytree``; 0.14.1 to 0.16.0 log ``Skipping import of cpp
extensions due to incompatible torch version``). None of it is the user's to act on in a
mixprec command, and it came before the command's own first line. :func:`quiet_imports` drops
exactly those records (by logger and message) while it is active; every other record of the same
loggers passes. The ``.so`` and skipped-extension lines are dropped on a CPU-only torch only:
with CUDA they may matter to a user of torchao's kernels.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Iterator

import torch

__all__ = ["quiet_imports"]

#: ``(logger name, message fragments)`` of the records :func:`quiet_imports` drops.
_ALWAYS = (("torch.utils._pytree", ("is an Enum subclass and is now natively supported",)),)
_CPU_ONLY = (("torchao", ("Failed to load ", "Skipping import of cpp extensions")),)


class _Drop(logging.Filter):
    """Drops the records whose message holds one of ``fragments``."""

    def __init__(self, fragments: tuple[str, ...]) -> None:
        super().__init__()
        self.fragments = fragments

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(f in message for f in self.fragments)


@contextlib.contextmanager
def quiet_imports() -> Iterator[None]:
    """While active, torchao's import-time noise (see the module docs) is not logged.

    Example:
        >>> with quiet_imports():
        ...     import transformers  # doctest: +SKIP
    """
    noise = _ALWAYS + (_CPU_ONLY if torch.version.cuda is None else ())
    filters = [(logging.getLogger(name), _Drop(fragments)) for name, fragments in noise]
    for logger, f in filters:
        logger.addFilter(f)
    try:
        yield
    finally:
        for logger, f in filters:
            logger.removeFilter(f)
