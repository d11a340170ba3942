"""The examples in the docstrings of mixprec's pure layers and value packages (``control``,
``formats``, ``fp8``, ``policy``, ``lowp``, ``ops``, ``optim``) run and print what they say: each
module's doctests (``doctest``, as ``python -m doctest``).

Other packages' examples are mostly fragments of a training loop (they take the reader's model
and optimizer: ``scaling``, ``engine``); these are values and rules on small tensors, so an
example there that no longer holds is a wrong statement about the code."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

PACKAGES = ("mixprec.control", "mixprec.formats", "mixprec.fp8", "mixprec.policy", "mixprec.lowp", "mixprec.ops",
            "mixprec.optim")


def _modules() -> list[str]:
    out = []
    for package in PACKAGES:
        pkg = importlib.import_module(package)
        out += [package] + [f"{package}.{m.name}" for m in pkgutil.iter_modules(pkg.__path__)]
    return out


@pytest.mark.parametrize("name", _modules())
def test_docstring_examples(name: str) -> None:
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, verbose=False,
                             report=False)
    assert result.failed == 0, f"{name}: {result.failed} of {result.attempted} docstring examples failed (run " \
                               f"python -m pytest --doctest-modules on {module.__file__} to see which)"


def test_the_runner_finds_examples() -> None:
    from mixprec.control import _backward

    assert "mixprec.control._backward" in _modules()
    assert doctest.testmod(_backward, report=False).attempted >= 5
