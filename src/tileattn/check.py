"""`tileattn check`: compile every registered instantiation without a GPU and audit its resources.

A kernel passes when NVRTC compiles it, ptxas reports zero spill bytes and a zero-byte stack
frame (a stack frame means a register array went to local memory), and ptxas issues none of its
wgmma-serialization warnings C7510-C7520 ("wgmma serialized", "warpgroup.wait injected": the
tensor cores would wait on each other). Deliberately broken lab
versions are compiled and listed, but their resource use does not fail the check.
"""

from __future__ import annotations

import multiprocessing
import os
import re
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

from .kernels import Family, families
from .runtime import CompileError, compile_cuda


@dataclass
class Row:
    family: str
    expression: str
    arch: str
    registers: int | None = None
    stack: int | None = None
    spills: int | None = None
    static_smem: int | None = None
    seconds: float | None = None
    broken: bool = False
    error: str | None = None
    serialization: str | None = None  # ptxas C7508-C7520 warnings (wgmma serialized, setmaxnreg ignored)

    @property
    def ok(self) -> bool:
        clean = self.stack == 0 and self.spills == 0 and self.serialization is None
        return self.error is None and (self.broken or clean)


# ptxas's warnings that wgmma instructions were serialized (C7510 ... C7520) or that setmaxnreg was
# ignored (C7508/C7509: the register split between warpgroups silently lost).
_SERIALIZATION = re.compile(r"C75(0[89]|1\d|20)\b|wgmma.*serializ|warpgroup\.wait.*inject", re.IGNORECASE)


def _compile_one(fam: Family, expr: str, arch: str, use_cache: bool) -> Row:
    row = Row(fam.name, expr, arch, broken=expr in fam.broken)
    try:
        module = compile_cuda(fam.path, [expr], arch, use_cache=use_cache)
    except CompileError as exc:
        row.error = str(exc)
        return row
    res = module.resources.get(expr)
    if res is None:
        row.error = "ptxas reported no resources for this kernel (was it instantiated?)"
        return row
    row.registers, row.stack, row.spills = res.registers, res.stack_bytes, res.spills
    warnings = [line.strip() for line in module.log.splitlines() if _SERIALIZATION.search(line)]
    row.serialization = "; ".join(warnings) or None
    row.static_smem, row.seconds = res.static_smem_bytes, module.compile_seconds
    return row


def run_check(archs: list[str] | None = None, *, family_filter: str | None = None, use_cache: bool = True,
              jobs: int | None = None, tuning: bool = False) -> list[Row]:
    """Compile every registered instantiation (optionally only families whose name contains
    `family_filter`; with `tuning`, the tuning candidates too). Raises ValueError when the filters leave
    nothing to compile: a check of nothing would read as a pass."""
    work = []
    for fam in families().values():
        if family_filter and family_filter not in fam.name:
            continue
        if not fam.path.exists():
            work.append((fam, None, None))
            continue
        for arch in fam.archs:
            if archs and arch not in archs:
                continue
            exprs = fam.instantiations + (tuple(e for e in fam.tuning if e not in fam.instantiations) if tuning else ())
            work.extend((fam, expr, arch) for expr in exprs)
    if not work:
        names = sorted(f.name for f in families().values())
        archs_known = sorted({a for f in families().values() for a in f.archs})
        asked = " and ".join(x for x in (family_filter and f"--family {family_filter!r}",
                                         archs and f"--arch {' '.join(archs)}") if x)
        raise ValueError(f"nothing to compile for {asked or 'no filter'}; families: {', '.join(names)}; archs: "
                         f"{', '.join(archs_known)}")
    rows: list[Row] = []
    # One process per core: an NVRTC compile holds the GIL, so threads would run one at a time.
    # "spawn": workers start clean (no inherited CUDA or thread state).
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=jobs or os.cpu_count() or 2, mp_context=ctx) as pool:
        futures = []
        for fam, expr, arch in work:
            if expr is None:
                rows.append(Row(fam.name, "*", "-", error=f"source {fam.path} not found"))
            else:
                futures.append(pool.submit(_compile_one, fam, expr, arch, use_cache))
        rows.extend(f.result() for f in futures)
    return rows


def _display_name(r: Row) -> str:
    """family:expression with the namespace qualifiers dropped (they repeat on every row)."""
    expr = r.expression
    for ns in ("tileattn::bwd::", "tileattn::fwd::", "tileattn::"):
        expr = expr.replace(ns, "")
    return f"{r.family}:{expr}"


def format_table(rows: list[Row]) -> str:
    width = max([len(_display_name(r)) for r in rows] + [6])
    head = f"{'kernel':<{width}} {'arch':<7} {'regs':>4} {'stack':>5} {'spill':>5} {'smem':>6} {'sec':>6}  status"
    lines = [head, "-" * len(head)]
    for r in rows:
        name = _display_name(r)
        if r.error:
            lines.append(f"{name:<{width}} {r.arch:<7} {'':>4} {'':>5} {'':>5} {'':>6} {'':>6}  COMPILE ERROR")
            continue
        status = ("ok" if r.ok and not r.broken else "broken (lab)" if r.broken
                  else f"FAIL: wgmma serialized ({r.serialization})" if r.serialization else "FAIL: spill/stack")
        lines.append(
            f"{name:<{width}} {r.arch:<7} {r.registers:>4} {r.stack:>5} {r.spills:>5} {r.static_smem:>6} "
            f"{r.seconds:>6.2f}  {status}"
        )
    return "\n".join(lines)
