"""Distributed faults end fast and say why (issue 16): a ``torchrun`` job (2 processes, gloo) in which rank 1
raises, is SIGKILLed, stalls, or was built unlike rank 0. The surviving rank's error names rank 1 and the
cause, every job ends within 60 s (a bound, not a benchmark), and none can hang: each launch has a timeout that
kills torchrun and its workers. Select with ``-m torchrun``.

The fault board itself (``fzero.mesh._faults``) and the sliced wait (``fzero.mesh._waiting``) are also tested
in this process, over an in-memory store and fake collectives: no subprocess, milliseconds.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest

from fzero.mesh._comm import MeshTimeout, RanksDisagree
from fzero.mesh._faults import Board, RankFailed, first_fault, process_alive
from fzero.mesh import _waiting
from launch import torchrun, torchrun_failing

HERE = os.path.dirname(__file__)
BOUND = 60.0  # seconds a failed job may take, launch included
# Seconds from rank 1's fault to rank 0's error: a rank waiting at a collective learns of it within a second; one in
# a gloo reduce-scatter, when rank 1's process ends (it stays up to 3 s for the others to report). Not the timeout.
SOON = 10.0
GLOO_MISMATCH = "Received data size doesn't match"  # gloo's C++ abort when ranks pair collectives of different sizes


def run(tmp_path, fault: str, stages: int, *extra: str) -> tuple[subprocess.CompletedProcess, float, dict]:
    """Launch tests/faults_worker.py with rank 1 misbehaving; (process, seconds, what each rank wrote)."""
    proc, seconds = torchrun_failing([os.path.join(HERE, "faults_worker.py"), "--fault", fault, "--stages", str(stages),
                                      "--out", str(tmp_path), *extra], timeout=120)
    files = {}
    for name in ("rank0", "rank1", "fault"):
        path = tmp_path / f"{name}.json"
        files[name] = json.loads(path.read_text()) if path.exists() else None
    return proc, seconds, files


def error_of(files: dict, rank: int, proc: subprocess.CompletedProcess) -> str:
    written = files[f"rank{rank}"]
    assert written is not None and written["error"] is not None, (
        f"rank {rank} wrote no error:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return written["error"]


@pytest.mark.torchrun
def test_a_job_without_faults_succeeds(tmp_path):
    """The control: the same worker, nobody misbehaving, trains and ends cleanly (launched as every successful
    torchrun test is, with tests/launch.py's single retry of the known C++ abort at exit)."""
    start = time.monotonic()
    torchrun([os.path.join(HERE, "faults_worker.py"), "--fault", "none", "--stages", "3", "--out", str(tmp_path)], timeout=120)
    assert time.monotonic() - start < 2 * BOUND
    for rank in (0, 1):
        assert json.loads((tmp_path / f"rank{rank}.json").read_text())["error"] is None


@pytest.mark.torchrun
@pytest.mark.parametrize("stages", [0, 3])
def test_a_raising_rank_is_named_by_the_others_within_seconds(tmp_path, stages):
    proc, seconds, files = run(tmp_path, "raise", stages)
    assert proc.returncode != 0 and seconds < BOUND, (proc.returncode, seconds, proc.stderr[-5000:])
    error = error_of(files, 0, proc)
    assert error.startswith("RankFailed: fzero.dist_mesh: rank 1 failed with ValueError: "), error
    assert "rank 1 broke its loss on purpose" in error
    # what rank 0 was doing: the collective (number, op, what it moves) and the step call
    assert re.search(r"This rank \(0\) stopped waiting at collective #\d+ \((all_gather|all_reduce|reduce_scatter) \w+", error), error
    assert "in step call #3 (fzero.Step.__call__)" in error
    assert "rank 1 broke its loss on purpose" in error_of(files, 1, proc)
    assert files["rank0"]["time"] - files["fault"]["time"] < SOON


@pytest.mark.torchrun
def test_a_killed_rank_is_named_as_vanished(tmp_path):
    proc, seconds, files = run(tmp_path, "kill", 3)
    assert proc.returncode != 0 and seconds < BOUND, (proc.returncode, seconds, proc.stderr[-5000:])
    error = error_of(files, 0, proc)
    # Two outcomes race, both right: rank 0's wait finds rank 1 gone (RankFailed), or torchrun, which saw rank 1 die,
    # SIGTERMs rank 0 first, and its handler raises the same finding as RankStopped (seen once in a full CI run)
    assert re.match(r"(RankFailed|RankStopped): fzero\.dist_mesh: rank 1 vanished: its process \(pid \d+ on .+\) ended "
                    r"without reporting an error \(killed by a signal such as SIGKILL", error), error
    assert "This rank (0) stopped waiting at collective #" in error and "in step call #3 (fzero.Step.__call__)" in error
    assert files["rank1"] is None  # it had no chance to write anything
    assert files["rank0"]["time"] - files["fault"]["time"] < SOON


@pytest.mark.torchrun
def test_a_stalled_rank_is_named_after_the_mesh_timeout(tmp_path):
    proc, seconds, files = run(tmp_path, "stall", 3, "--timeout", "10")
    assert proc.returncode != 0 and seconds < BOUND, (proc.returncode, seconds, proc.stderr[-5000:])
    error = error_of(files, 0, proc)
    assert re.match(r"MeshTimeout: fzero\.dist_mesh: rank 1 did not arrive at collective #\d+ \(\w+ .*\) in step call #3 "
                    r"\(fzero\.Step\.__call__\) within the mesh timeout of 10 s\. Rank 1 took part in collective #\d+", error), error
    assert "its process is alive" in error and "fzero.dist_mesh(timeout=1800)" in error
    waited = files["rank0"]["time"] - files["fault"]["time"]
    assert 9.0 <= waited < 30.0, waited  # the timeout, not a hang nor an early guess
    # the stalled rank itself, stopped by torchrun's SIGTERM, says it was the one that did not arrive
    stalled = error_of(files, 1, proc)
    assert stalled.startswith("RankStopped: fzero.dist_mesh: rank 1 did not arrive at collective #"), stalled
    assert "This rank (1) stopped computing in step call #3 (fzero.Step.__call__)" in stalled and "SIGTERM" in stalled


@pytest.mark.torchrun
def test_a_batch_of_another_feature_size_on_one_rank_is_named(tmp_path):
    proc, seconds, files = run(tmp_path, "features", 2)
    assert proc.returncode != 0 and seconds < BOUND, (proc.returncode, seconds, proc.stderr[-5000:])
    error = error_of(files, 0, proc)
    assert error.startswith("RankFailed: fzero.dist_mesh: rank 1 failed with RuntimeError: "), error
    assert "4x12" in error and "in step call #3 (fzero.Step.__call__)" in error
    assert files["rank0"]["time"] - files["fault"]["time"] < SOON


@pytest.mark.torchrun
@pytest.mark.parametrize(
    "fault, stages, message",
    [
        ("stages", 3, r"ranks disagree on the ZeRO stage: rank 0 has 3, rank 1 has 2\."),
        ("stages", 1, r"ranks disagree on the ZeRO stage: rank 0 has 1, rank 1 has 0\."),
        ("width", 3, r"ranks disagree on the shape of 'layers\.0\.\w+': rank 0 has \(8\b.*\), rank 1 has \(64\b.*\)\."),
        ("width", 0, r"ranks disagree on the number of units: rank 0 has \d+, rank 1 has \d+\."),
        ("precision", 3, r"ranks disagree on the precision: rank 0 has Precision\(compute=torch\.float32.*\), rank 1 has "
                         r"Precision\(compute=torch\.bfloat16"),
        # exchanges on one rank, gloo's own collectives on the other would pair unrelated messages
        ("collectives", 2, r"ranks disagree on how gloo collectives run \(dist_mesh\(collectives=\.\.\.\)\): rank 0 has "
                           r"'auto', rank 1 has 'native'\."),
    ],
)
def test_ranks_built_differently_raise_at_init_on_every_rank(tmp_path, fault, stages, message):
    proc, seconds, files = run(tmp_path, fault, stages)
    assert proc.returncode != 0 and seconds < BOUND, (proc.returncode, seconds, proc.stderr[-5000:])
    for rank in (0, 1):
        error = error_of(files, rank, proc)
        assert re.match(r"RanksDisagree: fzero\.Step\.init: " + message, error), error
    assert abs(files["rank0"]["time"] - files["rank1"]["time"]) < SOON
    assert GLOO_MISMATCH not in proc.stderr, proc.stderr[-5000:]


@pytest.mark.torchrun
def test_ranks_whose_models_differ_in_a_parameter_free_op_raise_at_the_first_step(tmp_path):
    """GELU on rank 0, Tanh on rank 1: the same parameters, so Step.init agrees; the first forward's structure check
    names the module and both ranks on every rank, before any update (issue 32)."""
    proc, seconds, files = run(tmp_path, "activation", 3)
    assert proc.returncode != 0 and seconds < BOUND, (proc.returncode, seconds, proc.stderr[-5000:])
    for rank in (0, 1):
        error = error_of(files, rank, proc)
        assert re.match(r"RanksDisagree: fzero\.Step\.__call__ \(the first step's fzero\.apply\): ranks disagree on the "
                        r"module at 'layers\.1': rank 0 has GELU\(approximate='none'\), rank 1 has Tanh\(\)\.", error), error


@pytest.mark.torchrun
def test_an_empty_batch_on_one_rank_is_named(tmp_path):
    proc, seconds, files = run(tmp_path, "empty", 0)
    assert proc.returncode != 0 and seconds < BOUND, (proc.returncode, seconds, proc.stderr[-5000:])
    assert error_of(files, 1, proc).startswith("ValueError: fzero.Step.__call__: rank 1's batch is empty: batch leaf 'x' has 0 rows")
    error = error_of(files, 0, proc)
    assert error.startswith("RankFailed: fzero.dist_mesh: rank 1 failed with ValueError: "), error
    assert "rank 1's batch is empty" in error and files["rank0"]["time"] - files["fault"]["time"] < SOON


@pytest.mark.torchrun
def test_a_rank_that_evaluates_while_the_others_step_is_named_before_gloo_aborts(tmp_path):
    """Without the check at the start of each call, gloo pairs the evaluation's collectives with the step's and
    aborts rank 1 in C++ ("Received data size doesn't match expected size")."""
    proc, seconds, files = run(tmp_path, "evaluate", 3)
    assert proc.returncode != 0 and seconds < BOUND, (proc.returncode, seconds, proc.stderr[-5000:])
    for rank in (0, 1):
        error = error_of(files, rank, proc)
        assert error.startswith("RanksDisagree: fzero.dist_mesh: ranks start different calls: rank 0 starts its step "
                                "call #3 (fzero.Step.__call__), rank 1 its call #1 of fzero.Step.evaluate."), error
    assert GLOO_MISMATCH not in proc.stderr, proc.stderr[-5000:]


# -- the board and the sliced wait, in this process ---------------------------------------------------------


class MemoryStore:
    """The part of torch.distributed's Store API the board uses, in memory."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    def set(self, key, value):
        self.data[key] = value.encode() if isinstance(value, str) else value

    def get(self, key):
        if key not in self.data:
            raise AssertionError(f"get({key!r}) would block until the store's timeout: check() first")
        return self.data[key]

    def check(self, keys):
        return all(k in self.data for k in keys)

    def add(self, key, n):
        value = int(self.data.get(key, b"0")) + n
        self.data[key] = str(value).encode()
        return value

    def delete_key(self, key):
        return self.data.pop(key, None) is not None


class SlowWork:
    """A collective that is still running for ``slices`` waits, then completes (or fails with ``error``)."""

    def __init__(self, slices: int, error: str | None = None, on_slice=None) -> None:
        self.slices, self.error, self.on_slice, self.waits = slices, error, on_slice, 0

    def wait(self, timeout=None):
        self.waits += 1
        if self.waits <= self.slices:
            if self.on_slice is not None:
                self.on_slice(self.waits)
            raise RuntimeError("Operation timed out!")
        if self.error is not None:
            raise RuntimeError(self.error)
        return True


def boards(size: int = 2, timeout: float = 30.0) -> list[Board]:
    store = MemoryStore()
    return [Board(store, rank=r, size=size, timeout=timeout) for r in range(size)]


@pytest.fixture
def fast_slices(monkeypatch):
    monkeypatch.setattr(_waiting, "FIRST_SLICE", 0.001)
    monkeypatch.setattr(_waiting, "LONGEST_SLICE", 0.001)


def test_a_waiting_rank_stops_at_another_ranks_fault_and_names_it(fast_slices):
    b0, b1 = boards()
    b0.enter("fzero.Step.__call__")
    call = b0.issue("all_gather params 'blocks.1', 64 x float32")
    work = SlowWork(100, on_slice=lambda n: n == 3 and b1.publish(1, "ValueError: bad batch"))
    with pytest.raises(RankFailed, match=r"^fzero\.dist_mesh: rank 1 failed with ValueError: bad batch\. This rank \(0\) "
                                          r"stopped waiting at collective #1 \(all_gather params 'blocks\.1', 64 x float32\) "
                                          r"in step call #1 \(fzero\.Step\.__call__\)\.") as info:
        _waiting.wait(work, call, b0, bounded=True)
    assert info.value.rank == 1 and info.value.cause == "ValueError: bad batch"
    assert work.waits == 3  # it stopped right after the slice in which the fault appeared, not at the timeout
    assert b0.waiting(0) is None  # it no longer says it waits


def test_a_collective_that_completes_never_touches_the_store(fast_slices):
    b0, _ = boards()
    before = dict(b0.store.data)
    _waiting.wait(SlowWork(0), b0.issue("all_reduce metrics, 1 x float32"), b0, bounded=True)
    assert b0.store.data == before and b0.last.seq == 1


def test_neighbours_waiting_for_different_collectives_disagree(fast_slices):
    b0, b1 = boards()
    b1.wait_at(b1.issue("reduce_scatter grads 'blocks.0', 128 x float32"))
    call = b0.issue("all_gather params 'blocks.0', 128 x float32")
    with pytest.raises(RanksDisagree, match=r"ranks disagree at collective #1: rank 0 all_gather params 'blocks\.0', 128 x "
                                            r"float32, rank 1 reduce_scatter grads 'blocks\.0', 128 x float32.*"
                                            r"model\.generate that stops at another length on each rank: pass synced_gpus=True"):
        _waiting.wait(SlowWork(100), call, b0, bounded=True)
    assert json.loads(b0.store.get(b0._key("fault", 1)))["by"] == 0  # published for the ranks not watching rank 1


def test_a_rank_that_never_arrives_is_named_at_the_timeout(fast_slices):
    b0, b1 = boards(timeout=0.05)
    b0.completed(b0.issue("all_reduce metrics, 1 x float32"))
    b1.completed(b1.issue("all_reduce metrics, 1 x float32"))
    call = b0.issue("all_gather params 'blocks.0', 128 x float32")
    start = time.monotonic()
    with pytest.raises(MeshTimeout, match=r"rank 1 did not arrive at collective #2 \(all_gather params 'blocks\.0', 128 x "
                                          r"float32\) in .* within the mesh timeout of 0\.05 s\. Rank 1 took part in "
                                          r"collective #1 \(all_reduce metrics, 1 x float32\)"):
        _waiting.wait(SlowWork(10**6), call, b0, bounded=True)
    assert time.monotonic() - start < 5.0
    assert "did not arrive" in json.loads(b0.store.get(b0._key("fault", 1)))["text"]


def test_a_failed_collective_names_the_rank_whose_process_is_gone(fast_slices):
    b0, b1 = boards()
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    b0.store.set(b0._key("pid", 1), f"{b0.host}\t{gone.pid}")
    call = b0.issue("reduce_scatter grads 'blocks.0', 128 x float32")
    with pytest.raises(RankFailed, match=rf"^fzero\.dist_mesh: rank 1 vanished: its process \(pid {gone.pid} on "
                                          rf".*\[RuntimeError: Connection closed by peer\]$"):
        _waiting.wait(SlowWork(0, error="Connection closed by peer"), call, b0, bounded=True)


GLOO_LOST = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
             "[127.0.0.1]:43678. This is typically caused by a remote worker crashing.")


def test_a_collective_posted_to_a_rank_whose_process_is_gone_names_it():
    """A peer already gone fails the collective when it is issued, not when it is waited for: gloo raises from
    ``isend`` itself (seen in CI as rank 0's raw error in test_a_killed_rank_is_named_as_vanished)."""
    b0, _ = boards()
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    b0.store.set(b0._key("pid", 1), f"{b0.host}\t{gone.pid}")
    b0.enter("fzero.Step.__call__")
    call = b0.issue("all_gather params 'blocks.0', 128 x float32")

    def post():
        raise RuntimeError(GLOO_LOST)

    with pytest.raises(RankFailed, match=rf"^fzero\.dist_mesh: rank 1 vanished: its process \(pid {gone.pid} on .*This rank "
                                          r"\(0\) stopped waiting at collective #1 \(all_gather params 'blocks\.0'") as info:
        _waiting.issued(post, call, b0)
    assert info.value.rank == 1 and b0.failing is info.value and b0.current is None


def test_an_own_error_when_posting_a_collective_passes_unchanged():
    b0, _ = boards()
    call = b0.issue("all_reduce metrics, 1 x complex32")

    def post():
        raise RuntimeError("Unsupported dtype for gloo: ComplexHalf")

    with pytest.raises(RuntimeError, match="^Unsupported dtype for gloo: ComplexHalf$"):
        _waiting.issued(post, call, b0)
    assert b0.failing is None


def test_a_rank_own_report_is_named_before_what_others_saw():
    b0, b1, b2 = boards(3)
    b0.publish(2, "rank 2 did not arrive at collective #5")
    b1.publish(1, "ValueError: x")
    assert first_fault(b0, b0.faults())[0] == 1
    b1.publish(1, "a later report does not replace the first")
    assert b0.faults()[1]["text"] == "ValueError: x"


def test_process_alive_tells_a_zombie_from_a_running_process():
    assert process_alive(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 30
    while process_alive(child.pid) and time.monotonic() < deadline:  # ended but not reaped: a zombie
        time.sleep(0.01)
    assert not process_alive(child.pid)
    child.wait()
    assert not process_alive(child.pid)


def test_the_limit_named_is_the_one_that_ran_out():
    board = boards(timeout=10.0)[0]
    assert _waiting._limit(board, None) == "the mesh timeout of 10 s"
    assert _waiting._limit(board, "RuntimeError: [...] Timed out waiting 10000ms for recv operation") == "the mesh timeout of 10 s"
    assert _waiting._limit(board, "Timed out waiting 4000ms for send").startswith("the process group's timeout of 4 s")


def test_collectives_are_described_in_the_call_that_made_them():
    b0 = boards()[0]
    b0.enter("fzero.Step.__call__")
    b0.enter("fzero.Step.__call__")
    b0.enter("fzero.Step.gather")
    assert str(b0.issue("all_gather gather 'blocks.0', 8 x float32")) == (
        "collective #1 (all_gather gather 'blocks.0', 8 x float32) in call #1 of fzero.Step.gather")


@pytest.mark.parametrize("timeout", [0, -1.0, True, "300"])
def test_dist_mesh_refuses_a_timeout_that_is_not_a_positive_number(timeout):
    import fzero

    with pytest.raises(ValueError, match=r"^fzero\.dist_mesh: timeout must be a number of seconds > 0, got .*dist_mesh\(timeout=1800\)"):
        fzero.dist_mesh(timeout=timeout)


@pytest.mark.torchrun
def test_a_rank_that_ends_its_program_early_is_named(tmp_path):
    """Rank 1 makes one step fewer and ends without an error (at stage 1 its gather is local): rank 0, left at a
    collective of its last step, names it instead of a raw "Connection closed by peer"."""
    proc, seconds, files = run(tmp_path, "fewer", 1)
    assert proc.returncode != 0 and seconds < BOUND, (proc.returncode, seconds, proc.stderr[-5000:])
    error = error_of(files, 0, proc)
    assert error.startswith("RankFailed: fzero.dist_mesh: rank 1 ended its program (its process exited without an "
                            "error) while this rank still expected it at a collective"), error
    assert "in step call #6 (fzero.Step.__call__)" in error
    assert files["rank1"]["error"] is None


@pytest.mark.torchrun
def test_a_rank_that_gathers_while_the_others_step_is_named(tmp_path):
    proc, seconds, files = run(tmp_path, "fewer", 3)
    assert proc.returncode != 0 and seconds < BOUND, (proc.returncode, seconds, proc.stderr[-5000:])
    for rank in (0, 1):
        assert error_of(files, rank, proc).startswith(
            "RanksDisagree: fzero.dist_mesh: ranks start different calls: rank 0 starts its step call #6 "
            "(fzero.Step.__call__), rank 1 its call #1 of fzero.Step.gather.")
