"""Pure-bf16 training with Kahan/stochastic updates and MasterWeights reaches fp32's loss; naive
bf16 stalls. Small deterministic regression task on the CPU."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from mixprec.optim import AdamW

STEPS = 600
LR = 2e-4  # Adam moves each weight by ~lr per step: far below bf16's gap near |w| ~ 0.3 (2**-10)


class Net(nn.Module):
    """16 -> 64 -> 1 tanh MLP that computes in float32 from weights of any dtype: the only
    rounding that differs between runs is the weight update's."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(16, 64)
        self.l2 = nn.Linear(64, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(F.linear(x, self.l1.weight.float(), self.l1.bias.float()))
        return F.linear(x, self.l2.weight.float(), self.l2.bias.float())


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny ops: one intra-op thread is faster, and immune to a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 16, generator=g)
    teacher = Net()
    with torch.no_grad():
        for p in teacher.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        y = teacher(x) + 0.1 * torch.randn(512, 1, generator=g)
    return x, y


def _model(dtype):
    torch.manual_seed(1)
    model = Net()
    return model if dtype == torch.float32 else mixprec.to_low_precision(model, dtype)


def _make_opt(kind, model):
    if kind in ("fp32", "naive"):
        return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    if kind == "master":
        return mixprec.MasterWeights(torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0))
    return AdamW(model.parameters(), lr=LR, weight_decay=0.0, compensation=kind, generator=torch.Generator().manual_seed(0))


def _train(model, opt, x, y, steps):
    for _ in range(steps):
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        return F.mse_loss(model(x), y).item()


@pytest.fixture(scope="module")
def final_losses():
    x, y = _data()
    out = {}
    with torch.no_grad():
        out["initial"] = F.mse_loss(_model(torch.float32)(x), y).item()
    for kind in ("fp32", "naive", "master", "kahan", "stochastic"):
        model = _model(torch.float32 if kind == "fp32" else torch.bfloat16)
        out[kind] = _train(model, _make_opt(kind, model), x, y, STEPS)
    return out


@pytest.mark.slow
def test_naive_bf16_stalls(final_losses):
    fp32, naive, initial = final_losses["fp32"], final_losses["naive"], final_losses["initial"]
    assert fp32 < 0.5 * initial  # the task trains
    assert naive > 1.5 * fp32  # most updates were rounded away


@pytest.mark.slow
@pytest.mark.parametrize("kind,tol", [("kahan", 0.01), ("stochastic", 0.01), ("master", 0.005)])
def test_compensated_training_matches_fp32(final_losses, kind, tol):
    fp32 = final_losses["fp32"]
    assert abs(final_losses[kind] - fp32) <= tol * fp32, final_losses


def test_resume_from_fp32_checkpoint_keeps_low_bits():
    """Seeding the Kahan buffer from fp32 weights tracks the fp32 run closer than rounding."""
    x, y = _data()
    ref = _model(torch.float32)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.0)
    _train(ref, ref_opt, x, y, 50)
    weights = {k: v.clone() for k, v in ref.state_dict().items()}
    opt_state = ref_opt.state_dict()

    def resumed(seed_low_bits):
        model = mixprec.to_low_precision(Net())
        model.load_state_dict(weights)  # rounds to nearest
        opt = AdamW(model.parameters(), lr=LR, weight_decay=0.0, compensation="kahan")
        opt.load_state_dict(opt_state)
        if seed_low_bits:
            opt.load_fp32_weights(weights, model=model)
        return model, opt

    seeded, seeded_opt = resumed(True)
    rounded, rounded_opt = resumed(False)
    for p, (name, w) in zip(seeded.parameters(), weights.items()):
        comp = seeded_opt.state[p]["kahan_comp"]
        assert torch.allclose(p.float() + comp.float(), w, rtol=2**-14, atol=0)
    for model, opt in ((ref, ref_opt), (seeded, seeded_opt), (rounded, rounded_opt)):
        _train(model, opt, x, y, 20)

    def distance(model, opt):
        total = 0.0
        for p, q in zip(model.parameters(), ref.parameters()):
            value = p.float() + opt.state[p]["kahan_comp"].float()
            total += (value - q).pow(2).sum().item()
        return total**0.5

    assert distance(seeded, seeded_opt) < 0.7 * distance(rounded, rounded_opt)  # measured ~0.5


