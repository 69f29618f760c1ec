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
