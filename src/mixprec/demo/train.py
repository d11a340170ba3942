"""Train the demo language model in every precision mode, side by side, from the same seed.

Every mode starts from the same initial weights (``torch.manual_seed(seed)`` before the model is
built) and sees the same batches in the same order, so their loss curves differ only by numerics.
The modes (see :data:`MODES`):

- ``fp32``: float32 weights and compute, ``torch.optim.AdamW``.
- ``torch-amp``: ``torch.autocast`` (float16) + ``torch.amp.GradScaler``: the reference.
- ``mixprec-fp16``: ``mixprec.autocast`` (float16) + ``mixprec.GradScaler``.
- ``mixprec-bf16``: ``mixprec.autocast`` (bfloat16), no scaler.
- ``bf16-naive``: bfloat16 weights (``mixprec.to_low_precision``), plain ``torch.optim.AdamW``.
- ``bf16-kahan``: the same weights, ``mixprec.optim.AdamW(compensation="kahan")``.
- ``bf16-stochastic``: the same weights, ``mixprec.optim.AdamW(compensation="stochastic")``.
- ``fp16-master``: float16 weights, float32 master copies (``mixprec.MasterWeights``) +
  ``mixprec.GradScaler``.
- ``torch-amp-bf16`` (not run by default): ``torch.autocast`` (bfloat16), the reference of
  ``mixprec-bf16`` in ``benchmarks/gpu.py``.

A mode whose mixprec API is missing is refused before anything trains (:func:`check_modes`).

Example:
    >>> settings = Settings.for_size("tiny", steps=5)
    >>> result = run_mode("fp32", settings, torch.device("cpu"))
    >>> len(result.losses)
    5
"""

from __future__ import annotations

import contextlib
import math
import numbers
import platform
import re
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, ContextManager, Iterator, Protocol

import torch
from torch import nn

import mixprec
from mixprec.demo.corpus import batch_offsets, load_tokens, make_batch
from mixprec.demo.model import SIZES, ModelConfig, TransformerLM, lm_loss
from mixprec.lowp import memory_bytes

__all__ = [
    "MODES",
    "DEFAULT_MODES",
    "MAX_SEED",
    "Mode",
    "Settings",
    "ModeResult",
    "DemoResult",
    "Progress",
    "check_modes",
    "run_mode",
    "run_demo",
    "lowp_speed",
    "cpu_lowp_support",
    "environment",
]


# --------------------------------------------------------------------------------------------
# settings


