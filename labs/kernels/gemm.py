"""GEMM ladder (labs/csrc/gemm.cu): the registered instantiations, and the host side of TMA.

Families:
  gemm_fp32   rungs 1-7 (FFMA), sm_90a and sm_80
  gemm_tc     rungs 8-9 (mma.sync + ldmatrix, cp.async), sm_90a and sm_80; rung 9 at 1, 2, 3, 4
              and 6 stages (labs.pipeline uses 1-3; 6 is the "deeper pipeline loses" case)
  gemm_sm90   rung 10 (TMA + mbarrier + wgmma + setmaxnreg) and the TMA self-test probe, sm_90a only

Rung 10's TMA descriptors come from `tileattn.runtime.tensor_map` and launch through
`tileattn.runtime.launch` like every other kernel.
"""

from __future__ import annotations

from tileattn.kernels import Family

from . import LABS_CSRC

# ---- instantiations ---------------------------------------------------------------------------
FP32 = {
    1: "sgemm_naive",
    2: "sgemm_coalesced",
    3: "sgemm_smem<32>",
    4: "sgemm_1d<64, 64, 8, 8>",
    5: "sgemm_2d<64, 64, 8, 8, 8>",
    6: "sgemm_vec<true>",
    7: "sgemm_warptile<true, true>",
}
FP32_VARIANTS = (  # scalar-load fallbacks (unaligned N or K) and the one-idea-at-a-time variants
    "sgemm_vec<false>",
    "sgemm_warptile<false, true>",
    "sgemm_warptile<true, false>",
    "sgemm_warptile<false, false>",
)
SPILLING = "sgemm_2d<128, 128, 8, 16, 16>"  # deliberately too large a per-thread tile: spills

TC_STAGES = (1, 2, 3, 4, 6)
DEFAULT_STAGES = 3


def mma_name(bf16: bool, aligned: bool) -> str:
    return f"hgemm_mma<{str(bf16).lower()}, {str(aligned).lower()}>"


def cp_async_name(bf16: bool, stages: int, aligned: bool) -> str:
    return f"hgemm_cp_async<{str(bf16).lower()}, {stages}, {str(aligned).lower()}>"


def wgmma_name(bf16: bool, bn: int, stages: int) -> str:
    return f"hgemm_tma_wgmma<{str(bf16).lower()}, {bn}, {stages}>"


TC = tuple(
    [mma_name(b, a) for b in (True, False) for a in (True, False)]
    + [cp_async_name(True, s, True) for s in TC_STAGES]
    + [cp_async_name(False, DEFAULT_STAGES, True), cp_async_name(True, DEFAULT_STAGES, False),
       cp_async_name(False, DEFAULT_STAGES, False)]
)
WGMMA_CONFIGS = ((256, 4), (256, 3), (128, 4))  # (BN, stages) for bf16; fp16 gets the first
SM90 = tuple([wgmma_name(True, bn, s) for bn, s in WGMMA_CONFIGS] + [wgmma_name(False, 256, 4), "tma_probe"])

FAMILIES = (
    Family(
        name="gemm_fp32",
        source=LABS_CSRC / "gemm.cu",
        instantiations=tuple(FP32.values()) + FP32_VARIANTS + (SPILLING,),
        broken=frozenset({SPILLING}),
    ),
    Family(name="gemm_tc", source=LABS_CSRC / "gemm.cu", instantiations=TC),
    Family(name="gemm_sm90", source=LABS_CSRC / "gemm.cu", instantiations=SM90, archs=("sm_90a",)),
)

# Rung 10 geometry (must match namespace h100 in gemm.cu).
WGMMA_BM, WGMMA_BK, WGMMA_THREADS = 128, 64, 384


def wgmma_smem_bytes(bn: int, stages: int) -> int:
    return stages * (WGMMA_BM + bn) * WGMMA_BK * 2 + 1024
