"""Whether a kernel change left other instantiations' code alone: the SASS instruction streams of a
family's instantiations compiled from the working tree's source and from another revision's.

    PYTHONPATH=src python scripts/sass_compare.py --family attention_fwd_sm90 --rev HEAD~1

Compiles (NVRTC, the installed version, no cache) the instantiations that both the working tree's
registry and the other revision's list (read from a temporary git worktree of it), once from each
revision's .cu file (both with the working tree's common/ headers: compare header changes another
way), disassembles both cubins (labs.sass's nvdisasm) and compares each kernel's instructions
without addresses. Prints the count of identical streams and names any that differ; exit status 1
if any does. Used for docs/attention_variants.md's "Variants on the packed layouts" (session 47).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path


def instruction_streams(cubin: bytes) -> dict[str, list[str]]:
    """Per mangled kernel name: its SASS instructions (opcode and operands), addresses dropped."""
    import labs.sass as sass

    streams: dict[str, list[str]] = {}
    current = None
    for line in sass.dump_sass(cubin).splitlines():
        head = re.match(r"\s*Function : (\S+)", line)
        if head:
            current = streams.setdefault(head.group(1), [])
            continue
        ins = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(.*?);", line)
        if current is not None and ins:
            current.append(ins.group(1))
    return streams


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", required=True)
    ap.add_argument("--rev", required=True, help="git revision whose source is compared with the working tree's")
    ap.add_argument("--arch", default="sm_90a")
    args = ap.parse_args(argv)

    from tileattn.kernels import family
    from tileattn.runtime.compiler import compile_cuda

    fam = family(args.family)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(["git", "worktree", "add", "--detach", tmp, args.rev], check=True, capture_output=True)
        try:
            code = (f"import sys; sys.path.insert(0, {tmp + '/src'!r}); from tileattn.kernels import family; "
                    f"print('\\n'.join(family({args.family!r}).instantiations))")
            old = set(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                                     text=True).stdout.splitlines())
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", tmp], check=True)
    exprs = [e for e in fam.instantiations if e in old]
    rel = fam.path.resolve().relative_to(Path.cwd().resolve())
    with tempfile.TemporaryDirectory() as tmp:
        old_src = Path(tmp) / fam.path.name
        old_src.write_text(subprocess.run(["git", "show", f"{args.rev}:{rel}"], check=True, capture_output=True,
                                          text=True).stdout)
        before = instruction_streams(compile_cuda(old_src, exprs, args.arch, use_cache=False).cubin)
    after = instruction_streams(compile_cuda(fam.path, exprs, args.arch, use_cache=False).cubin)
    same = [k for k in before if before[k] == after.get(k)]
    print(f"{args.family}: {len(exprs)} instantiations, {len(before)} kernels from {args.rev}, {len(after)} now; "
          f"identical instruction streams: {len(same)}")
    for k in before:
        if before[k] != after.get(k):
            print("differs:", k)
    return 0 if len(same) == len(before) == len(after) else 1


if __name__ == "__main__":
    sys.exit(main())
