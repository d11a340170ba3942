"""Per-layer gradient scaling: ``mixprec.GradScaler(device, per_layer=True).watch(model)``.

One loss scale cannot serve a network whose gradients span more binades than float16 holds (about
40 with subnormals): the scale that keeps the bottom layers from flushing to zero overflows the
top. Here the gradient is multiplied again, by a power of two ``s_k``, each time it crosses a
*cut point* on its way down: the output of a block, where every path from the loss has already
been summed (the residual stream between transformer blocks). A parameter below the cut points
``K`` carries ``S = loss scale * prod(s_k for k in K)``, and ``unscale_`` divides its gradient by
its own ``S``; all factors are powers of two, so scaling and unscaling are exact.

One module per idea:

* ``graph.py``: where to cut and what the graph says, :func:`choose_cut_points` and :func:`walk`;
* ``rule.py``: the rule, pure, as device functions and their bit-for-bit host twin;
* ``scaler.py`` and ``planning.py``: :class:`Layerwise`, the stateful unscaling strategy a
  ``GradScaler(per_layer=True)`` holds (:mod:`mixprec.scaling.unscaling`), its device state and
  update in the first, what the graph walks learnt and each backward's plan in the second;
* ``stages.py``: across ``torch.distributed.pipelining`` stages, ``scaler.watch(stage)``: every
  stage holds every cut point's state and hooks its own, and the stages agree in ``update``;
* ``mixprec.scaling._structure``: the learnt structure as a checkpoint stores it (outside the
  package: scalers pickled by earlier versions name it there).

The pieces:

* :func:`choose_cut_points`: the outputs of the children of the model's largest
  ``nn.Sequential``/``nn.ModuleList`` of blocks, or the modules a user names.
* :func:`walk`: a walk of the autograd graph from the loss that labels every node with the
  region whose scale its gradient carries, and raises where a node would sum gradients carrying
  different scales (a skip connection around a cut point): residual connections inside a block
  are fine, a path around a block is an error; a shared (tied) parameter reached from several
  regions gets its contributions rescaled to the topmost one. The first walk fixes the canonical
  structure; a later step whose forward differs (a block skipped, an early exit) is walked again
  and planned so that every gradient still carries its canonical region's scale.
* :func:`clean_step`, :func:`overflow_step`, :func:`layer_rule`: the rule, pure functions of
  device tensors over the cut points' :func:`topology`; :func:`host_rule`: the same rule on host
  numbers, bit for bit, for a state in host memory (the CPU), where it replaces some fifty tiny
  tensor ops by two reads.
* :class:`Layerwise`: the stateful shell, the scaler's unscaling strategy: the hooks (a
  backward hook on each cut point's output tensor multiplies the gradient by ``s_k`` and records
  its amax on the device), the per-region unscale, and :meth:`Layerwise.update`, which applies
  the rule; no host syncs on an accelerator.

The rule (after each ``update()``; ``e_k = log2 s_k``, ``T_r`` the sum of the ``e_k`` above
region ``r``, region 0 the one above every cut point, which carries the loss scale alone):
region ``r``'s statistic ``a_r`` is the amax of the scaled gradients seen there in the step (its
parameters' gradients and the activation gradient at its cut point). On a clean step every region
moves so that ``floor(log2 a_r) = floor(log2 a_0) - m_r``: ``T_r += floor(log2 a_0) - floor(log2
a_r) - HEADROOM - m_r`` (``ZERO_JUMP`` more per zero-only region), then ``e_k = T_(k) - T_(parent of k)``
clamped into ``layer_bounds``. The global loss scale keeps its own rule (overflow probing, growth)
and so sets the headroom of every region. An overflow skips the step and backs off the loss scale
as always; the topmost cut point whose region overflowed also raises its margin ``m_k`` by one
binade (after ``hysteresis`` overflows), which comes back down after ``growth_interval`` clean
steps.
"""

from mixprec.scaling.layerwise.graph import Walk, choose_cut_points, walk
from mixprec.scaling.layerwise.planning import CutHook
from mixprec.scaling.layerwise.rule import (
    DEFAULT_BOUNDS,
    HEADROOM,
    TOTAL_BOUND,
    ZERO_JUMP,
    LayerState,
    Topology,
    clean_step,
    host_rule,
    layer_rule,
    overflow_step,
    pow2,
    topology,
)
from mixprec.scaling.layerwise.scaler import HISTORY_LEN, Layerwise

__all__ = [
    "DEFAULT_BOUNDS", "HEADROOM", "HISTORY_LEN", "TOTAL_BOUND", "ZERO_JUMP", "LayerState", "Layerwise", "Topology",
    "Walk", "choose_cut_points", "clean_step", "host_rule", "layer_rule", "overflow_step", "pow2", "topology", "walk",
]

#: The forward hook's name in models pickled (``torch.save``) by mixprec before this package was
#: split: unpickling looks it up here.
_CutHook = CutHook
