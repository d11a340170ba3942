"""SGD for parameters of any floating dtype, with compensated or stochastic-rounding updates."""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from mixprec.optim._base import CompensatedOptimizer, _scalar
from mixprec.optim._foreach import sgd_foreach
from mixprec.optim._fused import sgd_native
from mixprec.optim._functional import NARROW, compute_dtype, sgd

__all__ = ["SGD"]


class SGD(CompensatedOptimizer):
    """``torch.optim.SGD`` that trains bfloat16/float16 parameters like float32 ones.

    Same hyper-parameters, defaults and arithmetic as ``torch.optim.SGD`` (on float32 parameters
    the two agree bitwise, and each loads the other's ``state_dict()``; :meth:`torch_state_dict`
    drops mixprec's buffers). ``compensation`` (default ``"auto"``: exact for bfloat16, Kahan
    for float16 parameters; ``None`` rounds to nearest), ``foreach``, ``fused`` (torch's fused SGD arithmetic; mixprec's C++ kernel
    for low-precision CPU parameters, by default too), ``generator``, loss scalers and
    ``torch.compile`` work as in :class:`mixprec.optim.AdamW`. ``state_dtype`` is the dtype of ``momentum_buffer``
    (float16 allowed: the momentum has the gradients' range; float8 and ``"8bit"`` are not).

    Raises:
        ValueError: an invalid hyper-parameter or option (as torch: Nesterov needs
            ``momentum > 0`` and ``dampening == 0``), in the constructor, ``add_param_group``
            and ``load_state_dict`` alike.

    Example:
        >>> import torch, mixprec
        >>> model = mixprec.to_low_precision(torch.nn.Linear(8, 8))
        >>> opt = mixprec.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9, compensation="stochastic",
        ...                         generator=torch.Generator().manual_seed(0))
    """

    def __init__(
        self,
        params: Any,
        lr: float | Tensor = 1e-3,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        *,
        maximize: bool = False,
        foreach: Optional[bool] = None,
        fused: Optional[bool] = None,
        compensation: Optional[str] = "auto",
        state_dtype: Optional[torch.dtype] = None,
        generator: Optional[torch.Generator] = None,
    ) -> None:
        defaults = dict(
            lr=lr,
            momentum=momentum,
            dampening=dampening,
            weight_decay=weight_decay,
            nesterov=nesterov,
            maximize=maximize,
            foreach=foreach,
            fused=fused,
            compensation=compensation,
            state_dtype=state_dtype,
        )
        super().__init__(params, defaults, generator=generator)

    @staticmethod
    def _check_hyperparameters(group: dict[str, Any]) -> None:
        lr, momentum, dampening = group["lr"], group["momentum"], group["dampening"]
        if not 0.0 <= _scalar(lr):
            raise ValueError(f"Invalid learning rate: {lr}")
        if momentum < 0.0:
            raise ValueError(f"Invalid momentum value: {momentum}")
        if group["weight_decay"] < 0.0:
            raise ValueError(f"Invalid weight_decay value: {group['weight_decay']}")
        if group["nesterov"] and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")

    def _required_state(self, group: dict[str, Any], p: Tensor) -> list[str]:
        return ["momentum_buffer"] if group["momentum"] != 0 else []

    def _start_state(self, group: dict[str, Any], p: Tensor) -> None:
        if group["momentum"] != 0:  # None: started from the first gradient, as torch.optim.SGD's
            self.state[p].setdefault("momentum_buffer", None)

    def _store_loaded_state(self, group: dict[str, Any], p: Tensor) -> None:
        """Store a loaded momentum as ``group["state_dtype"]`` says (float32 by default)."""
        buf = self.state[p].get("momentum_buffer")
        if buf is not None:
            dtype = group["state_dtype"] or compute_dtype(p.dtype)
            self.state[p]["momentum_buffer"] = buf.to(dtype)

    @staticmethod
    def _native_first(group: dict[str, Any], params: list[Tensor], grads: list[Tensor],
                      buffers: list[Optional[Tensor]], comps: list[Optional[Tensor]], hyper: dict[str, Any]) -> list[int]:
        """Step the parameters the C++ kernel takes (creating their float32 momentum buffers,
        as the other paths would); return the indices left to the other paths."""
        fresh = [False] * len(params)
        if group["momentum"] != 0 and group["state_dtype"] in (None, torch.float32):
            for i, p in enumerate(params):
                if buffers[i] is None and p.dtype in NARROW:
                    buffers[i] = torch.empty_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
                    fresh[i] = True
        todo = sgd_native(params, grads, buffers, fresh, comps, **hyper)
        for i in todo:
            if fresh[i]:  # the other paths create it themselves, and start it from the gradient
                buffers[i] = None
        return todo

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """Perform one optimization step; ``closure`` re-evaluates the loss (returned)."""
        loss, skip, inv_scale = self._begin_step(closure)
        if skip:  # a loss scaler found inf/NaN gradients
            return loss
        for group in self.param_groups:
            rule = self.resolved_compensation(group)  # "auto" for the dtypes the parameters have now
            self._drop_stale_buffers(group, rule)  # another rule's buffer (the model's dtype changed)
            params, grads, buffers, comps = [], [], [], []
            for p in group["params"]:
                if p.grad is None:
                    continue
                params.append(p)
                grads.append(p.grad)
                buffers.append(self.state[p].get("momentum_buffer"))
                comps.append(self._compensation_buffer(rule, p))
            if not params:
                continue
            hyper = dict(lr=_scalar(group["lr"]), momentum=group["momentum"], dampening=group["dampening"],
                         weight_decay=group["weight_decay"], nesterov=group["nesterov"], maximize=group["maximize"],
                         compensation=rule, generator=self.generator, inv_scale=inv_scale)
            todo = list(range(len(params)))
            if group["fused"] is None and group["foreach"] is None:  # the C++ kernel where it applies
                todo = self._native_first(group, params, grads, buffers, comps, hyper)
            if todo:
                if group["fused"]:
                    update: Callable[..., None] = partial(sgd_foreach, fused=True)
                else:
                    update = sgd_foreach if self._uses_foreach(group) else sgd
                rest_buffers = [buffers[i] for i in todo]
                update([params[i] for i in todo], [grads[i] for i in todo], rest_buffers,
                       [comps[i] for i in todo], state_dtype=group["state_dtype"], **hyper)
                for i, buf in zip(todo, rest_buffers):  # the momentum buffers it created
                    buffers[i] = buf
            if group["momentum"] != 0:
                for p, buf in zip(params, buffers):
                    self.state[p]["momentum_buffer"] = buf
        return loss
