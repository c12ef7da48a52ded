"""GPU tests of the transpose lab (labs/transpose.py, labs/csrc/transpose.cu): every version, fp32
and bf16, square, rectangular and edge-tile shapes, exact equality with torch's transpose.

Fresh random inputs, output poisoned with NaN before each launch (an element never written stays
NaN and fails torch.equal). Cases marked `sanitize` are small enough for compute-sanitizer.
"""

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from labs import transpose as lab  # noqa: E402

pytestmark = pytest.mark.gpu

SMALL = ((1, 1), (1, 37), (37, 1), (31, 33), (32, 32), (33, 31), (63, 65), (64, 64), (65, 127), (96, 160))
LARGE = ((1000, 3001), (4096, 8192), (8192, 4096), (2048 + 4, 1024 + 12))


def _check(x, version):
    rows, cols = x.shape
    out = torch.full((cols, rows), float("nan"), dtype=x.dtype, device=x.device)
    got = lab.transpose(x, version, out)
    assert got.data_ptr() == out.data_ptr()
    ok = torch.equal(out, x.t().contiguous())
    if not ok:
        bad = (out != x.t()).nonzero()
        raise AssertionError(f"{version} {x.dtype} {rows}x{cols}: {bad.shape[0]} wrong elements, first at {bad[0].tolist()}")


@pytest.mark.sanitize
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("version", lab.VERSIONS)
def test_small_and_edge_shapes(version, dtype):
    for rows, cols in SMALL:
        _check(torch.randn(rows, cols, device="cuda").to(lab.DTYPES[dtype]), version)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("version", lab.VERSIONS)
def test_large_and_rectangular(version, dtype):
    for rows, cols in LARGE:
        _check(torch.randn(rows, cols, device="cuda").to(lab.DTYPES[dtype]), version)


@pytest.mark.sanitize
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_vec4_misaligned_base_falls_back(dtype):
    # A view starting one element into its storage: not 16-byte aligned, so vec_ok is false.
    rows, cols = 128, 192
    flat = torch.randn(rows * cols + 1, device="cuda").to(lab.DTYPES[dtype])
    x = flat[1:].view(rows, cols)
    assert x.data_ptr() % 16 != 0
    _check(x, "transpose_vec4")


def test_default_allocates_output():
    x = torch.randn(100, 300, device="cuda")
    assert torch.equal(lab.transpose(x), x.t())


def test_refusals():
    x = torch.randn(8, 8, device="cuda")
    with pytest.raises(ValueError, match="contiguous 2-D"):
        lab.transpose(x.t())
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        lab.transpose(x.half())
    with pytest.raises(ValueError, match="unknown version"):
        lab.transpose(x, "transpose_magic")
    with pytest.raises(ValueError, match="out must be contiguous with shape"):
        lab.transpose(torch.randn(8, 4, device="cuda"), out=torch.empty(8, 4, device="cuda"))
