"""The same program under torchrun (2 processes, gloo) equals local_mesh(2) bitwise.

Bitwise needs one intra-op thread on both sides (torchrun sets OMP_NUM_THREADS=1), so the in-process
run pins torch to one thread too (one intra-op thread sums in one order: the same bits as a rank's). Select with ``-m torchrun``; CI runs them.
"""

import json
import os
import subprocess

import pytest
import torch

import fzero
from fzero.testing import assert_trees_equal
from launch import torchrun
from problems import PROBLEMS, fzero_run

HERE = os.path.dirname(__file__)


def _job(name: str, params: dict, where) -> tuple[int, list[str]] | None:
    """The torchrun job of one test of this module (its parameters ``params``; ``where``: a directory of its own), as
    (number of ranks, the worker's arguments); None for a test that runs none."""
    stages = str(params.get("stages", 3))
    problem = params.get("problem", "gpt")
    extra = {
        "test_torchrun_equals_local_mesh_bitwise": [],
        "test_torchrun_with_sharded_frozen_params_equals_local_mesh_bitwise": ["--shard-frozen"],
        "test_torchrun_under_torch_func_equals_local_mesh_bitwise": ["--autodiff", "func"],
        "test_torchrun_with_gloo_own_collectives_equals_local_mesh_bitwise": ["--collectives", "native"],
        "test_torchrun_bucketed_equals_local_mesh_bitwise": ["--bucket-elements", "30000"],
        "test_torchrun_exchanges_on_4_ranks_equal_local_mesh_bitwise": ["--collectives", "p2p"],
        "test_torchrun_offload_equals_local_mesh_without_offload": (
            ["--offload", params.get("where", ""), "--offload-dir", str(where / "offload")] if params.get("where") == "disk"
            else ["--offload", params.get("where", "")]),
        "test_torchrun_takes_rank_0s_non_persistent_buffers_as_ddp": ["--rank-seeded"],
        "test_torchrun_disk_offload_of_params_with_meta_init_equals_local_mesh": [
            "--offload", "disk", "--offload-dir", str(where / "offload"), "--offload-params", "--meta-init"],
    }.get(name)
    if extra is None:
        return None
    nproc = 4 if name == "test_torchrun_exchanges_on_4_ranks_equal_local_mesh_bitwise" else 2
    return nproc, ["--problem", problem, "--stages", stages, "--out", str(where / "out.pt"), *extra]


@pytest.fixture(scope="module")
def launched(request, tmp_path_factory) -> tuple[dict, dict]:
    """(test id -> its job's directory, test id -> why its launch failed): every selected test of this module has its
    job run by one torchrun launch per number of ranks (``torchrun_worker.py --jobs``), not one launch per test (about
    5 s each on 2 cores). Under xdist the workers share those launches, in a directory of the run: the first worker to
    need one runs it, under a lock, and the others wait for it and read it. Why: a worker does not know which of the
    module's tests it will get, and a launch of every job in each worker ran them all once per worker (an xdist group
    would keep them on one worker, but ``--dist loadgroup`` does not group under pytest 9.2 with pytest-xdist 3.8,
    pytest-dev/pytest-xdist#1386)."""
    import filelock  # torch's own dependency

    items = [it for it in request.session.items if it.module is request.module]
    shared = bool(os.environ.get("PYTEST_XDIST_WORKER"))
    root = tmp_path_factory.getbasetemp().parent / "torchrun_jobs" if shared else tmp_path_factory.mktemp("torchrun_jobs")
    root.mkdir(exist_ok=True)
    dirs: dict[str, object] = {}
    held: dict[int, list[tuple[str, list[str]]]] = {}
    for i, item in enumerate(items):  # the same items, in the same order, in every worker
        where = root / str(i)
        job = _job(item.originalname, getattr(getattr(item, "callspec", None), "params", {}), where)
        if job is None:
            continue
        dirs[item.nodeid] = where
        held.setdefault(job[0], []).append((item.nodeid, job[1]))
    failed: dict[str, str] = {}
    with filelock.FileLock(str(root) + ".lock"):
        for nproc, jobs in held.items():
            done, failure = root / f"done-{nproc}", root / f"failed-{nproc}.txt"
            if not done.exists() and not failure.exists():
                for nodeid, _ in jobs:
                    (dirs[nodeid] / "offload").mkdir(parents=True, exist_ok=True)
                spec = root / f"jobs-{nproc}.json"
                spec.write_text(json.dumps([args for _, args in jobs]))
                try:
                    torchrun([os.path.join(HERE, "torchrun_worker.py"), "--jobs", str(spec)], nproc=nproc,
                             timeout=120 + 40 * len(jobs))
                    done.touch()
                except (AssertionError, subprocess.TimeoutExpired) as e:
                    failure.write_text(str(e))
            if failure.exists():
                failed.update((nodeid, failure.read_text()) for nodeid, _ in jobs)
    return dirs, failed


