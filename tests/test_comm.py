"""Communication volume per rank per step, from the counting wrapper (``fzero.count_collectives``).

Stages 0-2 move 2Ψ·(N-1)/N elements per rank per step for params and gradients: an all-reduce at stage
0, a reduce-scatter plus an all-gather at stages 1 and 2. Ψ here is the padded size of the flat units
(fewer than N·SHARD_ALIGN padding elements per unit), and the few-element metrics all-reduce is counted apart.
"""

import pytest

import fzero
from fzero.layout._layout import SHARD_ALIGN
from problems import PROBLEMS


@pytest.mark.parametrize("stages", [0, 1, 2])
@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_two_psi_elements_per_rank_per_step(stages, ranks):
    prob = PROBLEMS["gpt"](steps=3)
    mesh = fzero.count_collectives(fzero.local_mesh(ranks))
    step = fzero.compile(prob.loss_fn, optimizer=fzero.optim.adamw(1e-3), stages=stages, mesh=mesh,
                         **({"unit_elements": 4096} if stages < 2 else {}))
    state = step.init(fzero.params_of(prob.model))
    layout = state[0].meta.layout
    psi, padded = layout.numel, layout.padded_numel
    assert psi <= padded <= psi + len(layout.units) * (ranks * SHARD_ALIGN - 1)
    mesh.counter.reset()  # init's own traffic is not a step's
    for b in prob.batches:
        state, _ = step(state, b)
    for rank in range(ranks):
        moved = mesh.counter.elements(rank=rank, tag="grads") + mesh.counter.elements(rank=rank, tag="params")
        assert moved / 3 == pytest.approx(2 * padded * (ranks - 1) / ranks, abs=1e-9)
        # metrics: one all-reduce per step of 2 elements (loss, squared grad norm) and one per param (whether some
        # rank's gradient used it: torch's grad=None, see fzero.step._context)
        assert mesh.counter.count(rank=rank, tag="metrics") == 3
        metrics = 2 + len(layout.paths)
        assert mesh.counter.elements(rank=rank, tag="metrics") == pytest.approx(3 * metrics * 2 * (ranks - 1) / ranks)
    calls = mesh.counter.summary(rank=0)
    units = len(layout.units)
    assert units >= 2
    if stages == 0:
        assert calls[("all_reduce", "grads")] == 3 * units and ("all_gather", "params") not in calls
    else:
        assert calls[("reduce_scatter", "grads")] == 3 * units
        assert calls[("all_gather", "params")] == 3 * units


def test_stage2_reduces_each_unit_during_backward():
    """At stage 2 the reduce-scatters happen inside the backward, before the loss of the step is known to the step."""
    prob = PROBLEMS["mlp"](steps=1)
    order = []
    mesh = fzero.count_collectives(fzero.local_mesh(2))
    base_loss = prob.loss_fn

    def loss_fn(params, b):
        order.append(("forward", len(mesh.counter.calls)))
        return base_loss(params, b)

    step = fzero.compile(loss_fn, optimizer=fzero.optim.sgd(0.1), stages=2, mesh=mesh)
    state = step.init(fzero.params_of(prob.model))
    step(state, prob.batches[0])
    ops = [(c.op, c.tag) for c in mesh.counter.calls if c.rank == 0]
    n_units = len(state[0].meta.layout.units)
    assert n_units >= 3
    # all reduce-scatters come before the metrics all-reduce, which comes before the all-gathers
    assert ops[:n_units] == [("reduce_scatter", "grads")] * n_units
    assert ops[n_units] == ("all_reduce", "metrics")
    assert ops[n_units + 1 :] == [("all_gather", "params")] * n_units
    # and in reverse unit order, as backward reaches them
    sizes = [c.numel for c in mesh.counter.calls if c.rank == 0 and c.op == "reduce_scatter"]
    units = state[0].meta.layout.units
    assert sizes == [u.padded for u in reversed(units)]


