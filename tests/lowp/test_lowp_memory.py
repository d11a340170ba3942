"""memory_bytes: measured from the tensors, each storage once."""

import pytest
import torch
from torch import nn

import mixprec
from mixprec.lowp import memory_bytes


def _step(model, opt):
    model(torch.randn(4, 64, dtype=model.weight.dtype)).float().sum().backward()
    opt.step()


@pytest.mark.parametrize(
    "dtype,make,expected",
    [
        (torch.float32, lambda ps: torch.optim.AdamW(ps), dict(params=4, grads=4, master=0, optimizer_state=8)),
        (torch.float32, lambda ps: torch.optim.SGD(ps, lr=0.1), dict(params=4, grads=4, master=0, optimizer_state=0)),
        (torch.bfloat16, lambda ps: torch.optim.AdamW(ps), dict(params=2, grads=2, master=0, optimizer_state=4)),
        (torch.bfloat16, lambda ps: mixprec.optim.AdamW(ps, compensation="kahan"), dict(params=2, grads=2, master=0, optimizer_state=10)),
        (torch.bfloat16, lambda ps: mixprec.optim.AdamW(ps, compensation="stochastic"), dict(params=2, grads=2, master=0, optimizer_state=8)),
        (torch.bfloat16, lambda ps: mixprec.optim.SGD(ps, momentum=0.9, compensation="kahan"), dict(params=2, grads=2, master=0, optimizer_state=6)),
        (torch.bfloat16, lambda ps: mixprec.MasterWeights(torch.optim.AdamW(ps)), dict(params=2, grads=2, master=4, optimizer_state=8)),
    ],
)
def test_bytes_per_param(dtype, make, expected):
    model = nn.Linear(64, 64, bias=False).to(dtype)
    opt = make(model.parameters())
    _step(model, opt)
    mem = memory_bytes(model, opt)
    n = 64 * 64
    assert mem["numel"] == n
    for key, per_param in expected.items():
        # AdamW's step counter is one 4-byte scalar tensor per parameter tensor
        assert mem[key] - per_param * n in ((0, 4) if key == "optimizer_state" else (0,)), (key, mem)
    assert mem["total"] == sum(mem[k] for k in expected)
    assert mem["bytes_per_param"] == mem["total"] / n


def test_master_grads_are_counted_while_alive():
    model = nn.Linear(64, 64, bias=False).to(torch.bfloat16)
    opt = mixprec.MasterWeights(torch.optim.SGD(model.parameters(), lr=0.1))
    model(torch.randn(4, 64, dtype=torch.bfloat16)).float().sum().backward()
    opt.prepare_grads()
    assert memory_bytes(model, opt)["master"] == 8 * 64 * 64  # fp32 master + its grad
    opt.step()
    assert memory_bytes(model, opt)["master"] == 4 * 64 * 64  # master grads released


def test_shared_storage_is_counted_once():
    emb = nn.Embedding(10, 8)
    head = nn.Linear(8, 10, bias=False)
    head.weight = emb.weight  # tied
    model = nn.Sequential(emb, head)
    assert memory_bytes(model)["params"] == 10 * 8 * 4
    view_model = nn.Module()
    base = torch.zeros(100)
    view_model.a = nn.Parameter(base[:50])
    view_model.b = nn.Parameter(base[50:])
    assert memory_bytes(view_model)["params"] == 400  # one storage of 100 floats


def test_meta_model_is_sized_per_storage():
    model = nn.Sequential(nn.Linear(10, 10, device="meta"), nn.Linear(10, 10, device="meta"))
    model[1].weight = model[0].weight  # tied: one storage
    assert memory_bytes(model)["params"] == (100 + 10 + 10) * 4
