"""Instruction census of a kernel's innermost tensor-core loop, from its SASS (no GPU needed).

    python scripts/sass_loop_census.py --family attention_fwd_sm90 [--all] EXPRESSION [EXPRESSION ...]

Compiles each template instantiation for sm_90a with the project's NVRTC, disassembles it
(labs.sass: cuobjdump + nvdisasm) and finds the loops: a backward branch and the code from its
target to it. Of the innermost loops that issue HGMMAs, the one with the most MUFU instructions
is the main loop; its census (instructions per thread per iteration, by pipe) is what a budget of
issue slots, MUFU and FP32 throughput against the tensor-core time works from
(docs/attention_variants.md, "Where the variants' time goes").
Static counts: one iteration as compiled, predicated-off instructions included.
--all prints every innermost loop that issues HGMMAs, in address order: a kernel whose masked and
unmasked visits compile to two loops with the same exponentials has both, and the main loop's
tie-break (the longer) may pick the masked one in one build and not in another (session 52: the
merged-boundary trial against main).
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # labs/ from a checkout

_LINE = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_TARGET = re.compile(r"\bBRA\b(?:\.\w+)*\s+(?:`\(\S+\)\s*)?(0x[0-9a-f]+)")
PIPES = {
    "MUFU": ("MUFU",),
    "FP32": ("FFMA", "FMUL", "FADD", "FMNMX", "FSEL", "FSETP", "FCHK"),
    "INT": ("IADD3", "IMAD", "LOP3", "SHF", "ISETP", "IABS", "LEA", "SEL", "PRMT"),
    "MOV": ("MOV",),
    "CVT": ("F2FP", "F2I", "I2F", "I2FP", "F2F"),
    "HGMMA": ("HGMMA",),
}


def instructions(sass: str) -> list[tuple[int, str]]:
    """(address, opcode with modifiers) of every instruction, predicates stripped."""
    out = []
    for line in sass.splitlines():
        m = _LINE.match(line)
        if m:
            text = re.sub(r"^@!?U?P\w+\s+", "", m.group(2))
            out.append((int(m.group(1), 16), text))
    return out


def loops(sass: str) -> list[list[str]]:
    """The innermost loops (a backward branch's body, target .. branch, holding no other such
    body), as opcode lists in address order."""
    ins = instructions(sass)
    at = {a: i for i, (a, _) in enumerate(ins)}
    spans = []
    for i, (addr, text) in enumerate(ins):
        m = _TARGET.search(text) if text.startswith("BRA") else None
        if m and int(m.group(1), 16) < addr and int(m.group(1), 16) in at:
            spans.append((at[int(m.group(1), 16)], i))
    inner = [(a, b) for a, b in spans if not any((c, d) != (a, b) and a <= c and d <= b for c, d in spans)]
    return [[t.split()[0] for _, t in ins[a:b + 1]] for a, b in sorted(inner)]


def census(body: list[str]) -> dict[str, int]:
    base = collections.Counter(op.split(".")[0] for op in body)
    row = {"instructions": len(body)}
    row.update({pipe: sum(base[o] for o in ops) for pipe, ops in PIPES.items()})
    return row


def tensor_core_loops(sass: str) -> list[dict[str, int]]:
    """The census of every innermost loop that issues HGMMAs, in address order."""
    return [census(body) for body in loops(sass) if any(op.startswith("HGMMA") for op in body)]


def main_loop(sass: str) -> dict[str, int]:
    """The census of the main loop: of the innermost loops that issue HGMMAs, the one with the most
    MUFU instructions (the softmax's exponentials live there). ValueError if no loop issues HGMMAs."""
    rows = tensor_core_loops(sass)
    if not rows:
        raise ValueError("no loop with HGMMA in this SASS")
    return max(rows, key=lambda row: (row["MUFU"], row["instructions"]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", required=True, help="registered kernel family, e.g. attention_fwd_sm90")
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("--all", action="store_true", help="every innermost HGMMA loop, not only the main loop")
    ap.add_argument("expressions", nargs="+", help="template instantiations, as the family lists them")
    args = ap.parse_args(argv)
    from labs.sass import dump_sass, tools
    from tileattn.kernels import family
    from tileattn.runtime import compile_cuda

    if None in tools():
        raise SystemExit("cuobjdump / nvdisasm not found (the nvidia-cuda-cuobjdump and triton wheels)")
    path = family(args.family).path
    columns = ["instructions", *PIPES]
    print("| instantiation | " + ("loop | " if args.all else "") + " | ".join(columns) + " |")
    print("|---|" + "---|" * (len(columns) + args.all))
    for expression in args.expressions:
        sass = dump_sass(compile_cuda(path, [expression], args.arch).cubin)
        rows = list(enumerate(tensor_core_loops(sass))) if args.all else [(None, main_loop(sass))]
        for k, row in rows:
            loop = f"{k} | " if args.all else ""
            print(f"| `{expression}` | {loop}" + " | ".join(str(row[c]) for c in columns) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
