"""The runtime on a GPU: dynamic shared memory above 48 KB, the device limit, torch-stream order."""

from pathlib import Path

import numpy as np
import pytest
import torch

from tileattn.runtime import LaunchError, device_smem_optin, launch, load_kernel

PROBE = Path(__file__).parent / "kernels" / "smem_probe.cu"
pytestmark = pytest.mark.gpu


@pytest.mark.sanitize
@pytest.mark.parametrize("kib", [4, 100, 200])
def test_dynamic_shared_memory(kib):
    n = kib * 1024 // 4
    kernel = load_kernel(PROBE, "smem_roundtrip")
    x = torch.randn(n, device="cuda")
    out = torch.full_like(x, float("nan"))
    launch(kernel, (1,), (256,), (x.data_ptr(), out.data_ptr(), np.int32(n)), smem=n * 4)
    torch.testing.assert_close(out, x.flip(0), rtol=0, atol=0)


def test_shared_memory_over_device_limit_is_refused():
    kernel = load_kernel(PROBE, "smem_roundtrip")
    limit = torch.cuda.get_device_properties(0).shared_memory_per_block_optin
    x = torch.randn(16, device="cuda")
    with pytest.raises(LaunchError, match="allows"):
        launch(kernel, (1,), (32,), (x.data_ptr(), x.data_ptr(), np.int32(16)), smem=limit + 1024)


def test_device_smem_optin_matches_torch_and_rejects_bad_indices():
    assert device_smem_optin(0) == torch.cuda.get_device_properties(0).shared_memory_per_block_optin
    for bad in (-1, torch.cuda.device_count(), "0", True):
        with pytest.raises(ValueError, match="device_index"):
            device_smem_optin(bad)


def test_launch_orders_with_torch_stream():
    """Work on a side stream: our launch must run after torch's producer on that stream."""
    kernel = load_kernel(PROBE, "smem_roundtrip")
    n = 4096
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        x = torch.randn(n, device="cuda")
        y = x * 2  # enqueued on `side`
        out = torch.full_like(x, float("nan"))
        launch(kernel, (1,), (256,), (y.data_ptr(), out.data_ptr(), np.int32(n)), smem=n * 4)
    side.synchronize()
    torch.testing.assert_close(out, (x * 2).flip(0), rtol=0, atol=0)


def test_bad_geometry_is_refused():
    kernel = load_kernel(PROBE, "smem_roundtrip")
    with pytest.raises(LaunchError, match="empty launch"):
        launch(kernel, (0,), (32,), (0, 0, np.int32(0)))