@pytest.mark.parametrize("ranks", [1, 2, 4])
@pytest.mark.parametrize("prefetch", [True, False])
def test_stage3_moves_three_psi_per_rank_per_step(ranks, prefetch):
    """Two all-gathers (forward, backward) and one reduce-scatter per block unit: 3Ψ·(N-1)/N. The root unit
    (embedding, final norm) stays gathered from forward to backward, as FSDP2 keeps its root: 2Ψ_root.
    With prefetch, from the second step on (the order is recorded by the first), the last block's backward
    follows its forward at once, and its buffer is kept rather than freed and gathered again: Ψ_last less."""
    prob = PROBLEMS["gpt"](steps=3)
    mesh = fzero.count_collectives(fzero.local_mesh(ranks))
    step = fzero.compile(prob.loss_fn, optimizer=fzero.optim.adamw(1e-3), stages=3, mesh=mesh, prefetch=prefetch)
    state = step.init(fzero.params_of(prob.model))
    layout = state[0].meta.layout
    root = sum(u.padded for u in layout.units if u.name == "<root>")
    last = next(u.padded for u in layout.units if u.name == "blocks.1")
    blocks = layout.padded_numel - root
    assert root and blocks and sorted(u.name for u in layout.units) == ["<root>", "blocks.0", "blocks.1"]
    mesh.counter.reset()
    for b in prob.batches:
        state, _ = step(state, b)
    # steps that kept the last block through the turn (all but the first); one rank neither prefetches nor keeps:
    # a gather there is a copy of its own shard
    kept = 2 if prefetch and ranks > 1 else 0
    for rank in range(ranks):
        moved = mesh.counter.elements(rank=rank, tag="grads") + mesh.counter.elements(rank=rank, tag="params")
        assert moved / 3 == pytest.approx((3 * blocks + 2 * root - kept / 3 * last) * (ranks - 1) / ranks, abs=1e-9)
        assert moved / 3 <= 3 * layout.padded_numel * (ranks - 1) / ranks
        assert mesh.counter.summary(rank=rank) == {
            ("all_gather", "params"): 3 * 5 - kept,  # root + 2 blocks forward + 2 blocks backward (less the kept)
            ("reduce_scatter", "grads"): 3 * 3,
            ("all_reduce", "metrics"): 3,
        }


# torch 2.11's profiler warns that it clears events at the end of each cycle (one cycle here); 2.13 does not
@pytest.mark.filterwarnings("ignore:Warning. Profiler clears events:UserWarning")
def test_profiler_ranges_name_every_collective_and_unit():
    """A torch.profiler trace of a stage-3 step shows each unit's gather and forward, and every collective
    with what it moves and for which unit (as FSDP2's ranges do). One rank: the profiler records the thread
    it runs in, and a process (torchrun's rank) profiles its own."""
    import torch

    prob = PROBLEMS["gpt"](steps=2)
    mesh = fzero.count_collectives(fzero.local_mesh(1))
    step = fzero.compile(prob.loss_fn, optimizer=fzero.optim.adamw(1e-3), stages=3, mesh=mesh)
    state = step.init(fzero.params_of(prob.model))
    state, _ = step(state, prob.batches[0])
    mesh.counter.reset()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step(state, prob.batches[1])
    names = [e.name for e in prof.events()]
    units = [u.name for u in state[0].meta.layout.units]
    calls = mesh.counter.calls
    assert calls  # the step did communicate
    for c in calls:  # one range per collective call, named by op, tag and unit
        expected = f"fzero.{c.op}:{c.tag}" + (f":{c.label}" if c.label else "")
        assert expected in names, expected
    assert sum(n.startswith("fzero.") and ":" in n and not n.startswith("fzero.unit:") for n in names) == len(calls)
    from fzero.layout._layout import ROOT

    # every module unit's own range and its gradient's reduce-scatter; the root unit (the params outside every
    # module unit) is gathered for the whole step, and its ranges are the unlabelled ones checked above
    for u in units:
        if u != ROOT:
            assert f"fzero.unit:{u}" in names and f"fzero.reduce_scatter:grads:{u}" in names, u