@pytest.fixture
def job(request, launched):
    """This test's job: what rank 0 saved, and its offload directory."""
    dirs, failed = launched
    if request.node.nodeid in failed:
        pytest.fail(f"this test's torchrun launch failed:\n{failed[request.node.nodeid]}", pytrace=False)
    where = dirs[request.node.nodeid]
    return torch.load(where / "out.pt", weights_only=False), where / "offload"


@pytest.mark.torchrun
@pytest.mark.parametrize("problem", ["mlp", "gpt", "any"])
@pytest.mark.parametrize("stages", [0, 1, 2, 3])
def test_torchrun_equals_local_mesh_bitwise(job, one_thread, problem, stages):
    dist, _ = job
    local, metrics = fzero_run(PROBLEMS[problem](), stages=stages, mesh=fzero.local_mesh(2))
    assert dist["world"] == 2
    assert len(dist["history"]) == len(local) == 5
    for d, l in zip(dist["history"], local):
        assert_trees_equal(d, l)
    assert [m["loss"] for m in dist["metrics"]] == [m["loss"] for m in metrics]
    ops = {op for op, _, _ in dist["calls"]}
    assert ops == ({"broadcast", "all_reduce"} if stages == 0 else {"broadcast", "all_reduce", "reduce_scatter", "all_gather"})
    if stages == 3:  # gather() under dist_mesh is a collective; prefetch issued async all-gathers
        assert ("all_gather", "gather") in {(op, tag) for op, tag, _ in dist["calls"]}


@pytest.mark.torchrun
def test_torchrun_with_sharded_frozen_params_equals_local_mesh_bitwise(job, one_thread):
    """Stage 3 with the GPT's matrices frozen and sharded (``init(..., frozen=...)``, the module's emptied): each
    process keeps its own shard of them and gathers them with their units, as each rank of a local mesh does."""
    dist, _ = job
    local, metrics = fzero_run(PROBLEMS["gpt"](), stages=3, mesh=fzero.local_mesh(2), shard_frozen=True)
    assert len(dist["history"]) == len(local) == 5
    for d, l in zip(dist["history"], local):
        assert_trees_equal(d, l)
    assert [m["loss"] for m in dist["metrics"]] == [m["loss"] for m in metrics]
    assert any(label and label.endswith(":frozen") for label in dist["gathers"])  # the frozen params' own gathers


@pytest.mark.torchrun
@pytest.mark.parametrize("stages", [0, 3])
def test_torchrun_under_torch_func_equals_local_mesh_bitwise(job, one_thread, stages):
    """autodiff="func" runs the first step's structure check inside torch.func.grad, whose tensors have no storage:
    under torchrun its exchange of the ranks' descriptions raised "Cannot access data pointer of Tensor that doesn't
    have storage" at the first step (local_mesh never exchanges them)."""
    dist, _ = job
    local, _ = fzero_run(PROBLEMS["gpt"](), stages=stages, mesh=fzero.local_mesh(2), autodiff="func")
    for d, l in zip(dist["history"], local):
        assert_trees_equal(d, l)


@pytest.mark.torchrun
@pytest.mark.parametrize("stages", [1, 2, 3])
def test_torchrun_with_gloo_own_collectives_equals_local_mesh_bitwise(job, one_thread, stages):
    # the default ("auto") runs all-gathers and reduce-scatters as point-to-point exchanges (the test above);
    # gloo's own collectives give the same bits on 2 ranks (a sum of two numbers does not depend on its order)
    dist, _ = job
    local, _ = fzero_run(PROBLEMS["gpt"](), stages=stages, mesh=fzero.local_mesh(2))
    for d, l in zip(dist["history"], local):
        assert_trees_equal(d, l)


