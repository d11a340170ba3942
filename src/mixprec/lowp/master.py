"""fp32 master weights for any ``torch.optim`` optimizer over bfloat16/float16 parameters."""

from __future__ import annotations

import contextlib
import functools
from collections import OrderedDict
from typing import Any, Callable, Iterator, Optional

import torch
from torch import Tensor

from mixprec._unscale import unscale_
from mixprec.lowp.cast import LOW_PRECISION_DTYPES
from mixprec.optim.rounding import round_into_
from mixprec.scaling.protocol import HoldsMasters, PreparesGrads, ScalesItself, lend_scale, lent_scale

__all__ = ["MasterWeights"]

_ROUNDINGS = ("nearest", "stochastic")
_HOOK_DICTS = (
    "_optimizer_step_pre_hooks",
    "_optimizer_step_post_hooks",
    "_optimizer_state_dict_pre_hooks",
    "_optimizer_state_dict_post_hooks",
    "_optimizer_load_state_dict_pre_hooks",
    "_optimizer_load_state_dict_post_hooks",
)


def _write_back_loaded(param: Tensor, master: Tensor, rounding: str) -> None:
    """Set ``param`` from a loaded ``master``: to nearest, or, for stochastic write-back, keep
    it where it already is a neighbour of the master (a valid stochastic rounding)."""
    nearest = master.to(param.dtype)
    if rounding == "stochastic":
        inf = torch.full_like(nearest, float("inf"))
        above = torch.nextafter(nearest, inf)
        below = torch.nextafter(nearest, -inf)
        neighbour = (
            (param == nearest)
            | ((param == above) & (nearest.float() < master))
            | ((param == below) & (nearest.float() > master))
        )
        nearest = torch.where(neighbour, param, nearest)
    param.copy_(nearest)


