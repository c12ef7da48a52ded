"""The dispatcher: which kernel family and tile configuration runs a call.

Decided by the device's arch (`tileattn.runtime.device_arch`: "sm_90a" on Hopper, "sm_80" on an
A100, "sm_86" ...), the dtype, the head dim, causal, and the layout. Each family keeps its tile
tables keyed by arch (`DEFAULTS[arch][(head_dim, causal)]`); an arch without a table of its own
uses the sm_80 one, shrunk to the device's shared memory where a family provides that.

Families, in the order they are considered:
- attention_fwd_sm90 (forward on Hopper: TMA, wgmma, warp specialization) where SM90_FORWARD lists
  the (head dim, causal) pair as measured faster than the sm80 kernel on the H200;
- attention_fwd_sm80 / attention_bwd_sm80: mma.sync + cp.async, every NVIDIA GPU from sm_80 on,
  every supported head dim (32, 64, 96, 128, 256), fp16 and bf16.

- attention_bwd_sm90 (backward on Hopper) where SM90_BACKWARD lists (head dim, causal,
  deterministic) as measured faster than the sm80 backward.

Calls with variants (window, softcap, ALiBi, dropout): the dense forward runs the Hopper forward's
variant instantiations on sm_90a for the head dims it has (SM90_VARIANT_FORWARD; with dropout also
SM90_DROPOUT_FORWARD and attention_fwd_sm90.supports_dropout; `variant_forward_family`,
`variant_forward_plan`); the varlen forward and the paged prefill with window, softcap or ALiBi
(no dropout) run its packed variant instantiations where SM90_VARLEN_VARIANT_FORWARD /
SM90_PAGED_VARIANT_PREFILL list them (`varlen_forward_plan`, `paged_launch`), and the varlen
backward with them its varlen variant instantiations where SM90_VARLEN_VARIANT_BACKWARD lists the
head dim (atomic dQ; `varlen_backward_plan`); everything else (other head dims, other archs, varlen
dropout unless SM90_VARLEN_DROPOUT_FORWARD lists it) runs the sm80 families' variant entry points;
the dense variant backward runs the Hopper backward's variant instantiations where
SM90_VARIANT_BACKWARD (with dropout also SM90_DROPOUT_BACKWARD) lists (head dim, mode) and
attention_bwd_sm90.supports_variants accepts the call (`variant_backward_plan`), else sm80's.
The variant backward recomputes the scores with the same definitions, so it takes the Hopper
forward's lse as it is. tileattn.api and api_varlen build those plans.

A forward plan is an object with `launch(q, k, v, out, lse)`; a backward plan one with
`launch(q, k, v, out, lse, dout, dq, dk, dv)`.
"""

from __future__ import annotations

import os

from . import attention_bwd_sm80, attention_fwd_sm80

# (head dim, causal) that the Hopper forward runs on sm_90a, by measurement (H200, bf16, B=4 H=32):
# d=128 (bench attention --forced columns, 2026-12-01 15:25 UTC): 650/687 TFLOP/s non-causal at
# N=2048/8192 against 382/374 for the sm80 kernel, causal 518/682 against 317/388; d=64 and d=256
# (bench attention --tune --forward-only, 16:00 UTC; docs/runs/tune-fwd-d*-h200.json): the sm90 defaults
# 388/452 non-causal and 298/437 causal at d=64, 737/728 and 610/724 at d=256, where no sm80
# candidate reached the top five (the sm80 defaults run ~300 at d=64 and ~285 at d=256).
SM90_FORWARD = {(d, causal) for d in (64, 128, 256) for causal in (False, True)}


# (head dim, causal, deterministic) that the Hopper backward runs on sm_90a, by measurement
# (attention_bwd_sm90.benchmark, H200, bf16, B=4 H=32, N=2048/8192, 2026-12-01 15:58 and 16:01 UTC),
# TFLOP/s sm90 against sm80: d=64 atomic 442/491 vs 257/280, causal 329/476 vs 203/268; d=128
# atomic 500/531 vs 288/319, causal 378/555 vs 244/307. The deterministic mode (ordered dQ staging):
# racecheck of its sanitize cases clean since the lse2 fix (2026-12-02 runs F9, V9, C1), and against
# the sm80 deterministic kernel (2026-12-02 07:35 UTC, run C5, N=4096/16384): d=128 452/479 vs
# 237/245 non-causal, 418/466 vs 224/242 causal; d=64 463/492 vs 214/222, 380/437 vs 198/219.
# d=256 (the role-split layout, csrc "d = 256"; deterministic by REDs in turn; H200, 2026-12-02
# 14:48 UTC, bf16 B=4 H=32 N=2048/8192): atomic 358/372 vs sm80 239/258 non-causal, 312/382 vs
# 220/253 causal; deterministic 270/297 vs 180/190, 243/277 vs 169/187 (docs/attention_bwd_sm90.md,
# "d = 256").
SM90_BACKWARD = {(d, causal, deterministic) for d in (64, 128, 256) for causal in (False, True)
                 for deterministic in (False, True)}


