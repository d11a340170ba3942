"""MixprecPrecision against Lightning's own MixedPrecision plugin, with the real Trainer on CPU."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import mixprec

pl = pytest.importorskip("lightning.pytorch")
from lightning.pytorch.plugins.precision import MixedPrecision  # noqa: E402
from lightning.pytorch.utilities.exceptions import MisconfigurationException  # noqa: E402

from mixprec.integrations.lightning import MixprecPrecision  # noqa: E402

# a scale that overflows fp16 in the first step and grows every 2 clean steps: the trajectory has
# skipped steps, backoffs and growth within a few steps
SCALER = {"init_scale": 2.0**18, "growth_interval": 2}


class TinyModule(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4))
        self.out_dtypes: dict[str, torch.dtype] = {}
        for name, module in self.net.named_children():
            module.register_forward_hook(self._record(f"net.{name}"))

    def _record(self, name: str) -> Any:
        def hook(module: nn.Module, args: Any, output: torch.Tensor) -> None:
            self.out_dtypes[name] = output.dtype

        return hook

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)  # module names are relative to self

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        g = torch.Generator().manual_seed(1)
        data = torch.utils.data.TensorDataset(torch.randn(32, 8, generator=g), torch.randint(0, 4, (32,), generator=g))
        return torch.utils.data.DataLoader(data, batch_size=8)


class Record(pl.Callback):
    """Losses and scales after each step, read from the Trainer's own precision plugin."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.scales: list[float] = []

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses.append(outputs["loss"].item())
        scaler = trainer.precision_plugin.scaler
        self.scales.append(scaler.get_scale() if scaler is not None else 1.0)


def fit(plugin: Any = None, steps: int = 6, ckpt: Path | None = None, save: Path | None = None,
        **trainer_kwargs: Any) -> tuple[TinyModule, Record]:
    module, record = TinyModule(), Record()
    kwargs = {"plugins": [plugin]} if plugin is not None else {}
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[record], **kwargs, **trainer_kwargs,
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*does not have many workers.*")
        warnings.filterwarnings("ignore", ".*precision.*")
        trainer.fit(module, ckpt_path=ckpt)
    if save is not None:
        trainer.save_checkpoint(save)
    return module, record


def assert_same_training(a: tuple[TinyModule, Record], b: tuple[TinyModule, Record]) -> None:
    (ma, ra), (mb, rb) = a, b
    assert ra.losses == rb.losses
    assert ra.scales == rb.scales
    for (name, pa), pb in zip(ma.named_parameters(), mb.parameters()):
        assert torch.equal(pa, pb), name


