"""FP8 (placeholder docstring, replaced below)."""
from mixprec.fp8._linear import linear
from mixprec.fp8._recipe import Cast, Float8Recipe
from mixprec.fp8._state import LayerState, layer_state