# Head dims whose variant forward (window, softcap, ALiBi; not dropout) runs the Hopper kernel on sm_90a.
# The sm80 variant kernel runs at or below the sm80 plain kernel (~370 TFLOP/s at d=128 on the
# H200), the Hopper plain forward at ~650: the targets (softcap and ALiBi within 10% of the
# plain kernel, a 4096-key window at N=32768 within 1.2x of the dense work) need the Hopper kernel.
SM90_VARIANT_FORWARD = {64, 128, 256}
# Head dims whose dense forward WITH dropout runs the Hopper kernel on sm_90a, for the calls
# attention_fwd_sm90.supports_dropout accepts (not ALiBi at d = 128: it spills). Its GPU tests passed
# on the H200 (tests/gpu/test_attention_fwd_sm90_dropout.py, 2026-12-01), and the plans of
# `python -m tileattn.kernels.attention_bwd_sm90 --dropout` timed in one process (p = 0.1, B=4 H=32
# bf16, N 2048 / 8192, causal and not; 22:56 UTC, 6c74120; docs/BENCHMARKS.md) measured it
# 1.8-2.2x the sm80 dropout forward (d=128: 323-406 TFLOP/s against 163-201; d=64: 202-267 against
# 101-125). d = 256 (2026-12-03 19:20 UTC, f7d66d4, `tileattn bench variants --suite overhead --head-dim
# 256 --rounds 3`, with and without --hopper-forced): 0.72-0.83x the plain forward against the sm80
# kernel's 0.32-0.40x (2.1-2.3x), its GPU tests and sanitize cases clean in the same calls.
SM90_DROPOUT_FORWARD: set[int] = {64, 128, 256}
# Head dims whose bf16 softcap forward (alone or with a window) runs with the fixed row max
# (attention_fwd_sm90.FIXED_MAX, where fixed_max_applies: cap log2 e and Nk within the exponent
# budget). Written in session 23 (0 spills; SASS main loop 645 -> 491 instructions per visit at
# d = 128). H200, 2026-12-03, call G2 (`tileattn bench variants --suite overhead --variant softcap
# --forward-only --rounds 3`, with and without --hopper-forced, bf16, B=4 H=32, N = 2048 / 8192),
# softcap / plain: d = 128 0.827-0.847 -> 0.847-0.924, d = 64 0.704-0.765 -> 0.752-0.790; call G4
# (the same command at d = 256): 0.916-0.954 -> 0.932-0.998. GPU tests and the four sanitizers in
# calls G3 / G2. Only for forwards that no backward follows (variant_forward_plan's inference: calls
# without autograd, traced ones without grad): with every p rounded to bf16 (the online max keeps the
# largest exactly 1), the O a backward reads is off by up to an ulp where one key dominates a row, and
# dq = P (dP - rowsum(dO O)) magnifies that where dP and the row sum nearly cancel: the Hopper
# variant backward after the fixed-max forward read dq relative errors of 2.2-3.1 against a dq of
# ~0 (Nq = Nk = 1) and 1.4e-2 at Nq = 1, Nk = 1000 (window (48, 16), cap 20; H200, 2026-12-04,
# session 25 call 2, tests/gpu/test_attention_bwd_sm90_variants.py::test_variants_lengths).
SM90_SOFTCAP_FIXED_MAX: set[int] = {64, 128, 256}
# Head dims whose causal forward with ALiBi or softcap alone (no window of its own) runs the kCausal
# variant kernel (attention_fwd_sm90.CAUSAL_VARIANT_INSTANTIATIONS: the plain causal kernel's blocks,
# mask and tiles, three consumers from WIDE_MIN_QUERIES) instead of the windowed two-consumer one.
# Written in session 23 (0 spills). H200, 2026-12-03, call G3 (`tileattn bench variants --suite overhead
# --variant V --forward-only --head-dim D --dtype T --rounds 3`, with and without --hopper-forced,
# B=4 H=32, causal N = 2048 / 8192), variant / plain, windowed -> kCausal: ALiBi bf16 d = 64
# 0.830-0.834 -> 0.894-0.914, d = 128 0.914-0.916 -> 0.951-0.969; softcap fp16 d = 64 0.703-0.760 ->
# 0.754-0.803 (bf16 causal softcap takes the fixed max first, where it applies). GPU tests
# (ForwardPlan(causal_kernel=True) at causal_variant_config's tiles) and the four sanitizers in G3.
SM90_CAUSAL_VARIANT_FORWARD: set[int] = {64, 128}
# Head dims whose causal bf16 softcap forward (no window of its own), where the fixed max applies,
# runs the kCausal kernel with the fixed max (attention_fwd_sm90.CAUSAL_FIXED_MAX_INSTANTIATIONS)
# instead of the windowed fixed-max kernel (WINDOW | SOFTCAP | FIXED_MAX, two consumers).
SM90_CAUSAL_FIXED_MAX: set[int] = {64, 128}


