# Adapted from PyTorch Lightning's own tests of its MixedPrecision plugin (Lightning 2.6.x):
#   tests/tests_pytorch/plugins/precision/test_amp.py
#   tests/tests_pytorch/plugins/precision/test_amp_integration.py
#   tests/tests_pytorch/plugins/test_amp_plugins.py
#   tests/tests_pytorch/models/test_amp.py
# https://github.com/Lightning-AI/pytorch-lightning, Copyright The Lightning AI team,
# licensed under the Apache License, Version 2.0 (http://www.apache.org/licenses/LICENSE-2.0).
#
# Changes: each test runs twice, against Lightning's MixedPrecision (the oracle: the test must
# hold for Lightning's plugin as installed) and against mixprec's MixprecPrecision; plugins are
# passed to the Trainer (plugins=[...]) where the original used precision="16-mixed"; tests the
# original ran on CUDA only run on CPU where nothing in them needs CUDA; RunIf became skipif.
# Left out: test_amp_ddp (needs the upstream conftest's mocked CUDA devices), the DDP-spawn
# variants of test_amp_cpus (two processes; tests/integrations/test_integrations_lightning.py covers the plugin),
# test_amp_forward_context_restores_grad_mode_context_managers and
# test_amp_forward_context_keeps_cache_enabled (behaviour newer than Lightning 2.6.6, which this
# project pins: its own MixedPrecision fails them), and the torch.autocast-only tests that do
# not involve the plugin.
"""Lightning's MixedPrecision tests, run against Lightning's plugin and MixprecPrecision."""

from __future__ import annotations

import re
import warnings
from collections import Counter
from typing import Any, Callable
from unittest import mock
from unittest.mock import Mock

import pytest
import torch
from torch import nn
from torch.optim import Optimizer

pl = pytest.importorskip("lightning.pytorch")
from lightning.pytorch import Trainer, seed_everything  # noqa: E402
from lightning.pytorch.demos.boring_classes import BoringModel  # noqa: E402
from lightning.pytorch.plugins.precision import MixedPrecision  # noqa: E402
from lightning.pytorch.utilities import GradClipAlgorithmType  # noqa: E402

import mixprec  # noqa: E402
from mixprec.integrations.lightning import MixprecPrecision  # noqa: E402

NEEDS_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CUDA = [pytest.mark.cuda, NEEDS_CUDA]  # the marks of a CUDA-only case: `-m cuda` selects it


def _lightning(precision: Any, device: str, scaler: Any = None) -> MixedPrecision:
    return MixedPrecision(precision, device, scaler)


def _mixprec(precision: Any, device: str, scaler: Any = None) -> MixprecPrecision:
    return MixprecPrecision(precision, scaler=scaler, device=device)


@pytest.fixture(params=[_lightning, _mixprec], ids=["lightning", "mixprec"])
def make(request: pytest.FixtureRequest) -> Callable[..., MixedPrecision]:
    """``make(precision, device, scaler=None)``: the plugin under test."""
    return request.param


@pytest.fixture(autouse=True)
def _quiet() -> Any:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*does not have many workers.*")
        warnings.filterwarnings("ignore", ".*GPU available but not used.*")
        warnings.filterwarnings("ignore", ".*precision.*")
        yield


def _trainer(plugin: MixedPrecision, tmp_path: Any, **kwargs: Any) -> Trainer:
    defaults = dict(default_root_dir=tmp_path, accelerator=plugin.device.split(":")[0], devices=1,
                    logger=False, enable_checkpointing=False, enable_progress_bar=False,
                    enable_model_summary=False)
    return Trainer(plugins=[plugin], **{**defaults, **kwargs})


# ------------------------------------------------------------------ plugins/precision/test_amp.py
def test_clip_gradients(make: Callable[..., MixedPrecision]) -> None:
    """Test that `.clip_gradients()` is a no-op when clipping is disabled."""
    optimizer = Mock(spec=Optimizer)
    precision = make("16-mixed", "cuda:0", scaler=Mock())
    precision.clip_grad_by_value = Mock()
    precision.clip_grad_by_norm = Mock()
    precision.clip_gradients(optimizer)
    precision.clip_grad_by_value.assert_not_called()
    precision.clip_grad_by_norm.assert_not_called()

    precision.clip_gradients(optimizer, clip_val=1.0, gradient_clip_algorithm=GradClipAlgorithmType.VALUE)
    precision.clip_grad_by_value.assert_called_once()
    precision.clip_grad_by_norm.assert_not_called()

    precision.clip_grad_by_value.reset_mock()
    precision.clip_grad_by_norm.reset_mock()

    precision.clip_gradients(optimizer, clip_val=1.0, gradient_clip_algorithm=GradClipAlgorithmType.NORM)
    precision.clip_grad_by_value.assert_not_called()
    precision.clip_grad_by_norm.assert_called_once()


