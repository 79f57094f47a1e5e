"""Shared fixtures for the training tests."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    """Two cores shared with other jobs: one torch thread avoids oversubscription stalls."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
