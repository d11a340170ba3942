"""The precision policy as a value: :class:`Policy`, its one-line text form (``_text``), its
checked JSON codec (``_codec``) and its low-bit rule (``_rule``, :class:`Fp8Rule`).

Importing it loads no Guard or Controller: a policy holds their settings, never the objects.

Example:
    >>> from mixprec.policy import Policy
    >>> str(Policy.parse("compute=bfloat16"))
    'params=float32,compute=bfloat16'
"""

from mixprec.policy._rule import Fp8Rule
from mixprec.policy._value import PRESETS, Policy, _rebuild, canonical, parse_dtype  # noqa: F401 (_rebuild: named by
# policies pickled before the split, as mixprec.policy._rebuild)

__all__ = ["Fp8Rule", "PRESETS", "Policy", "canonical", "parse_dtype"]
