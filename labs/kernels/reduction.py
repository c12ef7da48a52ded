"""Reductions (labs/csrc/reduction.cu): the sum/max ladder, its multi-block forms and broken versions.

Every kernel is a template `name<Op, B[, U]>` with Op in {SumOp, MaxOp}, B threads per block and,
for the float4 kernels, U float4 loads in flight per thread. The first entry of VEC4_CONFIGS is the
default; the others are there to be measured against it (labs.reduction times them all).
"""

from tileattn.kernels import Family

from . import LABS_CSRC

OPS = ("SumOp", "MaxOp")
BLOCK = 256  # versions 1-4 and the broken ones
VEC4_CONFIGS = ((256, 4), (256, 2), (256, 8), (512, 4))  # (B, U) for versions 5 and 6

# Correct kernels: template name -> template parameters after Op.
LADDER = ("reduce_interleaved", "reduce_sequential", "reduce_first_add", "reduce_warp_shuffle")
VEC4 = ("reduce_vec4", "reduce_vec4_onepass")
# Broken kernels (kept for the sanitizer lab) -> the mistake.
BROKEN = {
    "reduce_bug_barrier_in_branch": "__syncthreads() inside the divergent `if (tid < s)`",
    "reduce_bug_missing_barrier": "no barrier between tree levels (shared-memory race)",
    "reduce_bug_oob_store": "partial stored to out[blockIdx.x + 1]: one past the end",
    "reduce_bug_uninit_shared": "lanes past the end skip their shared store: stale shared memory read",
    "reduce_bug_final_reads_all": "final pass reads all B padded partials, not the `count` written",
}


def expression(kernel: str, op: str, *params: int) -> str:
    """NVRTC name expression, e.g. expression('reduce_vec4', 'SumOp', 256, 4) -> 'reduce_vec4<SumOp, 256, 4>'."""
    return f"{kernel}<{', '.join([op, *map(str, params)])}>"


def _instantiations() -> tuple[tuple[str, ...], frozenset[str]]:
    exprs: list[str] = []
    broken: list[str] = []
    for op in OPS:
        exprs += [expression(k, op, BLOCK) for k in LADDER]
        exprs += [expression(k, op, b, u) for k in VEC4 for b, u in VEC4_CONFIGS]
        bad = [expression(k, op, BLOCK) for k in BROKEN]
        exprs += bad
        broken += bad
    return tuple(exprs), frozenset(broken)


_EXPRS, _BROKEN = _instantiations()

FAMILIES = (
    Family(name="reduction", source=LABS_CSRC / "reduction.cu", instantiations=_EXPRS, broken=_BROKEN),
)