# (head dim, deterministic) whose variant backward (window, softcap, ALiBi; dropout only with
# SM90_DROPOUT_BACKWARD) runs the Hopper kernel on sm_90a, where attention_bwd_sm90.supports_variants
# also holds for the call. Its GPU tests and memcheck passed on the H200 (2026-12-01, a1b1c94 and
# de3f284), and `python -m tileattn.kernels.attention_bwd_sm90 --variants` measured it 2.2-2.5x the
# sm80 variant backward with ALiBi at d=128, 1.6-1.7x with softcap at d=64, 2.2-3x with a 4096-key
# window at N=32768. d = 256 (the role-split layout with the variants): its GPU tests, memcheck,
# racecheck, synccheck and initcheck passed (2026-12-03, f7d66d4), and `tileattn bench variants
# --suite overhead --head-dim 256 --rounds 3` read forward+backward 0.95-0.96x plain with softcap and
# 0.97-1.03x with ALiBi against 0.53-0.58x on the sm80 variant backward (same kernels, the other
# call of the two, 3 minutes apart). Deterministic mode (the windowed dQ turn counters): its
# bitwise-repeat tests passed at d = 64 / 128 / 256 and its sanitize cases were clean under memcheck
# and racecheck (2026-12-03, c68b158); `python -m tileattn.kernels.attention_bwd_sm90 --variants`
# timed it 2.5-3.1x the sm80 deterministic variant backward at d = 128, 2.5-4.3x at d = 64,
# 1.8-2.0x at d = 256 (softcap and ALiBi, causal and not, N 2048 / 8192).
SM90_VARIANT_BACKWARD: set[tuple[int, bool]] = {(d, mode) for d in (64, 128, 256) for mode in (False, True)}
# Head dims whose softcap variant backward (softcap alone, atomic dQ) on the Hopper kernel runs its
# split form (attention_bwd_sm90.SPLIT_MASKED_INSTANTIATIONS: the P^T / dS^T passes compiled apart for
# masked and unmasked tiles, the unmasked tiles' without the per-element window test; census d = 128
# ~750 -> 606 instructions per unmasked tile visit, d = 64 1618 static -> 943). On the H200
# (2026-12-04, 84e23d9, session 26 call 1): tests/gpu/test_attention_bwd_sm90_variants.py 482 passed,
# its 18 sanitize cases clean under all four tools; `tileattn bench variants --suite overhead
# --variant softcap --head-dim D --rounds 3`, with and without --hopper-forced, bf16 B=4 H=32, N 2048 /
# 8192: forward+backward d = 128 0.869-0.899x plain against 0.758-0.800 unsplit, d = 64 0.819-0.885
# against 0.658-0.702.
SM90_SOFTCAP_BWD_SPLIT: set[int] = {64, 128}


