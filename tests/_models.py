"""The small models the tests share, seeded, so that two files that train "the same model" do.

A helper seeds torch's global generator (``seed``, default 0) and then builds its layers in
order, as the per-file ``_model()`` helpers it replaces did: the parameters, and the global
generator's state afterwards, are bitwise theirs.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn


def fp8_stack(depth: int = 4, width: int = 32, *, seed: int = 0) -> nn.Sequential:
    """The shared fp8 test model: ``depth`` x (``Linear(width, width)``, ``Tanh``).

    Tanh bounds each layer's output, so an outlier injected into one layer's input stays in that
    layer. Its Linear layers are ``'0'``, ``'2'``, ``'4'``, ``'6'`` (depth 4); every width is a
    multiple of 16, so tensorwise fp8 selects them all. ``fp8_stack()[:-1]`` drops the last Tanh
    (same parameters, same names).
    """
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*layers)


def mlp(*widths: int, act: Callable[[], nn.Module] = nn.GELU, seed: int = 0) -> nn.Sequential:
    """``Linear(widths[0], widths[1])``, ``act()``, ``Linear(widths[1], widths[2])``, ...: an
    activation between Linear layers, none after the last; Linear layers at even indices."""
    if len(widths) < 2:
        raise ValueError(f"mlp needs at least 2 widths (in and out features), got {widths}")
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for i, (n_in, n_out) in enumerate(zip(widths, widths[1:])):
        layers += [nn.Linear(n_in, n_out)] + ([act()] if i < len(widths) - 2 else [])
    return nn.Sequential(*layers)


def sharp_classifier() -> nn.Sequential:
    """``mlp(32, 64, 64)`` with its logits' weight (layer ``'2'``) times 4: logits sharp enough
    that their NVFP4 error costs about 0.005 nats (the loss-cost tests' model)."""
    model = mlp(32, 64, 64)
    with torch.no_grad():
        model[2].weight.mul_(4)
    return model


def sharp_classifier_batch(rows: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` inputs of :func:`sharp_classifier` and its noisy argmax labels, drawn from ``generator``."""
    x = torch.randn(rows, 32, generator=generator)
    with torch.no_grad():
        y = (sharp_classifier()(x) + 0.5 * torch.randn(rows, 64, generator=generator)).argmax(-1)
    return x, y
