"""Programmatic dependent launch (PDL) on and off, for three single calls: host microseconds per eager
call (bench.harness.host_overhead_us) and the event-timed device time (bench.harness's timer, with and
without the L2 flush) of add_rms_norm [1, 4096], tileattn.linear at M = 1 (6144 x 4096) and a B=1 GQA
(32/8, d=128) paged decode over 4096 keys, bf16.

    PYTHONPATH=src python3 scripts/pdl_timing_probe.py

Written to test whether one-call event timings of PDL-launched kernels mean anything. Run on the
H200 (2026-12-01 23:31 UTC) against the harness of commit be9bde3, before measure() forced PDL off,
its device columns read, without / with PDL: add_rms_norm 65.6 / 53.5 us, the GEMV 47.9 / 18.7,
the decode 26.0 / 51.6 (host 28-46 us per call, so host-bound either way): one-call timings of PDL
launches are not interpretable, and bench.harness.measure now launches without PDL. With the
current harness the device columns of the PDL=1 rows are plain launches too; the host column still
compares the two launch paths.
"""

from __future__ import annotations

import os
import sys

import torch

import tileattn
from tileattn.api_layers import add_rms_norm
from tileattn.bench import harness


def main() -> int:
    if not torch.cuda.is_available():
        print("needs a CUDA GPU; nothing measured")
        return 1
    dev, bf16 = "cuda", torch.bfloat16
    x = torch.randn(1, 4096, device=dev, dtype=bf16)  # [1, 4096]
    w = torch.ones(4096, device=dev, dtype=bf16)
    weight = torch.randn(6144, 4096, device=dev, dtype=bf16) / 64  # [N, K]
    bs, nk, hq, hk, d = 16, 4096, 32, 8, 128
    k_cache = torch.randn(nk // bs, bs, hk, d, device=dev, dtype=bf16)  # [blocks, bs, Hkv, d]
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(1, hq, d, device=dev, dtype=bf16)  # [T, H, d]
    table = torch.randperm(nk // bs, device=dev, dtype=torch.int32)[None]  # [1, blocks]
    cu_q = torch.tensor([0, 1], device=dev, dtype=torch.int32)
    lens = torch.tensor([nk], device=dev, dtype=torch.int32)
    cases = {"add_rms_norm": lambda: add_rms_norm(x, w, 1e-5),
             "linear_gemv_m1": lambda: tileattn.linear(x, weight),
             "paged_decode_gqa_b1_4k": lambda: tileattn.attention_paged(q, k_cache, v_cache, table, cu_q, lens, 1, nk)}
    for name, fn in cases.items():
        for pdl in ("0", "1"):
            os.environ["TILEATTN_PDL"] = pdl
            host = harness.host_overhead_us(fn, calls=300)
            flushed = harness.measure(fn, reps=30, memory=False).median_ms * 1e3
            warm = harness.measure(fn, reps=30, memory=False, flush_l2=False).median_ms * 1e3
            print(f"{name:24s} PDL={pdl}: host {host:6.1f} us/call  device (flushed) {flushed:7.1f} us  "
                  f"(no flush) {warm:7.1f} us", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
