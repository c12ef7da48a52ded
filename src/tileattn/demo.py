"""`tileattn demo` (run by `make demo` after the CPU lab): checks that need no GPU, then the GPU part.

Without a GPU it says plainly what it skipped; with one it runs the fused kernel against the
float64 reference and the seed benchmark table.
"""

from __future__ import annotations

import torch

from . import reference


def _reference_check() -> float:
    """tileattn.reference against torch SDPA's math path on a small GQA causal case (CPU)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(2, 8, 33, 64, dtype=torch.float64)
    k = torch.randn(2, 2, 33, 64, dtype=torch.float64)
    v = torch.randn(2, 2, 33, 64, dtype=torch.float64)
    out, _ = reference.attention(q, k, v, causal=True)
    with sdpa_kernel(SDPBackend.MATH):
        expected = torch.nn.functional.scaled_dot_product_attention(
            q, k.repeat_interleave(4, dim=1), v.repeat_interleave(4, dim=1), is_causal=True
        )
    return float((out - expected).norm() / expected.norm())


def run_demo() -> int:
    err = _reference_check()
    print(f"reference vs torch SDPA (math), B=2 H=8 Hkv=2 N=33 d=64 causal, float64: rel. error {err:.2e}")
    if err > 1e-12:
        print("FAIL: the reference disagrees with torch")
        return 1
    if not torch.cuda.is_available():
        print("skipped (no CUDA GPU visible to torch): the fused attention kernels against the reference, "
              "and the benchmark table (tileattn bench attention). `tileattn check` compiles every kernel "
              "without a GPU; `make gpu-check` runs the GPU tests on a machine with one.")
        return 0
    from .bench.attention import main as bench_main

    return bench_main(["--demo"])