def test_optimizer_amp_scaling_support_in_step_method(make: Callable[..., MixedPrecision]) -> None:
    """Test that the plugin checks if the optimizer takes over unscaling in its step, making it
    incompatible with gradient clipping (example: fused Adam)."""
    optimizer = Mock(_step_supports_amp_scaling=True)
    precision = make("16-mixed", "cuda:0", scaler=Mock())

    with pytest.raises(RuntimeError, match="The current optimizer.*does not allow for gradient clipping"):
        precision.clip_gradients(optimizer, clip_val=1.0)


@pytest.mark.parametrize("grad_mode", [torch.no_grad, torch.inference_mode])
def test_amp_with_no_grad(make: Callable[..., MixedPrecision], grad_mode: Any) -> None:
    """Test that asserts using `no_grad` (or `inference_mode`) context wrapper with a persistent
    AMP context wrapper does not break gradient tracking."""
    layer = nn.Linear(2, 1)
    x = torch.randn(1, 2)
    amp = make("bf16-mixed", "cpu")

    with amp.forward_context():
        with grad_mode():
            _ = layer(x)

        loss = layer(x).mean()
        loss.backward()
        assert loss.grad_fn is not None


@pytest.mark.cuda
@NEEDS_CUDA
def test_amp_with_no_grad_cuda(make: Callable[..., MixedPrecision]) -> None:
    """The same on the CUDA path."""
    layer = nn.Linear(2, 1, device="cuda")
    x = torch.randn(1, 2, device="cuda")
    amp = make("16-mixed", "cuda")

    with amp.forward_context():
        with torch.no_grad():
            _ = layer(x)

        loss = layer(x).mean()
        loss.backward()
        assert loss.grad_fn is not None


def test_amp_autocast_context_manager_disables_cache(make: Callable[..., MixedPrecision]) -> None:
    """Test that the public autocast context manager preserves the existing no-cache workaround."""
    amp = make("bf16-mixed", "cpu")

    with amp.autocast_context_manager():
        assert not torch.is_autocast_cache_enabled()


# ------------------------------------------------------------------ plugins/test_amp_plugins.py
def test_cpu_amp_precision_context_manager(make: Callable[..., MixedPrecision]) -> None:
    """Test to ensure that the context manager correctly is set to CPU + bfloat16."""
    plugin = make("bf16-mixed", "cpu")
    assert plugin.device == "cpu"
    assert plugin.scaler is None
    context_manager = plugin.autocast_context_manager()
    assert isinstance(context_manager, torch.autocast)
    assert context_manager.fast_dtype == torch.bfloat16


def test_amp_precision_plugin_parameter_validation(make: Callable[..., MixedPrecision]) -> None:
    make("16-mixed", "cpu")  # should not raise exception
    make("bf16-mixed", "cpu")
    name = "MixedPrecision" if make is _lightning else "MixprecPrecision"
    for bad in ("16", 16, "bf16"):
        with pytest.raises(ValueError, match=re.escape(
                f"Passed `{name}(precision={bad!r})`. Precision must be '16-mixed' or 'bf16-mixed'")):
            make(bad, "cpu")


class TestClippingOptimizer(torch.optim.SGD):
    __test__ = False  # not a test class (upstream's name)

    def step(self, *args: Any, pl_module: Any = None) -> Any:
        pl_module.calls["optimizer.step"] += 1
        pl_module.check_grads_clipped()
        return super().step(*args)


