"""The ZeRO transforms composed by hand: each valid order gives what ``fzero.compile`` gives, bit for bit, and
each invalid composition is refused by name (issue 13). A step's stage is what its three typed parts add up to."""

from __future__ import annotations

import pytest

import fzero
from fzero.step._parts import GradsAllReduce, OptStateReplicated, ParamsReplicated
from fzero.testing import assert_trees_equal
from fzero.zero import GradsInBackward, GradsReduceScatter, OptStateSharded, ParamsSharded
from problems import mlp_problem


def _run(step, prob):
    state = step.init(fzero.params_of(prob.model))
    for b in prob.batches:
        state, metrics = step(state, b)
    return step.gather(state), metrics["loss"]


def _base(prob, mesh):
    return fzero.train_step(prob.loss_fn, fzero.optim.adamw(1e-2, weight_decay=0.1), mesh=mesh)


# (name, the composition by hand, the same step through compile)
COMPOSITIONS = [
    ("stage 1", lambda s, m: fzero.shard_optimizer(s, m), dict(stages=1)),
    ("stage 1, mesh on train_step", lambda s, m: fzero.shard_optimizer(s), dict(stages=1)),
    ("stage 2", lambda s, m: fzero.shard_grads(fzero.shard_optimizer(s, m)), dict(stages=2)),
    ("stage 3", lambda s, m: fzero.shard_params(fzero.shard_grads(fzero.shard_optimizer(s, m))), dict(stages=3)),
    ("stage 1 + cpu", lambda s, m: fzero.offload(fzero.shard_optimizer(s, m), "cpu"), dict(stages=1, offload="cpu")),
    ("offload before shard_grads", lambda s, m: fzero.shard_grads(fzero.offload(fzero.shard_optimizer(s, m), "cpu")),
     dict(stages=2, offload="cpu")),
    ("offload between shard_grads and shard_params",
     lambda s, m: fzero.shard_params(fzero.offload(fzero.shard_grads(fzero.shard_optimizer(s, m)), "cpu")),
     dict(stages=3, offload="cpu")),
    ("stage 3 + cpu params", lambda s, m: fzero.offload(fzero.shard_params(fzero.shard_grads(fzero.shard_optimizer(s, m))), "cpu", params=True),
     dict(stages=3, offload="cpu", offload_params=True)),
    ("stage 3 units and no prefetch", lambda s, m: fzero.shard_params(fzero.shard_grads(fzero.shard_optimizer(s, m)), units=("layers.0",), prefetch=False),
     dict(stages=3, units=("layers.0",), prefetch=False)),
]


@pytest.mark.parametrize("name, by_hand, settings", COMPOSITIONS, ids=[c[0] for c in COMPOSITIONS])
def test_a_composition_by_hand_equals_compile(name, by_hand, settings):
    prob = mlp_problem(steps=2)
    mesh = fzero.local_mesh(2)
    base = _base(prob, mesh if name == "stage 1, mesh on train_step" else None)
    step = by_hand(base, mesh)
    compiled = fzero.compile(prob.loss_fn, optimizer=fzero.optim.adamw(1e-2, weight_decay=0.1), mesh=mesh, **settings)
    assert step.stage == compiled.stage == settings["stages"]
    assert (type(step.params), type(step.grads), type(step.opt_state)) == (type(compiled.params), type(compiled.grads), type(compiled.opt_state))
    params, loss = _run(step, prob)
    expected, expected_loss = _run(compiled, prob)
    assert loss == expected_loss
    assert_trees_equal(params, expected)


def test_each_transform_replaces_its_parts():
    prob = mlp_problem(steps=1)
    s0 = _base(prob, None)
    s1 = fzero.shard_optimizer(s0, fzero.local_mesh(2))
    s2 = fzero.shard_grads(s1)
    s3 = fzero.shard_params(s2, remat=True)
    s3o = fzero.offload(s3, "cpu")
    assert (s0.params, s0.grads, s0.opt_state, s0.stage) == (ParamsReplicated(), GradsAllReduce(), OptStateReplicated(), 0)
    assert (s1.params, s1.grads, s1.opt_state, s1.stage) == (ParamsReplicated(), GradsReduceScatter(), OptStateSharded(), 1)
    assert (s2.params, s2.grads, s2.opt_state, s2.stage) == (ParamsReplicated(), GradsInBackward(), OptStateSharded(), 2)
    assert (s3.params, s3.grads, s3.stage, s3.unit_settings.remat) == (ParamsSharded(), GradsInBackward(), 3, True)
    assert s3o.opt_state.offload.where == "cpu" and s3o.offload is s3o.opt_state.offload and s3.offload is None
    r1 = fzero.remat_units(s1)  # a setting of the step, at any stage: the parts stay
    assert (r1.params, r1.grads, r1.opt_state, r1.stage, r1.unit_settings.remat) == (s1.params, s1.grads, s1.opt_state, 1, True)
    assert fzero.compile(prob.loss_fn, stages=1, mesh=fzero.local_mesh(2), remat=True).unit_settings == r1.unit_settings


def _stage(k, prob):
    s = _base(prob, fzero.local_mesh(2))
    for t in (fzero.shard_optimizer, fzero.shard_grads, fzero.shard_params)[:k]:
        s = t(s)
    return s


INVALID = [
    ("shard_grads without shard_optimizer", lambda p: fzero.shard_grads(_stage(0, p)), r"fzero.shard_grads: needs fzero.shard_optimizer inside it"),
    ("shard_params without shard_grads", lambda p: fzero.shard_params(_stage(1, p)), r"fzero.shard_params: needs fzero.shard_grads inside it"),
    ("shard_params on stage 0", lambda p: fzero.shard_params(_stage(0, p)), r"fzero.shard_params: needs fzero.shard_grads inside it"),
    ("offload without shard_optimizer", lambda p: fzero.offload(_stage(0, p), "cpu"), r"fzero.offload: needs fzero.shard_optimizer inside it"),
    ("offloaded params below stage 3", lambda p: fzero.offload(_stage(2, p), "cpu", params=True), r"params=True offloads param shards, which exist at stage 3 only"),
    ("shard_optimizer twice", lambda p: fzero.shard_optimizer(_stage(1, p)), r"fzero.shard_optimizer: the step is already stage 1"),
    ("shard_grads twice", lambda p: fzero.shard_grads(_stage(2, p)), r"fzero.shard_grads: the step already reduces gradients in backward"),
    ("shard_params twice", lambda p: fzero.shard_params(_stage(3, p)), r"fzero.shard_params: the step already shards its params"),
    ("offload twice", lambda p: fzero.offload(fzero.offload(_stage(1, p), "cpu"), "cpu"), r"fzero.offload: the step already offloads to 'cpu'"),
    ("a module, not a step", lambda p: fzero.shard_optimizer(p.model), r"fzero.shard_optimizer: expected a Step from fzero.train_step"),
    ("unit sizes at stage 2", lambda p: fzero.shard_grads(fzero.shard_optimizer(fzero.train_step(p.loss_fn, fzero.optim.sgd(0.1), unit_elements=64), fzero.local_mesh(2))),
     r"fzero.shard_grads: the step was built with unit_elements=64, but from stage 2 on units are modules"),
]


@pytest.mark.parametrize("name, compose, message", INVALID, ids=[c[0] for c in INVALID])
def test_an_invalid_composition_is_refused_by_name(name, compose, message):
    prob = mlp_problem(steps=1)
    with pytest.raises((ValueError, TypeError), match=message):
        compose(prob)
