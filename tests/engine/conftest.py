"""Engine tests run their tiny models on one CPU thread: at these sizes (hidden 64, a few tokens)
every op is a few microseconds of work, and a second OpenMP thread only adds synchronisation that
turns into long stalls on a loaded CI machine (measured: 46 s -> 8 s for the bench smoke test)."""

import pytest
import torch


@pytest.fixture(autouse=True, scope="package")
def one_cpu_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