class TestPrecisionModel(BoringModel):
    __test__ = False

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()  # the hooks that assert, by name: the test checks they ran

    # sister test: tests/trainer/optimization/test_manual_optimization.py::test_multiple_optimizers_step
    def on_after_backward(self) -> None:
        self.calls["on_after_backward"] += 1
        # check grads are scaled
        scale = self.trainer.precision_plugin.scaler.get_scale()
        assert scale != 1.0  # the return value if not enabled
        grads = [p.grad for p in self.parameters()]
        inv_scale = 1 / scale
        self.original_grads = [p * inv_scale for p in grads]

    def check_grads_unscaled(self, optimizer: Any = None) -> None:
        if optimizer is not None:
            scaler = self.trainer.precision_plugin.scaler
            state = scaler._per_optimizer_states[id(optimizer)]
            assert state["stage"].name == "UNSCALED"

        grads = [p.grad for p in self.parameters()]
        assert len(grads) == len(self.original_grads)
        for actual, expected in zip(grads, self.original_grads):
            torch.testing.assert_close(actual, expected, equal_nan=True)

    def check_grads_clipped(self) -> None:
        parameters = list(self.parameters())
        assert len(parameters) == len(self.clipped_parameters)
        for actual, expected in zip(parameters, self.clipped_parameters):
            torch.testing.assert_close(actual.grad, expected.grad, equal_nan=True)

    def on_before_optimizer_step(self, optimizer: Any, *_: Any) -> None:
        self.calls["on_before_optimizer_step"] += 1
        self.check_grads_unscaled(optimizer)
        # manually clip
        self.clipped_parameters = []
        for p in self.parameters():
            copy = p.detach().clone()
            copy.grad = p.grad.clone()
            self.clipped_parameters.append(copy)
        clip_val = self.trainer.gradient_clip_val
        torch.nn.utils.clip_grad_value_(self.clipped_parameters, clip_val)

    def configure_gradient_clipping(self, *args: Any, **kwargs: Any) -> None:
        # let lightning clip
        super().configure_gradient_clipping(*args, **kwargs)
        # check clipping worked as expected
        self.calls["configure_gradient_clipping"] += 1
        self.check_grads_clipped()

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, closure: Any, **_: Any) -> None:
        # pass self as a kwarg
        optimizer.step(closure, pl_module=self)

    def configure_optimizers(self) -> Any:
        return TestClippingOptimizer(self.layer.parameters(), lr=0.1)


@pytest.mark.parametrize("accum", [1, 2])
def test_amp_gradient_unscale(make: Callable[..., MixedPrecision], tmp_path: Any, accum: int) -> None:
    """(Upstream: 2 GPUs with DDP spawn; here one CPU device, fp16 with loss scaling.) Seeded:
    the optimizer's own check runs only on steps the scaler does not skip, and unseeded both of
    the 2 steps with accum=2 were skipped now and then."""
    seed_everything(1234)
    model = TestPrecisionModel()
    trainer = _trainer(
        make("16-mixed", "cpu"), tmp_path,
        max_epochs=2,
        limit_train_batches=2,
        limit_val_batches=0,
        # use a tiny value to make sure it works
        gradient_clip_val=1e-3,
        gradient_clip_algorithm="value",
        log_every_n_steps=1,
        accumulate_grad_batches=accum,
    )
    trainer.fit(model)
    hooks = ("on_after_backward", "on_before_optimizer_step", "configure_gradient_clipping", "optimizer.step")
    assert all(model.calls[hook] > 0 for hook in hooks), model.calls  # the asserts inside them ran


def test_amp_skip_optimizer(make: Callable[..., MixedPrecision], tmp_path: Any) -> None:
    """Test that optimizers can be skipped when using amp. (Upstream: on CUDA.)"""

    class CustomBoringModel(BoringModel):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False
            self.layer1 = torch.nn.Linear(32, 32)
            self.layer2 = torch.nn.Linear(32, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.layer1(x)
            x = self.layer2(x)
            return x

        def training_step(self, batch: Any, batch_idx: int) -> None:
            _, opt2 = self.optimizers()
            output = self(batch)
            loss = self.loss(output)
            opt2.zero_grad()
            self.manual_backward(loss)
            # only optimizer 2 steps
            opt2.step()

        def configure_optimizers(self) -> Any:
            return [
                torch.optim.SGD(self.layer1.parameters(), lr=0.1),
                torch.optim.SGD(self.layer2.parameters(), lr=0.1),
            ]

    trainer = _trainer(make("16-mixed", "cpu"), tmp_path, fast_dev_run=1)
    model = CustomBoringModel()
    trainer.fit(model)


# ------------------------------------------------------------------ plugins/precision/test_amp_integration.py
class FusedOptimizerParityModel(BoringModel):
    def __init__(self, fused: bool = False) -> None:
        super().__init__()
        self.fused = fused

    def configure_optimizers(self) -> Any:
        assert isinstance(self.trainer.precision_plugin.scaler, torch.amp.GradScaler)
        return torch.optim.Adam(self.parameters(), lr=1.0, fused=self.fused)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_amp_fused_optimizer_parity(make: Callable[..., MixedPrecision], tmp_path: Any, device: str) -> None:
    """(Upstream: on CUDA; torch has a fused Adam on CPU too.)"""
    def run(fused: bool = False) -> Any:
        seed_everything(1234)
        model = FusedOptimizerParityModel(fused)
        trainer = _trainer(make("16-mixed", device), tmp_path, max_steps=5)
        trainer.fit(model)
        return model.parameters()

    params = run(fused=False)
    params_fused = run(fused=True)

    # Both the regular and the fused version of Adam produce the same losses and model weights
    for p, q in zip(params, params_fused):
        torch.testing.assert_close(p, q)


def test_skip_training_step_with_grad_scaler(make: Callable[..., MixedPrecision]) -> None:
    """Test that the grad scaler gets skipped when skipping a training step. (Upstream: CUDA.)"""

    class TestModel(BoringModel):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            if batch_idx % 2:
                return None  # skipping the backward should skip the grad scaler too
            return super().training_step(batch, batch_idx)

    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        plugins=[make("16-mixed", "cpu")],
        barebones=True,
        max_steps=5,
        gradient_clip_val=0.5,
    )
    assert isinstance(trainer.precision_plugin, MixedPrecision)
    assert trainer.precision_plugin.scaler is not None
    trainer.precision_plugin.scaler = Mock(wraps=trainer.precision_plugin.scaler)
    model = TestModel()
    trainer.fit(model)
    assert trainer.precision_plugin.scaler.unscale_.call_count == 3
    assert trainer.precision_plugin.scaler.step.call_count == 3
    assert trainer.precision_plugin.scaler.update.call_count == 3


