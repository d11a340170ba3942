"""How far a layer's input-gradient error reaches the layers before it (``mixprec.control._reach``,
issue 39): the share ``r`` a walk of the autograd graph reads off the step's own backward,
against the same share computed by hand on graphs whose answer is known (a residual add, two
layers reading one input, a parallel branch, a head), the weighting and truncation, the graph
freed after it, the reach's state, and the controller charging a hidden layer's input gradient
with it."""

from __future__ import annotations

import functools
import gc
import weakref

import pytest
import torch
import torch.nn as nn
import torch.utils.checkpoint

import mixprec
from mixprec import fp8
from mixprec.control._backward import backward_costs
from mixprec.control._joint_walk import JointWalk
from mixprec.control._reach import Reach, ReachMap, walk
from mixprec.control._windows import reach_rows


def _r(start_of: str, layer: str, build, joint: bool = False) -> float:
    """``r`` of ``layer``'s output node in the walk from ``start_of``'s, one backward of ``build()``
    (which returns the loss and ``{name: output}``), the layer weighing 1: walked alone
    (:func:`walk`) or joined in a joint walk (``joint``: :class:`JointWalk`)."""
    loss, outs = build()
    reach = Reach(torch.device("cpu"))
    reach.gain.fill_(1.0)
    if joint:
        source = Reach(torch.device("cpu"))
        assert float(JointWalk().join(source, outs[start_of].grad_fn, {outs[layer].grad_fn: reach})) == 1.0
        loss.backward()
        return float(source.window[0])
    got: list[float] = []
    walk(outs[start_of].grad_fn, {outs[layer].grad_fn: reach}, Reach.weight, lambda w, r: got.append(float(r)))
    loss.backward()
    return sum(got)


@pytest.fixture(params=["alone", "joint"])
def r_of(request):
    """:func:`_r` of a layer walking alone, or joining a joint walk."""
    return functools.partial(_r, joint=request.param == "joint")


def _walk_over(reach: Reach, start, earlier: dict, joint: bool) -> None:
    """``reach``'s walk from ``start`` over ``earlier`` (node -> Reach): alone, or joined in a joint walk."""
    if joint:
        reach.window[1] += JointWalk().join(reach, start, earlier)
    else:
        reach.walk_alone(start, earlier, lambda fn: fn)


def _residual(seed: int = 0):
    """``h = k(x)``, ``out = h + l(h)``: ``k``'s output gradient is the skip's ``g`` plus ``l``'s input gradient."""
    torch.manual_seed(seed)
    k, l_ = nn.Linear(8, 8), nn.Linear(8, 8)
    x = torch.randn(4, 8)
    target = torch.randn(4, 8)

    def build():
        h = k(x)
        b = l_(h)
        return ((h + b - target) ** 2).sum(), {"k": h, "l": b}
    return build, k, l_, x, target


def test_a_residual_add_dilutes_by_the_branch_share(r_of):
    build, k, l_, x, target = _residual()
    with torch.no_grad():
        h = k(x)
        g = 2 * (h + l_(h) - target)  # the skip's gradient of h (and the branch output's)
        branch = g @ l_.weight      # l's input gradient
    expected = float(branch.square().sum() / (g + branch).square().sum())
    assert r_of("l", "k", build) == pytest.approx(min(1.0, expected), rel=1e-5)
    assert 0 < expected < 1


def test_a_share_carries_through_later_merges_of_its_own_gradient(r_of):
    """``h1 = h0 + a(h0)``, ``h2 = h1 + l(h1)``: ``l``'s share at ``h1`` is ``rho``; everything
    upstream of ``h1`` gets its gradient from ``h1`` (the skip and ``a``'s branch alike), so ``a``'s
    output and ``k``'s keep ``rho`` (a second merge of the same gradient dilutes nothing)."""
    torch.manual_seed(4)
    k, a, l_ = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
    x, target = torch.randn(4, 8), torch.randn(4, 8)

    def build():
        h0 = k(x)
        ya = a(h0)
        h1 = h0 + ya
        yl = l_(torch.tanh(h1))
        return ((h1 + yl - target) ** 2).sum(), {"k": h0, "a": ya, "l": yl}
    with torch.no_grad():
        h1 = k(x) + a(k(x))
        g = 2 * (h1 + l_(torch.tanh(h1)) - target)
        branch = (g @ l_.weight) * (1 - torch.tanh(h1) ** 2)
    rho = float(branch.square().sum() / (g + branch).square().sum())
    assert 0.05 < rho < 0.95
    assert r_of("l", "a", build) == pytest.approx(rho, rel=1e-4)
    assert r_of("l", "k", build) == pytest.approx(rho, rel=1e-4)


