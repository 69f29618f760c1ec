"""Reductions in flight during backward at stages 2-3 (issue 15): under plain autograd each unit's reduce-scatter
is started in its backward and waited for while later units are differentiated (``ShardGradView``), and the
updated params of stages 1-2 are all-gathered with every unit's gather issued before the first wait.

Only the timing changes, never a number: every test compares bitwise with the synchronous path (each unit's
reduction waited for in its own backward, which ``torch.func.grad`` still takes) and with stage 0.
"""

import pytest
import torch

import fzero
from fzero.models import GPTConfig
from fzero.testing import assert_trees_equal
from fzero.zero._stages import ShardGradView
from problems import PROBLEMS, SkippyBlocks, fzero_run


def _spy(monkeypatch):
    """Record the most reductions this rank had in flight at once (each unit its own bucket)."""
    seen = {"most": 0, "reduced": 0}
    original = ShardGradView._start_bucket

    def start_bucket(self):
        if self._bucket:
            seen["reduced"] += 1
            seen["most"] = max(seen["most"], len(self._pending) + 1)
        return original(self)

    monkeypatch.setattr(ShardGradView, "_start_bucket", start_bucket)
    return seen


@pytest.mark.parametrize("problem", ["mlp", "gpt", "any"])
@pytest.mark.parametrize("in_flight", [0, 1, 3])
@pytest.mark.parametrize("stages", [2, 3])
def test_reductions_in_flight_equal_the_synchronous_path_bitwise(monkeypatch, problem, in_flight, stages):
    prob = PROBLEMS[problem]()
    synchronous, m_sync = fzero_run(prob, stages=stages, mesh=fzero.local_mesh(2), autodiff="func", grad_accum=2)
    seen = _spy(monkeypatch)
    monkeypatch.setattr(ShardGradView, "IN_FLIGHT", in_flight)
    overlapped, m_over = fzero_run(prob, stages=stages, mesh=fzero.local_mesh(2), autodiff="autograd", grad_accum=2)
    assert seen["reduced"] > 0  # the in-flight path ran
    # the newest plus IN_FLIGHT older ones, never more (the models have 3 units or more: at 0 and 1 the bound is met)
    assert seen["most"] <= in_flight + 1 and (in_flight > 1 or seen["most"] == in_flight + 1)
    for a, b in zip(overlapped, synchronous):
        assert_trees_equal(a, b)
    assert [m["grad_norm"] for m in m_over] == [m["grad_norm"] for m in m_sync]
    assert [m["loss"] for m in m_over] == [m["loss"] for m in m_sync]


@pytest.mark.parametrize("precision", ["bf16", "fp16", fzero.Precision(compute=torch.bfloat16, reduce=torch.float32)])
@pytest.mark.parametrize("stages", [2, 3])
def test_reductions_in_flight_keep_the_low_precision_casts(precision, stages):
    # the shard gradient is cast to the shard's dtype as autograd casts it (bf16 params, fp32 reduction)
    prob = PROBLEMS["gpt"]()
    synchronous, _ = fzero_run(prob, stages=stages, mesh=fzero.local_mesh(2), autodiff="func", precision=precision)
    overlapped, _ = fzero_run(prob, stages=stages, mesh=fzero.local_mesh(2), autodiff="autograd", precision=precision)
    for a, b in zip(overlapped, synchronous):
        assert_trees_equal(a, b)


@pytest.mark.parametrize("stages", [2, 3])
def test_reductions_in_flight_equal_stage0_bitwise(stages):
    prob = PROBLEMS["gpt"]()
    stage0, _ = fzero_run(prob, stages=0, mesh=fzero.local_mesh(2))
    sharded, _ = fzero_run(prob, stages=stages, mesh=fzero.local_mesh(2))
    for a, b in zip(sharded, stage0):
        assert_trees_equal(a, b)


@pytest.mark.parametrize("settings", [{"remat": True}, {"offload": "cpu", "offload_params": True}, {"prefetch": False}],
                         ids=["remat", "offload-params", "no-prefetch"])
def test_stage3_reductions_in_flight_with_remat_offload_and_no_prefetch(settings):
    # remat units and the root unit still reduce through autograd (their leaves' .grad); offloaded shards get
    # their gradient on the host
    prob = PROBLEMS["gpt"]()
    synchronous, _ = fzero_run(prob, stages=3, mesh=fzero.local_mesh(2), autodiff="func", grad_accum=2, **settings)
    overlapped, _ = fzero_run(prob, stages=3, mesh=fzero.local_mesh(2), autodiff="autograd", grad_accum=2, **settings)
    for a, b in zip(overlapped, synchronous):
        assert_trees_equal(a, b)


