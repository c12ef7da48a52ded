"""Throughput of the exponential unit (MUFU) on this GPU, beside FFMA, in lanes per SM and clock.

    PYTHONPATH=src python scripts/mufu_throughput.py

Each op runs as eight independent dependency chains per thread (256 threads x 8 blocks per SM,
4096 iterations), so its pipe, not its latency, sets the time; the best of five launches is
reported as lanes (thread-operations) per SM per clock at the GPU's maximum SM clock, which the
short launches run at (a lower real clock would make the true rate higher). Ops: ex2.approx.ftz.f32
(the softmax's exponential), tanh.approx.f32 (softcap's tanh), both interleaved, tanh.approx.f16x2
(two tanh per instruction: counted per element), fma.rn.f32. Used for docs/attention_variants.md,
"Softcap's exponentials at d = 64, again".
"""

from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path

import numpy as np

SOURCE = r"""
// kOp: 0 ex2.f32, 1 tanh.f32, 2 ex2 and tanh alternating, 3 tanh.f16x2, 4 ffma
template <int kOp>
__global__ void mufu_loop(float* out, int iters, float a) {
  float r[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) r[i] = a * (threadIdx.x + i) * 1e-3f;
  for (int it = 0; it < iters; ++it) {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      if (kOp == 0 || (kOp == 2 && i % 2 == 0)) {  // i is a constant after unrolling
        asm volatile("ex2.approx.ftz.f32 %0, %0;" : "+f"(r[i]));
      } else if (kOp == 1 || kOp == 2) {
        asm volatile("tanh.approx.f32 %0, %0;" : "+f"(r[i]));
      } else if (kOp == 3) {
        asm volatile("tanh.approx.f16x2 %0, %0;" : "+r"(*reinterpret_cast<unsigned*>(&r[i])));
      } else {
        asm volatile("fma.rn.f32 %0, %0, %0, %0;" : "+f"(r[i]));
      }
    }
  }
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < 8; ++i) sum += r[i];
  if (sum == 12345.f) out[0] = sum;  // keeps the chains alive
}
"""
OPS = {0: ("ex2.approx.ftz.f32", 1), 1: ("tanh.approx.f32", 1), 2: ("ex2 + tanh, alternating", 1),
       3: ("tanh.approx.f16x2", 2), 4: ("fma.rn.f32", 1)}


def main() -> int:
    import torch

    from tileattn.runtime import device_sm_count, launch, load_kernel

    dev = torch.cuda.current_device()
    sms = device_sm_count(dev)
    query = ["nvidia-smi", f"--id={dev}", "--query-gpu=clocks.max.sm", "--format=csv,noheader,nounits"]
    clock_mhz = float(subprocess.run(query, capture_output=True, text=True, check=True).stdout.split()[0])
    out = torch.zeros(1, device="cuda")
    blocks, threads, iters = sms * 8, 256, 4096
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "mufu_loop.cu"
        path.write_text(SOURCE)
        for op, (name, elements) in OPS.items():
            kernel = load_kernel(path, f"mufu_loop<{op}>", device_index=dev)
            args = (out.data_ptr(), np.int32(iters), np.float32(0.5))
            launch(kernel, (blocks,), (threads,), args)
            best = float("inf")
            for _ in range(5):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                launch(kernel, (blocks,), (threads,), args)
                end.record()
                end.synchronize()
                best = min(best, start.elapsed_time(end))
            lanes = blocks * threads * iters * 8 * elements
            print(json.dumps({"op": name, "ms": round(best, 4), "sm_clock_mhz": clock_mhz,
                              "lanes_per_sm_per_clock": round(lanes / sms / (best * 1e-3) / (clock_mhz * 1e6), 2)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
