"""audit: recommends keeping the overflowing layer, the policy trains clean, model untouched."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
from torch import nn

import mixprec
from mixprec.diagnostics import AuditReport, audit


class Blow(nn.Module):
    """Overflows float16 inside, but its (normalised) output is small."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * 1e6
        return h / h.norm(dim=-1, keepdim=True)


class Block(nn.Module):
    def __init__(self, blow: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.act = Blow() if blow else nn.Tanh()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.fc(x))


def make(at: int | None, n: int = 3) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Sequential(*[Block(i == at) for i in range(n)]), nn.Linear(8, 2)
    )


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x).float(), y)


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(4, 8, generator=g), torch.randn(4, 2, generator=g)


def train(model: nn.Module, policy: mixprec.Policy | None, dtype: torch.dtype, scale: float,
          steps: int = 3) -> bool:
    """A few SGD steps under mixprec.autocast with a fixed loss scale; True if all were finite."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    b = batch()
    for _ in range(steps):
        opt.zero_grad()
        with mixprec.autocast("cpu", dtype=dtype, policy=policy):
            loss = loss_fn(model, b)
        (loss * scale).backward()
        grads = [p.grad for p in model.parameters()]
        if not (torch.isfinite(loss) and all(torch.isfinite(g).all() for g in grads)):
            return False
        for g in grads:
            g.div_(scale)
        opt.step()
    return True


@pytest.mark.parametrize("at", [0, 2])
def test_float16_only_keeps_the_overflowing_layer_and_trains_clean(at: int) -> None:
    model = make(at)
    report = audit(model, batch(), loss_fn, dtypes=(torch.float16,))
    name = f"0.{at}.act"
    assert report.dtype == "float16" and report.dtypes == ("float16",)
    ev = report.default_events["float16"]
    assert ev is not None and ev.module == name and ev.phase == "forward"
    assert report.keep["float16"] == (name,) and report.verified["float16"]
    assert report.policy.compute == torch.float16
    (rule,) = report.policy.module_rules
    assert rule.dtype == torch.float32
    assert [n for n, m in model.named_modules() if rule.matches(m, n)] == [name]
    assert report.risks[0].module == name and report.risks[0].issue == "nonfinite"
    # the recommended policy trains without overflow where the default one does not
    s = report.init_scale
    assert s == 2.0 ** round(math.log2(s)) and 1.0 <= s <= 2.0 ** 15
    assert train(make(at), report.policy, torch.float16, s)
    assert not train(make(at), None, torch.float16, s)


def test_both_dtypes_prefers_bfloat16_when_float16_needs_keeps() -> None:
    report = audit(make(1), batch(), loss_fn)
    assert report.dtypes == ("float16", "bfloat16")
    assert report.keep["float16"] == ("0.1.act",)
    assert report.dtype == "bfloat16" and report.keep["bfloat16"] == ()
    assert report.policy.compute == torch.bfloat16 and report.policy.module_rules == ()
    assert report.init_scale == 1.0 and "float16 needs modules kept" in report.reason
    with mixprec.autocast("cpu", policy=report.policy):
        y = make(1)(batch()[0])
    assert y.dtype == torch.bfloat16 and torch.isfinite(y).all()


def test_clean_model_prefers_float16_with_a_safe_scale() -> None:
    model = make(None)
    report = audit(model, batch(), loss_fn, dtypes=("fp16", "bf16"), steps=2)
    assert report.dtype == "float16" and report.keep == {"float16": (), "bfloat16": ()}
    assert all(report.verified.values()) and report.default_events == {
        "float16": None, "bfloat16": None}
    gmax = max(s.absmax for kinds in report.ranges["float32"].values()
               for k, s in kinds.items() if k in ("grad", "weight_grad"))
    assert report.init_scale == min(2.0 ** 15, 2.0 ** math.floor(math.log2(65504 / (gmax * 8))))
    scaled = report.ranges["float32@scale"]
    assert scaled["1"]["grad"].absmax == report.ranges["float32"]["1"]["grad"].absmax * report.init_scale
    assert report.ranges["float32"]["1"]["activation"].count == 2 * 4 * 2  # steps=2


def test_model_state_is_restored() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), Blow(),
                          nn.Linear(8, 2))
    model[0].weight.grad = torch.full_like(model[0].weight, 3.0)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(123)
    audit(model, batch(), loss_fn, dtypes=("float16",))
    after_rng = torch.rand(3)
    torch.manual_seed(123)
    assert torch.equal(after_rng, torch.rand(3))
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k]), k
    assert torch.equal(model[0].weight.grad, torch.full_like(model[0].weight, 3.0))
    assert all(p.grad is None for p in model[4].parameters())
    for m in model.modules():
        assert not m._forward_hooks and not m._forward_pre_hooks


def test_scaler_scale_is_used_to_judge_gradients() -> None:
    class Scaler:
        def get_scale(self) -> float:
            return 2.0 ** 30

    report = audit(make(None), batch(), loss_fn, dtypes=("float16",), scaler=Scaler())
    assert report.grad_scale == 2.0 ** 30
    assert any(r.issue == "overflow" and r.tensor in ("grad", "weight_grad")
               for r in report.risks)


def test_errors() -> None:
    model = make(None)
    with pytest.raises(ValueError, match="float16 and bfloat16"):
        audit(model, batch(), loss_fn, dtypes=(torch.float32,))
    with pytest.raises(ValueError, match="empty"):
        audit(model, batch(), loss_fn, dtypes=())
    with pytest.raises(ValueError, match="steps"):
        audit(model, batch(), loss_fn, steps=0)
    with pytest.raises(ValueError, match="scalar tensor"):
        audit(model, batch(), lambda m, b: m(b[0]), dtypes=("bf16",))
    with pytest.raises(TypeError, match="loss_fn"):
        audit(model, batch(), None)  # type: ignore[arg-type]

    class NaNModel(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x) * float("nan")

    with pytest.raises(RuntimeError, match="already in float32.*NaNModel"):
        audit(NaNModel(), batch(), loss_fn)


def test_report_outputs(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    report = audit(make(1), batch(), loss_fn)
    assert isinstance(report, AuditReport)
    text = report.summary_text()  # the text, nothing printed
    assert "compute=bfloat16" in text and "0.1.act" in text and "float16" in text
    assert capsys.readouterr().out == ""
    assert report.summary() is None  # printed only (before: printed and returned the text)
    assert "0.1.act" in capsys.readouterr().out
    d = json.loads(json.dumps(report.to_dict(), allow_nan=False))
    assert d["dtype"] == "bfloat16" and d["keep"]["float16"] == ["0.1.act"]
    assert d["default_events"]["float16"]["module"] == "0.1.act"
    assert set(d["ranges"]) == {"float32", "float32@scale", "float16", "bfloat16"}
    report.save(tmp_path / "rep")
    page = (tmp_path / "rep" / "index.html").read_text()
    assert page.count("data:image/png;base64,") == 2
    assert "0.1.act" in page and "<script" not in page and "http" not in page.replace(
        "http-equiv", "")
    assert json.loads((tmp_path / "rep" / "report.json").read_text())["dtype"] == "bfloat16"


def test_policy_names_are_exact_and_escaped() -> None:
    from mixprec.diagnostics.audit import _policy

    (rule,) = _policy("float16", {"a.b", "c"}).module_rules
    assert rule.matches(nn.Identity(), "a.b") and rule.matches(nn.Identity(), "c")
    for other in ("aXb", "a.bc", "xa.b", "c.d", ""):
        assert not rule.matches(nn.Identity(), other), other
    assert re.fullmatch(r"\^\(\?:.*\)\$", rule.names or "")


def test_public_names() -> None:
    import mixprec.diagnostics as diag

    for name in ("trace_nonfinite", "collect_ranges", "audit", "AuditReport"):
        assert getattr(mixprec, name) is getattr(diag, name)
    assert all(not n.startswith("_") for n in diag.__all__)
    assert {"NonFiniteEvent", "NonFiniteError", "RangeStats", "Risk"} <= set(diag.__all__)


def test_audit_accepts_a_criterion_with_an_inputs_target_batch():
    import torch.nn.functional as F

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    batch = (torch.randn(4, 6), torch.tensor([0, 1, 2, 1]))
    for crit in (nn.CrossEntropyLoss(), F.cross_entropy):
        report = mixprec.audit(model, batch, crit, dtypes=(torch.bfloat16,))
        assert report.policy.compute is torch.bfloat16
    with pytest.raises(ValueError, match="criterion"):
        mixprec.audit(model, torch.randn(4, 6), nn.MSELoss())


def test_device_type_must_match_the_model() -> None:
    # autocast("cuda") leaves CPU tensors in float32: the audit would call float32 "float16"
    with pytest.raises(ValueError, match="model is on cpu but device_type='cuda'"):
        audit(make(None), batch(), loss_fn, device_type="cuda")
    with pytest.raises(TypeError, match="device_type"):
        audit(make(None), batch(), loss_fn, device_type=torch.device("cpu"))  # type: ignore[arg-type]


class Attention(nn.Module):
    """q, k, v projections of one input (siblings); the scores overflow float16."""

    def __init__(self, d: int, hot: bool) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)
        self.hot = hot

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.q(x) @ self.k(x).transpose(-1, -2) * (1e5 if self.hot else 0.25)
        return self.norm(x + torch.softmax(s, -1) @ self.v(x))


class TinyTransformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(16, 8)
        self.blocks = nn.Sequential(Attention(8, hot=False), Attention(8, hot=True))
        self.head = nn.Linear(8, 4)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.emb(tokens))).mean(1)


def test_tiny_transformer_with_a_criterion_trains_clean_in_float16() -> None:
    g = torch.Generator().manual_seed(1)
    data = (torch.randint(0, 16, (2, 5), generator=g), torch.tensor([1, 2]))
    crit = nn.CrossEntropyLoss()
    report = audit(TinyTransformer(), data, crit, dtypes=(torch.float16,))
    assert report.dtype == "float16" and report.verified["float16"]
    assert report.keep["float16"] == ("blocks.1",)
    ev = report.default_events["float16"]
    assert ev is not None and ev.module == "blocks.1"

    def trains(policy: mixprec.Policy | None) -> bool:
        model = TinyTransformer()
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        for _ in range(3):
            opt.zero_grad()
            with mixprec.autocast("cpu", dtype=torch.float16, policy=policy):
                loss = crit(model(data[0]).float(), data[1])
            (loss * report.init_scale).backward()
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            if not (torch.isfinite(loss) and all(torch.isfinite(g).all() for g in grads)):
                return False
            for p in grads:
                p.div_(report.init_scale)
            opt.step()
        return True

    assert trains(report.policy) and not trains(None)


def test_use_it_line_follows_the_chosen_dtype(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """bfloat16 needs no scaler; float16 gets the report's own init_scale (it said
    ``GradScaler(init_scale=1) for float16`` whatever was chosen)."""
    bf16 = audit(make(1), batch(), loss_fn)
    fp16 = audit(make(None), batch(), loss_fn)
    assert (bf16.dtype, fp16.dtype) == ("bfloat16", "float16")
    k = int(math.log2(fp16.init_scale))
    for report, line in (
        (bf16, "use it: with mixprec.autocast('cpu', policy=report.policy): ...; bfloat16 needs no loss scaling"),
        (fp16, "use it: with mixprec.autocast('cpu', policy=report.policy): ...; "
               f"scaler = mixprec.GradScaler('cpu', init_scale=2**{k})"),
    ):
        assert line in report.summary_text().splitlines()
        report.save(tmp_path / report.dtype)
        page = (tmp_path / report.dtype / "index.html").read_text()
        assert ("GradScaler" in page) == (report.dtype == "float16")
        assert mixprec.Policy.load(tmp_path / report.dtype / "report.json") == report.policy


# ------------------------------------------------------------------ nothing unmeasured is recommended
def test_an_empty_batch_is_an_error_not_a_float16_recommendation() -> None:
    empty = (torch.randn(0, 8), torch.randn(0, 2))
    with pytest.raises(ValueError, match="the batch is empty.*at least one sample"):
        audit(make(None), empty, loss_fn)
    with pytest.raises(ValueError, match="the batch is empty"):
        audit(make(None), torch.randn(0, 8), lambda m, x: m(x).square().mean())


def test_a_non_finite_float32_loss_made_outside_every_module_is_an_error() -> None:
    def nan_loss(model: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return loss_fn(model, b) + torch.tensor(-1.0).log()  # NaN, with finite gradients

    with pytest.raises(RuntimeError, match="the loss is nan already in float32.*loss_fn"):
        audit(make(None), batch(), nan_loss)


def overflowing_loss(model: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Overflows float16 in loss_fn's own code (a square of a large fp16 value), outside every
    module; its gradients stay finite."""
    return (model(b[0]) * 3e4).square().mean() / 1e9


