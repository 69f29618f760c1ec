"""Simulated ranks are isolated, and ranks must agree (issue 12).

* Each rank thread of ``local_mesh(n)`` draws from its own RNG stream, a copy of the global generator
  at the start of each step; afterwards the global generator holds rank 0's final state. So a dropout
  model trains the same run after run, each rank draws what a separate process would, a one-rank mesh
  or no mesh consumes the global generator exactly as plain PyTorch, and ``torchrun`` equals
  ``local_mesh(2)`` bitwise.
* Ranks that run different collectives, or hold different layouts, get an error naming both ranks'
  side instead of training on silently mismatched buffers.
* ``units=`` entries that name no module raise, naming the closest module path.
"""

import os
import threading
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fzero
from fzero.mesh._comm import MeshTimeout, RanksDisagree
from fzero.step._state import RankStates
from fzero.testing import assert_trees_equal
from problems import PROBLEMS, Problem, fzero_run, reference_run
from ranks_worker import SEED, dropout_problem, train
from launch import torchrun

HERE = os.path.dirname(__file__)


def _rank() -> int:
    """This thread's rank on a local mesh of several ranks (0 in the main thread)."""
    name = threading.current_thread().name
    return int(name.removeprefix("fzero-rank")) if name.startswith("fzero-rank") else 0


# -- (A) one RNG stream per rank --------------------------------------------------------------------


@pytest.mark.parametrize("autodiff", ["func", "autograd"])
@pytest.mark.parametrize("stages", [0, 1, 2, 3])
def test_dropout_training_is_the_same_run_after_run(stages, autodiff):
    prob = dropout_problem()
    runs = [train(prob, stages=stages, mesh=fzero.local_mesh(2), autodiff=autodiff) for _ in range(3)]
    (first, first_losses), *others = runs
    for history, losses in others:
        assert losses == first_losses
        for a, b in zip(history, first):
            assert_trees_equal(a, b)


class _Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6))

    def forward(self, x):
        return self.layers(x)


@pytest.mark.parametrize("autodiff", ["func", "autograd"])
@pytest.mark.parametrize("stages", [0, 1, 2, 3])
def test_each_rank_draws_what_a_separate_process_draws(stages, autodiff):
    """Rank 1 draws more numbers than rank 0 (its data says so), then both draw a dropout mask and a
    permutation: each equals what a process of its own draws from the same seed, step after step, each rank going
    on from its own stream as a torchrun process does (rank 1 used to restart from rank 0's state at every step,
    which torchrun's rank 1 never does). Between steps the global generator goes on as rank 0's."""
    torch.manual_seed(0)
    model = _Plain()
    draws: dict[int, list] = {0: [], 1: []}

    def rank_draws(k: int):
        torch.rand(k)  # a rank-dependent amount of randomness (LayerDrop-like decisions, for instance)
        mask = F.dropout(torch.ones(4, 6), 0.5, training=True)
        return mask, torch.randperm(6), torch.randn(3)

    def loss_fn(params, b):
        mask, perm, noise = rank_draws(int(b["k"][0]))
        draws[_rank()].append((mask.clone(), perm.clone(), noise.clone()))
        out = fzero.apply(model, params, b["x"][:, perm])
        return F.mse_loss(out * mask, b["y"])

    steps = 3
    batch = {"x": torch.randn(8, 6), "y": torch.randn(8, 6), "k": torch.tensor([1] * 4 + [5] * 4)}
    step = fzero.compile(loss_fn, optimizer=fzero.optim.sgd(0.1), stages=stages, mesh=fzero.local_mesh(2), autodiff=autodiff)
    state = step.init(fzero.params_of(model))
    torch.manual_seed(SEED)
    for _ in range(steps):
        state, _ = step(state, batch)
    after = torch.get_rng_state()

    # the reference: two "processes" from one seed, each going on with its own generator
    torch.manual_seed(SEED)
    own = {0: torch.get_rng_state(), 1: torch.get_rng_state()}
    expected: dict[int, list] = {0: [], 1: []}
    for _ in range(steps):
        for rank, k in ((0, 1), (1, 5)):
            torch.set_rng_state(own[rank])
            expected[rank].append(rank_draws(k))
            own[rank] = torch.get_rng_state()
    torch.set_rng_state(own[0])
    assert torch.equal(after, torch.get_rng_state())
    for rank in (0, 1):
        assert len(draws[rank]) == steps
        for got, want in zip(draws[rank], expected[rank]):
            for g, w in zip(got, want):
                assert torch.equal(g, w)
    assert not torch.equal(draws[0][0][0], draws[1][0][0])  # the ranks' streams really went apart


