"""Marks every test of tests/adversarial ``adversarial``; the profiles are in ``_adv_profile``."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.nodeid.startswith("tests/adversarial/") or "/adversarial/" in item.nodeid:
            item.add_marker(pytest.mark.adversarial)
