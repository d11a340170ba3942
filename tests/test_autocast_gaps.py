"""Region behaviours from the issues: torch's error words, fp8 warnings, cast-cache dtypes."""

import pytest
import torch
from torch import nn

import mixprec
from mixprec import Policy


@pytest.mark.parametrize("device, torch_words", [
    ("not a real device", "Invalid device string: 'not a real device'"),
    ("cuda:x", "Invalid device string: 'cuda:x'"),
])
def test_an_invalid_device_string_leads_with_torchs_words(device, torch_words):
    with pytest.raises(RuntimeError) as torch_error:
        torch.autocast(device)
    assert str(torch_error.value) == torch_words  # the oracle: torch's test_invalid_device
    with pytest.raises(RuntimeError, match=torch_words) as ours:
        mixprec.autocast(device)
    assert str(ours.value).startswith(torch_words) and "mixprec.autocast" in str(ours.value)
    assert isinstance(ours.value, ValueError)


def _fp8_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32),
                         nn.ReLU(), nn.Linear(32, 16))


def test_a_criterion_called_in_an_fp8_region_gives_no_false_warning(recwarn):
    model, criterion = _fp8_model(), nn.CrossEntropyLoss()
    x, target = torch.randn(8, 16), torch.randint(0, 16, (8,))
    policy = Policy.parse("bf16").fp8("tensorwise")
    with mixprec.autocast("cpu", policy=Policy.parse("bf16")):
        bf16_out = model(x)
    with mixprec.autocast("cpu", policy=policy):
        out = model(x)
        loss = criterion(out, target)
    loss.backward()
    assert not [w for w in recwarn if "no layer selected" in str(w.message)]
    assert not torch.equal(out, bf16_out)  # fp8 ran (layers 2 and 4)
    assert mixprec.fp8.layer_state(model[2]).routed and model[2].weight.grad is not None


def test_a_region_whose_modules_have_no_linear_still_warns():
    policy = Policy.parse("bf16").fp8("tensorwise")
    with pytest.warns(UserWarning, match=r"no layer selected.*no module called in the region.*\(called: Tanh, Softsign\)"):
        with mixprec.autocast("cpu", policy=policy):
            nn.Softsign()(nn.Tanh()(torch.randn(2, 3)))