@pytest.mark.parametrize("stages", [0, 3])
def test_manual_seed_inside_loss_fn_seeds_the_rank_as_in_a_torchrun_process(stages):
    """``torch.manual_seed`` in ``loss_fn`` (a per-step reseed, HF's ``set_seed``) seeds the calling rank's stream, as
    it seeds its own process's generator under torchrun: the dropout masks follow it and the outer seed no longer
    matters (before: it seeded the shared global generator, which the ranks do not draw from, so the run depended on
    the outer seed, 0.7338 vs 0.7925 as the first loss). Afterwards the global generator goes on as rank 0's."""
    def run(outer: int):
        prob = dropout_problem(steps=2)

        def loss_fn(params, b):
            torch.manual_seed(int(b["seed"][0]))
            return F.mse_loss(fzero.apply(prob.model, params, b["x"]), b["y"])

        step = fzero.compile(loss_fn, optimizer=fzero.optim.sgd(0.1), stages=stages, mesh=fzero.local_mesh(2))
        state = step.init(fzero.params_of(prob.model))
        torch.manual_seed(outer)
        losses = []
        for i, b in enumerate(prob.batches):
            state, m = step(state, {**b, "seed": torch.full((8,), 100 + i)})
            losses.append(m["loss"])
        return losses, step.gather(state), torch.rand(3)

    (a, pa, after), (b, pb, after_other) = run(7), run(8)
    assert all(torch.equal(torch.as_tensor(x), torch.as_tensor(y)) for x, y in zip(a, b))
    assert_trees_equal(pa, pb)
    assert torch.equal(after, after_other)  # the global generator went on as rank 0's, reseeded in loss_fn: not the outer seed's
    mesh = fzero.local_mesh(2)
    torch.manual_seed(0)
    drawn = mesh.run(lambda comm: (torch.manual_seed(5), torch.rand(3))[1], [(), ()])
    torch.manual_seed(5)
    expected = torch.rand(3)
    assert torch.equal(drawn[0], expected) and torch.equal(drawn[1], expected)
    assert torch.equal(torch.rand(2), (torch.manual_seed(5), torch.rand(3), torch.rand(2))[2])  # rank 0's, gone on


def test_python_random_and_numpy_draws_are_each_ranks_own_as_in_torchrun_processes():
    """Python's ``random`` and ``np.random`` (HF Wav2Vec2/HuBERT draw SpecAugment masks and LayerDrop from it) give
    each rank of a local mesh its own stream, a copy of the global one at the start, going on from run to run, and
    ``random.seed``/``np.random.seed`` in a rank seed that rank's (before: the threads shared one stream, so rank 1
    drew what rank 0 left, in whatever order the threads ran: two runs of a tiny Wav2Vec2 from one seed started
    171.599 and 171.655, torchrun's 171.858). Afterwards the global streams go on as rank 0's."""
    import random

    np = pytest.importorskip("numpy")
    mesh = fzero.local_mesh(2)

    def draw(comm, k):
        for _ in range(k):
            random.random()  # a rank-dependent amount, as data-dependent sampling
        return random.random(), float(np.random.rand()), random.getstate() == random.getstate()

    def process(k, py, npst):  # one torchrun process: its own copy of the module streams
        random.setstate(py)
        np.random.set_state(npst)
        out = draw(None, k)
        return out, random.getstate(), np.random.get_state()

    random.seed(3)
    np.random.seed(4)
    py0, np0 = random.getstate(), np.random.get_state()
    runs = [mesh.run(draw, [(0,), (2,)]) for _ in range(2)]
    after = (random.random(), float(np.random.rand()))
    own = {0: (py0, np0), 1: (py0, np0)}
    for got in runs:
        for rank, k in ((0, 0), (1, 2)):
            want, *own[rank] = process(k, *own[rank])
            assert got[rank] == want
    random.setstate(own[0][0])
    np.random.set_state(own[0][1])
    assert after == (random.random(), float(np.random.rand()))
    seeded = mesh.run(lambda comm: (random.seed(9), np.random.seed(9), random.random(), float(np.random.rand()))[2:],
                      [(), ()])
    random.seed(9)
    np.random.seed(9)
    assert seeded[0] == seeded[1] == (random.random(), float(np.random.rand()))
    assert random.random.__self__ is random._inst and np.random.rand.__self__ is np.random.mtrand._rand  # put back


