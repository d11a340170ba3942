"""A PyTorch Lightning precision plugin that autocasts with mixprec and scales with its scaler.

:class:`MixprecPrecision` is Lightning's own ``MixedPrecision`` plugin with two parts swapped:
the forward runs under :func:`mixprec.autocast` with your :class:`mixprec.Policy`, and the loss
is scaled by a :class:`mixprec.GradScaler` (or the scaler you pass). Everything else (unscaling
before gradient clipping, skipped steps, the scaler state in checkpoints, LBFGS refused) is
Lightning's code. With the default policy and scaler the losses, scales and weights are bitwise
those of ``Trainer(plugins=[MixedPrecision(precision, device)])``.

On CPU, ``Trainer(precision="16-mixed")`` silently falls back to bf16 (Lightning has no fp16
autocast on CPU); ``MixprecPrecision("16-mixed", device="cpu")`` trains in fp16 as asked, with
loss scaling, like Lightning's ``MixedPrecision("16-mixed", "cpu")`` plugin built by hand.

Example:
    >>> import lightning.pytorch as pl
    >>> from torch import nn
    >>> policy = mixprec.Policy().keep(types=(nn.LayerNorm,))      # LayerNorms stay in fp32
    >>> trainer = pl.Trainer(accelerator="cpu", max_steps=10,
    ...                      plugins=[MixprecPrecision("16-mixed", policy=policy, device="cpu")])
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from typing import Any, Literal

import torch

import mixprec
from mixprec.integrations._common import PRECISIONS, default_device, device_type, resolve_policy
from mixprec.policy import Policy

try:
    from lightning.pytorch.plugins.precision import MixedPrecision
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "mixprec.integrations.lightning needs PyTorch Lightning: pip install lightning"
    ) from e

__all__ = ["MixprecPrecision"]

#: where Lightning's own MixedPrecision plugin keeps its scaler's state in a checkpoint
_LIGHTNINGS = MixedPrecision.__qualname__
#: what torch.amp.GradScaler.load_state_dict reads
_TORCH_SCALER_KEYS = frozenset({"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"})


class MixprecPrecision(MixedPrecision):
    """Lightning's mixed precision, with :func:`mixprec.autocast` and a mixprec loss scaler.

    Args:
        precision: ``"16-mixed"`` (float16 compute, loss scaling) or ``"bf16-mixed"`` (bfloat16,
            no scaler).
        policy: the :class:`mixprec.Policy` (or its string form) of the forward; None: PyTorch's
            op lists. Its ``compute`` dtype, if set, must match ``precision``.
        scaler: the loss scaler for ``"16-mixed"``; None: ``mixprec.GradScaler(device)`` with
            torch's defaults. Anything with ``scale``/``unscale_``/``step``/``update``/
            ``state_dict``/``load_state_dict`` works (a ``torch.amp.GradScaler`` too).
        device: the device to autocast, as Lightning takes it: ``"cpu"``, ``"cuda"`` or
            ``"cuda:<index>"`` (kept as given in ``self.device``; autocast and the default scaler
            use its type); None: ``"cuda"`` when CUDA is available, else ``"cpu"``. It must be
            the Trainer's accelerator.

    The scaler's state is saved in checkpoints under ``"MixprecPrecision"`` and restored on
    resume (``Trainer.fit(ckpt_path=...)``). Lightning finds a plugin's state by the plugin's class
    name, so checkpoints also switch between this plugin and Lightning's ``MixedPrecision``: a
    checkpoint without ``"MixprecPrecision"`` resumes from the ``"MixedPrecision"`` entry (a
    ``torch.amp.GradScaler`` state), and the state (in torch's layout, plus mixprec's own
    settings, which torch ignores) is saved under ``"MixedPrecision"`` too.

    Raises:
        ValueError: an unknown precision or device, or a policy whose compute dtype contradicts
            ``precision``; during training, a loss on another device type than ``device``.
        lightning's MisconfigurationException: a scaler with ``"bf16-mixed"``.
    """

    def __init__(
        self,
        precision: Literal["16-mixed", "bf16-mixed"] = "16-mixed",
        policy: Policy | str | None = None,
        scaler: Any = None,
        *,
        device: str | None = None,
    ) -> None:
        if precision not in ("16-mixed", "bf16-mixed"):  # Lightning's message
            raise ValueError(f"Passed `{type(self).__name__}(precision={precision!r})`. Precision must be "
                             "'16-mixed' or 'bf16-mixed'.")
        device = default_device() if device is None else device
        self.device_type = device_type(device, "MixprecPrecision")
        self.policy = resolve_policy(policy, PRECISIONS[precision], "MixprecPrecision")
        if scaler is None and precision == "16-mixed":
            scaler = mixprec.GradScaler(self.device_type)
        super().__init__(precision, device, scaler)

    def autocast_context_manager(self) -> mixprec.autocast:  # type: ignore[override]
        """``mixprec.autocast`` (a ``torch.autocast``) over the device type with the precision's
        dtype and the policy (weight-cast cache off, as Lightning's)."""
        return mixprec.autocast(self.device_type, dtype=PRECISIONS[self.precision], cache_enabled=False,
                                policy=self.policy)

    @contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        """The forward of training, validation, test and predict steps, under the policy."""
        with self.autocast_context_manager():
            yield

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Resume from the ``"MixedPrecision"`` entry of a checkpoint saved with Lightning's own
        plugin (Lightning loads only the entry named after the plugin's class, afterwards)."""
        super().on_load_checkpoint(checkpoint)
        if type(self).__qualname__ not in checkpoint and _LIGHTNINGS in checkpoint:
            self.load_state_dict(checkpoint[_LIGHTNINGS])

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Also save the scaler's state under ``"MixedPrecision"`` (when it is in torch's layout
        and that entry is free), so that Lightning's own plugin resumes the loss scale."""
        super().on_save_checkpoint(checkpoint)
        state = checkpoint.get(type(self).__qualname__)
        if isinstance(state, dict) and _TORCH_SCALER_KEYS <= state.keys():
            checkpoint.setdefault(_LIGHTNINGS, state)

    def pre_backward(self, tensor: torch.Tensor, module: Any) -> torch.Tensor:  # type: ignore[override]
        if isinstance(tensor, torch.Tensor) and tensor.device.type != self.device_type:
            raise ValueError(
                f"MixprecPrecision autocasts {self.device_type!r} but the loss is on {tensor.device.type!r}: "
                f"pass MixprecPrecision(..., device={tensor.device.type!r})"
            )
        return super().pre_backward(tensor, module)