def test_fp16_is_bitwise_lightnings_mixed_precision() -> None:
    ours = fit(MixprecPrecision("16-mixed", scaler=mixprec.GradScaler("cpu", **SCALER), device="cpu"))
    ref = fit(MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", **SCALER)))
    assert_same_training(ours, ref)
    scales = ours[1].scales
    assert any(b < a for a, b in zip(scales, scales[1:])) and any(b > a for a, b in zip(scales, scales[1:]))
    assert ours[0].out_dtypes["net.0"] == torch.float16


def test_default_fp16_scaler_is_mixprecs_and_bitwise_torchs() -> None:
    plugin = MixprecPrecision("16-mixed", device="cpu")
    assert isinstance(plugin.scaler, mixprec.GradScaler) and isinstance(plugin, MixedPrecision)
    ours = fit(plugin, steps=3)
    ref = fit(MixedPrecision("16-mixed", "cpu"), steps=3)
    assert_same_training(ours, ref)


def test_bf16_is_bitwise_trainer_precision_bf16_mixed() -> None:
    ours = fit(MixprecPrecision("bf16-mixed", device="cpu"), steps=3)
    ref = fit(None, steps=3, precision="bf16-mixed")
    assert_same_training(ours, ref)
    assert ours[0].out_dtypes["net.2"] == torch.bfloat16


def test_module_rules_keep_a_module_in_fp32() -> None:
    policy = mixprec.Policy().keep(names=r"^net\.2$")
    module, record = fit(MixprecPrecision("16-mixed", policy=policy, device="cpu"), steps=2)
    assert module.out_dtypes == {"net.0": torch.float16, "net.1": torch.float16, "net.2": torch.float32}
    assert all(torch.isfinite(torch.tensor(record.losses)))


def test_op_edits_are_honoured() -> None:
    policy = mixprec.Policy().with_ops(fp32=["linear"])
    module, _ = fit(MixprecPrecision("bf16-mixed", policy=policy, device="cpu"), steps=1)
    assert module.out_dtypes["net.0"] == torch.float32 and module.out_dtypes["net.2"] == torch.float32


def test_checkpoint_resume_restores_the_scaler_as_lightning_does(tmp_path: Path) -> None:
    def resume(plugin: Any) -> tuple[Record, tuple[TinyModule, Record], dict]:
        key = type(plugin()).__qualname__  # where Lightning saves the plugin's state
        ckpt = tmp_path / f"{key}.ckpt"
        _, first = fit(plugin(), steps=5, save=ckpt)
        saved = torch.load(ckpt, weights_only=False)[key]
        return first, fit(plugin(), steps=8, ckpt=ckpt), saved

    first, (module, resumed), saved = resume(
        lambda: MixprecPrecision("16-mixed", scaler=mixprec.GradScaler("cpu", **SCALER), device="cpu"))
    ref_first, (ref_module, ref_resumed), ref_saved = resume(
        lambda: MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", **SCALER)))
    assert saved["scale"] == first.scales[-1] == ref_saved["scale"] != SCALER["init_scale"]
    assert (first.losses, first.scales) == (ref_first.losses, ref_first.scales)
    assert resumed.losses == ref_resumed.losses and resumed.scales == ref_resumed.scales
    assert resumed.scales[0] in (saved["scale"], saved["scale"] / 2, saved["scale"] * 2)  # continues from it
    for pa, pb in zip(module.parameters(), ref_module.parameters()):
        assert torch.equal(pa, pb)


# the two plugins whose checkpoints must resume each other; the scale backs off from init_scale over the
# first steps (overflows, skipped) and then stays: restarting from init_scale would skip steps again
SWITCH_SCALER = {"init_scale": 2.0**24, "growth_interval": 100}
PLUGINS = {
    "MixprecPrecision": lambda: MixprecPrecision("16-mixed", scaler=mixprec.GradScaler("cpu", **SWITCH_SCALER),
                                                 device="cpu"),
    "MixedPrecision": lambda: MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", **SWITCH_SCALER)),
}


@pytest.mark.parametrize(("saved_by", "resumed_by"), [("MixedPrecision", "MixprecPrecision"),
                                                       ("MixprecPrecision", "MixedPrecision")])
def test_a_checkpoint_resumes_the_loss_scale_across_the_two_plugins(tmp_path: Path, saved_by: str,
                                                                     resumed_by: str) -> None:
    """Lightning looks a plugin's state up by the plugin's class name: until 2026-12-07 switching
    between Lightning's MixedPrecision and MixprecPrecision silently restarted from init_scale.
    The switched resume is bitwise the resume with the plugin that saved."""
    ckpt = tmp_path / "switch.ckpt"
    _, first = fit(PLUGINS[saved_by](), steps=5, save=ckpt)
    assert torch.load(ckpt, weights_only=False)[saved_by]["scale"] == first.scales[-1] != SWITCH_SCALER["init_scale"]
    switched, same = fit(PLUGINS[resumed_by](), steps=8, ckpt=ckpt), fit(PLUGINS[saved_by](), steps=8, ckpt=ckpt)
    assert_same_training(switched, same)
    assert switched[1].scales[0] <= first.scales[-1] < SWITCH_SCALER["init_scale"]  # from it, not restarted


def test_bad_arguments_say_what_to_do() -> None:
    with pytest.raises(ValueError, match="'16-mixed' or 'bf16-mixed'"):
        MixprecPrecision("16-true", device="cpu")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="'cpu' or 'cuda'"):
        MixprecPrecision("16-mixed", device="mps")
    with pytest.raises(ValueError, match="not a device"):
        MixprecPrecision("16-mixed", device="gpu0")
    with pytest.raises(ValueError, match="drop compute= from the policy"):
        MixprecPrecision("16-mixed", policy="compute=bf16", device="cpu")
    with pytest.raises(MisconfigurationException, match="does not use a scaler"):
        MixprecPrecision("bf16-mixed", scaler=mixprec.GradScaler("cpu"), device="cpu")
    with pytest.raises(ValueError, match=r"pass MixprecPrecision\(\.\.\., device='cpu'\)"):
        MixprecPrecision("16-mixed", device="cuda").pre_backward(torch.ones(()), None)
    with pytest.raises(ValueError, match=r"pass MixprecPrecision\(\.\.\., device='cpu'\)"):
        MixprecPrecision("16-mixed", device="cuda:1").pre_backward(torch.ones(()), None)


def test_an_indexed_cuda_device_is_taken_as_lightning_takes_it() -> None:
    plugin = MixprecPrecision("16-mixed", device="cuda:0")
    assert plugin.device == "cuda:0" and plugin.device_type == "cuda"
    assert isinstance(plugin.scaler, mixprec.GradScaler)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # CUDA is not available: the region is disabled
        ctx = plugin.autocast_context_manager()
    assert isinstance(ctx, torch.autocast) and ctx.device == "cuda" and ctx.fast_dtype == torch.float16


class Fp4Module(TinyModule):
    """Three Linears wide enough for NVFP4's 16-element blocks, and a validation loop."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 16))
        self.validated: list[bool] = []  # per validation step: whether it ran under inference mode

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        self.validated.append(torch.is_inference_mode_enabled())
        return nn.functional.cross_entropy(self(x), y)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return self._loader(1)

    def val_dataloader(self) -> torch.utils.data.DataLoader:
        return self._loader(2)

    def _loader(self, seed: int) -> torch.utils.data.DataLoader:
        g = torch.Generator().manual_seed(seed)
        data = torch.utils.data.TensorDataset(torch.randn(48, 32, generator=g), torch.randint(0, 16, (48,), generator=g))
        return torch.utils.data.DataLoader(data, batch_size=8)


def test_validation_between_nvfp4_steps_leaves_the_training_bitwise() -> None:
    """``trainer.validate()`` runs under ``torch.inference_mode()``, the validation inside ``fit``
    (every 2 steps here) under ``torch.no_grad()``: an NVFP4 layer's forward there draws nothing
    of its stochastic rounding, so the training is bitwise the run never validated. (Before, the
    first training step after ``validate()`` raised, an inference-mode rounding count saved for
    backward, and each validation shifted the training's draws.)"""
    policy = mixprec.Policy.parse("compute=bf16").fp8("nvfp4", first_last="fp8", backend="emulate_fp32")
    runs = []
    for validated in (False, True):
        module, record = Fp4Module(), Record()
        trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=6, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, callbacks=[record],
                             plugins=[MixprecPrecision("bf16-mixed", policy=policy, device="cpu")],
                             limit_val_batches=2 if validated else 0, val_check_interval=2, num_sanity_val_steps=0)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", ".*does not have many workers.*")
            if validated:
                trainer.validate(module, verbose=False)
            trainer.fit(module)
        # (validate(): 2 batches in inference mode; fit: 3 validations of 2 batches under no_grad)
        assert module.validated == ([True] * 2 + [False] * 6 if validated else [])
        runs.append((module, record))
    assert mixprec.fp8.rounding_steps(runs[0][0]) == mixprec.fp8.rounding_steps(runs[1][0]) == {
        "net.0": 6, "net.2": 6, "net.4": 6}
    assert_same_training(runs[0], runs[1])


class MasterModule(TinyModule):
    """A bf16 model (``mixprec.to_low_precision``) trained by ``mixprec.MasterWeights``."""

    def __init__(self) -> None:
        super().__init__()
        self.net = mixprec.to_low_precision(self.net)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self(x.bfloat16()).float(), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return mixprec.MasterWeights(torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.9))


