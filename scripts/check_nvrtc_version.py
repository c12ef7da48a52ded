"""`tileattn check` with another NVRTC than the installed one, e.g. the GPU machine's older 13.0.

ptxas inside NVRTC allocates registers differently from version to version: a kernel at 255
registers can spill under one and not under another. The H200 image has NVRTC 13.0, CI has the
newest wheel. To audit the device's version without device time, unpack its wheel and point this
script at the library folder:

    pip download --no-deps -d /tmp/w "nvidia-cuda-nvrtc==13.0.88"
    unzip -q /tmp/w/nvidia_cuda_nvrtc-13.0.88-*.whl -d /tmp/nvrtc-13.0
    python scripts/check_nvrtc_version.py /tmp/nvrtc-13.0/nvidia/cu13/lib --family attention

The libraries are loaded before cuda.bindings looks for NVRTC, so this process uses them; each
instantiation is compiled here, serially and without the disk cache. Exit status 1 when any
instantiation spills or uses stack (deliberately broken lab versions excepted).
"""

from __future__ import annotations

import argparse
import ctypes
import sys
from pathlib import Path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("libdir", type=Path, help="folder holding libnvrtc.so.* and libnvrtc-builtins.so.*")
    p.add_argument("--family", default="", help="only families whose name contains this")
    p.add_argument("--arch", default="sm_90a")
    args = p.parse_args()
    builtins = sorted(args.libdir.glob("libnvrtc-builtins.so.*"))
    nvrtc = sorted(args.libdir.glob("libnvrtc.so.*"))
    if not builtins or not nvrtc:
        sys.exit(f"no libnvrtc.so.* / libnvrtc-builtins.so.* in {args.libdir}")
    for lib in (builtins[0], nvrtc[0]):
        ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)

    from tileattn.kernels import families
    from tileattn.runtime import compile_cuda, nvrtc_version

    print(f"NVRTC {'.'.join(map(str, nvrtc_version()))} from {nvrtc[0]}, arch {args.arch}")
    failed = 0
    for fam in families().values():
        if args.family not in fam.name or args.arch not in fam.archs:
            continue
        for expr in fam.instantiations:
            if expr in fam.broken:
                continue
            res = compile_cuda(fam.path, [expr], args.arch, use_cache=False).resources[expr]
            bad = res.spills or res.stack_bytes
            failed += bool(bad)
            print(f"{'SPILL' if bad else 'ok':5s} {res.registers:4d} regs {res.stack_bytes:4d} stack "
                  f"{res.spill_store_bytes:4d}/{res.spill_load_bytes:<4d} spill  {fam.name}:{expr}", flush=True)
    print(f"{failed} instantiation(s) with spills or stack")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
