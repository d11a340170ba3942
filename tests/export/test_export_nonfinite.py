"""An inf or NaN amax (a step a loss scaler skips) never becomes a static scale: the Recorder leaves the
step out, export refuses one it is given, and the manifest is strict JSON."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from torch import nn

import mixprec
from mixprec import fp8
from mixprec.export import Recorder, ScaleRule, load_static, load_stats
from mixprec.fp8 import Float8Recipe

safetensors_torch = pytest.importorskip("safetensors.torch", reason="safetensors is not installed")

NVFP4_1D = Float8Recipe.nvfp4(hadamard=False, stochastic_rounding=False, weight_block=(1, 16))
BATCHES = [torch.randn(8, 32, generator=torch.Generator().manual_seed(i)) for i in range(6)]
BAD = 2  # the step whose batch holds a non-finite value


class _Block(nn.Module):
    """Keys and values measured at ``k_proj``/``v_proj`` (no KV cache argument), then an MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.k_proj, self.v_proj, self.up, self.down = (nn.Linear(32, 32) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x + self.k_proj(x) * self.v_proj(x))))


def _model(recipe: Float8Recipe | str = "tensorwise") -> nn.Module:
    """fp8 layers ``1.k_proj``, ``1.v_proj``, ``1.up``, ``1.down`` (the first and last linear kept)."""
    torch.manual_seed(0)
    return fp8.convert(nn.Sequential(nn.Linear(32, 32), _Block(), nn.Linear(32, 32)), recipe)


