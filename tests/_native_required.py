"""Where mixprec's C++ kernels could not be built: a skip on a developer's machine (no compiler,
the Python kernels serve), a failure in CI, with the build log's tail.

CI is ``MIXPREC_REQUIRE_NATIVE=1`` (``.ci/run`` sets it) or, where that is unset, ``CI=true``
(what hosted CI services set); ``MIXPREC_REQUIRE_NATIVE=0`` allows a CI runner without a
compiler. ``MIXPREC_NATIVE_KERNELS=0`` turns the kernels off on purpose: a skip everywhere.
``scripts/test.sh`` reads the same two variables the same way.
"""

from __future__ import annotations

import os
from typing import NoReturn

import pytest

from mixprec import _native

def required() -> bool:
    """Whether this run must have the C++ kernels (CI)."""
    flag = os.environ.get("MIXPREC_REQUIRE_NATIVE") or os.environ.get("CI", "")
    return flag.lower() in ("1", "true")


def build_log_tail(lines: int = 30) -> str:
    """The last ``lines`` lines of this environment's ``build.log`` and its remembered failure,
    or a line saying there is neither."""
    directory = _native.build_directory()
    parts = []
    for name in ("failed.json", "build.log"):
        path = directory / name
        if path.is_file():
            text = path.read_text(errors="replace").splitlines()
            parts.append(f"--- {path} (last {min(lines, len(text))} of {len(text)} lines)\n" + "\n".join(text[-lines:]))
    return "\n".join(parts) or f"(no build.log or failed.json in {directory})"


def kernels_missing(why: str) -> NoReturn:
    """Skip the test for want of the C++ kernels, or fail it where they are required (CI)."""
    if not _native.enabled():
        pytest.skip("MIXPREC_NATIVE_KERNELS=0: the C++ kernels are off")
    if required():
        pytest.fail(f"{why}; the C++ kernels are required here (MIXPREC_REQUIRE_NATIVE=1 or CI=true):\n"
                    f"{build_log_tail()}", pytrace=False)
    pytest.skip(why)
