"""Shared test setup: the `gpu` marker skips visibly when no CUDA device is present; on a GPU machine
the compiled path (runtime.host_launch) is switched on and loaded before the tests run."""

import os

import pytest
import torch

import labs.kernels  # noqa: F401  (registers the lab kernel families with tileattn's registry)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    reason = f"no CUDA GPU: torch {torch.__version__} reports torch.cuda.is_available() == False"
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session", autouse=True)
def compiled_forward_path():
    """On a GPU machine every test runs with the compiled path (runtime.host_launch) loaded,
    as a warmed-up process does, instead of switching paths mid-session when its background build
    ends; tests/gpu/test_host_launch.py checks that it loads and compares the two paths."""
    if torch.cuda.is_available():
        from tileattn.runtime import host_launch

        os.environ.setdefault("TILEATTN_HOST_LAUNCH", "1")  # on for the tests (the default) unless set to 0
        host_launch.wait(600)
    yield