@dataclass(frozen=True)
class Settings:
    """What to train and how long.

    Attributes:
        model: the model's shape.
        steps: optimizer steps per mode (>= 1).
        batch_size: sequences per batch.
        lr: peak learning rate (linear warm-up over the first 10% of steps, then cosine to 10%).
        seed: seeds the weights, the batches and the evaluation windows (``0 <= seed < 2**63``).
        eval_batches: validation batches for the final evaluation loss.
        size: the name of the size preset these settings came from ("custom" otherwise).
        untimed_steps: first steps left out of the throughput (warm-up: allocations, kernel
            selection, lazily created optimizer state); all steps are timed when there are no
            more than this many.
        fused: use ``torch.optim.AdamW(fused=True)`` (one kernel per step; the loss scalers then
            unscale and skip inside it) wherever the mode's optimizer is torch's AdamW.
    """

    model: ModelConfig
    steps: int
    batch_size: int
    lr: float
    seed: int = 0
    eval_batches: int = 4
    size: str = "custom"
    untimed_steps: int = 1
    fused: bool = False

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if self.eval_batches < 1:
            raise ValueError(f"eval_batches must be >= 1, got {self.eval_batches}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, numbers.Integral) or not 0 <= self.seed < MAX_SEED:
            raise ValueError(f"seed must be an integer in [0, 2**63), got {self.seed!r}")
        object.__setattr__(self, "seed", int(self.seed))  # e.g. numpy.int64 -> int, for torch
        if self.untimed_steps < 0:
            raise ValueError(f"untimed_steps must be >= 0, got {self.untimed_steps}")

    @classmethod
    def for_size(cls, size: str, *, steps: int | None = None, seed: int = 0) -> Settings:
        """The preset for ``size`` ("tiny", "small" or "base"), optionally with other steps/seed.

        Raises:
            ValueError: for an unknown size.
        """
        if size not in SIZES:
            raise ValueError(f"unknown size {size!r}; choose one of {', '.join(SIZES)}")
        default_steps, batch_size, lr = _TRAIN_PRESETS[size]
        return cls(
            model=SIZES[size],
            steps=default_steps if steps is None else steps,
            batch_size=batch_size,
            lr=lr,
            seed=seed,
            size=size,
        )

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.model.seq_len

    @property
    def timed_steps(self) -> range:
        """The steps whose time makes the throughput: all but the first ``untimed_steps``, or
        every step when that would leave none."""
        return range(self.untimed_steps if self.steps > self.untimed_steps else 0, self.steps)


#: Seeds are integers in ``[0, MAX_SEED)`` (torch takes 64-bit seeds; evaluation uses ``seed + 1``).
MAX_SEED = 2**63


# size -> (steps, batch_size, lr); "tiny" runs all eight modes in about 2 minutes on 2 CPU cores
_TRAIN_PRESETS: dict[str, tuple[int, int, float]] = {
    "tiny": (120, 8, 3e-3),
    "small": (300, 16, 2e-3),
    "base": (600, 32, 1e-3),
}


def _lr_factor(step: int, steps: int) -> float:
    warmup = max(1, steps // 10)
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return 0.1 + 0.45 * (1.0 + math.cos(math.pi * progress))


# --------------------------------------------------------------------------------------------
# modes


class _Scaler(Protocol):
    def scale(self, outputs: torch.Tensor) -> torch.Tensor: ...
    def step(self, optimizer: Any) -> Any: ...
    def update(self) -> None: ...


@dataclass
class _Setup:
    """One mode, ready to train: what a step calls, and how to read its loss scale."""

    model: nn.Module
    optimizer: torch.optim.Optimizer  # what zero_grad()/step() are called on
    autocast: Callable[[], ContextManager[Any]] = contextlib.nullcontext
    scaler: _Scaler | None = None
    # after scaler.update(): (current scale, whether the step was skipped), both device tensors
    scale_state: Callable[[], tuple[torch.Tensor, torch.Tensor]] | None = None


@dataclass(frozen=True)
class Mode:
    """A precision mode of the demo.

    Attributes:
        name: the name used by ``--modes``.
        summary: one line for the report.
        requires: mixprec attributes the mode needs, as dotted paths under ``mixprec``.
        setup: builds the mode's optimizer/scaler/autocast around a freshly built float32 model.
    """

    name: str
    summary: str
    requires: tuple[str, ...]
    setup: Callable[[nn.Module, Settings, torch.device], _Setup] = field(repr=False)


# Every scaler of the demo starts at torch's default scale but grows after 20 clean steps
# instead of 2000, so that a run of a hundred steps shows the scale growing and backing off.
_INIT_SCALE = 2.0**16
_GROWTH_INTERVAL = 20


def _adamw(params: Any, s: Settings) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=s.lr, betas=(0.9, 0.95), weight_decay=0.01, fused=s.fused)


def _torch_scale_state(scaler: torch.amp.GradScaler) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
    # torch's scaler has no hysteresis: a step was skipped exactly when update() lowered the scale.
    previous: list[torch.Tensor] = []

    def state() -> tuple[torch.Tensor, torch.Tensor]:
        scale = scaler._get_scale_async().detach().clone()  # device tensor: no host sync
        before = previous[0] if previous else torch.full_like(scale, _INIT_SCALE)
        previous[:] = [scale]
        return scale, scale < before

    return state


def _mixprec_scale_state(scaler: Any) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
    def state() -> tuple[torch.Tensor, torch.Tensor]:
        return scaler.state.scale.detach().clone(), scaler.last_step_skipped.detach().clone()

    return state


def _setup_fp32(model: nn.Module, s: Settings, device: torch.device) -> _Setup:
    opt = _adamw(model.parameters(), s)
    return _Setup(model, opt)


def _setup_torch_amp(dtype: torch.dtype) -> Callable[[nn.Module, Settings, torch.device], _Setup]:
    def setup(model: nn.Module, s: Settings, device: torch.device) -> _Setup:
        opt = _adamw(model.parameters(), s)
        autocast = lambda: torch.autocast(device.type, dtype=dtype)  # noqa: E731
        if dtype != torch.float16:
            return _Setup(model, opt, autocast)
        scaler = torch.amp.GradScaler(device.type, init_scale=_INIT_SCALE, growth_interval=_GROWTH_INTERVAL)
        return _Setup(model, opt, autocast, scaler, _torch_scale_state(scaler))

    return setup


def _setup_mixprec_amp(dtype: torch.dtype) -> Callable[[nn.Module, Settings, torch.device], _Setup]:
    def setup(model: nn.Module, s: Settings, device: torch.device) -> _Setup:
        opt = _adamw(model.parameters(), s)
        autocast = lambda: mixprec.autocast(device.type, dtype=dtype)  # noqa: E731
        if dtype != torch.float16:
            return _Setup(model, opt, autocast)
        scaler = mixprec.GradScaler(device.type, init_scale=_INIT_SCALE, growth_interval=_GROWTH_INTERVAL)
        return _Setup(model, opt, autocast, scaler, _mixprec_scale_state(scaler))

    return setup


def _setup_bf16(compensation: str | None) -> Callable[[nn.Module, Settings, torch.device], _Setup]:
    def setup(model: nn.Module, s: Settings, device: torch.device) -> _Setup:
        mixprec.to_low_precision(model, torch.bfloat16)
        if compensation is None:
            opt = _adamw(model.parameters(), s)
        else:
            opt = mixprec.optim.AdamW(
                model.parameters(), lr=s.lr, betas=(0.9, 0.95), weight_decay=0.01,
                compensation=compensation,
            )
        return _Setup(model, opt)

    return setup


def _setup_fp16_master(model: nn.Module, s: Settings, device: torch.device) -> _Setup:
    mixprec.to_low_precision(model, torch.float16)
    opt = _adamw(model.parameters(), s)
    scaler = mixprec.GradScaler(device.type, init_scale=_INIT_SCALE, growth_interval=_GROWTH_INTERVAL)
    return _Setup(
        model, mixprec.MasterWeights(opt), scaler=scaler, scale_state=_mixprec_scale_state(scaler)
    )


_ALL_MODES = (
    Mode("fp32", "float32 weights and compute", (), _setup_fp32),
    Mode("torch-amp", "torch.autocast fp16 + torch.amp.GradScaler (reference)", (),
         _setup_torch_amp(torch.float16)),
    Mode("mixprec-fp16", "mixprec.autocast fp16 + mixprec.GradScaler",
         ("autocast", "GradScaler"), _setup_mixprec_amp(torch.float16)),
    Mode("mixprec-bf16", "mixprec.autocast bf16", ("autocast",), _setup_mixprec_amp(torch.bfloat16)),
    Mode("bf16-naive", "bf16 weights, plain torch AdamW", ("to_low_precision",), _setup_bf16(None)),
    Mode("bf16-kahan", "bf16 weights, mixprec AdamW with Kahan summation",
         ("to_low_precision", "optim.AdamW"), _setup_bf16("kahan")),
    Mode("bf16-stochastic", "bf16 weights, mixprec AdamW with stochastic rounding",
         ("to_low_precision", "optim.AdamW"), _setup_bf16("stochastic")),
    Mode("fp16-master", "fp16 weights + fp32 MasterWeights + mixprec.GradScaler",
         ("to_low_precision", "MasterWeights", "GradScaler"), _setup_fp16_master),
    Mode("torch-amp-bf16", "torch.autocast bf16 (reference of mixprec-bf16)", (),
         _setup_torch_amp(torch.bfloat16)),
)

#: Every mode by name.
MODES: dict[str, Mode] = {m.name: m for m in _ALL_MODES}
#: The modes ``mixprec demo`` runs when ``--modes`` is not given.
DEFAULT_MODES: tuple[str, ...] = tuple(m.name for m in _ALL_MODES if m.name != "torch-amp-bf16")


def _missing(path: str) -> str | None:
    obj: Any = mixprec
    for part in path.split("."):
        try:
            obj = getattr(obj, part)
        except (AttributeError, ImportError) as e:
            return f"mixprec.{path} ({type(e).__name__}: {e})"
    return None


def check_modes(names: tuple[str, ...] | list[str]) -> None:
    """Check that every mode exists and that the mixprec APIs it needs import.

    Raises:
        ValueError: for an unknown or repeated mode name, or an empty list.
        RuntimeError: naming each mode whose mixprec API is missing.
    """
    if not names:
        raise ValueError(f"no modes given; choose from {', '.join(MODES)}")
    unknown = [n for n in names if n not in MODES]
    if unknown:
        raise ValueError(f"unknown mode(s) {', '.join(unknown)}; choose from {', '.join(MODES)}")
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"mode(s) given more than once: {', '.join(repeated)}; give each mode once")
    problems = [
        f"{n} needs {miss}" for n in names for req in MODES[n].requires if (miss := _missing(req))
    ]
    if problems:
        raise RuntimeError("cannot run: " + "; ".join(problems))