# Lightning precision, gradient_clip_algorithm and accumulate_grad_batches of a clipped run
MASTER_CLIPS = {
    "32-true, norm": ("32-true", "norm", 1),
    "32-true, value, accumulated": ("32-true", "value", 2),
    "bf16-true, norm": ("bf16-true", "norm", 1),
}
CLIP_VAL = {"norm": 1e-3, "value": 1e-4}


@pytest.mark.parametrize("case", MASTER_CLIPS)
def test_gradient_clip_val_clips_master_weights_grads_as_the_hand_written_loop(case: str) -> None:
    """Lightning clips ``param_groups``' parameters (the fp32 masters) inside the closure it hands
    to ``MasterWeights.step``; until 2026-12-07 the masters had no gradient there and
    ``gradient_clip_val`` silently did nothing. Reference: ``prepare_grads()`` then clipping
    ``opt.masters`` by hand, bitwise (with and without clipping)."""
    precision, algorithm, accumulate = MASTER_CLIPS[case]
    for clip in (None, CLIP_VAL[algorithm]):
        module = MasterModule()
        trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, precision=precision,
                             gradient_clip_val=clip, gradient_clip_algorithm=algorithm,
                             accumulate_grad_batches=accumulate)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", ".*does not have many workers.*")
            trainer.fit(module)
        hand = MasterModule()
        if precision == "bf16-true":  # Lightning casts the whole module (LayerNorm too) before configure_optimizers
            hand.to(torch.bfloat16)
        opt = hand.configure_optimizers()
        for i, batch in enumerate(hand.train_dataloader()):
            loss = hand.training_step(batch, i)
            (loss / accumulate if accumulate > 1 else loss).backward()
            if (i + 1) % accumulate:
                continue
            if clip is not None:
                opt.prepare_grads()
                clip_ = torch.nn.utils.clip_grad_norm_ if algorithm == "norm" else torch.nn.utils.clip_grad_value_
                clip_(opt.masters, clip)
            opt.step()
            opt.zero_grad()
            if (i + 1) // accumulate == 2:
                break
        for (name, pa), pb in zip(module.named_parameters(), hand.parameters()):
            assert torch.equal(pa, pb), (clip, name)