# Packed variable-length calls on the Hopper kernels: (head dim, causal) whose varlen forward runs
# attention_fwd_sm90's varlen layout on sm_90a, and (head dim, causal, deterministic) whose varlen
# backward runs attention_bwd_sm90's (atomic dQ; deterministic stays on sm80). Their GPU tests and
# every tests/gpu/test_attention_varlen.py case with them on passed on the H200 (run N1, 21:42 UTC,
# commit a1b1c94: 3021 GPU tests, memcheck / synccheck / racecheck / initcheck clean), and
# `tileattn bench varlen` (issue #10's 64 sequences of 100..4096 tokens, causal, d=128 bf16) measured
# 479 TFLOP/s forward and 409 forward+backward against 350 / 293 for the sm80 varlen kernels: 0.975x /
# 0.992x the dense op as dispatched on the same work.
SM90_VARLEN_FORWARD: set[tuple[int, bool]] = {(d, causal) for d in (64, 128, 256) for causal in (False, True)}
SM90_VARLEN_BACKWARD: set[tuple[int, bool, bool]] = {(d, causal, False) for d in (64, 128) for causal in (False, True)}
# (head dim, block_size) whose paged prefill (attention_paged calls that attention_fwd_sm90.supports_paged
# accepts: many query rows per sequence, no variants, no forced split) runs attention_fwd_sm90's paged
# layout on sm_90a. Same device run; `tileattn bench decode` (512 queries after a 4096-key prefix, B=8,
# d=128) measured 569-596 TFLOP/s at block_size 256 (0.89-0.90x the dense op) against 305-308 for the
# sm80 paged kernel, but at block_size 16 only 327-328 against 302-305 (a 128-key block is eight
# 16-row TMA boxes), and the engine's Qwen3-0.6B throughput (block_size 16, chunked prefill mixed
# with decodes) fell from 25,296 to 18,852 output tok/s with it on (H200, de3f284, 22:00 UTC). So
# block sizes of 64 and more only (64 and 128 unmeasured, by the box count: 2 and 1 per 128 keys).
# Since 3f03e23 the producer warp's lanes issue the boxes: block_size 16 forced on reads 455-495
# TFLOP/s (0.76-0.84x dense) against the sm80 kernel's 303-307 (H200, 2026-12-02 15:38 UTC; with O in
# its own buffer 463-482 against 299-307, 17:40 UTC), and the engine's Qwen3-0.6B throughput with it
# forced on read 25,162 output tok/s against 24,771 without (23:55 UTC, 587b997, one process each):
# it no longer loses there, so block sizes 16 and 32 are on too (their GPU tests: the paged file
# with TILEATTN_TEST_HOPPER_INFERENCE=1 and the engine's, docs/runs/gpu-check-2026-12-02.md).
SM90_PAGED_PREFILL: set[tuple[int, int]] = {(d, bs) for d in (64, 128, 256) for bs in (16, 32, 64, 128, 256)}
# Head dims whose varlen forward with variants (window, softcap, ALiBi: attention_fwd_sm90's packed
# variant kernels, PACKED_VARIANT_INSTANTIATIONS) runs on sm_90a, and (head dim, block_size) whose
# paged prefill with variants does (the calls SM90_PAGED_PREFILL's rule takes, variants aside).
# Dropout: SM90_VARLEN_DROPOUT_FORWARD; the varlen backward: SM90_VARLEN_VARIANT_BACKWARD. On an
# H100 (2026-12-06, session 47, 089b614; docs/attention_variants.md "Variants on the packed layouts"):
# tests/gpu/test_attention_fwd_sm90_varlen.py 361 passed, its packed-variant sanitize cases clean
# under memcheck and racecheck; scripts/packed_variants_bench.py (causal, bf16, medians of 3
# rotated rounds) 1.75-1.92x the sm80 varlen variant kernels at d = 128 (issue #10's 64 sequences),
# 2.26x at d = 256 (softcap 50), paged prefill 2.00-2.71x (512 queries after 4096 keys, d = 128,
# block_size 16).
SM90_VARLEN_VARIANT_FORWARD: set[int] = {64, 128, 256}
SM90_PAGED_VARIANT_PREFILL: set[tuple[int, int]] = set(SM90_PAGED_PREFILL)
# Head dims whose varlen forward with dropout runs attention_fwd_sm90's varlen dropout kernels
# (VARLEN_DROPOUT_INSTANTIATIONS, where packed_kernel_flags finds one; d = 256 with ALiBi has none and
# runs the sm80 varlen kernel). H100, 2026-12-06 (session 48 call 1, 515c255): the varlen dropout tests
# of tests/gpu/test_attention_fwd_sm90_varlen.py and ..._bwd_sm90_varlen.py 45 passed (against the
# float64 reference with the helper's mask, seed tensor = int seed bit for bit, kept fraction, the
# public op with autograd), their 5 sanitize cases clean under memcheck, racecheck, synccheck,
# initcheck; forward+backward on issue #10's batch (causal, bf16, dropout 0.1) 1.82x (d = 128), 1.83x
# (d = 64) and 1.13x (d = 256, whose backward is sm80's in both) the sm80 varlen dropout kernels
# (scripts/packed_variants_bench.py --dropout --backward; docs/attention_variants.md).
SM90_VARLEN_DROPOUT_FORWARD: set[int] = {64, 128, 256}
# Head dims whose varlen backward with window, softcap or ALiBi (atomic dQ, no dropout) runs
# attention_bwd_sm90's varlen variant kernels (VARLEN_VARIANT_INSTANTIATIONS) on sm_90a. H100,
# 2026-12-06 (session 47 call 4, 5b69d6f): tests/gpu/test_attention_bwd_sm90_varlen.py 143 passed, its
# variant sanitize cases clean under memcheck, racecheck, synccheck, initcheck; forward+backward on
# issue #10's batch (causal, bf16) 1.64-2.10x the sm80 variant kernels in both passes
# (scripts/packed_variants_bench.py --backward; docs/attention_variants.md).
SM90_VARLEN_VARIANT_BACKWARD: set[int] = {64, 128}
# ... and whose varlen backward with dropout (with a window or none) runs attention_bwd_sm90's varlen
# dropout kernels (VARLEN_DROPOUT_SETS): the same session 48 call (gradients against the float64
# reference and the sm80 varlen dropout backward's, seed tensor and int seed, sanitize cases clean).
SM90_VARLEN_DROPOUT_BACKWARD: set[int] = {64, 128}
# Head dims and modes whose dropout backward runs the Hopper variant backward (attention_bwd_sm90's
# dropout bit) when SM90_VARIANT_BACKWARD also lists them. Its GPU tests passed and racecheck found 0
# hazards in tests/gpu/test_attention_bwd_sm90_variants.py's sanitize cases on the H200 (2026-12-01,
# 6c74120; memcheck clean at de3f284); the same timing measured the atomic mode 2.0-2.2x the sm80
# dropout backward (d=128 N=8192: 31.4 ms against 65.2 non-causal, 16.2 against 33.8 causal) and the
# deterministic one 2.6-2.9x (the deterministic pairs wait with SM90_VARIANT_BACKWARD's). d = 256
# (2026-12-03, f7d66d4, with the dropout forward above): forward+backward 0.83-0.85x plain against
# 0.40-0.44x with the sm80 kernels. Deterministic dropout at d = 256 was not timed on its own (its
# bitwise-repeat test and sanitize cases passed; the same kernel without dropout is 1.8-2.0x sm80).
SM90_DROPOUT_BACKWARD: set[tuple[int, bool]] = {(d, mode) for d in (64, 128, 256) for mode in (False, True)}

