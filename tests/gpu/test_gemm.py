"""Every GEMM ladder rung (labs/csrc/gemm.cu) on small, irregular sizes, outputs poisoned with NaN.

fp32 rungs against a float64 reference of the fp32 inputs; tensor-core rungs against a float64
reference of the same bf16/fp16-rounded inputs. Run with `pytest -m gpu tests/gpu/test_gemm.py`.
"""

import pytest
import torch

pytestmark = pytest.mark.gpu

from labs import gemm  # noqa: E402

FP32_SIZES = [(1, 1, 1), (17, 33, 9), (64, 64, 8), (129, 130, 67), (200, 256, 36)]  # M, N, K
TC_SIZES = [(1, 1, 8), (1, 1, 1), (17, 33, 9), (128, 256, 64), (129, 130, 67), (200, 300, 136), (64, 72, 1000)]


def _rel(out, ref):
    out = out.double()
    assert torch.isfinite(out).all(), "NaN/inf in the output: an element was not written"
    return (torch.linalg.norm(out - ref) / torch.linalg.norm(ref)).item()


def _inputs(M, N, K, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed + 1000 * M + N + 7 * K)
    return torch.randn(M, K, device="cuda", generator=g), torch.randn(K, N, device="cuda", generator=g)


@pytest.mark.parametrize("size", FP32_SIZES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("rung", [1, 2, 3, 4, 5, 6, 7, "x"])
def test_fp32_rungs(rung, size):
    M, N, K = size
    a, b = _inputs(M, N, K)
    out = torch.full((M, N), float("nan"), device="cuda")
    gemm.sgemm(a, b, rung, out)
    torch.cuda.synchronize()
    assert _rel(out, a.double() @ b.double()) < 1e-5


@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize("vec", [False, True])
def test_warptile_variants(vec, prefetch):
    M, N, K = 260, 132, 68  # multiples of 4: both load paths are legal
    a, b = _inputs(M, N, K, seed=1)
    call = gemm._fp32_call(a, b, 7, expr=gemm.fp32_expr(7, vec, prefetch))
    out = call()
    out.fill_(float("nan"))
    out = call()
    torch.cuda.synchronize()
    assert _rel(out, a.double() @ b.double()) < 1e-5


def _tc_inputs(M, N, K, dtype, seed=0):
    a, b = _inputs(M, N, K, seed)
    return a.to(dtype), b.t().contiguous().to(dtype)


@pytest.mark.parametrize("size", TC_SIZES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("rung", [8, 9])
def test_mma_rungs(rung, dtype, size):
    M, N, K = size
    a, bt = _tc_inputs(M, N, K, dtype)
    out = torch.full((M, N), float("nan"), device="cuda", dtype=dtype)
    gemm.hgemm(a, bt, rung, out)
    torch.cuda.synchronize()
    assert _rel(out, a.double() @ bt.double().T) < (1e-2 if dtype == torch.bfloat16 else 2e-3)


def test_unaligned_pointer_takes_scalar_path():
    M, N, K = 33, 40, 64
    a, bt = _tc_inputs(M, N, K, torch.bfloat16)
    storage = torch.empty(M * K + 1, device="cuda", dtype=torch.bfloat16)
    a_off = storage[1:].view(M, K)  # base 2 bytes past a 16-byte boundary
    a_off.copy_(a)
    assert not gemm.tc_aligned(a_off, bt, K)
    for rung in (8, 9):
        out = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
        gemm.hgemm(a_off, bt, rung, out)
        torch.cuda.synchronize()
        assert _rel(out, a.double() @ bt.double().T) < 1e-2


def _hopper():
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


@pytest.mark.skipif(not _hopper(), reason="rung 10 needs an sm_90 GPU (TMA, wgmma)")
def test_tma_selftest():
    results = gemm.selftest_tma(verbose=False)
    assert results and all(v == "PASS" for v in results.values()), results


@pytest.mark.skipif(not _hopper(), reason="rung 10 needs an sm_90 GPU (TMA, wgmma)")
@pytest.mark.parametrize("size", TC_SIZES + [(1000, 1001, 999), (300, 520, 4096)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("config", [(256, 4), (256, 3), (128, 4)], ids=lambda c: f"bn{c[0]}s{c[1]}")
def test_rung10_bf16(config, size):
    M, N, K = size
    a, bt = _tc_inputs(M, N, K, torch.bfloat16)
    out = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
    gemm.hgemm(a, bt, 10, out, bn=config[0], wgmma_stages=config[1])
    torch.cuda.synchronize()
    assert _rel(out, a.double() @ bt.double().T) < 1e-2


@pytest.mark.skipif(not _hopper(), reason="rung 10 needs an sm_90 GPU (TMA, wgmma)")
@pytest.mark.parametrize("size", [(17, 33, 8), (129, 130, 67), (256, 512, 1024)], ids=lambda s: "x".join(map(str, s)))
def test_rung10_fp16(size):
    M, N, K = size
    a, bt = _tc_inputs(M, N, K, torch.float16)
    out = torch.full((M, N), float("nan"), device="cuda", dtype=torch.float16)
    gemm.hgemm(a, bt, 10, out)
    torch.cuda.synchronize()
    assert _rel(out, a.double() @ bt.double().T) < 2e-3


@pytest.mark.skipif(not _hopper(), reason="rung 10 needs an sm_90 GPU (TMA, wgmma)")
def test_rung10_rejects_unpadded_odd_k():
    a, bt = _tc_inputs(16, 16, 9, torch.bfloat16)
    with pytest.raises(ValueError, match="K % 8"):
        gemm.hgemm(a, bt, 10, pad_k=False)


# Small cases that `make gpu-check` re-runs under compute-sanitizer (memcheck, racecheck, synccheck,
# initcheck): one per kernel kind, tiny so the instrumented run stays fast.
@pytest.mark.sanitize
@pytest.mark.parametrize("rung", [3, 5, 6, 7])
def test_sanitize_fp32(rung):
    a, b = _inputs(70, 66, 20)
    out = torch.full((70, 66), float("nan"), device="cuda")
    gemm.sgemm(a, b, rung, out)
    torch.cuda.synchronize()
    assert _rel(out, a.double() @ b.double()) < 1e-5


@pytest.mark.sanitize
@pytest.mark.parametrize("rung,stages", [(8, 1), (9, 1), (9, 2), (9, 3)])
def test_sanitize_tc(rung, stages):
    a, bt = _tc_inputs(130, 136, 104, torch.bfloat16)
    out = torch.full((130, 136), float("nan"), device="cuda", dtype=torch.bfloat16)
    gemm.hgemm(a, bt, rung, out, stages=stages)
    torch.cuda.synchronize()
    assert _rel(out, a.double() @ bt.double().T) < 1e-2


@pytest.mark.sanitize
@pytest.mark.skipif(not _hopper(), reason="rung 10 needs an sm_90 GPU (TMA, wgmma)")
def test_sanitize_rung10():
    a, bt = _tc_inputs(130, 260, 136, torch.bfloat16)
    out = torch.full((130, 260), float("nan"), device="cuda", dtype=torch.bfloat16)
    gemm.hgemm(a, bt, 10, out)
    torch.cuda.synchronize()
    assert _rel(out, a.double() @ bt.double().T) < 1e-2


def test_argument_errors():
    a, b = _inputs(8, 8, 8)
    with pytest.raises(ValueError, match="inner dimensions"):
        gemm.sgemm(a, b[:4].contiguous())
    with pytest.raises(ValueError, match="float32"):
        gemm.sgemm(a.double(), b)
    with pytest.raises(ValueError, match="contiguous"):
        gemm.sgemm(a.t(), b)
    with pytest.raises(ValueError, match="one dtype"):
        gemm.hgemm(a.bfloat16(), b.half())
