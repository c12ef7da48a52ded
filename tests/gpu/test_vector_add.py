"""Vector add on the GPU: edge lengths, misaligned views, 2^28, CUDA-graph capture, bad input."""

import pytest
import torch

from labs.vector_add import VERSIONS, vector_add

pytestmark = pytest.mark.gpu


def _check(a, b, **kw):
    out = torch.full_like(a, float("nan"))  # poison: an unwritten element fails the comparison
    vector_add(a, b, out, **kw)
    torch.testing.assert_close(out, a + b, rtol=0, atol=0)


@pytest.mark.sanitize
@pytest.mark.parametrize("n", [1, 31, 32, 33, 1003])
@pytest.mark.parametrize("version", VERSIONS)
def test_edge_lengths(n, version):
    a, b = torch.randn(n, device="cuda"), torch.randn(n, device="cuda")
    _check(a, b, version=version)


@pytest.mark.sanitize
@pytest.mark.parametrize("offset", [1, 2, 3])
def test_misaligned_views_take_the_scalar_path(offset):
    base_a, base_b = torch.randn(1003 + offset, device="cuda"), torch.randn(1003 + offset, device="cuda")
    _check(base_a[offset:], base_b[offset:])


def test_large():
    n = 1 << 28
    a, b = torch.randn(n, device="cuda"), torch.randn(n, device="cuda")
    _check(a, b)


@pytest.mark.sanitize
def test_cuda_graph_capture_and_replay():
    n = 100_003
    a, b = torch.randn(n, device="cuda"), torch.randn(n, device="cuda")
    out = torch.empty_like(a)
    vector_add(a, b, out)  # warm-up outside capture: compile and load
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        vector_add(a, b, out)
    for _ in range(2):  # new data into the static inputs, replay, compare
        a.copy_(torch.randn(n, device="cuda"))
        b.copy_(torch.randn(n, device="cuda"))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, a + b, rtol=0, atol=0)


def test_bad_input_is_rejected_before_launch():
    a = torch.randn(8, device="cuda")
    with pytest.raises(ValueError, match="float32"):
        vector_add(a.half(), a.half())
    with pytest.raises(ValueError, match="CUDA"):
        vector_add(a.cpu(), a.cpu())
    with pytest.raises(ValueError, match="mismatch"):
        vector_add(a, torch.randn(9, device="cuda"))
    with pytest.raises(ValueError, match="contiguous"):
        vector_add(torch.randn(8, 2, device="cuda")[:, 0], torch.randn(8, device="cuda"))