# The tables that wait for a device run, each with everything its kernel implements:
# tileattn.api.hopper_kernels_forced() fills them with it for tests and benchmarks. A table leaves
# this list when the measurements fill it.
# None waits now (the last two, the varlen dropout tables, were filled in session 48).
UNMEASURED_SM90_TABLES: tuple[tuple[set, set], ...] = ()


# Rows M up to which tileattn.linear / add_rms_norm_linear run the hand-written GEMV (csrc/gemv.cu)
# instead of cuBLAS, by arch (0 = off). sm_90a: M = 1, where the H200's Llama-3-8B batch-1 decode ran
# 232.7 tok/s with it against 213.8 with cuBLAS and the separate norm / SiLU launches (2026-12-01,
# 54502fe, both with PDL; docs/BENCHMARKS.md), the kernel alone on par with cuBLAS at M = 1 and slower
# from M = 2. sm_80: not measured. Not in UNMEASURED_SM90_TABLES (those are sets of keys that
# hopper_kernels_forced() fills; this is a number per arch): tests force the kernel with
# GEMV_ROWS_OVERRIDE instead.
GEMV_MAX_ROWS: dict[str, int] = {"sm_90a": 1, "sm_80": 0}
GEMV_KERNEL_MAX_ROWS = 8  # the kernel's largest instantiation (kMaxM)
# TILEATTN_GEMV_MAX_ROWS, read once at import, replaces the table on every arch (0 = kernel off):
# the A/B switch for benchmarks. None when unset; a value that is not an integer in [0, 8] is kept
# as its text and reported by gemv_max_rows.
_GEMV_ENV = os.environ.get("TILEATTN_GEMV_MAX_ROWS")
GEMV_ROWS_OVERRIDE: int | str | None = (
    int(_GEMV_ENV) if _GEMV_ENV is not None and _GEMV_ENV.strip().isdigit() else _GEMV_ENV)


def gemv_max_rows(device_index: int) -> int:
    """Largest M for which the GEMV kernel runs on CUDA device `device_index` (0: never):
    TILEATTN_GEMV_MAX_ROWS when set, else GEMV_MAX_ROWS for the device's arch (0 for an arch not
    listed). Raises ValueError for a TILEATTN_GEMV_MAX_ROWS that is not an integer in [0, 8]."""
    override = GEMV_ROWS_OVERRIDE
    if override is not None:
        if not isinstance(override, int) or not 0 <= override <= GEMV_KERNEL_MAX_ROWS:
            raise ValueError(f"TILEATTN_GEMV_MAX_ROWS must be an integer in [0, {GEMV_KERNEL_MAX_ROWS}], "
                             f"got {override!r}")
        return override
    from ..runtime import device_arch

    return GEMV_MAX_ROWS.get(device_arch(device_index), 0)


class _PointerPlan:
    """A forward LaunchPlan whose dynamic parameters are the data pointers of q, k, v, out, lse."""

    __slots__ = ("plan",)

    def __init__(self, plan):
        self.plan = plan

    def launch(self, q, k, v, out, lse) -> None:
        self.plan.launch(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr())

    def host_slots(self):
        """(LaunchPlan, slots) for runtime.host_launch: the five values are the data pointers of
        q, k, v, out, lse."""
        from ..runtime import host_launch as hl

        return self.plan, tuple(hl.pointer_slots(self.plan.dynamic, (hl.Q, hl.K, hl.V, hl.OUT, hl.LSE)))


def needs_contiguous_kv(t) -> bool:
    """Whether K or V must be copied before the forward can read it (row stride too large for the
    forward kernel's 32-bit tile offsets; see attention_fwd_sm80.MAX_KV_ROW_STRIDE)."""
    return t.stride(2) >= attention_fwd_sm80.MAX_KV_ROW_STRIDE


def forward_family(arch: str, dtype, head_dim: int, causal: bool) -> str:
    """Name of the kernel family that runs this forward."""
    if arch == "sm_90a" and (head_dim, bool(causal)) in SM90_FORWARD:
        return "attention_fwd_sm90"
    return "attention_fwd_sm80"


