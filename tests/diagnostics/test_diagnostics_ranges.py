"""collect_ranges: fractions match real casts, statistics, loss scale, hooks, no syncs."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

import mixprec
from mixprec.diagnostics import FORMATS, RangeStats, collect_ranges
from mixprec.diagnostics.ranges import HIST_EDGES, format_limits


class Copy(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.clone()


def log_uniform(n: int, lo: float, hi: float, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    mag = torch.exp2(torch.empty(n).uniform_(lo, hi, generator=g))
    return mag * torch.randn(n, generator=g).sign()


def test_format_limits() -> None:
    fp16 = format_limits(torch.float16)
    assert fp16.overflow_from == 65520.0 and fp16.smallest_subnormal == 2.0 ** -24
    assert 2.0 ** -25 < fp16.zero_below < 2.0 ** -25 * (1 + 1e-6)
    assert fp16.normal_from == 2.0 ** -14 - 2.0 ** -25
    assert format_limits(torch.float8_e4m3fn).overflow_from == 464.0
    assert format_limits(torch.float8_e5m2).overflow_from == 61440.0
    assert format_limits(torch.bfloat16).smallest_subnormal == 2.0 ** -133


def test_fractions_match_real_casts() -> None:
    x = log_uniform(40000, -140, 127)
    specials = []
    for dt in FORMATS.values():  # values on and next to every rounding boundary
        lim = format_limits(dt)
        for v in (lim.zero_below, lim.normal_from, lim.overflow_from, lim.smallest_subnormal / 2,
                  lim.tiny, lim.max):
            t = torch.tensor(v, dtype=torch.float32)
            specials += [t, torch.nextafter(t, torch.tensor(0.0)), torch.nextafter(t, t * 2)]
    x = torch.cat([x, torch.stack(specials), -torch.stack(specials), torch.zeros(7)])
    model = Copy()
    with collect_ranges(model) as rc:
        model(x)
    s = rc.results()[""]["activation"]
    n = x.numel()
    for name, dt in FORMATS.items():
        y = x.to(dt).float()
        fi = torch.finfo(dt)
        if dt == torch.float8_e4m3fn:  # no inf: PyTorch saturates to +-448; 464 rounds past it
            overflow = x.abs() >= 448 + 16
        else:
            overflow = torch.isinf(y)
        assert s.overflow[name] == overflow.sum().item() / n, name
        assert s.underflow[name] == ((y == 0) & (x != 0)).sum().item() / n, name
        assert s.subnormal[name] == ((y != 0) & (y.abs() < fi.tiny)).sum().item() / n, name
    assert s.count == n and s.nonfinite == 0
    assert s.absmax == x.abs().max().item()
    assert s.min_nonzero == x.abs()[x != 0].min().item()
    assert sum(s.hist) == (x != 0).sum().item() and len(s.hist) == len(HIST_EDGES) - 1
    # one bin per binade: 1.5 lands in [2^0, 2^1)
    with collect_ranges(model) as rc:
        model(torch.tensor([1.5, 0.0, -3.0, 1e-40, 2.0 ** 127, 2.0 ** -126]))
    hist = rc.results()[""]["activation"].hist
    assert hist[HIST_EDGES.index(0)] == 1 and hist[HIST_EDGES.index(1)] == 1
    assert hist[0] == 1 and hist[-1] == 1 and hist[HIST_EDGES.index(-126)] == 1
    assert sum(hist) == 5 and HIST_EDGES[0] == -127 and HIST_EDGES[-2] == 127


def test_kinds_nonfinite_and_accumulation() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh())
    x = torch.randn(5, 4)
    with collect_ranges(model) as rc:
        for _ in range(2):
            model(x).sum().backward()
        inside = rc.results()
    res = rc.results()
    assert list(res) == ["", "0", "1"]
    assert set(res["0"]) == {"activation", "grad", "weight", "weight_grad"}
    assert set(res["1"]) == {"activation", "grad"}
    lin = res["0"]
    assert lin["activation"].count == 2 * 15 and lin["grad"].count == 2 * 15
    assert lin["weight"].count == 12 + 3
    w_absmax = max(model[0].weight.abs().max().item(), model[0].bias.abs().max().item())
    assert lin["weight"].absmax == pytest.approx(w_absmax)
    assert lin["activation"].absmax == pytest.approx(model[0](x).abs().max().item())
    assert inside["0"]["activation"] == lin["activation"]

    model = Copy()
    with collect_ranges(model) as rc:
        model(torch.tensor([1.0, float("inf"), float("nan"), 2.0]))
    s = rc.results()[""]["activation"]
    assert (s.nonfinite, s.absmax, s.min_nonzero, s.count) == (2, 2.0, 1.0, 4)


class _Scale:
    def __init__(self, scale: float) -> None:
        self.scale = scale

    def get_scale(self) -> float:
        return self.scale


def test_gradients_judged_at_loss_scale() -> None:
    torch.manual_seed(0)
    model = nn.Linear(8, 8)
    x = torch.randn(4, 8)
    stats = []
    for scaler in (None, _Scale(2.0 ** 20)):
        with collect_ranges(model, scaler=scaler) as rc:
            (model(x) * 1e-3).sum().backward()
        stats.append(rc.results()[""])
    for kind in ("grad", "weight_grad"):
        assert stats[1][kind].absmax == stats[0][kind].absmax * 2.0 ** 20
        assert stats[1][kind].overflow["float16"] >= stats[0][kind].overflow["float16"]
    assert stats[1]["activation"] == stats[0]["activation"]
    with pytest.raises(TypeError, match="get_scale"):
        collect_ranges(model, scaler=object())


def test_no_hooks_after_exit_and_no_sync_inside(monkeypatch: pytest.MonkeyPatch) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    with collect_ranges(model) as rc:
        def no_sync(*a, **k):  # type: ignore[no-untyped-def]
            raise AssertionError("host sync inside collect_ranges hooks")

        with monkeypatch.context() as m:
            for attr in ("item", "tolist", "__bool__", "cpu"):
                m.setattr(torch.Tensor, attr, no_sync)
            y = model(torch.randn(3, 4))
            y.sum().backward()
    for mod in model.modules():
        assert not mod._forward_hooks
    for p in model.parameters():
        assert not p._backward_hooks
    before = rc.results()
    model(torch.randn(3, 4)).sum().backward()  # nothing is collected any more
    assert rc.results() == before


def test_stats_round_trip_json() -> None:
    model = Copy()
    with collect_ranges(model) as rc:
        model(torch.tensor([0.0, 1e-9, 7e4]))
    s = rc.results()[""]["activation"]
    d = json.loads(json.dumps(s.to_dict(), allow_nan=False))
    assert RangeStats.from_dict(d) == s
    with collect_ranges(model) as rc:
        model(torch.zeros(3))
    z = rc.results()[""]["activation"]
    assert math.isinf(z.min_nonzero) and z.to_dict()["min_nonzero"] is None


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_no_sync_inside() -> None:
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64)).cuda()
    x = torch.randn(8, 64, device="cuda")
    model(x).sum().backward()  # warm up
    with collect_ranges(model) as rc:
        torch.cuda.set_sync_debug_mode("error")
        try:
            model(x).sum().backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert rc.results()["0"]["activation"].count == 8 * 64


def test_beyond_float32_counts_as_overflow_not_nonfinite() -> None:
    model = Copy()
    with collect_ranges(model) as rc:
        model(torch.tensor([1e300, 1.0, float("inf"), -1e300], dtype=torch.float64))
    s = rc.results()[""]["activation"]
    assert s.nonfinite == 1 and s.absmax == torch.finfo(torch.float32).max
    assert all(v == 0.5 for v in s.overflow.values())
    json.dumps(s.to_dict(), allow_nan=False)

    class TensorScale:  # a scaler whose scale tensor changes in place after it was read
        def __init__(self) -> None:
            self.scale = torch.tensor(2.0 ** 20)

        def get_scale(self) -> torch.Tensor:
            return self.scale

    scaler = TensorScale()
    lin = nn.Linear(4, 4)
    x = torch.randn(2, 4)
    with collect_ranges(lin, scaler=scaler) as rc:
        scaler.scale.mul_(0.5)  # the collector keeps the value it read on entry
        (lin(x) * 1e34).sum().backward()  # gradients 1e34 * 2**20: past float32
    g = rc.results()[""]["grad"]
    assert g.nonfinite == 0 and g.overflow["bfloat16"] == 1.0
    with collect_ranges(lin, scaler=scaler) as rc:
        (lin(x) * 1e-3).sum().backward()
    assert rc.results()[""]["grad"].absmax == pytest.approx(1e-3 * 2.0 ** 19)


class ArgmaxHead(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.argmax(dim=-1)  # an integer output: nothing to measure


class Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 3)
        self.head = ArgmaxHead()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.body(x)
        return logits, self.head(logits)


def test_non_floating_outputs_are_skipped_and_audit_runs() -> None:
    model = Classifier()
    with collect_ranges(model) as ranges:
        logits, labels = model(torch.randn(5, 4))
        logits.sum().backward()
    stats = ranges.results()
    assert "head" not in stats and stats["body"]["activation"].count == 15
    assert labels.dtype == torch.int64
    report = mixprec.audit(model, torch.randn(5, 4), lambda m, x: m(x)[0].square().mean())
    assert "head" in report.modules and "head" not in report.ranges["float32"]


# --- fp8: the "after scaling" view --------------------------------------------------------------

def test_fp8_view_scales_each_tensor_as_the_recipe_does_hand_computed() -> None:
    x = torch.tensor([1e4, 1.0, -0.1, 1e-3, 0.0, -2.0])
    with collect_ranges(model := Copy()) as rc:
        model(x)
    s = rc.results()[""]["activation"]
    view = s.fp8_scaled
    assert view is not None and (view.recipe, view.granularity, view.pow2_scales, view.count) == (
        "tensorwise", "tensor", False, 6)
    assert view.view == "after a per-tensor scale finfo.max/amax (tensorwise)"
    # by hand: scale = 448 / 1e4; |x| * scale = 448, 0.0448 (normal: >= 2**-6), 0.00448
    # (subnormal: >= 2**-10), 4.48e-5 (flushed: < 2**-10), 0 (zero, not counted), 0.0896
    assert view.underflow["float8_e4m3fn"] == 1 / 6 and view.subnormal["float8_e4m3fn"] == 1 / 6
    # e5m2: scale = 57344 / 1e4, every non-zero value lands on a normal
    assert view.underflow["float8_e5m2"] == 0 and view.subnormal["float8_e5m2"] == 0
    # the unscaled view of the same values: 1e4 overflows e4m3fn; scaled, nothing saturates
    assert s.overflow["float8_e4m3fn"] == 1 / 6
    scale = torch.tensor(448 / 1e4, dtype=torch.float64).float()
    assert (x * scale).abs().max() <= 448
    d = json.loads(json.dumps(s.to_dict(), allow_nan=False))
    assert d["fp8_scaled"]["view"] == view.view and RangeStats.from_dict(d) == s


def test_fp8_view_rowwise_uses_row_scales_rounded_down_to_a_power_of_two() -> None:
    x = torch.tensor([[1e4, 1e-3, 1.0, 0.5], [1e-3, 2e-3, 1e-3, 3e-3]])
    model = Copy()
    views = {}
    for recipe in ("tensorwise", "rowwise"):
        with collect_ranges(model, fp8_recipe=recipe) as rc:
            model(x)
        views[recipe] = rc.results()[""]["activation"].fp8_scaled
    # tensorwise: one scale 448/1e4 flushes 1e-3, 2e-3 (< 2**-10 once scaled): 5 of 8 values
    assert views["tensorwise"].underflow["float8_e4m3fn"] == 5 / 8
    # rowwise: row 1 has its own scale 2**floor(log2(448/3e-3)) = 2**17: nothing flushes there
    # (1e-3 * 2**17 = 131); row 0 (scale 2**-5) flushes its 1e-3 only
    rw = views["rowwise"]
    assert (rw.granularity, rw.pow2_scales) == ("row", True)
    assert rw.underflow["float8_e4m3fn"] == 1 / 8
    assert rw.view == "after a per-row scale finfo.max/amax, rounded down to a power of 2 (rowwise)"
    with collect_ranges(model, fp8_recipe=None) as rc:
        model(x)
    assert rc.results()[""]["activation"].fp8_scaled is None
    with pytest.raises(ValueError, match="unknown fp8 recipe"):
        collect_ranges(model, fp8_recipe="fp2")
    for fp4 in ("nvfp4", "mxfp4"):  # an fp4 recipe has no fp8 after-scaling view: refused, not miscounted
        with pytest.raises(ValueError, match=f"fp8_recipe='{fp4}' is an fp4 recipe.*auto-fp4"):
            collect_ranges(model, fp8_recipe=fp4)


class Outlier(nn.Module):
    """Multiplies feature 0 by 1e5: an outlier feature for the next layer."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.tensor([1e5] + [1.0] * (x.shape[-1] - 1))


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_view_matches_what_the_fp8_layer_records(recipe: str) -> None:
    from mixprec import fp8

    torch.manual_seed(0)
    model = nn.Sequential(Outlier(), nn.Linear(32, 32, bias=False))
    model = fp8.convert(model, recipe, filter_fn=lambda m, fqn: fqn == "1")
    x = torch.randn(64, 32)
    g = log_uniform(64 * 32, -40, 0).reshape(64, 32)  # grad_output: e5m2 flushes some of it too
    with collect_ranges(model, fp8_recipe=recipe) as rc:
        (model(x) * g).sum().backward()
    res = rc.results()
    layer = fp8.layer_state(model[1]).read()
    r = fp8.Float8Recipe.from_name(recipe)
    for operand, stats, cast in (("input", res["0"]["activation"], r.input),
                                 ("weight", res["1"]["weight"], r.weight),
                                 ("grad_output", res["1"]["grad"], r.grad_output)):
        got = stats.fp8_scaled.underflow[f"float8_{cast.format}"]
        assert got == pytest.approx(layer[operand]["underflow"], rel=1e-6, abs=0), operand
        assert stats.absmax == layer[operand]["amax"], operand
    assert layer["input"]["underflow"] > 0.05 and layer["grad_output"]["underflow"] > 0.01  # not vacuous


def test_a_copy_taken_inside_the_block_adds_nothing_to_the_statistics():
    """An EMA copy (``copy.deepcopy``) taken inside ``collect_ranges`` runs with the collector's
    hooks copied, inert: only the collected model's own calls are counted."""
    import copy

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU())
    with collect_ranges(model) as rc:
        model(torch.randn(3, 8))
        copy.deepcopy(model)(torch.randn(5, 8) * 1e6)
    stats = rc.results()["0"]["activation"]
    assert stats.count == 3 * 8 and stats.absmax < 1e3
