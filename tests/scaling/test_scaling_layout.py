"""The layout of ``mixprec.scaling``: its modules are found, and the names ``mixprec.scaling.layerwise``
offered before it became a package still import from it (sizes and imports: ``tests/test_layering.py``)."""

from __future__ import annotations

from pathlib import Path

import mixprec.scaling
import mixprec.scaling.layerwise as layerwise

PACKAGE = Path(mixprec.scaling.__file__).resolve().parent
MODULES = sorted(PACKAGE.rglob("*.py"))


def test_the_package_is_found():
    names = {str(p.relative_to(PACKAGE)) for p in MODULES}
    assert {"grad_scaler.py", "unscaling.py", "layerwise/rule.py", "layerwise/scaler.py"} <= names


def test_the_names_layerwise_offered_as_a_module_still_import_from_it():
    before = {
        "LayerState", "Layerwise", "Topology", "choose_cut_points", "clean_step", "layer_rule", "overflow_step",
        "host_rule", "pow2", "topology", "walk", "Walk", "DEFAULT_BOUNDS", "HEADROOM", "ZERO_JUMP", "HISTORY_LEN",
        "TOTAL_BOUND",
    }
    assert before <= set(layerwise.__all__)
    assert all(hasattr(layerwise, name) for name in before | {"_CutHook"})
