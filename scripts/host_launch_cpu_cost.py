"""The compiled attention path's own host cost without a GPU (docs/runtime.md, "The compiled attention path").

    PYTHONPATH=src python scripts/host_launch_cpu_cost.py [--calls 2000] [--rounds 15]

Builds runtime/host_launch.cpp (or finds it cached), configures it for CPU tensors with C no-ops in
place of cuLaunchKernel and cuStreamIsCapturing (compiled here with the system C compiler), and
registers one record with the Hopper forward plan's parameter kinds: four 128-byte tensor maps (q,
k, v, out), lse's pointer, an int32 scalar, the tile counter. Then it times, in bursts (median of
rounds, us per call): forward(want 0), forward(want 1), forward(want 3) (the C++ autograd Function),
and beside them in the same process torch.empty_strided of the same out from Python and a Python
autograd.Function.apply of an identity. Then a backward record with the Hopper backward plan's
three launches (pre: six pointers; main: six tensor maps and four pointers; convert: two pointers)
and the op-level backward(...) (dq, dk, dv, the workspace, the maps, three no-op launches), beside
the four torch.empty_strided / torch.empty calls that the Python path's backward makes. What it
leaves out: the CUDA caching allocator (CPU allocations here) and the driver's launches.
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import tempfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from tileattn.bench.overhead import IdentityFunction, burst_us
from tileattn.runtime import LaunchError, host_launch

NOOP_C = """
int noop_launch(void* f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                unsigned smem, void* stream, void** params, void** extra) { return 0; }
int noop_capture(void* stream, int* status) { *status = 0; return 0; }
"""
LAYOUT = ((0, 128), (128, 128), (256, 128), (384, 128), (512, 8), (520, 4), (528, 8))  # maps q, k, v, out; lse; int32; counter


def _noop_library(folder: Path) -> ctypes.CDLL:
    source, library = folder / "noop.c", folder / "libnoop.so"
    source.write_text(NOOP_C)
    subprocess.run(["cc", "-O2", "-shared", "-fPIC", str(source), "-o", str(library)], check=True)
    return ctypes.CDLL(str(library))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args(argv)
    if torch.cuda.is_available():
        raise SystemExit("a GPU is present: time the real path with `tileattn bench overhead --breakdown`")
    module = host_launch.import_built(host_launch.build())
    with tempfile.TemporaryDirectory() as tmp:
        noop = _noop_library(Path(tmp))
        maps = [np.zeros(128, dtype=np.uint8) for _ in range(4)]
        plans = {}
        module.configure(ctypes.cast(noop.noop_launch, ctypes.c_void_p).value,
                         ctypes.cast(noop.noop_capture, ctypes.c_void_p).value, lambda index: 0xC0C0, LaunchError,
                         {"_plans": plans}, "cpu")
        q, k, v = (torch.randn(1, 8, 128, 64).to(torch.bfloat16) for _ in range(3))
        encoders = [lambda address, m=m: SimpleNamespace(address=int(m.ctypes.data)) for m in maps]
        slots = (*((1, i, i, encoders[i]) for i in range(4)), (0, 4, 4, None), (2, 6, -1, None))
        unread = torch.empty(q.shape[:3], dtype=torch.float32)
        module.register(q, k, v, False, None, "entry", -1, (0xF00D, (1, 1, 1), (384, 1, 1), 0, bytes(536), LAYOUT, slots),
                        (q.shape, q.stride()), (q.shape[:3], unread.stride()), unread)
        qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
        out, lse = module.forward(q, k, v, False, None, 1)
        dout = torch.randn_like(out)
        hl = host_launch
        ws = [(hl.WORKSPACE, 0), (hl.WORKSPACE, 4096), (hl.WORKSPACE, 8192)]
        main_maps = [(hl.TENSOR_MAP, i, source, encoders[i % 4])
                     for i, source in enumerate((hl.Q, hl.K, hl.V, hl.DOUT, hl.DK, hl.DV))]
        pointers = [(offset, 8) for offset in range(0, 64, 8)]
        launches = (
            (0xA1, (1, 1, 1), (128, 1, 1), 0, bytes(80), pointers[:6],
             hl.pointer_slots(range(6), (hl.OUT, hl.DOUT, hl.LSE, *ws))),
            (0xA2, (1, 1, 1), (384, 1, 1), 0, bytes(896),
             (*((offset, 128) for offset in range(0, 768, 128)), *((offset, 8) for offset in range(768, 800, 8))),
             main_maps + hl.pointer_slots(range(6, 10), (*ws, hl.NULL))),
            (0xA3, (1, 1, 1), (128, 1, 1), 0, bytes(48), pointers[:2], hl.pointer_slots(range(2), (ws[2], hl.DQ))),
        )
        grad_specs = tuple((t.shape, t.stride()) for t in (q, k, v))
        module.register_backward(q, k, v, False, None, dout, False, launches, grad_specs, 3 * 1024 + 8 * 128 * 64, 0)

        pieces = {
            "forward, want 0 (key, out, maps, counter, no-op launch)": lambda: module.forward(q, k, v, False, None, 0),
            "forward, want 1 (and a fresh lse)": lambda: module.forward(q, k, v, False, None, 1),
            "forward, want 3 (the C++ autograd Function)": lambda: module.forward(qg, kg, vg, False, None, 3),
            "torch.empty_strided of the same out, from Python": lambda: torch.empty_strided(
                q.shape, q.stride(), dtype=q.dtype),
            "Python autograd.Function.apply of an identity": lambda: IdentityFunction.apply(qg),
            "backward(...), op level (3 no-op launches)": lambda: module.backward(q, k, v, out, lse, dout, False, None,
                                                                                   False),
            "the Python backward's 4 allocations alone": lambda: (
                *(torch.empty_strided(*spec, dtype=q.dtype) for spec in grad_specs),
                torch.empty(3 * 1024 + 8 * 128 * 64, dtype=torch.float32)),
        }
        for name, fn in pieces.items():
            us = burst_us(fn, args.calls, args.rounds, sync=lambda: None)["host_us"]
            print(f"  {name:<58} {us:6.2f} us")
        module.clear()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
