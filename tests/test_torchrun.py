"""The same program under torchrun (2 processes, gloo) equals local_mesh(2) bitwise.

Bitwise needs one intra-op thread on both sides (torchrun sets OMP_NUM_THREADS=1), so the in-process
run pins torch to one thread too (one intra-op thread sums in one order: the same bits as a rank's). Select with ``-m torchrun``; CI runs them.
"""

import os

import pytest
import torch

import fzero
from fzero.testing import assert_trees_equal
from launch import torchrun
from problems import PROBLEMS, fzero_run

HERE = os.path.dirname(__file__)


def run_torchrun(tmp_path, problem: str, stages: int, *extra: str, nproc: int = 2) -> dict:
    out = tmp_path / f"{problem}-{stages}.pt"
    torchrun([os.path.join(HERE, "torchrun_worker.py"), "--problem", problem, "--stages", str(stages), "--out", str(out), *extra],
             nproc=nproc)
    return torch.load(out, weights_only=False)


@pytest.mark.torchrun
@pytest.mark.parametrize("problem", ["mlp", "gpt", "any"])
@pytest.mark.parametrize("stages", [0, 1, 2, 3])
def test_torchrun_equals_local_mesh_bitwise(tmp_path, one_thread, problem, stages):
    dist = run_torchrun(tmp_path, problem, stages)
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
def test_torchrun_with_sharded_frozen_params_equals_local_mesh_bitwise(tmp_path, one_thread):
    """Stage 3 with the GPT's matrices frozen and sharded (``init(..., frozen=...)``, the module's emptied): each
    process keeps its own shard of them and gathers them with their units, as each rank of a local mesh does."""
    dist = run_torchrun(tmp_path, "gpt", 3, "--shard-frozen")
    local, metrics = fzero_run(PROBLEMS["gpt"](), stages=3, mesh=fzero.local_mesh(2), shard_frozen=True)
    assert len(dist["history"]) == len(local) == 5
    for d, l in zip(dist["history"], local):
        assert_trees_equal(d, l)
    assert [m["loss"] for m in dist["metrics"]] == [m["loss"] for m in metrics]
    assert any(label and label.endswith(":frozen") for label in dist["gathers"])  # the frozen params' own gathers


@pytest.mark.torchrun
@pytest.mark.parametrize("stages", [0, 3])
def test_torchrun_under_torch_func_equals_local_mesh_bitwise(tmp_path, one_thread, stages):
    """autodiff="func" runs the first step's structure check inside torch.func.grad, whose tensors have no storage:
    under torchrun its exchange of the ranks' descriptions raised "Cannot access data pointer of Tensor that doesn't
    have storage" at the first step (local_mesh never exchanges them)."""
    dist = run_torchrun(tmp_path, "gpt", stages, "--autodiff", "func")
    local, _ = fzero_run(PROBLEMS["gpt"](), stages=stages, mesh=fzero.local_mesh(2), autodiff="func")
    for d, l in zip(dist["history"], local):
        assert_trees_equal(d, l)


@pytest.mark.torchrun
@pytest.mark.parametrize("stages", [1, 2, 3])
def test_torchrun_with_gloo_own_collectives_equals_local_mesh_bitwise(tmp_path, one_thread, stages):
    # the default ("auto") runs all-gathers and reduce-scatters as point-to-point exchanges (the test above);
    # gloo's own collectives give the same bits on 2 ranks (a sum of two numbers does not depend on its order)
    dist = run_torchrun(tmp_path, "gpt", stages, "--collectives", "native")
    local, _ = fzero_run(PROBLEMS["gpt"](), stages=stages, mesh=fzero.local_mesh(2))
    for d, l in zip(dist["history"], local):
        assert_trees_equal(d, l)


@pytest.mark.torchrun
@pytest.mark.parametrize("problem", ["gpt", "any"])
@pytest.mark.parametrize("stages", [2, 3])
def test_torchrun_bucketed_equals_local_mesh_bitwise(tmp_path, one_thread, problem, stages):
    # bucket_elements under dist_mesh: several units' gradients in one reduce-scatter, several units in one
    # all-gather (stage 2: the updated params; stage 3: the prefetched units, whose refills are gathered into fresh
    # buffers and moved into the freed ones)
    dist = run_torchrun(tmp_path, problem, stages, "--bucket-elements", "30000")
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
def test_torchrun_exchanges_on_4_ranks_equal_local_mesh_bitwise(tmp_path, one_thread, stages):
    # collectives="p2p" sums in rank order 0..N-1, as local_mesh does: the same bits on more than 2 ranks,
    # where the order of a sum changes its rounding (gloo's ring sums each chunk in another order)
    dist = run_torchrun(tmp_path, "gpt", stages, "--collectives", "p2p", nproc=4)
    local, metrics = fzero_run(PROBLEMS["gpt"](), stages=stages, mesh=fzero.local_mesh(4))
    assert dist["world"] == 4
    for d, l in zip(dist["history"], local):
        assert_trees_equal(d, l)
    assert [m["loss"] for m in dist["metrics"]] == [m["loss"] for m in metrics]


@pytest.mark.torchrun
@pytest.mark.parametrize("where", ["cpu", "disk"])
@pytest.mark.parametrize("stages", [1, 2, 3])
def test_torchrun_offload_equals_local_mesh_without_offload(tmp_path, one_thread, where, stages):
    extra = ["--offload", where] + (["--offload-dir", str(tmp_path)] if where == "disk" else [])
    dist = run_torchrun(tmp_path, "gpt", stages, *extra)
    local, _ = fzero_run(PROBLEMS["gpt"](), stages=stages, mesh=fzero.local_mesh(2))
    for d, l in zip(dist["history"], local):
        assert_trees_equal(d, l)
    if where == "disk":
        assert os.listdir(tmp_path) == [f"gpt-{stages}.pt"]  # the ranks' offload files are gone with their states


@pytest.mark.torchrun
def test_torchrun_disk_offload_of_params_with_meta_init_equals_local_mesh(tmp_path, one_thread):
    # rank 1 passes shapes only (meta) to init and receives rank 0's values; param shards live in files
    extra = ["--offload", "disk", "--offload-dir", str(tmp_path), "--offload-params", "--meta-init"]
    dist = run_torchrun(tmp_path, "gpt", 3, *extra)
    local, metrics = fzero_run(PROBLEMS["gpt"](), stages=3, mesh=fzero.local_mesh(2))
    for d, l in zip(dist["history"], local):
        assert_trees_equal(d, l)
    assert [m["loss"] for m in dist["metrics"]] == [m["loss"] for m in metrics]
    assert os.listdir(tmp_path) == ["gpt-3.pt"]