def test_a_branch_cancelling_the_skip_caps_the_share_at_one(r_of):
    """``out = h + l(h)`` with ``l`` close to ``-h``: the branch's gradient nearly cancels the
    skip's, so its squared norm is many times the total's; the share is capped at 1."""
    torch.manual_seed(5)
    k, l_ = nn.Linear(8, 8), nn.Linear(8, 8, bias=False)
    with torch.no_grad():
        l_.weight.copy_(-0.9 * torch.eye(8))
    x = torch.randn(4, 8)

    def build():
        h = k(x)
        b = l_(h)
        return (h + b).sum() * 1.0, {"k": h, "l": b}
    assert r_of("l", "k", build) == 1.0


def test_a_layer_whose_output_the_loss_does_not_use_reaches_nothing(r_of):
    """Its node never runs, so nothing it sends arrives: the layers before it read 0."""
    torch.manual_seed(6)
    k, a, unused = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)
    x = torch.randn(3, 4)

    def build():
        h = k(x)
        return a(h).sum(), {"k": h, "unused": unused(h)}
    assert r_of("unused", "k", build) == 0.0


def test_two_layers_reading_one_input_share_it(r_of):
    torch.manual_seed(1)
    k, a, b = nn.Linear(6, 6), nn.Linear(6, 5), nn.Linear(6, 3)
    x = torch.randn(5, 6)

    def build():
        h = k(x)
        ya, yb = a(h), b(h)
        return ya.square().sum() + (yb * 3).sum(), {"k": h, "a": ya, "b": yb}
    with torch.no_grad():
        h = k(x)
        ra, rb = (2 * a(h)) @ a.weight, torch.full((5, 3), 3.0) @ b.weight
    assert r_of("a", "k", build) == pytest.approx(float(ra.square().sum() / (ra + rb).square().sum()), rel=1e-5)
    assert r_of("b", "k", build) == pytest.approx(float(rb.square().sum() / (ra + rb).square().sum()), rel=1e-5)


def test_a_parallel_branch_is_not_reached_and_a_head_reaches_everything(r_of):
    torch.manual_seed(2)
    k, a, b, head = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 2)
    x = torch.randn(5, 6)

    def build():
        h = k(x)
        ya, yb = a(h), b(h)  # parallel branches of one residual block
        z = h + ya + torch.tanh(yb)
        y = head(torch.layer_norm(z, (6,)))
        return y.square().sum(), {"k": h, "a": ya, "b": yb, "head": y}
    assert r_of("a", "b", build) == 0.0  # b's output gradient does not pass a's input gradient
    for layer in ("k", "a", "b"):
        assert r_of("head", layer, build) == pytest.approx(1.0, abs=1e-6)  # everything comes through the head
    r_k = r_of("a", "k", build)
    assert 0 < r_k < 1
    # the layer's reach: the earlier layers' shares weighted by their gains, the unreached b's 0 included
    loss, outs = build()
    earlier = {outs[n].grad_fn: Reach(torch.device("cpu")) for n in ("k", "b")}
    for reach, gain in zip(earlier.values(), (3.0, 1.0)):
        reach.gain.fill_(gain)
    reach = Reach(torch.device("cpu"))
    _walk_over(reach, outs["a"].grad_fn, earlier, r_of.keywords["joint"])
    loss.backward()
    assert float(_row(reach, torch.zeros(2))[2]) == pytest.approx(3.0 * r_k / 4.0, rel=1e-5)


