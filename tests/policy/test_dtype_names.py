"""One table of dtype names (``mixprec._dtype_names``) for every site that reads or writes them:
policies (``_codec``), the audit's candidates, the integrations' precisions, the Controller's
rung names."""

from __future__ import annotations

import pytest
import torch

from mixprec import _codec
from mixprec._dtype_names import DTYPE_NAMES, SHORT_NAMES, dtype_name, parse_dtype, short_name
from mixprec.diagnostics.audit import dtype_names
from mixprec.integrations._common import PRECISIONS


def test_every_name_reads_back_its_dtype_and_each_dtype_writes_its_canonical_name() -> None:
    for name, dtype in DTYPE_NAMES.items():
        assert parse_dtype(name) is dtype and parse_dtype(f" Torch.{name.upper()} ") is dtype
        assert parse_dtype(dtype_name(dtype)) is dtype and parse_dtype(short_name(dtype, "?")) is dtype
    assert set(SHORT_NAMES) == set(DTYPE_NAMES.values())
    assert short_name(torch.float8_e4m3fn, "compute") == "compute"


def test_an_unknown_name_says_where_and_lists_the_accepted_names() -> None:
    listed = ", ".join(sorted(DTYPE_NAMES))
    with pytest.raises(ValueError) as e:
        parse_dtype("fp8")
    assert str(e.value) == f"unknown dtype 'fp8'; use one of {listed}"
    with pytest.raises(ValueError, match=r"^policy 'compute': unknown dtype 'int8'; use one of bf16, "):
        parse_dtype("int8", "policy 'compute'")


def test_the_sites_share_the_table() -> None:
    assert _codec.DTYPE_NAMES is DTYPE_NAMES and _codec.parse_dtype is parse_dtype
    # the audit takes every name of its two candidates, and only those
    for name, dtype in DTYPE_NAMES.items():
        if dtype in (torch.float16, torch.bfloat16):
            assert dtype_names([name]) == (dtype_name(dtype),)
        else:
            with pytest.raises(ValueError, match="audit chooses among float16 and bfloat16 only"):
                dtype_names([name])
    with pytest.raises(ValueError, match="fp8 is not a compute dtype"):
        dtype_names(["float8_e4m3fn"])
    assert PRECISIONS == {"16-mixed": torch.float16, "bf16-mixed": torch.bfloat16,
                          "fp16": torch.float16, "bf16": torch.bfloat16}
