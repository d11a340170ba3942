"""The autocast engine: regions, the kernels at PyTorch's autocast keys, module calls.

Private; the public names are re-exported by :mod:`mixprec` (``autocast``, ``custom_fwd``,
``custom_bwd``, ``checkpoint_context_fn``, ``release_kernels``, ...). Layers, each importing
only those above it in this list:

- :mod:`~mixprec.engine.dynamo`: what the engine asks of Dynamo (decorators, the trace in progress);
- :mod:`~mixprec.engine.runtime`: the one per-thread state object and ``enter()``/``leave()``;
- :mod:`~mixprec.engine.watch`: a region's first pass over its module rules (unmatched rules warn);
- :mod:`~mixprec.engine.casts`: the cast kinds and their runners (fp8 through
  ``mixprec.fp8.internals.Fp8Target``);
- :mod:`~mixprec.engine.kernels`: registering and releasing our kernels, fp8 routing, the guard
  on the active policy;
- :mod:`~mixprec.engine.compile`: a region traced inside ``torch.compile`` (``mixprec::region``);
- :mod:`~mixprec.engine.module_decision`: the one decision for a module call (name, keep rule,
  fp8 layer), shared by the eager and traced hooks;
- :mod:`~mixprec.engine.module_calls`: the module hooks, eager and traced;
- :mod:`~mixprec.engine.region`: ``mixprec.autocast``, ``custom_fwd``/``custom_bwd``, checkpoints.
"""
