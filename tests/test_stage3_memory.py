"""Stage 3's memory under bf16 with fp32 masters (issue 27): no compute-dtype shard beside the master while a step runs,
no buffer the step's pool adopts and never lends again, and a peak host memory against FSDP2's on a Hugging Face Llama.

The peaks are process RSS (VmHWM) in fresh processes, the same measure for both systems, with
``MALLOC_MMAP_THRESHOLD_=131072`` for both so that freed buffers leave RSS at once (``benchmarks/llama_peak.py``
runs each system; its docstring has the set-up). What is compared is the training peak: the steps after the first,
from the memory the first left. fzero's set-up (``step.init`` from the full module, then freeing the module) peaks
at the module plus the state, where FSDP2 at one rank keeps the module's own fp32 tensors as its shards: that is the
init's to change, and the docs say what was measured.
"""

import dataclasses
import json
import os
import subprocess
import sys

import optree
import pytest
import torch

import fzero
from fzero.step._pool import Pool
from launch import torchrun
from problems import PROBLEMS, fzero_run

HERE = os.path.dirname(__file__)
BENCH = os.path.join(HERE, os.pardir, "benchmarks", "llama_peak.py")
# 8 decoder layers x 512 (intermediate 1344), vocab 4096: 29.1M params; a layer, the unit, is 3.11M of them
SIZE = ["--layers", "8", "--width", "512", "--vocab", "4096", "--seq", "256", "--batch", "2", "--steps", "3"]
UNIT = 3_113_984


def _bf16_step(prob, mesh, **kw):
    return fzero.compile(prob.loss_fn, optimizer=fzero.optim.adamw(1e-3), stages=3, mesh=mesh,
                         precision=fzero.Precision(compute=torch.bfloat16, reduce=torch.float32), **kw)


def test_the_compute_dtype_shards_hold_no_memory_while_a_step_runs_and_come_back_equal():
    prob = PROBLEMS["gpt"]()
    step = _bf16_step(prob, fzero.local_mesh(1))
    box = {"state": step.init(fzero.params_of(prob.model))}
    seen = []

    def loss_fn(params, b):  # reads the state from outside, while the step runs
        seen.append({k: t.untyped_storage().nbytes() for k, t in box["state"][0].params.items()})
        return prob.loss_fn(params, b)

    step = dataclasses.replace(step, loss_fn=loss_fn)
    for b in prob.batches[:2]:
        box["state"], _ = step(box["state"], b)
    assert seen and all(n == 0 for during in seen for n in during.values())  # every unit's shard, the root's too
    state = box["state"][0]
    masters = state.opt_state.master
    for name, shard in state.params.items():  # whole again, and what every update leaves: the master, cast
        assert shard.untyped_storage().nbytes() == shard.numel() * 2
        assert torch.equal(shard, masters[name].to(torch.bfloat16))


@pytest.mark.parametrize("ranks", [1, 2])
def test_stage3_bf16_with_freed_shards_equals_stage0_bitwise(ranks):
    # the gathers read the masters cast, the same numbers as the shards they replace: every step as at stage 0 (at one
    # rank the gather's copy itself rounds the master to bf16)
    prob = PROBLEMS["gpt"]()
    precision = fzero.Precision(compute=torch.bfloat16, reduce=torch.float32)
    stage0, m0 = fzero_run(prob, stages=0, mesh=fzero.local_mesh(ranks), precision=precision)
    stage3, m3 = fzero_run(prob, stages=3, mesh=fzero.local_mesh(ranks), precision=precision, grad_accum=1)
    for a, b in zip(stage3, stage0):
        fzero.testing.assert_trees_equal(a, b)
    assert [m["loss"] for m in m3] == [m["loss"] for m in m0]


def test_a_shard_that_is_not_its_master_cast_is_kept_and_gathered():
    # params replaced between steps (their masters not): the forward reads the params the state holds, as before
    prob = PROBLEMS["gpt"]()
    step = _bf16_step(prob, fzero.local_mesh(1))
    state, _ = step(step.init(fzero.params_of(prob.model)), prob.batches[0])
    name = next(n for n in state[0].params if n != "<root>")
    changed = {k: (t * 1.5 if k == name else t) for k, t in state[0].params.items()}
    state = dataclasses.replace(state, states=(dataclasses.replace(state[0], params=changed),))
    expected = step.evaluate(state, prob.batches[1])["loss"]  # evaluate gathers the shards themselves
    _, metrics = step(state, prob.batches[1])
    assert metrics["loss"] == expected


@pytest.mark.parametrize("written", ["shard", "master"])
def test_a_shard_or_master_written_in_place_between_steps_is_compared_again(written):
    # the step after an update frees the shards it left without comparing them (a wait for the device); a write in place
    # to either tensor since then (its version counter moves) brings the comparison back, and the forward reads the shard
    prob = PROBLEMS["gpt"]()
    step = _bf16_step(prob, fzero.local_mesh(1))
    state, _ = step(step.init(fzero.params_of(prob.model)), prob.batches[0])
    name = next(n for n in state[0].params if n != "<root>")
    with torch.no_grad():
        (state[0].params[name] if written == "shard" else state[0].opt_state.master[name]).mul_(1.5)
    # the same state as new tensors, which carry no record of any update: every shard compared
    fresh = optree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, state, namespace="fzero")
    after_fresh, expected = step(fresh, prob.batches[1])
    after, metrics = step(state, prob.batches[1])
    assert (metrics["loss"], metrics["grad_norm"]) == (expected["loss"], expected["grad_norm"])
    fzero.testing.assert_trees_equal(after, after_fresh)