def test_a_loss_that_overflows_outside_every_module_is_not_verified() -> None:
    report = audit(make(None), batch(), overflowing_loss)
    assert report.default_events["float16"] is None  # no module saw an inf: only the loss did
    assert report.verified == {"float16": False, "bfloat16": True}
    assert report.dtype == "bfloat16" and report.init_scale == 1.0
    assert math.isinf(report.losses["float16"][0]) and math.isfinite(report.losses["float32"][0])
    assert "float16's loss inf" in report.reason
    only = audit(make(None), batch(), overflowing_loss, dtypes=("fp16",))
    assert only.verified == {"float16": False} and "WARNING" in only.reason
    assert json.loads(json.dumps(only.to_dict(), allow_nan=False))["losses"]["float16"] == [None]


def test_a_loss_far_from_float32s_is_not_verified() -> None:
    def cancelling(model: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        near_one = torch.full((1, 1), 1.0001) @ torch.ones(1, 1)  # 1.0 in either half dtype
        return loss_fn(model, b) * 1e-6 + near_one.squeeze() - 1

    report = audit(make(None), batch(), cancelling)
    assert report.verified == {"float16": False, "bfloat16": False}
    assert "by more than loss_rtol" in report.reason
    loose = audit(make(None), batch(), cancelling, loss_rtol=2.0)
    assert loose.verified == {"float16": True, "bfloat16": True}
    with pytest.raises(ValueError, match="loss_rtol"):
        audit(make(None), batch(), loss_fn, loss_rtol=0)


def test_verified_losses_are_recorded_per_pass() -> None:
    report = audit(make(None), batch(), loss_fn, steps=2)
    assert set(report.losses) == {"float32", "float16", "bfloat16"}
    assert all(len(v) == 2 for v in report.losses.values())
    ref = report.losses["float32"][0]
    assert all(abs(v[0] - ref) <= 0.05 * abs(ref) for v in report.losses.values())


@pytest.mark.parametrize("fp8", [None, "auto"])
def test_audit_runs_on_a_bfloat16_model_with_its_default_dtypes(fp8):
    """A bfloat16 model, default dtypes (float16 among them): the audit measures and recommends
    (before: its hooks' own math ran under float16 autocast, 'Unexpected floating ScalarType in
    at::autocast::prioritize', for every bf16 model, fp8='auto' too). The model is untouched."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 1)).bfloat16()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(4, 8).bfloat16()
    report = audit(model, x, lambda m, b: m(b).float().square().mean(), fp8=fp8)
    assert isinstance(report, AuditReport) and report.policy.compute in (torch.float16, torch.bfloat16)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    with mixprec.autocast("cpu", policy=report.policy):
        assert model(x).dtype == report.policy.compute


def test_the_underflow_figure_plots_what_the_risks_table_judges() -> None:
    """The figure's gradient bars are each dtype's risks: float16's at the loss scale, bfloat16's
    unscaled (it drew bfloat16's from the gradients at float16's loss scale: 5.5% where the table
    said 7.5%)."""
    from mixprec.diagnostics.report import underflow_shares

    class Small(nn.Module):  # gradients below bfloat16's normal range, within it at the loss scale
        def __init__(self) -> None:
            super().__init__()
            self.body, self.head = nn.Linear(8, 8), nn.Linear(8, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.body(x)) * 1e-37

    torch.manual_seed(0)
    report = audit(Small(), (torch.randn(16, 8), torch.randn(16, 4)), lambda m, b: (m(b[0]) - b[1]).square().mean())
    assert report.grad_scale > 1
    shares = underflow_shares(report)["grad"]
    modules = [m for m in report.modules if m in report.ranges["float32"]]
    for d in ("float16", "bfloat16"):
        table = [sum(r.fraction for r in report.risks if (r.dtype, r.module, r.tensor) == (d, m, "grad")
                     and r.issue in ("underflow", "subnormal")) for m in modules]
        assert shares[d] == pytest.approx(table), d
    assert max(shares["bfloat16"]) == 1.0  # (at the loss scale bfloat16's would read 0)