@pytest.mark.parametrize("mesh", [None, 1], ids=["no-mesh", "local_mesh(1)"])
@pytest.mark.parametrize("autodiff", ["func", "autograd"])
def test_one_rank_trains_dropout_as_plain_pytorch(mesh, autodiff):
    """One rank draws from torch's global generator itself: the same masks as a plain loop, and the
    generator is left where the plain loop leaves it."""
    prob = dropout_problem()
    torch.manual_seed(SEED)
    expected, losses = reference_run(prob, fused=True)
    after_reference = torch.get_rng_state()
    torch.manual_seed(SEED)
    got, metrics = fzero_run(prob, stages=0, mesh=None if mesh is None else fzero.local_mesh(mesh), autodiff=autodiff)
    assert torch.equal(torch.get_rng_state(), after_reference)
    assert [m["loss"] for m in metrics] == losses
    for g, e in zip(got, expected):
        assert_trees_equal(g, e)


def test_remat_in_a_rank_thread_replays_its_own_stream():
    """fzero.remat's recompute replays the rank's stream: the same dropout masks as without remat, hence
    the same training, bit for bit (a replay of the shared global generator would draw other masks)."""
    prob = dropout_problem()

    def remat_loss(params, b):
        out = fzero.remat(lambda p, x: fzero.apply(prob.model, p, x))(params, b["x"])
        return F.mse_loss(out, b["y"])

    plain, plain_losses = train(prob, stages=0, mesh=fzero.local_mesh(2))
    rematted, losses = train(Problem(prob.model, remat_loss, prob.batches), stages=0, mesh=fzero.local_mesh(2))
    assert losses == plain_losses
    for a, b in zip(rematted, plain):
        assert_trees_equal(a, b)


def test_evaluate_draws_from_rank_streams_too():
    prob = dropout_problem()
    step = fzero.compile(prob.loss_fn, stages=0, mesh=fzero.local_mesh(2))
    state = step.init(fzero.params_of(prob.model))
    results = []
    for _ in range(3):
        torch.manual_seed(SEED)
        results.append((step.evaluate(state, prob.batches[0])["loss"], torch.get_rng_state()))
    assert all(r[0] == results[0][0] and torch.equal(r[1], results[0][1]) for r in results)


def run_torchrun(tmp_path, case: str, stages: int) -> str:
    out = tmp_path / f"{case}-{stages}.pt"
    torchrun([os.path.join(HERE, "ranks_worker.py"), "--case", case, "--stages", str(stages), "--out", str(out)])
    return str(out)


@pytest.mark.torchrun
@pytest.mark.parametrize("stages", [0, 3])
def test_torchrun_equals_local_mesh_with_dropout(tmp_path, one_thread, stages):
    dist = torch.load(run_torchrun(tmp_path, "dropout", stages), weights_only=False)
    local, losses = train(dropout_problem(), stages=stages, mesh=fzero.local_mesh(2))
    assert dist["losses"] == losses
    assert len(dist["history"]) == len(local) == 4
    for d, l in zip(dist["history"], local):
        assert_trees_equal(d, l)
    assert torch.equal(dist["rng"], torch.get_rng_state())  # this process goes on as rank 0's did


# -- (B) ranks must agree -----------------------------------------------------------------------------


