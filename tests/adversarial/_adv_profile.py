"""The adversarial harness's two profiles (docs/testing.md, "The adversarial harness").

* fast (default): a few derandomized hypothesis examples per test, no shrinking, so the default
  test command stays within a few minutes and is deterministic (the programs of known failures
  run as their own tests, ``test_item*``/``test_known_programs``);
* long: ``MIXPREC_ADVERSARIAL=long`` (optionally ``MIXPREC_ADVERSARIAL_EXAMPLES=n``, default
  200 per test): random seeds, many examples, shrinking, and hypothesis prints the shrunk
  failing program with the blob to reproduce it.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, Phase, settings

LONG = os.environ.get("MIXPREC_ADVERSARIAL", "fast") == "long"
if os.environ.get("MIXPREC_ADVERSARIAL", "fast") not in ("fast", "long"):
    raise ValueError("MIXPREC_ADVERSARIAL must be 'fast' (the default) or 'long'")


def profile(fast_examples: int) -> settings:
    """The hypothesis settings of one adversarial test: ``fast_examples`` derandomized examples
    without shrinking by default; the long profile's count, random and shrunk, with
    ``MIXPREC_ADVERSARIAL=long``."""
    common = dict(deadline=None, database=None, report_multiple_bugs=False,
                  suppress_health_check=list(HealthCheck))
    if LONG:
        return settings(max_examples=int(os.environ.get("MIXPREC_ADVERSARIAL_EXAMPLES", "200")),
                        derandomize=False, print_blob=True, **common)
    return settings(max_examples=fast_examples, derandomize=True,
                    phases=(Phase.explicit, Phase.generate), **common)