@pytest.mark.torchrun
@pytest.mark.parametrize("problem", ["gpt", "any"])
@pytest.mark.parametrize("stages", [2, 3])
def test_torchrun_bucketed_equals_local_mesh_bitwise(job, one_thread, problem, stages):
    # bucket_elements under dist_mesh: several units' gradients in one reduce-scatter, several units in one
    # all-gather (stage 2: the updated params; stage 3: the prefetched units, whose refills are gathered into fresh
    # buffers and moved into the freed ones)
    dist, _ = job
    mesh = fzero.count_collectives(fzero.local_mesh(2))
    local, metrics = fzero_run(PROBLEMS[problem](), stages=stages, mesh=mesh)  # one gather and one reduction per unit
    for d, l in zip(dist["history"], local):
        assert_trees_equal(d, l)
    assert [m["loss"] for m in dist["metrics"]] == [m["loss"] for m in metrics]
    gathers = [n for op, tag, n in dist["calls"] if (op, tag) == ("all_gather", "params")]
    unbucketed = [c.numel for c in mesh.counter.calls if (c.rank, c.op, c.tag) == (0, "all_gather", "params")]
    assert len(gathers) < len(unbucketed) and sum(gathers) == sum(unbucketed)


@pytest.mark.torchrun
@pytest.mark.slow
@pytest.mark.parametrize("stages", [0, 3])
def test_torchrun_exchanges_on_4_ranks_equal_local_mesh_bitwise(job, one_thread, stages):
    # collectives="p2p" sums in rank order 0..N-1, as local_mesh does: the same bits on more than 2 ranks,
    # where the order of a sum changes its rounding (gloo's ring sums each chunk in another order)
    dist, _ = job
    local, metrics = fzero_run(PROBLEMS["gpt"](), stages=stages, mesh=fzero.local_mesh(4))
    assert dist["world"] == 4
    for d, l in zip(dist["history"], local):
        assert_trees_equal(d, l)
    assert [m["loss"] for m in dist["metrics"]] == [m["loss"] for m in metrics]


@pytest.mark.torchrun
@pytest.mark.parametrize("where", ["cpu", "disk"])
@pytest.mark.parametrize("stages", [1, 2, 3])
def test_torchrun_offload_equals_local_mesh_without_offload(job, one_thread, where, stages):
    dist, offload_dir = job
    local, _ = fzero_run(PROBLEMS["gpt"](), stages=stages, mesh=fzero.local_mesh(2))
    for d, l in zip(dist["history"], local):
        assert_trees_equal(d, l)
    if where == "disk":
        assert os.listdir(offload_dir) == []  # the ranks' offload files are gone with their states


@pytest.mark.torchrun
def test_torchrun_disk_offload_of_params_with_meta_init_equals_local_mesh(job, one_thread):
    # rank 1 passes shapes only (meta) to init and receives rank 0's values; param shards live in files
    dist, offload_dir = job
    local, metrics = fzero_run(PROBLEMS["gpt"](), stages=3, mesh=fzero.local_mesh(2))
    for d, l in zip(dist["history"], local):
        assert_trees_equal(d, l)
    assert [m["loss"] for m in dist["metrics"]] == [m["loss"] for m in metrics]
    assert os.listdir(offload_dir) == []


@pytest.mark.torchrun
@pytest.mark.parametrize("problem", ["rank_buffers"])
@pytest.mark.parametrize("stages", [0, 3])
def test_torchrun_takes_rank_0s_non_persistent_buffers_as_ddp(job, one_thread, problem, stages):
    """Non-persistent buffers that differ by rank (one filled from the rank's RNG at init, one written by the forward
    from the rank's batch): DDP broadcasts every ``named_buffers()`` from rank 0 at construction and before each
    forward, and a local mesh starts each rank from the one module's and keeps rank 0's. Before: each torchrun process
    kept its own, so rank 1 trained on its own noise (the params differed from local_mesh(2) at the first step) and
    ended holding its own values, silently. Now each process takes rank 0's at its first forward of a call and again
    when the call succeeds."""
    dist, offload_dir = job
    prob = PROBLEMS[problem]()
    local, metrics = fzero_run(prob, stages=stages, mesh=fzero.local_mesh(2))
    for d, l in zip(dist["history"], local):
        assert_trees_equal(d, l)
    assert [m["loss"] for m in dist["metrics"]] == [m["loss"] for m in metrics]
    for rank in range(2):  # every process ends holding rank 0's, as the local mesh's one module
        assert_trees_equal(torch.load(f"{offload_dir.parent / 'out.pt'}.buffers{rank}"), dict(prob.model.named_buffers()))
