"""The loss cost of a forward GEMM's output error (``Controller(max_loss_cost=...)``): the
output errors against a reference GEMM (:func:`output_errors`), met with the output's gradient in
the backward (:func:`measure_cost`), the estimate from a step's sums (:func:`loss_cost`), and on
how many steps of a window it is measured (:func:`cost_steps`: the steps cost a reference GEMM
each, so a cost whose window mean lies far from its threshold is measured on few) and in which
windows (:class:`Cadence`: one far from it, alone or with the windows before it (:func:`clear`),
in fewer and fewer, the last figure standing). Device tensors in, a record's loss-cost buffer
updated in place, no host sync; :func:`cost_steps` and :func:`clear` are plain arithmetic on the
figures a check read."""

from __future__ import annotations

import functools
import math
import statistics
from typing import Any, Callable

import torch
import torch.nn.functional as F

from mixprec.control._reference import emulation_backend, operand_dtype, reference_linear
from mixprec.formats._linear import local_linear

__all__ = ["COST_Z", "COST_ZONE", "MAX_PERIOD", "POOL_LEAST", "POOL_WINDOWS", "ROW_STEP", "UNRESOLVED_SHARE",
           "UNRESOLVED_WINDOWS", "VARIANCES", "Cadence", "clear", "clear_pooled", "cost_steps", "far", "load_pool",
           "loss_cost", "measure_cost", "output_errors", "pool", "pooled_with", "sampled_rows", "share_of_rows",
           "unresolved", "variance"]

#: how many standard errors of its window mean a loss cost measured on fewer than all of a
#: window's steps keeps from its threshold (:func:`cost_steps`): at 3, a window's mean lands on
#: the other side of the threshold than the step costs' own mean in about 1 window of 700.
COST_Z = 3.0
#: how near its threshold (a share of it) a cost's window mean may lie undecided (:func:`cost_steps`):
#: a plan takes the steps that resolve a mean this far from the threshold, not more; a mean
#: nearer is decided on them (either side then costs within this share of the limit)
COST_ZONE = 0.5
#: how many windows' steps a cost's plan may need before one window stops trying to resolve it
#: (:func:`unresolved`): past that, even a window measured on every step leaves its mean under
#: half of :data:`COST_Z` standard errors from the threshold's zone, a toss either way
UNRESOLVED_WINDOWS = 4
#: the share of a window's steps a cost no window resolves is measured on (:func:`cost_steps`):
#: it is decided on its windows since the last switch taken together (``LayerRecord.split``),
#: which gather as many steps in twice the windows
UNRESOLVED_SHARE = 0.5
#: the most windows a cost far from its threshold waits between two measured ones (:class:`Cadence`)
MAX_PERIOD = 8
#: how many measured windows' figures (since the forward GEMM's last switch) :func:`clear` pools:
#: a cost whose steps are too noisy for one window to tell it from its threshold, yet lies on one
#: side of it window after window, is measured in fewer windows (it would be measured on every step
#: of every window for the rest of a run)
POOL_WINDOWS = 16
#: the fewest per-step estimates a pool's verdict reads (:func:`clear_pooled`): its standard error
#: is itself estimated, and with 6 estimates COST_Z of them miss about 1 time in 70 (Student's t)
POOL_LEAST = 6
#: how far a sample of rows (:func:`sampled_rows`) moves its first row from one step to the next,
#: modulo the row count: a prime (coprime with any count below it), so over as many steps as rows
#: every row starts a sample once, and consecutive steps' samples land on different residues
ROW_STEP = 2654435761


