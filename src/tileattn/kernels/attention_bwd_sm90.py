"""Attention backward on Hopper (csrc/attention_bwd_sm90.cu): TMA + wgmma + warp specialization.

Same tensors and contract as attention_bwd_sm80.BackwardPlan: q, out, dout, dq [B, H, Nq, d]; k, v,
dk, dv [B, Hkv, Nk, d]; lse [B, H, Nq] fp32 contiguous, natural log (-inf for fully masked rows,
whose gradients come out 0); one 16-bit dtype; a contiguous last dim and 16-byte aligned rows.

One backward is three launches on torch's current stream (capturable by CUDA graphs):
1. attention_bwd_sm80's preprocess kernel: delta = rowsum(dO * O), lse2 = lse * log2(e), and the fp32
   dQ accumulator zeroed;
2. this family's main kernel: one CTA per (128 keys, kv head, batch), dK and dV in registers over
   the GQA group's query heads, dQ added into the accumulator with fp32 vector REDs; in
   deterministic mode a dQ warp adds each staged tile with one bulk reduce-add, in key-block order
   through per-(b, h, query tile) counters (zeroed by a memset), so dq is bitwise reproducible.
   d = 256 (csrc "d = 256"): one CTA per 64 keys, the two MMA warpgroups split the products (S^T,
   P^T, dV | dP^T, dS^T, dK; dQ by columns), dQ by REDs in both modes (in key-block order through
   per-(b, h, query tile, warpgroup) counters when deterministic);
3. attention_bwd_sm80's convert kernel: dq = scale * accumulator.
The main kernel writes the sm80 kernels' fragment-order accumulator layout, so 1 and 3 are reused
as they are.

Variants (issue #15; csrc "Variants"): window, softcap, ALiBi and dropout run the
attention_bwd_sm90_variants instantiations (atomic and deterministic modes), through
BackwardPlan(..., variants=VariantArgs) or variant_backward_plan, whose launch takes (alibi
pointer, seed, offset, rng state pointer) after the tensors like the sm80 variant backward's; supports_variants says
which calls they cover (dropout with a window or none, not with softcap / ALiBi; d = 256 on the
role-split layout, csrc "d = 256"). lse
is the variant forward's (natural log of the transformed logits), as the Hopper and sm80 variant
forwards write it; with dropout, out is the dropped output and seed / offset the forward's, whose
keep mask (tileattn.dropout.dropout_mask) the kernel recomputes (docs/attention_bwd_sm90.md, "Dropout").
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..launch_limits import MAX_GRID_X
from . import Family
from .attention_bwd_sm80 import _CONVERT_ROWS, _PRE_ROWS, _ROW_PAD, convert_expr, preprocess_expr

FAMILY_NAME = "attention_bwd_sm90"
SOURCE = "attention_bwd_sm90.cu"
HEAD_DIMS = (64, 128, 256)
BLOCK_N = 128           # keys per CTA at d = 64 / 128: two MMA warpgroups x 64
BLOCK_N_256 = 64        # keys per CTA at d = 256 (csrc "d = 256": the warpgroups split the products)
VARLEN_HEAD_DIMS = (64, 128)  # the varlen entry point (d = 256 varlen runs attention_bwd_sm80's)
THREADS = 384           # producer warpgroup + two MMA warpgroups
PANEL = 64              # TMA box width in elements: 128 bytes, the 128-byte swizzle span
LOG2E = 1.4426950408889634
SMEM_LIMIT = 232448     # bytes per block on an H100/H200 (227 KB opt-in), static + dynamic
STATIC_SMEM = 256       # reserved for the kernel's static mbarriers (kStaticSmem in the .cu)
L2_SECTION_BYTES = 40 * 2**20  # Q + dO + dq_accum of the (kv head, batch) pairs in flight (FA3's budget)
# The deterministic windowed plans' semaphore templates, kept for the life of the process: `launch`
# copies one per call, and a CUDA graph that captured that copy reads the template on every replay,
# also after tileattn.api.clear_plans (or the plan cache's overflow) has dropped the plan. A few
# int32 per query tile each, one per such plan made.
_GRAPH_READ_TEMPLATES: list[torch.Tensor] = []


@dataclass(frozen=True, order=True)
class Sm90BwdConfig:
    """block_m query rows per step of the walk (the wgmma N of S^T = K Q^T; d * block_m = 8192, so
    that dQ is 64 x 64 per MMA warpgroup), the depth of the Q / dO ring, and how the atomic mode
    adds dQ: REDs from the MMA registers (dq_bulk False) or, like the deterministic mode, tiles
    staged in shared memory and added by a dQ warp's bulk reduce-add, unordered (dq_bulk True)."""

    block_m: int
    stages: int
    dq_bulk: bool = False

    def dq_mode(self, deterministic: bool) -> int:
        """The kernel's kDqMode: 1 deterministic (ordered bulk), 2 unordered bulk, 0 REDs."""
        return 1 if deterministic else 2 if self.dq_bulk else 0

    def _smem_without_dq(self, head_dim: int) -> int:
        block_n = block_n_of(head_dim)
        kv = 2 * block_n * head_dim * 2
        ring = 2 * self.stages * self.block_m * head_dim * 2
        ds = 2 * block_n * self.block_m * 2
        p_exchange = block_n * self.block_m * 4 if head_dim == 256 else 0  # fp32 P^T, role 0 -> role 1
        rows = 2 * self.stages * self.block_m * 4
        return kv + ring + ds + p_exchange + rows + 1024

    def dq_buffers(self, head_dim: int, deterministic: bool) -> int:
        """The staged dQ modes' fp32 tiles (block_m x d x 4 bytes each): two where they fit beside the
        rest (and STATIC_SMEM of mbarriers) in SMEM_LIMIT, else one (which may still not fit: see
        fits); none with REDs. Mirrors dq_buffers() in the .cu."""
        tile = self.block_m * head_dim * 4
        if self.dq_mode(deterministic) == 0 or head_dim == 256:  # d = 256 adds dQ by REDs in both modes
            return 0
        return 2 if self._smem_without_dq(head_dim) + 2 * tile + STATIC_SMEM <= SMEM_LIMIT else 1

    def smem_bytes(self, head_dim: int, deterministic: bool = False) -> int:
        """Dynamic shared memory: K, V (128 x d each), `stages` Q and dO tiles, the double-buffered
        dS^T tile, the staged dQ tiles, lse2 / delta per stage, + 1 KB to align to 1024 B."""
        return (self._smem_without_dq(head_dim)
                + self.dq_buffers(head_dim, deterministic) * self.block_m * head_dim * 4)

    def fits(self, head_dim: int, deterministic: bool) -> bool:
        """Whether the instantiation's shared memory fits in a block (d = 256: 64-query tiles, dQ by
        REDs, as the kernel's role-split layout has them)."""
        if head_dim == 256 and (self.block_m != 64 or self.dq_bulk):
            return False
        return self.smem_bytes(head_dim, deterministic) + STATIC_SMEM <= SMEM_LIMIT

    def __str__(self) -> str:
        return f"{self.block_m}x{BLOCK_N}/s{self.stages}" + ("/bulk" if self.dq_bulk else "")


C = Sm90BwdConfig


def block_n_of(head_dim: int) -> int:
    """Keys per CTA of the main kernel: 128 (two MMA warpgroups x 64 keys) at d = 64 / 128, 64 at
    d = 256, where the warpgroups split the products instead (csrc "d = 256"). Never raises."""
    return BLOCK_N_256 if head_dim == 256 else BLOCK_N

# Default per (head dim, causal), fp16 and bf16 alike: FA3's tiles where the kernel's shape allows
# (d=128: 64 x 128, FA3 uses 64 causal / 80 non-causal; d=64: 128 x 128), two stages as FA3 has.
# dQ at d=128 by the staged bulk reduce-add (kDqMode 2, FA3's way): on the H200 (2026-12-02,
# docs/attention_bwd_sm90.md "Tuning the dQ mode") it ran 2-6 % above the REDs at every N from 2048
# to 32768, causal or not; at d=64 the REDs stayed 1-4 % ahead. The rotated walk and a third ring
# stage gained nothing at either head dim.
#   d=128: 64 + 64 + 32 (Q, dO ring) + 32 (dS^T) KB + 1.5 KB = 162 KB, + 2 x 32 KB staged dQ = 226 KB
#   d=64:  32 + 64 + 64 KB + 3 KB = 163 KB
# d=256 (the role-split layout, 64 keys per CTA): 64 (K, V) + 128 (Q, dO ring) + 16 (dS^T) + 16 (P^T
# exchange) + 2 KB = 226 KB; dQ by REDs (no room for a staged tile), in turn when deterministic.
DEFAULTS: dict[tuple[int, bool], Sm90BwdConfig] = {
    (128, False): C(64, 2, True),
    (128, True): C(64, 2, True),
    (64, False): C(128, 2),
    (64, True): C(128, 2),
    (256, False): C(64, 2),
    (256, True): C(64, 2),
}
# The varlen and variant entry points keep dQ by REDs: their staged modes have not been timed.
_RED_DEFAULTS = {key: C(cfg.block_m, cfg.stages) for key, cfg in DEFAULTS.items()}
VARLEN_DEFAULTS: dict[tuple[int, bool], Sm90BwdConfig] = _RED_DEFAULTS
# The rotated walk (csrc "Rotated walk": concurrent key blocks of a pair add into different dq_accum
# tiles) per (head dim, causal) in the atomic mode; a run-time flag of the same kernels. Off: within
# +-1 % of the unrotated walk on the H200 (docs/attention_bwd_sm90.md, "Tuning the dQ mode").
ROTATE: dict[tuple[int, bool], bool] = {(d, c): False for d in HEAD_DIMS for c in (False, True)}
# Tuning candidates beside the default: a third ring stage (196 KB at either head dim), and both
# atomic dQ modes, REDs and the staged bulk reduce-add (the deterministic mode's path without the
# turn; FA3's choice), so that whichever mode a default (dense, varlen) does not use stays timed.
TUNING_EXTRA: dict[int, tuple[Sm90BwdConfig, ...]] = {128: (C(64, 3), C(64, 2), C(64, 2, True)),
                                                      64: (C(128, 3), C(128, 2), C(128, 2, True)),
                                                      256: ()}


