"""The demo's training text: public-domain works shipped inside the package, as byte tokens.

The text lives in ``mixprec/demo/data/corpus.txt`` (see ``data/README.md`` for the works it holds)
and is read with :mod:`importlib.resources`, so it works from a wheel or a zip; nothing is
downloaded.

Example:
    >>> train, val = load_tokens()
    >>> train.dtype, int(train.max()) < 256
    (torch.uint8, True)
"""

from __future__ import annotations

from importlib import resources

import torch

__all__ = ["VOCAB_SIZE", "load_text", "load_tokens", "batch_offsets", "make_batch"]

#: Byte-level tokens: every UTF-8 byte is one token.
VOCAB_SIZE = 256


def load_text() -> str:
    """The whole corpus as a string (UTF-8)."""
    return resources.files("mixprec.demo").joinpath("data", "corpus.txt").read_text(encoding="utf-8")


def load_tokens(val_fraction: float = 0.1) -> tuple[torch.Tensor, torch.Tensor]:
    """The corpus as uint8 byte tokens, split into ``(train, validation)`` at ``1 - val_fraction``.

    Raises:
        ValueError: if ``val_fraction`` is not in ``(0, 1)``.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    data = torch.frombuffer(bytearray(load_text().encode("utf-8")), dtype=torch.uint8)
    cut = int(len(data) * (1.0 - val_fraction))
    return data[:cut], data[cut:]


def batch_offsets(
    n_tokens: int, steps: int, batch_size: int, seq_len: int, seed: int
) -> torch.Tensor:
    """Start offsets of every training window, ``(steps, batch_size)`` int64, drawn from ``seed``.

    Drawn once per run so that every precision mode trains on exactly the same batches.

    Raises:
        ValueError: if the text is not longer than ``seq_len + 1`` tokens.
    """
    if n_tokens <= seq_len + 1:
        raise ValueError(f"need more than {seq_len + 1} tokens for windows of {seq_len}, got {n_tokens}")
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, n_tokens - seq_len - 1, (steps, batch_size), generator=gen)


def make_batch(
    data: torch.Tensor, offsets: torch.Tensor, seq_len: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-token targets, both ``(len(offsets), seq_len)`` int64 on ``device``."""
    idx = offsets[:, None] + torch.arange(seq_len + 1)
    windows = data[idx].long().to(device, non_blocking=True)
    return windows[:, :-1], windows[:, 1:]