def _mismatch(calls) -> RanksDisagree:
    """Run ``calls[rank](comm)`` on each rank of a 2-rank mesh; the error it raises."""
    mesh = fzero.local_mesh(2, timeout=60)
    start = time.monotonic()
    with pytest.raises(RanksDisagree) as info:
        mesh.run(lambda comm: calls[comm.rank](comm), [(), ()])
    assert time.monotonic() - start < 30  # at once, not after the timeout
    assert not isinstance(info.value, MeshTimeout)
    return info.value


@pytest.mark.parametrize(
    "calls, message",
    [
        ((lambda c: c.all_gather(torch.zeros(8), torch.zeros(4), tag="params", label="blocks.1"),
          lambda c: c.all_gather(torch.zeros(8), torch.zeros(4), tag="params", label="blocks.0")),
         "ranks disagree at collective #1: rank 0 all_gather params 'blocks.1' 8 x float32, "
         "rank 1 all_gather params 'blocks.0' 8 x float32"),
        ((lambda c: c.reduce_scatter(torch.zeros(8), tag="grads"), lambda c: c.reduce_scatter(torch.zeros(16), tag="grads")),
         "rank 0 reduce_scatter grads 8 x float32, rank 1 reduce_scatter grads 16 x float32"),
        ((lambda c: c.all_reduce(torch.zeros(4), tag="metrics"), lambda c: c.all_reduce(torch.zeros(4, dtype=torch.bfloat16), tag="metrics")),
         "rank 0 all_reduce metrics 4 x float32, rank 1 all_reduce metrics 4 x bfloat16"),
        ((lambda c: c.broadcast(torch.zeros(4), src=0, tag="init"), lambda c: c.all_reduce(torch.zeros(4), tag="init")),
         "rank 0 broadcast init from rank 0 4 x float32, rank 1 all_reduce init 4 x float32"),
        ((lambda c: c.all_reduce(torch.zeros(4), tag="metrics"),
          lambda c: (c.all_reduce(torch.zeros(4), tag="metrics"), c.all_reduce(torch.zeros(2), tag="metrics"))),
         "ranks disagree at collective #2: rank 0 finished its program .no more collectives., rank 1 all_reduce metrics 2 x float32"),
    ],
    ids=["label", "numel", "dtype", "op", "count"],
)
def test_thread_mesh_names_both_ranks_calls_when_collectives_differ(calls, message):
    err = _mismatch(calls)
    assert str(err).startswith("fzero.local_mesh(2): ")
    assert "every rank must run the same model with the same units" in str(err).lower()
    import re

    assert re.search(message, str(err)), str(err)


def test_matching_collectives_pass_and_are_counted_with_their_labels():
    mesh = fzero.count_collectives(fzero.local_mesh(2))

    def program(comm):
        out = comm.all_gather(torch.zeros(4), torch.full((2,), float(comm.rank)), tag="params", label="blocks.0")
        pending = comm.all_gather_async(torch.zeros(4), torch.full((2,), 2.0 + comm.rank), tag="params", label="blocks.1")
        total = comm.all_reduce(torch.ones(1), tag="metrics")
        return out, pending.wait(), total

    results = mesh.run(program, [(), ()])
    assert torch.equal(results[1][0], torch.tensor([0.0, 0, 1, 1])) and torch.equal(results[0][1], torch.tensor([2.0, 2, 3, 3]))
    assert float(results[0][2]) == 2.0
    # the thread mesh runs an async gather when it is waited for, after the all-reduce here
    assert [c.label for c in mesh.counter.calls if c.rank == 0] == ["blocks.0", None, "blocks.1"]


