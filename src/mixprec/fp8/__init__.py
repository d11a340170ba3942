"""FP8 training with guardrails: emulated on any machine, bitwise equal to torchao's emulation.

* :class:`Float8Recipe`: per GEMM operand, the fp8 format and the scale granularity
  (``.tensorwise()``, ``.rowwise()``, ``.rowwise_with_gw_hp()``, the block-scaled ``.mxfp8()`` and
  ``.blockwise()``, ``.from_name(...)``).
* :func:`linear`: the functional fp8 linear (differentiable; tensorwise saves its activations for
  backward in fp8). ``backend="emulate"`` everywhere (bitwise torchao's emulation),
  ``"emulate_fp32"`` (every GEMM in float32, as a tensor core accumulates: fast fp4/MX emulation
  on CPUs without bf16 GEMMs), ``"emulate_tc"`` (accumulated as an fp8 tensor core: about 14 bits,
  promoted every 128 elements of K), ``"scaled_mm"`` on CUDA (tensorwise/rowwise sm89+, blockwise
  sm90, MXFP8/MXFP4/NVFP4 sm100).
* :class:`LayerState` / :func:`layer_state`: per-layer statistics kept on the device. The fp4
  call count that seeds a layer's stochastic rounding is in its module's ``state_dict()``;
  :func:`keep_rounding_state` lets a fresh policy-route model load it before its first forward;
  :func:`rounding_steps` / :func:`load_rounding_steps`: the same counts as plain data.
* :class:`Guard`: thresholds that move a layer back to the compute dtype, the same on every rank,
  decided in ``guard.step()`` (once per optimizer step), resumable from its ``state_dict()``.
* :class:`GuardSettings`, :class:`ControllerSettings`: their settings as frozen values (what a
  policy's fp8 rule holds; ``Guard(settings)``, ``guard.settings``).
* :func:`convert`, :func:`unconvert`, :class:`Float8Linear`, :class:`Float8Conv1D`, :func:`stats`:
  module conversion (``nn.Linear`` and transformers' ``Conv1D``), its undoing, the stats table.
* :func:`eligible`, :func:`select_layers`: the layer-selection rules.
* :func:`grouped_linear`, :class:`GroupedExperts`: a mixture of experts' experts in fp8 and fp4, one
  grouped GEMM per GEMM, each expert with its own scales and statistics, a layer of its own for
  ``fp8.stats``, a Guard and (policy route) a Controller; ``fp8.convert`` and ``Policy.fp8`` reach them.
* ``convert(..., fsdp_fp8_all_gather=True)``, :func:`precompute_fsdp_scales`: FSDP2 all-gathers
  the weights in fp8 (tensorwise), bitwise torchao's ``enable_fsdp_float8_all_gather``.
* :class:`Controller` (also ``mixprec.Controller``): moves each layer up a ladder of formats
  before its statistics' trend crosses a limit and back down when the lower format is safe again
  (``ctl.attach(model)``, ``Policy.fp8(controller=ctl.settings)``, ``ctl.step()``); see docs/controller.md.
* ``mixprec.fp8.internals``: what mixprec's other packages (diagnostics, export) use of fp8's
  private modules, in one place (not public API).

Example:
    >>> import torch
    >>> from mixprec import fp8
    >>> model = fp8.convert(torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(4)]))
    >>> guard = fp8.Guard(every=10)
    >>> loss = model(torch.randn(8, 32)).square().mean(); loss.backward()
    >>> guard.step(model)
    []

Interface for ``Policy.fp8`` (no module swap)
---------------------------------------------
``Policy.fp8(recipe="tensorwise", types=(nn.Linear,), names=None, first_last="keep")`` selects
layers with ``select_layers(model, types, names, first_last) -> list[fqn]`` (the same function
:func:`convert` uses by default; it warns once per layer left out by :func:`eligible`, whose
``(ok, reason)`` is the dims-multiple-of-16 rule) and, inside a mixprec region, routes each
selected ``nn.Linear`` call (transformers ``Conv1D``: its ``addmm``, with ``weight.t()``) to::

    fp8.linear(x, module.weight, module.bias, recipe, state=fp8.layer_state(module))

``recipe`` may come from ``fp8.as_recipe("tensorwise")``. ``linear`` switches autocast off
inside, computes in ``x``'s dtype (cast ``x`` to the compute dtype first, as autocast does for
``F.linear``), and, when the module's ``LayerState.fallback`` is set, runs ``F.linear`` in that
dtype instead. ``layer_state(module)`` keeps the state as a plain module attribute (not a
buffer: state dict keys do not change, ``deepcopy`` follows it); create it before
``torch.compile`` traces (selection time). ``layer_states(model)`` collects ``{fqn: state}``
for ``Guard.step(states_or_model)``; the policy's guard tracks the selected layers at each
outermost call and decides only in ``step()``. Its step count, decisions and open windows survive
checkpoints through ``Guard.state_dict()``/``load_state_dict()`` (keyed by fqn), not through the
module state dict.
"""

from mixprec.control._controller import Controller, Decision
from mixprec.control._convert import Float8Stats, convert, stats, unconvert
from mixprec.formats._fsdp import precompute_fsdp_scales
from mixprec.formats._grouped import GroupedExperts, grouped_linear
from mixprec.control._guard import Fallback, Float8FallbackWarning, Guard, layer_states
from mixprec.control._settings import ControllerSettings, GuardSettings
from mixprec.formats._layers import Float8Conv1D, Float8Linear, as_recipe, eligible, select_layers
from mixprec.formats._linear import linear
from mixprec.formats._recipe import Cast, Float8Recipe, Recipe
from mixprec.formats._state import ROUNDING_KEY, LayerState, keep_rounding_state, layer_state, load_rounding_steps, rounding_steps
from mixprec.formats._tensor_parallel import colwise_sequence_parallel

__all__ = [
    "Cast", "Controller", "ControllerSettings", "Decision", "Fallback", "Float8Conv1D", "Float8FallbackWarning", "Float8Linear", "Float8Recipe", "Float8Stats",
    "Guard", "GuardSettings", "GroupedExperts", "LayerState", "Recipe", "as_recipe", "colwise_sequence_parallel", "convert", "eligible", "grouped_linear", "layer_state", "layer_states", "linear",
    "ROUNDING_KEY", "keep_rounding_state", "load_rounding_steps", "precompute_fsdp_scales", "rounding_steps", "select_layers", "stats", "unconvert",
]
