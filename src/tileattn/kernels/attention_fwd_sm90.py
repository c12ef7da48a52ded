"""Attention forward on Hopper (csrc/attention_fwd_sm90.cu): TMA + wgmma + warp specialization.

Same tensors and contract as attention_fwd_sm80.launch_forward: q [B, H, Nq, d], k/v
[B, Hkv, Nk, d], out [B, H, Nq, d] (one 16-bit dtype), lse [B, H, Nq] fp32 contiguous, natural
log. Every CTA has 128 query rows (two consumer warpgroups of 64; 192 with three, a config of the
plain dense kernel at d = 64 and 128, of ALiBi or softcap alone there and of the varlen kernel) and a producer
warpgroup; the config is the K/V block (kBlockN keys, the N of S = Q K^T), the depth of the K/V
rings and the consumer count.

GQA packing: with H / Hkv = G query heads per K/V head, a tile may hold G heads x 128 / G
positions instead of 128 positions of one head, so that each K/V block is read once for all G
heads. `gqa_pack` decides per call (packing when it leaves fewer padded query rows, e.g. decode);
`pack_gqa=True/False` forces it.

Q, K, V and O are read and written through 4-D TMA tensor maps over the tensors as they are
(d, N, heads, batch), so any strides the API accepts work without copies: TMA needs 16-byte
strides and a 16-byte aligned base, which the API's checks guarantee for every dimension longer
than 1 (tileattn.runtime.tensor_map gives size-1 dimensions valid strides itself). A tensor that
TMA still cannot describe (a zero stride from expand(), strides >= 2^40 bytes) is copied
contiguous first, and out is then written through a contiguous temporary.

Variants (issue #15; docs/attention_variants.md): window, softcap, ALiBi and dropout run in
instantiations of the same kernel with the variant parameters appended, one per (head dim, dtype,
set of variants) so that each set pays only for what it uses (`variant_flags`); ForwardPlan(variants=...)
takes attention_fwd_sm80.VariantArgs (causal folded into the window) and launches with the slopes'
pointer and the dropout seed and offset after the plain tensors. Dropout (the DROPOUT bit) applies
exactly tileattn.dropout.dropout_mask's mask, for the flag sets in DROPOUT_FLAG_SETS
(`supports_dropout`; docs/attention_fwd_sm90.md, "Dropout").

Variable-length batches (issue #10; docs/attention_fwd_sm90.md, "Variable-length batches"):
`forward_varlen_plan` runs the same kernel on packed q [Tq, H, d], k/v [Tk, Hkv, d] with
cu_seqlens (the kernel's kVariant = VARLEN instantiations), with the launch signature of
attention_fwd_sm80.forward_varlen_plan, so that tileattn.api_varlen can use either.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import lru_cache

import numpy as np
import torch

from . import Family

FAMILY_NAME = "attention_fwd_sm90"
SOURCE = "attention_fwd_sm90.cu"
HEAD_DIMS = (64, 128, 256)
BLOCK_M = 128           # query rows per CTA with the usual two consumer warpgroups x 64
PANEL = 64              # TMA box width in elements: 128 bytes, the 128-byte swizzle span
LOG2E = 1.4426950408889634
MAX_TILES = 2**30       # ceil(Nq / 128) * H * B; the kernel steps tile + gridDim.x in int32
SMEM_LIMIT = 232448     # bytes per block on an H100/H200 (227 KB opt-in)
TILE_COUNTER_ARG = 13   # the kernel's tile_counter parameter: after 4 tensor maps, lse and 8 scalars


@dataclass(frozen=True, order=True)
class Sm90Config:
    """block_n keys per K/V block (the wgmma N of S = Q K^T: 64, 80, 96, 128, 176, 192 or 256), ring stages,
    whether the two consumer warpgroups take turns issuing their GEMMs (ping-pong), and whether the
    grid is persistent (one CTA per SM walking the tiles; otherwise one CTA per tile), and the
    consumer warpgroups (2, or 3 without ping-pong: 192-row tiles; the plain dense and varlen kernels,
    ALiBi or softcap alone).
    `persistent` is a launch choice only: both grids run the same compiled kernel."""

    block_n: int
    stages: int
    pingpong: bool = False
    persistent: bool = False
    consumers: int = 2

    def __post_init__(self):
        if self.consumers not in (2, 3) or (self.consumers == 3 and self.pingpong):
            raise ValueError(f"Sm90Config: consumers must be 2, or 3 without ping-pong; got consumers={self.consumers}, "
                             f"pingpong={self.pingpong}")

    @property
    def block_m(self) -> int:
        """Query rows per tile: 64 per consumer warpgroup."""
        return 64 * self.consumers

    @property
    def threads(self) -> int:
        """Threads per CTA: the producer warpgroup and the consumers."""
        return 128 * (1 + self.consumers)

    def smem_bytes(self, head_dim: int) -> int:
        """Dynamic shared memory: Q tile + `stages` K and V blocks + 1 KB to align to 1024 B, plus an
        O staging tile of the Q tile's size where the total and the static mbarriers (< 256 B) stay
        within SMEM_LIMIT (the kernel's kOwnO: then the next tile's Q need not wait for the store of
        this one's O)."""
        base = 2 * head_dim * (self.block_m + 2 * self.stages * self.block_n) + 1024
        staging = 2 * head_dim * self.block_m
        return base + staging if base + staging + 256 <= SMEM_LIMIT else base

    def __str__(self) -> str:
        return f"{self.block_m}x{self.block_n}/s{self.stages}" + ("/pp" if self.pingpong else "") + (
            "/persistent" if self.persistent else "")


C = Sm90Config

# Default per (head dim, causal), fp16 and bf16 alike: the fastest of the registered candidates in
# the H200 tuning runs (`bench attention --tune`, docs/BENCHMARKS.md "Hopper forward: tile choice",
# and the later A/B runs in docs/attention_fwd_sm90.md), within 227 KB of shared memory.
#   d=64:  S 64 + O 32 fp32 regs per consumer thread; Q + 3 stages = 112 KB, + 16 KB sO, + 1 KB.
#   d=128: S 64 + O 64 regs; Q + 2 stages = 160 KB, + 32 KB sO, + 1 KB.
#   d=256: S 32 + O 128 regs; Q + 2 stages of 64 keys = 192 KB + 1 KB (no room for sO).
DEFAULTS: dict[tuple[int, bool], Sm90Config] = {
    (64, False): C(128, 3),
    (64, True): C(128, 3),
    (128, False): C(128, 2),
    (128, True): C(128, 2),
    (256, False): C(64, 2),
    (256, True): C(64, 2),
}
# d = 64 and 128 run on a persistent grid (one CTA per SM; each takes its next tile from a
# grid-wide counter, so tiles go out once each in the schedule's order and a slow CTA takes fewer)
# at every length, plain and variant kernels alike: the producer loads the next tile's Q and K/V
# during this one's last P V and epilogue (O staged in sO). Measured on the H200 (2026-12-02,
# session 15, call D1, `scripts/fwd_sm90_configs.py --grids-only`, B=4 H=32 bf16, median of 2
# rounds; docs/attention_fwd_sm90.md "A grid-wide tile counter"): persistent / one CTA per tile at
# N = 4096 / 8192 / 16384 / 32768: d=128 causal 1.06 / 1.02 / 1.05 / 1.01, non-causal 0.98 / 1.04
# / 1.02 / 1.00; d=64 causal 1.03 / 1.02 / 1.02 / 1.02, non-causal 0.99 / 1.00 / 1.01 / 1.01; the
# static tile stride it replaced read 0.88-0.94x at causal d=128 16k / 32k. d = 256 has no room for
# sO and keeps one CTA per tile.
PERSISTENT_HEAD_DIMS = (64, 128)
# Three consumer warpgroups (192-row tiles) for the plain dense kernel where listed: d = 64, where
# the exponentials take as long as the GEMMs and a third warpgroup's softmax fills what two leave
# idle (FlashAttention-3's d = 64 shape). H200, 2026-12-03, call G2 (`scripts/fwd_sm90_configs.py
# --head-dim 64 --config ...`, B=4 H=32 bf16, persistent grids, median of 2 rounds), TFLOP/s of
# 128 x 128 / s3 (two consumers) against 192 x 128 / s2 and / s3, cuDNN in the same rounds:
#   non-causal N = 2048 413 / 444 / 446 (cuDNN 423), 8192 445 / 523 / 512 (458), 32768 449 / 524 / 521 (454)
#   causal     N = 2048 338 / 323 / 338 (342),       8192 421 / 474 / 474 (432), 32768 442 / 514 / 518 (451)
# Shorter (call G3, same command at N = 512 / 1024): non-causal 262 / 264 / 259 and 367 / 365 / 359
# (a tie), causal 163 / 142 / 148 and 249 / 227 / 224 (two consumers 10 % ahead), so the three stay
# off below WIDE_MIN_QUERIES[64] queries (causal ties at 2048 in G2 and leads from 4096 on: call G5, same
# command, 419 against 401 TFLOP/s at 4096).
# d = 128: three consumers fit 160 registers with 64- or 80-key blocks (S 40 + O 64 fp32 at 80 keys;
# 96 keys spill). H200, 2026-12-03, call H1 (same command, --head-dim 128), TFLOP/s of the default
# 128 x 128 / s2 against 192 x 64 / s3, 192 x 64 / s4, 192 x 80 / s3 (all persistent), cuDNN:
#   non-causal N = 2048 614 / 569 / 571 / 582 (568), 4096 628 / 596 / 619 / 624 (583), 8192 649 / 647 / 633 / 677 (606)
#   causal     N = 2048 486 / 453 / 451 / 461 (465), 4096 570 / 528 / 538 / 546 (532), 8192 599 / 602 / 598 / 627 (571)
# so 192 x 80 / s3 from 8192 queries on.
# Where GQA packing needs a 128-row tile (see default_config) the two-consumer tile stays. Varlen,
# paged and variant kernels keep two consumers (DEFAULTS), except ALiBi or softcap alone (VARIANT_WIDE, variant_config).
WIDE_DEFAULTS: dict[tuple[int, bool], Sm90Config] = {(64, False): C(128, 2, consumers=3),
                                                     (64, True): C(128, 3, consumers=3),
                                                     (128, False): C(80, 3, consumers=3),
                                                     (128, True): C(80, 3, consumers=3)}
WIDE_MIN_QUERIES: dict[int, int] = {64: 2048, 128: 8192}  # per head dim: queries from which WIDE_DEFAULTS applies
# From LONG_KEYS[(head dim, causal)] keys on, the pairs listed take a config of their own. d = 256
# non-causal: 80-key blocks with ping-pong (tuning runs: 743 against 705 TFLOP/s at 16384 keys in
# F1, 684 against 706 at 4096; 734 against 728 at 8192 on 2026-12-01). Through the public op
# (2026-12-03, call G1, `tileattn bench attention --forward-only --head-dim 256 --seq 8192 --seq 16384
# --rounds 2`, bf16): 723 / 734 TFLOP/s against cuDNN's 671 / 659 (1.08x / 1.11x). From 2048 keys
# since 2026-12-04 (session 28, `scripts/fwd_sm90_configs.py --head-dim 256 --seq 2048 --seq 4096
# --config 128x64/s2 --config 128x64/s2/persistent --config 128x80/s2/pp` with TILEATTN_BENCH_CLOCKS,
# B = 4 H = 32 bf16, medians of rotated rounds, two machine starts; docs/attention_fwd_sm90.md "cuDNN's
# tiles at short sequences"): 128 x 80 / pp against 128 x 64 at 2048 keys 634 / 610 and 633 / 606
# TFLOP/s, at 4096 688 / 663 and 691 / 670 (cuDNN 614-649); session 18's H4 read +4 % and -0.7 %.
# Causal, the same tile from 8192: 687 / 694 TFLOP/s against the short default's 673 / 685 at 8192 /
# 16384 keys (call H1, `scripts/fwd_sm90_configs.py --head-dim 256`, cuDNN 619 / 633; at 4096 594
# against 612, and 598 / 597 in session 28).
LONG_KEYS: dict[tuple[int, bool], int] = {(256, False): 2048, (256, True): 8192}
LONG_DEFAULTS: dict[tuple[int, bool], Sm90Config] = {(256, False): C(80, 2, True), (256, True): C(80, 2, True)}


def default_config(head_dim: int, causal: bool, seqlen_k: int = 0, *, seqlen_q: int | None = None,
                   heads: int = 1, kv_heads: int = 1, pack_gqa: bool | None = None,
                   wide_min_queries: int | None = None) -> Sm90Config:
    """The dense forward's config: LONG_DEFAULTS' entry from LONG_KEYS[key] keys on, else WIDE_DEFAULTS'
    (three consumers) when the call has at least WIDE_MIN_QUERIES[head_dim] queries (seqlen_q None: assumed
    long) and its GQA packing (gqa_pack's choice, or pack_gqa's) works with a 192-row tile as with a
    128-row one, else DEFAULTS'; on a persistent grid for a head dim in PERSISTENT_HEAD_DIMS.
    wide_min_queries replaces WIDE_MIN_QUERIES[head_dim] (a variant kernel whose switch lies elsewhere).
    Raises KeyError for a head dim not in HEAD_DIMS."""
    key = (head_dim, bool(causal))
    config = DEFAULTS[key]
    switch = WIDE_MIN_QUERIES.get(head_dim) if wide_min_queries is None else wide_min_queries
    if key in WIDE_DEFAULTS and (seqlen_q is None or seqlen_q >= switch):
        wide, group = WIDE_DEFAULTS[key], heads // kv_heads
        if pack_gqa is None:
            packs = seqlen_q is not None and gqa_pack(heads, kv_heads, seqlen_q) > 1
        else:
            packs = pack_gqa and group > 1
        if not packs or packable(group, wide.block_m):
            config = wide
    if key in LONG_DEFAULTS and seqlen_k >= LONG_KEYS[key]:
        config = LONG_DEFAULTS[key]
    return _default_grid(head_dim, config)


def _default_grid(head_dim: int, config: Sm90Config) -> Sm90Config:
    """A default tile on its default grid: persistent for a head dim in PERSISTENT_HEAD_DIMS."""
    return replace(config, persistent=True) if head_dim in PERSISTENT_HEAD_DIMS else config


# Extra candidates for the tuning benchmark (bf16 only): the defaults with ping-pong and/or a
# persistent grid, deeper rings, smaller key blocks and FA3's tiles (d = 64: 192 query rows, three
# consumer warpgroups; the others where two consumers fit them).
_EXTRA = {
    64: (C(128, 3, True), C(128, 3, False, True), C(128, 4), C(128, 4, False, True), C(64, 4), C(192, 2),
         C(192, 2, True), C(192, 2, False, True), C(192, 2, True, True),
         C(128, 2, False, True, 3), C(128, 3, False, True, 3)),
    128: (C(128, 2, True), C(128, 2, False, True), C(128, 2, True, True), C(64, 4), C(64, 4, True), C(176, 2),
          C(176, 2, True), C(96, 3),
          # three consumers where S + P + O fit 160 registers (O 64: 64- / 80-key blocks; 96 spills)
          C(64, 3, False, True, 3), C(64, 4, False, True, 3)),
    256: (C(64, 2, True), C(64, 2, False, True), C(80, 2), C(80, 2, True)),
}
EXTRA_BF16: dict[tuple[int, bool], tuple[Sm90Config, ...]] = {
    (d, causal): extra for d, extra in _EXTRA.items() for causal in (False, True)
}


def _template_args(head_dim: int, config: Sm90Config, causal: bool, bf16: bool) -> str:
    flag = {True: "true", False: "false"}
    return f"{head_dim}, {config.block_n}, {config.stages}, {flag[config.pingpong]}, {flag[causal]}, {flag[bf16]}"


def expression(head_dim: int, config: Sm90Config, causal: bool, bf16: bool) -> str:
    """The NVRTC name expression of one instantiation (must match the registry string exactly);
    kConsumers is spelled only where it is not the template's default 2."""
    consumers = "" if config.consumers == 2 else f", {config.consumers}"
    return f"tileattn::attention_fwd_sm90<{_template_args(head_dim, config, causal, bf16)}{consumers}>"


def _flavour_expression(head_dim: int, config: Sm90Config, causal: bool, bf16: bool, variant: int,
                        param_types: str) -> str:
    """A variant / varlen / paged instantiation: kConsumers (3 only for the varlen layout and
    WIDE_VARIANT_FLAGS: the paged kernel and the other variant sets have no three-consumer form),
    kVariant, then the trailing parameters' types."""
    if config.consumers != 2 and (variant & ~FIXED_MAX) not in (VARLEN, *WIDE_VARIANT_FLAGS):
        raise ValueError(f"{config}: only the dense and varlen kernels and ALiBi or softcap alone have a "
                         "three-consumer form")
    return (f"tileattn::attention_fwd_sm90<{_template_args(head_dim, config, causal, bf16)}, {config.consumers}, "
            f"{variant}, {param_types}>")


# Variant flags (bits of the kernel's kVariant; fwd90::kWindow, kSoftcap, kAlibi in the .cu file).
WINDOW, SOFTCAP, ALIBI = 1, 2, 4
# The varlen layout bit (fwd90::kVarlen; see "Variable-length batches" below), defined here because
# _flavour_expression tests it for the instantiations registered from here on.
VARLEN = 8
# Tiles of the variant kernels: the non-causal defaults (a window is masked like causal, and the
# defaults are the same config causal or not).
VARIANT_DEFAULTS: dict[int, Sm90Config] = {d: DEFAULTS[(d, False)] for d in HEAD_DIMS}
# ALiBi alone and softcap alone (non-causal: causal is the WINDOW bit) also run WIDE_DEFAULTS'
# non-causal three-consumer tile where the plain kernel takes it (variant_config): 0 spills at 160
# registers (NVRTC 13.5), while WINDOW | ALIBI spills there (56 bytes of spill stores at d = 128, 244
# at d = 64) and keeps two. docs/attention_variants.md, "ALiBi alone with three consumers": on the
# H200 (2026-12-03, bf7717b, `bench variants --suite overhead --rounds 3`) ALiBi 602 TFLOP/s at d = 128
# bf16 non-causal N = 8192, where the two-consumer kernel read 582 (session 19, another process; its
# same-process A/B: +4.5 %); softcap: "Softcap by the hardware tanh".
WIDE_VARIANT_FLAGS = (ALIBI, SOFTCAP)
VARIANT_WIDE: dict[int, Sm90Config] = {d: cfg for (d, causal), cfg in WIDE_DEFAULTS.items() if not causal}
# A causal call with ALiBi or softcap alone (window (unbounded, 0), the causal fold) can also run a
# kCausal kernel (fwd90::kCausalVariant): the plain causal kernel's blocks and mask, at its two-
# consumer tile (DEFAULTS) or, where the plain causal call takes three consumers (default_config),
# at CAUSAL_VARIANT_WIDE's; WINDOW | ALIBI and WINDOW | SOFTCAP keep two consumers (they spill on
# three). d = 64 and 128 (d = 256 has no three-consumer tile). Three consumers at d = 64 take
# 96-key blocks: with the plain tile's 128 both variants spill (NVRTC 13.5, 192 x 128 / s3: 52 bytes
# of spill stores and 16 of stack; s2 the same), at 96 and 64 they fit 0 / 0; d = 128's 192 x 80 /
# s3 fits as it is. The dispatcher takes them where dispatch.SM90_CAUSAL_VARIANT_FORWARD lists the
# head dim (ForwardPlan's causal_kernel).
CAUSAL_VARIANT_FLAGS = (ALIBI, SOFTCAP)
CAUSAL_VARIANT_HEAD_DIMS = (64, 128)
CAUSAL_VARIANT_WIDE: dict[int, Sm90Config] = {64: C(96, 3, consumers=3), 128: WIDE_DEFAULTS[(128, True)]}
# Softcap alone, with the online max or the fixed one (FIXED_MAX below), takes the three-consumer tile
# from fewer queries than the plain kernel at d = 128, causal (kCausal) and not. Fixed max: H200,
# 2026-12-04 (session 25, call 1, ForwardPlans timed directly, B=4 H=32 bf16, cap 30, median of 3
# rotating rounds; docs/attention_variants.md "Causal softcap on the kCausal kernel"), TFLOP/s
# relative to the plain kernel of the same shape, two / three consumers: causal N = 2048 0.920 /
# 0.938, 4096 0.881 / 0.935, 8192 0.858 / 0.909; non-causal 2048 0.900 / 0.921, 4096 0.880 / 0.901,
# 8192 0.842 / 0.897. Online max (the forward autograd runs; session 26, call 3, same method): causal
# 2048 0.860 / 0.902, 4096 0.855 / 0.913; non-causal 2048 0.828 / 0.837, 4096 0.840 / 0.854. d = 64
# (fixed max, causal): 0.791 / 0.790, 0.785 / 0.782, 0.748 / 0.762, so it keeps the plain switch.
SOFTCAP_WIDE_MIN_QUERIES: dict[int, int] = {128: 2048}


def _variant_wide_switch(head_dim: int, softcap_alone: bool) -> int | None:
    """default_config's wide_min_queries for a variant kernel: SOFTCAP_WIDE_MIN_QUERIES' entry for
    softcap alone, else None (the plain kernel's WIDE_MIN_QUERIES)."""
    return SOFTCAP_WIDE_MIN_QUERIES.get(head_dim) if softcap_alone else None


def causal_variant_config(head_dim: int, seqlen_k: int = 0, *, seqlen_q: int | None = None, heads: int = 1,
                          kv_heads: int = 1, pack_gqa: bool | None = None, softcap: bool = False) -> Sm90Config:
    """The kCausal variant kernel's config: default_config's choice for the plain causal kernel of
    the same call (for softcap, switching to three consumers at SOFTCAP_WIDE_MIN_QUERIES where
    listed), with CAUSAL_VARIANT_WIDE's tile where that choice has three consumers (on the same
    grid). Raises KeyError for a head dim not in CAUSAL_VARIANT_HEAD_DIMS."""
    wide = CAUSAL_VARIANT_WIDE[head_dim]
    plain = default_config(head_dim, True, seqlen_k, seqlen_q=seqlen_q, heads=heads, kv_heads=kv_heads,
                           pack_gqa=pack_gqa, wide_min_queries=_variant_wide_switch(head_dim, softcap))
    return replace(wide, persistent=plain.persistent) if plain.consumers == 3 else plain


def fixed_max_tile(head_dim: int, config: Sm90Config) -> Sm90Config:
    """The non-causal fixed-max kernel's tile where variant_config chose `config`: FIXED_MAX_WIDE's
    (on the same grid) in place of VARIANT_WIDE's for the head dims it lists, `config` otherwise."""
    wide = FIXED_MAX_WIDE.get(head_dim)
    if wide is not None and replace(config, persistent=False) == VARIANT_WIDE[head_dim]:
        return replace(wide, persistent=config.persistent)
    return config


def variant_config(head_dim: int, flags: int, seqlen_k: int = 0, *, seqlen_q: int | None = None, heads: int = 1,
                   kv_heads: int = 1, pack_gqa: bool | None = None) -> Sm90Config:
    """The variant forward's config for kVariant `flags` (variant_flags, after dropout_kernel_flags):
    for ALiBi or softcap alone (WIDE_VARIANT_FLAGS), default_config's choice for the plain non-causal
    kernel of the same call when that is the VARIANT_WIDE tile (three consumers, so from
    WIDE_MIN_QUERIES[head_dim] queries and where GQA packing allows it, as default_config decides);
    otherwise, and for every other flag set, VARIANT_DEFAULTS[head_dim] (the variant kernels exist at
    no other tile: LONG_DEFAULTS' is not taken). On a persistent grid for a head dim in
    PERSISTENT_HEAD_DIMS. Softcap alone takes the three-consumer tile from SOFTCAP_WIDE_MIN_QUERIES'
    queries where that lists the head dim (with or without the fixed max); with the FIXED_MAX bit,
    fixed_max_tile's choice. Raises KeyError for a head dim not in HEAD_DIMS."""
    base = flags & ~FIXED_MAX
    if (head_dim, flags) in RNG_STATE_TILES:
        return _default_grid(head_dim, RNG_STATE_TILES[(head_dim, flags)])
    if base in WIDE_VARIANT_FLAGS and head_dim in VARIANT_WIDE:
        plain = default_config(head_dim, False, seqlen_k, seqlen_q=seqlen_q, heads=heads, kv_heads=kv_heads,
                               pack_gqa=pack_gqa, wide_min_queries=_variant_wide_switch(head_dim, base == SOFTCAP))
        if replace(plain, persistent=False) == VARIANT_WIDE[head_dim]:
            return fixed_max_tile(head_dim, plain) if flags & FIXED_MAX else plain
    return _default_grid(head_dim, VARIANT_DEFAULTS[head_dim])


# Dropout (fwd90::kDropout): a bit apart from the layout bits 8 (VARLEN) and 16 (PAGED).
DROPOUT = 32
# Softcap's fixed row max (fwd90::kFixedMax): bf16 SOFTCAP or WINDOW | SOFTCAP, where
# fixed_max_applies. The softmax runs with m = cap log2(e), softcap's largest logit (in log2 units),
# instead of the online row max. SASS loop census (NVRTC 13.5, bf16, scripts/sass_loop_census.py's
# loops; the static count includes the online kernels' O-rescale branch, d / 2 FMULs, which runs only
# when a row's max grows): d = 128 128 x 128 645 -> 491 instructions per visit (plain 517), three
# consumers 192 x 80 478 -> 347, d = 64 579 -> 457.
FIXED_MAX = 64
FIXED_MAX_FLAGS = (SOFTCAP, WINDOW | SOFTCAP)
# Every row's largest p is at least 2^(-2 cap log2 e) (t = -1 everywhere), and exp2 results below
# 2^-126 flush to 0: keys below a row's max by more than 126 - 2 cap log2 e (log2 units) are dropped,
# at most Nk of them, so their total weight relative to the row's largest is below
# Nk 2^-(126 - 2 cap log2 e). fixed_max_applies asks for that bound to be at most 2^-12 (bf16 rounds
# at 2^-8): 2 cap log2 e + log2 Nk <= 114 (cap 30: Nk up to 2^27; cap 50, Gemma 2's, never).
FIXED_MAX_LOG2_BUDGET = 114.0
# Non-causal softcap with the fixed max where variant_config picks the three-consumer tile: at d = 64
# 96-key blocks, where the kernel computes 3 of 8 exponentials on the FP32 pipe (kExp2FmaPer8 in the
# .cu file; at VARIANT_WIDE's 128-key blocks that spills).
FIXED_MAX_WIDE: dict[int, Sm90Config] = {64: C(96, 3, consumers=3)}


def fixed_max_applies(dtype, flags: int, softcap: float, seqlen_k: int) -> bool:
    """Whether a forward with variant flags `flags` (variant_flags, no dropout) and this softcap may
    run the fixed-max kernel: bf16, SOFTCAP or WINDOW | SOFTCAP, and 2 cap log2(e) + log2(Nk) within
    FIXED_MAX_LOG2_BUDGET (fp16's P would underflow: its smallest normal is 2^-14)."""
    if dtype != torch.bfloat16 or flags not in FIXED_MAX_FLAGS or softcap <= 0:
        return False
    return 2.0 * softcap * math.log2(math.e) + math.log2(max(seqlen_k, 1)) <= FIXED_MAX_LOG2_BUDGET


def causal_variant_flags(variants) -> int | None:
    """kVariant of the kCausal kernel that runs `variants` (attention_fwd_sm80.VariantArgs, causal
    folded into the window): ALiBi or softcap alone with the causal window (left unbounded, right 0),
    i.e. a causal call without a window of its own; None for anything else."""
    from ..dropout import UNBOUNDED

    flags = variant_flags(variants)
    if flags & WINDOW and (flags & ~WINDOW) in CAUSAL_VARIANT_FLAGS:
        if variants.window_left == UNBOUNDED and variants.window_right == 0:
            return flags & ~WINDOW
    return None


def variant_flags(variants) -> int:
    """kVariant of an attention_fwd_sm80.VariantArgs (0: none of window, softcap, ALiBi, dropout is
    on; a window with both edges unbounded is no window; dropout_p 0 is no dropout)."""
    from ..dropout import UNBOUNDED

    window = variants.window_left != UNBOUNDED or variants.window_right != UNBOUNDED
    return ((WINDOW if window else 0) | (SOFTCAP if variants.softcap > 0 else 0)
            | (ALIBI if variants.alibi_batch_stride is not None else 0) | (DROPOUT if variants.dropout_p > 0 else 0)
            | (RNG_STATE if variants.reads_rng_state else 0))


# The types of VARIANT_PARAMS (common/variants.cuh), in order: the variant kernels' trailing
# parameter pack (alibi, seed, offset, alibi_sb, win_left, win_right, cap_in, cap_out, drop_thr, drop_scale,
# rng_state).
_VARIANT_PARAM_TYPES = ("const float*, unsigned long long, unsigned long long, long long, int, int, float, float, "
                        "unsigned int, float, const unsigned long long*")


def variant_expression(head_dim: int, config: Sm90Config, bf16: bool, flags: int, causal: bool = False) -> str:
    """The NVRTC name expression of a variant instantiation (flags: 1..7, or DROPOUT with any of
    them, see variant_flags): the plain kernel template with kCausal `causal` (True only for
    CAUSAL_VARIANT_FLAGS, or SOFTCAP | FIXED_MAX), kVariant = flags and VARIANT_PARAMS' types."""
    if causal and flags not in (*CAUSAL_VARIANT_FLAGS, SOFTCAP | FIXED_MAX):
        raise ValueError(f"variant flags {flags}: only ALiBi or softcap alone (softcap with or without the fixed "
                         f"max) have a kCausal kernel")
    return _flavour_expression(head_dim, config, causal, bf16, flags, _VARIANT_PARAM_TYPES)


def configs_for(head_dim: int, causal: bool, bf16: bool) -> tuple[Sm90Config, ...]:
    """Every registered config for one (head dim, causal, dtype), the defaults (short, long keys) first."""
    out = [DEFAULTS[(head_dim, causal)]]
    for table in (WIDE_DEFAULTS, LONG_DEFAULTS):
        if (head_dim, causal) in table:
            out.append(table[(head_dim, causal)])
    if bf16:
        out += [c for c in EXTRA_BF16.get((head_dim, causal), ()) if c not in out]
    return tuple(out)


def _expressions(pairs) -> tuple[str, ...]:
    """Name expressions of (head dim, causal, bf16, config) entries, each kernel once (persistent or
    not is the same kernel)."""
    exprs = []
    for d, causal, bf16, cfg in pairs:
        assert cfg.smem_bytes(d) <= SMEM_LIMIT, (d, cfg)
        exprs.append(expression(d, cfg, causal, bf16))
    return tuple(dict.fromkeys(exprs))


# What the dispatcher and tests use (compiled by `tileattn check`), and the tuning candidates
# (compiled by `tileattn check --tuning` and on first use by the tuning benchmark).
VARIANT_INSTANTIATIONS = tuple(variant_expression(d, cfg, bf16, flags) for d, cfg in VARIANT_DEFAULTS.items()
                               for bf16 in (False, True) for flags in range(1, 8))
# ALiBi or softcap alone at the three-consumer tile (VARIANT_WIDE, variant_config): d = 64 and 128,
# both dtypes.
VARIANT_WIDE_INSTANTIATIONS = tuple(variant_expression(d, cfg, bf16, flags) for flags in WIDE_VARIANT_FLAGS
                                    for d, cfg in VARIANT_WIDE.items() for bf16 in (False, True))
# Softcap's fixed-max kernels (bf16 only): SOFTCAP and WINDOW | SOFTCAP at VARIANT_DEFAULTS' tiles,
# SOFTCAP at VARIANT_WIDE's and FIXED_MAX_WIDE's.
FIXED_MAX_INSTANTIATIONS = tuple(
    [variant_expression(d, cfg, True, flags | FIXED_MAX) for d, cfg in VARIANT_DEFAULTS.items() for flags in FIXED_MAX_FLAGS]
    + [variant_expression(d, cfg, True, SOFTCAP | FIXED_MAX) for table in (VARIANT_WIDE, FIXED_MAX_WIDE)
       for d, cfg in table.items()])
# The kCausal ALiBi / softcap kernels (CAUSAL_VARIANT_FLAGS) at the plain causal kernel's tiles.
CAUSAL_VARIANT_INSTANTIATIONS = tuple(
    variant_expression(d, cfg, bf16, flags, causal=True) for flags in CAUSAL_VARIANT_FLAGS
    for d in CAUSAL_VARIANT_HEAD_DIMS for cfg in (DEFAULTS[(d, True)], CAUSAL_VARIANT_WIDE[d])
    for bf16 in (False, True))
# Causal bf16 softcap with the fixed max on the kCausal kernel, at the same two tiles per head dim.
CAUSAL_FIXED_MAX_INSTANTIATIONS = tuple(
    variant_expression(d, cfg, True, SOFTCAP | FIXED_MAX, causal=True) for d in CAUSAL_VARIANT_HEAD_DIMS
    for cfg in (DEFAULTS[(d, True)], CAUSAL_VARIANT_WIDE[d]))
# Dropout: the flag sets registered per head dim, at the variant tiles (kBlockN a multiple of 64:
# whole Philox groups and keep words). Causal dropout is DROPOUT | WINDOW. Without the window bit,
# softcap or ALiBi with dropout spilled under NVRTC 13.5's ptxas (DROPOUT | SOFTCAP | ALIBI at every
# d, 36-188 bytes; DROPOUT | SOFTCAP and DROPOUT | ALIBI at d = 64) while the same sets with the
# window bit did not: those calls run the windowed kernel with both edges unbounded (the window then
# masks only the Nk edge block, which is masked anyway), see dropout_kernel_flags. At d = 128,
# ALiBi with dropout spills under the H200 image's NVRTC 13.0 (DROPOUT | WINDOW | ALIBI 80 bytes,
# with SOFTCAP 204; 13.5: 0) and is not registered: such calls stay on the sm80 kernels. ptxas
# table (NVRTC 13.5 and 13.0) in docs/attention_fwd_sm90.md ("Dropout").
_DROPOUT_ALL = (DROPOUT, DROPOUT | WINDOW, DROPOUT | WINDOW | SOFTCAP, DROPOUT | WINDOW | ALIBI,
                DROPOUT | WINDOW | SOFTCAP | ALIBI)
DROPOUT_FLAG_SETS: dict[int, tuple[int, ...]] = {64: _DROPOUT_ALL, 128: _DROPOUT_ALL[:3], 256: _DROPOUT_ALL}
# The kRngState forms (fwd90::kRngState; VariantArgs.rng_state): the consumers read the seed and
# offset from device memory, so a captured CUDA graph applies whatever state each replay finds there.
# Registered where they compile with 0 spills (NVRTC 13.5): every set at d = 64; at d = 128 the three
# sets, the windowed two at 128 x 64 / s2 (RNG_STATE_TILES: at the dropout kernels' 128 x 128 they
# spilled 120 and 20 bytes); at d = 256 the same three sets, the windowed two (causal dropout among
# them) on 128 x 64 / s2 with ping-pong (at the by-value tile, 128 x 64 / s2 without it, they spilled
# 4 bytes; session 48). The d = 256 windowed sets with ALiBi spill on both (4 and 12 bytes with
# ping-pong): those calls run the sm80 kernels' kRngState form.
# docs/attention_variants.md, "Dropout's rng state in device memory".
RNG_STATE = 256
RNG_STATE_FLAG_SETS: dict[int, tuple[int, ...]] = {
    d: tuple(flags | RNG_STATE for flags in sets)
    for d, sets in ((64, _DROPOUT_ALL), (128, _DROPOUT_ALL[:3]), (256, _DROPOUT_ALL[:3]))}
RNG_STATE_TILES: dict[tuple[int, int], Sm90Config] = {
    (d, flags | RNG_STATE): tile for d, tile in ((128, C(64, 2)), (256, C(64, 2, pingpong=True)))
    for flags in _DROPOUT_ALL[1:3]}
DROPOUT_INSTANTIATIONS = tuple(
    variant_expression(d, RNG_STATE_TILES.get((d, flags), VARIANT_DEFAULTS[d]), bf16, flags)
    for table in (DROPOUT_FLAG_SETS, RNG_STATE_FLAG_SETS) for d, sets in table.items() for bf16 in (False, True)
    for flags in sets)


def dropout_kernel_flags(head_dim: int, flags: int) -> int | None:
    """kVariant of the registered instantiation that runs variant flags `flags` (with DROPOUT, and
    RNG_STATE for a kRngState call) at this head dim: the set itself, or the set with WINDOW (run with
    the window's edges as given: unbounded when the call has no window), or None when neither is
    registered."""
    sets = (RNG_STATE_FLAG_SETS if flags & RNG_STATE else DROPOUT_FLAG_SETS).get(head_dim, ())
    for k in (flags, flags | WINDOW):
        if k in sets:
            return k
    return None
# Variable-length batches: the plain kernel with kVariant = VARLEN (fwd90::kVarlen, a layout bit of
# that parameter, so the dense kernels keep their names) and VARLEN_PARAMS' types appended
# (cu_seqlens_q, cu_seqlens_k, out, out's token and head strides, Tq). Tiles: the dense defaults.
_VARLEN_PARAM_TYPES = "const int*, const int*, unsigned short*, long long, long long, int"
VARLEN_DEFAULTS = DEFAULTS


def varlen_expression(head_dim: int, config: Sm90Config, causal: bool, bf16: bool) -> str:
    """The NVRTC name expression of a varlen instantiation."""
    return _flavour_expression(head_dim, config, causal, bf16, VARLEN, _VARLEN_PARAM_TYPES)


VARLEN_INSTANTIATIONS = tuple(varlen_expression(d, cfg, causal, bf16) for (d, causal), cfg in VARLEN_DEFAULTS.items()
                              for bf16 in (False, True))

# Packed queries against a paged K/V cache (prefill chunks): kVariant = PAGED (fwd90::kPaged) with
# PAGED_PARAMS' types appended (VARLEN_PARAMS' with seqlens_k for cu_seqlens_k, then block_table,
# its row stride, max_blocks, num_blocks, log2(block_size)). Tiles: the dense defaults (kBlockN a
# power of two, so a K/V block spans whole cache blocks or lies inside one).
PAGED = 16
_PAGED_PARAM_TYPES = _VARLEN_PARAM_TYPES + ", const int*, int, int, int, int"
PAGED_DEFAULTS = DEFAULTS
PAGED_BLOCK_SIZES = (16, 32, 64, 128, 256)


def paged_expression(head_dim: int, config: Sm90Config, causal: bool, bf16: bool) -> str:
    """The NVRTC name expression of a paged instantiation."""
    return _flavour_expression(head_dim, config, causal, bf16, PAGED, _PAGED_PARAM_TYPES)


PAGED_INSTANTIATIONS = tuple(paged_expression(d, cfg, causal, bf16) for (d, causal), cfg in PAGED_DEFAULTS.items()
                             for bf16 in (False, True))

# Both packed layouts with variants: kVariant = VARLEN or PAGED | a set of WINDOW, SOFTCAP, ALIBI
# (causal is the window's right edge 0, so kCausal false; dropout: the varlen sets below), the
# layout's parameters then VARIANT_PARAMS', at the dense variant kernels' tiles (VARIANT_DEFAULTS:
# two consumers, kBlockN a power of two as the paged layout needs).
PACKED_VARIANT_FLAGS = tuple(range(1, 8))
_LAYOUT_PARAM_TYPES = {VARLEN: _VARLEN_PARAM_TYPES, PAGED: _PAGED_PARAM_TYPES}


# Dropout on the varlen layout (not paged: attention_paged has none), with the window bit as the dense
# dropout kernels (a call without a window runs both edges unbounded; dropout_kernel_flags), and the
# kRngState forms. Registered where they compile with 0 spills (NVRTC 13.5, both dtypes): every set
# at d = 64 (128 x 128 / s3) and at d = 128 on 128 x 64 / s2 (at 128 x 128 the varlen state made
# DROPOUT | WINDOW spill 8 bytes, with SOFTCAP 8, with ALIBI 40); at d = 256 without ALiBi (with it:
# 4 bytes). The mask is the dense kernels' with the sequence index as the batch and positions inside
# the sequence (tileattn.dropout.dropout_mask's batch_start rule), which the varlen backwards (Hopper's
# VARLEN_DROPOUT_SETS, sm80's) regenerate.
_VARLEN_DROPOUT_SETS = (DROPOUT | WINDOW, DROPOUT | WINDOW | SOFTCAP, DROPOUT | WINDOW | ALIBI)
VARLEN_DROPOUT_FLAG_SETS: dict[int, tuple[int, ...]] = {
    d: tuple(flags | rng for flags in sets for rng in (0, RNG_STATE))
    for d, sets in ((64, _VARLEN_DROPOUT_SETS), (128, _VARLEN_DROPOUT_SETS), (256, _VARLEN_DROPOUT_SETS[:2]))}
VARLEN_DROPOUT_TILES: dict[int, Sm90Config] = {128: C(64, 2)}


def packed_variant_expression(head_dim: int, config: Sm90Config, bf16: bool, layout: int, flags: int) -> str:
    """The NVRTC name expression of a packed layout's variant instantiation (layout VARLEN or PAGED,
    flags in PACKED_VARIANT_FLAGS; VARLEN also VARLEN_DROPOUT_FLAG_SETS' sets)."""
    dropout = layout == VARLEN and flags in VARLEN_DROPOUT_FLAG_SETS.get(head_dim, ())
    if flags not in PACKED_VARIANT_FLAGS and not dropout:
        raise ValueError(f"variant flags {flags}: the packed layouts take window, softcap and ALiBi (one of "
                         f"{PACKED_VARIANT_FLAGS}), the varlen layout also {VARLEN_DROPOUT_FLAG_SETS}")
    return _flavour_expression(head_dim, config, False, bf16, layout | flags,
                               f"{_LAYOUT_PARAM_TYPES[layout]}, {_VARIANT_PARAM_TYPES}")


def packed_variant_config(head_dim: int, flags: int) -> Sm90Config:
    """The tile of a packed variant kernel: VARLEN_DROPOUT_TILES' with dropout where listed,
    VARIANT_DEFAULTS' otherwise."""
    return VARLEN_DROPOUT_TILES.get(head_dim, VARIANT_DEFAULTS[head_dim]) if flags & DROPOUT else VARIANT_DEFAULTS[head_dim]


PACKED_VARIANT_INSTANTIATIONS = tuple(
    packed_variant_expression(d, cfg, bf16, layout, flags) for layout in (VARLEN, PAGED)
    for d, cfg in VARIANT_DEFAULTS.items() for bf16 in (False, True) for flags in PACKED_VARIANT_FLAGS)
VARLEN_DROPOUT_INSTANTIATIONS = tuple(
    packed_variant_expression(d, packed_variant_config(d, flags), bf16, VARLEN, flags)
    for d, sets in VARLEN_DROPOUT_FLAG_SETS.items() for bf16 in (False, True) for flags in sets)


def packed_kernel_flags(head_dim: int, layout: int, variants) -> int | None:
    """kVariant's variant bits of the packed instantiation that runs `variants` (VariantArgs, causal
    folded into the window) on `layout` (VARLEN or PAGED): variant_flags itself without dropout, the
    set with the window bit for varlen dropout (VARLEN_DROPOUT_FLAG_SETS), None where none is
    registered. Never raises."""
    flags = variant_flags(variants)
    if flags in PACKED_VARIANT_FLAGS:
        return flags
    if layout == VARLEN and flags & DROPOUT and flags | WINDOW in VARLEN_DROPOUT_FLAG_SETS.get(head_dim, ()):
        return flags | WINDOW
    return None


def _packed_variant_flags(variants, causal: bool, head_dim: int, layout: int) -> int:
    """packed_kernel_flags of a packed plan's `variants` (None: 0), checked: causal folded into the
    window, a registered set."""
    if variants is None:
        return 0
    if causal:
        raise ValueError("causal must be folded into the window (causal=False) with variants")
    flags = packed_kernel_flags(head_dim, layout, variants)
    if flags is None:
        raise ValueError(f"the sm90 packed layouts run window, softcap and ALiBi, and on the varlen layout "
                         f"dropout with at most one of them ({VARLEN_DROPOUT_FLAG_SETS}); not variant flags "
                         f"{variant_flags(variants)} at head_dim {head_dim}")
    return flags


INSTANTIATIONS = (_expressions((d, causal, bf16, cfg) for (d, causal), cfg in (*DEFAULTS.items(), *WIDE_DEFAULTS.items(),
                                                                              *LONG_DEFAULTS.items())
                               for bf16 in (False, True))
                  + VARIANT_INSTANTIATIONS + VARLEN_INSTANTIATIONS + PAGED_INSTANTIATIONS + DROPOUT_INSTANTIATIONS
                  + VARIANT_WIDE_INSTANTIATIONS + FIXED_MAX_INSTANTIATIONS + CAUSAL_VARIANT_INSTANTIATIONS
                  + CAUSAL_FIXED_MAX_INSTANTIATIONS + PACKED_VARIANT_INSTANTIATIONS + VARLEN_DROPOUT_INSTANTIATIONS)
# Tuning candidates: the dense extras, and the varlen kernel at every registered dense config (a
# persistent config is the same kernel as its one-CTA-per-tile twin: a launch choice).
TUNING = tuple(e for e in _expressions((d, causal, True, cfg) for (d, causal), extra in EXTRA_BF16.items()
                                       for cfg in extra) if e not in INSTANTIATIONS) + tuple(dict.fromkeys(
    varlen_expression(d, cfg, causal, True) for (d, causal) in DEFAULTS for cfg in configs_for(d, causal, True)
    if varlen_expression(d, cfg, causal, True) not in VARLEN_INSTANTIATIONS))

FAMILIES = (Family(FAMILY_NAME, SOURCE, INSTANTIATIONS, archs=("sm_90a",), tuning=TUNING),)


def packable(group: int, block_m: int = BLOCK_M) -> bool:
    """Whether a tile of block_m rows can hold `group` heads x block_m / group positions: the
    group divides block_m, and each consumer's 64 rows (its O store, one TMA box) are whole heads'
    position runs or one head's (block_m / group a multiple or a divisor of 64)."""
    if group < 1 or block_m % group:
        return False
    rows = block_m // group
    return rows % 64 == 0 or 64 % rows == 0


def gqa_pack(heads: int, kv_heads: int, seqlen_q: int, block_m: int = BLOCK_M) -> int:
    """How many query heads one tile packs: G = heads / kv_heads when G > 1 is packable into a
    block_m-row tile and G heads x block_m/G positions pad fewer query rows than block_m positions
    of one head (few queries per head, e.g. decode: Nq = 1 pads 127 of 128 rows unpacked, 128/G - 1
    packed), else 1."""
    group = heads // kv_heads
    if group <= 1 or not packable(group, block_m):
        return 1
    rows = block_m // group
    return group if -(-seqlen_q // rows) * rows < -(-seqlen_q // block_m) * block_m else 1


@dataclass(frozen=True)
class _Geometry:
    """What a launch needs besides the tensors: GQA pack, tile count, TMA boxes (outermost first:
    batch, head, rows, 64 columns) for q, k, v, out, and the causal tile order's L2 group."""

    pack: int
    tiles: int
    boxes: tuple[tuple[int, int, int, int], ...]
    l2_group: int


def l2_group_size(seqlen_k: int, head_dim: int, units: int, l2_bytes: int) -> int:
    """(batch, head group) units whose K and V (16-bit) fit in half the L2 together: the causal
    tile order runs that many units' tiles longest first before moving on (at least 1)."""
    kv_bytes = max(seqlen_k, 1) * head_dim * 2 * 2
    return max(1, min(units, (l2_bytes // 2) // kv_bytes))


@lru_cache(maxsize=None)
def _l2_bytes(device_index: int) -> int:
    props = torch.cuda.get_device_properties(device_index)
    return int(getattr(props, "L2_cache_size", 50 << 20))  # 60 MB on an H200


def _geometry(batch: int, heads: int, kv_heads: int, seqlen_q: int, seqlen_k: int, head_dim: int,
              config: Sm90Config, pack_gqa: bool | None, l2_bytes: int) -> _Geometry:
    group = heads // kv_heads
    block_m = config.block_m
    if pack_gqa is None:
        pack = gqa_pack(heads, kv_heads, seqlen_q, block_m)
    elif pack_gqa and group > 1:
        if not packable(group, block_m):
            raise ValueError(f"pack_gqa: H / Hkv ({group}) must divide {block_m} query rows into runs that are a "
                             f"multiple or a divisor of 64 ({config})")
        pack = group
    else:
        pack = 1
    rows = block_m // pack                 # positions per tile and head
    o_rows = min(rows, 64)                 # a consumer stores 64 tile rows: o_rows positions x 64/o_rows heads
    boxes = ((1, pack, rows, PANEL), (1, 1, config.block_n, PANEL), (1, 1, config.block_n, PANEL),
             (1, 64 // o_rows, o_rows, PANEL))
    units = (heads // pack) * batch
    return _Geometry(pack, -(-seqlen_q // rows) * units, boxes, l2_group_size(seqlen_k, head_dim, units, l2_bytes))


def _scalar_args(batch: int, heads: int, kv_heads: int, geo: _Geometry, seqlen_q: int, seqlen_k: int,
                 scale: float) -> tuple:
    """The kernel's parameters after lse: batches, heads, kv_group, pack, l2_group, Nq, Nk,
    scale * log2(e)."""
    return (np.int32(batch), np.int32(heads), np.int32(heads // kv_heads), np.int32(geo.pack), np.int32(geo.l2_group),
            np.int32(seqlen_q), np.int32(seqlen_k), np.float32(scale * LOG2E))


def _tile_counter(persistent: bool, device_index: int) -> int:
    """The kernel's tile_counter argument: a persistent grid takes its tiles from the current
    stream's counter pair (runtime.stream_counters), one CTA per tile needs none (0)."""
    if not persistent:
        return 0
    from ..runtime import stream_counters

    return stream_counters(device_index)


def _kernel_runs(head_dim: int, dtype, device) -> bool:
    """The conditions every layout of this kernel shares: head_dim in HEAD_DIMS, dtype fp16/bf16 and,
    when a device is given, a CUDA device of compute capability 9.0. Never raises."""
    if head_dim not in HEAD_DIMS or dtype not in (torch.float16, torch.bfloat16):
        return False
    if device is not None:
        device = torch.device(device)
        return device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0)
    return True


def supports(head_dim: int, dtype, *, device=None, seqlen_q: int | None = None, seqlen_k: int | None = None,
             batch: int | None = None, heads: int | None = None) -> bool:
    """Whether launch_forward_sm90 can run this call: head_dim in HEAD_DIMS, dtype fp16/bf16, and,
    when given, a device of compute capability 9.0, sequence lengths >= 0 and at most 2^30
    query tiles (ceil(seqlen_q / 128) * heads * batch, unpacked). Never raises."""
    if not _kernel_runs(head_dim, dtype, device):
        return False
    if (seqlen_q is not None and seqlen_q < 0) or (seqlen_k is not None and seqlen_k < 0):
        return False
    if None not in (seqlen_q, batch, heads) and -(-seqlen_q // BLOCK_M) * heads * batch > MAX_TILES:
        return False
    return True


def supports_dropout(head_dim: int, dtype, variants) -> bool:
    """Whether ForwardPlan(variants=variants) has an instantiation for this dense call with
    dropout_p > 0 (attention_fwd_sm80.VariantArgs): dtype fp16/bf16 and dropout_kernel_flags finds
    one for head_dim and variant_flags(variants). False for dropout_p = 0 (not a dropout call).
    Never raises."""
    if dtype not in (torch.float16, torch.bfloat16) or not variants.dropout_p > 0:
        return False
    return dropout_kernel_flags(head_dim, variant_flags(variants)) is not None


def tuning_candidates(head_dim: int, causal: bool, dtype) -> tuple[Sm90Config, ...]:
    """Configs registered for (head dim, causal, dtype), default first: what a tuning bench times."""
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"head_dim {head_dim} is not supported by the sm90 forward; supported: {HEAD_DIMS}")
    if dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"dtype must be torch.float16 or torch.bfloat16, got {dtype}")
    return configs_for(head_dim, bool(causal), dtype == torch.bfloat16)


# (device index, expression) -> (LoadedKernel, smem bytes); filled on first use.
_loaded: dict[tuple[int, str], tuple] = {}


def _kernel(device_index: int, head_dim: int, config: Sm90Config, causal: bool, bf16: bool):
    expr = expression(head_dim, config, causal, bf16)
    hit = _loaded.get((device_index, expr))
    if hit is None:
        from ..runtime import load_kernel
        from . import family

        fam = family(FAMILY_NAME)
        with torch.cuda.device(device_index):
            kern = load_kernel(fam.path, fam.require(expr))
            smem = config.smem_bytes(head_dim)
            kern.reserve_dynamic_smem(smem)
        hit = (kern, smem)
        _loaded[(device_index, expr)] = hit
    return hit


def _tma_ready(t: torch.Tensor) -> bool:
    """Whether TMA can describe t in place: every dimension longer than 1 has a positive stride
    that is a multiple of 16 bytes and below 2^40 bytes (size-1 dimensions are fixed up by
    tensor_map), the last dim contiguous, the base 16-byte aligned."""
    elem = t.element_size()
    if t.stride(-1) != 1 or t.data_ptr() % 16:
        return False
    return all(size == 1 or (0 < stride * elem < 2**40 and (stride * elem) % 16 == 0)
               for size, stride in zip(t.shape[:-1], t.stride()[:-1]))


def launch_forward_sm90(q, k, v, out, lse, *, causal: bool, scale: float, config: Sm90Config | None = None,
                        pack_gqa: bool | None = None) -> None:
    """out, lse <- attention(q, k, v) with the Hopper kernel, on the current CUDA stream of q's device.

    q [B, H, Nq, d], k/v [B, Hkv, Nk, d], out [B, H, Nq, d]: one dtype (torch.float16 or
    torch.bfloat16), d in HEAD_DIMS, H a multiple of Hkv, last dim contiguous; any other strides
    (tensors TMA cannot describe in place are copied, see the module docstring). lse [B, H, Nq]
    float32 contiguous, written in natural-log units (-inf for rows that see no key, whose out
    rows are 0). `scale` (> 0) multiplies q . k; causal is aligned bottom-right. `config` forces a
    registered tile configuration (see tuning_candidates). `pack_gqa` forces GQA packing on or off
    (None: gqa_pack decides). Nq = 0 launches nothing.
    Needs a compute capability 9.0 GPU (supports() says whether a call can run here).
    This is the launch layer: beyond the checks below it trusts its caller (tileattn.api checks
    arguments). Raises ValueError for an unsupported head dim or dtype, H not a multiple of Hkv,
    pack_gqa=True with H / Hkv not dividing 128, or more than 2^30 query tiles; TensorMapError (a
    ValueError) if the driver refuses a tensor map.
    """
    from ..runtime import device_sm_count, launch, tensor_map

    batch, heads, seqlen_q, head_dim = q.shape
    kv_heads, seqlen_k = k.shape[1], k.shape[2]
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"head_dim {head_dim} is not supported by the sm90 forward; supported: {HEAD_DIMS}")
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"q.dtype must be torch.float16 or torch.bfloat16, got {q.dtype}")
    if kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"q heads ({heads}) must be a multiple of k/v heads ({kv_heads})")
    if seqlen_q == 0 or batch == 0 or heads == 0:
        return
    if config is None:
        config = default_config(head_dim, causal, seqlen_k, seqlen_q=seqlen_q, heads=heads, kv_heads=kv_heads,
                                pack_gqa=pack_gqa)
    geo = _geometry(batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim, config, pack_gqa, _l2_bytes(q.device.index))
    if geo.tiles > MAX_TILES:
        raise ValueError(f"{geo.tiles} query tiles (ceil(Nq / ({config.block_m} / pack)) * H / pack * B); at most {MAX_TILES}")
    kern, smem = _kernel(q.device.index, head_dim, config, bool(causal), q.dtype == torch.bfloat16)

    q = q if _tma_ready(q) else q.contiguous()
    if seqlen_k == 0:  # TMA cannot describe an empty tensor; no key is seen: a 1-key dummy, all masked
        k = v = torch.zeros(batch, kv_heads, 1, head_dim, device=q.device, dtype=q.dtype)
    k = k if _tma_ready(k) else k.contiguous()
    v = v if _tma_ready(v) else v.contiguous()
    target = out if _tma_ready(out) else torch.empty_like(out, memory_format=torch.contiguous_format)
    maps = [tensor_map(t, box) for t, box in zip((q, k, v, target), geo.boxes)]  # 128B swizzle, zero fill
    grid = (min(geo.tiles, device_sm_count(q.device.index)) if config.persistent else geo.tiles, 1, 1)
    args = (*maps, lse.data_ptr(), *_scalar_args(batch, heads, kv_heads, geo, seqlen_q, seqlen_k, scale),
            _tile_counter(config.persistent, q.device.index))
    launch(kern, grid, (config.threads, 1, 1), args, smem=smem)
    if target is not out:
        out.copy_(target)


class ForwardPlan:
    """The Hopper forward for tensors of fixed shapes, strides, dtype and device (arguments
    already validated by tileattn.api): tensor-map templates for q, k, v, out (only the address
    changes from call to call; maps are cached per address) and a LaunchPlan whose dynamic
    parameters are the four maps and lse's pointer. Tensors TMA cannot describe in place (decided
    here, once, from the strides) are copied on each launch, as launch_forward_sm90 does.

    `variants` (attention_fwd_sm80.VariantArgs with causal folded into the window; causal must then
    be False): the variant kernel of variant_flags(variants) runs, or the plain non-causal one when
    that is 0, and launch takes four more values: the ALiBi slopes' pointer (0: none), the
    dropout seed and offset (ints in [0, 2^64); the mask is tileattn.dropout.dropout_mask(seed,
    offset, B, H, Nq, Nk, p), kept values scaled by 1 / (1 - p), lse that of the undropped
    softmax) and the pointer of a device [seed, offset] that replaces them (0: none).
    fixed_max: run softcap with the fixed row max (FIXED_MAX kernels), which needs
    fixed_max_applies (variant_config then picks the fixed-max tile: FIXED_MAX_WIDE's where it lists the
    head dim and the call takes three consumers). causal_kernel: run a causal call with ALiBi or softcap alone
    (causal_variant_flags) on the kCausal kernel (causal_variant_config's tile) instead of the
    windowed one; both together: causal bf16 softcap with the fixed max on the kCausal kernel
    (CAUSAL_FIXED_MAX_INSTANTIATIONS). Raises ValueError for causal with variants, dropout_p > 0 with
    a head dim / flag set that has no dropout instantiation (supports_dropout), fixed_max where it
    does not apply, or causal_kernel for variants or a head dim it does not cover
    (CAUSAL_VARIANT_HEAD_DIMS)."""

    def __init__(self, q, k, v, out, lse, *, causal: bool, scale: float, config: Sm90Config | None = None,
                 pack_gqa: bool | None = None, variants=None, fixed_max: bool = False, causal_kernel: bool = False):
        from ..runtime import LaunchPlan, TensorMapTemplate, device_sm_count
        from . import load

        batch, heads, seqlen_q, head_dim = q.shape
        kv_heads, seqlen_k = k.shape[1], k.shape[2]
        flags = 0
        if variants is not None:
            if causal:
                raise ValueError("causal must be folded into the window (causal=False) with variants")
            flags = variant_flags(variants)
            if flags & DROPOUT:
                kernel_flags = dropout_kernel_flags(head_dim, flags)
                if kernel_flags is None:
                    raise ValueError(f"the sm90 forward has no dropout instantiation for head_dim {head_dim} with "
                                     f"variant flags {flags}; registered: {DROPOUT_FLAG_SETS}")
                flags = kernel_flags
        if causal_kernel:
            causal_flags = None if variants is None else causal_variant_flags(variants)
            if causal_flags is None or head_dim not in CAUSAL_VARIANT_HEAD_DIMS:
                raise ValueError(f"causal_kernel: ALiBi or softcap alone with the causal window at head dims "
                                 f"{CAUSAL_VARIANT_HEAD_DIMS} only (variant flags {flags}, head_dim {head_dim})")
            flags, causal = causal_flags, True
            config = config or causal_variant_config(head_dim, seqlen_k, seqlen_q=seqlen_q, heads=heads,
                                                     kv_heads=kv_heads, pack_gqa=pack_gqa, softcap=flags == SOFTCAP)
        if fixed_max:
            if variants is None or not fixed_max_applies(q.dtype, flags, variants.softcap, seqlen_k):
                raise ValueError(f"fixed_max: bf16 softcap alone or with a window, 2 cap log2(e) + log2(Nk) <= "
                                 f"{FIXED_MAX_LOG2_BUDGET} (variant flags {flags}, dtype {q.dtype}, Nk {seqlen_k})")
            flags |= FIXED_MAX
        if config is None and flags:  # variant kernels exist at VARIANT_DEFAULTS' tiles (ALiBi or softcap alone: and VARIANT_WIDE's)
            config = variant_config(head_dim, flags, seqlen_k, seqlen_q=seqlen_q, heads=heads, kv_heads=kv_heads,
                                    pack_gqa=pack_gqa)
        config = config or default_config(head_dim, causal, seqlen_k, seqlen_q=seqlen_q, heads=heads,
                                          kv_heads=kv_heads, pack_gqa=pack_gqa)
        self.copy_q, self.copy_k, self.copy_v = (not _tma_ready(t) for t in (q, k, v))
        self.copy_out = not _tma_ready(out)
        dense = [t.contiguous() if copy else t for t, copy in ((q, self.copy_q), (k, self.copy_k), (v, self.copy_v))]
        target = torch.empty_like(out, memory_format=torch.contiguous_format) if self.copy_out else out
        geo = _geometry(batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim, config, pack_gqa,
                        _l2_bytes(q.device.index))
        self.templates = tuple(TensorMapTemplate(t, box) for t, box in zip((*dense, target), geo.boxes))
        maps = [t.encode(x.data_ptr()) for t, x in zip(self.templates, (*dense, target))]
        bf16 = q.dtype == torch.bfloat16
        expr = (variant_expression(head_dim, config, bf16, flags, causal=causal_kernel) if flags
                else expression(head_dim, config, bool(causal), bf16))
        kern = load(FAMILY_NAME, expr, q.device.index)
        grid = (min(geo.tiles, device_sm_count(q.device.index)) if config.persistent else geo.tiles,)
        self.config, self.device_index = config, q.device.index
        args = (*maps, lse.data_ptr(), *_scalar_args(batch, heads, kv_heads, geo, seqlen_q, seqlen_k, scale),
                _tile_counter(config.persistent, q.device.index))
        dynamic = (*range(5), TILE_COUNTER_ARG)
        if flags:  # VARIANT_PARAMS after the plain ones; alibi pointer, seed, offset, rng state are per call
            from .attention_fwd_sm80 import VARIANT_DYNAMIC

            dynamic += tuple(len(args) + i for i in VARIANT_DYNAMIC)
            args += variants.kernel_args(scale)
        self.variant_values = bool(flags)  # whether launch passes on (alibi, seed, offset, rng state)
        self.plan = LaunchPlan(kern, grid, (config.threads,), args, smem=config.smem_bytes(head_dim), dynamic=dynamic)

    def launch(self, q, k, v, out, lse, *extra) -> None:
        """Launch on q, k, v, out, lse; with variants `extra` = (alibi pointer, seed, offset, rng state pointer), which
        a plan without variant kernel (flags 0) ignores."""
        tq, tk, tv, to = self.templates
        if self.copy_q:
            q = q.contiguous()
        if self.copy_k:
            k = k.contiguous()
        if self.copy_v:
            v = v.contiguous()
        target = torch.empty_like(out, memory_format=torch.contiguous_format) if self.copy_out else out
        self.plan.launch(tq.encode(q.data_ptr()), tk.encode(k.data_ptr()), tv.encode(v.data_ptr()),
                         to.encode(target.data_ptr()), lse.data_ptr(),
                         _tile_counter(self.config.persistent, self.device_index),
                         *(extra if self.variant_values else ()))
        if self.copy_out:
            out.copy_(target)

    def host_slots(self):
        """(LaunchPlan, slots) for runtime.host_launch, or None for a plan it cannot run (one that
        copies an operand, or a variant kernel's per-call values): four tensor maps of q, k, v, out
        with their templates' encoders, lse's pointer, and a persistent grid's tile-counter pair (a
        one-CTA-per-tile grid keeps its packed 0)."""
        from ..runtime import host_launch as hl

        if self.copy_q or self.copy_k or self.copy_v or self.copy_out or self.variant_values:
            return None
        params = self.plan.dynamic
        slots = [(hl.TENSOR_MAP, params[source], source, template.encode)
                 for source, template in zip((hl.Q, hl.K, hl.V, hl.OUT), self.templates)]
        slots.append((hl.POINTER, params[4], hl.LSE, None))
        if self.config.persistent:
            slots.append((hl.TILE_COUNTER, params[5], -1, None))
        return self.plan, tuple(slots)


# ---- variable-length batches --------------------------------------------------------------------
def _packed_view(t: torch.Tensor) -> torch.Tensor:
    """[T, H, d] -> the [1, H, T, d] view the kernel's 4-D tensor maps describe (no copy)."""
    return t.permute(1, 0, 2).unsqueeze(0)


def _packed_grid(tiles: int, config: Sm90Config, device_index: int) -> int:
    """CTAs of a varlen / paged launch: one per tile, or one per SM for a persistent config; at
    least one (every CTA's consumer warpgroups also write a share of the rows past the last
    sequence after their tiles, which must happen even with no tile)."""
    from ..runtime import device_sm_count

    return max(1, min(tiles, device_sm_count(device_index)) if config.persistent else tiles)


def supports_varlen(head_dim: int, dtype, *, device=None, tensors=(), batch: int | None = None,
                    heads: int | None = None, max_seqlen_q: int | None = None) -> bool:
    """Whether forward_varlen_plan can run this call: head_dim in HEAD_DIMS, dtype fp16/bf16, and,
    when given, a device of compute capability 9.0, packed [T, H, d] `tensors` (q, k, v, out) that
    TMA can describe in place (16-byte aligned base, token and head strides multiples of 16 bytes,
    below 2^40 bytes; the plan cannot copy: it is launched with bare pointers), and at most 2^30
    query tiles (ceil(max_seqlen_q / 128) * heads * batch). Never raises."""
    if not _kernel_runs(head_dim, dtype, device):
        return False
    if any(t.dim() != 3 or (t.shape[0] > 0 and not _tma_ready(_packed_view(t))) for t in tensors):
        return False
    if None not in (batch, heads, max_seqlen_q) and -(-max_seqlen_q // BLOCK_M) * heads * batch > MAX_TILES:
        return False
    return True


class VarlenPlan:
    """The Hopper forward for packed variable-length batches of fixed shapes, strides, dtype and
    device (see forward_varlen_plan): tensor-map templates for q, k, v, out (maps cached per
    address) and a LaunchPlan whose dynamic parameters are the four maps, lse's, cu_seqlens_q's,
    cu_seqlens_k's and out's pointers (and, with variants, the ALiBi slopes')."""

    def __init__(self, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, *, causal: bool,
                 scale: float, config: Sm90Config | None = None, pack_gqa: bool | None = None, variants=None):
        from ..runtime import LaunchPlan, TensorMapTemplate
        from . import load

        total_q, heads, head_dim = q.shape
        total_k, kv_heads = k.shape[0], k.shape[1]
        batch = cu_seqlens_q.shape[0] - 1
        if head_dim not in HEAD_DIMS:
            raise ValueError(f"head_dim {head_dim} is not supported by the sm90 forward; supported: {HEAD_DIMS}")
        if q.dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"q.dtype must be torch.float16 or torch.bfloat16, got {q.dtype}")
        for name, t in (("k", k), ("v", v), ("out", out)):
            if t.dtype != q.dtype:
                raise ValueError(f"{name}.dtype ({t.dtype}) must be q's ({q.dtype})")
        if kv_heads < 1 or heads % kv_heads:
            raise ValueError(f"q heads ({heads}) must be a multiple of k/v heads ({kv_heads})")
        if max_seqlen_q < 0 or batch < 0:
            raise ValueError(f"max_seqlen_q ({max_seqlen_q}) and the number of sequences ({batch}) must be >= 0")
        flags = _packed_variant_flags(variants, causal, head_dim, VARLEN)
        config = config or (packed_variant_config(head_dim, flags) if flags else VARLEN_DEFAULTS[(head_dim, bool(causal))])
        for name, t in (("q", q), ("k", k), ("v", v), ("out", out)):
            if t.shape[0] > 0 and not _tma_ready(_packed_view(t)):
                raise ValueError(f"{name} (shape {tuple(t.shape)}, strides {t.stride()}) is not TMA-describable: "
                                 "token and head strides must be multiples of 16 bytes, the base 16-byte aligned")
        self.plan = None
        self.dummy_kv = None
        if total_q == 0:
            return  # no token: nothing to launch
        if total_k == 0:  # TMA cannot describe an empty tensor; every sequence then has no key
            self.dummy_kv = torch.zeros(1, kv_heads, head_dim, device=q.device, dtype=q.dtype)
            k = v = self.dummy_kv
        mean_k = max(1, total_k // max(batch, 1))  # the causal tile order's L2 grouping: typical K/V length
        geo = _geometry(max(batch, 0), heads, kv_heads, max_seqlen_q, mean_k, head_dim, config, pack_gqa,
                        _l2_bytes(q.device.index))
        if geo.tiles > MAX_TILES:
            raise ValueError(f"{geo.tiles} query tiles (ceil(max_seqlen_q / (128 / pack)) * H / pack * B); "
                             f"at most {MAX_TILES}")
        views = [_packed_view(t) for t in (q, k, v, out)]
        self.templates = tuple(TensorMapTemplate(t, box) for t, box in zip(views, geo.boxes))
        maps = [tmpl.encode(t.data_ptr()) for tmpl, t in zip(self.templates, views)]
        bf16 = q.dtype == torch.bfloat16
        expr = (packed_variant_expression(head_dim, config, bf16, VARLEN, flags) if flags
                else varlen_expression(head_dim, config, bool(causal), bf16))
        kern = load(FAMILY_NAME, expr, q.device.index)
        self.persistent, self.device_index = config.persistent, q.device.index
        args = (*maps, lse.data_ptr(), *_scalar_args(batch, heads, kv_heads, geo, max_seqlen_q, 0, scale),
                _tile_counter(config.persistent, q.device.index), cu_seqlens_q.data_ptr(), cu_seqlens_k.data_ptr(),
                out.data_ptr(), np.int64(out.stride(0)), np.int64(out.stride(1)), np.int32(total_q))
        dynamic = (0, 1, 2, 3, 4, TILE_COUNTER_ARG, 14, 15, 16)
        self.variant_values = 4 if flags & DROPOUT else 1 if flags else 0  # per-call values launch passes on
        if flags:  # VARIANT_PARAMS after VARLEN_PARAMS; the slopes' pointer (their first) is per call, and
            # with dropout the seed, offset and rng state pointer (VARIANT_DYNAMIC) too
            from .attention_fwd_sm80 import VARIANT_DYNAMIC

            dynamic += tuple(len(args) + i for i in VARIANT_DYNAMIC[:self.variant_values])
            args += variants.kernel_args(scale)
        self.grid = (_packed_grid(geo.tiles, config, q.device.index),)
        self.plan = LaunchPlan(kern, self.grid, (config.threads,), args, smem=config.smem_bytes(head_dim),
                               dynamic=dynamic)

    def launch(self, q_ptr: int, k_ptr: int, v_ptr: int, out_ptr: int, lse_ptr: int, cu_seqlens_q_ptr: int,
               cu_seqlens_k_ptr: int, alibi_ptr: int = 0, seed: int = 0, offset: int = 0,
               rng_state_ptr: int = 0) -> None:
        """Launch on tensors at these addresses (the layouts the plan was made for), on the current
        stream: the signature of attention_fwd_sm80.forward_varlen_plan's LaunchPlan.launch. A plan
        with variants takes the ALiBi slopes' address (0: none), one with dropout the seed, offset and
        the rng state's address (0: none; a kRngState plan reads the seed and offset there); a plan
        without dropout refuses non-zero dropout values."""
        if self.plan is None:
            return
        if self.variant_values < 4 and (seed or offset or rng_state_ptr):
            raise ValueError("this sm90 varlen plan has no dropout: seed, offset and rng_state_ptr must be 0")
        if self.dummy_kv is not None:
            k_ptr = v_ptr = self.dummy_kv.data_ptr()
        tq, tk, tv, to = self.templates
        self.plan.launch(tq.encode(q_ptr), tk.encode(k_ptr), tv.encode(v_ptr), to.encode(out_ptr), lse_ptr,
                         _tile_counter(self.persistent, self.device_index), cu_seqlens_q_ptr,
                         cu_seqlens_k_ptr, out_ptr, *(alibi_ptr, seed, offset, rng_state_ptr)[:self.variant_values])


def forward_varlen_plan(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, *, causal: bool,
                        scale: float, config: Sm90Config | None = None, pack_gqa: bool | None = None,
                        variants=None) -> VarlenPlan:
    """A plan computing out, lse <- attention_varlen(q, k, v) with the Hopper kernel for tensors of
    these shapes, strides, dtype and device and batches of len(cu_seqlens_q) - 1 sequences whose
    longest query has max_seqlen_q tokens. Launch it with the data pointers of q, k, v, out, lse,
    cu_seqlens_q, cu_seqlens_k (in that order), as attention_fwd_sm80.forward_varlen_plan's.

    q [Tq, H, d], k/v [Tk, Hkv, d], out [Tq, H, d]: one 16-bit dtype, d in HEAD_DIMS, H a multiple
    of Hkv, stride(-1) == 1, token and head strides multiples of 16 bytes, 16-byte aligned
    (supports_varlen says whether a call fits); lse [H, Tq] fp32 contiguous (natural log);
    cu_seqlens_q / cu_seqlens_k int32 [B + 1] contiguous on q's device. Causal is bottom-right per
    sequence; a sequence of length 0 writes nothing; rows past cu_seqlens_q[B] get out 0 and lse
    -inf; a sequence longer than max_seqlen_q is cut. `config` forces a registered tile config (a
    persistent one launches one CTA per SM, which walk the tiles and skip the empty ones at the
    cost of an L1 hit); `pack_gqa` forces GQA packing (None: gqa_pack on max_seqlen_q).
    `variants`: None, or an attention_fwd_sm80.VariantArgs (window edges with causal folded in, so
    causal False; softcap; the ALiBi slopes' batch stride, slopes [B, H] or [H] fp32; dropout where
    packed_kernel_flags finds a kernel): the packed variant kernel at packed_variant_config's tile,
    whose launch then takes the slopes' address after cu_seqlens_k's, and with dropout the seed, offset
    and rng state address (the mask of tileattn.dropout.dropout_mask per sequence, batch_start = its
    index; lse undropped). Needs a compute capability 9.0 GPU. Raises ValueError for an unsupported
    head dim or dtype, mixed dtypes, H not a multiple of Hkv, a tensor TMA cannot describe in place,
    more than 2^30 query tiles, causal with variants, or a variant set without a kernel;
    TensorMapError (a ValueError) if the driver refuses a map.
    """
    return VarlenPlan(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, causal=causal, scale=scale,
                      config=config, pack_gqa=pack_gqa, variants=variants)


# ---- paged K/V cache (prefill) ----------------------------------------------------------------------
MIN_PAGED_QUERIES = 64  # below this many queries per sequence a 128-row tile is mostly padding: sm80's decode path


def _cache_view(cache: torch.Tensor) -> torch.Tensor:
    """[num_blocks, block_size, Hkv, d] -> the [num_blocks, Hkv, block_size, d] view the kernel's
    cache maps describe (coordinates: column, row in the block, KV head, block id; no copy)."""
    return cache.permute(0, 2, 1, 3)


def supports_paged(head_dim: int, dtype, *, block_size: int, max_seqlen_q: int, batch: int, heads: int,
                   kv_heads: int, total_q: int | None = None, device=None, tensors=(),
                   min_tiles: int | None = None) -> bool:
    """Whether PagedPlan should run this call instead of the sm80 paged kernel: head_dim in HEAD_DIMS,
    dtype fp16/bf16, block_size a power of two in 16..256, at least MIN_PAGED_QUERIES queries in the
    longest sequence and, given total_q (q.shape[0]), on average per sequence (a prefill chunk
    batched with many decodes would give each decode a 128-row tile and a full K/V pass), and at
    least `min_tiles` query tiles (default: the device's SM count, 132 without a device): below
    that the sm80 kernel's split-KV fills the GPU better (this kernel has no split). With a device,
    compute capability 9.0; `tensors` (q [Tq, H, d], k_cache, v_cache, out) must be
    TMA-describable in place. Never raises."""
    if not _kernel_runs(head_dim, dtype, device):
        return False
    if block_size not in PAGED_BLOCK_SIZES or max_seqlen_q < MIN_PAGED_QUERIES or kv_heads < 1 or heads % kv_heads:
        return False
    if total_q is not None and total_q < MIN_PAGED_QUERIES * batch:
        return False
    if device is not None and min_tiles is None:
        from ..runtime import device_sm_count

        device = torch.device(device)
        min_tiles = device_sm_count(device.index if device.index is not None else torch.cuda.current_device())
    pack = gqa_pack(heads, kv_heads, max_seqlen_q)
    tiles = -(-max_seqlen_q * pack // BLOCK_M) * (heads // pack) * batch
    if not (min_tiles or 132) <= tiles <= MAX_TILES:
        return False
    for t in tensors:
        if t.numel() == 0 or not _tma_ready(_cache_view(t) if t.dim() == 4 else _packed_view(t)):
            return False
    return True


class PagedPlan:
    """The Hopper forward of packed queries against a paged K/V cache (prefill chunks after a cached
    prefix), for one (device, dtype, shapes, strides, flags) combination: the calling shape of
    attention_paged_sm80.PagedLaunch (made the same way, called with the tensors), without split-KV.

    q [Tq, H, d] (token and head strides multiples of 16 bytes); k_cache / v_cache
    [num_blocks, block_size, Hkv, d] (any strides TMA can describe: multiples of 16 bytes);
    block_table int32 [B, max_blocks] (stride(1) == 1); cu_seqlens_q int32 [B + 1] and seqlens_k
    int32 [B] contiguous: key j of sequence b is row j % block_size of cache block
    block_table[b, j // block_size], its queries are its last keys (causal bottom-right). Keys past
    the table's capacity or in a block id outside [0, num_blocks) are masked and never read; rows past
    cu_seqlens_q[B] get out 0, lse -inf. `variants`: None, or an attention_fwd_sm80.VariantArgs
    without dropout (causal folded into the window, so causal False): the packed variant kernel at
    packed_variant_config's tile, called with the slopes as PagedLaunch is. Raises ValueError for what the
    kernel cannot run (head dim, dtype, block_size not a power of two in 16..256, num_splits > 1,
    causal with variants, dropout, layouts TMA cannot describe, an empty cache, more than 2^30
    tiles). A persistent config launches one CTA per SM."""

    def __init__(self, q, k_cache, v_cache, block_table, *, max_seqlen_q: int, causal: bool, scale: float,
                 return_lse: bool, num_splits: int | None = None, config: Sm90Config | None = None, variants=None,
                 pack_gqa: bool | None = None):
        from ..runtime import LaunchPlan, TensorMapTemplate
        from . import load

        total_q, heads, head_dim = q.shape
        num_blocks, block_size, kv_heads, _ = k_cache.shape
        batch, max_blocks = block_table.shape
        if head_dim not in HEAD_DIMS:
            raise ValueError(f"head_dim {head_dim} is not supported by the sm90 forward; supported: {HEAD_DIMS}")
        if q.dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"q.dtype must be torch.float16 or torch.bfloat16, got {q.dtype}")
        for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
            if t.dtype != q.dtype or t.shape != k_cache.shape:
                raise ValueError(f"{name} ({tuple(t.shape)}, {t.dtype}) must match k_cache's shape and q's dtype")
        if kv_heads < 1 or heads % kv_heads:
            raise ValueError(f"q heads ({heads}) must be a multiple of k/v heads ({kv_heads})")
        if block_size not in PAGED_BLOCK_SIZES:
            raise ValueError(f"block_size must be a power of two in 16..256, got {block_size}")
        if num_blocks == 0:
            raise ValueError("the cache has no block (num_blocks = 0)")
        if num_splits not in (None, 1):
            raise ValueError(f"the sm90 paged forward has no split-KV (num_splits {num_splits}); use the sm80 kernel")
        flags = _packed_variant_flags(variants, causal, head_dim, PAGED)
        config = config or (packed_variant_config(head_dim, flags) if flags else PAGED_DEFAULTS[(head_dim, bool(causal))])
        views = (_packed_view(q), _cache_view(k_cache), _cache_view(v_cache))
        for name, t in zip(("q", "k_cache", "v_cache"), views):
            if t.numel() and not _tma_ready(t):
                raise ValueError(f"{name} (shape {tuple(t.shape)}) is not TMA-describable: strides must be multiples "
                                 "of 16 bytes, the base 16-byte aligned")
        self.num_splits = 1
        self.config = config
        self.variants = variants if flags else None
        self.out_shape = (total_q, heads, head_dim)
        self.lse_shape = (heads, total_q)
        self.return_lse = return_lse
        self.device = q.device
        self.plan = None
        if total_q == 0:
            return
        geo = _geometry(batch, heads, kv_heads, max_seqlen_q, max_blocks * block_size, head_dim, config, pack_gqa,
                        _l2_bytes(q.device.index))
        if geo.tiles > MAX_TILES:
            raise ValueError(f"{geo.tiles} query tiles; at most {MAX_TILES}")
        kv_box = (1, 1, min(block_size, config.block_n), PANEL)
        out = torch.empty(self.out_shape, dtype=q.dtype, device=q.device)  # the layout __call__ allocates
        self.templates = tuple(TensorMapTemplate(t, box) for t, box in zip(
            (*views, _packed_view(out)), (geo.boxes[0], kv_box, kv_box, geo.boxes[3])))
        maps = [tmpl.encode(t.data_ptr()) for tmpl, t in zip(self.templates, (*views, _packed_view(out)))]
        bf16 = q.dtype == torch.bfloat16
        expr = (packed_variant_expression(head_dim, config, bf16, PAGED, flags) if flags
                else paged_expression(head_dim, config, bool(causal), bf16))
        kern = load(FAMILY_NAME, expr, q.device.index)
        i32 = np.int32
        self.persistent, self.device_index = config.persistent, q.device.index
        args = (*maps, 0, *_scalar_args(batch, heads, kv_heads, geo, max_seqlen_q, 0, scale),
                _tile_counter(config.persistent, q.device.index), 0, 0, 0, np.int64(out.stride(0)), np.int64(out.stride(1)),
                i32(total_q),
                0, i32(block_table.stride(0)), i32(max_blocks), i32(num_blocks), i32(block_size.bit_length() - 1))
        dynamic = (0, 1, 2, 3, 4, TILE_COUNTER_ARG, 14, 15, 16, 20)
        if flags:  # VARIANT_PARAMS after PAGED_PARAMS; the slopes' pointer (their first) is per call
            dynamic += (len(args),)
            args += variants.kernel_args(scale)
        self.grid = (_packed_grid(geo.tiles, config, q.device.index),)
        self.plan = LaunchPlan(kern, self.grid, (config.threads,), args, smem=config.smem_bytes(head_dim),
                               dynamic=dynamic)

    def launch(self, q_ptr: int, k_cache_ptr: int, v_cache_ptr: int, block_table_ptr: int, cu_seqlens_q_ptr: int,
               seqlens_k_ptr: int, out_ptr: int, lse_ptr: int, alibi_ptr: int = 0) -> None:
        """Launch on tensors at these addresses (the plan's layouts; out contiguous [Tq, H, d], lse
        [H, Tq] fp32, both always written) on the current stream; alibi_ptr: the slopes of a plan
        with variants (0: none; ignored without variants)."""
        if self.plan is None:
            return
        tq, tk, tv, to = self.templates
        self.plan.launch(tq.encode(q_ptr), tk.encode(k_cache_ptr), tv.encode(v_cache_ptr), to.encode(out_ptr), lse_ptr,
                         _tile_counter(self.persistent, self.device_index), cu_seqlens_q_ptr,
                         seqlens_k_ptr, out_ptr, block_table_ptr, *((alibi_ptr,) if self.variants else ()))

    def __call__(self, q, k_cache, v_cache, block_table, cu_seqlens_q, seqlens_k, out=None, lse=None,
                 alibi_slopes=None):
        """(out [Tq, H, d], lse [H, Tq] fp32, or None unless return_lse or given), launched on the
        current stream; out / lse (contiguous) are allocated with torch.empty unless given.
        `alibi_slopes`: the fp32 slopes of a plan made with an ALiBi batch stride (ignored otherwise,
        as PagedLaunch ignores them)."""
        given_lse = lse is not None
        if out is None:
            out = torch.empty(self.out_shape, dtype=q.dtype, device=self.device)
        if lse is None:  # the kernel always writes lse
            lse = torch.empty(self.lse_shape, dtype=torch.float32, device=self.device)
        alibi = 0 if alibi_slopes is None or self.variants is None else alibi_slopes.data_ptr()
        self.launch(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_table.data_ptr(),
                    cu_seqlens_q.data_ptr(), seqlens_k.data_ptr(), out.data_ptr(), lse.data_ptr(), alibi)
        return out, (lse if self.return_lse or given_lse else None)


__all__ = [
    "DEFAULTS",
    "LONG_DEFAULTS",
    "WIDE_DEFAULTS",
    "WIDE_MIN_QUERIES",
    "LONG_KEYS",
    "PERSISTENT_HEAD_DIMS",
    "default_config",
    "EXTRA_BF16",
    "FAMILIES",
    "HEAD_DIMS",
    "INSTANTIATIONS",
    "TUNING",
    "DROPOUT",
    "DROPOUT_FLAG_SETS",
    "DROPOUT_INSTANTIATIONS",
    "dropout_kernel_flags",
    "VARIANT_DEFAULTS",
    "VARIANT_INSTANTIATIONS",
    "VARIANT_WIDE",
    "VARIANT_WIDE_INSTANTIATIONS",
    "FIXED_MAX",
    "FIXED_MAX_FLAGS",
    "FIXED_MAX_INSTANTIATIONS",
    "FIXED_MAX_LOG2_BUDGET",
    "fixed_max_applies",
    "CAUSAL_VARIANT_FLAGS",
    "CAUSAL_VARIANT_HEAD_DIMS",
    "CAUSAL_VARIANT_INSTANTIATIONS",
    "CAUSAL_FIXED_MAX_INSTANTIATIONS",
    "SOFTCAP_WIDE_MIN_QUERIES",
    "FIXED_MAX_WIDE",
    "fixed_max_tile",
    "CAUSAL_VARIANT_WIDE",
    "causal_variant_config",
    "causal_variant_flags",
    "WIDE_VARIANT_FLAGS",
    "variant_config",
    "Sm90Config",
    "configs_for",
    "expression",
    "ForwardPlan",
    "gqa_pack",
    "launch_forward_sm90",
    "supports",
    "supports_dropout",
    "tuning_candidates",
    "variant_expression",
    "variant_flags",
    "PAGED_DEFAULTS",
    "PAGED_INSTANTIATIONS",
    "PagedPlan",
    "paged_expression",
    "supports_paged",
    "VARLEN_DEFAULTS",
    "VARLEN_INSTANTIATIONS",
    "VarlenPlan",
    "forward_varlen_plan",
    "supports_varlen",
    "varlen_expression",
]
