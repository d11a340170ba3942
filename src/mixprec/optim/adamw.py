"""AdamW for parameters of any floating dtype, with Kahan or stochastic-rounding updates."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import Tensor

from mixprec.optim._base import CompensatedOptimizer, _scalar
from mixprec.optim._functional import adamw

__all__ = ["AdamW"]


class AdamW(CompensatedOptimizer):
    """``torch.optim.AdamW`` that trains bfloat16/float16 parameters like float32 ones.

    Same hyper-parameters, defaults and arithmetic as ``torch.optim.AdamW`` (on float32
    parameters the two agree to float32 rounding, and their ``state_dict()`` formats are
    interchangeable). For a low-precision parameter the update is computed in float32 and written
    back by ``compensation``:

    * ``None``: rounded to nearest. Updates below half a gap of the weight (``2**-9`` relative
      for bfloat16) are lost: this is naive pure-bf16 training.
    * ``"kahan"``: the rounding error is kept in a buffer of the parameter's dtype (``state
      ["kahan_comp"]``, +2 bytes per bf16 parameter) and added back at the next step.
    * ``"stochastic"``: rounded stochastically (unbiased), using ``generator``.

    Float32/float64 parameters ignore ``compensation``.

    Args:
        params: parameters or param groups, as for any ``torch.optim`` optimizer.
        lr, betas, eps, weight_decay, amsgrad, maximize: as ``torch.optim.AdamW``.
        compensation: ``None``, ``"kahan"`` or ``"stochastic"`` (per group).
        state_dtype: dtype of ``exp_avg``/``exp_avg_sq``/``max_exp_avg_sq``; ``None`` (default)
            means float32 for low-precision parameters (the parameter's dtype if wider).
            ``torch.bfloat16`` halves optimizer memory at some accuracy cost.
        generator: randomness for ``"stochastic"`` (on the parameters' device); ``None`` uses
            the device's default generator. Its state is saved in ``state_dict()``.

    Raises:
        ValueError: an invalid hyper-parameter or option.

    Works with ``mixprec.GradScaler`` and ``torch.amp.GradScaler`` through their fused protocol,
    float16 parameters included: the scaler checks for overflow, ``step`` skips on it (one host
    sync) or unscales the gradients on the fly. A tensor ``lr`` is read with ``.item()``.

    Example:
        >>> import torch, mixprec
        >>> model = mixprec.to_low_precision(torch.nn.Linear(8, 8))  # bf16 weights
        >>> opt = mixprec.optim.AdamW(model.parameters(), lr=1e-4, compensation="kahan")
    """

    def __init__(
        self,
        params: Any,
        lr: float | Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        compensation: Optional[str] = None,
        state_dtype: Optional[torch.dtype] = None,
        generator: Optional[torch.Generator] = None,
    ) -> None:
        if not 0.0 <= _scalar(lr):
            raise ValueError(f"Invalid learning rate: {lr}")
        if not 0.0 <= eps:
            raise ValueError(f"Invalid epsilon value: {eps}")
        if not 0.0 <= betas[0] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 0: {betas[0]}")
        if not 0.0 <= betas[1] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 1: {betas[1]}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            maximize=maximize,
            compensation=compensation,
            state_dtype=state_dtype,
        )
        super().__init__(params, defaults, generator=generator)

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """Perform one optimization step; ``closure`` re-evaluates the loss (returned)."""
        loss, skip, inv_scale = self._begin_step(closure)
        if skip:  # a loss scaler found inf/NaN gradients
            return loss
        for group in self.param_groups:
            params, grads, exp_avgs, exp_avg_sqs, max_sqs, steps, comps = [], [], [], [], [], [], []
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "step" not in state:
                    sdtype = self._state_dtype(group, p)
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, dtype=sdtype, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=sdtype, memory_format=torch.preserve_format)
                if group["amsgrad"] and "max_exp_avg_sq" not in state:
                    state["max_exp_avg_sq"] = torch.zeros_like(state["exp_avg_sq"], memory_format=torch.preserve_format)
                params.append(p)
                grads.append(p.grad)
                exp_avgs.append(state["exp_avg"])
                exp_avg_sqs.append(state["exp_avg_sq"])
                max_sqs.append(state.get("max_exp_avg_sq"))
                steps.append(state["step"])
                comps.append(self._kahan_comp(group, p))
            if not params:
                continue
            beta1, beta2 = group["betas"]
            adamw(
                params,
                grads,
                exp_avgs,
                exp_avg_sqs,
                max_sqs,
                steps,
                comps,
                lr=_scalar(group["lr"]),
                beta1=_scalar(beta1),
                beta2=_scalar(beta2),
                eps=group["eps"],
                weight_decay=group["weight_decay"],
                amsgrad=group["amsgrad"],
                maximize=group["maximize"],
                compensation=group["compensation"],
                generator=self.generator,
                inv_scale=inv_scale,
            )
        return loss
