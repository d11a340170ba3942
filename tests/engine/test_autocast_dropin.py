"""mixprec.autocast where code written for torch.autocast already runs: the errors it catches, the
cache flag it inherits, the dtype and device spellings, isinstance checks."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import mixprec

from _count_casts import CountCasts


@pytest.mark.parametrize("device", ["tpu", "xpu", ""])
def test_unknown_devices_raise_what_torch_code_catches(device):
    with pytest.raises(RuntimeError):
        torch.autocast(device if device != "xpu" else "tpu")  # torch's own error type
    with pytest.raises(RuntimeError, match="supports device_type 'cpu' and 'cuda'"):
        mixprec.autocast(device)
    with pytest.raises(ValueError, match="use torch.autocast"):
        mixprec.autocast(device)


def test_device_strings_say_what_to_write():
    with pytest.raises(RuntimeError, match="write 'cpu'"):
        mixprec.autocast("CPU")
    with pytest.raises(RuntimeError, match="write 'cuda' .an index after ':' must be a number"):
        mixprec.autocast("cuda:x")
    with pytest.raises(ValueError, match=r"pass its \.type"):
        mixprec.autocast(torch.device("cpu"))
    ac = mixprec.autocast("cpu:0")  # an index is ignored, as torch's autocast state is per type
    assert ac.device == "cpu" and mixprec.autocast("cuda:1", enabled=False).device == "cuda"
    with ac:
        assert torch.is_autocast_enabled("cpu") and torch.mm(torch.ones(2, 2), torch.ones(2, 2)).dtype == torch.bfloat16


def test_cache_flag_is_inherited_as_torch_does():
    lin, a = nn.Linear(3, 3), torch.randn(3, 3)
    counts = {}
    for ctx in (torch.autocast, mixprec.autocast):
        with torch.autocast("cpu", cache_enabled=False):
            with ctx("cpu"):
                assert not torch.is_autocast_cache_enabled()
                with CountCasts() as c:
                    lin(a), lin(a)
                counts[ctx] = c.casts
            with ctx("cpu", cache_enabled=True):
                assert torch.is_autocast_cache_enabled()
        assert torch.is_autocast_cache_enabled()
    assert counts[torch.autocast] == counts[mixprec.autocast] == 6
    assert mixprec.autocast("cpu")._cache_enabled is True  # torch's default outside any region


@pytest.mark.parametrize("name,dtype", [("bf16", torch.bfloat16), ("bfloat16", torch.bfloat16),
                                        ("fp16", torch.float16), ("half", torch.float16),
                                        ("torch.float16", torch.float16)])
def test_dtype_names_as_policies_accept(name, dtype):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with mixprec.autocast("cpu", dtype=name) as ac:
            assert ac.fast_dtype is dtype and torch.get_autocast_dtype("cpu") is dtype
            assert torch.mm(torch.ones(2, 2), torch.ones(2, 2)).dtype == dtype


def test_bad_dtypes_raise_one_clear_error():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "Disabling autocast" warning besides
        with pytest.raises(ValueError, match="unknown dtype 'bf61'; use one of .*bf16"):
            mixprec.autocast("cpu", dtype="bf61")
        with pytest.raises(TypeError, match="torch.dtype or a name such as 'bf16'"):
            mixprec.autocast("cpu", dtype=3)
    with pytest.warns(UserWarning, match="not supported"):  # float32, as torch: autocast off
        assert not mixprec.autocast("cpu", dtype="f32")._enabled


def test_is_a_torch_autocast_and_keeps_its_behaviour():
    ac = mixprec.autocast("cpu", policy=mixprec.Policy().with_ops(fp32=["mm"]))
    assert isinstance(ac, torch.autocast) and isinstance(ac, torch.amp.autocast)
    a = torch.randn(3, 3)
    with ac:
        assert torch.mm(a, a).dtype == torch.float32 and nn.functional.linear(a, a).dtype == torch.bfloat16

    @ac
    def f(a):
        return torch.mm(a, a), nn.functional.linear(a, a)

    assert [t.dtype for t in f(a)] == [torch.float32, torch.bfloat16]
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    for x, y in zip(compiled(a), f(a)):
        assert x.dtype == y.dtype and torch.equal(x, y)
