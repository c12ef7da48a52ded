"""GPU tests of the reduction lab (labs/reduction.py, labs/csrc/reduction.cu): every correct version,
sum and max, at edge lengths, misaligned views and repeated one-launch calls.

Fresh random inputs each run (the seed is in every assertion message; replay with
TILEATTN_TEST_SEED=<seed>); the one-element output is poisoned with NaN before each launch, so a
result that was never written fails. Cases marked `sanitize` are small enough for
compute-sanitizer (`make gpu-check` reruns them under memcheck/racecheck/synccheck/initcheck).
"""

import math
import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # `labs` lives at the repository root
    sys.path.insert(0, str(ROOT))

from labs import reduction as lab  # noqa: E402

pytestmark = pytest.mark.gpu

EDGE_LENGTHS = (1, 2, 31, 32, 33, 63, 64, 65, 255, 256, 257, 511, 512, 513, 1003, 4097)
VEC4_VERSIONS = tuple(k for k in lab.CORRECT if k.startswith(("v5", "v6")))


@pytest.fixture
def gen():
    """A fresh CUDA generator; its seed (for failure messages) is g.initial_seed()."""
    seed = int(os.environ.get("TILEATTN_TEST_SEED", torch.randint(0, 2**31 - 1, ()).item()))
    g = torch.Generator(device="cuda")
    g.manual_seed(seed)
    return g


def _run(x, op, version):
    out = torch.full((1,), float("nan"), device=x.device)  # poisoned: an unwritten result fails
    got = lab.reduce(x, op, version, out=out)
    assert got.data_ptr() == out.data_ptr()
    return got


def _check(x, op, got, seed, what):
    rec = lab.check_result(x, op, got)
    detail = f"{what}: got {rec['got']!r}, expected {rec['ref']!r} (seed {seed})"
    if op == "sum":
        assert rec["correct"], f"{detail}, relative error {rec['rel_err']:.3e} > {lab.sum_tolerance(x.numel()):.0e}"
    else:
        assert rec["exact"], detail


@pytest.mark.sanitize
@pytest.mark.parametrize("op", ["sum", "max"])
@pytest.mark.parametrize("version", lab.CORRECT)
def test_lab_lengths(version, op, gen):
    for n in lab.CHECK_LENGTHS:
        x = lab.random_input(n, generator=gen)
        _check(x, op, _run(x, op, version), gen.initial_seed(), f"{version} {op} n={n}")


@pytest.mark.parametrize("op", ["sum", "max"])
@pytest.mark.parametrize("version", lab.CORRECT)
def test_edge_and_multi_block_lengths(version, op, gen):
    for n in EDGE_LENGTHS + (1 << 20, (1 << 20) + 3, 3 * (1 << 20) + 7):
        x = lab.random_input(n, generator=gen)
        _check(x, op, _run(x, op, version), gen.initial_seed(), f"{version} {op} n={n}")


@pytest.mark.sanitize
@pytest.mark.parametrize("version", lab.CORRECT)
def test_max_of_negative_values_uses_minus_inf(version, gen):
    # Lanes past the end must hold -inf, not 0: with all-negative data a 0 would win.
    for n in (1, 33, 1003):
        x = -1.0 - torch.rand(n, device="cuda", generator=gen)
        _check(x, "max", _run(x, "max", version), gen.initial_seed(), f"{version} max of negatives n={n}")


@pytest.mark.sanitize
@pytest.mark.parametrize("version", VEC4_VERSIONS)
def test_misaligned_views(version, gen):
    # x + offset is only 4-byte aligned: the float4 kernels peel a scalar head.
    base = lab.random_input(5000, generator=gen)
    for offset in (1, 2, 3):
        for n in (1, 2, 3, 5, 1003, 4990):
            x = base[offset:offset + n]
            for op in ("sum", "max"):
                _check(x, op, _run(x, op, version), gen.initial_seed(), f"{version} {op} offset={offset} n={n}")


@pytest.mark.parametrize("version", [k for k in VEC4_VERSIONS if k.startswith("v6")])
def test_onepass_counter_returns_to_zero(version, gen):
    # Different grid sizes back to back: each launch must leave the ticket counter at 0.
    for n in (5, 70_000, 1 << 22, 300, (1 << 22) + 1, 1):
        x = lab.random_input(n, generator=gen)
        _check(x, "sum", _run(x, "sum", version), gen.initial_seed(), f"{version} n={n}")
        torch.cuda.synchronize()
        assert int(lab._counter(x.device).item()) == 0, f"{version} left the counter non-zero after n={n}"


def test_large_sum_is_accurate(gen):
    n = (1 << 28) + 5
    x = lab.random_input(n, generator=gen)
    for version in (lab.DEFAULT_VERSION, lab.TWO_PASS_DEFAULT, "v4_warp_shuffle"):
        _check(x, "sum", _run(x, "sum", version), gen.initial_seed(), f"{version} n={n}")
    got = _run(x, "max", lab.DEFAULT_VERSION)
    assert float(got) == float(torch.amax(x))


def test_empty_and_refusals():
    x = torch.empty(0, device="cuda")
    assert float(lab.reduce(x, "sum")) == 0.0
    with pytest.raises(ValueError, match="empty"):
        lab.reduce(x, "max")
    y = torch.ones(10, device="cuda")
    with pytest.raises(ValueError, match="deliberately broken"):
        lab.reduce(y, "sum", "bug_missing_barrier")
    with pytest.raises(ValueError, match="float32"):
        lab.reduce(y.double(), "sum")
    with pytest.raises(ValueError, match="contiguous 1-D"):
        lab.reduce(torch.ones(4, 4, device="cuda")[:, 0], "sum")
    with pytest.raises(ValueError, match="one element"):
        lab.reduce(y, "sum", out=torch.empty(2, device="cuda"))


def test_grid_is_one_wave():
    x = torch.ones(1 << 24, device="cuda")
    for version in VEC4_VERSIONS:
        v = lab.VERSIONS[version]
        grid = lab._grid_stride_grid(v, v.expr("sum"), x.numel(), x.device)
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        assert sms <= grid <= sms * (2048 // v.block), f"{version}: grid {grid} for {sms} SMs"
        assert math.isclose(float(lab.reduce(x, "sum", version)), float(x.numel()))
