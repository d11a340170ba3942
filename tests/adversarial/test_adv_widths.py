"""Layer widths against fp4 blocks: a layer whose in or out features are not multiples of its
recipe's blocks (``recipe.multiple``: 32 for ``mxfp4``, 16 for ``nvfp4``) never runs that recipe.

Each route either leaves the layer out up front, saying so (``Policy.fp8(names=...)``: a warning
naming the layer and the block, the layer in the compute dtype, bitwise plain bf16 autocast), or
refuses it with a ValueError naming the layer (``Policy.fp8(recipes=...)`` on the first forward,
``fp8.convert(..., filter_fn=...)`` before changing anything); widths that fit run the recipe.
"""

from __future__ import annotations

import re
import warnings

import pytest
import torch

import mixprec
from _adv_programs import Net, Shape, Step, batch, loss_of
from mixprec import Policy, fp8

#: (recipe, a width that does not fit, one that does)
CASES = [("mxfp4", 16, 32), ("nvfp4", 24, 16)]
_STEP = Step(skip=frozenset({1}), rows=((8, 4),))


def _outputs(model: torch.nn.Module, region: object) -> list[torch.Tensor]:
    out = []
    for m, rows in enumerate(_STEP.rows[0]):
        with region:  # type: ignore[attr-defined]
            out.append(model(batch(Shape(width=model.head.in_features), 0, 0, 0, m, rows), _STEP))
    return out


@pytest.mark.parametrize("recipe, odd, fits", CASES)
def test_policy_names_leave_out_a_layer_whose_width_does_not_fit(recipe: str, odd: int, fits: int) -> None:
    ctl = mixprec.Controller(every=1, ladder=(recipe, "tensorwise", "rowwise", "compute"), per_gemm=True)
    policy = Policy.parse("compute=bf16").fp8(recipe, names=r"^blocks\.", first_last="fp8", controller=ctl)
    model = Net(Shape(width=odd, blocks=2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _outputs(model, mixprec.autocast("cpu", policy=policy))
    said = [str(w.message) for w in caught]
    multiple = fp8.Float8Recipe.from_name(recipe).multiple
    for layer in ("blocks.0.0", "blocks.1.0"):
        assert any(re.search(rf"'{re.escape(layer)}'.*not (a multiple|multiples) of {multiple}", s) for s in said), said
    want = _outputs(model, mixprec.autocast("cpu", dtype=torch.bfloat16))
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert ctl.step() == [] and not fp8.stats(model).rows
    fitting = Net(Shape(width=fits, blocks=2))
    _outputs(fitting, mixprec.autocast("cpu", policy=policy))
    assert {r["layer"] for r in fp8.stats(fitting).rows} == {"blocks.0.0", "blocks.1.0"}


@pytest.mark.parametrize("recipe, odd, fits", CASES)
def test_policy_recipes_refuse_a_layer_whose_width_does_not_fit(recipe: str, odd: int, fits: int) -> None:
    policy = Policy.parse("compute=bf16").fp8("tensorwise", names=r"^blocks\.", first_last="fp8",
                                              recipes={"blocks.0.0": recipe})
    model = Net(Shape(width=odd, blocks=2))
    multiple = fp8.Float8Recipe.from_name(recipe).multiple
    with pytest.raises(ValueError, match=rf"'blocks\.0\.0'.*not (a multiple|multiples) of {multiple}"):
        loss_of(_outputs(model, mixprec.autocast("cpu", policy=policy))[0])
    _outputs(Net(Shape(width=fits, blocks=2)), mixprec.autocast("cpu", policy=policy))


@pytest.mark.parametrize("recipe, odd, fits", CASES)
def test_convert_refuses_a_layer_whose_width_does_not_fit(recipe: str, odd: int, fits: int) -> None:
    model = Net(Shape(width=odd, blocks=2))
    try:
        fp8.convert(model, recipe, filter_fn=lambda m, fqn: fqn.startswith("blocks."))
    except ValueError as error:
        assert "blocks.0.0" in str(error)
    else:
        converted = [n for n, m in model.named_modules() if isinstance(m, fp8.Float8Linear)]
        raise AssertionError(f"fp8.convert converted {converted} to {recipe} at width {odd}")
    assert not any(isinstance(m, fp8.Float8Linear) for m in model.modules())  # nothing changed
