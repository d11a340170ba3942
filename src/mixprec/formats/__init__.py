"""Low-bit formats and their GEMMs: the room that knows numbers, not decisions.

Recipes and casts (``_recipe``), block scales and the MX/blockwise GEMMs (``_blocks``), fp8
casts and their statistics (``_quant``), fp4 values, rounding and the Hadamard transform
(``_fp4``), a layer's statistics window and routing state (``_state``), the linear autograd
functions (``_linear``, ``_fp4_linear``), FSDP2's fp8 all-gather (``_fsdp``), Linear-like layers
and their selection (``_like``, ``_layers``). Nothing here imports precision control, the policy
or the engine (``tests/test_layering.py``).

Not public API: users reach all of it through :mod:`mixprec.fp8`.
"""