def measure_cost(rec: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 out: torch.Tensor, wanted: tuple[bool, bool] = (True, True), gate: torch.Tensor | None = None,
                 tp: Any = None, timed: Callable[[Callable], Callable] = lambda fn: fn, share: float = 1.0,
                 step: int | torch.Tensor = 0) -> None:
    """Keep the forward GEMM's output errors (:func:`output_errors`, the rows ``wanted``) until
    the backward hook that meets them with the output's gradient (:func:`_accumulate_cost`;
    ``gate``, a device flag per row: the sums keep a row only where it is set). ``tp``: the
    layer's tensor-parallel sharding (``x``, ``weight``, ``out`` its local shards): the cost is
    the whole layer's, as one process measures it (each rank's output rows' ``g . e`` summed over
    the group: one all-reduce of a float per output row in the backward). ``share``: of the
    output rows (its leading dimensions flattened), the share measured, those ``step`` draws
    (:func:`sampled_rows`; 1: all): the sums are scaled to the whole output's, an unbiased
    estimate, every row sampled equally often. The hook is ``timed``."""
    own, below = _measurable(rec, wanted)
    if not own and below is None:  # (a rung below wanted where there is none: no rows drawn)
        return
    total = out.numel() // max(out.shape[-1], 1) if out.dim() else 1
    rows = share_of_rows(total, share, step, out.device)
    errors = output_errors(rec, x, weight, bias, out, wanted, tp, rows)
    if errors:
        buf = rec.cost
        out.register_hook(timed(lambda grad: _accumulate_cost(buf, errors, grad, gate, tp, rows, total)))


def sampled_rows(count: int, most: int | None, step: int | torch.Tensor,
                 device: torch.device | str = "cpu") -> torch.Tensor | None:
    """The rows of ``count`` (an output's leading dimensions flattened) a loss cost measures on
    ``step`` (a Python int, or a 0-d int64 device tensor: compiled code, no guard), at most
    ``most`` (None, or ``count <= most``: None, every row): evenly spaced, ``ceil(count /
    most)`` apart, from a first row that moves :data:`ROW_STEP` rows a step (modulo ``count``,
    wrapping), so each row is in exactly ``len(rows)`` of any ``count`` consecutive steps'
    samples: ``sum * count / len(rows)`` estimates the whole output's sum without bias. The
    same ``step`` draws the same rows on every tensor-parallel rank and in a checkpoint's
    recompute. No host sync.

    Example:
        >>> sampled_rows(10, 4, 0), sampled_rows(10, 4, 1), sampled_rows(10, None, 1)
        (tensor([0, 3, 6, 9]), tensor([1, 4, 7, 0]), None)
    """
    if most is None or count <= most:
        return None
    if isinstance(step, int):  # (eager code: the layers of a step share one tensor)
        return _rows_at(count, most, step, torch.device(device))
    return _rows(count, most, step, device)


def share_of_rows(count: int, share: float, step: int | torch.Tensor, device: torch.device | str = "cpu"
                  ) -> torch.Tensor | None:
    """:func:`sampled_rows` of ``count`` at most ``ceil(count * share)`` (``share`` 1: None, every row).

    Example:
        >>> share_of_rows(8, 0.25, 0), share_of_rows(8, 1.0, 0)
        (tensor([0, 4]), None)
    """
    return None if share >= 1 else sampled_rows(count, math.ceil(count * share), step, device)


@functools.lru_cache(maxsize=16)
def _rows_at(count: int, most: int, step: int, device: torch.device) -> torch.Tensor:
    return _rows(count, most, step, device)


