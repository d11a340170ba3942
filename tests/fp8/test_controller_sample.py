"""What the Controller's measurements read (issue 39): about ``sample`` elements of each operand
whatever its size, the whole tensor's scale where the cast has one, and, per GEMM, only on the
steps whose windows a decision reads."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from mixprec import Controller, fp8
from mixprec.control import _measure
from mixprec.control._measure import measure
from mixprec.formats._fp4 import quantize
from mixprec.formats._recipe import Cast
from mixprec.formats._state import new_window

SAMPLE = 256
CASTS = {"nvfp4": Cast("e2m1", "1x16"), "mxfp4": Cast("e2m1", "1x32"), "tensorwise": Cast("e4m3fn", "tensor"),
         "rowwise": Cast("e4m3fn", "row")}


@pytest.fixture
def measured_rows(monkeypatch) -> list[torch.Size]:
    """The shapes :func:`measure` hands to the statistics (``record_cast``'s ``x``)."""
    seen: list[torch.Size] = []
    record = _measure.record_cast
    monkeypatch.setattr(_measure, "record_cast", lambda w, op, x, q, amax: (seen.append(x.shape), record(w, op, x, q, amax)))
    return seen


@pytest.mark.parametrize("cast", CASTS, ids=str)
@pytest.mark.parametrize("rows", [3, 64, 1024, 16384])
def test_a_measurement_reads_about_sample_elements_at_any_size(measured_rows, cast, rows):
    """Whole rows, evenly strided, at least ``SAMPLE`` elements and less than one row more (every
    row of a smaller tensor): the cost of a measurement does not grow with the operand."""
    x = torch.randn(rows, 64)
    measure(new_window(), 0, x, CASTS[cast], False, SAMPLE)
    (shape,) = measured_rows
    assert shape[1] == 64
    if rows * 64 <= SAMPLE:
        assert shape[0] == rows
    else:
        assert SAMPLE <= shape[0] * 64 < SAMPLE + 2 * 64


@pytest.mark.parametrize("rows", [16, 64, 1024, 16384])
def test_a_2d_block_cast_is_measured_on_whole_bands_of_about_sample_elements(measured_rows, rows):
    """A 16x16 block cast: whole bands of 16 rows, evenly strided, at least ``SAMPLE`` elements
    and less than one band more (every row of a smaller tensor)."""
    measure(new_window(), 1, torch.randn(rows, 64), Cast("e2m1", "16x16"), False, SAMPLE)
    (shape,) = measured_rows
    assert shape[1] == 64 and shape[0] % 16 == 0
    if rows * 64 <= SAMPLE:
        assert shape[0] == rows
    else:
        assert SAMPLE <= shape[0] * 64 < SAMPLE + 2 * 16 * 64


def test_a_2d_block_cast_of_rows_that_fill_no_whole_band_is_measured_on_every_row(measured_rows):
    measure(new_window(), 1, torch.randn(1000, 64), Cast("e2m1", "16x16"), False, SAMPLE)
    assert measured_rows == [torch.Size([1000, 64])]


def test_a_banded_sample_flushes_what_the_whole_16x16_cast_flushes_on_its_bands():
    """NVFP4's 16x16 weight blocks, an outlier 1e6x the rest in a band the sample skips: the
    measured flush is the whole tensor's cast's on the sampled bands (its fp32 tensor scale),
    the amax the whole tensor's."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1024, 64, generator=g)
    x[20, 5] = 1e6
    window = new_window()
    cast = Cast("e2m1", "16x16")
    measure(window, 0, x, cast, False, SAMPLE)
    bands = torch.arange(1024).reshape(64, 16)[::64 // -(-SAMPLE // (16 * 64))].flatten()
    assert 20 not in bands.tolist()  # the sample misses the outlier's band
    whole = quantize(x, cast).magnitudes()[bands]
    flushed = ((whole == 0) & (x[bands] != 0)).sum().item() / whole.numel()
    assert flushed > 0.05
    assert window[0, 0].item() == 1e6 and window[0, 2].item() == pytest.approx(flushed)


def test_a_square_block_cast_of_the_transpose_measures_as_the_tensor():
    """The statistics of a cast do not depend on the order of the elements: a 16x16 cast of
    ``w.t()`` (the input-gradient GEMM's weight) measures as one of ``w`` (the forward's)."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(256, 64, generator=g) * torch.logspace(-3, 0, 64)
    a, b = new_window(), new_window()
    cast = Cast("e2m1", "16x16")
    measure(a, 1, w, cast, False, 1 << 20)
    measure(b, 1, w.t(), cast, False, 1 << 20)
    assert torch.equal(a, b) and a[1, 2] > 0


@pytest.mark.parametrize("cast", ["nvfp4", "tensorwise"])
def test_a_sample_is_cast_with_the_whole_tensors_scale(cast):
    """An outlier 1e6x the rest, in a row the sample skips, sets the tensor-wide scale: the sampled
    measurement flushes what the whole tensor's cast flushes on those rows (NVFP4: its fp32 tensor
    scale; tensorwise fp8: its one scale), and reports the whole tensor's amax."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1024, 64, generator=g)
    x[1, 5] = 1e6
    window = new_window()
    measure(window, 0, x, CASTS[cast], False, SAMPLE)
    stride = 1024 // (SAMPLE // 64)
    rows = x[::stride]
    assert not torch.equal(rows.abs().max(), x.abs().max())  # the sample misses the outlier
    if cast == "nvfp4":
        whole = quantize(x, CASTS[cast]).magnitudes()[::stride]
    else:
        scale = torch.finfo(torch.float8_e4m3fn).max / x.abs().max()
        whole = (rows * scale).to(torch.float8_e4m3fn).float()
    flushed = ((whole == 0) & (rows != 0)).sum().item() / rows.numel()
    assert flushed > 0.05  # the whole tensor's scale flushes a share of the sample
    assert window[0, 0].item() == 1e6 and window[0, 2].item() == pytest.approx(flushed)


def test_per_gemm_casts_are_measured_only_on_the_steps_a_decision_reads():
    """A per-GEMM record measures its GEMMs' own casts and the rung below's on the last
    ``shadow_steps`` steps of each window: nothing on the steps before."""
    torch.manual_seed(0)
    ctl = Controller(every=6, shadow_steps=2, ladder=("nvfp4", "tensorwise", "compute"), per_gemm=True)
    model = fp8.convert(nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32)), "nvfp4",
                        filter_fn=lambda m, n: True, controller=ctl)
    windows = []
    for step in range(6):
        model(torch.randn(8, 32)).square().sum().backward()
        windows.append(ctl._layers["0"].gemm_windows.clone())
        if step < 5:
            ctl.step()
    assert [bool(w.abs().sum() > 0) for w in windows] == [False, False, False, False, True, True]


def test_an_empty_batch_on_a_measuring_step_measures_nothing():
    ctl = Controller(every=2, shadow_steps=2, ladder=("nvfp4", "tensorwise", "compute"), per_gemm=True)
    model = fp8.convert(nn.Sequential(nn.Linear(32, 32)), "nvfp4", filter_fn=lambda m, n: True, controller=ctl)
    model(torch.randn(4, 32)).sum().backward()
    before = ctl._layers["0"].gemm_windows.clone()
    model(torch.randn(0, 32, requires_grad=True)).sum().backward()
    assert torch.equal(ctl._layers["0"].gemm_windows, before) and before.abs().sum() > 0


def test_the_weights_square_block_cast_is_sampled_once_for_two_gemms(monkeypatch):
    """NVFP4 casts the weight in 16x16 blocks for the forward and the input-gradient GEMM alike:
    a shadow step casts one sample of it for both (their windows hold the same statistics)."""
    from mixprec.control import _probe

    casts: list[Cast] = []
    original = _probe.sampled_cast
    monkeypatch.setattr(_probe, "sampled_cast", lambda x, cast, *a: (casts.append(cast), original(x, cast, *a))[1])
    ctl = Controller(every=2, shadow_steps=2, ladder=("nvfp4", "tensorwise", "compute"), per_gemm=True)
    model = fp8.convert(nn.Sequential(nn.Linear(32, 64)), "nvfp4", filter_fn=lambda m, n: True, controller=ctl)
    model(torch.randn(48, 32)).square().sum().backward()
    assert [c.granularity for c in casts].count("16x16") == 1 and len(casts) == 5
    windows = ctl._layers["0"].gemm_windows[0]
    assert torch.equal(windows[0, 1, :-1], windows[1, 1, :-1]) and windows[0, 1, 0] > 0  # output's and grad_input's weight
