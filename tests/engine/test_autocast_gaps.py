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


def _tied(kept_first: bool):
    torch.manual_seed(0)
    a, b = nn.Linear(8, 8), nn.Linear(8, 8)
    b.weight = a.weight  # tied
    model = nn.Sequential(a, b)
    return model, Policy.parse("bf16").keep(names=r"^0$" if kept_first else r"^1$", dtype="f16")


@pytest.mark.parametrize("kept_first", [True, False])
def test_a_half_dtype_rule_does_not_share_torchs_cast_cache(kept_first):
    """torch's cache is keyed by the weight, not the dtype: a tied weight cast to float16 for the
    kept module was handed to the bfloat16 module (or the reverse): a dtype crash."""
    model, policy = _tied(kept_first)
    x = torch.randn(2, 8)
    with mixprec.autocast("cpu", policy=policy, cache_enabled=False):  # the reference: no cache
        ref = model(x)
    with mixprec.autocast("cpu", policy=policy):
        out = model(x)
    assert out.dtype == ref.dtype == (torch.bfloat16 if kept_first else torch.float16)
    assert torch.equal(out, ref)


def test_threads_sharing_a_model_with_a_half_dtype_rule():
    import threading

    model, policy = _tied(True)
    x = torch.randn(2, 8)
    errors = []

    def run(p):
        try:
            for _ in range(20):
                with mixprec.autocast("cpu", policy=p):
                    model(x)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=run, args=(p,)) for p in (policy, Policy.parse("bf16"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert errors == []