def _rows(count: int, most: int, step: int | torch.Tensor, device: torch.device | str) -> torch.Tensor:
    stride = -(-count // most)
    first = (step % count) * (ROW_STEP % count) % count  # (each factor under count: no int64 overflow)
    return (first + stride * torch.arange(-(-count // stride), device=device)) % count


def output_errors(rec: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  out: torch.Tensor, wanted: tuple[bool, bool] = (True, True), tp: Any = None,
                  rows: torch.Tensor | None = None) -> list[tuple[int, torch.Tensor]]:
    """The forward GEMM's output errors against its reference (:mod:`._reference`: float32, or
    bfloat16 operands accumulated in float32: ``rec.reference``), as ``(row of rec.cost, error)``, of the
    rows ``wanted``: its own casts' (row 0) when it runs casts, the recipe below's (row 1,
    emulated) while it may go down. Costs one reference GEMM (none when no row is wanted or
    measurable, nor where the forward runs no casts and its output is at least as precise as
    the reference: that output is the reference, and the rung below's error is what a demotion
    would change it by), and one emulated GEMM of the recipe below for a promoted forward; each
    error is the output's size, in its dtype (under ``tp``, the local output's: the rung below's
    casts take the whole layer's scales). ``rows`` (:func:`sampled_rows`; None: all): only those
    output rows, as a 2-D error, the GEMMs on those rows of ``x``; the rung below's casts still
    take the whole input's scale (a row holding its largest magnitude joins the emulated GEMM's
    input). No host sync."""
    errors = []
    own, below = _measurable(rec, wanted)
    if not own and below is None:
        return errors
    with torch.no_grad(), torch.autocast(x.device.type, enabled=False):
        x, w, out = x.detach(), weight.detach(), out.detach()
        b = None if bias is None else bias.detach()
        whole = x
        if rows is not None:
            x = x.reshape(-1, x.shape[-1]).index_select(0, rows)
            out = out.reshape(-1, out.shape[-1]).index_select(0, rows)
        dtype = operand_dtype(rec.reference, x.dtype)
        if rec.forward_low or out.dtype not in (dtype, torch.float32):
            reference = reference_linear(x, w, b, dtype)
        else:  # (the compute dtype's GEMM, or float32's: no casts)
            reference = out.float()
        if own:
            errors.append((0, (out.float() - reference).to(out.dtype)))
        if below is not None:
            emulated = local_linear(x if rows is None else _with_amax(x, whole), w, b, below,
                                    emulation_backend(dtype), tp)
            errors.append((1, (emulated[:x.shape[0]].float() - reference).to(out.dtype)))
    return errors


def _measurable(rec: Any, wanted: tuple[bool, bool]) -> tuple[bool, Any]:
    """Of the rows ``wanted``, whether the own casts' error is measurable (the forward runs
    casts) and the recipe below whose error is (None: none wanted, or no rung below)."""
    return wanted[0] and rec.forward_low and not rec.state.fallback, rec.forward_below if wanted[1] else None


def _with_amax(rows: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
    """``rows`` (2-D, rows of ``whole``) and one more row holding ``whole``'s largest magnitude
    (then zeros): their cast takes the whole tensor's scale (tensorwise fp8, NVFP4's tensor scale)
    and each row's own (row and block scales) as the whole tensor's cast does."""
    low, high = torch.aminmax(whole)
    return torch.cat([rows, F.pad(torch.maximum(high, -low).reshape(1, 1), (0, rows.shape[1] - 1))])


def _accumulate_cost(buf: torch.Tensor, errors: list, grad: torch.Tensor, gate: torch.Tensor | None = None,
                     tp: Any = None, rows: torch.Tensor | None = None, total: int = 0) -> None:
    """Add to ``buf``'s step sums, per error ``e`` (rows of the output), the first-order term
    ``sum(grad * e)``, the sum over rows of ``(grad_row . e_row) ** 2`` and the row count (where
    ``gate``, a device flag per row of ``buf``, is set, when given). Under ``tp`` each row's
    ``grad_row . e_row`` is the sum over the group of the local ones: a colwise layer's ranks hold
    its output columns, a rowwise layer's its partial sums (whose gradient is the output's).
    ``rows``: the output rows the errors hold (:func:`sampled_rows`) of ``total``: both sums are
    scaled by ``total / len(rows)``, the count is ``total``."""
    g2 = grad.detach().reshape(-1, grad.shape[-1])
    if rows is not None:  # (the rows first: the conversion below then takes only them)
        g2 = g2.index_select(0, rows)
    g2 = g2.float()
    kept = [row for row, _ in errors]
    # every error's per-row terms in one pass: [errors, rows]
    stacked = torch.stack([error.reshape(g2.shape) for _, error in errors]).float()
    per_row = (g2 * stacked).sum(-1)
    if tp is not None:
        import torch.distributed as dist

        per_row = tp.reduce(per_row, dist.ReduceOp.SUM)
    first, squares = per_row.sum(-1), per_row.square().sum(-1)
    if rows is not None:
        scale = total / rows.numel()
        first, squares = first * scale, squares * scale
    count = float(per_row.shape[-1] if rows is None else total)
    sums = torch.stack([first, squares, torch.full_like(first, count)], dim=-1)
    at = slice(kept[0], kept[-1] + 1)  # (rows 0, 1 or both, in order: output_errors')
    buf[at, :3] += sums if gate is None else torch.where(gate[at].unsqueeze(-1), sums, 0.0)


def loss_cost(first: torch.Tensor, squares: torch.Tensor, rows: torch.Tensor,
              loss_scale: float | torch.Tensor = 1.0, at_error: bool = False) -> torch.Tensor:
    """The loss a GEMM's output error ``e`` adds, to second order, from one step's sums over
    the ``rows`` of its output: ``first = sum(g * e)`` and ``squares = sum_t (g_t . e_t) ** 2``
    with ``g`` the loss's gradient (times ``loss_scale``) on the output. With the loss the mean
    of per-row losses ``l_t`` (``g_t = grad l_t / rows``) and each row's Hessian taken as
    ``grad l_t grad l_t'`` (the empirical Fisher), the curvature term ``1/2 e' H e`` is
    ``rows / 2 * squares``. The estimate is ``first + rows / 2 * squares`` when ``g`` was taken
    at the output without the error (the rung below's, measured from a promoted GEMM), and
    ``first - rows / 2 * squares`` when at the output with it (``at_error``: the GEMM's own
    casts, whose gradient already moved by ``H e``). In the loss's units (nats for a cross-entropy).

    Example:
        >>> g, e = torch.tensor([[0.5, -1.0]]), torch.tensor([[-0.1, -0.2]])
        >>> per_row = (g * e).sum(-1)  # 0.15
        >>> [round(float(loss_cost(per_row.sum(), per_row.square().sum(), torch.tensor(1.0), at_error=a)), 5)
        ...  for a in (False, True)]
        [0.16125, 0.13875]
    """
    curvature = 0.5 * rows * squares / (loss_scale * loss_scale)
    return first / loss_scale + (-curvature if at_error else curvature)


#: how many windows' sample variances a plan keeps: it plans from their median (one window's
#: outlier, a loss spike's step, does not make every later window measure every step)
VARIANCES = 3


def cost_steps(mean: float, mean_square: float, steps: float, variances: list[float] | None, threshold: float,
               every: int, least: int, pooled: int = 1) -> tuple[int, list[float] | None]:
    """``(steps, variances)``: on how many steps of the next window (the last ones, at least
    ``least``, at most ``every``) to measure a loss cost whose last window measured ``steps``
    per-step estimates of ``mean`` and mean square ``mean_square``, and the per-step sample
    variances it keeps (``variances``: those kept so far, None: none yet; the window's joins
    them, the last :data:`VARIANCES` kept). Few steps where the threshold the decision compares
    the window's mean with lies :data:`COST_Z` standard errors of the mean away, by the median
    of the variances kept (:func:`variance`): ``ceil(COST_Z**2 * variance / (mean -
    threshold)**2)``, divided by ``pooled`` where the decision takes that many windows in a row
    on the same side (a demotion: ``demote_windows`` clean windows; each window's
    :data:`COST_Z` shrinks by its square root), the distance taken as at least :data:`COST_ZONE`
    of the threshold (a mean nearer than that is decided on those steps: measuring every step
    could not resolve it either, and either side costs about the limit); :data:`UNRESOLVED_SHARE`
    of the window's steps (at least ``least``) for a cost no window resolves (:func:`unresolved`:
    its windows decide together); every step without a variance (a first window, or one of
    fewer than 2 steps kept none) or without a measurement in the window.

    Example:
        >>> cost_steps(0.0, 1e-8, 10, None, 1e-3, 10, 2)  # far below: 2 steps
        (2, [1.111111111111111e-08])
        >>> cost_steps(9e-4, 9e-4 ** 2 + 9e-7, 10, None, 1e-3, 10, 2)[0]  # near, and noisy: every step
        10
        >>> cost_steps(9e-4, 9e-4 ** 2 + 1e-5, 10, None, 1e-3, 10, 2)[0]  # too noisy for any window: half
        5
        >>> cost_steps(9e-4, 9e-4 ** 2 + 1e-8, 10, None, 1e-3, 10, 2)[0]  # near, in the zone: resolved by 2
        2
    """
    if steps >= 2:
        sample = max(0.0, (mean_square - mean * mean) * steps / (steps - 1))
        variances = ([] if variances is None else list(variances))[-(VARIANCES - 1):] + [sample]
    needed = _needed(mean, variances, threshold, pooled)
    if needed is None or steps < 1:
        return every, variances
    if needed > UNRESOLVED_WINDOWS * every:
        return max(least, math.ceil(UNRESOLVED_SHARE * every)), variances
    return (min(every, max(least, math.ceil(needed))) if needed < every else every), variances


def unresolved(mean: float, steps: float, variances: list[float] | None, threshold: float, every: int,
               pooled: int = 1) -> bool:
    """Whether no window resolves a cost whose last window measured ``steps`` estimates of
    ``mean`` (``variances``: the plan's, this window's included; ``pooled``: as
    :func:`cost_steps`): more than :data:`UNRESOLVED_WINDOWS` windows' steps would keep its mean
    :data:`COST_Z` standard errors from ``threshold``. Such a cost is measured on a share of the
    steps and decided on its windows since the last switch together.

    Example:
        >>> unresolved(9e-4, 10, [1e-6], 1e-3, 10), unresolved(9e-4, 10, [1e-5], 1e-3, 10), unresolved(9e-4, 10, None, 1e-3, 10)
        (False, True, False)
    """
    needed = _needed(mean, variances, threshold, pooled)
    return needed is not None and steps >= 1 and needed > UNRESOLVED_WINDOWS * every


def _needed(mean: float, variances: list[float] | None, threshold: float, pooled: int) -> float | None:
    """The per-step estimates that keep ``mean`` :data:`COST_Z` standard errors (the median of
    ``variances``) from ``threshold`` (at least :data:`COST_ZONE` of it away), for a decision
    taking ``pooled`` windows in a row; None without a variance or a finite mean."""
    kept = variance(variances)
    distance = max(abs(mean - threshold), COST_ZONE * abs(threshold))
    if kept is None or not math.isfinite(mean) or not distance > 0:
        return None
    return COST_Z * COST_Z * kept / (distance * distance * max(1, pooled))


def variance(variances: list[float] | None) -> float | None:
    """The per-step variance a plan uses: the median of the windows' sample variances kept
    (the mean of the middle two of an even count; None: none).

    Example:
        >>> variance([1e-8, 4.0, 3e-8]), variance([1e-8, 3e-8]), variance(None)
        (3e-08, 2e-08, None)
    """
    return statistics.median(variances) if variances else None


def far(mean: float, variance: float | None, threshold: float, steps: float = 1) -> bool:
    """Whether the mean of ``steps`` per-step estimates of a cost lies :data:`COST_Z` standard
    errors from ``threshold`` (``variance``: per step; None: unknown, not far): the window's
    decision was not a matter of chance.

    Example:
        >>> far(0.0, 1e-8, 1e-3), far(9e-4, 1e-8, 1e-3), far(9e-4, 1e-8, 1e-3, steps=10), far(0.0, None, 1e-3)
        (True, False, True, False)
    """
    return (variance is not None and steps > 0 and math.isfinite(mean) and
            COST_Z * COST_Z * variance <= steps * (mean - threshold) * (mean - threshold))


def pool(windows: list[list[float]]) -> tuple[float, float | None, float]:
    """``(mean, variance, steps)`` of the per-step estimates of measured ``windows`` (each
    ``[steps, mean, mean_square]``), taken together: the variance per step about the pooled mean
    (None under 2 steps), so a cost that moved between the windows reads noisier.

    Example:
        >>> pool([[10, 1.0, 1.0], [10, 3.0, 9.0]])  # two steady windows, far apart
        (2.0, 1.0526315789473684, 20)
    """
    steps = sum(w[0] for w in windows)
    if steps <= 0:
        return -math.inf, None, 0
    mean = sum(w[0] * w[1] for w in windows) / steps
    square = sum(w[0] * w[2] for w in windows) / steps
    return mean, (max(0.0, square - mean * mean) * steps / (steps - 1) if steps >= 2 else None), steps


def pooled_with(windows: list[list[float]], window: list[float]) -> list[list[float]]:
    """``windows`` and the newly measured ``window`` (``[steps, mean, mean_square]``): the last
    :data:`POOL_WINDOWS` of them (costs move over a run).

    Example:
        >>> len(pooled_with([[1, 0.0, 0.0]] * POOL_WINDOWS, [1, 1.0, 1.0])), pooled_with([], [1, 1.0, 1.0])
        (16, [[1, 1.0, 1.0]])
    """
    return [*windows, window][-POOL_WINDOWS:]


def clear(mean: float, variance: float | None, steps: float, threshold: float, windows: list[list[float]]) -> bool:
    """Whether a measured window's cost (its ``steps`` estimates' ``mean``, per-step ``variance``)
    lies clear of ``threshold``: its cadence may skip windows (:class:`Cadence`). Either the
    window alone lies :func:`far` from it, or the last measured ``windows`` do
    (:func:`clear_pooled`, this one among them).

    Example:
        >>> noisy = [10, 9e-4, 9e-4 ** 2 + 1e-6]  # one window: 3 standard errors span 9.5e-4
        >>> clear(9e-4, 1.1e-6, 10, 5e-4, [noisy]), clear(9e-4, 1.1e-6, 10, 5e-4, [noisy] * 12)
        (False, True)
    """
    return far(mean, variance, threshold, steps) or clear_pooled(mean, threshold, windows)


def clear_pooled(mean: float, threshold: float, windows: list[list[float]]) -> bool:
    """Whether the measured ``windows`` (:func:`pool`: at least :data:`POOL_LEAST` estimates)
    lie :func:`far` from ``threshold`` on the side the last window's ``mean`` lies (the figure
    that then stands for the windows a cadence skips decides as they would).

    Example:
        >>> steps = [[1, c, c * c] for c in (2e-5, 4e-5, 3e-5, 5e-5, 1e-5, 3e-5)]  # one estimate a window
        >>> clear_pooled(3e-5, 1e-4, steps), clear_pooled(3e-5, 1e-4, steps[:5]), clear_pooled(2e-4, 1e-4, steps)
        (True, False, False)
    """
    pooled, spread, n = pool(windows)
    return n >= POOL_LEAST and (pooled > threshold) == (mean > threshold) and far(pooled, spread, threshold, n)


def load_pool(saved: Any, rows: int = 2) -> list[list[list[float]]]:
    """Pools as a Controller's ``state_dict`` saved them (``rows`` of them: per cost, the measured
    windows' ``[steps, mean, mean square]``), checked: ValueError where they are not."""
    try:
        pools = [[[float(v) for v in w] for w in p] for p in saved]
    except (TypeError, ValueError):
        pools = None
    if pools is None or len(pools) != rows or any(len(w) != 3 or w[0] < 0 for p in pools for w in p):
        raise ValueError(f"Controller.load_state_dict: a loss-cost pool must be {rows} lists of [steps, mean, "
                         f"mean square] windows (steps >= 0), got {saved!r}")
    return pools


class Cadence:
    """In which windows a cost is measured: every window at first and after a switch; each
    measured window whose figure lies far from its threshold (``clear``) doubles the period
    (at most :data:`MAX_PERIOD` windows), one near it brings it back to every window. Between
    two measured windows the last measured figure stands for the decisions. Plain data
    (:meth:`state`: ``[period, wait, last]``); the same all-reduced figures give every rank the
    same cadence.

    Example:
        >>> c = Cadence()
        >>> [c.checked([0.0], True, True), c.due, c.checked([], False, False), c.due]
        [[0.0], False, [0.0], True]
    """

    def __init__(self) -> None:
        self.period, self.wait, self.last = 1, 0, None

    @property
    def due(self) -> bool:
        """Whether the window under way is measured."""
        return self.wait == 0

    def checked(self, figures: Any, measured: bool, clear: bool) -> Any:
        """A check read a window (``figures``: what it measured, when ``measured``): the
        figures its decisions read (the last measured ones in a window the cadence skipped)."""
        if measured:
            self.last, self.period = figures, (min(MAX_PERIOD, 2 * self.period) if clear else 1)
            self.wait = self.period - 1
            return figures
        if self.wait == 0:  # (a due window without a measurement, a layer that did not run: no evidence)
            return figures
        self.wait -= 1
        return self.last

    def reset(self) -> None:
        self.period, self.wait, self.last = 1, 0, None

    def state(self) -> list:
        return [self.period, self.wait, self.last]

    def load(self, state: Any) -> None:
        period, wait, last = state
        self.period, self.wait, self.last = int(period), int(wait), None if last is None else list(last)
