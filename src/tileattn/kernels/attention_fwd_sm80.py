"""Attention forward on the sm_80 tensor-core path (csrc/attention_fwd_sm80.cu): configs and launch.

One table says which tile configuration each (head dim, causal) uses; every config is built for
fp16 and bf16. A few extra bf16 candidates for d=128 and d=64 are registered too, so the tuning
benchmark (`tileattn bench attention --tune`) can time them all in one GPU run and the winner can
be moved into DEFAULTS.

Kernel conventions (shared with the backward): q [B, H, Nq, d], k/v [B, Hkv, Nk, d], out
[B, H, Nq, d], all 16-bit with strides in elements, a contiguous last dim and 16-byte aligned rows;
lse [B, H, Nq] fp32 contiguous in natural-log units. kv head = h // (H // Hkv). Grid
(ceil(Nq / BLOCK_M), H, B), dynamic shared memory 2 * d * (BLOCK_M + 2 * STAGES * BLOCK_N) bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..dropout import UNBOUNDED, drop_threshold  # the kernels' kUnbounded; the dropout threshold
from . import Family

FAMILY_NAME = "attention_fwd_sm80"
SOURCE = "attention_fwd_sm80.cu"
HEAD_DIMS = (32, 64, 96, 128, 256)
LOG2E = 1.4426950408889634
# The main loop addresses a K/V block with 32-bit per-thread offsets (row * row_stride < 2^31 for
# row < BLOCK_N <= 128), which keeps 64-bit pointers out of the registers. K or V with a larger
# row stride (keys more than 32 MB apart) is copied to a contiguous tensor first.
MAX_KV_ROW_STRIDE = 1 << 24
# Every registered config needs <= 160 KB of dynamic shared memory, so each also fits an A100
# (163 KB per block); H100/H200 allow 227 KB.


@dataclass(frozen=True, order=True)
class FwdConfig:
    """A tile configuration: BLOCK_M query rows per CTA, BLOCK_N keys per K/V block, warps, stages."""

    block_m: int
    block_n: int
    warps: int
    stages: int

    @property
    def threads(self) -> int:
        return 32 * self.warps

    @property
    def rows_per_warp(self) -> int:
        return self.block_m // self.warps

    def smem_bytes(self, head_dim: int) -> int:
        """Dynamic shared memory: Q tile + kStages K and V blocks, 16-bit elements."""
        return 2 * head_dim * (self.block_m + 2 * self.stages * self.block_n)

    def __str__(self) -> str:
        return f"{self.block_m}x{self.block_n}/w{self.warps}/s{self.stages}"


C = FwdConfig

# The H200's table: default config per (head dim, causal), for fp16 and bf16 alike. Register/smem
# notes (sm_90a, ptxas -v; 32 rows per warp keep O and S in ~192 registers at d=128, see the .cu
# header and docs/attention_fwd_sm80.md):
_H200: dict[tuple[int, bool], FwdConfig] = {
    (32, False): C(128, 64, 4, 2),   # 32 rows/warp: O 32 + S 64 regs/thread; 40 KB smem
    (32, True): C(128, 64, 4, 2),
    (64, False): C(128, 64, 4, 2),   # O 64 + S 64; 48 KB smem (N=128 spills at 255 regs)
    (64, True): C(128, 64, 4, 2),
    # d=96 and d=256 by measurement (bench attention --tune --head-dim D --seq 4096 --seq 16384,
    # bf16, H200, 2026-11-29; docs/attention_fwd_sm80.md): d=96 128x64/w4/s2 335/339 non-causal and
    # 309/331 causal TFLOP/s against 259/270 and 252/277 for 128x64/w8/s2.
    (96, False): C(128, 64, 4, 2),   # 32 rows/warp: O 96 + S 64 regs; 72 KB smem
    (96, True): C(128, 64, 4, 2),
    # 32 rows/warp: O 128 + S 64 regs, 255 in all with 0 spills; 96 KB -> 2 CTAs (8 warps)/SM.
    # Chosen by measurement (bench attention --tune, H200, 2026-11-29, N=2048/16384 bf16):
    # 352/367 TFLOP/s non-causal and 287/354 causal, against 340/356 and 272/348 for 128x32/w4/s2.
    (128, False): C(128, 64, 4, 2),
    (128, True): C(128, 64, 4, 2),
    # d=256: 64x32/w4/s2 285/282 non-causal against 272/281 for 128x32/w8/s2; causal 272/273
    # against 267/288, so causal takes 128x32/w8/s2 (the long sequences gain more than N=4096 loses).
    (256, False): C(64, 32, 4, 2),   # 16 rows/warp (O alone is 128 regs); 96 KB -> 2 CTAs/SM
    (256, True): C(128, 32, 8, 2),   # 16 rows/warp, 8 warps; 128 KB -> 1 CTA/SM
}

# Tables keyed by arch (what tileattn.kernels.dispatch reads). sm_80 (A100 and the other GPUs
# without a table of their own): no sm_80 GPU has been available to measure on, so it holds the
# H200's choices, each of which fits an A100's 163 KB of shared memory per block; a measured
# A100 table replaces it when one is run (`tileattn bench attention --tune` on that GPU).
DEFAULTS: dict[str, dict[tuple[int, bool], FwdConfig]] = {"sm_90a": _H200, "sm_80": dict(_H200)}

# Variable-length batches (attention_fwd_varlen_sm80): the dense tables, except d=128 causal. The
# per-sequence offsets and lengths come from cu_seqlens in device memory, so on sm_90a they sit in
# per-thread registers (the dense kernel's come from parameters and blockIdx, in uniform registers),
# and 128x64/w4/s2 causal then spills 16 bytes; 128x48/w4/s2 compiles to 249 registers (dense
# H200 numbers: 277/349 causal TFLOP/s against 287/354 at N = 4096/16384, Tuning log step 4).
VARLEN_DEFAULTS: dict[str, dict[tuple[int, bool], FwdConfig]] = {
    arch: {**table, (128, True): C(128, 48, 4, 2)} for arch, table in DEFAULTS.items()
}

# Extra candidates timed by the tuning benchmark (bf16 only, to keep CI compile time moderate;
# the winner goes into DEFAULTS and is then built for fp16 too). d=128: 128x64/w4/s2 is FA2's
# H100 tile (32 rows/warp, 64 keys/block: half the barriers, cp.async waits and row reductions per
# key of 128x32; 255 registers, 0 spills, 96 KB -> 2 CTAs/SM); BLOCK_N=48 is the step between;
# 3 stages hide more load latency (80 KB, still 2 CTAs/SM); the 8-warp configs hold Q in
# registers at 16 rows/warp. (64x64/w4/s2 was dropped: slowest everywhere on the H200, 292-294
# TFLOP/s non-causal; see docs/attention_fwd_sm80.md, Tuning log.)
_EXTRA_D128 = (
    C(128, 32, 4, 2), C(128, 48, 4, 2), C(128, 32, 4, 3), C(128, 64, 8, 2), C(128, 64, 8, 3), C(128, 128, 8, 2),
)
_EXTRA_D64 = (C(128, 32, 4, 2), C(128, 64, 4, 3), C(128, 128, 8, 2), C(64, 64, 4, 2))
# d = 32, 96, 256: the other configs that compile without spills, timed against the default by
# the same benchmark (docs/attention_fwd_sm80.md).
_EXTRA_D32 = (C(128, 128, 4, 2), C(64, 64, 4, 2))
_EXTRA_D96 = (C(128, 64, 8, 2), C(128, 32, 8, 2), C(64, 64, 4, 2))
_EXTRA_D256 = (C(64, 32, 4, 2), C(64, 64, 4, 2), C(128, 32, 8, 2), C(64, 32, 4, 3))
EXTRA_BF16: dict[tuple[int, bool], tuple[FwdConfig, ...]] = {
    (d, causal): extra
    for d, extra in ((32, _EXTRA_D32), (64, _EXTRA_D64), (96, _EXTRA_D96), (128, _EXTRA_D128), (256, _EXTRA_D256))
    for causal in (False, True)
}


def kv_group_magic(kv_group: int) -> int:
    """ceil(2^32 / kv_group): the kernel computes h // kv_group as (h * magic) >> 32 (exact for
    h, kv_group < 2^16, which the API's grid checks guarantee) so that kv_head stays in uniform registers."""
    return ((1 << 32) + kv_group - 1) // kv_group


def _dtype_is_bf16(dtype) -> bool:
    """torch.bfloat16 / "bf16" / "bfloat16" -> True, torch.float16 / "fp16" / "float16" -> False."""
    name = str(dtype).removeprefix("torch.")
    if name in ("bfloat16", "bf16"):
        return True
    if name in ("float16", "fp16", "half"):
        return False
    raise ValueError(f"attention forward supports float16 and bfloat16, got {dtype}")


def expression(head_dim: int, config: FwdConfig, causal: bool, bf16: bool, varlen: bool = False) -> str:
    """The NVRTC name expression of one instantiation (must match the registry string exactly);
    `varlen` names the packed variable-length entry point."""
    return (
        f"tileattn::attention_fwd{'_varlen' if varlen else ''}_sm80<{head_dim}, {config.block_m}, {config.block_n}, "
        f"{config.warps}, "
        f"{config.stages}, {'true' if causal else 'false'}, {'true' if bf16 else 'false'}>"
    )


def tuning_candidates(head_dim: int, causal: bool, dtype, arch: str = "sm_90a") -> tuple[FwdConfig, ...]:
    """Configs the tuning benchmark times for (head dim, causal, dtype) on `arch`, its default first
    (the extras are bf16-only: the winner then goes into the table for both dtypes)."""
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"head dim {head_dim} is not supported; supported: {HEAD_DIMS}")
    out = [default_config(head_dim, causal, arch)]
    if _dtype_is_bf16(dtype):
        out += [c for c in EXTRA_BF16.get((head_dim, bool(causal)), ()) if c not in out]
    return tuple(out)


def _expressions(tables, varlen: bool = False) -> tuple[str, ...]:
    exprs = [expression(d, cfg, causal, bf16, varlen) for table in tables for (d, causal), cfg in table.items()
             for bf16 in (False, True)]
    return tuple(dict.fromkeys(exprs))


# ---- attention variants (issue #15; csrc/common/variants.cuh) ----------------------------------
# Window, softcap, ALiBi and dropout run in separate instantiations (kVariants) of the same body, so
# the plain kernels keep their code. One per (head dim, dtype, dense or varlen): every variant is a
# run-time choice inside it, and causal is the window's right edge 0. Tiles: the dense non-causal
# table's (dropout draws its bits per 32 keys, so BLOCK_N is a multiple of 32), except varlen d=128,
# which spills 24 bytes on sm_80 at 128x64 and takes 128x32 (245 registers).
VARIANT_DEFAULTS: dict[int, FwdConfig] = {d: _H200[(d, False)] for d in HEAD_DIMS}
VARLEN_VARIANT_DEFAULTS: dict[int, FwdConfig] = {**VARIANT_DEFAULTS, 128: C(128, 32, 4, 2)}


@dataclass(frozen=True)
class VariantArgs:
    """The variants of one launch plan (hashable: part of the plan key). Window edges in keys
    (UNBOUNDED: none; causal is right = 0), softcap 0.0 = off, alibi_batch_stride None = no ALiBi
    (0: slopes [H], H: slopes [B, H]), dropout_p 0.0 = off. The slopes' pointer and the dropout
    seed/offset are per-call values (see `VARIANT_DYNAMIC`). rng_state (with dropout): the kernels'
    kRngState instantiations run, which read the seed and offset from the per-call rng_state pointer
    (device memory, for CUDA graph replays) instead of the two values."""

    window_left: int = UNBOUNDED
    window_right: int = UNBOUNDED
    softcap: float = 0.0
    alibi_batch_stride: int | None = None
    dropout_p: float = 0.0
    rng_state: bool = False

    @property
    def reads_rng_state(self) -> bool:
        """Whether the kernels read the seed and offset from device memory (rng_state with dropout)."""
        return self.rng_state and self.dropout_p > 0

    def kernel_args(self, scale: float) -> tuple:
        """VARIANT_PARAMS of the kernels, with 0 for the per-call alibi pointer, seed, offset and rng_state."""
        cap = float(self.softcap)
        cap_in = scale / cap if cap > 0 else 0.0
        return (
            0, np.uint64(0), np.uint64(0), np.int64(self.alibi_batch_stride or 0),
            np.int32(self.window_left), np.int32(self.window_right), np.float32(cap_in), np.float32(cap * LOG2E),
            np.uint32(drop_threshold(self.dropout_p)),
            np.float32(1.0 / (1.0 - self.dropout_p)), 0,
        )


# Parameter offsets (after the plain parameters) of the per-call variant values: alibi, seed, offset and
# rng_state (the device pointer to {seed, offset} that replaces the two values when not 0; variants.cuh).
VARIANT_DYNAMIC = (0, 1, 2, 10)


def rng_template_arg(rng_state: bool) -> str:
    """The trailing template argument of the sm80 variant entry points' kRngState form (forward and
    backward): seed and offset read from device memory (VariantArgs.rng_state); none for the default."""
    return ", true" if rng_state else ""


def variant_expression(head_dim: int, config: FwdConfig, bf16: bool, varlen: bool = False,
                       rng_state: bool = False) -> str:
    """NVRTC name expression of a variant forward instantiation (rng_state: its kRngState form)."""
    return (
        f"tileattn::attention_fwd{'_varlen' if varlen else ''}_variants_sm80<{head_dim}, {config.block_m}, "
        f"{config.block_n}, {config.warps}, {config.stages}, {'true' if bf16 else 'false'}"
        f"{rng_template_arg(rng_state)}>"
    )


VARIANT_INSTANTIATIONS = tuple(
    variant_expression(d, table[d], bf16, varlen, rng_state)
    for varlen, table in ((False, VARIANT_DEFAULTS), (True, VARLEN_VARIANT_DEFAULTS))
    for d in HEAD_DIMS for bf16 in (False, True) for rng_state in (False, True))

INSTANTIATIONS = (_expressions(DEFAULTS.values()) + _expressions(VARLEN_DEFAULTS.values(), varlen=True)
                  + VARIANT_INSTANTIATIONS)
# A second tile config of the variant kernel (d=128 bf16, BLOCK_N 32 instead of 64): the GPU tests
# check that the dropout mask does not depend on the tiles.
VARIANT_TUNING = (variant_expression(128, C(128, 32, 4, 2), True),)
TUNING = tuple(dict.fromkeys(
    e for (d, causal), extra in EXTRA_BF16.items() for cfg in extra
    if (e := expression(d, cfg, causal, True)) not in INSTANTIATIONS)) + VARIANT_TUNING

FAMILIES = (Family(FAMILY_NAME, SOURCE, INSTANTIATIONS, archs=("sm_90a", "sm_80"), tuning=TUNING),)


def default_config(head_dim: int, causal: bool, arch: str = "sm_90a") -> FwdConfig:
    """The table's config for (head dim, causal) on `arch` (archs without a table use sm_80's)."""
    table = DEFAULTS.get(arch, DEFAULTS["sm_80"])
    try:
        return table[(int(head_dim), bool(causal))]
    except KeyError:
        raise ValueError(f"head dim {head_dim} is not supported; supported: {HEAD_DIMS}") from None