def attention_forward_plan(q, k, v, out, lse, *, causal: bool, scale: float):
    """The forward plan for these (already validated) tensors on their device:
    `.launch(q, k, v, out, lse)`."""
    from ..runtime import device_arch

    family = forward_family(device_arch(q.device.index), q.dtype, q.shape[3], causal)
    if family == "attention_fwd_sm90":
        from . import attention_fwd_sm90

        return attention_fwd_sm90.ForwardPlan(q, k, v, out, lse, causal=causal, scale=scale)
    return _PointerPlan(attention_fwd_sm80.forward_plan(q, k, v, out, lse, causal=causal, scale=scale))


def variant_forward_family(arch: str, dtype, head_dim: int, dropout_p: float, variants=None) -> str:
    """Name of the kernel family that runs a dense forward with variants. With dropout, the Hopper
    kernel needs the head dim in SM90_DROPOUT_FORWARD and attention_fwd_sm90.supports_dropout to
    accept `variants` (an attention_fwd_sm80.VariantArgs; without it, the sm80 family is named)."""
    if arch != "sm_90a" or head_dim not in SM90_VARIANT_FORWARD:
        return "attention_fwd_sm80"
    if not dropout_p:
        return "attention_fwd_sm90"
    if head_dim in SM90_DROPOUT_FORWARD and variants is not None:
        from . import attention_fwd_sm90

        if attention_fwd_sm90.supports_dropout(head_dim, dtype, variants):
            return "attention_fwd_sm90"
    return "attention_fwd_sm80"


class _VariantPointerPlan:
    """A variant forward LaunchPlan (sm80) launched like the Hopper ForwardPlan: `launch(q, k, v,
    out, lse, alibi pointer, seed, offset, rng state pointer)`."""

    __slots__ = ("plan",)

    def __init__(self, plan):
        self.plan = plan

    def launch(self, q, k, v, out, lse, alibi, seed, offset, rng_state) -> None:
        self.plan.launch(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr(), alibi, seed, offset,
                         rng_state)


def sm90_variant_forward_kind(dtype, head_dim: int, seqlen_k: int, variants, *, inference: bool) -> tuple[bool, bool]:
    """(fixed_max, causal_kernel) for attention_fwd_sm90.ForwardPlan. For a forward that no backward
    follows (inference), bf16 softcap takes the fixed-max kernel where SM90_SOFTCAP_FIXED_MAX lists
    the head dim and fixed_max_applies (causal too: WINDOW | SOFTCAP, or the kCausal kernel with the
    fixed max where SM90_CAUSAL_FIXED_MAX lists the head dim); causal ALiBi, and causal softcap that
    the fixed max does not take, the kCausal kernel where SM90_CAUSAL_VARIANT_FORWARD lists the head
    dim."""
    from . import attention_fwd_sm90

    flags = attention_fwd_sm90.variant_flags(variants)
    fixed_max = inference and head_dim in SM90_SOFTCAP_FIXED_MAX and attention_fwd_sm90.fixed_max_applies(
        dtype, flags, variants.softcap, seqlen_k)
    causal_table = SM90_CAUSAL_FIXED_MAX if fixed_max else SM90_CAUSAL_VARIANT_FORWARD
    causal_kernel = head_dim in causal_table and attention_fwd_sm90.causal_variant_flags(variants) is not None
    return fixed_max, causal_kernel


def variant_forward_plan(q, k, v, out, lse, *, scale: float, variants, inference: bool = False):
    """The forward plan of a dense call with variants (attention_fwd_sm80.VariantArgs, causal
    folded into the window) for these validated tensors: `.launch(q, k, v, out, lse, alibi
    pointer, seed, offset, rng state pointer)`. K/V must already be copied where the sm80 kernel needs it
    (needs_contiguous_kv). inference: no backward follows this forward, so softcap's fixed row max
    may run (sm90_variant_forward_kind; a backward from its output and lse would be less exact, see
    SM90_SOFTCAP_FIXED_MAX)."""
    from ..runtime import device_arch

    family = variant_forward_family(device_arch(q.device.index), q.dtype, q.shape[3], variants.dropout_p, variants)
    if family == "attention_fwd_sm90":
        from . import attention_fwd_sm90

        fixed_max, causal_kernel = sm90_variant_forward_kind(q.dtype, q.shape[3], k.shape[2], variants, inference=inference)
        return attention_fwd_sm90.ForwardPlan(q, k, v, out, lse, causal=False, scale=scale, variants=variants,
                                              fixed_max=fixed_max, causal_kernel=causal_kernel)
    return _VariantPointerPlan(attention_fwd_sm80.forward_plan(q, k, v, out, lse, causal=False, scale=scale,
                                                               variants=variants))