# --------------------------------------------------------------------------------------------
# measuring


@contextlib.contextmanager
def _saved_tensor_bytes(exclude: set[int]) -> Iterator[dict[int, int]]:
    """Collect ``{storage pointer: bytes}`` of every tensor autograd saves for backward."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in exclude:
            seen.setdefault(ptr, storage.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield seen


def lowp_speed(device: torch.device, n: int = 256, rounds: int = 7) -> dict[str, float]:
    """Time of an ``n x n`` matmul in float16 and bfloat16 relative to float32 on ``device``.

    The dtypes are timed in turn, ``rounds`` times after a warm-up, and each keeps its fastest
    time (so that other load on the machine hurts them alike). A ratio well above 1 means the
    device has no native kernels for that dtype (on most CPUs float16 and bfloat16 matmuls are
    emulated). Synchronises the device.
    """
    a = torch.randn(n, n, device=device)
    xs = {dtype: a.to(dtype) for dtype in (torch.float32, torch.float16, torch.bfloat16)}
    best = dict.fromkeys(xs, math.inf)
    for round_ in range(rounds + 1):
        for dtype, x in xs.items():
            _sync(device)
            start = time.perf_counter()
            x @ x
            _sync(device)
            if round_:  # round 0 warms up
                best[dtype] = min(best[dtype], time.perf_counter() - start)
    return {
        "float16": best[torch.float16] / best[torch.float32],
        "bfloat16": best[torch.bfloat16] / best[torch.float32],
    }


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --------------------------------------------------------------------------------------------
# results


@dataclass
class ModeResult:
    """What one mode measured. Memory is in bytes, throughput in tokens per second.

    ``scales`` and ``skipped_steps`` are empty for modes without a loss scaler; ``eval_loss`` is
    the validation loss after training, in the mode's own precision.
    """

    mode: str
    summary: str
    losses: list[float]
    eval_loss: float
    tokens_per_s: float
    memory: dict[str, int]
    activation_method: str
    scales: list[float] = field(default_factory=list)
    skipped_steps: list[int] = field(default_factory=list)
    wall_s: float = 0.0

    @property
    def final_loss(self) -> float:
        """Mean training loss over the last 10% of steps (at least one)."""
        tail = self.losses[-max(1, len(self.losses) // 10):]
        return sum(tail) / len(tail)

    @property
    def total_memory(self) -> int:
        return sum(self.memory.values())

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "final_loss": self.final_loss, "total_memory": self.total_memory}


@dataclass
class DemoResult:
    """A whole demo run: its settings, its environment, and one :class:`ModeResult` per mode."""

    settings: Settings
    device: str
    environment: dict[str, Any]
    modes: list[ModeResult]

    def to_json(self) -> dict[str, Any]:
        return {
            "settings": asdict(self.settings),
            "device": self.device,
            "environment": self.environment,
            "modes": [m.to_json() for m in self.modes],
        }


class Progress(Protocol):
    """Receives progress while a mode trains (see :mod:`mixprec.demo.progress`)."""

    def start(self, mode: str, total: int) -> None: ...
    def update(self, step: int, loss: float, scale: float | None) -> None: ...
    def finish(self, result: ModeResult) -> None: ...


# --------------------------------------------------------------------------------------------
# training


def run_mode(
    name: str,
    settings: Settings,
    device: torch.device,
    progress: Progress | None = None,
    data: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> ModeResult:
    """Train a fresh model in mode ``name`` and measure it.

    Args:
        name: a key of :data:`MODES`.
        settings: the run's settings; ``settings.seed`` fixes weights and batches.
        device: where to train.
        progress: told about the run every few steps (each report reads the loss: a host sync).
        data: ``(train, validation)`` byte tokens; the packaged corpus when None.

    Raises:
        ValueError, RuntimeError: see :func:`check_modes`.

    Peak activations are the bytes of the tensors saved for backward during the first step
    (distinct storages, parameters excluded) on CPU, and the growth of
    ``torch.cuda.max_memory_allocated`` over the first forward pass on CUDA (which resets the
    device's peak memory statistics). Throughput leaves out the first ``settings.untimed_steps``
    steps (warm-up and the activation measurement; see :attr:`Settings.timed_steps`), with the
    device synchronised at both ends of the timed span.
    """
    check_modes([name])
    mode = MODES[name]
    train, val = load_tokens() if data is None else data
    cfg = settings.model
    offsets = batch_offsets(len(train), settings.steps, settings.batch_size, cfg.seq_len, settings.seed)
    torch.manual_seed(settings.seed)
    model = TransformerLM(cfg).to(device)
    setup = mode.setup(model, settings, device)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        setup.optimizer, lambda step: _lr_factor(step, settings.steps)
    )
    report_every = max(1, settings.steps // 30)
    if progress is not None:
        progress.start(name, settings.steps)

    losses: list[torch.Tensor] = []
    scale_trace: list[tuple[torch.Tensor, torch.Tensor]] = []
    activations = 0
    timed = settings.timed_steps
    _sync(device)
    wall_start = time.perf_counter()
    timed_from = wall_start
    for step in range(settings.steps):
        if step == timed.start and step:
            _sync(device)
            timed_from = time.perf_counter()
        x, y = make_batch(train, offsets[step], cfg.seq_len, device)
        setup.optimizer.zero_grad(set_to_none=True)
        measuring = step == 0
        if measuring and device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        param_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()} if measuring else set()
        hooks = _saved_tensor_bytes(param_ptrs) if measuring and device.type != "cuda" else contextlib.nullcontext({})
        with hooks as saved, setup.autocast():
            loss = lm_loss(model(x), y)
        if measuring:
            if device.type == "cuda":
                activations = torch.cuda.max_memory_allocated(device) - base
            else:
                activations = sum(saved.values())
        if setup.scaler is None:
            loss.backward()
            setup.optimizer.step()
        else:
            setup.scaler.scale(loss).backward()
            setup.scaler.step(setup.optimizer)
            setup.scaler.update()
        with warnings.catch_warnings():
            # a loss scaler that skips the first step never calls optimizer.step(): expected here
            warnings.filterwarnings("ignore", re.escape("Detected call of `lr_scheduler.step()`"), UserWarning)
            schedule.step()
        losses.append(loss.detach())
        if setup.scale_state is not None:
            scale_trace.append(setup.scale_state())
        if progress is not None and (step % report_every == 0 or step == settings.steps - 1):
            scale = scale_trace[-1][0].item() if scale_trace else None
            progress.update(step + 1, losses[-1].item(), scale)
    _sync(device)
    end = time.perf_counter()
    tokens_per_s = len(timed) * settings.tokens_per_step / max(end - timed_from, 1e-9)

    held = memory_bytes(model, setup.optimizer)
    memory = {key: held[key] for key in ("params", "grads", "master", "optimizer_state")}
    memory["activations"] = activations
    result = ModeResult(
        mode=name,
        summary=mode.summary,
        losses=torch.stack(losses).float().cpu().tolist(),
        eval_loss=_evaluate(model, setup, val, settings, device),
        tokens_per_s=tokens_per_s,
        memory=memory,
        activation_method="cuda peak over forward" if device.type == "cuda" else "saved for backward",
        wall_s=end - wall_start,
    )
    if scale_trace:
        scales, skipped = (torch.stack(t).cpu() for t in zip(*scale_trace))
        result.scales = scales.float().tolist()
        result.skipped_steps = torch.nonzero(skipped.bool()).flatten().tolist()
    if progress is not None:
        progress.finish(result)
    return result


@torch.no_grad()
def _evaluate(
    model: nn.Module, setup: _Setup, val: torch.Tensor, settings: Settings, device: torch.device
) -> float:
    seq = settings.model.seq_len
    offsets = batch_offsets(len(val), settings.eval_batches, settings.batch_size, seq, settings.seed + 1)
    total = torch.zeros((), device=device)
    for row in offsets:
        x, y = make_batch(val, row, seq, device)
        with setup.autocast():
            total += lm_loss(model(x), y)
    return total.item() / settings.eval_batches


# CPU flags of native float16/bfloat16 matmul units (x86; /proc/cpuinfo)
_NATIVE_FLAGS = {"float16": ("avx512_fp16", "amx_fp16"), "bfloat16": ("avx512_bf16", "amx_bf16")}


def cpu_lowp_support() -> dict[str, dict[str, Any]]:
    """Whether this CPU has native float16/bfloat16 matmul units, and how slow those matmuls are.

    Returns ``{"float16": {"native": ..., "slowdown": ...}, "bfloat16": {...}}``: ``native`` from
    the CPU flags in ``/proc/cpuinfo`` (``None`` where they cannot be read), ``slowdown`` the
    matmul time relative to float32 from :func:`lowp_speed` (noisy on a busy machine).
    """
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags: set[str] | None = {
                flag for line in f if line.startswith("flags") for flag in line.split(":", 1)[1].split()
            }
    except OSError:
        flags = None
    slowdown = lowp_speed(torch.device("cpu"))
    return {
        dtype: {
            "native": None if not flags else any(flag in flags for flag in names),
            "slowdown": slowdown[dtype],
        }
        for dtype, names in _NATIVE_FLAGS.items()
    }


def environment(device: torch.device) -> dict[str, Any]:
    """Versions and hardware of this run; on CPU, :func:`cpu_lowp_support` too."""
    env: dict[str, Any] = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "threads": torch.get_num_threads(),
    }
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    else:
        env["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
        env["cpu_lowp"] = cpu_lowp_support()
    return env


def run_demo(
    settings: Settings,
    modes: tuple[str, ...] | list[str] = DEFAULT_MODES,
    device: torch.device | str = "cpu",
    progress: Progress | None = None,
) -> DemoResult:
    """Train every mode in ``modes`` in turn with the same settings; see :func:`run_mode`.

    Raises:
        ValueError, RuntimeError: see :func:`check_modes` (checked before anything trains).
    """
    check_modes(list(modes))
    device = torch.device(device)
    data = load_tokens()
    env = environment(device)
    results = [run_mode(name, settings, device, progress, data) for name in modes]
    return DemoResult(settings=settings, device=str(device), environment=env, modes=results)
