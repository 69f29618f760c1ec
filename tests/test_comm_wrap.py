"""fzero.wrap_comm: a transform of a mesh's comms reaches every collective of a step, at every stage."""

import collections

import pytest
import torch

import fzero
from fzero.testing import assert_trees_equal
from problems import PROBLEMS

LR = 0.05


class Recorder(fzero.CommWrapper):
    """Counts every collective by (op, tag); changes nothing."""

    def __init__(self, inner, seen):
        super().__init__(inner)
        self.seen = seen

    def _count(self, op, tag):
        self.seen[(op, tag)] += 1

    def all_gather(self, out, shard, *, tag, label=None):
        self._count("all_gather", tag)
        return self.inner.all_gather(out, shard, tag=tag, label=label)

    def all_gather_async(self, out, shard, *, tag, label=None):
        self._count("all_gather", tag)
        return self.inner.all_gather_async(out, shard, tag=tag, label=label)

    def reduce_scatter(self, full, *, tag, label=None, out=None):
        self._count("reduce_scatter", tag)
        return self.inner.reduce_scatter(full, tag=tag, label=label, out=out)

    def reduce_scatter_async(self, full, *, tag, label=None, out=None):
        self._count("reduce_scatter", tag)
        return self.inner.reduce_scatter_async(full, tag=tag, label=label, out=out)

    def all_reduce(self, tensor, *, tag, label=None):
        self._count("all_reduce", tag)
        return self.inner.all_reduce(tensor, tag=tag, label=label)

    def all_reduce_async(self, tensor, *, tag, label=None):
        self._count("all_reduce", tag)
        return self.inner.all_reduce_async(tensor, tag=tag, label=label)


class HalvedGradients(fzero.CommWrapper):
    """A stand-in for a lossy gradient compression: every reduced gradient comes back halved (exact in floating
    point), so SGD moves each param by half its step: the run must equal one with half the learning rate."""

    def reduce_scatter(self, full, *, tag, label=None, out=None):
        return _halved(self.inner.reduce_scatter(full, tag=tag, label=label, out=out), tag)

    def reduce_scatter_async(self, full, *, tag, label=None, out=None):
        pending = self.inner.reduce_scatter_async(full, tag=tag, label=label, out=out)
        return self.then(pending, lambda t: _halved(t, tag))

    def all_reduce(self, tensor, *, tag, label=None):
        return _halved(self.inner.all_reduce(tensor, tag=tag, label=label), tag)

    def all_reduce_async(self, tensor, *, tag, label=None):
        pending = self.inner.all_reduce_async(tensor, tag=tag, label=label)
        return self.then(pending, lambda t: _halved(t, tag))


def _halved(t, tag):
    return t.mul_(0.5) if tag == "grads" else t


def _run(prob, *, stages, mesh, lr):
    step = fzero.compile(prob.loss_fn, optimizer=fzero.optim.sgd(lr), stages=stages, mesh=mesh,
                         **({"unit_elements": 2048} if stages < 2 else {}))
    state = step.init(fzero.params_of(prob.model))
    out = []
    for b in prob.batches:
        state, m = step(state, b)
        out.append((step.gather(state), m["loss"]))
    return out


@pytest.mark.parametrize("stages", [0, 1, 2, 3])
def test_a_wrapper_sees_every_collective_and_changes_nothing_by_itself(stages):
    prob = PROBLEMS["gpt"](steps=2)
    seen = collections.Counter()
    mesh = fzero.local_mesh(2)
    wrapped = _run(prob, stages=stages, mesh=fzero.wrap_comm(mesh, lambda comm: Recorder(comm, seen)), lr=LR)
    plain = _run(prob, stages=stages, mesh=mesh, lr=LR)
    for (a, la), (b, lb) in zip(wrapped, plain):
        assert_trees_equal(a, b)
        assert la == lb
    grads = "all_reduce" if stages == 0 else "reduce_scatter"
    assert seen[(grads, "grads")] > 0 and seen[("all_reduce", "metrics")] > 0
    if stages == 3:
        assert seen[("all_gather", "params")] > 0  # the units' gathers go through it too
    counted = fzero.count_collectives(mesh)
    _run(prob, stages=stages, mesh=counted, lr=LR)
    by_op = collections.Counter()
    for call in counted.counter.calls:
        by_op[(call.op, call.tag)] += 1
    assert seen == by_op  # every collective the mesh ran (both ranks), and no other


@pytest.mark.parametrize("stages", [0, 1, 2, 3])
def test_a_wrapper_that_changes_the_gradients_changes_the_training(stages):
    prob = PROBLEMS["mlp"](steps=3)
    halved = _run(prob, stages=stages, mesh=fzero.wrap_comm(fzero.local_mesh(2), HalvedGradients), lr=LR)
    half_lr = _run(prob, stages=stages, mesh=fzero.local_mesh(2), lr=LR / 2)
    full_lr = _run(prob, stages=stages, mesh=fzero.local_mesh(2), lr=LR)
    for (a, _), (b, _) in zip(halved, half_lr):
        assert_trees_equal(a, b)
    assert not all(torch.equal(halved[-1][0][k], full_lr[-1][0][k]) for k in full_lr[-1][0])


def test_wrappers_compose_and_bad_arguments_are_refused():
    seen = collections.Counter()
    mesh = fzero.wrap_comm(fzero.wrap_comm(fzero.local_mesh(2), HalvedGradients), lambda comm: Recorder(comm, seen))
    prob = PROBLEMS["mlp"](steps=1)
    half_lr = _run(prob, stages=1, mesh=fzero.local_mesh(2), lr=LR / 2)
    got = _run(prob, stages=1, mesh=mesh, lr=LR)
    assert_trees_equal(got[0][0], half_lr[0][0])  # the inner wrapper still halves
    assert seen[("reduce_scatter", "grads")] > 0  # and the outer one sees the calls
    with pytest.raises(TypeError, match=r"fzero\.wrap_comm: expected a mesh from fzero\.local_mesh or fzero\.dist_mesh, got 2"):
        fzero.wrap_comm(2, HalvedGradients)
    with pytest.raises(TypeError, match=r"fzero\.wrap_comm: wrapper must be a function comm -> comm"):
        fzero.wrap_comm(fzero.local_mesh(2), "zip")
    assert isinstance(HalvedGradients(object()), fzero.CommWrapper)


def test_a_dist_mesh_hands_the_step_its_wrapped_comm(monkeypatch):
    # one process as a one-rank torch.distributed job (gloo over an in-memory store): the comm DistMesh makes for
    # the step goes through the wrapper too
    import torch.distributed as dist

    monkeypatch.setattr("fzero.mesh._mesh.fault_board", lambda timeout: None)  # no torchrun store behind this group
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        seen = collections.Counter()
        mesh = fzero.wrap_comm(fzero.DistMesh(size=1, rank=0, backend="gloo"), lambda comm: Recorder(comm, seen))
        assert isinstance(mesh.comm(api="a test"), Recorder)
        prob = PROBLEMS["mlp"](steps=1)
        got = _run(prob, stages=3, mesh=mesh, lr=LR)
        want = _run(prob, stages=3, mesh=fzero.local_mesh(1), lr=LR)
        assert_trees_equal(got[0][0], want[0][0])
        assert seen[("all_reduce", "metrics")] == 1 and seen[("all_gather", "params")] > 0
    finally:
        dist.destroy_process_group()