def inference_forward_differs(q, k, variants) -> bool:
    """Whether a forward that no backward follows takes another plan than one a backward may follow
    (variant_forward_plan's inference): the Hopper variant forward with softcap's fixed max."""
    from ..runtime import device_arch

    if variant_forward_family(device_arch(q.device.index), q.dtype, q.shape[3], variants.dropout_p,
                              variants) != "attention_fwd_sm90":
        return False
    kinds = {sm90_variant_forward_kind(q.dtype, q.shape[3], k.shape[2], variants, inference=i) for i in (False, True)}
    return len(kinds) == 2


def variant_backward_family(arch: str, dtype, head_dim: int, variants, deterministic: bool) -> str:
    """Name of the kernel family that runs a dense backward with variants (with dropout, the pair
    must be in SM90_DROPOUT_BACKWARD too)."""
    key = (head_dim, bool(deterministic))
    if arch == "sm_90a" and key in SM90_VARIANT_BACKWARD and (not variants.dropout_p or key in SM90_DROPOUT_BACKWARD):
        from . import attention_bwd_sm90

        if attention_bwd_sm90.supports_variants(head_dim, dtype, variants, deterministic):
            return "attention_bwd_sm90"
    return "attention_bwd_sm80"


def variant_backward_plan(q, k, v, out, lse, dout, dq, dk, dv, *, scale: float, deterministic: bool, variants):
    """The backward plan of a dense call with variants (attention_fwd_sm80.VariantArgs, causal folded
    into the window) for these validated tensors: `.launch(q, k, v, out, lse, dout, dq, dk, dv,
    alibi pointer, seed, offset, rng state pointer)`. lse is the variant forward's, from either forward family."""
    from ..runtime import device_arch

    family = variant_backward_family(device_arch(q.device.index), q.dtype, q.shape[3], variants, deterministic)
    if family == "attention_bwd_sm90":
        from . import attention_bwd_sm90

        split = q.shape[3] in SM90_SOFTCAP_BWD_SPLIT and attention_bwd_sm90.split_masked_applies(
            q.shape[3], variants, deterministic)
        return attention_bwd_sm90.variant_backward_plan(q, k, v, out, lse, dout, dq, dk, dv, scale=scale,
                                                        deterministic=deterministic, variants=variants,
                                                        split_masked=split)
    return attention_bwd_sm80.backward_plan(q, k, v, out, lse, dout, dq, dk, dv, causal=False, scale=scale,
                                            deterministic=deterministic, variants=variants)


def backward_family(arch: str, dtype, head_dim: int, causal: bool, deterministic: bool) -> str:
    """Name of the kernel family that runs this backward."""
    if arch == "sm_90a" and (head_dim, bool(causal), bool(deterministic)) in SM90_BACKWARD:
        return "attention_bwd_sm90"
    return "attention_bwd_sm80"


def attention_backward_plan(q, k, v, out, lse, dout, dq, dk, dv, *, causal: bool, scale: float,
                            deterministic: bool):
    """The backward plan for these (already validated) tensors: `.launch(q, k, v, out, lse, dout,
    dq, dk, dv)`."""
    from ..runtime import device_arch

    family = backward_family(device_arch(q.device.index), q.dtype, q.shape[3], causal, deterministic)
    module = attention_bwd_sm80
    if family == "attention_bwd_sm90":
        from . import attention_bwd_sm90 as module
    return module.backward_plan(q, k, v, out, lse, dout, dq, dk, dv, causal=causal, scale=scale,
                                deterministic=deterministic)


def varlen_forward_plan(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, *, causal: bool,
                        scale: float, variants=None):
    """The packed variable-length forward's plan for these (already validated) tensors:
    `.launch(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k)` with data pointers, and with variants
    (the sm80 kernels' VariantArgs, causal folded in) the ALiBi pointer, dropout seed, offset and
    rng state pointer after them. The Hopper varlen kernel on sm_90a where SM90_VARLEN_FORWARD
    lists (head dim, causal), or with variants SM90_VARLEN_VARIANT_FORWARD (with dropout
    SM90_VARLEN_DROPOUT_FORWARD) the head dim and attention_fwd_sm90.packed_kernel_flags finds a
    kernel; the sm80 family otherwise."""
    from ..runtime import device_arch

    head_dim = q.shape[2]
    if variants is None:
        hopper = (head_dim, bool(causal)) in SM90_VARLEN_FORWARD
    else:
        from .attention_fwd_sm90 import VARLEN, packed_kernel_flags

        table = SM90_VARLEN_DROPOUT_FORWARD if variants.dropout_p > 0 else SM90_VARLEN_VARIANT_FORWARD
        hopper = head_dim in table and packed_kernel_flags(head_dim, VARLEN, variants) is not None
    if hopper and device_arch(q.device.index) == "sm_90a":
        from . import attention_fwd_sm90

        if attention_fwd_sm90.supports_varlen(head_dim, q.dtype, tensors=(q, k, v, out),
                                              batch=cu_seqlens_q.shape[0] - 1, heads=q.shape[1],
                                              max_seqlen_q=max_seqlen_q):
            return attention_fwd_sm90.forward_varlen_plan(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                                          causal=causal, scale=scale, variants=variants)
    return attention_fwd_sm80.forward_varlen_plan(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                                  causal=causal, scale=scale, variants=variants)