def test_load_fp32_weights_forms_and_errors():
    model = mixprec.to_low_precision(nn.Sequential(nn.Linear(3, 2), nn.LayerNorm(2)))
    opt = mixprec.optim.SGD(model.parameters(), compensation="kahan")
    weights = [torch.randn(p.shape) for p in model.parameters()]
    opt.load_fp32_weights(weights)
    for p, w in zip(model.parameters(), weights):
        if p.dtype == torch.float32:  # the LayerNorm: copied exactly, no buffer
            assert torch.equal(p, w) and "kahan_comp" not in opt.state[p]
        else:
            assert torch.equal(p, w.to(p.dtype))
            assert torch.equal(opt.state[p]["kahan_comp"], (w - p.float()).to(p.dtype))
    with pytest.raises(TypeError, match="model="):
        opt.load_fp32_weights(nn.Linear(3, 2).state_dict())
    with pytest.raises(ValueError, match="weights for"):
        opt.load_fp32_weights(weights[:1])
    with pytest.raises(ValueError, match="shape"):
        opt.load_fp32_weights([torch.randn(5) for _ in weights])
    with pytest.raises(ValueError, match="no entry"):
        opt.load_fp32_weights({"0.weight": weights[0]}, model=model)


# A second, different task, so the claims are not tuned to one: a 3-class GELU classifier with
# cross-entropy, trained with AdamW and with SGD + momentum.
class Classifier(nn.Module):
    """8 -> 32 -> 32 -> 3 GELU MLP computing in float32 from weights of any dtype."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(8, 32)
        self.l2 = nn.Linear(32, 32)
        self.l3 = nn.Linear(32, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.gelu(F.linear(x, self.l1.weight.float(), self.l1.bias.float()))
        x = F.gelu(F.linear(x, self.l2.weight.float(), self.l2.bias.float()))
        return F.linear(x, self.l3.weight.float(), self.l3.bias.float())


CLASSIFIER_OPTIMIZERS = {  # lr well below a bf16 gap per step for weights of magnitude ~0.2
    "adamw": (lambda ps: torch.optim.AdamW(ps, lr=1e-4, weight_decay=0.0), lambda ps, c, g: AdamW(ps, lr=1e-4, weight_decay=0.0, compensation=c, generator=g)),
    "sgd": (lambda ps: torch.optim.SGD(ps, lr=3e-3, momentum=0.9), lambda ps, c, g: mixprec.optim.SGD(ps, lr=3e-3, momentum=0.9, compensation=c, generator=g)),
}


@pytest.fixture(scope="module", params=sorted(CLASSIFIER_OPTIMIZERS))
def classifier_losses(request):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(384, 8, generator=g)
    y = (x @ torch.randn(8, 3, generator=g) + 0.5 * torch.randn(384, 3, generator=g)).argmax(1)
    plain, ours = CLASSIFIER_OPTIMIZERS[request.param]
    out = {}
    for kind in ("fp32", "naive", "master", "kahan", "stochastic"):
        torch.manual_seed(1)
        model = Classifier()
        if kind == "fp32":
            out["initial"] = F.cross_entropy(model(x), y).item()
        else:
            mixprec.to_low_precision(model)
        if kind in ("fp32", "naive"):
            opt = plain(model.parameters())
        elif kind == "master":
            opt = mixprec.MasterWeights(plain(model.parameters()))
        else:
            opt = ours(model.parameters(), kind, torch.Generator().manual_seed(0))
        for _ in range(400):
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        with torch.no_grad():
            out[kind] = F.cross_entropy(model(x), y).item()
    return out


@pytest.mark.slow
def test_classifier_naive_bf16_stalls(classifier_losses):
    losses = classifier_losses
    assert losses["fp32"] < 0.8 * losses["initial"]
    assert losses["naive"] > 1.2 * losses["fp32"], losses


@pytest.mark.slow
@pytest.mark.parametrize("kind,tol", [("kahan", 0.01), ("stochastic", 0.01), ("master", 0.005)])
def test_classifier_compensated_training_matches_fp32(classifier_losses, kind, tol):
    fp32 = classifier_losses["fp32"]
    assert abs(classifier_losses[kind] - fp32) <= tol * fp32, classifier_losses
