"""Module rules (keep, output=, fp8 layers) across nested regions, checkpoint recompute, root= and
the warning for rules that match nothing."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import mixprec
from mixprec import Policy

LN_F32 = Policy.parse("compute=bf16,output=f32").keep(types=nn.LayerNorm)


def _ln_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))


def test_nested_regions_with_an_equal_policy_keep_the_outer_rules():
    m, x = _ln_model(), torch.randn(2, 4)
    with mixprec.autocast("cpu", policy=LN_F32):
        assert m(x).dtype == torch.float32
        with mixprec.autocast("cpu", policy=LN_F32):
            assert m(x).dtype == torch.float32
        assert m(x).dtype == torch.float32  # the outer region's rules are still there


def test_decorated_forward_inside_a_region_with_the_same_policy():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = _ln_model()

        @mixprec.autocast("cpu", policy=LN_F32)
        def forward(self, x):
            return self.body(x)

    net, x = Net(), torch.randn(2, 4)
    with mixprec.autocast("cpu", policy=LN_F32):
        net(x)
        assert net.body(x).dtype == torch.float32