def _stack(joint: bool, seed: int = 0) -> tuple[dict[str, list[float]], int]:
    """A pre-norm residual stack (4 blocks: a two-layer branch and a parallel one-layer branch
    reading the same norm, then a head) whose every layer walks (``joint``: through the map's
    joint walk; else each alone); returns each layer's window and the hooks that ran."""
    torch.manual_seed(seed)
    d = 8
    blocks = [(nn.Linear(d, 2 * d), nn.Linear(2 * d, d), nn.Linear(d, d)) for _ in range(4)]
    head, x = nn.Linear(d, 5), torch.randn(6, d)
    reaches: dict[str, Reach] = {}
    found = ReachMap()
    calls = [0]

    def counted(fn):
        def run(*args):
            calls[0] += 1
            return fn(*args)
        return run

    def lin(name: str, module: nn.Module, h: torch.Tensor) -> torch.Tensor:
        out = module(h)
        reach = reaches[name] = Reach(torch.device("cpu"))
        reach.gain.fill_(0.5 + len(reaches) % 3)
        if joint:
            found.walk(reach, out.grad_fn, counted)
        elif reach.due() and found.earlier(reach):
            reach.walk_alone(out.grad_fn, found.earlier(reach), counted)
        found.add(reach, out.grad_fn)
        return out

    h = x
    for i, (a, b, c) in enumerate(blocks):
        n = torch.layer_norm(h, (d,))
        h = h + lin(f"b{i}", b, torch.tanh(lin(f"a{i}", a, n))) + torch.tanh(lin(f"c{i}", c, n))
    lin("head", head, torch.layer_norm(h, (d,))).square().sum().backward()
    return {name: r.window.tolist() for name, r in reaches.items()}, calls[0]


@pytest.mark.parametrize("limit", [None, 12], ids=["joint", "past-its-limit"])
def test_a_joint_walk_gives_every_layer_its_own_walks_shares(monkeypatch, limit):
    """Every layer of a residual stack with parallel branches walks in one joint walk: each
    layer's weighted sum and total are what its own walk gives (to float32 rounding), from a
    fraction of the hooks; past the joint walk's limit the layers that do not fit walk alone."""
    from mixprec.control import _joint_walk

    alone, alone_calls = _stack(False)
    joined: list = []
    original = _joint_walk.JointWalk.join
    monkeypatch.setattr(_joint_walk.JointWalk, "join", lambda self, *a: joined.append(original(self, *a)) or joined[-1])
    if limit is not None:
        monkeypatch.setattr(_joint_walk, "JOINT_NODES", limit)
    joint, joint_calls = _stack(True)
    for name, (reached, total) in alone.items():
        assert joint[name][1] == total, name  # (the same weights summed in the same order)
        assert joint[name][0] == pytest.approx(reached, rel=1e-5, abs=1e-7), name
    assert joint["head"][0] == pytest.approx(joint["head"][1], rel=1e-6)  # (the head reaches everything)
    assert joint["c0"][0] == 0.0  # (a0's branch is parallel: none of c0's error reaches it)
    if limit is None:
        assert all(t is not None for t in joined) and joint_calls * 5 < alone_calls
    else:
        assert any(t is None for t in joined) and any(t is not None for t in joined)


def test_a_joint_walks_sums_land_under_autograd_grad_and_in_each_backward():
    """The sums land at the end of whichever backward runs the hooks (an engine callback):
    ``torch.autograd.grad`` as ``backward()``, and a second forward's walk lands its own."""
    build, k, *_ = _residual()
    shares = []
    for grad in (False, True):
        loss, outs = build()
        earlier, source = Reach(torch.device("cpu")), Reach(torch.device("cpu"))
        earlier.gain.fill_(1.0)
        reaches = ReachMap()
        reaches.add(earlier, outs["k"].grad_fn)
        reaches.walk(source, outs["l"].grad_fn)
        if grad:
            torch.autograd.grad(loss, list(k.parameters()))  # (k's output node runs: its weight's gradient)
        else:
            loss.backward()
        shares.append(float(source.window[0]))
    assert shares[0] == shares[1] and 0 < shares[0] < 1