class _LayerDrop(nn.Module):
    """Skips block 1 where the batch says so: a data-dependent skip, decided differently per rank."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 32), nn.Linear(32, 8)])
        self.skip = nn.Linear(8, 32)

    def forward(self, x, drop):
        h = self.blocks[0](x)
        h = self.skip(h) if drop else self.blocks[1](h)
        return self.blocks[2](h)


@pytest.mark.parametrize("autodiff", ["func", "autograd"])
@pytest.mark.parametrize("stages", [2, 3])
def test_ranks_that_run_different_units_raise(stages, autodiff):
    torch.manual_seed(0)
    model = _LayerDrop()

    def loss_fn(params, b):
        return F.mse_loss(fzero.apply(model, params, b["x"], bool(b["drop"][0])), b["y"])

    step = fzero.compile(loss_fn, optimizer=fzero.optim.sgd(0.1), stages=stages, mesh=fzero.local_mesh(2), autodiff=autodiff)
    state = step.init(fzero.params_of(model))
    batch = {"x": torch.randn(4, 8), "y": torch.randn(4, 8), "drop": torch.tensor([0, 0, 1, 1])}
    with pytest.raises(RanksDisagree, match=r"fzero.local_mesh\(2\): ranks disagree at collective #\d+: rank 0 .*, rank 1 "):
        step(state, batch)


@pytest.mark.parametrize("stages", [0, 1, 2, 3])
def test_ranks_with_different_models_raise_on_local_mesh(stages):
    """Rank 0 holds a model of hidden width 8, rank 1 of width 16 (states assembled by hand, each rank
    running its own model). Padded to the same unit sizes, their collectives would pair up and train
    silently wrong; the step names the first difference instead."""
    models = [dropout_problem(width=8).model, dropout_problem(width=16).model]

    def loss_fn(params, b):
        return F.mse_loss(fzero.apply(models[_rank()], params, b["x"]), b["y"])

    step = fzero.compile(loss_fn, optimizer=fzero.optim.sgd(0.1), stages=stages, mesh=fzero.local_mesh(2))
    states = [step.init(fzero.params_of(m)) for m in models]
    state = RankStates((states[0][0], states[1][1]))
    batch = {"x": torch.randn(4, 8), "y": torch.randn(4, 4)}
    # params are packed in the model's order (stages 0-1) or sorted within a module unit (stages 2-3)
    message = (r"fzero.Step.__call__: ranks disagree on the shape of 'blocks.0.lin.(weight': rank 0 has \(8, 8\), rank 1 has "
               r"\(16, 8\)|bias': rank 0 has \(8,\), rank 1 has \(16,\))\. Every rank must build the same model")
    with pytest.raises(RanksDisagree, match=message) as info:
        step(state, batch)
    assert "(raised on rank 0 of fzero.local_mesh(2))" in info.value.__notes__
    with pytest.raises(RanksDisagree, match=message.replace("__call__", "evaluate")):
        step.evaluate(state, batch)


@pytest.mark.torchrun
@pytest.mark.parametrize("stages", [2, 3])
def test_torchrun_ranks_with_different_models_raise_at_init(tmp_path, stages):
    out = run_torchrun(tmp_path, "widths", stages)
    for rank in (0, 1):
        message = torch.load(f"{out}.{rank}", weights_only=False)["message"]
        assert message is not None, f"rank {rank} trained with a model unlike rank {1 - rank}'s"
        assert message.startswith("RanksDisagree: fzero.Step.init: ranks disagree on the shape of 'blocks.0.lin.bias': "
                                  "rank 0 has (8,), rank 1 has (16,). Every rank must build the same model"), message


def test_ranks_agree_lists_the_first_difference_in_order():
    from fzero.mesh._comm import first_difference

    a = [("the ZeRO stage", 3), ("unit #0", "'a'"), ("the shape of 'a.w'", (2,))]
    assert first_difference([a, list(a)]) is None
    assert first_difference([a, [("the ZeRO stage", 2), ("unit #0", "'b'")]]) == ("the ZeRO stage", 1, 3, 2)
    assert first_difference([a, a, a[:2]]) == ("the shape of 'a.w'", 2, (2,), "(nothing: no such field)")
    assert first_difference([a[:1], a]) == ("unit #0", 1, "(nothing: no such field)", "'a'")


# -- (C) units= that match no module ------------------------------------------------------------------


@pytest.mark.parametrize("stages", [2, 3])
@pytest.mark.parametrize(
    "units, message",
    [
        (("enc.layer.0",), r"units entry 'enc.layer.0' matches no module with trainable parameters .* closest module path is 'enc.layers.0'"),
        (("enc.layers.0", "shared.O"), r"units entry 'shared.O' .* closest module path is 'shared.0'"),
        (("enc.layers.0.lin.weight",), r"units entry 'enc.layers.0.lin.weight' matches no module .* It is a parameter, not a module; the module that holds it is 'enc.layers.0.lin'"),
        (("nope",), r"units entry 'nope' matches no module with trainable parameters .*fzero.units_of\(model"),
    ],
    ids=["typo", "one-of-two", "a-parameter", "nothing-close"],
)
def test_units_that_match_no_module_raise(stages, units, message):
    prob = PROBLEMS["any"](steps=1)
    step = fzero.compile(prob.loss_fn, stages=stages, mesh=fzero.local_mesh(2), units=units)
    with pytest.raises(ValueError, match=r"^fzero.Step.init: " + message):
        step.init(fzero.params_of(prob.model))


def test_units_that_name_modules_are_accepted():
    prob = PROBLEMS["any"](steps=1)
    units = fzero.units_of(prob.model)
    step = fzero.compile(prob.loss_fn, stages=3, mesh=fzero.local_mesh(2), units=units)
    state = step.init(fzero.params_of(prob.model))
    assert {u.name for u in state[0].meta.layout.units} >= set(units)
    step(state, prob.batches[0])


def test_a_reseed_between_steps_restarts_every_rank_from_it():
    """Between two runs of a local mesh, ``torch.manual_seed`` (as every process of a torchrun job would run it) starts
    every rank from the seed again; without it each rank goes on from its own stream (the test above)."""
    mesh = fzero.local_mesh(2)

    def draw(comm, k):
        return torch.rand(k)

    torch.manual_seed(3)
    mesh.run(draw, [(1,), (5,)])  # the ranks end in different states
    torch.manual_seed(4)
    again = mesh.run(draw, [(2,), (2,)])
    torch.manual_seed(4)
    assert torch.equal(again[0], torch.rand(2)) and torch.equal(again[1], again[0])


def test_a_generate_that_stops_at_another_length_on_each_rank_is_named_with_the_fix():
    """At stage 3 every new token runs the units, so ranks whose generation ends at different lengths issue different
    collectives: the error names generate and the fixes (DeepSpeed ZeRO-3 users know synced_gpus=True)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=16, n_positions=32, n_embd=16, n_layer=2,
                                                                 n_head=2, pad_token_id=0)).eval()
    prompts = torch.tensor([[4, 5, 6], [7, 8, 9]])  # one row per rank
    with torch.no_grad():  # greedy: rank 0's first new token is the end of its sequence, rank 1's is not
        first = model(prompts).logits[:, -1].argmax(-1)
    assert first[0] != first[1]
    eos = int(first[0])

    def loss_fn(params, ids):
        with torch.no_grad():
            out = fzero.apply(model.generate, params, ids, max_new_tokens=6, do_sample=False, eos_token_id=eos,
                              attention_mask=torch.ones_like(ids))
        return fzero.apply(model, params, input_ids=out, labels=out).loss

    step = fzero.compile(loss_fn, stages=3, mesh=fzero.local_mesh(2, timeout=60))
    state = step.init(fzero.params_of(model))
    with pytest.raises(RanksDisagree, match=r"ranks disagree at collective .*model\.generate that stops at another "
                                            r"length on each rank.*min_new_tokens=max_new_tokens.*synced_gpus=True"):
        step(state, prompts)


@pytest.mark.torchrun
def test_generate_with_synced_gpus_at_stage3_under_torchrun_runs_each_rank_to_its_own_length(tmp_path):
    """What the error above tells a user to do works: each rank generates what the plain model generates (rank 0 one
    token, rank 1 six), and the step's loss is the mean of the plain model's losses on them."""
    pytest.importorskip("transformers")
    out = tmp_path / "g.pt"
    torchrun([os.path.join(HERE, "generate_worker.py"), "--out", str(out)])
    got = torch.load(out, weights_only=True)
    lengths = []
    for rank in got["ranks"]:
        assert torch.equal(rank["fzero"], rank["plain"])
        lengths.append(rank["fzero"].shape[1])
    assert lengths == [4, 9]
    assert got["loss"] == pytest.approx(sum(r["plain_loss"] for r in got["ranks"]) / 2, rel=1e-6)