# ---- variants (csrc "Variants": bits of the kernel's kVariant, as attention_fwd_sm90's) ------------
WINDOW, SOFTCAP, ALIBI, DROPOUT = 1, 2, 4, 32  # DROPOUT: attention_fwd_sm90.DROPOUT's value
# The flag sets registered per head dim, every one with the window bit: a window with unbounded edges
# costs a variant kernel a few scalar operations per query tile (its range and `masked` test come out
# as the full range and the Nk edge), and the sets without it bought nothing while spilling where the
# window set does not. ptxas spill bytes (sm_90a, 240 registers per MMA thread, both dtypes alike,
# atomic mode) under NVRTC 13.5 (here) / 13.0 (the H200 image; scripts/check_nvrtc_version.py): 0/0
# for every set at d = 128 and d = 64. At d = 64 (block_m 128) the 128 fp32 S^T / dP^T
# accumulators and 64 of dK / dV leave ~20 registers for the P^T pass: softcap fits only because
# its pass packs P^T and dS^T pair by pair (computed for the whole tile first, 168-656 bytes spilled).
# Compile-time sets rather than run-time flags: each call pays only for its variants' per-score
# work (docs/attention_bwd_sm90.md, "Variants").
# Dropout (docs/attention_bwd_sm90.md, "Dropout"): with the window bit alone (dropout without a
# window runs it with both edges unbounded, as the other sets); not with softcap or ALiBi yet (the
# kernel's static_assert): such calls stay on the sm80 variant backward.
# WINDOW | DROPOUT | RNG_STATE (bwd90::kRngState; VariantArgs.rng_state): the seed and offset read from
# device memory at the entry point (docs/attention_variants.md, "Dropout's rng state in device memory").
RNG_STATE = 128
VARIANT_SETS: dict[int, tuple[int, ...]] = {
    d: (WINDOW, WINDOW | SOFTCAP, WINDOW | ALIBI, WINDOW | SOFTCAP | ALIBI, WINDOW | DROPOUT,
        WINDOW | DROPOUT | RNG_STATE) for d in (128, 64, 256)
}


def variant_bits(variants) -> int:
    """The kernel's kVariant for an attention_fwd_sm80.VariantArgs: 0 when none of window, softcap,
    ALiBi, dropout is on (the plain non-causal kernel runs), else WINDOW plus SOFTCAP / ALIBI /
    DROPOUT as set (see VARIANT_SETS: every registered set has the window bit). Never raises."""
    from .attention_fwd_sm90 import variant_flags

    flags = variant_flags(variants) & (WINDOW | SOFTCAP | ALIBI | DROPOUT)
    return 0 if flags == 0 else WINDOW | flags | (RNG_STATE if variants.reads_rng_state else 0)


def supports_variants(head_dim: int, dtype, variants, deterministic: bool = False) -> bool:
    """Whether variant_backward_plan runs a call with these variants (attention_fwd_sm80.VariantArgs,
    causal folded into the window) on this family: head_dim in VARIANT_SETS (64, 128, 256), float16 /
    bfloat16, the set of variant_bits registered there (dropout: with a window or none, not with
    softcap or ALiBi); atomic or deterministic (the dispatcher decides whether the latter runs here,
    as it does for the plain kernel), except UNREGISTERED_VARIANTS. The caller still routes only sm_90a
    devices here. Never raises."""
    if dtype not in (torch.float16, torch.bfloat16):
        return False
    bits = variant_bits(variants)
    return (head_dim in VARIANT_SETS and (bits == 0 or bits in VARIANT_SETS[head_dim])
            and (head_dim, bits, bool(deterministic)) not in UNREGISTERED_VARIANTS)


def variant_expression(head_dim: int, config: Sm90BwdConfig, bf16: bool, bits: int, deterministic: bool = False) -> str:
    """The NVRTC name expression of one variant main-kernel instantiation."""
    return (f"tileattn::attention_bwd_sm90_variants<{head_dim}, {config.block_m}, {config.stages}, "
            f"{'true' if bf16 else 'false'}, {config.dq_mode(deterministic)}, {bits}>")


def window_first_blocks(seqlen_q: int, seqlen_k: int, left: int, block_m: int, block_n: int = BLOCK_N) -> list[int]:
    """Per query tile m, the first key block whose window_tiles range (csrc) holds it: the block of
    the lowest key the tile's first row sees, max(0, m block_m + Nk - Nq - left) // block_n (keys per
    CTA: block_n_of(head_dim); both ends of a key block's range are non-decreasing in the block, so a
    tile's visitors are consecutive key blocks from there). The deterministic mode starts each tile's
    turn counter at this value: the kernel's turn code is the plain one, which counts from key block 0.
    Never raises."""
    diag = seqlen_k - seqlen_q
    return [max(0, m * block_m + diag - left) // block_n for m in range(-(-seqlen_q // block_m))]


def expression(head_dim: int, config: Sm90BwdConfig, causal: bool, bf16: bool, deterministic: bool) -> str:
    """The NVRTC name expression of one main-kernel instantiation."""
    flag = {True: "true", False: "false"}
    return (f"tileattn::attention_bwd_sm90<{head_dim}, {config.block_m}, {config.stages}, {flag[bool(causal)]}, "
            f"{flag[bool(bf16)]}, {config.dq_mode(deterministic)}>")


def varlen_expression(head_dim: int, config: Sm90BwdConfig, causal: bool, bf16: bool) -> str:
    """The NVRTC name expression of one varlen main-kernel instantiation (atomic dQ modes only: the
    deterministic varlen backward runs on the sm80 kernels)."""
    flag = {True: "true", False: "false"}
    return (f"tileattn::attention_bwd_sm90_varlen<{head_dim}, {config.block_m}, {config.stages}, "
            f"{flag[bool(causal)]}, {flag[bool(bf16)]}, {config.dq_mode(False)}>")


def _expressions(configs_by_dim, varlen: bool = False) -> tuple[str, ...]:
    """Every (causal, dtype, mode) of the configs, the modes whose shared memory fits; varlen: the
    varlen entry point's (causal, dtype), atomic mode only."""
    exprs = []
    for d, configs in configs_by_dim:
        for cfg in configs:
            if varlen:
                exprs += [varlen_expression(d, cfg, causal, bf16) for causal in (False, True) for bf16 in (False, True)
                          if cfg.fits(d, False)]
                continue
            exprs += [expression(d, cfg, causal, bf16, det)
                      for causal in (False, True) for bf16 in (False, True) for det in (False, True)
                      if cfg.fits(d, det)]
    return tuple(dict.fromkeys(exprs))


def _default_configs(table, head_dims=HEAD_DIMS):
    return ((d, {table[(d, c)] for c in (False, True)}) for d in head_dims)


# The varlen entry point takes the dense tiles (VARLEN_DEFAULTS: DEFAULTS with dQ by REDs; TUNING_EXTRA):
# same shared memory; only the default configs are registered for dispatch, the rest as tuning
# candidates. Variant kernels: the non-causal default tiles with REDs (a window is masked like
# causal; the defaults are the same config causal or not), VARIANT_SETS x both dtypes x atomic /
# deterministic.
VARIANT_DEFAULTS: dict[int, Sm90BwdConfig] = {d: _RED_DEFAULTS[(d, False)] for d in VARIANT_SETS}
# (head dim, bits, deterministic) not registered: the kRngState form at d = 256 in the deterministic mode
# spilled 16 bytes (NVRTC 13.5); such calls run the sm80 kernels' kRngState form.
UNREGISTERED_VARIANTS = {(256, WINDOW | DROPOUT | RNG_STATE, True)}
VARIANT_INSTANTIATIONS = tuple(variant_expression(d, VARIANT_DEFAULTS[d], bf16, bits, det) for d in VARIANT_SETS
                               for bf16 in (False, True) for bits in VARIANT_SETS[d] for det in (False, True)
                               if (d, bits, det) not in UNREGISTERED_VARIANTS)
# Softcap's P^T / dS^T passes compiled apart for masked and unmasked tiles (bwd90::kSplitMasked; csrc
# says why): softcap alone (WINDOW | SOFTCAP) at d = 64 and 128, atomic dQ, both dtypes. The other
# combinations spill (NVRTC 13.5): d = 64 deterministic 4 bytes, d = 128 atomic with ALiBi too 52.
SPLIT_MASKED = 64
SPLIT_MASKED_HEAD_DIMS = (64, 128)
SPLIT_MASKED_INSTANTIATIONS = tuple(
    variant_expression(d, VARIANT_DEFAULTS[d], bf16, WINDOW | SOFTCAP | SPLIT_MASKED, False)
    for d in SPLIT_MASKED_HEAD_DIMS for bf16 in (False, True))


# The varlen entry point with variants (attention_bwd_sm90_varlen_variants): the sets without dropout
# at the varlen head dims, the variant tiles, atomic dQ (the deterministic varlen backward is sm80's),
# both dtypes. The softcap sets run the unsplit passes. Dropout (VARLEN_DROPOUT_SETS: with the window
# bit alone, as the dense kernel, with and without kRngState; 0 spills, NVRTC 13.5; GPU-tested and
# dispatched in session 48: dispatch.SM90_VARLEN_DROPOUT_BACKWARD).
VARLEN_VARIANT_SETS = (WINDOW, WINDOW | SOFTCAP, WINDOW | ALIBI, WINDOW | SOFTCAP | ALIBI)
VARLEN_DROPOUT_SETS = (WINDOW | DROPOUT, WINDOW | DROPOUT | RNG_STATE)


def varlen_variant_expression(head_dim: int, config: Sm90BwdConfig, bf16: bool, bits: int) -> str:
    """The NVRTC name expression of one varlen variant main-kernel instantiation (bits in
    VARLEN_VARIANT_SETS or VARLEN_DROPOUT_SETS, atomic dQ)."""
    return (f"tileattn::attention_bwd_sm90_varlen_variants<{head_dim}, {config.block_m}, {config.stages}, "
            f"{'true' if bf16 else 'false'}, {config.dq_mode(False)}, {bits}>")


VARLEN_VARIANT_INSTANTIATIONS = tuple(varlen_variant_expression(d, VARIANT_DEFAULTS[d], bf16, bits)
                                      for d in VARLEN_HEAD_DIMS for bf16 in (False, True)
                                      for bits in VARLEN_VARIANT_SETS + VARLEN_DROPOUT_SETS)


def supports_varlen_variants(head_dim: int, dtype, variants, deterministic: bool = False) -> bool:
    """Whether BackwardVarlenPlan runs a varlen call with these variants (attention_fwd_sm80.VariantArgs,
    causal folded into the window): supports_varlen's head dims, dtypes and atomic mode, and
    variant_bits in VARLEN_VARIANT_SETS or VARLEN_DROPOUT_SETS (dropout with a window or none, not with
    softcap or ALiBi). Never raises."""
    return (supports_varlen(head_dim, dtype, False, deterministic)
            and variant_bits(variants) in VARLEN_VARIANT_SETS + VARLEN_DROPOUT_SETS)


def split_masked_applies(head_dim: int, variants, deterministic: bool) -> bool:
    """Whether a split-masked kernel (SPLIT_MASKED_INSTANTIATIONS) runs this call: softcap alone (with
    the window bit every variant kernel has), atomic dQ, a head dim in SPLIT_MASKED_HEAD_DIMS."""
    return (not deterministic and head_dim in SPLIT_MASKED_HEAD_DIMS
            and variant_bits(variants) == WINDOW | SOFTCAP)
INSTANTIATIONS = (_expressions(_default_configs(DEFAULTS))
                  + _expressions(_default_configs(VARLEN_DEFAULTS, VARLEN_HEAD_DIMS), varlen=True)
                  + VARIANT_INSTANTIATIONS + SPLIT_MASKED_INSTANTIATIONS + VARLEN_VARIANT_INSTANTIATIONS)
TUNING = tuple(e for e in _expressions(TUNING_EXTRA.items())
               + _expressions(((d, TUNING_EXTRA[d]) for d in VARLEN_HEAD_DIMS), varlen=True)
               if e not in INSTANTIATIONS)
FAMILIES = (Family(FAMILY_NAME, SOURCE, INSTANTIATIONS, archs=("sm_90a",), tuning=TUNING),)


def supports(head_dim: int, dtype, causal: bool = False) -> bool:
    """Whether this backward has an instantiation for (head_dim, dtype, causal): head_dim in
    HEAD_DIMS and dtype float16 / bfloat16 (causal and not alike). The caller still routes only
    sm_90a devices here. Never raises."""
    return head_dim in HEAD_DIMS and dtype in (torch.float16, torch.bfloat16)


def supports_varlen(head_dim: int, dtype, causal: bool = False, deterministic: bool = False) -> bool:
    """Whether the varlen Hopper backward (BackwardVarlenPlan) runs (head_dim, dtype, causal,
    deterministic): head_dim in VARLEN_HEAD_DIMS (64, 128), float16 / bfloat16, causal or not, atomic
    mode only (deterministic=True and d = 256 stay on attention_bwd_sm80's varlen kernels). The
    caller still routes only sm_90a devices here. Never raises."""
    return head_dim in VARLEN_HEAD_DIMS and supports(head_dim, dtype, causal) and not deterministic


def tuning_candidates(head_dim: int, causal: bool, deterministic: bool = False) -> tuple[Sm90BwdConfig, ...]:
    """Configs worth timing for (head_dim, causal, mode), the default first: those whose shared
    memory fits in that mode, and in deterministic mode only one per kernel (dq_bulk does not
    change it). Raises ValueError for an unsupported head dim."""
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"head_dim {head_dim} is not supported by the sm90 backward; supported: {HEAD_DIMS}")
    configs = dict.fromkeys((DEFAULTS[(head_dim, bool(causal))], *TUNING_EXTRA[head_dim]))
    return tuple(c for c in configs if c.fits(head_dim, deterministic) and not (deterministic and c.dq_bulk))