def test_a_truncated_walk_gives_the_last_reached_layer_the_rest():
    """Past ``limit`` nodes the layers not reached take the share of the last one reached."""
    torch.manual_seed(3)
    layers = [nn.Linear(4, 4) for _ in range(6)]
    x = torch.randn(3, 4)
    got: list[tuple[float, float]] = []
    outs = []
    h = x
    for m in layers:
        h = torch.tanh(m(h))
        outs.append(h.grad_fn.next_functions[0][0])  # the Linear's output node
    reaches = [Reach(torch.device("cpu")) for _ in layers]
    for i, r in enumerate(reaches):
        r.gain.fill_(float(i + 1))
    total = walk(outs[-1], dict(zip(outs[:-1], reaches[:-1])), Reach.weight, lambda w, r: got.append((float(w), float(r))),
                 limit=5)
    h.sum().backward()
    assert float(total) == pytest.approx(1 + 2 + 3 + 4 + 5)
    # a chain: every reached layer's r is 1; the deepest reached carries the unreached layers' weights
    assert all(r == pytest.approx(1.0) for _, r in got)
    assert sum(w for w, _ in got) == pytest.approx(15.0)
    assert len(got) < 5  # (some were not reached)


@pytest.mark.parametrize("joint", [False, True], ids=["alone", "joint"])
def test_the_walk_keeps_no_graph_alive(joint):
    build, *_ = _residual()
    loss, outs = build()
    reach = Reach(torch.device("cpu"))
    saved = outs["l"].grad_fn  # a node, to see the graph go
    ref = weakref.ref(outs["k"])
    reaches = ReachMap()
    reaches.add(reach, outs["k"].grad_fn)
    walking = Reach(torch.device("cpu"))
    if joint:
        reaches.walk(walking, outs["l"].grad_fn)
    else:
        walking.walk_alone(outs["l"].grad_fn, reaches.earlier(walking), lambda fn: fn)
    assert float(walking.window[1]) > 0
    loss.backward()
    reaches.clear()
    del loss, outs, saved
    gc.collect()
    assert ref() is None


def test_the_next_micro_batchs_forward_starts_the_map_over():
    """Two forwards before a step (gradient accumulation): in the second, a layer's earlier layers
    are those the second forward ran before it, not the first forward's later ones (another graph,
    which no walk reaches: counted, they would dilute its reach as unreached layers)."""
    torch.manual_seed(0)
    a, b, c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
    ra, rb, rc = (Reach(torch.device("cpu")) for _ in range(3))
    for r in (ra, rb, rc):
        r.gain.fill_(1.0)
    reaches = ReachMap()
    for _ in range(2):
        x = torch.randn(4, 8)
        ha = a(x)
        assert reaches.earlier(ra) == {}
        reaches.add(ra, ha.grad_fn)
        hb = b(ha)
        assert reaches.earlier(rb) == {ha.grad_fn: ra}
        reached: list[float] = []
        total = walk(hb.grad_fn, reaches.earlier(rb), Reach.weight, lambda w, r: reached.append(float(r)))
        assert float(total) == float(ra.weight())  # (a alone, in each forward)
        reaches.add(rb, hb.grad_fn)
        hc = c(hb)
        assert list(reaches.earlier(rc).values()) == [ra, rb]
        reaches.add(rc, hc.grad_fn)
        hc.sum().backward()
        assert reached == [1.0]  # b's error reaches a whole (no merge)


