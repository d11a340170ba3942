"""A small decoder-only transformer language model (GPT-style, pre-norm, untied head).

Built only from standard modules and ops (``nn.Embedding``, ``nn.LayerNorm``, ``nn.Linear``,
``F.scaled_dot_product_attention``, ``F.gelu``, ``F.cross_entropy``) so that every precision mode of
the demo sees the same graph. The same class at :data:`GPT2_SMALL` is the model of
``benchmarks/gpu.py``.

Example:
    >>> cfg = SIZES["tiny"]
    >>> model = TransformerLM(cfg)
    >>> tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
    >>> model(tokens).shape == (2, cfg.seq_len, cfg.vocab_size)
    True
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["ModelConfig", "SIZES", "GPT2_SMALL", "TransformerLM", "lm_loss"]


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a :class:`TransformerLM`.

    Attributes:
        vocab_size: number of token ids (256 for the demo's byte-level tokens).
        seq_len: maximum sequence length (size of the learned position table).
        d_model: width of the residual stream; must be divisible by ``n_heads``.
        n_layers: number of transformer blocks.
        n_heads: attention heads per block.
        d_ff: hidden width of the MLP (``4 * d_model`` when 0).
    """

    vocab_size: int = 256
    seq_len: int = 64
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    d_ff: int = 0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "d_model", "n_layers", "n_heads"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelConfig.{name} must be positive, got {getattr(self, name)}")
        if self.d_model % self.n_heads:
            raise ValueError(
                f"ModelConfig.d_model={self.d_model} must be divisible by n_heads={self.n_heads}"
            )
        if self.d_ff < 0:
            raise ValueError(f"ModelConfig.d_ff must be >= 0 (0 means 4 * d_model), got {self.d_ff}")

    @property
    def hidden(self) -> int:
        """The MLP's hidden width."""
        return self.d_ff or 4 * self.d_model


#: The demo's model sizes (byte-level vocabulary).
SIZES: dict[str, ModelConfig] = {
    "tiny": ModelConfig(seq_len=64, d_model=64, n_layers=2, n_heads=4),
    "small": ModelConfig(seq_len=128, d_model=128, n_layers=4, n_heads=4),
    "base": ModelConfig(seq_len=256, d_model=256, n_layers=6, n_heads=8),
}

#: GPT-2 small's shape (124M parameters with a tied head; 163M here, the head is untied).
GPT2_SMALL = ModelConfig(vocab_size=50257, seq_len=1024, d_model=768, n_layers=12, n_heads=12)


class _Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc = nn.Linear(cfg.d_model, cfg.hidden)
        self.out = nn.Linear(cfg.hidden, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TransformerLM(nn.Module):
    """Decoder-only transformer: token + position embeddings, pre-norm blocks, final norm, head.

    ``forward(tokens)`` takes int64 ids of shape ``(batch, t)`` with ``t <= cfg.seq_len`` and
    returns logits of shape ``(batch, t, vocab_size)`` in the dtype the computation ran in.
    Weights are initialised GPT-2 style (normal, std 0.02; residual projections scaled by
    ``1/sqrt(2 * n_layers)``), from the global torch RNG: seed it for reproducible models.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        for name, p in self.named_parameters():
            if p.dim() == 1:
                nn.init.zeros_(p) if name.endswith("bias") else nn.init.ones_(p)
            else:
                std = 0.02 / math.sqrt(2 * cfg.n_layers) if name.endswith(("proj.weight", "out.weight")) else 0.02
                nn.init.normal_(p, std=std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        if t > self.cfg.seq_len:
            raise ValueError(f"sequence of {t} tokens is longer than the model's seq_len={self.cfg.seq_len}")
        x = self.tok(tokens) + self.pos(torch.arange(t, device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy, computed in float32 whatever the logits' dtype."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
