"""Count SASS instructions in a cubin: the evidence that a kernel does what its rung claims.

    python -m labs.sass FILE.cubin            # per-kernel counts of the instructions below

`cuobjdump --dump-sass` (it calls `nvdisasm`) comes from the CUDA toolkit on the GPU machine
(on PATH, or under $CUDA_HOME/bin) or, on a CPU machine, from the `nvidia-cuda-cuobjdump` wheel
(cuobjdump) and Triton's wheel (nvdisasm). Counts are static (instructions in the code, not
executed): an unrolled inner loop shows each copy once.
"""

from __future__ import annotations

import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile
from functools import lru_cache
from pathlib import Path

# Reported columns: (label, predicate on the opcode with modifiers, e.g. "LDG.E.128.CONSTANT").
CATEGORIES = (
    ("FFMA", lambda op: op.split(".")[0] == "FFMA"),
    ("LDG.E.128", lambda op: op.startswith("LDG.E.128")),
    ("LDG", lambda op: op.split(".")[0] == "LDG"),  # all widths; LDGSTS is its own column
    ("LDS", lambda op: op.split(".")[0] == "LDS"),
    ("LDS.128", lambda op: op.startswith("LDS.128")),
    ("LDSM", lambda op: op.startswith("LDSM")),
    ("LDGSTS", lambda op: op.startswith("LDGSTS")),
    ("HMMA", lambda op: op.startswith("HMMA")),
    ("HGMMA", lambda op: op.startswith("HGMMA")),
    ("UTMALDG", lambda op: op.startswith("UTMALDG")),
    ("SETMAXREG", lambda op: op.startswith("USETMAXREG")),
    ("LDL/STL", lambda op: op.split(".")[0] in ("LDL", "STL")),
)

_FUNC = re.compile(r"Function : (\S+)")
_INSN = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Z0-9_]+)*)")


def _tool(name: str) -> str | None:
    """Path of a CUDA binary tool: PATH, $CUDA_HOME/bin, then the pip wheels in this environment."""
    found = shutil.which(name)
    if found:
        return found
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    if (Path(home) / "bin" / name).exists():
        return str(Path(home) / "bin" / name)
    for base in map(Path, sys.path):
        for rel in (f"nvidia/cu13/bin/{name}", f"nvidia/cuda_cuobjdump/bin/{name}",
                    f"triton/backends/nvidia/bin/{name}"):
            if (base / rel).exists():
                return str(base / rel)
    return None


@lru_cache(maxsize=1)
def tools() -> tuple[str | None, str | None]:
    return _tool("cuobjdump"), _tool("nvdisasm")


def dump_sass(cubin: bytes) -> str:
    """The disassembly text; RuntimeError saying what is missing when the tools are not found."""
    cuobjdump, nvdisasm = tools()
    if cuobjdump is None:
        raise RuntimeError("cuobjdump not found (install nvidia-cuda-cuobjdump or put the CUDA toolkit on PATH)")
    env = dict(os.environ)
    if nvdisasm is not None:  # cuobjdump --dump-sass runs nvdisasm from PATH
        env["PATH"] = str(Path(nvdisasm).parent) + os.pathsep + env.get("PATH", "")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([cuobjdump, "--dump-sass", f.name], capture_output=True, text=True, env=env, timeout=120)
    if out.returncode != 0 or "Function :" not in out.stdout:
        raise RuntimeError(f"cuobjdump --dump-sass failed ({out.returncode}): {out.stderr.strip()[:500]}")
    return out.stdout


def opcode_counts(sass: str) -> dict[str, collections.Counter]:
    """Mangled kernel name -> Counter of full opcodes (with modifiers)."""
    counts: dict[str, collections.Counter] = {}
    current = None
    for line in sass.splitlines():
        m = _FUNC.search(line)
        if m:
            current = m.group(1)
            counts[current] = collections.Counter()
            continue
        if current is None:
            continue
        m = _INSN.search(line)
        if m:
            counts[current][m.group(1)] += 1
    return counts


def categorize(counter: collections.Counter) -> dict[str, int]:
    return {label: sum(n for op, n in counter.items() if pred(op)) for label, pred in CATEGORIES}


def kernel_counts(cubin: bytes, mangled: str) -> dict[str, int]:
    """Category counts for one kernel of a cubin; KeyError if the kernel is not in it."""
    per_kernel = opcode_counts(dump_sass(cubin))
    if mangled not in per_kernel:
        raise KeyError(f"{mangled} not in cubin (has {sorted(per_kernel)})")
    return categorize(per_kernel[mangled])


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cubin")
    args = ap.parse_args(argv)
    for name, counter in opcode_counts(dump_sass(Path(args.cubin).read_bytes())).items():
        print(name, categorize(counter))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
