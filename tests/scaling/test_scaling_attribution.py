"""mixprec.GradScaler's overflow attribution: watch(), last_overflow, MinScaleError and the
history callback (CSV, TensorBoard)."""

from __future__ import annotations

import pickle
import warnings

import pytest
import torch
from torch import nn

from mixprec.scaling import _attribution
from mixprec.scaling import CSVHistory, GradScaler, MinScaleError, TensorBoardHistory

from _scaling_cases import INF, make_optimizer, one_param_step


def test_min_scale_raise_names_parameters_step_and_history():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler("cpu", init_scale=4.0, min_scale=2.0).watch(model)
    for step in range(3):
        scaler.scale(model(torch.ones(1, 2)).sum()).backward()
        model[1].bias.grad[0] = INF
        if step < 1:
            scaler.step(opt)
            scaler.update()
            assert scaler.last_overflow == ("1.bias",)
            opt.zero_grad()
            continue
        scaler.step(opt)
        with pytest.raises(MinScaleError) as info:
            scaler.update()
        break
    message = str(info.value)
    assert "1.bias" in message and "step 1" in message and "[4, 2]" in message and "Try" in message
    assert scaler.get_scale() == 2.0
    # After the error the scaler is usable (the iteration was closed).
    opt.zero_grad()
    scaler.scale(model(torch.ones(1, 2)).sum()).backward()
    scaler.step(opt)
    scaler.update()


def test_min_scale_raise_without_watch_uses_optimizer_labels():
    p = nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([p], lr=1.0)
    scaler = GradScaler("cpu", init_scale=1.0, min_scale=1.0)
    with pytest.raises(MinScaleError, match=r"param_groups\[0\]\['params'\]\[0\] \(3,\)"):
        one_param_step(scaler, opt, p, True)


def test_min_scale_warn_once_and_ignore():
    p = nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([p], lr=1.0)
    scaler = GradScaler("cpu", init_scale=1.0, min_scale=1.0, on_min_scale="warn")
    with pytest.warns(RuntimeWarning, match="min_scale"):
        one_param_step(scaler, opt, p, True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        one_param_step(scaler, opt, p, True)
        quiet = GradScaler("cpu", init_scale=1.0, min_scale=1.0, on_min_scale="ignore")
        one_param_step(quiet, opt, p, True)
    assert scaler.skipped_steps.item() == 2 and scaler.get_scale() == 1.0


def test_watch_attributes_only_on_skipped_steps(monkeypatch):
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler("cpu")
    assert scaler.last_overflow is None
    scaler.watch(model, prefix="net.")
    calls = []
    original = _attribution.nonfinite_names
    monkeypatch.setattr(_attribution, "nonfinite_names", lambda named: calls.append(1) or original(named))
    for bad in (False, True, False):
        opt.zero_grad()
        scaler.scale(model(torch.ones(1, 2)).sum()).backward()
        if bad:
            model[0].weight.grad[0, 0] = float("nan")
        scaler.step(opt)
        scaler.update()
        assert scaler.last_overflow == (("net.0.weight",) if bad else ())
    assert len(calls) == 1


@pytest.mark.parametrize("kind", ["plain", "fused"])
def test_watch_attributes_before_clipping_spreads_nan(kind, syncs):
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    opt = make_optimizer(kind, model.parameters())
    scaler = GradScaler("cpu").watch(model)
    scaler.scale(model(torch.ones(1, 2)).sum()).backward()
    model[1].weight.grad[0, 0] = float("nan")
    syncs.start()
    scaler.unscale_(opt)
    nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    assert torch.isnan(model[0].weight.grad).all()  # clipping spread the NaN
    clean = syncs.count
    scaler.step(opt)
    scaler.update()
    syncs.stop()
    assert scaler.last_overflow == ("1.weight",)
    assert syncs.count == clean  # the step reused the flag read in unscale_


def test_history_callback_and_csv(tmp_path):
    rows = []
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    csv_path = tmp_path / "scale.csv"
    writer = CSVHistory(csv_path)
    scaler = GradScaler("cpu", init_scale=8.0, history=lambda *row: (rows.append(row), writer(*row)))
    scaler.watch(model)
    for bad in (False, True, False):
        opt.zero_grad()
        scaler.scale(model(torch.ones(1, 2)).sum()).backward()
        if bad:
            model.bias.grad[1] = INF
        scaler.step(opt)
        scaler.update()
    writer.close()
    assert rows == [(0, 8.0, False, ()), (1, 8.0, True, ("bias",)), (2, 4.0, False, ())]
    assert CSVHistory.read(csv_path) == rows
    clone = pickle.loads(pickle.dumps(writer))
    clone(3, 4.0, False, ())
    clone.close()
    assert CSVHistory.read(csv_path)[-1] == (3, 4.0, False, ())


def test_tensorboard_history_with_a_writer():
    class Recorder:
        def __init__(self):
            self.calls = []

        def add_scalar(self, tag, value, step):
            self.calls.append((tag, value, step))

        def add_text(self, tag, text, step):
            self.calls.append((tag, text, step))

        def close(self):
            self.calls.append("closed")

    recorder = Recorder()
    history = TensorBoardHistory(writer=recorder)
    history(5, 2.0, True, ("w",))
    history.close()
    assert recorder.calls == [
        ("loss_scale/scale", 2.0, 5),
        ("loss_scale/skipped", 1.0, 5),
        ("loss_scale/overflow", "w", 5),
        "closed",
    ]


def test_tensorboard_history_without_tensorboard_says_what_to_install(tmp_path):
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="pip install"):
            TensorBoardHistory(str(tmp_path))
    else:
        TensorBoardHistory(str(tmp_path))(0, 1.0, False, ())


def test_non_optimizer_and_repeated_watch():
    model = nn.Linear(2, 2)
    scaler = GradScaler("cpu").watch(model).watch(model)  # watching twice names each once
    scaler.scale(torch.tensor(1.0))
    for call in (scaler.unscale_, scaler.step):
        with pytest.raises(TypeError, match="Pass the optimizer"):
            call(list(model.parameters()))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.ones(1, 2)).sum().backward()
    model.bias.grad[0] = INF
    scaler.step(opt)
    scaler.update()
    assert scaler.last_overflow == ("bias",)


@pytest.mark.cuda
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_names_wait_for_the_flags():
    """The flags are computed on a busy stream; names read from a non-blocking host copy without
    a sync would come back empty (a race), ours wait for them."""
    grads = [("clean", torch.ones(1 << 20, device="cuda")), ("bad", torch.ones(1 << 20, device="cuda"))]
    grads[1][1][-1] = INF
    torch.cuda._sleep(1 << 30)  # keep the stream busy for a good while
    assert _attribution.nonfinite_names(grads) == ("bad",)