def test_the_shards_an_update_left_are_freed_without_a_comparison(monkeypatch):
    from fzero.zero import _stages as _shard_params

    prob = PROBLEMS["gpt"]()
    step = _bf16_step(prob, fzero.local_mesh(1))
    compared = []
    real = _shard_params._bits
    monkeypatch.setattr(_shard_params, "_bits", lambda t: compared.append(t) or real(t))
    state = step.init(fzero.params_of(prob.model))
    state, _ = step(state, prob.batches[0])
    first = len(compared)
    state, _ = step(state, prob.batches[1])
    assert first == 2 * len(state[0].params) and len(compared) == first  # the first step compares; the second needs not


def test_an_error_in_the_step_leaves_the_shards_whole():
    prob = PROBLEMS["gpt"]()
    step = _bf16_step(prob, fzero.local_mesh(1))
    state = step.init(fzero.params_of(prob.model))
    before = {k: t.clone() for k, t in state[0].params.items()}

    def failing(params, b):
        prob.loss_fn(params, b)
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        dataclasses.replace(step, loss_fn=failing)(state, prob.batches[0])
    for k, t in state[0].params.items():
        assert torch.equal(t, before[k])
    state, metrics = step(state, prob.batches[0])  # and it still trains
    assert metrics["step"] == 1


def test_the_pool_holds_the_same_after_each_step_under_an_fp32_reduction():
    # the flat bf16 gradient and the fp32 reduced shard go back to the pool; nothing else is adopted (a buffer allocated
    # where a lent one was, of another size, was taken in and never lent again: the pool grew every step)
    prob = PROBLEMS["gpt"](steps=6)
    step = _bf16_step(prob, fzero.local_mesh(2))
    state = step.init(fzero.params_of(prob.model))
    held = []
    for b in prob.batches:
        state, _ = step(state, b)
        held.append(step.pool.held_bytes)
    assert held[2:] == held[2:3] * (len(held) - 2)


def test_a_pool_refuses_a_buffer_of_another_size_at_a_lent_address():
    pool = Pool()
    lent = pool.take(1 << 16, dtype=torch.bfloat16, device="cpu")
    ptr = lent.data_ptr()
    stranger = torch.empty(0, dtype=torch.float32).set_(lent.untyped_storage(), 0, (1 << 15,))  # same address, other dtype
    assert stranger.data_ptr() == ptr
    pool.give(stranger)
    assert pool.held_bytes == 0
    pool.give(lent)
    assert pool.held_bytes == lent.numel() * 2


def _peaks(results: list[dict]) -> dict[str, float]:
    """Training peak (steps 2-3) above the RSS that held the module, in bytes, per system (the larger rank's)."""
    return {r["system"]: max((x["train_peak_kib"] - x["base_kib"]) * 1024 for x in r["ranks"]) for r in results}


def _run_alone(system: str, tmp_path) -> dict:
    out = tmp_path / f"{system}.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "131072"}
    subprocess.run([sys.executable, BENCH, "--system", system, "--json-out", str(out), *SIZE], env=env, check=True,
                   capture_output=True, timeout=240)
    return json.loads(out.read_text())


@pytest.mark.slow
def test_stage3_peak_is_at_most_fsdp2s_on_one_rank(tmp_path):
    peaks = _peaks([_run_alone(s, tmp_path) for s in ("fzero-s3", "fsdp2")])
    # measured: fzero 13.65 and FSDP2 13.68 bytes per parameter above the module's RSS (29.1M params); before issue 27
    # fzero held 15.87: a bf16 shard beside each master (2), the pool's idle units during the update, a prefetched unit
    assert peaks["fzero-s3"] <= peaks["fsdp2"], peaks


@pytest.mark.slow
@pytest.mark.torchrun
def test_stage3_peak_is_within_its_overlap_buffers_of_fsdp2s_on_two_ranks(tmp_path, monkeypatch):
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "131072")  # the launch passes this process's environment on
    results = []
    for system in ("fzero-s3", "fsdp2"):
        out = tmp_path / f"{system}.json"
        torchrun([BENCH, "--system", system, "--json-out", str(out), *SIZE], timeout=240)
        results.append(json.loads(out.read_text()))
    peaks = _peaks(results)
    # fzero overlaps what FSDP2 on CPU does not: the next unit is gathered (bf16) while one runs, and a unit's fp32
    # gradient is reduced while the next unit's backward runs. Measured: 8.09 against 7.78 bytes per parameter (29.1M
    # params; 9.47 before issue 27), and 7.76 with neither (prefetch=False, no reduction in flight)
    overlap = UNIT * 2 + UNIT * 4  # one gathered bf16 unit, one unit's fp32 gradient
    assert peaks["fzero-s3"] <= peaks["fsdp2"] + overlap, peaks
