"""Fixtures shared by the test files."""

import pytest
import torch


@pytest.fixture
def one_thread():
    """One intra-op thread, as torchrun gives each rank: bitwise comparisons with torchrun runs need it (DESIGN.md §4)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def pytest_runtest_logreport(report):
    """With ``FZERO_FAILURE_LOG=path``, each failure's traceback is appended to that file as it happens, not only
    in the summary at the end: a run cut short by a time limit (a lent GPU machine's) still says what failed."""
    import os

    path = os.environ.get("FZERO_FAILURE_LOG")
    if not path or os.environ.get("PYTEST_XDIST_WORKER") or not report.failed:
        return  # under xdist the controller writes, from the reports its workers send
    with open(path, "a") as f:
        f.write(f"=== {report.nodeid} ({report.when}, {report.duration:.1f} s)\n{report.longreprtext[-6000:]}\n\n")
