"""Shared helpers of the mixprec.optim tests: a seeded training run and a bitwise comparison."""

from __future__ import annotations

import torch


def train(cls, params, *, grad_dtype=None, steps=4, late=True, **kwargs):
    """``steps`` steps of ``cls`` over two param groups (the second at lr 3e-3), seeded gradients
    of ``grad_dtype`` (default: each parameter's); with ``late`` the last parameter gets its first
    gradient a step late. Checks that ``.grad`` is never used as scratch. Returns the optimizer."""
    for p in params:
        if grad_dtype not in (None, p.dtype) and hasattr(p, "grad_dtype"):  # torch >= 2.10 checks it
            p.grad_dtype = None
    opt = cls([{"params": params[:1]}, {"params": params[1:], "lr": 3e-3}],
              generator=torch.Generator().manual_seed(1), **kwargs)
    for step in range(steps):
        g = torch.Generator().manual_seed(100 + step)
        for i, p in enumerate(params):
            skip = late and step == 0 and i == len(params) - 1
            p.grad = None if skip else torch.randn(p.shape, generator=g).to(grad_dtype or p.dtype)
        kept = [None if p.grad is None else p.grad.clone() for p in params]
        opt.step()
        for p, k in zip(params, kept):
            assert (p.grad is None and k is None) or torch.equal(p.grad, k)
    return opt


def assert_same(a, opt_a, b, opt_b):
    """Parameters, optimizer state (keys, dtypes, values) and generator states bitwise equal."""
    for p, q in zip(a, b):
        assert p.dtype == q.dtype
        assert torch.equal(p.detach().flatten().view(torch.uint8), q.detach().flatten().view(torch.uint8))
        assert opt_a.state[p].keys() == opt_b.state[q].keys()
        for key, value in opt_a.state[p].items():
            assert value.dtype == opt_b.state[q][key].dtype, key
            assert torch.equal(value, opt_b.state[q][key]), key
    assert (opt_a.generator is None) == (opt_b.generator is None)
    if opt_a.generator is not None:
        assert torch.equal(opt_a.generator.get_state(), opt_b.generator.get_state())
