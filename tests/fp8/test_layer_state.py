"""LayerState's window: the one place that knows its layout (rows per operand, the statistics,
then the previous cast's amax)."""

from __future__ import annotations

import pickle

import pytest
import torch

from mixprec import fp8
from mixprec.formats._quant import cast_stats, cast_to_fp8
from mixprec.formats._state import INPUT, WEIGHT, new_window, record_cast, window_stats


def _cast(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    q, _, amax = cast_to_fp8(x, fp8.Cast("e4m3fn"), -1, False)
    return q, amax


def test_record_cast_keeps_the_worst_values_and_the_last_amax():
    window = new_window()
    big, small = torch.tensor([[4.0, -1e-9, 2.0]]), torch.tensor([[0.5, 0.25, 1e-12]])
    record_cast(window, WEIGHT, big, *_cast(big))
    record_cast(window, WEIGHT, small, *_cast(small))
    first = cast_stats(big, *_cast(big), torch.tensor(0.0))
    second = cast_stats(small, *_cast(small), torch.tensor(4.0))
    assert torch.equal(window_stats(window)[WEIGHT], torch.maximum(first, second))
    assert window[WEIGHT, -1].item() == 0.5  # the last cast's amax, for the next one's saturation
    assert not window[INPUT].any() and not window[2].any()
    record_cast(None, INPUT, big, *_cast(big))  # no window: nothing to do, no error


def test_layer_state_views_and_loading():
    st = fp8.LayerState()
    x = torch.tensor([[3.0, -6.0]])
    st.record(INPUT, x, *_cast(x))
    assert st.window_amax(INPUT).tolist() == [6.0] and st.last_amax(INPUT).item() == 6.0
    assert st.window_amax(INPUT).data_ptr() == st.window.data_ptr()  # views of the device window
    st.reset()
    assert st.window_amax(INPUT).item() == 0.0 and st.last_amax(INPUT).item() == 6.0
    saved = st.window.clone()
    other = fp8.LayerState()
    other.load_window(saved, 12.5)
    assert torch.equal(other.window, saved) and other.output_sqnr_db.item() == 12.5
    with pytest.raises(ValueError, match=r"a window of shape \(3, 4\), expected \(3, 5\)"):
        other.load_window(torch.zeros(3, 4))


def test_guard_refuses_a_window_of_another_shape():
    lin = fp8.convert(torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(3)]))
    guard = fp8.Guard()
    guard.track(lin)
    sd = guard.state_dict()
    sd["windows"]["1"]["stats"] = [[0.0] * 4] * 3
    with pytest.raises(ValueError, match=r"Guard.load_state_dict: a window of shape \(3, 4\), expected \(3, 5\)"):
        guard.load_state_dict(sd)


def test_a_model_pickled_before_the_layers_moved_loads():
    """Float8Linear moved from fp8/_convert.py to fp8/_layers.py: a pickle naming the old module loads."""
    model = fp8.convert(torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(3)]))
    old = pickle.dumps(model, protocol=0).replace(b"mixprec.formats._layers", b"mixprec.control._convert")
    assert b"mixprec.control._convert\nFloat8Linear" in old
    loaded = pickle.loads(old)
    assert type(loaded[1]) is fp8.Float8Linear and torch.equal(loaded[1].weight, model[1].weight)
