"""Fixtures of the demo tests: ``data``, the shipped corpus as (train, val) tokens."""

from __future__ import annotations

import pytest
import torch

from mixprec.demo import corpus


@pytest.fixture(scope="module")
def data() -> tuple[torch.Tensor, torch.Tensor]:
    """The corpus's (train, val) byte tokens, loaded once per test module."""
    return corpus.load_tokens()