def test_a_layer_run_twice_in_one_forward_keeps_the_layers_before_it():
    """``a -> l -> b -> l -> c`` (``l``'s weight shared): ``l``'s second run counts its latest
    output only, and ``c``'s walk weighs ``a``, ``b`` and that output (one forward, one graph)."""
    torch.manual_seed(0)
    a, l_, b, c = (nn.Linear(8, 8) for _ in range(4))
    ra, rl, rb, rc = (Reach(torch.device("cpu")) for _ in range(4))
    reaches = ReachMap()
    h = a(torch.randn(4, 8))
    reaches.add(ra, h.grad_fn)
    first = l_(h)
    reaches.add(rl, first.grad_fn)
    h = b(first)
    reaches.add(rb, h.grad_fn)
    second = l_(h)
    assert list(reaches.earlier(rl).values()) == [ra, rb]
    reaches.add(rl, second.grad_fn)
    assert [(node is second.grad_fn, r) for node, r in reaches.earlier(rc).items()] == [(False, ra), (False, rb), (True, rl)]


def test_the_reach_state_round_trips_and_refuses_what_it_did_not_save():
    reach = Reach(torch.device("cpu"))
    assert reach.state() == [[0.0, 0.0], 1.0, None, 0]
    reach.window += torch.tensor([0.25, 1.0])
    _row(reach, torch.tensor([0.5, 2.0]))
    other = Reach(torch.device("cpu"))
    other.load(reach.state())
    assert other.state() == reach.state() == [[0.25, 1.0], 0.25, 0.25, 0]
    for bad in ([[0.1], 0.5, None, 0], [[0.0, 1.0], 1.5, None, 0], [[0.0, 1.0], float("nan"), 0.1, 0], "reach",
                [[-1, 1], 0.5, 1, 0], [[0.0, 1.0], 0.5, None, -1], [[0.0, 1.0], 0.5, None, 1.5], [[0.0, 1.0], 0.5, None]):
        with pytest.raises(ValueError, match="reach"):
            Reach(torch.device("cpu")).load(bad)


def test_a_reach_rounded_over_one_reads_one_and_loads_from_an_older_checkpoint():
    """A reach is a share of its walks' weights, at most 1; its two sums, added in their own
    orders, can round the ratio to 1 + 1 ulp (a run's state_dict then failed to load: a
    per-GEMM controller resumed at step 30). The check's row clamps it; a checkpoint that holds
    such a value (saved before) loads as 1, one further over is refused."""
    reach = Reach(torch.device("cpu"))
    reach.window += torch.tensor([1.0000001192092896, 1.0])
    assert _row(reach, torch.tensor([0.5, 1.0]))[2].item() == 1.0 and reach.state()[1] == 1.0
    other = Reach(torch.device("cpu"))
    other.load([[1.0, 1.0], 1.0000001192092896, 0.5, 3])
    assert other.state() == [[1.0, 1.0], 1.0, 0.5, 3]
    with pytest.raises(ValueError, match="reach"):
        other.load([[1.0, 1.0], 1.001, 0.5, 3])


def _row(reach: Reach, gain: torch.Tensor) -> torch.Tensor:
    """One reach's check row from its window's gain sums (:func:`reach_rows` of it alone)."""
    return reach_rows([reach], gain.unsqueeze(0))[0]


def test_a_window_without_a_walk_keeps_the_last_reach_and_gain():
    reach = Reach(torch.device("cpu"))
    assert _row(reach, torch.zeros(2)).tolist() == [-float("inf"), 0.0, 1.0]  # nothing yet: undiluted
    reach.window += torch.tensor([0.1, 0.5])
    assert _row(reach, torch.tensor([3.0, 3.0])).tolist() == pytest.approx([1.0, 1.0, 0.2])
    reach.reset()
    assert _row(reach, torch.zeros(2)).tolist() == pytest.approx([1.0, 1.0, 0.2])


def test_backward_costs_charge_the_input_gradient_by_its_reach():
    row = [0.1, 0.0, 0.0, 0.2, 0.0, 1.0] + [0.0] * 6 + [1, 1, 0, 0, 0.5, 1]
    end = [-float("inf"), 0]  # (no end slope measured)
    full, diluted = (backward_costs([row + [1.0] + end, row + [1.0] + end]),
                     backward_costs([row + [1.0] + end, row + [0.01] + end]))
    assert diluted[1][0] == pytest.approx(full[1][0] * 0.01)
    assert diluted[1][1] == full[1][1]  # the weight gradient's own cost is not the input gradient's reach


