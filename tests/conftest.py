"""Fixtures shared by the test files."""

import pytest
import torch


@pytest.fixture
def one_thread():
    """One intra-op thread, as torchrun gives each rank: bitwise comparisons with torchrun runs need it (one thread sums in one order)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def pytest_runtest_logreport(report):
    """For runs that a time limit may cut short (a lent GPU machine's), written as they happen, not in the summary at
    the end: with ``FZERO_FAILURE_LOG=path`` each failure's traceback is appended to that file, and with
    ``FZERO_OUTCOME_LOG=path`` one line per finished test (``passed``/``failed``/``skipped`` and its id), which a
    later run can pass as ``FZERO_SKIP_DONE=path`` to run only what is left."""
    import os

    if os.environ.get("PYTEST_XDIST_WORKER"):
        return  # under xdist the controller writes, from the reports its workers send
    path = os.environ.get("FZERO_FAILURE_LOG")
    if path and report.failed:
        with open(path, "a") as f:
            f.write(f"=== {report.nodeid} ({report.when}, {report.duration:.1f} s)\n{report.longreprtext[-6000:]}\n\n")
    done = os.environ.get("FZERO_OUTCOME_LOG")
    if done and (report.when == "call" or report.outcome != "passed"):  # one line per test: its call, or what stopped it
        with open(done, "a") as f:
            f.write(f"{report.outcome} {report.nodeid}\n")


def pytest_collection_modifyitems(config, items):
    """``FZERO_SKIP_DONE=path`` (an outcome log, see above): deselect the tests that log says passed or were skipped."""
    import os

    path = os.environ.get("FZERO_SKIP_DONE")
    if not path:
        return
    with open(path) as f:
        lines = [parts for parts in (line.strip().split(" ", 1) for line in f) if len(parts) == 2]  # (failure texts too)
    failed = {nodeid for outcome, nodeid in lines if outcome == "failed"}  # a teardown failure after a passed call
    done = {nodeid for outcome, nodeid in lines if outcome in ("passed", "skipped")} - failed
    keep = [item for item in items if item.nodeid not in done]
    config.hook.pytest_deselected(items=[item for item in items if item.nodeid in done])
    items[:] = keep


def pytest_configure(config):
    """``FZERO_DEVICE_THREAD_TWIN=1``: every step's backward runs, after its loss's node, in a thread without fzero's
    context, as autograd's device thread runs a CUDA backward on a GPU (``tests/test_device_thread.py`` says why). A
    run of the whole suite so, on the CPU, looks for what only a GPU would show of that kind; not a CI setting."""
    import os

    if not os.environ.get("FZERO_DEVICE_THREAD_TWIN"):
        return
    from fzero.mesh import _rank

    backward = _rank._NoteTask.backward

    def without_the_threads_context(ctx, grad):
        out = backward(ctx, grad)
        saved = _rank._local.__dict__.pop("context", None)
        if saved is not None:
            torch.autograd.Variable._execution_engine.queue_callback(lambda: setattr(_rank._local, "context", saved))
        return out

    _rank._NoteTask.backward = staticmethod(without_the_threads_context)