def varlen_backward_plan(q, k, v, out, lse, dout, dq, dk, dv, cu_seqlens_q, max_seqlen_q: int, max_seqlen_k: int, *,
                         causal: bool, scale: float, deterministic: bool, variants=None):
    """The packed variable-length backward's plan for these (already validated) tensors:
    `.launch(q, k, v, out, lse, dout, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, *variant values)`. The
    Hopper varlen backward on sm_90a where SM90_VARLEN_BACKWARD lists (head dim, causal,
    deterministic), or with variants (the sm80 kernels' VariantArgs, causal folded in)
    SM90_VARLEN_VARIANT_BACKWARD (with dropout SM90_VARLEN_DROPOUT_BACKWARD) the head dim and
    supports_varlen_variants the call; sm80's otherwise."""
    from ..runtime import device_arch

    head_dim = q.shape[2]
    if variants is None:
        hopper = (head_dim, bool(causal), bool(deterministic)) in SM90_VARLEN_BACKWARD
    else:
        hopper = head_dim in (SM90_VARLEN_DROPOUT_BACKWARD if variants.dropout_p > 0 else SM90_VARLEN_VARIANT_BACKWARD)
    if hopper and device_arch(q.device.index) == "sm_90a":
        from . import attention_bwd_sm90

        if (attention_bwd_sm90.supports_varlen(head_dim, q.dtype, causal, deterministic) if variants is None
                else attention_bwd_sm90.supports_varlen_variants(head_dim, q.dtype, variants, deterministic)):
            return attention_bwd_sm90.backward_varlen_plan(q, k, v, out, lse, dout, dq, dk, dv, cu_seqlens_q,
                                                           max_seqlen_q, max_seqlen_k, causal=causal, scale=scale,
                                                           deterministic=deterministic, variants=variants)
    return attention_bwd_sm80.backward_varlen_plan(q, k, v, out, lse, dout, dq, dk, dv, cu_seqlens_q, max_seqlen_q,
                                                   max_seqlen_k, causal=causal, scale=scale,
                                                   deterministic=deterministic, variants=variants)


def paged_launch(q, k_cache, v_cache, block_table, *, max_seqlen_q: int, causal: bool, scale: float,
                 return_lse: bool, num_splits: int | None, variants=None,
                 prior_kernel_writes_only_new_keys: bool = False):
    """The callable that runs attention_paged for these (already validated) tensors:
    `launch(q, k_cache, v_cache, block_table, cu_seqlens_q, seqlens_k, alibi_slopes=...)` ->
    (out, lse or None). The Hopper paged forward for prefill-shaped calls whose (head dim,
    block_size) SM90_PAGED_PREFILL lists on sm_90a (with variants: SM90_PAGED_VARIANT_PREFILL, and a
    kernel attention_fwd_sm90.packed_kernel_flags finds), the sm80 paged kernel (split-KV) otherwise;
    only the latter uses prior_kernel_writes_only_new_keys (the Hopper one waits first)."""
    from ..runtime import device_arch
    from .attention_paged_sm80 import PagedLaunch

    head_dim = q.shape[2]
    key = (head_dim, k_cache.shape[1])
    if variants is None:
        hopper = key in SM90_PAGED_PREFILL
    else:
        from .attention_fwd_sm90 import PAGED, packed_kernel_flags

        hopper = key in SM90_PAGED_VARIANT_PREFILL and packed_kernel_flags(key[0], PAGED, variants) is not None
    if hopper and num_splits in (None, 1) and device_arch(q.device.index) == "sm_90a":
        from . import attention_fwd_sm90

        if attention_fwd_sm90.supports_paged(head_dim, q.dtype, block_size=k_cache.shape[1], max_seqlen_q=max_seqlen_q,
                                             batch=block_table.shape[0], heads=q.shape[1], kv_heads=k_cache.shape[2],
                                             total_q=q.shape[0], device=q.device, tensors=(q, k_cache, v_cache)):
            return attention_fwd_sm90.PagedPlan(q, k_cache, v_cache, block_table, max_seqlen_q=max_seqlen_q,
                                                causal=causal and variants is None, scale=scale,
                                                return_lse=return_lse, variants=variants)
    return PagedLaunch(q, k_cache, v_cache, block_table, max_seqlen_q=max_seqlen_q,
                       causal=causal and variants is None, scale=scale, return_lse=return_lse,
                       num_splits=num_splits, variants=variants,
                       prior_kernel_writes_only_new_keys=prior_kernel_writes_only_new_keys)