class _Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm, self.fc, self.out = nn.LayerNorm(width), nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.out(torch.relu(self.fc(self.norm(h))))


def _residual_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), _Block(64), _Block(64), nn.LayerNorm(64), nn.Linear(64, 16))


class _Checkpointed(nn.Module):
    """The residual stack with its blocks under activation checkpoints (or not)."""

    def __init__(self, checkpointed: bool) -> None:
        super().__init__()
        self.m, self.checkpointed = _residual_model(), checkpointed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.m[0](x)
        for block in (self.m[1], self.m[2]):
            h = torch.utils.checkpoint.checkpoint(block, h, use_reentrant=False, context_fn=mixprec.checkpoint_context_fn
                                                  ) if self.checkpointed else block(h)
        return self.m[4](self.m[3](h))


def _reaches(model: nn.Module, steps: int = 12) -> dict:
    """Train ``model`` under a per-GEMM controller with a backward cost; every layer's saved reach state."""
    ctl = mixprec.Controller(every=4, ladder=("nvfp4", "tensorwise", "compute"), per_gemm=True,
                             max_backward_cost=1e-3)
    ctl.attach(model)
    policy = mixprec.Policy.parse("compute=bf16").fp8("nvfp4", first_last="fp8", controller=ctl.settings,
                                                      backend="emulate_fp32")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(32, 32, generator=gen), torch.randn(32, 16, generator=gen)
        with mixprec.autocast("cpu", policy=policy):
            loss = (model(x).float() - y).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        ctl.step()
    return {n: layer["backward_cost"][4] for n, layer in ctl.state_dict()["layers"].items()}


def test_a_checkpoints_recompute_walks_nothing():
    """Recomputed inside the backward, a checkpointed block's layers neither walk (their graph
    is the recompute's) nor count a window: reaches, gains and walk counts as without checkpoints."""
    assert _reaches(_Checkpointed(True)) == _reaches(_Checkpointed(False))


def test_the_controller_measures_each_layers_reach():
    """A pre-norm residual stack under the controller: the head's error reaches everything (1);
    a block's first layer's (its input gradient joins the stream past the skip) reaches less than
    its second's (which reaches the first at its whole share first); every reach in [0, 1]."""
    reach = {n: state[1] for n, state in _reaches(_residual_model()).items()}
    assert reach["4"] == pytest.approx(1.0, abs=1e-4)  # (bf16 gradients summed in another order)
    assert all(0 <= r <= 1 for r in reach.values())
    assert reach["1.fc"] < reach["1.out"] < 1
    assert reach["2.fc"] < reach["2.out"] < 1


class _SkipsOnce(nn.Module):
    """The residual stack whose second block is left out of a step's first micro-batch (of several)."""

    def __init__(self) -> None:
        super().__init__()
        self.m = _residual_model()

    def forward(self, x: torch.Tensor, m: int, micro: int) -> torch.Tensor:
        h = self.m[1](self.m[0](x))
        return self.m[4](self.m[3](h if micro > 1 and m == 0 else self.m[2](h)))


