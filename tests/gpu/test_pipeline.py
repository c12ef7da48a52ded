"""Rung 9 (cp.async ring) at 1, 2, 3, 4 and 6 stages: every synchronization path of the timeline.

Tile counts T = ceil(K / 32) around the stage count S: T = 1 (partial), T < S-1 (the prologue
commits empty groups), T = S-1 (all tiles issued in the prologue), T = S, T >> S (buffers reused),
partial last tiles, and the unaligned-K path. Outputs NaN-poisoned; two runs must agree bitwise.
"""

import pytest
import torch

from labs import gemm

pytestmark = pytest.mark.gpu

K_VALUES = [8, 24, 32, 40, 64, 72, 96, 104, 128, 136, 200, 1000, 1032]


def _run(M, N, K, stages, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed + K)
    a = torch.randn(M, K, device="cuda", generator=g).bfloat16()
    bt = torch.randn(N, K, device="cuda", generator=g).bfloat16()
    outs = []
    for _ in range(2):
        out = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
        gemm.hgemm(a, bt, 9, out, stages=stages)
        outs.append(out)
    torch.cuda.synchronize()
    ref = a.double() @ bt.double().T
    return gemm.rel_err(outs[0], ref), torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16))


@pytest.mark.parametrize("K", K_VALUES)
@pytest.mark.parametrize("stages", [1, 2, 3, 4, 6])
def test_stages_and_tile_counts(stages, K):
    err, repeatable = _run(130, 250, K, stages)
    assert err < 1e-2, f"stages={stages} K={K}: rel err {err}"
    assert repeatable, f"stages={stages} K={K}: two runs differ (race)"


@pytest.mark.parametrize("K", [1, 7, 33, 999])
def test_unaligned_k(K):
    err, repeatable = _run(129, 64, K, 3)
    assert err < 1e-2 and repeatable


@pytest.mark.sanitize
@pytest.mark.parametrize("stages,K", [(1, 72), (2, 72), (3, 40), (3, 200)])
def test_sanitize_pipeline(stages, K):
    err, repeatable = _run(130, 136, K, stages)
    assert err < 1e-2 and repeatable