class MasterWeights(torch.optim.Optimizer, PreparesGrads, ScalesItself, HoldsMasters):
    """Train a bfloat16/float16 model with float32 master weights, around any optimizer.

    ``MasterWeights(optimizer)`` replaces each low-precision parameter in ``optimizer``'s param
    groups by a float32 copy (its *master*); float32 parameters (e.g. normalisation layers kept by
    :func:`mixprec.to_low_precision`) are used as they are. Each :meth:`step`:

    1. :meth:`prepare_grads`: the model's gradients are copied into the masters' ``.grad``
       (float32; the model's ``.grad`` are only read);
    2. the wrapped optimizer steps on the masters, in float32;
    3. each master is written back into its model parameter, rounded to nearest (or
       stochastically with ``rounding="stochastic"``); the masters' gradients are released.

    The wrapper is a ``torch.optim.Optimizer``: ``param_groups``, ``state`` and ``defaults`` are
    the wrapped optimizer's (so they hold the masters), LR schedulers and step hooks work, and
    ``state_dict()`` holds the wrapped optimizer's state plus the float32 masters
    (``"master_params"``, one per parameter in ``param_groups`` order).

    Loss scaling: the wrapper speaks the scalers' protocol (:mod:`mixprec.scaling.protocol`: it is
    a :class:`~mixprec.scaling.protocol.PreparesGrads` and a
    :class:`~mixprec.scaling.protocol.ScalesItself`), so ``scaler.step(opt)`` hands it ``grad_scale`` and
    ``found_inf`` instead of unscaling gradients it cannot see. ``mixprec.GradScaler`` calls
    :meth:`prepare_grads` before it checks (or, in ``unscale_``, unscales) the gradients, so it
    checks the float32 master gradients and float16 parameters with dynamic loss scaling work
    (no "Attempting to unscale FP16 gradients"). ``torch.amp.GradScaler`` does not know
    :meth:`prepare_grads`: call ``opt.prepare_grads()`` yourself after ``backward`` and before
    ``scaler.unscale_(opt)`` / ``scaler.step(opt)``; forgetting it raises a ``RuntimeError`` in
    :meth:`step` (the scaler would have missed an overflow). On an overflow the step is skipped:
    parameters, masters and state are unchanged. A fused wrapped optimizer gets ``grad_scale``
    and ``found_inf`` forwarded (no host sync); any other reads ``found_inf`` once on the host
    and steps on master gradients unscaled in place.

    Memory per low-precision parameter: 2 (param) + 2 (grad) + 4 (master) + the wrapped
    optimizer's float32 state, plus 4 for the master gradient between :meth:`prepare_grads` (or,
    in ``step(closure)``, the closure's ``backward``) and the end of :meth:`step`.

    Args:
        optimizer: a ``torch.optim.Optimizer`` built on the model's parameters, before its first
            step or after (existing state is moved to the masters and cast to float32).
        rounding: ``"nearest"`` (default) or ``"stochastic"`` write-back.
        generator: randomness for stochastic write-back (on the parameters' device).

    Raises:
        TypeError: ``optimizer`` is not a ``torch.optim.Optimizer``, is a ``MasterWeights``, or
            is ``torch.optim.LBFGS`` (it re-evaluates the closure inside its step).
        ValueError: unknown ``rounding``.

    Example:
        >>> import torch, mixprec
        >>> model = mixprec.to_low_precision(torch.nn.Linear(4, 2), torch.bfloat16)
        >>> opt = mixprec.MasterWeights(torch.optim.AdamW(model.parameters(), lr=1e-4))
        >>> model(torch.randn(3, 4, dtype=torch.bfloat16)).float().sum().backward()
        >>> opt.step()
        >>> opt.zero_grad()
        >>> opt.masters[0].dtype, model.weight.dtype
        (torch.float32, torch.bfloat16)
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        rounding: str = "nearest",
        generator: Optional[torch.Generator] = None,
    ) -> None:
        if isinstance(optimizer, MasterWeights):
            raise TypeError("the optimizer is already wrapped in MasterWeights")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"MasterWeights wraps a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if isinstance(optimizer, torch.optim.LBFGS):
            raise TypeError(
                "LBFGS re-evaluates the closure inside step(), where MasterWeights cannot refresh "
                "the master gradients; train LBFGS in float32"
            )
        if rounding not in _ROUNDINGS:
            raise ValueError(f"rounding must be 'nearest' or 'stochastic', got {rounding!r}")
        # torch.optim.Optimizer.__init__ would build param groups of its own: set up only its hooks.
        for name in _HOOK_DICTS:
            setattr(self, name, OrderedDict())
        self._patch_step_function()
        self.optimizer = optimizer
        self.rounding = rounding
        self.generator = generator
        self._pairs: list[tuple[Tensor, Tensor]] = []  # (model param, fp32 master), low-p only
        self._prepared: list[Optional[tuple[Tensor, int]]] = []  # model grad + version copied
        for group in optimizer.param_groups:
            self._attach(group)

    # -- the wrapped optimizer's view ----------------------------------------------------------
    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        """The wrapped optimizer's param groups (holding the float32 masters)."""
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        """The wrapped optimizer's state, keyed by the masters."""
        return self.optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optimizer.defaults

    #: The loss scalers' fused protocol: see "Loss scaling" above.
    _step_supports_amp_scaling = True

    def __getstate__(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"MasterWeights(rounding={self.rounding!r}, optimizer={self.optimizer!r})"

    @property
    def masters(self) -> list[Tensor]:
        """The float32 master of every parameter, in ``param_groups`` order (float32 params are
        their own master)."""
        self._adopt_cast_params()
        return [m for g in self.param_groups for m in g["params"]]

    def master_pairs(self) -> tuple[tuple[Tensor, Tensor], ...]:
        """``(model parameter, float32 master)`` for each low-precision parameter, in the order
        they were added (:class:`mixprec.scaling.protocol.HoldsMasters`; float32 parameters,
        their own masters, are not listed)."""
        self._adopt_cast_params()
        return tuple(self._pairs)

    def _adopt_cast_params(self) -> None:
        """Give a master to each parameter of the wrapped optimizer that has become low precision
        since it was wrapped (:func:`mixprec.to_low_precision` after ``MasterWeights(...)``: the
        cast keeps the parameter objects), so that it is not stepped in bfloat16/float16."""
        for group in self.optimizer.param_groups:
            if any(p.dtype in LOW_PRECISION_DTYPES for p in group["params"]):
                self._attach(group)

    def _attach(self, group: dict[str, Any]) -> None:
        """Swap ``group``'s low-precision params for masters, in place (the list object is kept,
        in case the optimizer holds it)."""
        params = group["params"]
        self._check_new(params)
        for i, p in enumerate(params):
            if p.dtype not in LOW_PRECISION_DTYPES:
                continue
            master = p.detach().to(torch.float32, copy=True).requires_grad_(p.requires_grad)
            state = self.optimizer.state.pop(p, None)
            if state is not None:
                self.optimizer.state[master] = {
                    k: v.to(torch.float32) if k != "step" and isinstance(v, Tensor) and v.is_floating_point() else v
                    for k, v in state.items()
                }
            params[i] = master
            self._pairs.append((p, master))
            self._prepared.append(None)

    def _check_new(self, params: list[Tensor]) -> None:
        """Two masters for one parameter would silently overwrite each other's update."""
        held = {id(p) for p, _ in self._pairs}
        for p in params:
            if p.dtype in LOW_PRECISION_DTYPES:
                if id(p) in held:
                    raise ValueError(
                        "a parameter appears more than once (in one or more parameter groups): "
                        "give MasterWeights each model parameter once"
                    )
                held.add(id(p))

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group of model parameters: their masters join the wrapped optimizer."""
        params = param_group["params"]
        params = [params] if isinstance(params, Tensor) else list(params)
        self._check_new(params)
        self.optimizer.add_param_group({**param_group, "params": params})
        self._attach(self.optimizer.param_groups[-1])

    # -- the training step ---------------------------------------------------------------------
    @torch.no_grad()
    def prepare_grads(self) -> None:
        """Copy the model's gradients into the masters' ``.grad`` (float32).

        Idempotent until the model's gradients change (checked by tensor identity and version
        counter, no host sync), so a scaler can call it in ``unscale_`` and unscale the master
        gradients in place, and :meth:`step` then keeps them. A parameter without ``.grad`` gives
        its master none. Called by :meth:`step`; call it yourself before
        ``torch.amp.GradScaler.unscale_``/``step``, or to clip/inspect float32 gradients.
        Parameters cast to low precision since the wrapper was built get their masters first.
        """
        self._adopt_cast_params()
        for i in range(len(self._pairs)):
            self._prepare_grad(i)

    @torch.no_grad()
    def _prepare_grad(self, i: int) -> None:
        """:meth:`prepare_grads` for the ``i``-th low-precision parameter."""
        p, master = self._pairs[i]
        grad = p.grad
        if grad is None:
            master.grad = None
            self._prepared[i] = None
            return
        done = self._prepared[i]
        if done is not None and done[0] is grad and done[1] == grad._version:
            return
        if master.grad is None:
            master.grad = grad.to(torch.float32, copy=True)
        else:
            master.grad.copy_(grad)
        self._prepared[i] = (grad, grad._version)

    @contextlib.contextmanager
    def _masters_follow_grads(self) -> Iterator[None]:
        """While the closure of :meth:`step` runs, copy each model gradient into its master as
        soon as ``backward`` has accumulated it, so that code the closure runs after ``backward``
        (Lightning's ``gradient_clip_val``, a ``clip_grad_norm_`` over ``param_groups``) sees and
        clips the float32 master gradients the step uses. The copies are those :meth:`prepare_grads`
        makes (it then keeps them): without such code the step is bitwise unchanged."""
        handles = [
            p.register_post_accumulate_grad_hook(functools.partial(self._on_grad_accumulated, i))
            for i, (p, _) in enumerate(self._pairs) if p.requires_grad
        ]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def _on_grad_accumulated(self, i: int, param: Tensor) -> None:
        self._prepare_grad(i)

    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:  # type: ignore[override]
        """Prepare float32 gradients, step the wrapped optimizer, write the masters back.

        ``closure`` (re-evaluating the model's loss and calling ``backward``) runs first; its
        loss is returned, else the wrapped optimizer's return value. Within the closure each
        master gets its gradient as soon as ``backward`` has accumulated the model's, so that
        clipping ``param_groups``' parameters after ``backward`` in the closure (Lightning's
        ``gradient_clip_val``) clips the gradients stepped on.
        """
        loss = None
        self._adopt_cast_params()
        if closure is not None:
            with torch.enable_grad(), self._masters_follow_grads():
                loss = closure()
            self._adopt_cast_params()
        lent = lent_scale(self)
        if lent is not None and not self._grads_prepared():
            raise RuntimeError(
                "a loss scaler checked this optimizer's gradients before they were copied into the "
                "float32 masters (or the model's gradients changed since), so it may have missed an "
                "overflow. With torch.amp.GradScaler call opt.prepare_grads() after backward() and "
                "before scaler.unscale_(opt)/scaler.step(opt), and do not change the model's .grad "
                "after that (clip opt.masters' gradients instead); or use mixprec.GradScaler, which "
                "calls prepare_grads() itself."
            )
        self.prepare_grads()
        found_inf = None if lent is None else lent.found_inf
        if getattr(self.optimizer, "_step_supports_amp_scaling", False):
            # the fused inner optimizer unscales and skips
            with contextlib.nullcontext() if lent is None else lend_scale(self.optimizer, *lent):
                out = self.optimizer.step()
        else:
            if found_inf is not None and bool(found_inf):  # host sync, as the scalers' plain path
                self._release_master_grads()
                return loss
            if lent is not None and lent.grad_scale is not None:
                self._unscale_master_grads(lent.grad_scale)
            out = self.optimizer.step()
            found_inf = None
        with torch.no_grad():
            for p, master in self._pairs:
                if master.grad is None:  # no gradient, not stepped (torch's optimizers skip it): p stays
                    continue
                if self.rounding == "nearest":
                    p.copy_(master)  # unchanged master (a skipped step): unchanged p
                elif found_inf is None:
                    round_into_(p, master, True, self.generator)
                else:  # a fresh random rounding would move p on a skipped step: keep it, on device
                    rounded = round_into_(torch.empty_like(p), master, True, self.generator)
                    p.copy_(torch.where(found_inf.to(p.device) != 0, p, rounded))
        self._release_master_grads()
        return loss if closure is not None else out

    def _grads_prepared(self) -> bool:
        """Whether every model gradient is the one last copied into its master (no host sync)."""
        for (p, _), done in zip(self._pairs, self._prepared):
            grad = p.grad
            if grad is not None and (done is None or done[0] is not grad or done[1] != grad._version):
                return False
        return True

    def _unscale_master_grads(self, grad_scale: Tensor) -> None:
        """Divide the gradients the wrapped optimizer will read by ``grad_scale``, in place, as
        the scalers' ``unscale_`` does."""
        unscale_((p.grad for g in self.param_groups for p in g["params"] if p.grad is not None), grad_scale)

    def _release_master_grads(self) -> None:
        for i, (_, master) in enumerate(self._pairs):
            master.grad = None
            self._prepared[i] = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the gradients of the model's parameters and of the masters."""
        self.optimizer.zero_grad(set_to_none=set_to_none)
        for i, (p, _) in enumerate(self._pairs):
            self._prepared[i] = None
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                if p.grad.grad_fn is not None:
                    p.grad.detach_()
                else:
                    p.grad.requires_grad_(False)
                p.grad.zero_()

    @torch.no_grad()
    def refresh_masters(self) -> None:
        """Copy the model's parameters into the masters (after loading model weights into a model
        whose optimizer is already wrapped; the masters' low bits are lost)."""
        self._adopt_cast_params()
        for p, master in self._pairs:
            master.copy_(p)

    # -- checkpoints ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """The wrapped optimizer's ``state_dict()`` plus ``"master_params"``: the float32
        masters, one per parameter in ``param_groups`` order (references, as torch's state), and
        with a ``generator``, its state (``"master_generator_state"``), so that stochastic
        write-back resumes bitwise. Hooks registered on the wrapper with
        ``register_state_dict_pre_hook``/``register_state_dict_post_hook`` run as in
        ``torch.optim.Optimizer.state_dict`` (a post-hook may return a replacement)."""
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        self._adopt_cast_params()
        state = self.optimizer.state_dict()
        state["master_params"] = [m.detach() for m in self.masters]
        if self.generator is not None:
            state["master_generator_state"] = self.generator.get_state()
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            result = post_hook(self, state)
            if result is not None:
                state = result
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        """Load a :meth:`state_dict`: the masters are restored exactly and written back to the
        model, rounded to nearest (with ``rounding="stochastic"``, a model parameter that is
        already one of its master's two neighbours, e.g. loaded from the model's checkpoint, is
        kept, so training resumes bitwise in either load order). A ``state_dict`` without ``"master_params"`` (from the bare
        optimizer) keeps the current masters. A saved generator state is restored into this
        wrapper's ``generator``, if it has one. Hooks registered on the wrapper with
        ``register_load_state_dict_pre_hook`` (which may return a replacement state dict) and
        ``register_load_state_dict_post_hook`` run as in ``torch.optim.Optimizer.load_state_dict``.

        Raises:
            ValueError: the saved masters, or a moment (``exp_avg``, ``momentum_buffer``, ... of
                torch's optimizers) of the wrapped optimizer's state, do not match this
                optimizer's parameters; checked before anything changes, so a refused load
                leaves the wrapper, its masters and the wrapped optimizer as they were.
        """
        state_dict = dict(state_dict)
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = dict(result)
        saved = state_dict.pop("master_params", None)
        generator_state = state_dict.pop("master_generator_state", None)
        masters = self.masters
        if saved is not None:
            if len(saved) != len(masters):
                raise ValueError(
                    f"the checkpoint has {len(saved)} master params, this optimizer {len(masters)}"
                )
            for m, s in zip(masters, saved):
                if tuple(m.shape) != tuple(s.shape):
                    raise ValueError(
                        f"checkpoint master of shape {tuple(s.shape)} for a parameter of shape {tuple(m.shape)}"
                    )
        _check_moment_shapes(state_dict, masters)
        if generator_state is not None and not isinstance(generator_state, Tensor):
            raise TypeError("master_generator_state must be a torch.Generator's state (a uint8 tensor), got "
                            f"{type(generator_state).__name__}")
        self.optimizer.load_state_dict(state_dict)
        if saved is not None:
            with torch.no_grad():
                for m, s in zip(masters, saved):
                    m.copy_(s)
                for p, master in self._pairs:
                    _write_back_loaded(p, master, self.rounding)
        if generator_state is not None and self.generator is not None:
            self.generator.set_state(generator_state.cpu())
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)


#: State keys of torch.optim optimizers that hold one value per parameter element.
_PER_ELEMENT_STATE = frozenset({"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "square_avg",
                                "acc_delta", "sum", "grad_avg", "ax", "prev", "step_size"})


def _check_moment_shapes(state_dict: dict[str, Any], masters: list[Tensor]) -> None:
    """Raise ``ValueError`` if a per-element moment of the wrapped optimizer's saved state (by
    torch's parameter index, ``param_groups`` order) does not have its master's shape: torch's
    ``load_state_dict`` would take it, and the step would fail or broadcast."""
    for index, saved in (state_dict.get("state") or {}).items():
        if not isinstance(index, int) or not 0 <= index < len(masters):
            continue  # torch's own load names what does not match
        for key, value in saved.items():
            if (key in _PER_ELEMENT_STATE and isinstance(value, Tensor) and value.dtype != torch.uint8
                    and value.shape != masters[index].shape):  # (8-bit codes: mixprec.optim checks them)
                raise ValueError(
                    f"the saved state of parameter {index} holds {key!r} of shape {tuple(value.shape)} for a "
                    f"parameter of shape {tuple(masters[index].shape)}: the checkpoint belongs to another model "
                    "or parameter order; load the matching checkpoint"
                )