# ------------------------------------------------------------------ models/test_amp.py
class AMPTestModel(BoringModel):
    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()  # the hooks that assert, by name: the test checks they ran

    def step(self, batch: Any) -> Any:
        self.calls[f"step ({self.trainer.state.stage.value})"] += 1
        self._assert_autocast_enabled()
        output = self(batch)
        is_bfloat16 = self.trainer.precision_plugin.precision == "bf16-mixed"
        assert output.dtype == (torch.float16 if not is_bfloat16 else torch.bfloat16)
        return self.loss(output)

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
        self.calls["predict_step"] += 1
        self._assert_autocast_enabled()
        output = self(batch)
        is_bfloat16 = self.trainer.precision_plugin.precision == "bf16-mixed"
        assert output.dtype == (torch.float16 if not is_bfloat16 else torch.bfloat16)
        return output

    def _assert_autocast_enabled(self) -> None:
        if self.trainer.precision_plugin.device == "cpu":
            assert torch.is_autocast_enabled("cpu")
        else:
            assert torch.is_autocast_enabled()


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
def test_amp_cpus(make: Callable[..., MixedPrecision], tmp_path: Any, precision: str) -> None:
    """Make sure combinations of AMP and strategies work if supported (single device here)."""
    trainer = _trainer(
        make(precision, "cpu"), tmp_path,
        strategy="single_device",
        max_epochs=1,
        limit_train_batches=1,
        limit_val_batches=1,
        limit_test_batches=1,
        limit_predict_batches=1,
    )
    model = AMPTestModel()
    trainer.fit(model)
    trainer.test(model)
    trainer.predict(model)
    ran = ("step (train)", "step (sanity_check)", "step (validate)", "step (test)", "predict_step")
    assert all(model.calls[hook] > 0 for hook in ran), model.calls  # the asserts inside them ran


@pytest.mark.parametrize("clip_val", [0, 10])
@mock.patch("torch.nn.utils.clip_grad_norm_")
def test_precision_16_clip_gradients(mock_clip_grad_norm: Any, clip_val: int, tmp_path: Any,
                                     make: Callable[..., MixedPrecision]) -> None:
    """Ensure that clip gradients is only called if the value is greater than 0."""
    model = BoringModel()
    trainer = _trainer(
        make("16-mixed", "cpu"), tmp_path,
        max_epochs=1,
        limit_train_batches=4,
        limit_val_batches=0,
        gradient_clip_val=clip_val,
    )
    trainer.fit(model)

    if clip_val > 0:
        mock_clip_grad_norm.assert_called()
    else:
        mock_clip_grad_norm.assert_not_called()


def test_the_plugin_under_test_is_mixprecs() -> None:
    plugin = _mixprec("16-mixed", "cuda:0", scaler=mixprec.GradScaler("cpu"))
    assert plugin.device == "cuda:0" and plugin.device_type == "cuda"
    assert isinstance(plugin.autocast_context_manager(), mixprec.autocast)