def _train(every: int, bad: float | None) -> tuple[nn.Module, Recorder]:
    """Six SGD steps under a Recorder. Step ``BAD``'s batch holds ``bad`` and the step is skipped (no
    backward, as a loss scaler skips it); ``bad`` None: step ``BAD`` runs no forward (the reference)."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    rec = Recorder(model, every=every)
    for step, x in enumerate(BATCHES):
        if step != BAD or bad is not None:
            x = x.clone()
            if step == BAD:
                x[0, 0] = bad
            loss = model(x).square().mean()
            if torch.isfinite(loss):
                loss.backward()
                opt.step()
        opt.zero_grad()
        rec.step()
    rec.close()
    return model, rec


def _snapshot(folder) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def _sqnr_db(ref: torch.Tensor, x: torch.Tensor) -> float:
    ref, x = ref.double(), x.double()
    return float(20 * torch.log10(ref.norm() / (ref - x).norm()))


def _refuse_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


#: (every, the bad value, windows in the history): six steps, step 2's window left out (every=1), or
#: holding step 3 only (every=2)
SKIPPED = [(1, math.inf, 5), (2, math.nan, 3)]


@pytest.mark.parametrize("every,bad,windows", SKIPPED, ids=["every1-inf", "every2-nan"])
def test_a_skipped_steps_amaxes_are_left_out_and_the_export_is_the_runs_without_it(tmp_path, every, bad, windows):
    """The windows, scales and files are those of the same run whose bad step ran no forward."""
    model, rec = _train(every, bad)
    reference, ref_rec = _train(every, None)
    assert rec.history.shape == (windows, len(rec.names))
    assert torch.equal(rec.history, ref_rec.history)  # bitwise, finite
    q = mixprec.export(model, tmp_path / "served", stats=rec)
    mixprec.export(reference, tmp_path / "reference", stats=ref_rec)
    assert _snapshot(tmp_path / "served") == _snapshot(tmp_path / "reference")

    stored = safetensors_torch.load_file(str(tmp_path / "served" / "model.safetensors"))
    hist = ref_rec.series()
    for fqn in ("1.k_proj", "1.v_proj", "1.up", "1.down"):
        amaxes = torch.stack([hist["1.k_proj:input"], hist["1.v_proj:input"]]).amax(0) \
            if fqn in ("1.k_proj", "1.v_proj") else hist[f"{fqn}:input"]  # fused shards: one input scale
        assert torch.equal(stored[f"{fqn}.input_scale"], ScaleRule().scale(amaxes)), fqn
    assert torch.equal(stored["1.k_scale"], ScaleRule().scale(hist["1:k"]))
    manifest = json.loads((tmp_path / "served" / "mixprec_export.json").read_text(), parse_constant=_refuse_constant)
    assert manifest["layers"]["1.up"]["input_amax"] == q.layers["1.up"].input_amax == float(hist["1.up:input"].max())

    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(9))
    served = load_static(fp8.unconvert(copy.deepcopy(model)), tmp_path / "served")
    with torch.no_grad():
        assert _sqnr_db(model(x), served(x)) > 20  # fp8 e4m3 weights and inputs: about 30 dB here


#: (case, the layers' recipe, the saved windows: series -> amaxes, ScaleRule, the error's words)
REFUSED = [
    ("fp8-input-inf", "tensorwise", {"1.up:input": [math.inf]}, ScaleRule(),
     r"amax of the input of layer '1\.up' is inf \(recorded windows\)"),
    ("fp8-input-nan-last-window", "tensorwise", {"1.up:input": [2.0, math.nan]}, ScaleRule(windows=1),
     r"amax of the input of layer '1\.up' is nan"),
    ("keys-inf", "tensorwise", {"1:k": [math.inf, 2.0]}, ScaleRule(), r"amax of the keys of attention '1' is inf"),
    ("values-nan", "tensorwise", {"1:v": [math.nan]}, ScaleRule(), r"amax of the values of attention '1' is nan"),
    ("nvfp4-input-inf", NVFP4_1D, {"1.up:input": [math.inf]}, ScaleRule(),
     r"amax of the input of layer '1\.up' is inf"),
    # a layer that ran only in windows older than the rule's: a scale of 1e-12 / 448 (NVFP4: an infinite
    # input_global_scale) was written, every served input flushed
    ("fp8-input-older-windows", "tensorwise", {"1.up:input": [2.0, 1.5, 0.0, 0.0]}, ScaleRule(windows=2),
     r"amax of the input of layer '1\.up' over the ScaleRule's windows is 0\.0"),
    ("nvfp4-input-older-windows", NVFP4_1D, {"1.up:input": [2.0, 0.0]}, ScaleRule(windows=1),
     r"amax of the input of layer '1\.up' over the ScaleRule's windows is 0\.0"),
    ("keys-older-windows", "tensorwise", {"1:k": [3.0, 0.0]}, ScaleRule(windows=1),
     r"amax of the keys of attention '1' over the ScaleRule's windows is 0\.0"),
]


@pytest.mark.parametrize("case,recipe,windows,rule,words", REFUSED, ids=[c[0] for c in REFUSED])
def test_export_refuses_a_non_finite_amax_naming_the_layer(tmp_path, case, recipe, windows, rule, words):
    """Statistics saved with an inf or NaN window (by an earlier mixprec, or edited): the rule's amax is
    refused, not written as a scale of inf or 0 (an NVFP4 ``input_global_scale``); the other layers'
    come from their finite ``LayerState`` windows."""
    model = _model(recipe)
    model(BATCHES[0])
    torch.save({"names": list(windows), "history": torch.tensor(list(windows.values())).T, "kv_sites": {}},
               tmp_path / "stats.pt")
    with pytest.raises(ValueError, match=words) as err:
        mixprec.export(model, tmp_path / "out", stats=load_stats(tmp_path / "stats.pt"), rule=rule)
    assert "mixprec.export.Recorder" in str(err.value)
    assert not (tmp_path / "out").exists()


def test_a_window_without_the_non_finite_one_is_taken(tmp_path):
    """What the error advises: a rule whose windows exclude the non-finite one gives the finite scale."""
    model = _model()
    model(BATCHES[0])
    torch.save({"names": ["1.up:input"], "history": torch.tensor([[math.inf], [3.0]])}, tmp_path / "stats.pt")
    q = mixprec.export(model, tmp_path / "out", stats=load_stats(tmp_path / "stats.pt"), rule=ScaleRule(windows=1),
                       kv_cache=False)
    assert torch.equal(q.layers["1.up"].input_scale, mixprec.export.static_scale(torch.tensor(3.0)))


def test_without_a_finite_window_the_layer_states_inf_amax_is_refused(tmp_path):
    """A Recorder that saw only the skipped step has no window; the fp8 ``LayerState`` window it falls
    back to saw the inf: refused, naming the first fp8 layer."""
    model = _model()
    with Recorder(model) as rec:
        x = BATCHES[0].clone()
        x[0, 0] = math.inf
        model(x)
        rec.step()
    assert rec.history.shape == (0, len(rec.names))
    with pytest.raises(ValueError, match=r"amax of the input of layer '1\.k_proj' is inf \(fp8 LayerState"):
        mixprec.export(model, tmp_path / "out", stats=rec)
