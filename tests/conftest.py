"""Shared test setup: the `gpu` marker skips visibly when no CUDA device is present."""

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