class _SkipsTheFirst(nn.Module):
    """Two residual blocks before a head, the first controlled layer in the first: a step's first
    micro-batch leaves out the second block, the later ones the first (an expert the router skips)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.m = nn.Sequential(nn.LayerNorm(32), _Block(32), _Block(32), nn.LayerNorm(32), nn.Linear(32, 16))

    def forward(self, x: torch.Tensor, m: int, micro: int) -> torch.Tensor:
        h = self.m[0](x)
        h = self.m[1](h) if micro == 1 or m == 0 else h
        return self.m[4](self.m[3](self.m[2](h) if micro == 1 or m > 0 else h))


def _accumulated(micro: int, steps: int = 16, model: nn.Module | None = None,
                 route: str = "policy") -> tuple[list, dict[str, int]]:
    """Train ``model`` (:class:`_SkipsOnce`) under a per-GEMM controller with a backward cost
    (``route``: a policy's, or ``fp8.convert``'s layers), ``micro`` micro-batches a step (its
    forward told which and of how many); returns each walk as ``(step, micro-batch, walking
    layer, the layers it weighed)`` and each layer's windows asked."""
    model = _SkipsOnce() if model is None else model
    ctl = mixprec.Controller(every=4, ladder=("nvfp4", "tensorwise", "compute"), per_gemm=True, max_backward_cost=1e-3)
    if route == "policy":
        ctl.attach(model)
        policy = mixprec.Policy.parse("compute=bf16").fp8("nvfp4", first_last="fp8", controller=ctl.settings,
                                                          backend="emulate_fp32")
        region = lambda: mixprec.autocast("cpu", policy=policy)  # noqa: E731
    else:
        model = fp8.convert(model, "nvfp4", backend="emulate_fp32", controller=ctl)
        region = lambda: mixprec.autocast("cpu", dtype=torch.bfloat16)  # noqa: E731
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    walks: list = []
    where = [0, 0]
    original, alone = ReachMap.walk, Reach.walk_alone

    def spy(self, reach, start, timed=lambda fn: fn):
        due = reach.due

        def once():  # (a walk that is due: where, which layer, the layers it weighs)
            walks_now = due()
            if walks_now:
                walks.append((*where, reach, list(self.earlier(reach).values())))
            return walks_now
        reach.due = once
        try:
            return original(self, reach, start, timed)
        finally:
            del reach.due

    def never(*args):
        raise AssertionError("a layer walked alone: the joint walk holds every node here")

    ReachMap.walk, Reach.walk_alone = spy, never
    try:
        for step in range(steps):
            x, y = torch.randn(32, 32, generator=gen), torch.randn(32, 16, generator=gen)
            for m in range(micro):
                where[:] = step, m
                with region():
                    loss = (model(x, m, micro).float() - y).square().mean() / micro
                loss.backward()
            opt.step()
            opt.zero_grad()
            ctl.step()
    finally:
        ReachMap.walk, Reach.walk_alone = original, alone
    names = {id(rec.backward.reach): n.removeprefix("m.") for n, rec in ctl._layers.items()}
    walked = [(step, m, names[id(layer)], {names[id(r)] for r in before}) for step, m, layer, before in walks]
    return walked, {n.removeprefix("m."): rec.backward.reach.asked for n, rec in ctl._layers.items()}


def test_under_gradient_accumulation_each_walk_weighs_the_layers_its_own_forward_ran_before():
    """Three micro-batches a step, the first without the second block: a layer walks once a
    window, on its window's first forward (the second block's on the second micro-batch), and
    weighs exactly the layers that forward ran before it, never the earlier micro-batch's later
    ones (another graph, which no walk reaches); its windows asked are one forward a step's."""
    order = ["0", "1.fc", "1.out", "2.fc", "2.out", "4"]
    walked, asked = _accumulated(3)
    single, asked_single = _accumulated(1)
    assert asked == asked_single and len(walked) == len(single)  # (one walk a window, as one forward a step walks)
    assert {name for _, m, name, _ in walked if m == 1} == {"2.fc", "2.out"}  # (left out of the first)
    for step, m, name, before in walked:
        ran = order if m else [n for n in order if not n.startswith("2.")]
        assert before == set(ran[:ran.index(name)]), (step, m, name, before)
    for _, m, name, before in single:
        assert before == set(order[:order.index(name)])


@pytest.mark.parametrize("route", ["policy", "convert"])
def test_a_micro_batch_without_the_first_layer_weighs_only_its_own_forwards_layers(route: str):
    """The first controlled layer left out of the later micro-batches: the second block walks on
    the second micro-batch, over the layers that forward ran before it (none), never the first
    micro-batch's (the map starts over at each forward of the model, a policy's or a converted
    one, not only where its first layer runs again)."""
    walked, asked = _accumulated(2, model=_SkipsTheFirst(), route=route)
    assert {name for _, m, name, _ in walked if m == 1} == {"2.fc", "2.out"}
    # (fp8.convert leaves the first and last Linear out: there the first controlled layer is 1.out)
    ran = {m: [n for n in names if n in asked] for m, names in ((0, ["1.fc", "1.out", "4"]), (1, ["2.fc", "2.out", "4"]))}
    for step, m, name, before in walked:
        assert before == set(ran[m][:ran[m].index(name)]), (step, m, name, before)


