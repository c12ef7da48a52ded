"""The error of the GPU's tanh.approx.f32 (MUFU.TANH), which every softcap kernel uses since the
softcap forward moved off the exact 1 - 2 / (1 + e^2y) (docs/attention_variants.md, "Softcap by the
hardware tanh"): the kernels' logit is cap * tanh(y), so its absolute error is cap times tanh's.

    PYTHONPATH=src python3 scripts/hw_tanh_error.py [--step 64]

Evaluates tanh.approx.f32 on every `step`-th positive fp32 bit pattern from 2^-24 to 2^8 (tanh is odd
and the instruction symmetric; y >= 2^8 gives 1 exactly) and, separately, on the negatives of a
sample of them, and compares with tanh in float64. Prints, per binade range of |y|, the largest
absolute and relative errors, and the summary line the docs quote.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

SOURCE = r"""
extern "C" __global__ void tanh_approx(const float* __restrict__ y, float* __restrict__ t, long long n) {
  const long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x;
  if (i < n) {
    float r;
    asm("tanh.approx.f32 %0, %1;\n" : "=f"(r) : "f"(y[i]));
    t[i] = r;
  }
}
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--step", type=int, default=64, help="evaluate every step-th fp32 bit pattern")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU; nothing measured")
        return 1
    from tileattn.runtime import launcher

    lo = np.float32(2.0**-24).view(np.int32)
    hi = np.float32(2.0**8).view(np.int32)
    bits = np.arange(lo, hi, args.step, dtype=np.int64).astype(np.int32)
    y = torch.from_numpy(bits.view(np.float32)).cuda()  # [n] fp32, positive
    y = torch.cat([y, -y[:: 7]])                          # odd symmetry checked on a sample
    t = torch.full_like(y, float("nan"))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "tanh_approx.cu"
        path.write_text(SOURCE)
        kernel = launcher.load_kernel(path, "tanh_approx")
        n = y.numel()
        launcher.launch(kernel, ((n + 255) // 256, 1, 1), (256, 1, 1), [y.data_ptr(), t.data_ptr(), np.int64(n)])
        torch.cuda.synchronize()
    exact = torch.tanh(y.double())
    err = (t.double() - exact).abs()
    rel = err / exact.abs()
    assert not torch.isnan(t).any(), "tanh.approx returned NaN"
    a = y.abs().double()
    print(f"{n} arguments, every {args.step}th fp32 bit pattern in [2^-24, 2^8) and a sample of negatives")
    print(f"{'|y| range':>18s} {'max abs err':>12s} {'max rel err':>12s} {'log2 rel':>9s}")
    edges = [2.0**-24, 2.0**-12, 2.0**-6, 2.0**-3, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 2.0**8]
    for a0, a1 in zip(edges[:-1], edges[1:]):
        sel = (a >= a0) & (a < a1)
        if sel.any():
            m_abs, m_rel = err[sel].max().item(), rel[sel].max().item()
            print(f"[{a0:8.3g}, {a1:7.3g}) {m_abs:12.3e} {m_rel:12.3e} {np.log2(m_rel):9.2f}")
    m_abs, m_rel = err.max().item(), rel.max().item()
    worst = y[err.argmax()].item()
    print(f"overall: max |error| {m_abs:.3e} (at y = {worst:.6g}), max relative {m_rel:.3e} "
          f"(2^{np.log2(m_rel):.2f}); |error| <= {m_abs:.2e} means a logit error <= cap * {m_abs:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
