"""The probe that :func:`mixprec.fp8.linear` calls around a controlled layer's GEMM
(``LayerState.probe``): it measures the operands into the layer's record (:mod:`._ladder`): the
range under fp16, the shadow (what another rung's casts would do, on a sample), each GEMM's own
casts for a per-GEMM record, and the loss costs of the forward and backward GEMMs."""

from __future__ import annotations

import warnings
import weakref
from typing import Any, Callable

import torch

from mixprec._scaled import latest_count
from mixprec.formats._recipe import Cast
from mixprec.formats._tensor_parallel import probe_operand
from mixprec.formats._state import GRAD_OUTPUT, INPUT, WEIGHT
from mixprec.control._cost import measure_cost
from mixprec.control._ladder import GEMMS, LayerRecord
from mixprec.control._measure import abs_max, record, record_range, sampled_cast
from mixprec.control._reach import ReachMap
from mixprec.control._reference import reference_dtype
from mixprec.control._clock import CheckClock
from mixprec.control._settings import ControllerSettings

__all__ = ["Probe"]


class Probe:
    """What :func:`mixprec.fp8.linear` calls after a controlled layer's GEMM (``LayerState.probe``),
    in eager mode and traced alike: the range (fp16 inputs) and, on the last steps of each window,
    the shadow of a promoted layer, and for a per-GEMM record each GEMM's own casts; under
    ``Controller.max_loss_cost``, on the training steps its plan names (``rec.cost_now``: the
    last steps of each window, all of them where the window's mean may land near its threshold),
    the loss cost of the forward GEMM's error (:func:`~mixprec.control._cost.measure_cost`), on every row of its
    output, or on a share ``cost_row_share`` of them (:func:`~mixprec.control._cost.sampled_rows`: a
    sum of signed terms, estimated without bias and noisier, which the plan's variance takes in).
    The casts are measured on a sample of about ``settings.sample`` elements per operand. A copy
    or a pickle of the model (``copy.deepcopy``) drops it: the copy runs its rung without
    measurements."""

    def __init__(self, rec: LayerRecord, settings: ControllerSettings, measuring: bool = False,
                 clock: CheckClock | None = None, reaches: ReachMap | None = None) -> None:
        """(``settings``: the controller's, whose ``sample``, ``reference`` (resolved for the
        layer's device into ``rec.reference``) and ``cost_row_share`` it reads; ``measuring``:
        whether the step under way feeds the shadows, written to the record; ``clock``: the
        controller's, which adds up the measurements' host seconds; ``reaches``: its map of the
        step's GEMM outputs, which the backward cost's reach walks.)"""
        self.rec, self.sample, self.clock = rec, settings.sample, clock  # ``sample``: the elements measured per operand
        self.cost_row_share = settings.cost_row_share
        rec.reference = reference_dtype(settings.reference, rec.state.device)
        self.reaches = reaches
        rec.measuring.fill_(measuring)
        rec.measuring_now = measuring
        self.fp32 = False  # the fp32 rung: fp8.linear's fallback runs the GEMM in float32
        self.dtype: torch.dtype | None = None  # the input dtype the layer computes in (Controller._learn_compute)

    def __deepcopy__(self, memo: dict) -> None:
        return None

    def __reduce__(self) -> tuple:
        return type(None), ()

    def timed(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` timed by the controller's clock (:meth:`~mixprec.control._clock.CheckClock.timed`);
        traced code is not timed (a host clock in a graph would break it)."""
        if self.clock is None or torch.compiler.is_compiling():
            return fn
        return self.clock.timed(fn)

    def tap(self, x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Before the GEMM, on the step that measures the backward GEMMs' loss cost
        (``rec.backward_now``, eager code): ``x`` and ``weight`` as views that hand the layer's
        own backward results to it (:meth:`~mixprec.control._backward.BackwardCost.tap`); else unchanged."""
        rec = self.rec
        if (rec.backward is None or not rec.backward_now or not rec.backward.due or rec.cost_blind
                or torch.compiler.is_compiling()):
            return x, weight
        return self.timed(rec.backward.tap)(x, weight, self.timed)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor | None, out: torch.Tensor,
                 bias: torch.Tensor | None = None, tp: Any = None) -> torch.Tensor:
        """Measure ``x`` (the GEMM's input, in its dtype), ``weight`` (``(out, in)``; None: not
        measured), ``out`` and (the loss cost) ``bias``; returns ``out``. ``tp``: the layer's
        tensor-parallel sharding (its local shards given): the casts are measured as one process
        measures the whole operands (:func:`~mixprec.formats._tensor_parallel.probe_operand`).
        Its host seconds and its gradient hooks' go to the controller's clock (eager code); a
        call with nothing to measure (most calls, most steps: :meth:`_idle`) returns at once."""
        if self._idle(x, tp):
            return out.view_as(out) if out.requires_grad and out._backward_hooks is not None else out
        return self.timed(self._probe)(x, weight, out, bias, tp)

    def _idle(self, x: torch.Tensor, tp: Any) -> bool:
        """Whether :meth:`_probe` would measure nothing and change no state in this call (eager
        code, the input's dtype known, not fp16's range, no tensor parallelism): not a shadow
        step nor the backward costs' step, no loss cost this step, nothing of the backward
        costs pending (an update's gain, its end slope, a loaded update, a tapped forward). What it then returns
        is what :meth:`_probe` does (``out``, or a view where hooks went on it)."""
        if torch.compiler.is_compiling():  # (first: traced code reads no flag, no guard)
            return False
        rec = self.rec
        if rec.measuring_now or rec.backward_now or tp is not None or self.dtype is None or x.dtype is torch.float16:
            return False
        if rec.cost is not None and any(rec.cost_rows_now()):
            return False
        back = rec.backward
        return back is None or (back.pending is None and back.ready is None and back.slope is None
                                and back._open is None and back.gained is None)

    def _probe(self, x: torch.Tensor, weight: torch.Tensor | None, out: torch.Tensor, bias: torch.Tensor | None,
               tp: Any) -> torch.Tensor:
        rec, sample = self.rec, self.sample
        # Traced code reads no Python state that changes between rung switches (each read is a
        # guard, each change a recompile): the compute dtype goes to the probe, taken by the
        # controller at its step; the shadows are measured on every step, kept on shadow steps
        # by a device flag (``rec.measuring``), bitwise what eager keeps (``rec.measuring_now``)
        compiling = torch.compiler.is_compiling()
        if compiling or self.dtype is None:  # (compiling first: traced code reads no dtype, no guard)
            self.dtype = x.dtype
        measuring, gate = (True, rec.measuring) if compiling else (rec.measuring_now, None)
        if x.dtype is torch.float16:
            record_range(rec.range, x, out)
        if tp is not None and not compiling and rec.backward is not None:
            _note_shard_cost(rec)
        if rec.cost is not None and not rec.cost_blind and weight is not None and out.requires_grad:
            # traced: both rows on every step, kept where the device flags say (no guard on the plan)
            wanted, kept = ((True, True), rec.cost_gate) if compiling else (rec.cost_rows_now(), None)
            if any(wanted):
                measure_cost(rec, x, weight, bias, out, wanted, kept, tp, self.timed, self.cost_row_share,
                             rec.cost_step_t if compiling else rec.cost_step)
        if rec.backward is not None and not compiling and not rec.cost_blind and weight is not None:
            rec.backward.observe(x, weight, out, rec.backward_now and rec.backward.due, self.timed,
                                 self.reaches if rec.backward_now else None)  # (the step's nodes: only where walked)
        if rec.gemm_windows is not None:
            _measure_gemms(rec, x, weight, out, sample, measuring, gate, tp, self.timed)
        elif rec.below is not None and measuring:
            self._measure_shadow(x, weight, out, gate, tp)
        # the gradient hooks go on ``out``, the caller gets a view of it: so they see the gradient
        # the GEMM's backward receives, after any hook on the returned tensor (a per-layer loss
        # scaler's cut point, whose factor the gradients of this layer carry); none where no hook
        # went on ``out`` (a step that measures nothing of the layer) but on the step whose
        # backward walks the reaches (the graph it walks keeps its nodes)
        hooked = compiling or rec.backward_now or out._backward_hooks is not None
        if not compiling and out.requires_grad and out._backward_hooks is not None:
            _note_scaled(rec, out)
        return out.view_as(out) if out.requires_grad and hooked else out

    def _measure_shadow(self, x: torch.Tensor, weight: torch.Tensor | None, out: torch.Tensor,
                        gate: torch.Tensor | None, tp: Any) -> None:
        """The rung below's casts of a promoted layer's operands (a per-layer record), on a shadow step."""
        rec, sample = self.rec, self.sample
        below = rec.below
        _measure(rec.shadow, INPUT, x, "mk", below.input, below.pow2_scales, sample, gate, tp)
        if weight is not None:
            _measure(rec.shadow, WEIGHT, weight.detach(), "nk", below.weight, below.pow2_scales, sample, gate, tp)
        if out.requires_grad:
            buf = rec.shadow
            out.register_hook(self.timed(lambda g: _measure(buf, GRAD_OUTPUT, g, "mn", below.grad_output,
                                                            below.pow2_scales, sample, gate, tp)))


def _note_scaled(rec: LayerRecord, out: torch.Tensor) -> None:
    """Note when this forward ran (not a checkpoint's recompute, inside a backward) and when the
    gradient its hooks measure came, as :func:`~mixprec._scaled.latest_count`: the loss scale it
    carries is the one noted in between (:func:`~mixprec.control._records.grad_scale`)."""
    if torch._C._current_graph_task_id() == -1:
        rec.scaled_by[0] = latest_count()
    out.register_hook(lambda grad: rec.scaled_by.__setitem__(1, latest_count()))


def _measure(window: torch.Tensor, operand: int, t: torch.Tensor, has: str, cast: Cast, pow2: bool, sample: int,
             gate: torch.Tensor | None, tp: Any, hadamard_seed: int | None = None, amax: torch.Tensor | None = None,
             shared: dict | None = None, tag: str = "") -> None:
    """:func:`measure` of ``t`` (layer dimensions ``has``); under tensor parallelism ``tp``, of
    the whole operand as one process measures it (:func:`probe_operand`). ``shared``: the
    sampled casts of this forward so far, by operand ``tag`` (``"x"``, ``"w"``): a square 2-D
    block cast of an operand and of its transpose measure alike (:func:`sampled_cast`), so the
    weight's NVFP4 16x16 cast is sampled and cast once for the forward and the input-gradient GEMM."""
    if tp is not None:  # (the whole operand: shared by nothing)
        t, whole = probe_operand(tp, t, has, cast, sample)
        amax, shared = amax if whole is None else whole, None
    key = (tag, cast, pow2) if shared is not None and tag and hadamard_seed is None and _square(cast) else None
    cast_sample = shared.get(key) if key is not None else None
    if cast_sample is None:
        cast_sample = sampled_cast(t, cast, pow2, sample, hadamard_seed, amax)
        if key is not None:
            shared[key] = cast_sample
    if cast_sample is not None:
        record(window, operand, cast_sample, gate)


def _square(cast: Cast) -> bool:
    """Whether ``cast`` has square 2-D blocks (a cast of the transpose is the transpose of the cast)."""
    return cast.block is not None and cast.block[0] > 1 and cast.block[0] == cast.block[1]


_SHARD_NOTED: weakref.WeakSet = weakref.WeakSet()


def _note_shard_cost(rec: LayerRecord) -> None:
    """Warn once per layer that its backward GEMMs' loss cost is its shard's (a tensor-parallel layer)."""
    if rec not in _SHARD_NOTED:
        _SHARD_NOTED.add(rec)
        name = rec.state.name or "a tensor-parallel layer"
        warnings.warn(f"fp8: Controller(max_backward_cost=...) measures the backward GEMMs' loss cost of {name!r} on "
                      f"each rank's shard of the layer (tensor parallelism), and a check takes the largest shard's: "
                      f"it can read up to the TP degree too small, so a backward GEMM may stay in a rung one "
                      f"process would leave (its cast statistics and forward loss cost are the whole layer's)",
                      UserWarning, stacklevel=4)


def _measure_gemms(rec: LayerRecord, x: torch.Tensor, weight: torch.Tensor | None, out: torch.Tensor,
                   sample: int, shadow: bool, gate: torch.Tensor | None = None, tp: Any = None,
                   timed: Callable[[Callable], Callable] = lambda fn: fn) -> None:
    """Per GEMM, the statistics of its own casts and of the rung below's, on ``shadow`` steps
    (under ``gate``, a device flag: measured on every step, kept where it is set), in eager code
    only those the next check reads (``rec.stats_read``), each operand
    as that GEMM reads it (its contracted dimension last; under ``tp``, the whole operand's: :func:`_measure`);
    the gradient hook ``timed``."""
    if not shadow:
        return
    compiling = torch.compiler.is_compiling()  # (traced code measures all: no guard on the flags, the check skips them)
    wanted = [(g, gemm, kind, casts) for g, gemm in enumerate(GEMMS)
              for kind, casts in ((0, rec.own[g]), (1, rec.below_gemm[g]))
              if casts is not None and (compiling or rec.stats_read[kind][g])]
    if not wanted:  # (most shadow steps of a layer whose loss costs decide: no operand read)
        return
    x2 = x.detach().reshape(-1, x.shape[-1])
    w = weight.detach() if weight is not None else None
    # each operand is read by two GEMMs: one pass for its amax (none on an empty batch: not measured)
    amax_x, amax_w = (None if t is None or t.numel() == 0 else abs_max(t) for t in (x2, w))
    reads = {"output": ((x2, amax_x, "mk", "x"), (w, amax_w, "nk", "w")),
             "grad_input": (None, None if w is None else (w.t(), amax_w, "kn", "w")),
             "grad_weight": (None, (x2.t(), amax_x, "km", "x"))}
    backward, shared = [], {}
    for g, gemm, kind, casts in wanted:
        for side, (operand, cast) in enumerate(zip(reads[gemm], (casts.left, casts.right))):
            if operand is not None:
                _measure(rec.gemm_windows[kind, g], side, operand[0], operand[2], cast, casts.pow2, sample, gate,
                         tp, casts.hadamard_seed, operand[1], shared, operand[3])
        if gemm != "output":
            backward.append((rec.gemm_windows[kind, g], gemm, casts, gate))
    if backward and out.requires_grad:
        out.register_hook(timed(lambda grad: _measure_grad(backward, grad, sample, tp)))


def _measure_grad(where: list, grad: torch.Tensor, sample: int, tp: Any = None) -> None:
    g2 = grad.detach().reshape(-1, grad.shape[-1])
    amax = abs_max(g2) if g2.numel() else None  # not measured
    for window, gemm, casts, gate in where:
        _measure(window, 0, g2 if gemm == "grad_input" else g2.t(), "mn" if gemm == "grad_input" else "nm", casts.left,
                 casts.pow2, sample, gate, tp, casts.hadamard_seed, amax)
