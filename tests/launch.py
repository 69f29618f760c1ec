"""Launching a 2-process ``torchrun`` job (gloo) from a test, the same way in every test file.

Each rank gets one intra-op thread (torchrun's default, which bitwise comparisons with ``local_mesh``
need), this folder on ``PYTHONPATH`` and Python's fault handler, so that a rank that dies in C++ prints
its Python stacks.

Known defect, not understood yet: in some full-suite runs (about one run in three here, never when
the torchrun tests run alone or under CPU load), one rank of a stage-2 job aborts in C++ with
"terminate called without an active exception" (SIGABRT). The workers meet at a barrier before
tearing down their gloo group, which did not stop it. Such a launch, and only such a launch, is run
once more, and the test says so on stdout. Any other failure, and any wrong number, fails the test.
A likely cause, not confirmed here (it does not happen on demand): a gloo worker thread dropping the last
reference to a tensor while the interpreter finalizes needs the GIL and is ended by the interpreter, which in
C++ is a terminate without an exception (see pytorch/pytorch PR 179291). ``torchrun_failing`` (jobs expected
to fail) never retries.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(__file__)
_CPP_ABORT = "terminate called without an active exception"


def _command(args: list[str], nproc: int) -> tuple[list[str], dict[str, str]]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1",
           "PYTHONPATH": HERE + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), *args], env


def torchrun_failing(args: list[str], *, nproc: int = 2, timeout: float = 120) -> tuple[subprocess.CompletedProcess, float]:
    """The same launch for a job that is expected to fail: its completed process (never asserted) and the seconds
    it took (``time.monotonic``). A job still running after ``timeout`` seconds raises ``subprocess.TimeoutExpired``
    (torchrun and its workers are killed): a hang fails the test instead of stalling the suite."""
    cmd, env = _command(args, nproc)
    start = time.monotonic()
    # its own process group, so that a timeout kills the workers too, not only torchrun
    with subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True) as p:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate()
            raise
    return subprocess.CompletedProcess(cmd, p.returncode, out, err), time.monotonic() - start


def torchrun(args: list[str], *, nproc: int = 2, timeout: float = 240) -> subprocess.CompletedProcess:
    """``python -m torch.distributed.run --standalone --nproc_per_node nproc *args``; asserts it succeeded."""
    cmd, env = _command(args, nproc)
    for attempt in (1, 2):
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        if proc.returncode == 0 or _CPP_ABORT not in proc.stderr or attempt == 2:
            break
        print(f"torchrun: a rank aborted in C++ ({_CPP_ABORT!r}); launching once more (see tests/launch.py):\n"
              f"{proc.stderr[-2000:]}")
    assert proc.returncode == 0, f"torchrun failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc
