"""Attention backward on the sm_80 tensor-core path (csrc/attention_bwd_sm80.cu): registry + launcher.

Three launches per call, all on torch's current stream (no host syncs, so it is capturable by
torch.cuda.graph):

1. ``attn_bwd_preprocess_kernel<d, bf16>``: delta = rowsum(dO * O), lse2 = lse * log2(e) (+inf for
   fully masked and padding rows), and zeroes the fp32 dQ accumulator in atomic mode.
2. ``attn_bwd_main_kernel<d, BN, BM, warps, wn1, wn2, wm3, min_blocks, bf16, with_dq, unroll>``: one
   block per (key block, kv head, batch): dK and dV (GQA group summed in registers), plus dQ
   through fp32 RED when ``with_dq``.
3. atomic mode: ``attn_bwd_convert_dq_kernel<d, bf16>``: dq = scale * dq_accum in the input dtype;
   deterministic mode: ``attn_bwd_dq_kernel<d, BM, BN, bf16>``: one block per (query block, head,
   batch) recomputes P and dS and accumulates dQ in registers (no atomics: bit-identical runs).

Tile configurations come from one table per arch, ``DEFAULTS[arch]`` keyed by (head_dim, causal); fp16 and bf16
share it; ``_SMALL_SMEM`` holds the configs for GPUs with less shared memory per block than a
table entry needs (d=256 on an A100). ``tuning_candidates`` adds the runners-up of the last tuning
run per head dim. Every instantiation of every config is registered in ``FAMILIES`` so
``tileattn check`` proves it compiles with zero spills for sm_90a and sm_80.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..launch_limits import MAX_GRID_YZ
from . import Family
from .attention_fwd_sm80 import rng_template_arg

__all__ = [
    "FAMILIES",
    "FAMILY_NAME",
    "HEAD_DIMS",
    "BackwardVarlenPlan",
    "BwdConfig",
    "backward_varlen_plan",
    "default_config",
    "BackwardPlan",
    "backward_plan",
    "launch_backward",
    "precompile",
    "tuning_candidates",
    "workspace_bytes",
]

FAMILY_NAME = "attention_bwd_sm80"
SOURCE = "attention_bwd_sm80.cu"
HEAD_DIMS = (32, 64, 96, 128, 256)
_NS = "tileattn::bwd::"
# lse2 / delta workspaces are padded to a multiple of this many rows, so every query block (of any
# config: block_m and dq_block_m divide it) reads them without a bounds check.
_ROW_PAD = 128
_PRE_ROWS = 64  # rows per preprocess block (kRowsPerBlock in the kernel)
_CONVERT_ROWS = 64  # rows per convert block
# Varlen workspace rows between the starts of consecutive sequences beyond their queries (kVarlenWsGap
# in the kernel): 128-row padding plus 3 rows of 16-byte alignment, rounded up to a multiple of 4.
VARLEN_WS_GAP = 132


@dataclass(frozen=True)
class BwdConfig:
    """Tile configuration of one backward instantiation (both dtypes share it).

    Main kernel: ``block_n`` keys per block, ``block_m`` query rows per iteration, ``warps`` warps;
    warp layouts: phase 1 (S^T, dP^T) ``warps_n1`` warps along keys, phase 2 (dK, dV) ``warps_n2``
    along keys, phase 3 (dQ) ``warps_m3`` along queries; ``min_blocks`` for __launch_bounds__;
    ``unroll``: unroll factor of the k loops of phases 1 and 3 (register-pressure knob) in atomic
    mode, ``unroll_det`` the same for the deterministic mode's main kernel (no phase 3: ptxas
    allocates it differently, so it gets its own knob).
    Deterministic dQ kernel: ``dq_block_m`` query rows (dq_block_m / 16 warps), ``dq_block_n`` keys
    per step.
    """

    head_dim: int
    block_n: int
    block_m: int
    warps: int
    warps_n1: int
    warps_n2: int
    warps_m3: int
    min_blocks: int = 1
    unroll: int = 2
    unroll_det: int = 2
    dq_block_m: int = 64
    dq_block_n: int = 64

    def __post_init__(self) -> None:
        d, bn, bm, w = self.head_dim, self.block_n, self.block_m, self.warps
        checks = [
            (d in HEAD_DIMS, f"head_dim {d} not in {HEAD_DIMS}"),
            (w % self.warps_n1 == 0 and w % self.warps_n2 == 0 and w % self.warps_m3 == 0, "warp layouts"),
            (bm % 32 == 0 and _ROW_PAD % bm == 0, f"block_m {bm} must be a multiple of 32 dividing {_ROW_PAD}"),
            (self.dq_block_m % 32 == 0 and _ROW_PAD % self.dq_block_m == 0, "dq_block_m"),
            (bn % 16 == 0 and self.dq_block_n % 16 == 0, "block_n"),
        ]
        for ok, what in checks:
            if not ok:
                raise ValueError(f"invalid BwdConfig {self}: {what}")

    @property
    def name(self) -> str:
        """Short label for benchmark tables."""
        return (
            f"d{self.head_dim}_n{self.block_n}_m{self.block_m}_w{self.warps}"
            f"_l{self.warps_n1}.{self.warps_n2}.{self.warps_m3}_b{self.min_blocks}_u{self.unroll}.{self.unroll_det}"
            f"_dq{self.dq_block_m}x{self.dq_block_n}"
        )

    def main_expr(self, bf16: bool, with_dq: bool, varlen: bool = False, variants: bool = False,
                  rng_state: bool = False) -> str:
        return (
            f"{_NS}attn_bwd_main{_v(varlen)}{_var(variants)}_kernel<{self.head_dim}, {self.block_n}, {self.block_m}, {self.warps}, "
            f"{self.warps_n1}, {self.warps_n2}, {self.warps_m3}, {self.min_blocks}, {_b(bf16)}, {_b(with_dq)}, "
            f"{self.unroll if with_dq else self.unroll_det}{rng_template_arg(rng_state)}>"
        )

    def dq_expr(self, bf16: bool, varlen: bool = False, variants: bool = False, rng_state: bool = False) -> str:
        return (f"{_NS}attn_bwd_dq{_v(varlen)}{_var(variants)}_kernel<{self.head_dim}, {self.dq_block_m}, "
                f"{self.dq_block_n}, {_b(bf16)}{rng_template_arg(rng_state)}>")

    @property
    def main_threads(self) -> int:
        return 32 * self.warps

    @property
    def dq_threads(self) -> int:
        return 32 * (self.dq_block_m // 16)

    @property
    def main_smem(self) -> int:
        """Dynamic shared memory of the main kernel (MainCfg::kSmem)."""
        d, bn, bm = _pitch(self.head_dim), self.block_n, self.block_m
        return 2 * bn * d * 2 + 2 * 2 * bm * d * 2 + 2 * bn * bm * 2 + 2 * 2 * bm * 4

    @property
    def dq_smem(self) -> int:
        """Dynamic shared memory of the deterministic dQ kernel (DqCfg::kSmem)."""
        d = _pitch(self.head_dim)
        return 2 * self.dq_block_m * d * 2 + 2 * 2 * self.dq_block_n * d * 2


def _pitch(cols: int) -> int:
    """Row pitch in elements of a shared-memory tile of `cols` columns (SwizzledTile::kPitchChunks * 8):
    the power of two >= cols, so d = 96 rows take 128 elements."""
    return 1 << (cols - 1).bit_length()


def _b(x: bool) -> str:
    return "true" if x else "false"


def _v(varlen: bool) -> str:
    """Name infix of the packed variable-length entry points."""
    return "_varlen" if varlen else ""


def _var(variants: bool) -> str:
    """Name infix of the variant entry points (window, softcap, ALiBi, dropout; issue #15)."""
    return "_variants" if variants else ""


def preprocess_expr(head_dim: int, bf16: bool, varlen: bool = False) -> str:
    return f"{_NS}attn_bwd_preprocess{_v(varlen)}_kernel<{head_dim}, {_b(bf16)}>"


def convert_expr(head_dim: int, bf16: bool, varlen: bool = False) -> str:
    return f"{_NS}attn_bwd_convert_dq{_v(varlen)}_kernel<{head_dim}, {_b(bf16)}>"


# ---- the config table -------------------------------------------------------------------------
# One entry per (head_dim, causal). Register budget per thread (fp32 accumulators): dK + dV =
# 2 * block_n * d / (32 * warps) for the whole kernel, plus phase 1's dP^T block_n * block_m /
# (32 * warps) and one m16 row of S^T, or phase 3's block_m * d / (32 * warps). ptxas fills the
# rest of the 255 registers with fragments and addresses; every entry compiles with 0 spills.
# Causal and non-causal share tiles for now (causal skips whole query blocks at run time; the
# masked diagonal tiles cost the same per tile); they are separate keys so tuning can split them.
_BASE = {
    # d = 32, 96, 256: bench attention --tune --head-dim D --seq 4096 --seq 16384 (bf16, H200,
    # 2026-11-29), non-causal / causal TFLOP/s at N=4096 and 16384, docs/attention_bwd_sm80.md:
    # d=32 BM=128: 194/204, 181/201 against 167/174, 156/171 for BM=64.
    32: BwdConfig(32, block_n=128, block_m=128, warps=8, warps_n1=4, warps_n2=4, warps_m3=4, unroll=2),
    # BM=128: 249/263 TFLOP/s against 223/236 for BM=64 (N=4096/16384 non-causal bf16, H200,
    # bench attention --tune --head-dim 64, 2026-11-29, before the fragment-order dQ REDs).
    64: BwdConfig(64, block_n=128, block_m=128, warps=8, warps_n1=4, warps_n2=4, warps_m3=2, unroll=4),
    # d=96 unroll 8: 268/282, 250/278 against 267/281, 249/277 for unroll 2.
    96: BwdConfig(96, block_n=128, block_m=64, warps=8, warps_n1=4, warps_n2=4, warps_m3=4, unroll=8),
    # Phase-1 warp tile 32 keys x 32 queries (FA2's), phase-2 64 keys x 32 dims, k loops unrolled:
    # 313/330 TFLOP/s non-causal and 290/325 causal at N=4096/16384 (bf16, H200, bench attention
    # --tune, 2026-11-29); docs/attention_bwd_sm80.md has the steps that led here.
    128: BwdConfig(128, block_n=128, block_m=64, warps=8, warps_n1=4, warps_n2=2, warps_m3=2, unroll=8),
    # d=256 BM=64 unroll 4: 248/259, 237/256 against 204/212, 197/210 for BM=32 unroll 2. Its 208 KB
    # of shared memory need a Hopper-sized SM; _SMALL_SMEM below is what smaller ones get.
    256: BwdConfig(256, block_n=64, block_m=64, warps=8, warps_n1=4, warps_n2=2, warps_m3=2, unroll=4,
                   dq_block_m=64, dq_block_n=32),
}
# Used instead of the table's config on a GPU whose per-block shared memory (opt-in) is smaller than
# what the table's config needs, e.g. an A100 (163 KB) for d=256. Every table config of the other
# head dims fits 163 KB.
_SMALL_SMEM = {
    256: BwdConfig(256, block_n=64, block_m=32, warps=8, warps_n1=4, warps_n2=2, warps_m3=2, unroll=2,
                   dq_block_m=64, dq_block_n=32),
}
_H200: dict[tuple[int, bool], BwdConfig] = {(d, c): cfg for d, cfg in _BASE.items() for c in (False, True)}
# Tables keyed by arch (what tileattn.kernels.dispatch reads). sm_80 (A100 and GPUs without a table
# of their own): no sm_80 GPU has been available to measure on; it holds the H200's tiles except
# where they need more than an A100's 163 KB of shared memory per block (d=256).
DEFAULTS: dict[str, dict[tuple[int, bool], BwdConfig]] = {
    "sm_90a": _H200,
    "sm_80": {(d, c): _SMALL_SMEM.get(d, cfg) for (d, c), cfg in _H200.items()},
}

# Extra candidates for the tuning benchmark (the default comes first): the runners-up of the last
# tuning run and, for d=128, the previous default (8, 4, 2) / unroll 2. unroll = KS unrolls the k
# loops of phases 1 and 3 fully, so ptxas can load the next k step's fragments during this step's
# mma (with unroll=2 every step waits for its own ldmatrix results).
_TUNING: dict[int, tuple[BwdConfig, ...]] = {
    32: (
        BwdConfig(32, block_n=128, block_m=64, warps=8, warps_n1=4, warps_n2=4, warps_m3=4, unroll=2),
        BwdConfig(32, block_n=128, block_m=64, warps=8, warps_n1=4, warps_n2=4, warps_m3=4, unroll=8),
    ),
    64: (
        BwdConfig(64, block_n=128, block_m=64, warps=8, warps_n1=4, warps_n2=4, warps_m3=2, unroll=4),
        BwdConfig(64, block_n=128, block_m=128, warps=8, warps_n1=4, warps_n2=2, warps_m3=4, unroll=4),
    ),
    96: (
        BwdConfig(96, block_n=128, block_m=64, warps=8, warps_n1=4, warps_n2=4, warps_m3=4, unroll=2),
        BwdConfig(96, block_n=128, block_m=64, warps=8, warps_n1=4, warps_n2=8, warps_m3=4, unroll=2),
    ),
    128: (
        BwdConfig(128, block_n=128, block_m=64, warps=8, warps_n1=4, warps_n2=4, warps_m3=2, unroll=8),
        BwdConfig(128, block_n=128, block_m=64, warps=8, warps_n1=4, warps_n2=4, warps_m3=2, unroll=2),
        BwdConfig(128, block_n=128, block_m=64, warps=8, warps_n1=8, warps_n2=4, warps_m3=2, unroll=2),
    ),
    256: (
        _SMALL_SMEM[256],
        BwdConfig(256, block_n=64, block_m=64, warps=8, warps_n1=4, warps_n2=2, warps_m3=2, unroll=2,
                  dq_block_m=64, dq_block_n=32),
    ),
}


# Variable-length batches (the *_varlen_kernel entry points): the dense tables, except where the
# per-sequence offsets and lengths (read from cu_seqlens into per-thread registers) push the main
# kernel into spills: d=96 takes unroll 2 (36 spill bytes on sm_80 with unroll 8; dense H200
# numbers 268/282 against 267/281 TFLOP/s, the d=96 tuning above) and d=256 on sm_90a unroll 2
# (8 spill bytes with unroll 4).
_VARLEN_OVERRIDES: dict[str, dict[int, BwdConfig]] = {
    "sm_90a": {96: _TUNING[96][0], 256: _TUNING[256][1]},
    "sm_80": {96: _TUNING[96][0]},
}
VARLEN_DEFAULTS: dict[str, dict[tuple[int, bool], BwdConfig]] = {
    arch: {(d, c): _VARLEN_OVERRIDES[arch].get(d, cfg) for (d, c), cfg in table.items()}
    for arch, table in DEFAULTS.items()
}


def default_config(head_dim: int, causal: bool, arch: str = "sm_90a", max_smem: int | None = None,
                   varlen: bool = False) -> BwdConfig:
    """The table's config for (head_dim, causal) on `arch` (archs without a table use sm_80's);
    fp16 and bf16 share tiles. With ``max_smem`` (bytes of dynamic shared memory a block may use on
    the target GPU), a config that needs more is replaced by the head dim's small-shared-memory one.
    ``varlen`` reads the table of the packed variable-length kernels."""
    tables = VARLEN_DEFAULTS if varlen else DEFAULTS
    table = tables.get(arch, tables["sm_80"])
    try:
        cfg = table[(int(head_dim), bool(causal))]
    except KeyError:
        raise ValueError(f"head_dim must be one of {HEAD_DIMS}, got {head_dim}") from None
    if max_smem is not None and (isinstance(max_smem, bool) or not isinstance(max_smem, int) or max_smem <= 0):
        raise ValueError(f"max_smem must be a positive number of bytes, got {max_smem!r}")
    if max_smem is not None and max(cfg.main_smem, cfg.dq_smem) > max_smem:
        small = _SMALL_SMEM.get(cfg.head_dim)
        if small is None or max(small.main_smem, small.dq_smem) > max_smem:
            raise ValueError(f"no backward config for head_dim {head_dim} fits {max_smem} B of shared memory")
        cfg = small
    return cfg


def tuning_candidates(head_dim: int, causal: bool, dtype=None, arch: str = "sm_90a") -> list[BwdConfig]:
    """Configs worth timing for (head_dim, causal, dtype) on `arch`: the default first, then the
    extras (registered as the family's tuning candidates), each usable as ``config=``."""
    out = [default_config(head_dim, causal, arch)]
    for cfg in _TUNING.get(int(head_dim), ()):
        if cfg not in out:
            out.append(cfg)
    return out


def all_configs() -> list[BwdConfig]:
    """Every config of the family: the arch tables, the small-shared-memory ones, the tuning extras."""
    tables = [cfg for table in DEFAULTS.values() for cfg in table.values()]
    return list(dict.fromkeys(tables + list(_SMALL_SMEM.values()) + [c for cs in _TUNING.values() for c in cs]))


def _expressions(configs, varlen: bool = False) -> list[str]:
    return [e for cfg in configs for bf16 in (False, True)
            for e in (cfg.main_expr(bf16, True, varlen), cfg.main_expr(bf16, False, varlen), cfg.dq_expr(bf16, varlen))]


def _instantiations() -> tuple[str, ...]:
    exprs = []
    for varlen in (False, True):  # dense, then the packed variable-length entry points of the same tiles
        exprs += [e for bf16 in (False, True) for d in HEAD_DIMS
                  for e in (preprocess_expr(d, bf16, varlen), convert_expr(d, bf16, varlen))]
        exprs += _expressions((cfg for table in (VARLEN_DEFAULTS if varlen else DEFAULTS).values()
                               for cfg in table.values()), varlen)
        exprs += _expressions(_SMALL_SMEM.values(), varlen)
    return tuple(dict.fromkeys(exprs))  # dedupe, keep order


# ---- attention variants (csrc/common/variants.cuh) ----------------------------------------------
# Window, softcap, ALiBi and dropout run in separate instantiations (kVariants) of the main and
# deterministic dQ bodies (the preprocess and convert kernels are shared): one per (head dim, dtype,
# dense or varlen, atomic or deterministic), every variant a run-time choice, causal a window. One
# table for every arch and both layouts: the variant code (logit transform, Philox, window tests)
# needs registers the plain tiles do not have, so these are the tiles of the table and its tuning
# runners-up that compile with 0 spills for sm_80 and sm_90a, dense and varlen (ptxas -v, 2026-12-01):
VARIANT_CONFIGS: dict[int, BwdConfig] = {
    32: _BASE[32],
    # BM=128 unroll 4 spills 8-28 bytes on sm_90a; BM=64: 202-241 registers.
    64: _TUNING[64][0],
    96: _TUNING[96][0],  # unroll 2 (unroll 8 spills in the varlen layout on sm_80, as the plain one)
    # The table's layouts (4, 2, 2): unroll 8 spills 24 bytes on sm_80 (atomic) and unroll_det 2 8
    # bytes on sm_90a; unroll 4 and unroll_det 1 compile to 0 spills everywhere.
    128: BwdConfig(128, block_n=128, block_m=64, warps=8, warps_n1=4, warps_n2=2, warps_m3=2, unroll=4,
                   unroll_det=1),
    # BM=64 spills on sm_90a (12-36 bytes, atomic); the small-shared-memory BM=32 tiles: 238-248.
    256: _SMALL_SMEM[256],
}


def variant_config(head_dim: int) -> BwdConfig:
    """Tiles of the variant kernels for `head_dim` (every arch; each fits an A100's 163 KB)."""
    try:
        return VARIANT_CONFIGS[int(head_dim)]
    except KeyError:
        raise ValueError(f"head_dim must be one of {HEAD_DIMS}, got {head_dim}") from None


def _variant_instantiations() -> tuple[str, ...]:
    return tuple(e for varlen in (False, True) for d in HEAD_DIMS for bf16 in (False, True) for rng in (False, True)
                 for e in (VARIANT_CONFIGS[d].main_expr(bf16, True, varlen, True, rng),
                           VARIANT_CONFIGS[d].main_expr(bf16, False, varlen, True, rng),
                           VARIANT_CONFIGS[d].dq_expr(bf16, varlen, True, rng)))


INSTANTIATIONS = _instantiations() + _variant_instantiations()
TUNING = tuple(dict.fromkeys(e for e in _expressions(c for cs in _TUNING.values() for c in cs) if e not in INSTANTIATIONS))
FAMILIES = (Family(FAMILY_NAME, SOURCE, INSTANTIATIONS, archs=("sm_90a", "sm_80"), tuning=TUNING),)


# ---- argument checks -------------------------------------------------------------------------
def _check_args(q, k, v, out, lse, dout, dq, dk, dv, scale, config) -> None:
    """Validate everything the kernels rely on, ``config`` included. ValueError on failure."""
    import torch

    named = {"q": q, "k": k, "v": v, "out": out, "lse": lse, "dout": dout, "dq": dq, "dk": dk, "dv": dv}
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    for name in ("q", "k", "v", "out", "dout", "dq", "dk", "dv"):
        if named[name].dim() != 4:
            raise ValueError(f"{name} must be rank 4, got shape {tuple(named[name].shape)}")
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"q must be float16 or bfloat16, got {q.dtype}")
    for name in ("k", "v", "out", "dout", "dq", "dk", "dv"):
        if named[name].dtype != q.dtype:
            raise ValueError(f"{name} must have q's dtype {q.dtype}, got {named[name].dtype}")
    if lse.dtype != torch.float32:
        raise ValueError(f"lse must be float32, got {lse.dtype}")

    batch, heads, nq, d = q.shape
    _, kv_heads, nk, dk_ = k.shape
    if min(batch, heads, nq, d, kv_heads, nk) < 1:
        raise ValueError(f"empty dimension: q {tuple(q.shape)}, k {tuple(k.shape)}")
    if d not in HEAD_DIMS:
        raise ValueError(f"head dim must be one of {HEAD_DIMS}, got {d}")
    if k.shape[0] != batch or dk_ != d:
        raise ValueError(f"k must be [B={batch}, Hkv, Nk, d={d}], got {tuple(k.shape)}")
    if tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"v must have k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
    if heads % kv_heads != 0:
        raise ValueError(f"kv heads ({kv_heads}) must divide query heads ({heads})")
    for name, ref in (("out", q), ("dout", q), ("dq", q), ("dk", k), ("dv", v)):
        if tuple(named[name].shape) != tuple(ref.shape):
            raise ValueError(f"{name} must have shape {tuple(ref.shape)}, got {tuple(named[name].shape)}")
    if tuple(lse.shape) != (batch, heads, nq):
        raise ValueError(f"lse must have shape {(batch, heads, nq)}, got {tuple(lse.shape)}")
    if not lse.is_contiguous():
        raise ValueError(f"lse must be contiguous, got strides {lse.stride()}")
    if max(heads, kv_heads, batch) > MAX_GRID_YZ:
        raise ValueError(f"batch and head counts must be <= {MAX_GRID_YZ}")
    if max(nq, nk) >= 2**31 - _ROW_PAD:
        raise ValueError(f"sequence lengths must be < 2**31 - {_ROW_PAD}, got Nq={nq}, Nk={nk}")
    # 16-byte cp.async / vector accesses: contiguous last dim, every other stride of a dimension
    # longer than 1 a multiple of 8 elements (a size-1 dimension's stride is never applied).
    for name in ("q", "k", "v", "out", "dout", "dq", "dk", "dv"):
        t = named[name]
        if t.stride(3) != 1:
            raise ValueError(f"{name} must have a contiguous last dim (stride 1), got strides {t.stride()}")
        if any(t.shape[i] > 1 and t.stride(i) % 8 for i in range(3)):
            raise ValueError(
                f"{name} strides {t.stride()} must be multiples of 8 elements (16-byte aligned rows)"
            )
    if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not math.isfinite(scale):
        raise ValueError(f"scale must be a finite float, got {scale!r}")
    if config is not None and not isinstance(config, BwdConfig):
        raise ValueError(f"config must be a BwdConfig, got {type(config).__name__}")
    if config is not None and config.head_dim != d:
        raise ValueError(f"config is for head_dim {config.head_dim}, tensors have head_dim {d}")
    devices = {t.device for t in named.values()}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(str(x) for x in devices)}")
    if q.device.type != "cuda":
        raise ValueError(f"tensors must be CUDA tensors, got device {q.device}")
    for name in ("q", "k", "v", "out", "dout", "dq", "dk", "dv"):
        if named[name].data_ptr() % 16:
            raise ValueError(f"{name} must be 16-byte aligned (data_ptr {named[name].data_ptr():#x})")
    # Gradients must not overlap the inputs the kernels still read while writing them.
    reads = [q, k, v, out, lse, dout]
    for i, name in enumerate(("dq", "dk", "dv")):
        g = named[name]
        for r in reads + [named[o] for o in ("dq", "dk", "dv")[i + 1:]]:
            if _overlap(g, r):
                raise ValueError(f"{name} overlaps another argument; pass fresh gradient buffers")


def _overlap(a, b) -> bool:
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    a0, a1 = a.data_ptr(), a.data_ptr() + _extent_bytes(a)
    b0, b1 = b.data_ptr(), b.data_ptr() + _extent_bytes(b)
    return a0 < b1 and b0 < a1


def _extent_bytes(t) -> int:
    return (sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1) * t.element_size()


def workspace_bytes(batch: int, heads: int, nq: int, head_dim: int, deterministic: bool) -> int:
    """Extra device memory launch_backward allocates: lse2 + delta and, in atomic mode, the fp32 dQ
    accumulator, all with Nq padded to a multiple of 128 rows."""
    pad = -(-nq // _ROW_PAD) * _ROW_PAD
    extra = 0 if deterministic else batch * heads * pad * head_dim * 4
    return 2 * batch * heads * pad * 4 + extra


# ---- launch plans ----------------------------------------------------------------------------
class BackwardPlan:
    """The three launches of one backward for tensors of fixed shapes, strides, dtype and device.

    Made once per such combination (the public op keeps it with its forward plan, so a backward
    re-validates nothing); `launch` allocates the workspaces with torch and launches the three
    kernels with the call's data pointers. The workspaces' addresses change from call to call, so
    they are dynamic parameters like the tensors'.
    """

    def __init__(self, q, k, v, out, lse, dout, dq, dk, dv, *, causal: bool, scale: float, deterministic: bool,
                 config: BwdConfig, variants=None):
        import numpy as np
        import torch

        from ..runtime import LaunchPlan
        from . import load

        batch, heads, nq, d = q.shape
        kv_heads, nk = k.shape[1], k.shape[2]
        bf16 = q.dtype == torch.bfloat16
        device = q.device.index
        cfg = config
        self.deterministic = deterministic
        self.nq_pad = nq_pad = -(-nq // _ROW_PAD) * _ROW_PAD
        rows = batch * heads * nq_pad
        # One fp32 workspace per call: lse2 [B, H, NqPad], delta [B, H, NqPad], then in atomic mode
        # the dQ accumulator [B, H, NqPad, d] (one allocation instead of two: host time per call).
        self.ws_elems = 2 * rows + (0 if deterministic else rows * d)
        self.device = q.device
        i32, i64, f32 = np.int32, np.int64, np.float32

        def strides(t):
            sb, sh, sr, _ = t.stride()
            return i64(sb), i64(sh), i64(sr)

        scale_log2 = f32(scale * 1.4426950408889634)  # log2(e) folded into the scale
        group = heads // kv_heads
        # Placeholder pointers (0): every pointer is a dynamic parameter, written at launch.
        self.pre = LaunchPlan(
            load(FAMILY_NAME, preprocess_expr(d, bf16), device),
            (nq_pad // _PRE_ROWS, heads, batch), (128,),
            (0, 0, 0, 0, 0, 0, *strides(out), *strides(dout), i32(nq), i32(heads), i32(nq_pad)),
            dynamic=range(6),
        )
        self.variant_values = with_variants = variants is not None  # launch takes (alibi, seed, offset, rng)
        rng = with_variants and variants.reads_rng_state
        self.main = _plan(
            load(FAMILY_NAME, cfg.main_expr(bf16, not deterministic, False, with_variants, rng), device),
            (-(-nk // cfg.block_n), kv_heads, batch), (cfg.main_threads,),
            (0, 0, 0, 0, 0, 0, 0, 0, 0, *strides(q), *strides(k), *strides(v), *strides(dout), *strides(dk),
             *strides(dv), i32(nq), i32(nk), i32(heads), i32(group), i32(nq_pad), i32(1 if causal else 0),
             scale_log2, f32(scale)),
            cfg.main_smem, range(9), variants, scale,
        )
        if deterministic:
            self.last = _plan(
                load(FAMILY_NAME, cfg.dq_expr(bf16, False, with_variants, rng), device),
                (-(-nq // cfg.dq_block_m), heads, batch), (cfg.dq_threads,),
                (0, 0, 0, 0, 0, 0, 0, *strides(q), *strides(k), *strides(v), *strides(dout), *strides(dq),
                 i32(nq), i32(nk), i32(heads), i32(group), i32(nq_pad), i32(1 if causal else 0), scale_log2,
                 f32(scale)),
                cfg.dq_smem, range(7), variants, scale,
            )
        else:
            self.last = LaunchPlan(
                load(FAMILY_NAME, convert_expr(d, bf16), device),
                (-(-nq // _CONVERT_ROWS), heads, batch), (128,),
                (0, 0, *strides(dq), i32(nq), i32(heads), i32(nq_pad), f32(scale)),
                dynamic=range(2),
            )
        self._delta_offset, self._acc_offset = rows * 4, 2 * rows * 4  # bytes into the workspace

    def launch(self, q, k, v, out, lse, dout, dq, dk, dv, *variant_values) -> None:
        """`variant_values` (plans made with variants only): ALiBi slopes' pointer, dropout seed, offset,
        rng state pointer."""
        import torch

        ws = torch.empty(self.ws_elems, dtype=torch.float32, device=self.device)
        lse2 = ws.data_ptr()
        delta = lse2 + self._delta_offset
        acc_ptr = 0 if self.deterministic else lse2 + self._acc_offset
        self.pre.launch(out.data_ptr(), dout.data_ptr(), lse.data_ptr(), lse2, delta, acc_ptr)
        self.main.launch(q.data_ptr(), k.data_ptr(), v.data_ptr(), dout.data_ptr(), dk.data_ptr(), dv.data_ptr(),
                         acc_ptr, lse2, delta, *variant_values)
        if self.deterministic:
            self.last.launch(q.data_ptr(), k.data_ptr(), v.data_ptr(), dout.data_ptr(), dq.data_ptr(), lse2, delta,
                             *variant_values)
        else:
            self.last.launch(acc_ptr, dq.data_ptr())
        # ws goes back to torch's caching allocator here; its block is reused only by work enqueued
        # later on this stream, which runs after these kernels.

    def host_launches(self):
        """((LaunchPlan, slots) x 3, workspace fp32 elements, 0 semaphores) for runtime.host_launch,
        which then runs `launch` in C++; None for a variant plan (per-call values)."""
        from ..runtime import host_launch as hl

        if self.variant_values:
            return None
        lse2, delta = (hl.WORKSPACE, 0), (hl.WORKSPACE, self._delta_offset)
        acc = hl.NULL if self.deterministic else (hl.WORKSPACE, self._acc_offset)
        if self.deterministic:
            last = (hl.Q, hl.K, hl.V, hl.DOUT, hl.DQ, lse2, delta)
        else:
            last = (acc, hl.DQ)
        return (((self.pre, hl.pointer_slots(self.pre.dynamic, (hl.OUT, hl.DOUT, hl.LSE, lse2, delta, acc))),
                 (self.main, hl.pointer_slots(self.main.dynamic, (hl.Q, hl.K, hl.V, hl.DOUT, hl.DK, hl.DV, acc, lse2,
                                                                  delta))),
                 (self.last, hl.pointer_slots(self.last.dynamic, last))),
                self.ws_elems, 0)


def backward_plan(q, k, v, out, lse, dout, dq, dk, dv, *, causal: bool, scale: float, deterministic: bool,
                  config: BwdConfig | None = None, variants=None) -> BackwardPlan:
    """A BackwardPlan for these tensors' shapes, strides, dtype and device (arguments trusted: the
    public op validated them in its forward). The config defaults to the table of the device's
    arch, shrunk to the device's shared memory. `variants` (attention_fwd_sm80.VariantArgs, causal
    folded into its window): the variant kernels; the plan's launch then takes the ALiBi pointer,
    dropout seed and offset after the tensors."""
    if variants is not None:
        config = config or variant_config(q.shape[3])
    if config is None:
        from ..runtime import device_arch, device_smem_optin

        index = q.device.index
        config = default_config(q.shape[3], causal, device_arch(index), max_smem=device_smem_optin(index))
    return BackwardPlan(q, k, v, out, lse, dout, dq, dk, dv, causal=bool(causal), scale=float(scale),
                        deterministic=bool(deterministic), config=config, variants=variants)


def _plan(kernel, grid, block, args, smem, dynamic, variants, scale):
    """A LaunchPlan; with variants, their parameters follow `args` and the per-call ALiBi pointer,
    seed and offset are dynamic after `dynamic`."""
    from ..runtime import LaunchPlan

    dynamic = tuple(dynamic)
    if variants is not None:
        from .attention_fwd_sm80 import VARIANT_DYNAMIC

        dynamic += tuple(len(args) + i for i in VARIANT_DYNAMIC)
        args = (*args, *variants.kernel_args(scale))
    return LaunchPlan(kernel, grid, block, args, smem=smem, dynamic=dynamic)


class BackwardVarlenPlan:
    """The three launches of one packed variable-length backward (see BackwardPlan): q, out, dout,
    dq [Tq, H, d], k, v, dk, dv [Tk, Hkv, d], lse [H, Tq], B = len(cu_seqlens_q) - 1 sequences whose
    longest has max_seqlen_q queries and max_seqlen_k keys. Fixed per (shapes, strides, dtype,
    device, B, max lengths, flags); the cu_seqlens tensors are dynamic parameters like the data.
    Every grid has B + 1 z-slices: the last one zeroes the gradient rows past the last sequence.

    Workspace rows (lse2, delta, and dq_accum times d): [H, ws_pitch], ws_pitch = roundup(Tq, 4) +
    132 B; sequence b's rows from roundup(cu_seqlens_q[b], 4) + 132 b, its query count rounded up
    to 128 (the kernels' ws_row: 16-byte aligned rows, disjoint sequences).
    """

    def __init__(self, q, k, v, out, lse, dout, dq, dk, dv, cu_seqlens_q, max_seqlen_q: int, max_seqlen_k: int, *,
                 causal: bool, scale: float, deterministic: bool, config: BwdConfig, variants=None):
        import numpy as np
        import torch

        from ..runtime import LaunchPlan
        from . import load

        total_q, heads, d = q.shape
        kv_heads = k.shape[1]
        batch = cu_seqlens_q.shape[0] - 1
        bf16 = q.dtype == torch.bfloat16
        device = q.device.index
        cfg = config
        self.deterministic = deterministic
        ws_pitch = -(-total_q // 4) * 4 + VARLEN_WS_GAP * batch
        rows = heads * ws_pitch
        self.ws_elems = 2 * rows + (0 if deterministic else rows * d)
        self.device = q.device
        i32, i64, f32 = np.int32, np.int64, np.float32

        def strides(t):  # [T, H, d]: (head stride, token stride)
            return i64(t.stride(1)), i64(t.stride(0))

        def blocks(n, per):
            return max(1, -(-n // per))

        scale_log2 = f32(scale * 1.4426950408889634)
        group = heads // kv_heads
        q_pad = -(-max(max_seqlen_q, 1) // _ROW_PAD) * _ROW_PAD
        self.pre = LaunchPlan(
            load(FAMILY_NAME, preprocess_expr(d, bf16, True), device),
            (q_pad // _PRE_ROWS, heads, batch + 1), (128,),
            (0, 0, 0, 0, 0, 0, *strides(out), *strides(dout), 0, i32(total_q), i32(ws_pitch)),
            dynamic=(0, 1, 2, 3, 4, 5, 10),
        )
        with_variants = variants is not None
        rng = with_variants and variants.reads_rng_state
        self.main = _plan(
            load(FAMILY_NAME, cfg.main_expr(bf16, not deterministic, True, with_variants, rng), device),
            (blocks(max_seqlen_k, cfg.block_n), kv_heads, batch + 1), (cfg.main_threads,),
            (0, 0, 0, 0, 0, 0, 0, 0, 0, *strides(q), *strides(k), *strides(v), *strides(dout), *strides(dk),
             *strides(dv), 0, 0, i32(k.shape[0]), i32(group), i32(ws_pitch), i32(1 if causal else 0), scale_log2,
             f32(scale)),
            cfg.main_smem, (*range(9), 21, 22), variants, scale,
        )
        if deterministic:
            self.last = _plan(
                load(FAMILY_NAME, cfg.dq_expr(bf16, True, with_variants, rng), device),
                (blocks(max_seqlen_q, cfg.dq_block_m), heads, batch + 1), (cfg.dq_threads,),
                (0, 0, 0, 0, 0, 0, 0, *strides(q), *strides(k), *strides(v), *strides(dout), *strides(dq), 0, 0,
                 i32(total_q), i32(group), i32(ws_pitch), i32(1 if causal else 0), scale_log2, f32(scale)),
                cfg.dq_smem, (*range(7), 17, 18), variants, scale,
            )
        else:
            self.last = LaunchPlan(
                load(FAMILY_NAME, convert_expr(d, bf16, True), device),
                (blocks(max_seqlen_q, _CONVERT_ROWS), heads, batch + 1), (128,),
                (0, 0, *strides(dq), 0, i32(total_q), i32(ws_pitch), f32(scale)),
                dynamic=(0, 1, 4),
            )
        self._delta_offset, self._acc_offset = rows * 4, 2 * rows * 4  # bytes into the workspace

    def launch(self, q, k, v, out, lse, dout, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, *variant_values) -> None:
        """`variant_values` (plans made with variants only): ALiBi slopes' pointer, dropout seed, offset,
        rng state pointer."""
        import torch

        ws = torch.empty(self.ws_elems, dtype=torch.float32, device=self.device)
        lse2 = ws.data_ptr()
        delta = lse2 + self._delta_offset
        acc_ptr = 0 if self.deterministic else lse2 + self._acc_offset
        cu_q, cu_k = cu_seqlens_q.data_ptr(), cu_seqlens_k.data_ptr()
        self.pre.launch(out.data_ptr(), dout.data_ptr(), lse.data_ptr(), lse2, delta, acc_ptr, cu_q)
        self.main.launch(q.data_ptr(), k.data_ptr(), v.data_ptr(), dout.data_ptr(), dk.data_ptr(), dv.data_ptr(),
                         acc_ptr, lse2, delta, cu_q, cu_k, *variant_values)
        if self.deterministic:
            self.last.launch(q.data_ptr(), k.data_ptr(), v.data_ptr(), dout.data_ptr(), dq.data_ptr(), lse2, delta,
                             cu_q, cu_k, *variant_values)
        else:
            self.last.launch(acc_ptr, dq.data_ptr(), cu_q)


def backward_varlen_plan(q, k, v, out, lse, dout, dq, dk, dv, cu_seqlens_q, max_seqlen_q: int, max_seqlen_k: int, *,
                         causal: bool, scale: float, deterministic: bool,
                         config: BwdConfig | None = None, variants=None) -> BackwardVarlenPlan:
    """A BackwardVarlenPlan for these tensors (arguments trusted: tileattn.api_varlen validated
    them); the config defaults to the varlen table of the device's arch, shrunk to its shared memory.
    `variants`: as backward_plan."""
    if variants is not None:
        config = config or variant_config(q.shape[2])
    if config is None:
        from ..runtime import device_arch, device_smem_optin

        index = q.device.index
        config = default_config(q.shape[2], causal, device_arch(index), max_smem=device_smem_optin(index),
                                varlen=True)
    return BackwardVarlenPlan(q, k, v, out, lse, dout, dq, dk, dv, cu_seqlens_q, int(max_seqlen_q),
                              int(max_seqlen_k), causal=bool(causal), scale=float(scale),
                              deterministic=bool(deterministic), config=config, variants=variants)


def launch_backward(
    q,
    k,
    v,
    out,
    lse,
    dout,
    dq,
    dk,
    dv,
    *,
    causal: bool,
    scale: float,
    deterministic: bool,
    config: BwdConfig | None = None,
) -> None:
    """Gradients of attention into the caller's dq, dk, dv (written completely, never read).

    q, out, dout, dq: [B, H, Nq, d]; k, v, dk, dv: [B, Hkv, Nk, d]; lse: [B, H, Nq] float32
    contiguous, natural log, -inf for fully masked rows (their gradients come out 0). All 16-bit
    tensors share one dtype (float16 or bfloat16), have a contiguous last dim and other strides
    that are multiples of 8 elements. causal is bottom-right aligned. ``deterministic`` computes dQ
    without atomics (bit-identical run to run; one more pass over K and V). ``config`` overrides the
    table (see tuning_candidates). Raises ValueError on any inconsistent argument, before any launch.
    Launches on torch's current stream; allocates only torch workspaces (no host sync). Builds its
    plan on every call: the public op `tileattn.attention` keeps plans instead.
    """
    import torch

    _check_args(q, k, v, out, lse, dout, dq, dk, dv, scale, config)
    with torch.cuda.device(q.device):
        plan = backward_plan(q, k, v, out, lse, dout, dq, dk, dv, causal=causal, scale=scale,
                             deterministic=deterministic, config=config)
        plan.launch(q, k, v, out, lse, dout, dq, dk, dv)


def _compile_one(args):
    expr, arch = args
    from ..runtime import compile_cuda

    module = compile_cuda(FAMILIES[0].path, [expr], arch)
    return expr, module.compile_seconds, module.from_cache


def precompile(arch: str | None = None, expressions=None, workers: int | None = None) -> float:
    """Fill the disk compile cache for `expressions` (default: every registered instantiation) in
    parallel processes, so the first launch_backward calls only load cubins. Returns the summed
    NVRTC seconds. `arch` defaults to the current GPU's. Used by the GPU tests and benchmarks.
    Concurrent callers (pytest-xdist workers, each warming the cache for its tests) take turns on a
    lock file in the cache directory: the first compiles, the others find the cubins cached. Without
    it 15 workers each ran a 15-process pool over the same 60 programs (H200 call G1, 2026-12-03)."""
    import fcntl
    import multiprocessing as mp
    import os
    from concurrent.futures import ProcessPoolExecutor

    from ..runtime.compiler import cache_dir

    if arch is None:
        from ..runtime import device_arch, require_gpu

        arch = device_arch(require_gpu())
    exprs = list(expressions) if expressions is not None else list(FAMILIES[0].instantiations)
    workers = workers or max(1, min(len(exprs), (os.cpu_count() or 2) - 1))
    # Not fork: the parent may hold a CUDA context. A forkserver imports this module (and torch)
    # once, then forks cheap NVRTC-only workers from that clean process.
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])
    cache_dir().mkdir(parents=True, exist_ok=True)
    with open(cache_dir() / f"precompile-{FAMILY_NAME}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        with ProcessPoolExecutor(workers, mp_context=ctx) as pool:
            results = list(pool.map(_compile_one, [(e, arch) for e in exprs]))
    return sum(sec for _, sec, cached in results if not cached)