def section_pairs(seqlen_q: int, head_dim: int, group: int, elem_bytes: int, causal: bool,
                  deterministic: bool) -> int:
    """(kv head, batch) pairs per section of the main kernel's block order (csrc "Block order"):
    the largest power of two whose Q, dO (elem_bytes each) and fp32 dq_accum rows of `group` query
    heads fit in L2_SECTION_BYTES, at least 1. Non-causal atomic runs keep 1 (key blocks of one pair
    after another: equal-length CTAs gain nothing from LPT, and that order was measured). Never raises."""
    if not (causal or deterministic):
        return 1
    per_pair = max(1, group * seqlen_q * head_dim * (2 * elem_bytes + 4))
    fit = max(1, L2_SECTION_BYTES // per_pair)
    return 1 << (fit.bit_length() - 1)


def _tma_ready(t: torch.Tensor) -> bool:
    """Whether TMA can describe t in place (last dim contiguous, 16-byte aligned base, every
    dimension longer than 1 with a positive stride that is a multiple of 16 bytes below 2^40)."""
    elem = t.element_size()
    if t.stride(-1) != 1 or t.data_ptr() % 16:
        return False
    return all(size == 1 or (0 < stride * elem < 2**40 and (stride * elem) % 16 == 0)
               for size, stride in zip(t.shape[:-1], t.stride()[:-1]))


def _strides(t):
    sb, sh, sr, _ = t.stride()
    return np.int64(sb), np.int64(sh), np.int64(sr)


def _dense_view(t: torch.Tensor) -> torch.Tensor:
    return t


def _varlen_view(t: torch.Tensor) -> torch.Tensor:
    """[T, H, d] packed -> the [1, H, T, d] view the kernel's 4-D maps (d, row, head, batch) read."""
    return t.unsqueeze(0).transpose(1, 2)


class _TmaOperands:
    """The TMA side of a plan: q, k, v, dout (loads) and dk, dv (stores), in the kernel's
    [B, H, N, d] view (`view` of the caller's tensors). Which of them TMA cannot describe in place
    (a zero or huge stride) is decided once: those are copied to / staged in contiguous tensors on
    every launch. Boxes outermost first (batch, head, rows, 64 columns), 128-byte swizzle, zero
    fill: block_m query rows, block_n key rows (block_n_of(d)), 64-row dK / dV stores."""

    def __init__(self, tensors, block_m: int, view=_dense_view):
        from ..runtime import TensorMapTemplate

        self.view = view
        self.copy = tuple(not _tma_ready(view(t)) for t in tensors)
        staged = self.stage(tensors)
        block_n = block_n_of(tensors[0].shape[-1])
        rows = (block_m, block_n, block_n, block_m, 64, 64)
        self.templates = tuple(TensorMapTemplate(view(t), (1, 1, r, PANEL)) for t, r in zip(staged, rows))
        self.dk_layout, self.dv_layout = staged[4].stride(), staged[5].stride()  # what the kernel writes

    def stage(self, tensors) -> tuple:
        """The six tensors the kernel reads and writes: the inputs, contiguous copies where decided,
        and fresh contiguous dK / dV buffers where the gradients cannot be stored in place."""
        q, k, v, dout, dk, dv = tensors
        loads = tuple(t.contiguous() if c else t for t, c in zip((q, k, v, dout), self.copy))
        stores = tuple(torch.empty_like(t, memory_format=torch.contiguous_format) if c else t
                       for t, c in zip((dk, dv), self.copy[4:]))
        return (*loads, *stores)

    def encode(self, staged) -> list:
        """The six tensor maps of the staged tensors (cached per address by their templates)."""
        return [tm.encode(t.data_ptr()) for tm, t in zip(self.templates, staged)]

    def finish(self, dk, dv, staged) -> None:
        """Copy staged dK / dV into the caller's buffers (enqueued after the kernels)."""
        for dst, src, c in zip((dk, dv), staged[4:], self.copy[4:]):
            if c:
                dst.copy_(src)


def _zero_gradients(*grads) -> None:
    """The gradients of a call with no work to launch (no query or no key at all): zeros."""
    for g in grads:
        if g.numel():
            g.zero_()


class BackwardPlan:
    """The three launches of one Hopper backward for tensors of fixed shapes, strides, dtype and
    device (arguments already validated by tileattn.api; same constructor and `launch` as
    attention_bwd_sm80.BackwardPlan). `config` overrides DEFAULTS (see tuning_candidates).

    Tensors: q, out, dout, dq [B, H, Nq, d]; k, v, dk, dv [B, Hkv, Nk, d]; lse [B, H, Nq] fp32
    contiguous (natural log); one dtype, float16 or bfloat16; d in HEAD_DIMS. `launch` writes dq, dk,
    dv completely (never reads them) on torch's current stream and allocates only a torch
    workspace. A tensor TMA cannot describe in place (a zero or huge stride) is copied on each
    launch (decided here, once). `section` overrides section_pairs() and `rotate` the ROTATE table
    (benchmarks; the deterministic mode never rotates). `variants` (attention_fwd_sm80.VariantArgs,
    causal folded into the window, so causal must be False; lse that of the variant logits): the
    attention_bwd_sm90_variants kernel of variant_bits(variants), and `launch` then takes the ALiBi
    slopes' pointer (0: none), the dropout seed and offset (the forward's) after dv. Raises ValueError
    for an unsupported head dim or dtype, H not a multiple of Hkv, a grid of 2^31 blocks or more,
    section < 1, a config whose shared memory does not fit in this mode, or variants that
    supports_variants rejects (or with causal=True). split_masked: softcap's kernel with its passes
    compiled apart for masked and unmasked tiles (SPLIT_MASKED_INSTANTIATIONS: ValueError for variants
    other than softcap alone, the deterministic mode, or a head dim not in SPLIT_MASKED_HEAD_DIMS).
    """

    def __init__(self, q, k, v, out, lse, dout, dq, dk, dv, *, causal: bool, scale: float, deterministic: bool,
                 config: Sm90BwdConfig | None = None, section: int | None = None, rotate: bool | None = None,
                 variants=None, split_masked: bool = False):
        from ..runtime import LaunchPlan
        from . import attention_bwd_sm80 as sm80
        from . import load

        batch, heads, nq, d = q.shape
        kv_heads, nk = k.shape[1], k.shape[2]
        if not supports(d, q.dtype, causal):
            raise ValueError(f"the sm90 backward supports head_dim in {HEAD_DIMS} and float16/bfloat16, "
                             f"got head_dim {d} and {q.dtype}")
        if kv_heads < 1 or heads % kv_heads:
            raise ValueError(f"q heads ({heads}) must be a multiple of k/v heads ({kv_heads})")
        block_n = block_n_of(d)
        n_blocks = -(-nk // block_n)
        if n_blocks * kv_heads * batch > MAX_GRID_X:
            raise ValueError(f"batch x k/v heads x ceil(Nk / {block_n}) must be <= {MAX_GRID_X} blocks")
        if section is not None and section < 1:
            raise ValueError(f"section must be >= 1, got {section}")
        bits = 0
        if variants is not None:
            if causal or not supports_variants(d, q.dtype, variants, deterministic):
                raise ValueError(f"the sm90 variant backward does not run {variants} at head_dim {d}, {q.dtype}, "
                                 f"deterministic={bool(deterministic)}, causal={bool(causal)} (see supports_variants; "
                                 "causal must be folded into the window)")
            bits = variant_bits(variants)
        if split_masked:
            if variants is None or not split_masked_applies(d, variants, deterministic):
                raise ValueError(f"split_masked: softcap alone, atomic dQ, head dims {SPLIT_MASKED_HEAD_DIMS} only "
                                 f"(variant bits {bits}, deterministic={bool(deterministic)}, head_dim {d})")
            bits |= SPLIT_MASKED
        self.variant_values = bits != 0  # whether launch passes (alibi, seed, offset, rng state) to the kernel
        self.config = config = config or (VARIANT_DEFAULTS[d] if bits else DEFAULTS[(d, bool(causal))])
        if not config.fits(d, deterministic):
            raise ValueError(f"config {config} does not fit in shared memory at head_dim {d} with "
                             f"deterministic={bool(deterministic)}")
        bf16 = q.dtype == torch.bfloat16
        device = q.device.index
        self.device = q.device
        self.deterministic = deterministic = bool(deterministic)
        # Nothing to launch: no queries (dK = dV = 0), no keys (dQ = 0), or no heads / batches.
        self.empty = min(batch, heads, nq, nk) == 0
        if self.empty:
            return
        self.nq_pad = nq_pad = -(-nq // _ROW_PAD) * _ROW_PAD
        rows = batch * heads * nq_pad
        # One fp32 workspace: lse2 [B, H, NqPad], delta [B, H, NqPad], the fragment-order dQ
        # accumulator [B, H, NqPad / 16, d / 8, 32, 4]; deterministic: the int32 turn counters
        # [B, H, ceil(Nq / block_m)] (zeroed per call; d = 256: [.., 2], one per role's half of dQ).
        self.ws_elems = 2 * rows + rows * d
        self.sem_elems = batch * heads * -(-nq // config.block_m) * (2 if d == 256 else 1)
        self._delta_offset, self._acc_offset = rows * 4, 2 * rows * 4  # bytes into the workspace
        i32, f32 = np.int32, np.float32
        group = heads // kv_heads
        scale_log2 = f32(scale * LOG2E)
        if section is None:  # a window walks few tiles per key block, as causal: the L2-section order
            section = section_pairs(nq, d, group, q.element_size(), causal or (bits != 0 and _windowed(variants)),
                                    deterministic)
        self.section = section = min(section, kv_heads * batch)
        # The rotated walk: atomic mode at d = 64 / 128 (the d = 256 layout walks unrotated).
        self.rotate = rotate = (False if deterministic or d == 256
                                else bool(ROTATE[(d, bool(causal))] if rotate is None else rotate))

        self.pre = LaunchPlan(
            load(sm80.FAMILY_NAME, preprocess_expr(d, bf16), device),
            (nq_pad // _PRE_ROWS, heads, batch), (128,),
            (0, 0, 0, 0, 0, 0, *_strides(out), *_strides(dout), i32(nq), i32(heads), i32(nq_pad)),
            dynamic=range(6),
        )

        self.operands = _TmaOperands((q, k, v, dout, dk, dv), config.block_m)
        self.copy, (self.copy_dk, self.copy_dv) = self.operands.copy[:4], self.operands.copy[4:]
        maps = self.operands.encode(self.operands.stage((q, k, v, dout, dk, dv)))
        args = (*maps, 0, 0, 0, 0, i32(heads), i32(group), i32(batch), i32(section), i32(nq), i32(nk), i32(nq_pad),
                scale_log2, f32(scale), i32(rotate))
        dynamic = tuple(range(10))
        if bits:  # VARIANT_PARAMS after the plain ones; the alibi pointer, seed, offset and rng state are per call
            from .attention_fwd_sm80 import VARIANT_DYNAMIC

            dynamic += tuple(len(args) + i for i in VARIANT_DYNAMIC)
            args += variants.kernel_args(scale)
        expr = (variant_expression(d, config, bf16, bits, deterministic) if bits
                else expression(d, config, causal, bf16, deterministic))
        # Deterministic, windowed: each query tile's turn counter starts at its first visiting key
        # block (window_first_blocks), copied from this template instead of zeroed per call.
        self.sem_init = None
        if deterministic and bits and variants.window_left != _unbounded():
            first = torch.tensor(window_first_blocks(nq, nk, variants.window_left, config.block_m, block_n_of(d)),
                                 dtype=torch.int32, device=q.device)
            if d == 256:  # one counter per role's half of dQ: [.., m, 2]
                first = first.repeat_interleave(2)
            self.sem_init = first.repeat(batch * heads)
            _GRAPH_READ_TEMPLATES.append(self.sem_init)  # see _GRAPH_READ_TEMPLATES
        self.main = LaunchPlan(load(FAMILY_NAME, expr, device), (n_blocks * kv_heads * batch,), (THREADS,), args,
                               smem=config.smem_bytes(d, deterministic), dynamic=dynamic)
        self.convert = LaunchPlan(
            load(sm80.FAMILY_NAME, convert_expr(d, bf16), device),
            (-(-nq // _CONVERT_ROWS), heads, batch), (128,),
            (0, 0, *_strides(dq), i32(nq), i32(heads), i32(nq_pad), f32(scale)),
            dynamic=range(2),
        )

    def launch(self, q, k, v, out, lse, dout, dq, dk, dv, *variant_values, events=None) -> None:
        """The three launches (see the class). `variant_values` (plans with variants): the ALiBi
        slopes' pointer, the dropout seed and offset (as attention_bwd_sm80's variant plans take
        them; ignored when no variant kernel runs). `events`: four torch.cuda.Events recorded before
        the preprocess, between the launches and after the convert (benchmark()'s breakdown)."""
        if self.empty:
            _zero_gradients(dq, dk, dv)
            return
        ws = torch.empty(self.ws_elems, dtype=torch.float32, device=self.device)
        sem = None
        if self.deterministic:
            sem = (self.sem_init.clone() if self.sem_init is not None
                   else torch.zeros(self.sem_elems, dtype=torch.int32, device=self.device))
        lse2 = ws.data_ptr()
        delta = lse2 + self._delta_offset
        acc = lse2 + self._acc_offset
        staged = self.operands.stage((q, k, v, dout, dk, dv))
        maps = self.operands.encode(staged)
        if events is not None:
            events[0].record()
        self.pre.launch(out.data_ptr(), dout.data_ptr(), lse.data_ptr(), lse2, delta, acc)
        if events is not None:
            events[1].record()
        self.main.launch(*maps, lse2, delta, acc, 0 if sem is None else sem.data_ptr(),
                         *(variant_values if self.variant_values else ()))
        if events is not None:
            events[2].record()
        self.convert.launch(acc, dq.data_ptr())
        if events is not None:
            events[3].record()
        self.operands.finish(dk, dv, staged)
        # ws and sem return to torch's caching allocator here; their blocks are reused only by work
        # enqueued later on this stream, which runs after these kernels.

    def host_launches(self):
        """((LaunchPlan, slots) x 3, workspace fp32 elements, semaphore int32 elements) for
        runtime.host_launch, which then runs `launch` in C++; None for a plan it cannot run: no work,
        a copied operand, a variant kernel's per-call values (windowed deterministic plans copy a
        semaphore template: variants too)."""
        from ..runtime import host_launch as hl

        if self.empty or self.variant_values or any(self.operands.copy):
            return None
        lse2, delta, acc = (hl.WORKSPACE, 0), (hl.WORKSPACE, self._delta_offset), (hl.WORKSPACE, self._acc_offset)
        maps = [(hl.TENSOR_MAP, param, source, template.encode)
                for param, source, template in zip(self.main.dynamic[:6], (hl.Q, hl.K, hl.V, hl.DOUT, hl.DK, hl.DV),
                                                   self.operands.templates, strict=True)]
        semaphores = hl.SEMAPHORES if self.deterministic else hl.NULL
        main = maps + hl.pointer_slots(self.main.dynamic[6:], (lse2, delta, acc, semaphores))
        return (((self.pre, hl.pointer_slots(self.pre.dynamic, (hl.OUT, hl.DOUT, hl.LSE, lse2, delta, acc))),
                 (self.main, main),
                 (self.convert, hl.pointer_slots(self.convert.dynamic, (acc, hl.DQ)))),
                self.ws_elems, self.sem_elems if self.deterministic else 0)


def _unbounded() -> int:
    from ..dropout import UNBOUNDED

    return UNBOUNDED


def _windowed(variants) -> bool:
    return variants.window_left != _unbounded() or variants.window_right != _unbounded()


def variant_backward_plan(q, k, v, out, lse, dout, dq, dk, dv, *, scale: float, deterministic: bool, variants,
                          config: Sm90BwdConfig | None = None, split_masked: bool = False) -> BackwardPlan:
    """A BackwardPlan with variants for these (already validated) tensors: the same call as
    attention_bwd_sm80.backward_plan(..., causal=False, variants=variants) without `causal` (folded
    into variants' window). `.launch(q, k, v, out, lse, dout, dq, dk, dv, alibi pointer, seed,
    offset)`. Tensors as BackwardPlan; lse [B, H, Nq] fp32 the variant forward's (natural log of
    the transformed logits, -inf for rows whose window holds no key: their gradients come out 0).
    Raises ValueError where supports_variants(d, dtype, variants, deterministic) is False, and
    what BackwardPlan raises."""
    return BackwardPlan(q, k, v, out, lse, dout, dq, dk, dv, causal=False, scale=float(scale),
                        deterministic=bool(deterministic), config=config or VARIANT_DEFAULTS.get(q.shape[3]),
                        variants=variants, split_masked=split_masked)


def backward_plan(q, k, v, out, lse, dout, dq, dk, dv, *, causal: bool, scale: float, deterministic: bool,
                  config: Sm90BwdConfig | None = None) -> BackwardPlan:
    """A BackwardPlan for these (already validated) tensors; the same call as
    attention_bwd_sm80.backward_plan."""
    return BackwardPlan(q, k, v, out, lse, dout, dq, dk, dv, causal=bool(causal), scale=float(scale),
                        deterministic=bool(deterministic), config=config)


class BackwardVarlenPlan:
    """The three launches of one packed variable-length Hopper backward, the same constructor and
    `launch` as attention_bwd_sm80.BackwardVarlenPlan (atomic mode): q, out, dout, dq [Tq, H, d];
    k, v, dk, dv [Tk, Hkv, d]; lse [H, Tq] fp32 contiguous (natural log, -inf for fully masked
    rows: as the varlen forward writes it); B = len(cu_seqlens_q) - 1 sequences (cu_seqlens int32
    [B + 1] on the device, passed to `launch`) whose longest has max_seqlen_q queries and
    max_seqlen_k keys; causal aligned bottom-right per sequence. One 16-bit dtype, d in HEAD_DIMS,
    a contiguous last dim and 16-byte aligned rows (tileattn.api_varlen validated the arguments).

    Launches: attention_bwd_sm80's varlen preprocess (its workspace layout: lse2, delta and the fp32
    dQ accumulator as [H, ws_pitch] rows, ws_pitch = roundup(Tq, 4) + VARLEN_WS_GAP B), this
    family's varlen main kernel (one CTA per (128 keys, kv head, sequence) over max_seqlen_k, plus
    Hkv CTAs zeroing the dK / dV rows past the last sequence), the sm80 varlen convert (which
    zeroes the dQ rows past the last sequence). `launch` writes dq, dk, dv completely: a sequence
    with keys but no queries gets dK = dV = 0, fully masked query rows dQ = 0. Rows of q / dout
    / k / v past a sequence's end are read by TMA but zeroed in shared memory before use, so
    they never contribute, whatever they hold; dK / dV edge boxes are stored row by row, so no
    neighbouring sequence's rows are written.

    `variants` (attention_fwd_sm80.VariantArgs, causal folded into the window, so causal False; the
    sets supports_varlen_variants accepts: dropout only with a window or none): the varlen variant
    kernel of variant_bits(variants) at VARIANT_DEFAULTS' tile, lse the variant forward's; `launch`
    then takes the ALiBi slopes' pointer, the dropout seed, offset and rng state pointer after
    cu_seqlens_k (as attention_bwd_sm80's varlen variant plans take them; the forward's values, so the
    mask is the forward's).

    Raises ValueError for deterministic=True (use attention_bwd_sm80.backward_varlen_plan), an
    unsupported head dim or dtype, H not a multiple of Hkv, a grid of 2^31 blocks or more, a config
    whose shared memory does not fit, section < 1, or variants supports_varlen_variants rejects (or
    with causal=True).
    """

    def __init__(self, q, k, v, out, lse, dout, dq, dk, dv, cu_seqlens_q, max_seqlen_q: int, max_seqlen_k: int, *,
                 causal: bool, scale: float, deterministic: bool = False, config: Sm90BwdConfig | None = None,
                 section: int | None = None, rotate: bool | None = None, variants=None):
        from ..runtime import LaunchPlan
        from . import attention_bwd_sm80 as sm80
        from . import load

        total_q, heads, d = q.shape
        total_k, kv_heads = k.shape[0], k.shape[1]
        batch = cu_seqlens_q.shape[0] - 1
        if deterministic:
            raise ValueError("the sm90 varlen backward has no deterministic mode; use "
                             "attention_bwd_sm80.backward_varlen_plan for deterministic=True")
        if not supports_varlen(d, q.dtype, causal, deterministic):
            raise ValueError(f"the sm90 varlen backward supports head_dim in {VARLEN_HEAD_DIMS} and float16/bfloat16, "
                             f"got head_dim {d} and {q.dtype}")
        if kv_heads < 1 or heads % kv_heads:
            raise ValueError(f"q heads ({heads}) must be a multiple of k/v heads ({kv_heads})")
        if section is not None and section < 1:
            raise ValueError(f"section must be >= 1, got {section}")
        bits = 0
        if variants is not None:
            if causal or not supports_varlen_variants(d, q.dtype, variants):
                raise ValueError(f"the sm90 varlen backward does not run {variants} at head_dim {d}, {q.dtype}, "
                                 f"causal={bool(causal)} (see supports_varlen_variants; causal folds into the window)")
            bits = variant_bits(variants)
        self.variant_values = bool(bits)
        self.config = config = config or (VARIANT_DEFAULTS[d] if bits else VARLEN_DEFAULTS[(d, bool(causal))])
        if not config.fits(d, False):
            raise ValueError(f"config {config} does not fit in shared memory at head_dim {d}")
        # The grid covers the longest sequence's key blocks (at least one: CTAs past a sequence's
        # keys exit), then Hkv tail CTAs.
        n_blocks = max(1, -(-int(max_seqlen_k) // BLOCK_N))
        self.grid = n_blocks * kv_heads * batch + kv_heads
        if self.grid > MAX_GRID_X:
            raise ValueError(f"sequences x k/v heads x ceil(max_seqlen_k / {BLOCK_N}) must be < {MAX_GRID_X} blocks")
        bf16 = q.dtype == torch.bfloat16
        device = q.device.index
        self.device = q.device
        self.deterministic = False
        # Nothing to launch: no query token (dK = dV = 0), no key token (dQ = 0), or no head.
        self.empty = min(total_q, total_k, heads, batch) == 0
        if self.empty:
            return
        self.ws_pitch = ws_pitch = -(-total_q // 4) * 4 + sm80.VARLEN_WS_GAP * batch
        rows = heads * ws_pitch
        # One fp32 workspace: lse2 [H, ws_pitch], delta [H, ws_pitch], the fragment-order dQ
        # accumulator (the same rows times d), laid out by the sm80 varlen preprocess.
        self.ws_elems = 2 * rows + rows * d
        self._delta_offset, self._acc_offset = rows * 4, 2 * rows * 4  # bytes into the workspace
        i32, i64, f32 = np.int32, np.int64, np.float32
        group = heads // kv_heads
        scale_log2 = f32(scale * LOG2E)
        if section is None:  # a window walks few tiles per key block, as causal: the L2-section order
            section = section_pairs(max(int(max_seqlen_q), 1), d, group, q.element_size(),
                                    causal or (bits != 0 and _windowed(variants)), False)
        self.section = section = min(section, kv_heads * batch)
        self.rotate = rotate = bool(ROTATE[(d, bool(causal))] if rotate is None else rotate)

        def strides(t):  # [T, H, d]: (head stride, token stride), as the sm80 varlen kernels take them
            return i64(t.stride(1)), i64(t.stride(0))

        q_pad = -(-max(int(max_seqlen_q), 1) // _ROW_PAD) * _ROW_PAD
        self.pre = LaunchPlan(
            load(sm80.FAMILY_NAME, preprocess_expr(d, bf16, True), device),
            (q_pad // _PRE_ROWS, heads, batch + 1), (128,),
            (0, 0, 0, 0, 0, 0, *strides(out), *strides(dout), 0, i32(total_q), i32(ws_pitch)),
            dynamic=(0, 1, 2, 3, 4, 5, 10),
        )
        self.operands = _TmaOperands((q, k, v, dout, dk, dv), config.block_m, _varlen_view)
        staged = self.operands.stage((q, k, v, dout, dk, dv))
        maps = self.operands.encode(staged)
        dk_sr, dk_sh = staged[4].stride()[:2]
        dv_sr, dv_sh = staged[5].stride()[:2]
        args = (*maps, 0, 0, 0, 0, 0, 0, 0, i64(dk_sh), i64(dk_sr), i64(dv_sh), i64(dv_sr), i32(heads), i32(group),
                i32(batch), i32(section), i32(n_blocks * BLOCK_N), i32(total_k), i32(ws_pitch), scale_log2, f32(scale),
                i32(rotate))
        dynamic = tuple(range(13))
        if bits:  # VARIANT_PARAMS after the varlen ones; the alibi pointer, seed, offset and rng state are per call
            from .attention_fwd_sm80 import VARIANT_DYNAMIC

            dynamic += tuple(len(args) + i for i in VARIANT_DYNAMIC)
            args += variants.kernel_args(scale)
        expr = varlen_variant_expression(d, config, bf16, bits) if bits else varlen_expression(d, config, causal, bf16)
        self.main = LaunchPlan(load(FAMILY_NAME, expr, device), (self.grid,), (THREADS,), args,
                               smem=config.smem_bytes(d, False), dynamic=dynamic)
        self.convert = LaunchPlan(
            load(sm80.FAMILY_NAME, convert_expr(d, bf16, True), device),
            (max(1, -(-int(max_seqlen_q) // _CONVERT_ROWS)), heads, batch + 1), (128,),
            (0, 0, *strides(dq), 0, i32(total_q), i32(ws_pitch), f32(scale)),
            dynamic=(0, 1, 4),
        )

    def launch(self, q, k, v, out, lse, dout, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, *variant_values) -> None:
        """The three launches (see the class) on torch's current stream; nothing synchronizes.
        `variant_values` (plans with variants): the ALiBi slopes' pointer, seed, offset, rng state
        pointer (ignored by a plan without variants)."""
        if self.empty:
            _zero_gradients(dq, dk, dv)
            return
        ws = torch.empty(self.ws_elems, dtype=torch.float32, device=self.device)
        lse2 = ws.data_ptr()
        delta = lse2 + self._delta_offset
        acc = lse2 + self._acc_offset
        cu_q, cu_k = cu_seqlens_q.data_ptr(), cu_seqlens_k.data_ptr()
        staged = self.operands.stage((q, k, v, dout, dk, dv))
        maps = self.operands.encode(staged)
        self.pre.launch(out.data_ptr(), dout.data_ptr(), lse.data_ptr(), lse2, delta, acc, cu_q)
        self.main.launch(*maps, lse2, delta, acc, cu_q, cu_k, staged[4].data_ptr(), staged[5].data_ptr(),
                         *(variant_values if self.variant_values else ()))
        self.convert.launch(acc, dq.data_ptr(), cu_q)
        self.operands.finish(dk, dv, staged)
        # ws returns to torch's caching allocator here; its block is reused only by work enqueued
        # later on this stream, which runs after these kernels.


def backward_varlen_plan(q, k, v, out, lse, dout, dq, dk, dv, cu_seqlens_q, max_seqlen_q: int, max_seqlen_k: int, *,
                         causal: bool, scale: float, deterministic: bool, config: Sm90BwdConfig | None = None,
                         variants=None) -> BackwardVarlenPlan:
    """A BackwardVarlenPlan for these (already validated) tensors; the same call as
    attention_bwd_sm80.backward_varlen_plan (`variants`: the sets supports_varlen_variants accepts).
    Raises ValueError for deterministic=True (see supports_varlen) and what BackwardVarlenPlan raises."""
    return BackwardVarlenPlan(q, k, v, out, lse, dout, dq, dk, dv, cu_seqlens_q, int(max_seqlen_q),
                              int(max_seqlen_k), causal=bool(causal), scale=float(scale),
                              deterministic=bool(deterministic), config=config, variants=variants)


# Columns of benchmark(): name -> what it times (every one through bench.harness.measure, the timer
# of `tileattn bench attention`: L2 flushed before each repetition, repetitions enqueued back to back).
COLUMNS = {
    "sm90": "this plan's three launches, the dispatched defaults (DEFAULTS, ROTATE)",
    "sm90_rot": "the same with the rotated walk",
    "sm90_bulk": "dQ by the staged bulk reduce-add (kDqMode 2) instead of REDs",
    "sm90_bulk_rot": "kDqMode 2 with the rotated walk",
    "sm90_tune": "the atomic mode's other tuning candidates, one column each: sm90[config]",
    "sm90_l2": "non-causal only: the L2-section block order causal runs use",
    "sm90_det": "deterministic mode",
    "sm80": "the sm80 backward (atomic dQ)",
    "sm80_det": "the sm80 backward, deterministic",
    "autograd": "tileattn.attention's forward once, then torch.autograd.grad: what `tileattn bench attention "
                "--backward-only` times (dispatcher, plan cache, gradient allocation)",
    "cudnn": "SDPA cuDNN's backward through torch.autograd.grad, as `tileattn bench attention` times it",
}


def _measure_ms(fn, reps: int, max_seconds: float = 2.0) -> float:
    """Median milliseconds of fn() by bench.harness.measure (two warm-ups, L2 flushed before each
    timed repetition, no host sync between repetitions), fewer repetitions (at least 3) where `reps`
    would take over max_seconds (N = 32768 backward passes take 0.3-1 s each)."""
    from ..bench.harness import measure

    return measure(fn, warmup=2, reps=reps, memory=False, max_seconds=max_seconds).median_ms


def _breakdown_ms(plan: "BackwardPlan", args, reps: int) -> tuple[float, float, float]:
    """Median ms of the preprocess, main and convert launches of one plan.launch, from events recorded
    between them (L2 flushed before each call; the sum is the plan's device time without the gaps
    between calls)."""
    from ..bench.harness import _flush_l2

    marks = [tuple(torch.cuda.Event(enable_timing=True) for _ in range(4)) for _ in range(max(3, reps))]
    for events in marks:
        _flush_l2()
        plan.launch(*args, events=events)
    torch.cuda.synchronize()
    return tuple(sorted(e[i].elapsed_time(e[i + 1]) for e in marks)[len(marks) // 2] for i in range(3))


def _bench_case(d: int, dtype, causal: bool, n: int, batch: int, heads: int, reps: int, columns) -> dict:
    """One benchmark() record (its tensors are freed on return)."""
    import functools
    import math

    from torch.nn.attention import SDPBackend, sdpa_kernel

    import tileattn

    from ..bench.attention import flops
    from . import attention_bwd_sm80, dispatch

    q, k, v, dout = (torch.randn(batch, heads, n, d, device="cuda", dtype=dtype) for _ in range(4))
    scale = 1.0 / math.sqrt(d)
    out = torch.empty_like(q)
    lse = torch.empty(batch, heads, n, device="cuda", dtype=torch.float32)
    dispatch.attention_forward_plan(q, k, v, out, lse, causal=causal, scale=scale).launch(q, k, v, out, lse)
    grads = tuple(torch.empty_like(t) for t in (q, k, v))
    args = (q, k, v, out, lse, dout, *grads)
    rec = {"suite": "bwd_sm90", "d": d, "dtype": str(dtype).split(".")[-1], "causal": causal, "n": n,
           "batch": batch, "heads": heads}
    work = flops(batch, heads, n, n, d, causal, backward=True)
    default = DEFAULTS[(d, bool(causal))]
    bulk = Sm90BwdConfig(default.block_m, default.stages, True)
    kw = {"causal": causal, "scale": scale}
    makers = {
        "sm90": lambda: BackwardPlan(*args, **kw, deterministic=False),
        "sm90_rot": lambda: BackwardPlan(*args, **kw, deterministic=False, rotate=True),
        "sm90_bulk": lambda: BackwardPlan(*args, **kw, deterministic=False, config=bulk, rotate=False),
        "sm90_bulk_rot": lambda: BackwardPlan(*args, **kw, deterministic=False, config=bulk, rotate=True),
        "sm90_det": lambda: BackwardPlan(*args, **kw, deterministic=True),
        "sm80": lambda: attention_bwd_sm80.backward_plan(*args, **kw, deterministic=False),
        "sm80_det": lambda: attention_bwd_sm80.backward_plan(*args, **kw, deterministic=True),
    }
    if "sm90_tune" in columns:  # e.g. "sm90[64x128/s3]"; the bulk candidate has its own column
        for cfg in tuning_candidates(d, causal)[1:]:
            if cfg != bulk:
                makers[f"sm90[{cfg}]"] = lambda cfg=cfg: BackwardPlan(*args, **kw, deterministic=False, config=cfg)
    if not causal:  # the block order causal / deterministic runs use, measured on equal-length CTAs
        l2 = section_pairs(n, d, 1, q.element_size(), True, False)
        makers["sm90_l2"] = lambda: BackwardPlan(*args, **kw, deterministic=False, section=l2)
        rec["section_l2"] = l2
    for name, make in makers.items():
        if name not in columns and not name.startswith("sm90["):
            continue
        plan = make()
        if name == "sm90":
            rec["section"], rec["rotate"] = plan.section, plan.rotate
            rec["pre_ms"], rec["main_ms"], rec["convert_ms"] = _breakdown_ms(plan, args, reps)
        ms = _measure_ms(functools.partial(plan.launch, *args), reps)
        rec[name], rec[name + "_ms"] = work / (ms * 1e-3) / 1e12, ms
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    if "autograd" in columns:
        o = tileattn.attention(qg, kg, vg, causal=causal)
        ms = _measure_ms(lambda: torch.autograd.grad(o, (qg, kg, vg), dout, retain_graph=True), reps)
        rec["autograd"], rec["autograd_ms"] = work / (ms * 1e-3) / 1e12, ms
        del o
    if "cudnn" in columns:
        try:
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                o = torch.nn.functional.scaled_dot_product_attention(qg, kg, vg, is_causal=causal)
            ms = _measure_ms(lambda: torch.autograd.grad(o, (qg, kg, vg), dout, retain_graph=True), reps)
            rec["cudnn"], rec["cudnn_ms"] = work / (ms * 1e-3) / 1e12, ms
        except RuntimeError as exc:  # cuDNN not available for this case
            rec["cudnn"] = float("nan")
            rec["cudnn_error"] = str(exc).splitlines()[0]
    for name in [key for key in rec if key.startswith(("sm90", "autograd")) and not key.endswith("_ms")
                 and key not in ("sm90_det",) and isinstance(rec[key], float)]:
        if "cudnn" in rec:
            rec[f"{name}_vs_cudnn"] = rec[name] / rec["cudnn"]
    if "sm90_det" in rec and "sm90" in rec:
        rec["det_vs_atomic"] = rec["sm90_det"] / rec["sm90"]
    return rec


def _keep(rec: dict, records: list, json_path: str | None, line: str | None = None) -> None:
    """One benchmark record: print `line` (default: key=value, floats to 3 places), append rec to
    records and, with json_path, rewrite it with {"environment", "records"} so that a run cut short
    keeps what it measured; then free the allocator's cached blocks for the next case."""
    import json

    from ..bench.env import environment

    print(line or " ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in rec.items()),
          flush=True)
    records.append(rec)
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"environment": environment(), "records": records}, f, indent=1)
    torch.cuda.empty_cache()


def benchmark(seq_lens=(2048, 4096, 8192, 16384, 32768), head_dims=HEAD_DIMS,
              dtypes=(torch.bfloat16, torch.float16), causals=(False, True), batch: int = 4, heads: int = 32,
              reps: int = 10, json_path: str | None = None, columns=tuple(COLUMNS)) -> list[dict]:
    """Backward-only TFLOP/s (bench.attention.flops' convention) and median ms of the COLUMNS named in `columns`
    (default all) on the same inputs [batch, heads, N, d], every one timed by bench.harness.measure
    like `tileattn bench attention` (so `<column>_vs_cudnn` here and the ratios of that benchmark mean
    the same), plus pre_ms / main_ms / convert_ms: the dispatched plan's three launches. Prints one
    line per case and returns the records; with json_path also writes {"environment", "records"}
    there after every case (the docs/runs/ format). Needs an sm_90 GPU; raises ValueError for an
    unknown column. Out and lse come from one forward launch (tileattn's dispatcher) per case."""

    unknown = set(columns) - set(COLUMNS)
    if unknown:
        raise ValueError(f"unknown benchmark columns {sorted(unknown)}; known: {sorted(COLUMNS)}")
    records = []
    for d in head_dims:
        for dtype in dtypes:
            for causal in causals:
                for n in seq_lens:
                    rec = _bench_case(d, dtype, causal, n, batch, heads, reps, set(columns))
                    _keep(rec, records, json_path, " ".join(
                        f"{key}={val:.3f}" if key.endswith("_ms") or "_vs_" in key or key.startswith("det_")
                        else f"{key}={val:.1f}" if isinstance(val, float) else f"{key}={val}"
                        for key, val in rec.items()))
    return records


# Columns of benchmark_varlen(): name -> what it times (backward only, bench.harness.measure).
VARLEN_COLUMNS = {
    "sm90_varlen": "BackwardVarlenPlan, the defaults (DEFAULTS, ROTATE)",
    "sm90_varlen_rot": "the same with the rotated walk",
    "sm90_varlen_bulk": "dQ by the staged bulk reduce-add (kDqMode 2)",
    "sm80_varlen": "attention_bwd_sm80's varlen backward (what tileattn.attention_varlen runs today)",
    "sm90_dense": "BackwardPlan on a dense batch of the same work (bench.varlen.dense_equivalent)",
}


def _varlen_columns(lengths, heads, kv_heads, head_dim, dtype, causal, reps, seed) -> dict:
    """benchmark_varlen()'s packed-batch columns (their tensors are freed on return)."""
    import math

    from ..api_varlen import attention_varlen
    from ..bench.varlen import pairs
    from . import attention_bwd_sm80

    cu = torch.tensor([0, *np.cumsum(lengths).tolist()], dtype=torch.int32, device="cuda")
    total, longest = sum(lengths), max(lengths)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(total, heads, head_dim, device="cuda", generator=gen).to(dtype)  # [Tq, H, d]
    k = torch.randn(total, kv_heads, head_dim, device="cuda", generator=gen).to(dtype)  # [Tk, Hkv, d]
    v = torch.randn(total, kv_heads, head_dim, device="cuda", generator=gen).to(dtype)
    dout = torch.randn_like(q)
    out, lse = attention_varlen(q, k, v, cu, cu, longest, longest, causal=causal, return_lse=True)
    args = (q, k, v, out, lse, dout, *(torch.empty_like(t) for t in (q, k, v)), cu)
    work = 2.5 * 4.0 * head_dim * heads * sum(pairs(n, causal) for n in lengths)
    kw = {"causal": causal, "scale": 1.0 / math.sqrt(head_dim)}
    default = VARLEN_DEFAULTS[(head_dim, bool(causal))]
    bulk = Sm90BwdConfig(default.block_m, default.stages, True)
    makers = {
        "sm90_varlen": lambda: BackwardVarlenPlan(*args, longest, longest, **kw),
        "sm90_varlen_rot": lambda: BackwardVarlenPlan(*args, longest, longest, **kw, rotate=True),
        "sm90_varlen_bulk": lambda: BackwardVarlenPlan(*args, longest, longest, **kw, config=bulk),
        "sm80_varlen": lambda: attention_bwd_sm80.backward_varlen_plan(*args, longest, longest, **kw,
                                                                       deterministic=False),
    }
    rec = {"tokens": total, "max_len": longest}
    for name, make in makers.items():
        plan = make()
        ms = _measure_ms(lambda plan=plan: plan.launch(*args, cu), reps)
        rec[name], rec[name + "_ms"] = work / (ms * 1e-3) / 1e12, ms
    return rec


def _dense_column(lengths, heads, kv_heads, head_dim, dtype, causal, reps, seed) -> dict:
    """benchmark_varlen()'s sm90_dense column: BackwardPlan on bench.varlen.dense_equivalent's batch."""
    import math

    from ..bench.varlen import dense_equivalent, pairs
    from . import dispatch

    batch, n = dense_equivalent(lengths, causal)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v, dout = (torch.randn(batch, h, n, head_dim, device="cuda", generator=gen).to(dtype)
                     for h in (heads, kv_heads, kv_heads, heads))  # [B', H or Hkv, N, d]
    scale = 1.0 / math.sqrt(head_dim)
    out = torch.empty_like(q)
    lse = torch.empty(batch, heads, n, device="cuda", dtype=torch.float32)
    dispatch.attention_forward_plan(q, k, v, out, lse, causal=causal, scale=scale).launch(q, k, v, out, lse)
    args = (q, k, v, out, lse, dout, *(torch.empty_like(t) for t in (q, k, v)))
    plan = BackwardPlan(*args, causal=causal, scale=scale, deterministic=False)
    ms = _measure_ms(lambda: plan.launch(*args), reps)
    work = 2.5 * 4.0 * head_dim * heads * batch * pairs(n, causal)
    return {"dense_b": batch, "dense_n": n, "sm90_dense": work / (ms * 1e-3) / 1e12, "sm90_dense_ms": ms}


def benchmark_varlen(seqs: int = 64, min_len: int = 100, max_len: int = 4096, heads: int = 32, kv_heads: int = 32,
                     head_dim: int = 128, dtypes=(torch.bfloat16,), causals=(True, False), reps: int = 10,
                     seed: int = 0, json_path: str | None = None) -> list[dict]:
    """Backward-only TFLOP/s (useful FLOPs: 2.5 x 4 d H per visible (query, key) pair) of the
    VARLEN_COLUMNS on issue #10's workload (`seqs` lengths uniform in [min_len, max_len], drawn as
    `tileattn bench varlen` draws them; Nq = Nk per sequence), and `sm90_varlen_vs_dense` /
    `sm90_varlen_vs_sm80`: the ratios the dispatch decision needs. out / lse come from
    tileattn.attention_varlen (varlen) and the dispatcher's forward plan (dense). One record per
    (dtype, causal), printed; with json_path, {"environment", "records"} rewritten after each. Needs
    an sm_90 GPU."""

    from ..bench.varlen import draw_lengths

    lengths = draw_lengths(seqs, min_len, max_len, seed)
    records = []
    for dtype in dtypes:
        for causal in causals:
            rec = {"suite": "bwd_sm90_varlen", "seqs": seqs, "h": heads, "hkv": kv_heads, "d": head_dim,
                   "dtype": str(dtype).removeprefix("torch."), "causal": causal}
            rec.update(_varlen_columns(lengths, heads, kv_heads, head_dim, dtype, causal, reps, seed))
            torch.cuda.empty_cache()
            rec.update(_dense_column(lengths, heads, kv_heads, head_dim, dtype, causal, reps, seed))
            torch.cuda.empty_cache()
            rec["sm90_varlen_vs_dense"] = rec["sm90_varlen"] / rec["sm90_dense"]
            rec["sm90_varlen_vs_sm80"] = rec["sm90_varlen"] / rec["sm80_varlen"]
            _keep(rec, records, json_path)
    return records


# Cases of benchmark_variants(): name -> (causal, window (left, right) or None, softcap, alibi).
VARIANT_BENCH_CASES = {
    "softcap": (False, None, 30.0, False),
    "softcap_causal": (True, None, 30.0, False),
    "alibi": (False, None, 0.0, True),
    "alibi_causal": (True, None, 0.0, True),
}


def _variant_case_ms(d: int, dtype, n: int, batch: int, heads: int, causal: bool, window, cap: float, alibi: bool,
                     reps: int) -> dict:
    """Median backward-only ms of one variant case: this family's variant plan, the plain sm90 plan on
    the same shape (causal as the case), the sm80 variant backward, and the two variant backwards in
    deterministic mode (`_det`). out / lse from the dispatcher's variant forward (the Hopper one on
    sm_90a). Tensors are freed on return."""
    import functools
    import math

    from .. import dropout as dr
    from . import attention_bwd_sm80, dispatch
    from .attention_fwd_sm80 import VariantArgs

    q, k, v, dout = (torch.randn(batch, heads, n, d, device="cuda", dtype=dtype) for _ in range(4))  # [B, H, N, d]
    scale = 1.0 / math.sqrt(d)
    slopes = (torch.tensor([2.0 ** (-8.0 * (i + 1) / heads) for i in range(heads)], device="cuda")
              if alibi else None)  # [H] fp32
    left, right = dr.check_window(window, causal)
    va = VariantArgs(left, right, cap, 0 if alibi else None, 0.0)
    extra = (0 if slopes is None else slopes.data_ptr(), 0, 0, 0)
    out, lse = torch.empty_like(q), torch.empty(batch, heads, n, device="cuda", dtype=torch.float32)
    dispatch.variant_forward_plan(q, k, v, out, lse, scale=scale, variants=va).launch(q, k, v, out, lse, *extra)
    grads = tuple(torch.empty_like(t) for t in (q, k, v))
    args = (q, k, v, out, lse, dout, *grads)
    plans = {}
    for suffix, det in (("", False), ("_det", True)):
        plans["sm90_var" + suffix] = variant_backward_plan(*args, scale=scale, deterministic=det, variants=va)
        plans["sm80_var" + suffix] = attention_bwd_sm80.backward_plan(*args, causal=False, scale=scale,
                                                                      deterministic=det, variants=va)
    rec = {name: _measure_ms(functools.partial(plan.launch, *args, *extra), reps) for name, plan in plans.items()}
    plain_out, plain_lse = torch.empty_like(q), torch.empty_like(lse)
    dispatch.attention_forward_plan(q, k, v, plain_out, plain_lse, causal=causal, scale=scale).launch(
        q, k, v, plain_out, plain_lse)
    plain_args = (q, k, v, plain_out, plain_lse, dout, *grads)
    plain = BackwardPlan(*plain_args, causal=causal, scale=scale, deterministic=False)
    rec["sm90_plain"] = _measure_ms(functools.partial(plain.launch, *plain_args), reps)
    return rec


def benchmark_variants(head_dims=(128, 64), dtypes=(torch.bfloat16,), seq_lens=(2048, 8192), batch: int = 4,
                       heads: int = 32, window_n: int = 32768, window: int = 4096, reps: int = 10,
                       json_path: str | None = None) -> list[dict]:
    """Issue #15's backward targets on this family (backward only, bench.harness.measure, L2 flushed):
    per VARIANT_BENCH_CASES case, head dim, dtype and N, the variant plan's TFLOP/s (bench.attention.flops'
    convention) beside the plain sm90 plan on the same shape (target sm90_var_vs_plain >= 0.9) and
    the sm80 variant backward, each also in deterministic mode (`*_det` columns, ratios
    sm90_var_det_vs_sm80_var_det and sm90_var_det_vs_atomic); then the sliding window: a causal `window`-key window at N =
    `window_n` (batch 1) against the dense non-causal plain plan at N = window, batch window_n /
    window, the same work (target window_vs_dense <= 1.2). Prints one line per record and returns
    them; with json_path writes {"environment", "records"} after every record. Needs an sm_90 GPU."""
    from ..bench.attention import flops

    records = []
    for d in head_dims:
        for dtype in dtypes:
            for name, (causal, win, cap, alibi) in VARIANT_BENCH_CASES.items():
                for n in seq_lens:
                    ms = _variant_case_ms(d, dtype, n, batch, heads, causal, win, cap, alibi, reps)
                    work = flops(batch, heads, n, n, d, causal, backward=True)
                    rec = {"suite": "bwd_sm90_variants", "case": name, "d": d, "dtype": str(dtype).split(".")[-1],
                           "n": n, "batch": batch, "heads": heads}
                    for col, t in ms.items():
                        rec[col], rec[col + "_ms"] = work / (t * 1e-3) / 1e12, t
                    rec["sm90_var_vs_plain"] = rec["sm90_var"] / rec["sm90_plain"]
                    rec["sm90_var_vs_sm80_var"] = rec["sm90_var"] / rec["sm80_var"]
                    rec["sm90_var_det_vs_sm80_var_det"] = rec["sm90_var_det"] / rec["sm80_var_det"]
                    rec["sm90_var_det_vs_atomic"] = rec["sm90_var_det"] / rec["sm90_var"]
                    _keep(rec, records, json_path)
            win_ms = _variant_case_ms(d, dtype, window_n, 1, heads, True, (window - 1, 0), 0.0, False, reps)
            dense_ms = _variant_case_ms(d, dtype, window, window_n // window, heads, False, (-1, -1), 0.0, False,
                                        reps)
            _keep({"suite": "bwd_sm90_variants", "case": f"window{window}_n{window_n}", "d": d,
                  "dtype": str(dtype).split(".")[-1], "window_ms": win_ms["sm90_var"],
                  "window_sm80_ms": win_ms["sm80_var"], "window_det_ms": win_ms["sm90_var_det"],
                  "window_sm80_det_ms": win_ms["sm80_var_det"], "dense_ms": dense_ms["sm90_plain"],
                  "window_vs_dense": win_ms["sm90_var"] / dense_ms["sm90_plain"]}, records, json_path)
    return records


def benchmark_dropout(head_dims=(128, 64), seq_lens=(2048, 8192), p: float = 0.1, batch: int = 4, heads: int = 32,
                      reps: int = 10, json_path: str | None = None) -> list[dict]:
    """The Hopper dropout kernels against the sm80 dropout kernels (bf16, causal and not; every plan
    built directly, whatever the dispatch tables say): forward (attention_fwd_sm90's dropout bit vs
    the sm80 variant forward) and backward (this family's variant backward vs the sm80 one, atomic
    and deterministic), median ms by bench.harness.measure with L2 flushed. The numbers that
    dispatch.SM90_DROPOUT_FORWARD / SM90_DROPOUT_BACKWARD cite. Prints one line per record and
    returns them; with json_path writes {"environment", "records"} after every record. Needs sm_90."""
    import functools
    import math

    from .. import dropout as dr
    from ..bench.attention import flops
    from . import attention_bwd_sm80, attention_fwd_sm80, attention_fwd_sm90, dispatch

    records = []
    for d in head_dims:
        for n in seq_lens:
            for causal in (False, True):
                q, k, v, dout = (torch.randn(batch, heads, n, d, device="cuda", dtype=torch.bfloat16)
                                 for _ in range(4))  # [B, H, N, d]
                scale = 1.0 / math.sqrt(d)
                left, right = dr.check_window(None, causal)
                va = attention_fwd_sm80.VariantArgs(left, right, 0.0, None, p)
                extra = (0, 1234, 0, 0)  # no ALiBi; seed, offset; no device rng state
                out, lse = torch.empty_like(q), torch.empty(batch, heads, n, device="cuda", dtype=torch.float32)
                fwd = {"sm90": attention_fwd_sm90.ForwardPlan(q, k, v, out, lse, causal=False, scale=scale, variants=va),
                       "sm80": dispatch._VariantPointerPlan(attention_fwd_sm80.forward_plan(
                           q, k, v, out, lse, causal=False, scale=scale, variants=va))}
                ms = {f"fwd_{name}": _measure_ms(functools.partial(plan.launch, q, k, v, out, lse, *extra), reps)
                      for name, plan in fwd.items()}
                fwd["sm90"].launch(q, k, v, out, lse, *extra)
                args = (q, k, v, out, lse, dout, *(torch.empty_like(t) for t in (q, k, v)))
                for det in (False, True):
                    bwd = {"sm90": variant_backward_plan(*args, scale=scale, deterministic=det, variants=va),
                           "sm80": attention_bwd_sm80.backward_plan(*args, causal=False, scale=scale,
                                                                    deterministic=det, variants=va)}
                    for name, plan in bwd.items():
                        ms[f"bwd_{name}_det{int(det)}"] = _measure_ms(functools.partial(plan.launch, *args, *extra), reps)
                work = flops(batch, heads, n, n, d, causal, backward=True)  # backward convention; the forward's is work / 2.5
                rec = {"suite": "dropout_sm90_vs_sm80", "d": d, "n": n, "causal": causal, "p": p, "batch": batch,
                       "heads": heads, **{key + "_ms": t for key, t in ms.items()}}
                for key, t in ms.items():
                    rec[key + "_tflops"] = (work / 2.5 if key.startswith("fwd") else work) / (t * 1e-3) / 1e12
                del q, k, v, dout, out, lse, args, fwd
                _keep(rec, records, json_path)
    return records


def main(argv=None) -> None:
    """`python -m tileattn.kernels.attention_bwd_sm90 [--d 128] [--dtype bf16] [--causal 0|1] [--seq N ...]
    [--col NAME ...] [--batch 4] [--heads 32] [--json PATH]`: benchmark() on a subset (each option
    repeatable; --col picks columns, default all: """ + ", ".join(COLUMNS) + """)."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--d", type=int, action="append", choices=HEAD_DIMS)
    parser.add_argument("--dtype", action="append", choices=("bf16", "fp16"))
    parser.add_argument("--causal", type=int, action="append", choices=(0, 1))
    parser.add_argument("--seq", type=int, action="append")
    parser.add_argument("--col", action="append", choices=tuple(COLUMNS))
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--json")
    parser.add_argument("--varlen", action="store_true",
                        help="benchmark_varlen() instead: issue #10's 64 sequences of 100..4096 tokens, backward only")
    parser.add_argument("--variants", action="store_true",
                        help="benchmark_variants() instead: issue #15's softcap / ALiBi / sliding-window targets")
    parser.add_argument("--dropout", action="store_true",
                        help="benchmark_dropout() instead: the Hopper dropout forward/backward against the sm80 ones")
    a = parser.parse_args(argv)
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16}
    if a.variants:
        benchmark_variants(head_dims=tuple(a.d or (128, 64)), dtypes=tuple(dt[x] for x in (a.dtype or ("bf16",))),
                           seq_lens=tuple(a.seq or (2048, 8192)), batch=a.batch, heads=a.heads, reps=a.reps,
                           json_path=a.json)
        return
    if a.dropout:
        benchmark_dropout(head_dims=tuple(a.d or (128, 64)), seq_lens=tuple(a.seq or (2048, 8192)), batch=a.batch,
                          heads=a.heads, reps=a.reps, json_path=a.json)
        return
    if a.varlen:
        benchmark_varlen(head_dim=(a.d or [128])[0], dtypes=tuple(dt[x] for x in (a.dtype or ("bf16",))),
                         causals=tuple(bool(c) for c in (a.causal if a.causal is not None else (1, 0))),
                         heads=a.heads, reps=a.reps, json_path=a.json)
        return
    benchmark(seq_lens=tuple(a.seq or (2048, 4096, 8192, 16384, 32768)), head_dims=tuple(a.d or HEAD_DIMS),
              dtypes=tuple(dt[x] for x in (a.dtype or ("bf16", "fp16"))),
              causals=tuple(bool(c) for c in (a.causal if a.causal is not None else (0, 1))), batch=a.batch,
              heads=a.heads, reps=a.reps, json_path=a.json, columns=tuple(a.col or COLUMNS))


__all__ = [
    "BLOCK_N",
    "BLOCK_N_256",
    "VARLEN_HEAD_DIMS",
    "block_n_of",
    "COLUMNS",
    "DEFAULTS",
    "VARLEN_DEFAULTS",
    "FAMILIES",
    "FAMILY_NAME",
    "HEAD_DIMS",
    "INSTANTIATIONS",
    "ROTATE",
    "TUNING",
    "ALIBI",
    "BackwardPlan",
    "BackwardVarlenPlan",
    "SOFTCAP",
    "VARIANT_BENCH_CASES",
    "VARIANT_DEFAULTS",
    "VARIANT_INSTANTIATIONS",
    "SPLIT_MASKED",
    "SPLIT_MASKED_HEAD_DIMS",
    "SPLIT_MASKED_INSTANTIATIONS",
    "split_masked_applies",
    "VARIANT_SETS",
    "WINDOW",
    "Sm90BwdConfig",
    "VARLEN_COLUMNS",
    "backward_plan",
    "backward_varlen_plan",
    "benchmark",
    "benchmark_variants",
    "benchmark_varlen",
    "expression",
    "main",
    "section_pairs",
    "supports",
    "supports_variants",
    "supports_varlen",
    "tuning_candidates",
    "variant_backward_plan",
    "variant_bits",
    "variant_expression",
    "window_first_blocks",
    "varlen_expression",
]


if __name__ == "__main__":
    main()