def test_a_layer_walks_in_its_first_window_and_every_reach_every_th_after():
    from mixprec.control._reach import REACH_EVERY
    walked = []
    for window in range(2 * REACH_EVERY + 1):
        build, *_ = _residual(window)
        loss, outs = build()
        earlier = Reach(torch.device("cpu"))
        earlier.gain.fill_(1.0)
        reach = Reach(torch.device("cpu"))
        reach.asked = window
        reaches = ReachMap()
        reaches.add(earlier, outs["k"].grad_fn)
        reaches.walk(reach, outs["l"].grad_fn)
        reaches.walk(reach, outs["l"].grad_fn)  # (asked again in the window: no second walk)
        loss.backward()
        walked.append(float(reach.window[1]) > 0)
        assert reach.asked == window + 1
    assert walked == [w % REACH_EVERY == 0 for w in range(2 * REACH_EVERY + 1)]


def test_a_forward_off_the_measured_step_leaves_no_graph_behind():
    """A forward with gradients but no backward (an evaluation without ``no_grad``) on a step that
    measures no backward cost: the controller keeps none of its nodes, so its graph goes with its output."""
    model = _residual_model()
    ctl = mixprec.Controller(every=4, ladder=("nvfp4", "tensorwise", "compute"), per_gemm=True, max_backward_cost=1e-3)
    ctl.attach(model)
    policy = mixprec.Policy.parse("compute=bf16").fp8("nvfp4", first_last="fp8", controller=ctl.settings,
                                                      backend="emulate_fp32")
    x = torch.randn(8, 32, requires_grad=True)  # (held by its graph's gradient accumulator)
    held = weakref.ref(x)
    with mixprec.autocast("cpu", policy=policy):  # step 0 of windows of 4: no shadow step yet
        out = model(x)
    del x, out
    gc.collect()
    assert held() is None


def test_a_converted_models_hook_is_one_and_its_copies_do_nothing():
    """fp8.convert with a Controller hooks the model's forwards once (tracked again: still one);
    a deep copy and a pickle of the model keep a hook that starts no map over (their probes are
    dropped alike) and run."""
    import copy
    import pickle

    from mixprec.control._reach import StartsOver

    ctl = mixprec.Controller(every=4, ladder=("nvfp4", "tensorwise", "compute"), per_gemm=True, max_backward_cost=1e-3)
    model = fp8.convert(_SkipsTheFirst(), "nvfp4", backend="emulate_fp32", controller=ctl)
    ctl.track(model)
    hooks = [h for h in model._forward_pre_hooks.values() if isinstance(h, StartsOver)]
    assert len(hooks) == 1 and hooks[0].reaches is ctl._reaches
    x = torch.randn(4, 32)
    for other in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        (copied,) = [h for h in other._forward_pre_hooks.values() if isinstance(h, StartsOver)]
        assert copied.reaches is None
        with mixprec.autocast("cpu", dtype=torch.bfloat16):
            assert other(x, 0, 1).shape == (4, 16)


def test_a_run_resumed_where_its_reach_rounded_over_one_is_bitwise_the_straight_run():
    """The run that found it (a per-GEMM NVFP4 controller, one shadow step, max_loss_cost 1e-2,
    its state saved after step 30 held a reach of 1 + 1 ulp): it loads, and goes on bitwise."""
    from test_controller_idle_probe import _run

    straight = _run(shadow_steps=1, max_loss_cost=1e-2)
    resumed = _run(shadow_steps=1, max_loss_cost=1e-2, resume_at=30)
    assert resumed[0] == straight[0] and resumed[1] == straight[1]
    assert repr(resumed[2]) == repr(straight[2])