class _Skips(torch.nn.Module):
    """Three blocks, the middle one never run: its unit gets no gradient."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(3))

    def forward(self, x):
        return self.blocks[2](torch.tanh(self.blocks[0](x))).sum(-1)


def _skips_runs(runs: list[tuple[str, int]], **settings) -> dict:
    """``_Skips`` trained 2 steps per (autodiff, stages) on local_mesh(2): the gathered params of each run."""
    torch.manual_seed(0)
    model = _Skips()

    def loss_fn(params, batch):
        return (fzero.apply(model, params, batch["x"]) - batch["y"]).pow(2).mean()

    batch = {"x": torch.randn(8, 4), "y": torch.randn(8)}
    out = {"before": fzero.params_of(model)}
    for autodiff, stages in runs:
        step = fzero.compile(loss_fn, optimizer=fzero.optim.adamw(0.1), stages=stages, mesh=fzero.local_mesh(2),
                             autodiff=autodiff, **({"unit_elements": 20} if stages < 2 else {}), **settings)
        state = step.init(fzero.params_of(model))
        for _ in range(2):
            state, metrics = step(state, batch)
        assert set(metrics["unused"]) == {"blocks.1.weight", "blocks.1.bias"}
        out[autodiff, stages] = step.gather(state)
    return out


def test_a_unit_without_gradient_gets_zeros_not_another_units_shard():
    runs = _skips_runs([("func", 2), ("autograd", 2), ("autograd", 3)])
    assert_trees_equal(runs["autograd", 2], runs["func", 2])
    assert_trees_equal(runs["autograd", 3], runs["func", 2])
    before = runs["before"]
    assert torch.equal(runs["autograd", 3]["blocks.1.weight"], before["blocks.1.weight"])  # untouched, as torch's grad=None
    assert not torch.equal(runs["autograd", 3]["blocks.2.weight"], before["blocks.2.weight"])


@pytest.mark.parametrize("stages", [0, 1])
@pytest.mark.parametrize("problem", ["gpt", "mlp"])
def test_stage01_reductions_start_in_backward_in_descending_unit_order(monkeypatch, stages, problem):
    # ParamView starts each unit's all-reduce (stage 0) or reduce-scatter (stage 1) as soon as backward completes
    # it, from the last unit down; what backward never completes (unused params) starts at its end, in that order
    from fzero.step._parts import ParamView

    order, during = {}, []  # per view (a rank's step): the units in the order their reductions started
    original = ParamView._start_ready

    def spy(self, *, all_=False):
        before = self._next
        original(self, all_=all_)
        order.setdefault(self, []).extend(range(before, self._next, -1))  # the view kept: no id reused
        during.append(0 if all_ else before - self._next)

    monkeypatch.setattr(ParamView, "_start_ready", spy)
    prob = PROBLEMS[problem]()
    by_func, _ = fzero_run(prob, stages=stages, mesh=fzero.local_mesh(2), autodiff="func", grad_accum=2)
    started, _ = fzero_run(prob, stages=stages, mesh=fzero.local_mesh(2), autodiff="autograd", grad_accum=2)
    for a, b in zip(started, by_func):
        assert_trees_equal(a, b)
    assert len(order) == 2 * len(prob.batches)  # each rank's step started its reductions
    for started_units in order.values():
        units = len(started_units)
        assert units == len(next(iter(order)).layout.units) and started_units == list(range(units - 1, -1, -1))
    assert problem != "gpt" or units > 1
    assert sum(during) > 0  # some started while backward still ran


@pytest.mark.parametrize("stages", [0, 1])
def test_stage01_a_unit_backward_never_completes_starts_at_the_end(stages):
    runs = _skips_runs([("func", stages), ("autograd", stages)])
    assert_trees_equal(runs["autograd", stages], runs["func", stages])


@pytest.mark.parametrize("stages", [2, 3])
def test_bucketed_reductions_equal_one_per_unit_bitwise_with_fewer_calls(stages):
    # bucket_elements: consecutive units reduced in one reduce-scatter (every unit's rank chunks together), each
    # rank's shards summed in the same rank order as one reduce-scatter per unit; the elements moved do not change
    prob = PROBLEMS["gpt"]()
    runs, calls = {}, {}
    for bucket in (10**6, 0):
        mesh = fzero.count_collectives(fzero.local_mesh(2))
        runs[bucket] = fzero_run(prob, stages=stages, mesh=mesh, grad_accum=2, bucket_elements=bucket)
        calls[bucket] = [(mesh.counter.count(rank=0, op=op, tag=tag), mesh.counter.elements(rank=0, op=op, tag=tag))
                         for op, tag in (("reduce_scatter", "grads"), ("all_gather", "params"))]
    (bucketed, m_b), (per_unit, m_u) = runs[10**6], runs[0]
    for a, b in zip(bucketed, per_unit):
        assert_trees_equal(a, b)
    assert [m["grad_norm"] for m in m_b] == [m["grad_norm"] for m in m_u]
    # fewer calls, the same elements: the reductions, and the gathers (stage 2: of the updated params after the
    # update; stage 3: of the units before they run)
    for (calls_b, moved_b), (calls_u, moved_u) in zip(calls[10**6], calls[0]):
        assert calls_b < calls_u and moved_b == moved_u


@pytest.mark.parametrize("fresh", [False, True], ids=["into-freed-buffers", "fresh-buffers"])
@pytest.mark.parametrize("problem", ["gpt5", "any"])
def test_bucketed_gathers_equal_one_per_unit_bitwise_with_fewer_calls(problem, fresh, monkeypatch):
    # stage 3 with bucket_elements: the prefetched gathers of consecutive units run as one all-gather, each unit's
    # buffer filled from it; the same values, fewer calls, the same elements. "any" calls a shared block twice (a
    # unit twice in the order ends a bucket). fresh: the path of dist_mesh's comm, whose refills gather into fresh
    # buffers that are then moved into the freed ones, rather than straight into the freed buffers (local_mesh).
    from fzero.mesh._thread_comm import ThreadComm

    if fresh:
        monkeypatch.setattr(ThreadComm, "async_writes_keep_version", False)
    # gpt5: blocks of 12.6K elements, so a 30K bucket gathers 2-3 of them at once
    prob = PROBLEMS["gpt"](cfg=GPTConfig.tiny(n_layer=5)) if problem == "gpt5" else PROBLEMS[problem]()
    runs, calls = {}, {}
    for bucket in (30_000, 0):
        mesh = fzero.count_collectives(fzero.local_mesh(2))
        runs[bucket] = fzero_run(prob, stages=3, mesh=mesh, bucket_elements=bucket)
        calls[bucket] = (mesh.counter.count(rank=0, op="all_gather", tag="params"),
                         mesh.counter.elements(rank=0, op="all_gather", tag="params"))
    (bucketed, m_b), (per_unit, m_u) = runs[30_000], runs[0]
    for a, b in zip(bucketed, per_unit):
        assert_trees_equal(a, b)
    assert [m["loss"] for m in m_b] == [m["loss"] for m in m_u]
    assert calls[30_000][0] < calls[0][0], calls
    assert calls[30_000][1] == calls[0][1]


def test_bucketed_gathers_follow_the_order_and_stop_with_it():
    # a forward that leaves the recorded order stops prefetch (pending buckets completed and dropped on every rank)
    # and still trains as the unbucketed step does
    torch.manual_seed(0)
    model = SkippyBlocks(64, 4)
    gen = torch.Generator().manual_seed(1)
    batches = [{"x": torch.randn(8, 64, generator=gen), "depth": d} for d in (4, 4, 2, 4, 3, 4)]

    def loss_fn(params, b):
        return fzero.apply(model, params, b["x"], depth=b["depth"]).square().mean()

    runs, calls = {}, {}
    for bucket in (9_000, 0):  # about two blocks (4160 elements each) per bucket
        mesh = fzero.count_collectives(fzero.local_mesh(2))
        step = fzero.compile(loss_fn, optimizer=fzero.optim.adamw(1e-3), stages=3, mesh=mesh, bucket_elements=bucket)
        state = step.init(fzero.params_of(model))
        for b in batches:
            state, _ = step(state, b)
        runs[bucket] = step.gather(state)
        calls[bucket] = mesh.counter.count(rank=0, op="all_gather", tag="params")
    assert_trees_equal(runs[9_000], runs[0])
    assert calls[9_000] < calls[0]


@pytest.mark.parametrize("bad", [-1, 1.5, True, "25MB"])
def test_bucket_elements_must_be_a_count(bad):
    prob = PROBLEMS["mlp"]()
    with pytest.raises(ValueError, match="bucket_elements must be an int >= 0"):
        fzero.compile(prob.loss_fn, stages=2, mesh=fzero.local_mesh(2), bucket_elements=bad)


def test_bucket_elements_is_refused_below_stage_2():
    prob = PROBLEMS["mlp"]()
    with pytest.raises(ValueError, match="bucket_elements"):
        fzero.compile(prob.loss_fn, stages=1, mesh=fzero.local_mesh(2), bucket_elements=1000)