def forward_plan(q, k, v, out, lse, *, causal: bool, scale: float, config: FwdConfig | None = None,
                 variants: VariantArgs | None = None):
    """A LaunchPlan computing out, lse <- attention(q, k, v) for tensors of these shapes, strides,
    dtype and device. Launch it with the data pointers of q, k, v, out, lse (in that order).

    q [B, H, Nq, d], k/v [B, Hkv, Nk, d], out [B, H, Nq, d]: one 16-bit dtype (fp16 or bf16), any
    strides with stride(-1) == 1 and 16-byte aligned rows (pointers and strides multiples of 8
    elements), K/V row strides below MAX_KV_ROW_STRIDE; lse [B, H, Nq] fp32 contiguous, written in
    natural-log units. `scale` multiplies q . k. `config` forces a tile configuration (a registered
    one: see tuning_candidates); by default the dispatcher's table for the device's arch decides.
    This is the launch layer: it trusts its caller (tileattn.api checks the arguments).
    With `variants` (causal must then be folded into variants.window_right), the variant kernel runs
    and the plan's launch takes three more values: the ALiBi slopes' pointer (0: none), the dropout
    seed and offset (uint64 ints).
    """
    from ..runtime import device_arch
    from . import load

    batch, heads, seqlen_q, head_dim = q.shape
    kv_heads, seqlen_k = k.shape[1], k.shape[2]
    device_index = q.device.index
    bf16 = q.dtype == torch.bfloat16
    if variants is not None:
        config = config or VARIANT_DEFAULTS[head_dim]
        kern = load(FAMILY_NAME, variant_expression(head_dim, config, bf16, rng_state=variants.reads_rng_state),
                    device_index)
    else:
        if config is None:
            config = default_config(head_dim, causal, device_arch(device_index))
        kern = load(FAMILY_NAME, expression(head_dim, config, causal, bf16), device_index)
    grid = ((seqlen_q + config.block_m - 1) // config.block_m, heads, batch)
    qs, ks, vs, os_ = q.stride(), k.stride(), v.stride(), out.stride()
    i64 = np.int64
    args = (
        q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr(),
        i64(qs[0]), i64(qs[1]), i64(qs[2]),
        i64(ks[0]), i64(ks[1]), i64(ks[2]),
        i64(vs[0]), i64(vs[1]), i64(vs[2]),
        i64(os_[0]), i64(os_[1]), i64(os_[2]),
        np.int32(heads), np.uint64(kv_group_magic(heads // kv_heads)), np.int32(seqlen_q), np.int32(seqlen_k),
        np.float32(scale * LOG2E),
    )
    return _plan(kern, grid, config, head_dim, args, (0, 1, 2, 3, 4), variants, scale)


def _plan(kern, grid, config, head_dim, args, dynamic, variants, scale):
    from ..runtime import LaunchPlan

    if variants is not None:
        dynamic = (*dynamic, *(len(args) + i for i in VARIANT_DYNAMIC))
        args = (*args, *variants.kernel_args(scale))
    return LaunchPlan(kern, grid, (config.threads,), args, smem=config.smem_bytes(head_dim), dynamic=dynamic)


def launch_forward(q, k, v, out, lse, *, causal: bool, scale: float, config: FwdConfig | None = None) -> None:
    """out, lse <- attention(q, k, v) on the current stream of q's device: `forward_plan` built and
    launched once (tests and tuning; the public op keeps its plans). K/V with a row stride >=
    MAX_KV_ROW_STRIDE elements are copied contiguous first."""
    if k.stride(2) >= MAX_KV_ROW_STRIDE:
        k = k.contiguous()
    if v.stride(2) >= MAX_KV_ROW_STRIDE:
        v = v.contiguous()
    plan = forward_plan(q, k, v, out, lse, causal=causal, scale=scale, config=config)
    plan.launch(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr())


# ---- variable-length batches -----------------------------------------------------------------
def default_varlen_config(head_dim: int, causal: bool, arch: str = "sm_90a") -> FwdConfig:
    """The varlen table's config for (head dim, causal) on `arch` (archs without a table use sm_80's)."""
    table = VARLEN_DEFAULTS.get(arch, VARLEN_DEFAULTS["sm_80"])
    try:
        return table[(int(head_dim), bool(causal))]
    except KeyError:
        raise ValueError(f"head dim {head_dim} is not supported; supported: {HEAD_DIMS}") from None


def forward_varlen_plan(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, *, causal: bool,
                        scale: float, config: FwdConfig | None = None, variants: VariantArgs | None = None):
    """A LaunchPlan computing out, lse <- attention_varlen(q, k, v) for tensors of these shapes,
    strides, dtype and device, and batches of len(cu_seqlens_q) - 1 sequences whose longest query
    has max_seqlen_q tokens. Launch it with the data pointers of q, k, v, out, lse, cu_seqlens_q,
    cu_seqlens_k (in that order).

    q [Tq, H, d], k/v [Tk, Hkv, d], out [Tq, H, d]: one 16-bit dtype, stride(-1) == 1, token and
    head strides multiples of 8 elements, K/V token strides below MAX_KV_ROW_STRIDE; lse [H, Tq] fp32
    contiguous (natural log); cu_seqlens_q / cu_seqlens_k int32 [B + 1] contiguous on q's device.
    The grid covers max_seqlen_q (>= every sequence's query length: tiles past a sequence's end exit,
    a longer sequence would be cut); rows past cu_seqlens_q[B] get out 0 and lse -inf. Trusts its
    caller (tileattn.api_varlen checks the arguments). `variants`: as forward_plan.
    """
    from ..runtime import device_arch
    from . import load

    total_q, heads, head_dim = q.shape
    kv_heads = k.shape[1]
    batch = cu_seqlens_q.shape[0] - 1
    device_index = q.device.index
    bf16 = q.dtype == torch.bfloat16
    if variants is not None:
        config = config or VARLEN_VARIANT_DEFAULTS[head_dim]
        kern = load(FAMILY_NAME, variant_expression(head_dim, config, bf16, varlen=True,
                                                    rng_state=variants.reads_rng_state), device_index)
    else:
        if config is None:
            config = default_varlen_config(head_dim, causal, device_arch(device_index))
        kern = load(FAMILY_NAME, expression(head_dim, config, causal, bf16, varlen=True), device_index)
    # z-slice B (the last) writes the rows past the last sequence (out 0, lse -inf).
    grid = (max(1, (max_seqlen_q + config.block_m - 1) // config.block_m), heads, batch + 1)
    qs, ks, vs, os_ = q.stride(), k.stride(), v.stride(), out.stride()
    i64 = np.int64
    args = (
        q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr(),
        i64(qs[1]), i64(qs[0]), i64(ks[1]), i64(ks[0]), i64(vs[1]), i64(vs[0]), i64(os_[1]), i64(os_[0]),
        np.uint64(kv_group_magic(heads // kv_heads)), cu_seqlens_q.data_ptr(), cu_seqlens_k.data_ptr(),
        np.int32(total_q), np.float32(scale * LOG2E),
    )
    return _plan(kern, grid, config, head_dim, args, (0, 1, 2, 3, 4, 14, 15), variants, scale)


__all__ = [
    "DEFAULTS",
    "EXTRA_BF16",
    "FAMILIES",
    "FwdConfig",
    "HEAD_DIMS",
    "INSTANTIATIONS",
    "UNBOUNDED",
    "VariantArgs",
    "variant_expression",
    "forward_plan",
    "default_config",
    "default_varlen_config",
    "expression",
    "forward_varlen_plan",
    "launch_forward",
    "tuning_candidates",
]
