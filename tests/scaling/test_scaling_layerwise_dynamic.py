"""Per-layer scaling on graphs that change from step to step, and on shared weights.

A block skipped on some steps (LayerDrop, stochastic depth, early exit, an expert without
tokens), two backward calls with different blocks before one step, a block whose parameters get
no gradient, activation checkpoints around skipped blocks, a tied embedding (GPT-2); then a
computed-and-discarded block output, a block run twice on a later step, ``per_layer`` without
``watch``, and pickling a watched model.

The models run in float32: multiplying by the powers of two of per-layer scaling and dividing
them out again rounds nothing there, so the unscaled gradients must equal, bit for bit, those of
a plain float32 backward of a copy of the model on the same batch.
"""

from __future__ import annotations

import copy
import io
import pickle

import pytest
from hypothesis import example, given, settings, strategies as st
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import mixprec


class Block(nn.Module):
    """``tanh(Linear(32, 32))``, the Linear under a reentrant checkpoint when ``reentrant``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(32, 32)
        self.reentrant = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(checkpoint(self.lin, x, use_reentrant=True) if self.reentrant else self.lin(x))


class Skippy(nn.Module):
    """A stem, 4 blocks of ``Linear(32, 32) + tanh`` (weights x0.05, so that each block shrinks
    the gradient and the factors differ) and a head. ``skip``: the blocks not run this step;
    ``exit_after``: run blocks up to this one only (early exit); ``discard``: blocks run but
    their output not used (kept in ``held`` while ``hold``, else dropped); ``twice``: blocks run
    twice; ``ckpt``: ``None``, ``"reentrant"``
    (each block's Linear, inside the block) or ``"non-reentrant"`` (each block)."""

    def __init__(self, ckpt: str | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Linear(32, 32)
        self.blocks = nn.ModuleList(Block() for _ in range(4))
        with torch.no_grad():
            for block in self.blocks:
                block.lin.weight.mul_(0.05)
                block.reentrant = ckpt == "reentrant"
        self.head = nn.Linear(32, 1)
        self.ckpt = ckpt
        self.skip: set[int] = set()
        self.discard: set[int] = set()
        self.hold = True
        self.held: list[torch.Tensor] = []
        self.twice: set[int] = set()
        self.exit_after = 3

    def _block(self, i: int, x: torch.Tensor) -> torch.Tensor:
        block = self.blocks[i]
        if self.ckpt == "non-reentrant":
            return checkpoint(block, x, use_reentrant=False)
        return block(x)

    def _stem(self, x: torch.Tensor) -> torch.Tensor:
        return self.stem(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self._stem(x)
        for i in range(self.exit_after + 1):
            if i in self.skip:
                continue
            y = self._block(i, x)
            if i in self.twice:
                y = self._block(i, y)
            if i not in self.discard:
                x = y
            elif self.hold:
                self.held = [y]
        return self.head(x)


def _batch(seed: int = 0) -> torch.Tensor:
    return torch.randn(64, 32, generator=torch.Generator().manual_seed(seed))


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).pow(2).mean()


def _reference(model: nn.Module, *batches: torch.Tensor) -> dict[str, torch.Tensor | None]:
    """Float32 gradients of a copy of ``model`` (same skips), summed over ``batches``."""
    ref = copy.deepcopy(model)
    ref.zero_grad()
    for x in batches:
        _loss(ref, x).backward()
    return {n: None if p.grad is None else p.grad.clone() for n, p in ref.named_parameters()}


def _mismatches(model: nn.Module, ref: dict[str, torch.Tensor | None]) -> list[str]:
    """Parameters whose gradient is not ``ref``'s bit for bit (``None`` there: none or zeros)."""
    wrong = []
    for n, p in model.named_parameters():
        want = ref[n] if ref[n] is not None or p.grad is None else torch.zeros_like(p.grad)
        if (p.grad is None) != (want is None) or (p.grad is not None and not torch.equal(p.grad, want)):
            wrong.append(n)
    return wrong


def _scaler(model: nn.Module, exponents=(3, -2, 5, 2), **options) -> mixprec.GradScaler:
    """A per-layer scaler watching ``model``, its factors set to ``2**exponents`` (so that a
    wrongly counted factor shows)."""
    scaler = mixprec.GradScaler("cpu", per_layer=True, init_scale=16.0, **options).watch(model)
    state = scaler.state_dict()
    n = len(exponents)
    state["layerwise"] = {
        "cut_points": [f"blocks.{i}" for i in range(n)], "exponent": list(exponents), "margin": [0] * n,
        "growth_tracker": [0] * n, "hysteresis_left": [1] * n,
    }
    scaler.load_state_dict(state)
    return scaler


def _train(model: Skippy, scaler: mixprec.GradScaler, patterns, **setting) -> list[dict[str, float]]:
    """One step per entry of ``patterns`` (``{attribute: value}`` set on the model for that step),
    lr 0, the same batch; asserts bitwise float32 gradients after ``unscale_`` on every step and
    returns the factors after each update."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    x, trajectory = _batch(), []
    for step, pattern in enumerate(patterns):
        for key, value in {"skip": set(), "exit_after": 3, "discard": set(), **pattern}.items():
            setattr(model, key, value)
        ref = _reference(model, x)
        optimizer.zero_grad(**setting)
        scaler.scale(_loss(model, x)).backward()
        scaler.unscale_(optimizer)
        assert _mismatches(model, ref) == [], f"step {step} {pattern}"
        scaler.step(optimizer)
        scaler.update()
        trajectory.append(scaler.layer_scales())
    return trajectory


# ------------------------------------------------------------------ skipped blocks: exact


def test_a_block_skipped_every_third_step_gives_exact_gradients_and_steady_factors():
    """The issue's run: block 2 skipped on every third step. Before, the layers below it were
    32x off on those steps and the factors swung to 2**-6 and 2**15 on the step after."""
    model = Skippy()
    scaler = mixprec.GradScaler("cpu", per_layer=True, init_scale=16.0).watch(model)
    trajectory = _train(model, scaler, [{"skip": {2}} if step % 3 == 2 else {} for step in range(12)])
    assert max(trajectory[-1].values()) > 1  # the factors are not all 1
    assert all(factors == trajectory[1] for factors in trajectory[1:])  # no swing after skips


@pytest.mark.parametrize(
    "patterns",
    [
        [{}, {"skip": {0}}, {}, {"skip": {0, 3}}, {"skip": {1, 2}}, {}],  # LayerDrop, the stem below
        [{}, {"exit_after": 1}, {"exit_after": 0}, {}, {"exit_after": 2}],  # early exit
        [{"skip": {2}}, {}, {"skip": {1}}, {}, {"skip": {0}}],  # the first step skips one
        [{"exit_after": 1}, {}, {"exit_after": 2}, {}],  # the first step exits early
        [{}, {"skip": {0, 1, 2, 3}}, {}],  # no block at all
    ],
    ids=["layerdrop", "early-exit", "first-step-skips", "first-step-exits", "all-skipped"],
)
def test_any_subset_of_blocks_gives_exact_gradients(patterns):
    model = Skippy()
    scaler = _scaler(model)
    _train(model, scaler, patterns)
    before = _scaler(Skippy()).layer_scales()
    assert before == {"blocks.0": 8.0, "blocks.1": 0.25, "blocks.2": 32.0, "blocks.3": 4.0}


@pytest.mark.parametrize("ckpt", ["reentrant", "non-reentrant"])
def test_skipped_blocks_under_activation_checkpointing(ckpt):
    model = Skippy(ckpt=ckpt)
    patterns = [{}, {"skip": {2}}, {}, {"skip": {0}}, {"exit_after": 1}, {}]
    _train(model, _scaler(model), patterns)


def test_zero_gradients_of_a_skipped_block_do_not_move_the_factors():
    """``zero_grad(set_to_none=False)`` leaves zeros in a skipped block's gradients; the rule
    would read them as a region that saw only zeros and raise its factor 16x per step."""
    model = Skippy()
    scaler = mixprec.GradScaler("cpu", per_layer=True, init_scale=16.0).watch(model)
    patterns = [{}, {}, {"skip": {2}}, {"skip": {2}}, {}, {"skip": {1, 2}}]
    trajectory = _train(model, scaler, patterns, set_to_none=False)
    assert all(factors == trajectory[1] for factors in trajectory[1:])


def test_a_block_whose_parameters_get_no_gradient():
    model = Skippy()
    scaler = _scaler(model)
    for p in model.blocks[1].parameters():
        p.requires_grad_(False)
    _train(model, scaler, [{}, {"skip": {2}}, {}])
    for p in model.blocks[1].parameters():
        p.requires_grad_(True)
    _train(model, scaler, [{}, {"skip": {1}}, {}])


def test_accumulation_with_a_block_skipped_in_one_micro_batch():
    """Two backward calls before one step, block 2 skipped in the first only: the gradients are
    the sum of both float32 backward passes, bit for bit."""
    model = Skippy()
    scaler = _scaler(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    for order in ([{2}, set()], [set(), {2}], [{0}, {1, 3}]):
        xs = [_batch(1), _batch(2)]
        ref = copy.deepcopy(model)
        ref.zero_grad()
        optimizer.zero_grad()
        for skip, x in zip(order, xs):
            model.skip = ref.skip = skip
            _loss(ref, x).backward()
            scaler.scale(_loss(model, x)).backward()
        scaler.unscale_(optimizer)
        assert _mismatches(model, {n: p.grad for n, p in ref.named_parameters()}) == [], order
        scaler.step(optimizer)
        scaler.update()


_MICRO_BATCH = st.fixed_dictionaries(
    {"skip": st.sets(st.integers(0, 3), max_size=4), "exit_after": st.integers(0, 3)}
)


@settings(max_examples=12, deadline=None)
@example(  # no cut point in the first backward, then block 0 only: the structure completed late
    steps=[[{"skip": {0}, "exit_after": 0}, {"skip": set(), "exit_after": 0}]], exponents=[1, 0, 0, 0]
)
@given(steps=st.lists(st.lists(_MICRO_BATCH, min_size=1, max_size=2), min_size=1, max_size=4),
       exponents=st.lists(st.integers(-6, 6), min_size=4, max_size=4))
def test_random_skips_and_micro_batches_give_exact_gradients(steps, exponents):
    """Random steps of one or two micro-batches, each with its own skipped blocks and exit."""
    model = Skippy()
    scaler = _scaler(model, exponents)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    for step, micro_batches in enumerate(steps):
        ref = copy.deepcopy(model)
        ref.zero_grad()
        optimizer.zero_grad()
        for i, pattern in enumerate(micro_batches):
            for target in (model, ref):
                target.skip, target.exit_after = pattern["skip"], pattern["exit_after"]
            _loss(ref, _batch(i)).backward()
            scaler.scale(_loss(model, _batch(i))).backward()
        scaler.unscale_(optimizer)
        assert _mismatches(model, {n: p.grad for n, p in ref.named_parameters()}) == [], (step, micro_batches)
        scaler.step(optimizer)
        scaler.update()


# ------------------------------------------------------------------ resuming after skipped blocks

#: Steps whose first ones reach the blocks one at a time, blocks 1 and 2 where the block above
#: does not run (so the walks place them under the top region), then full steps: a scaler that
#: learnt its structure from a full step instead scales the blocks otherwise.
_RESUME_PATTERNS = [
    {"skip": {0, 1, 2, 3}}, {"exit_after": 0}, {"skip": {0, 1, 2}}, {"skip": {0}, "exit_after": 1},
    {"skip": {0, 1, 3}}, {}, {"skip": {2}}, {}, {},
]


def _resumable(model: Skippy) -> tuple[mixprec.GradScaler, torch.optim.Optimizer]:
    scaler = mixprec.GradScaler("cpu", per_layer=True, init_scale=16.0, growth_interval=2).watch(model)
    return scaler, torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)


def _steps(model: Skippy, scaler: mixprec.GradScaler, optimizer: torch.optim.Optimizer, start: int, stop: int):
    """Steps ``start..stop-1`` of :data:`_RESUME_PATTERNS`; per step the scaled gradients (before
    ``unscale_``) and the factors after the update."""
    out = []
    for step in range(start, stop):
        for key, value in {"skip": set(), "exit_after": 3, **_RESUME_PATTERNS[step]}.items():
            setattr(model, key, value)
        optimizer.zero_grad()
        scaler.scale(_loss(model, _batch(step))).backward()
        scaled = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        scaler.step(optimizer)
        scaler.update()
        out.append((scaled, scaler.layer_scales()))
    return out


def _checkpoint_at(resume_at: int) -> dict:
    model = Skippy()
    scaler, optimizer = _resumable(model)
    _steps(model, scaler, optimizer, 0, resume_at)
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scaler": scaler.state_dict()},
               buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def _resumed(saved: dict) -> tuple[Skippy, mixprec.GradScaler, torch.optim.Optimizer]:
    model = Skippy()
    scaler, optimizer = _resumable(model)
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    scaler.load_state_dict(saved["scaler"])
    return model, scaler, optimizer


@pytest.mark.parametrize("resume_at", [2, 5, 7])
def test_a_run_resumed_after_skipped_blocks_is_bitwise(resume_at):
    """Saved mid-run after steps that skipped blocks (state_dicts through torch.save,
    weights_only), rebuilt and loaded: the scaled gradients and the factors of every later step
    are the uninterrupted run's, bit for bit (before, the resumed scaler learnt its structure
    from its first step after the load and its factors went elsewhere)."""
    model = Skippy()
    scaler, optimizer = _resumable(model)
    n = len(_RESUME_PATTERNS)
    straight = _steps(model, scaler, optimizer, 0, n)
    assert len({tuple(factors.values()) for _, factors in straight[resume_at:]}) > 1  # the factors move
    resumed_model, resumed_scaler, resumed_optimizer = _resumed(_checkpoint_at(resume_at))
    resumed = _steps(resumed_model, resumed_scaler, resumed_optimizer, resume_at, n)
    for step, ((want_grads, want_factors), (grads, factors)) in enumerate(zip(straight[resume_at:], resumed), resume_at):
        assert factors == want_factors, f"step {step}"
        assert grads.keys() == want_grads.keys(), f"step {step}"
        assert [g for g in grads if not torch.equal(grads[g], want_grads[g])] == [], f"step {step}"
    assert resumed_scaler.state_dict() == scaler.state_dict()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), resumed_model.parameters()))


def test_a_per_layer_state_without_structure_still_loads():
    """A checkpoint of an older mixprec (no 'structure'): it loads, the factors are restored,
    the structure is learnt again from the next step (the old behaviour) and the gradients stay
    exact; a corrupted structure is refused before anything changes."""
    saved = _checkpoint_at(5)
    structure = saved["scaler"]["layerwise"].pop("structure")
    assert structure["parent"][1:3] == [None, None]  # blocks 1 and 2 found under the top region
    model, scaler, _ = _resumed(saved)
    assert list(scaler.layer_scales().values()) == [2.0**e for e in saved["scaler"]["layerwise"]["exponent"]]
    _train(model, scaler, [{}, {"skip": {2}}, {}])
    assert scaler.state_dict()["layerwise"]["structure"]["parent"] == ["blocks.1", "blocks.2", "blocks.3", None]
    for broken, match in [({**structure, "parent": ["blocks.1", "blocks.0", None, None]}, "under itself"),
                          ({**structure, "known": ["blocks.9"]}, "not one of the cut points"),
                          ({k: v for k, v in structure.items() if k != "shared"}, "with the keys")]:
        before = scaler.state_dict()
        with pytest.raises(ValueError, match=match):
            scaler.load_state_dict({**before, "layerwise": {**before["layerwise"], "structure": broken}})
        assert scaler.state_dict() == before


def test_a_structure_naming_other_parameters_warns_and_is_learnt_again():
    """A checkpoint's structure whose parameters are not the watched model's (another model):
    the next scale() warns and learns the structure from its step, with exact gradients."""
    saved = _checkpoint_at(5)
    del saved["scaler"]["layerwise"]["structure"]["regions"]["head.bias"]
    model, scaler, _ = _resumed(saved)
    with pytest.warns(RuntimeWarning, match="names other parameters than the watched model's"):
        _train(model, scaler, [{}])
    assert scaler.state_dict()["layerwise"]["structure"]["parent"] == ["blocks.1", "blocks.2", "blocks.3", None]


# ------------------------------------------------------------------ what is refused


def test_a_discarded_block_output_is_a_clear_error_naming_the_block():
    """Its output kept alive (a returned intermediate): the backward is planned without a walk."""
    model = Skippy()
    scaler = _scaler(model)
    _train(model, scaler, [{"skip": {1}}, {}])
    model.discard = {2}  # a forward that runs every block (no walk), one output discarded
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    optimizer.zero_grad()
    scaler.scale(_loss(model, _batch())).backward()
    with pytest.raises(ValueError, match="cut point 'blocks.2' ran in the forward but its output did not reach the loss"):
        scaler.unscale_(optimizer)


def test_a_discarded_block_output_that_is_dropped_gives_exact_gradients():
    """Its graph died before scale(): the step is walked as one that skipped the block."""
    model = Skippy()
    model.hold = False
    _train(model, _scaler(model), [{}, {"discard": {2}}, {}, {"discard": {0}}, {}])


def test_a_block_run_twice_on_a_later_step_is_refused():
    model = Skippy()
    scaler = _scaler(model)
    _train(model, scaler, [{}, {}])
    model.twice = {1}
    with pytest.raises(ValueError, match="crosses cut point 'blocks.1' twice"):
        scaler.scale(_loss(model, _batch()))


# ------------------------------------------------------------------ tied embeddings (GPT-2)


def _gpt2(tied: bool = True) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=2, vocab_size=256, n_positions=32, bos_token_id=0, eos_token_id=0,
        attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0, tie_word_embeddings=tied,
    )
    return transformers.GPT2LMHeadModel(config)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_gpt2_with_tied_embeddings_gives_exact_gradients(tied):
    """The tied ``transformer.wte.weight`` gets one contribution from the embedding, below every
    cut point, and one from the LM head, above them; each is brought to the head's scale before
    autograd sums them."""
    model = _gpt2(tied)
    assert (model.lm_head.weight is model.transformer.wte.weight) == tied
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    scaler = mixprec.GradScaler("cpu", per_layer=True).watch(model)
    state = scaler.state_dict()
    cuts = ["transformer.h.0", "transformer.h.1"]
    state["layerwise"] = {"cut_points": cuts, "exponent": [6, -3], "margin": [0, 0],
                          "growth_tracker": [0, 0], "hysteresis_left": [1, 1]}
    scaler.load_state_dict(state)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    for step in range(3):
        ref = copy.deepcopy(model)
        ref(ids, labels=ids).loss.backward()
        optimizer.zero_grad()
        scaler.scale(model(ids, labels=ids).loss).backward()
        scaler.unscale_(optimizer)
        expected = {n: p.grad for n, p in ref.named_parameters()}
        assert _mismatches(model, expected) == [], step
        scaler.step(optimizer)
        scaler.update()


def test_gpt2_with_tied_embeddings_trains_in_float16():
    model = _gpt2()
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    scaler = mixprec.GradScaler("cpu", per_layer=True).watch(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    for _ in range(4):
        ref = _gpt2()
        ref(ids, labels=ids).loss.backward()
        optimizer.zero_grad()
        with mixprec.autocast("cpu", dtype=torch.float16):
            loss = model(ids, labels=ids).loss
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        got, want = model.transformer.wte.weight.grad, ref.transformer.wte.weight.grad
        assert ((got - want).norm() / want.norm()).item() < 2e-2
        scaler.step(optimizer)
        scaler.update()


# ------------------------------------------------------------------ watch, pickling


def test_per_layer_without_watch_raises_at_the_first_scale():
    scaler = mixprec.GradScaler("cpu", per_layer=True)
    with pytest.raises(ValueError, match=r"call scaler.watch\(model\) before the first scale"):
        scaler.scale(torch.ones((), requires_grad=True))
    model = Skippy()
    scaler.watch(model)
    scaler.scale(_loss(model, _batch())).backward()
    twin = pickle.loads(pickle.dumps(scaler))
    with pytest.raises(ValueError, match=r"watch\(model\) again"):
        twin.scale(_loss(model, _batch()))


@pytest.mark.parametrize("per_layer", [True, False])
@pytest.mark.parametrize("how", ["pickle", "torch.save"])
def test_a_watched_model_pickles_and_the_copy_trains_unwatched(per_layer, how):
    model = Skippy()
    scaler = mixprec.GradScaler("cpu", per_layer=per_layer, init_scale=16.0).watch(model)
    if per_layer:
        _train(model, scaler, [{}, {"skip": {2}}])
    if how == "pickle":
        copied = pickle.loads(pickle.dumps(model))
        pair = pickle.loads(pickle.dumps((model, scaler)))
    else:
        buffer = io.BytesIO()
        torch.save((model, scaler), buffer)
        buffer.seek(0)
        pair = torch.load(buffer, weights_only=False)
        copied = copy.deepcopy(pair[0])
    # the copy's hooks are inert: a plain backward gives the plain float32 gradients
    ref = _reference(model, _batch())
    _loss(copied, _batch()).backward()
    assert _mismatches(copied, ref) == []
    # and a scaler watching the copy trains it exactly (the unpickled scaler needs watch again)
    model2, scaler2 = pair
    if per_layer:
        with pytest.raises(ValueError, match="again"):
            scaler2.scale(_loss(model2, _batch()))
    scaler2.watch(model2)
    if per_layer:
        assert scaler2.layer_scales() == scaler.layer_scales()
        _train(model2, scaler2, [{}, {"skip": {1}}, {}])
    # the original is still watched and exact
    if per_layer:
        _train(model, scaler, [{"skip": {0}}, {}])


# ------------------------------------------------------------------ parameters placed late, scalers replaced


class Branchy(Skippy):
    """:class:`Skippy` with a second stem below every cut point, added to the first on the steps
    ``branch`` is set; ``frozen`` freezes (or unfreezes) the first stem."""

    def __init__(self) -> None:
        super().__init__()
        self.branch = False
        self.side = nn.Linear(32, 32)

    @property
    def frozen(self) -> bool:
        return not self.stem.weight.requires_grad

    @frozen.setter
    def frozen(self, value: bool) -> None:
        self.stem.requires_grad_(not value)

    def _stem(self, x: torch.Tensor) -> torch.Tensor:
        return self.stem(x) + self.side(x) if self.branch else self.stem(x)


LATE = {  # per step, what the model runs: a parameter below every cut point gets its first gradient late
    "a stem frozen, then trained (warm-up freezing)": [{"frozen": True}] * 2 + [{"frozen": False}] * 3,
    "a branch first run at step 2": [{}, {}, {"branch": True}, {"branch": True}, {}],
    "a branch first run with a block skipped": [{}, {"branch": True, "skip": {1}}, {"branch": True}, {}],
}


@pytest.mark.parametrize("patterns", LATE.values(), ids=LATE.keys())
def test_a_parameter_below_the_cut_points_first_trained_late_gets_exact_gradients(patterns):
    """Its region was guessed (the top one) while no walk reached it: every step is walked while
    such a parameter requires grad, and the walk that reaches it places it. Before, the steps
    that ran every cut point skipped the walk, and its gradients kept the product of the factors
    above it (x2**8 here), step after step."""
    model = Branchy()
    _train(model, _scaler(model), patterns)


def test_a_scaler_that_watches_a_model_releases_the_one_that_watched_it():
    """A new per-layer scaler (resumed from the old one's state_dict, or fresh) watching the same
    model, the old one still alive: only the new one's hooks scale the gradients (exact), and the
    old one refuses to scale until it watches the model again, which releases the new one."""
    model = Skippy()
    old = _scaler(model)
    _train(model, old, [{}, {"skip": {1}}])
    new = mixprec.GradScaler("cpu", per_layer=True)
    new.load_state_dict(old.state_dict())
    new.watch(model)
    _train(model, new, [{}, {"skip": {2}}, {}])
    with pytest.raises(ValueError, match="another per-layer scaler"):
        old.scale(_loss(model, _batch()))
    fresh = mixprec.GradScaler("cpu", per_layer=True, init_scale=16.0).watch(model)
    _train(model, fresh, [{}, {}])
    old.watch(model)
    _train(model, old, [{"skip": {0}}, {}])
    for scaler in (new, fresh):
        with pytest.raises(ValueError, match="another per-layer scaler"):
            scaler.scale(_loss(model, _batch()))
