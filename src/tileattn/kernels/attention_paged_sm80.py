"""Paged attention on the sm_80 tensor-core path (csrc/attention_paged_sm80.cu): configs, split-KV
choice and launch plans.

Kernel conventions: q [Tq, H, d] (any strides, last dim contiguous, 16-byte aligned rows);
k_cache/v_cache [num_blocks, block_size, Hkv, d] likewise; block_table int32 [B, max_blocks] with
stride(1) == 1; cu_seqlens_q int32 [B+1] and seqlens_k int32 [B] contiguous; out [Tq, H, d] and
lse [H, Tq] fp32 contiguous, allocated here with torch.empty. block_size is a power of two in
16..256. grid = (M tiles, Hkv * num_splits, B), M tiles = ceil(max_seqlen_q * G / BLOCK_M) with
G = H / Hkv: nothing in the grid depends on the device-side lengths, so a CUDA graph captured
once replays for every step. Rows of out / lse past cu_seqlens_q[B] (token padding) are written
0 / -inf by the kernel. Window / softcap / ALiBi run the `attention_paged_variants_sm80`
instantiations (VARIANT_INSTANTIATIONS, the base table CONFIGS on every arch).

Programmatic dependent launch: every CTA of the kernel waits (griddepcontrol.wait) before its first
global access, so with runtime.pdl_enabled(device) (sm_90+, unless TILEATTN_PDL=0) the launch
carries the PDL attribute and overlaps its scheduling with the previous kernel's tail (an engine's
rotary + KV write) and lets the next one (the o projection) be scheduled early. The flag is read on
every call and picks one of the launch's two plans (PagedLaunch._plan), so a cached PagedLaunch
follows a switch. TILEATTN_PAGED_PDL=0 launches this family without the attribute while the others
keep it (to measure what PDL saves around attention).

Two latency options for short contexts (docs/attention_paged.md, "Latency at short contexts",
measured on the H200 in the engine's decode):
- unsplit_tiles (T): a (sequence, KV head) group of at most T key tiles runs as one split (no
  partials, arrival or combine). PagedLaunch's `unsplit_tiles`, default from
  TILEATTN_PAGED_UNSPLIT_TILES (read once per process: a non-negative int, or "auto" for the
  config's stages - 1, the most tiles whose loads are all in flight at once; unset: "auto", +0.3 %
  in the engine's decode; 0 restores the split-per-tile rule).
- prior_kernel_writes_only_new_keys: the caller's contract under which the kernel reads the block
  table and lengths and issues the old keys' tile loads before its PDL wait (the kernel's header,
  "Programmatic dependent launch"). Never assumed; measured 10 % slower in the engine's decode, so
  the engine does not use it.

Three warp layouts per head dim, picked by the rows one (sequence, KV head) problem can have,
max_seqlen_q * G: up to 16 (decode, GQA decode, short speculative runs) one m16 tile whose keys
are split over 4 warps; up to 64 a 64-row tile of 4 warps; more (chunked prefill) 128 rows, 32 per
warp (16 at d=256), FlashAttention-2 style.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import numpy as np
import torch

from . import Family

FAMILY_NAME = "attention_paged_sm80"
SOURCE = "attention_paged_sm80.cu"
HEAD_DIMS = (32, 64, 96, 128, 256)
LOG2E = 1.4426950408889634
MAX_SPLITS = 128  # the in-kernel combine's kMaxSplits
MIN_COUNTERS = 4096  # arrival counters allocated at least (B * Hkv * M tiles of any split launch)


@dataclass(frozen=True)
class PagedConfig:
    """BLOCK_M rows (16 or 32 per warp along M) x BLOCK_N keys per tile, warps over rows x keys, stages."""

    block_m: int
    warps_m: int
    warps_n: int
    block_n: int
    stages: int

    @property
    def threads(self) -> int:
        return 32 * self.warps_m * self.warps_n

    def smem_bytes(self, head_dim: int) -> int:
        """Dynamic shared memory: the Q tile and `stages` K and V tiles, 16-bit elements, rows at
        common/sm80_tile.cuh's power-of-two pitch (d=96 rows take 128 elements)."""
        pitch = 1 << (head_dim - 1).bit_length()
        return 2 * pitch * (self.block_m + 2 * self.stages * self.block_n)

    def __str__(self) -> str:
        return f"{self.block_m}x{self.block_n}/w{self.warps_m}x{self.warps_n}/s{self.stages}"


C = PagedConfig
# (head dim) -> (decode, small, prefill) configs. Decode: 16 rows, 4 warps each multiplying 16 keys
# of a 64-key tile; K+V bytes in flight per CTA = (stages - 1) * 64 keys * d * 4 B = 64 KB at
# d=128 with 3 stages, and 100 KB of smem lets 2 CTAs share an SM (128 KB in flight per SM; an
# H200 needs ~30 KB per SM to cover ~1 us of latency at 4.8 TB/s). d=256: 2 stages (136 KB, one
# CTA per SM, 64 KB in flight). Prefill at d <= 128: 128 rows over 4 warps of 32 rows (two m16
# tiles: half the shared-memory K/V reads per FLOP of 16-row warps), 64 KB at d=128 with 32-key
# tiles, 240 registers (2 CTAs per SM); d=256: 8 warps of 16 rows (O alone is 128 registers per m16
# tile). This table is what sm_80 runs; ARCH_CONFIGS overrides entries per arch.
CONFIGS: dict[int, tuple[PagedConfig, PagedConfig, PagedConfig]] = {
    32: (C(16, 1, 4, 64, 4), C(64, 4, 1, 64, 3), C(128, 4, 1, 64, 2)),
    64: (C(16, 1, 4, 64, 4), C(64, 4, 1, 64, 3), C(128, 4, 1, 64, 2)),
    96: (C(16, 1, 4, 64, 3), C(64, 4, 1, 64, 2), C(128, 4, 1, 32, 2)),
    128: (C(16, 1, 4, 64, 3), C(64, 4, 1, 64, 2), C(128, 4, 1, 32, 2)),
    256: (C(16, 1, 4, 64, 2), C(64, 4, 1, 32, 2), C(128, 8, 1, 32, 2)),
}


def expression(head_dim: int, config: PagedConfig, bf16: bool) -> str:
    c = config
    return (
        f"tileattn::attention_paged_sm80<{head_dim}, {c.block_m}, {c.warps_m}, {c.warps_n}, {c.block_n}, "
        f"{c.stages}, {'true' if bf16 else 'false'}>"
    )


# Per-arch replacements of CONFIGS entries. sm_90a, d=128 prefill: the dense forward's own
# 128x64/w4/s2 tile (255 registers, 0 spills with sm_90a's uniform registers; sm_80's ptxas spills
# 40 bytes there, so sm_80 keeps 128x32): the loader, barrier, row max and rescale vote per 64 keys
# instead of 32, ~3.4 instead of ~4.0 SASS instructions per HMMA on the common path.
ARCH_CONFIGS: dict[str, dict[int, tuple[PagedConfig, PagedConfig, PagedConfig]]] = {
    "sm_90a": {128: (*CONFIGS[128][:2], C(128, 4, 1, 64, 2))},
}


def configs(head_dim: int, arch: str = "sm_80") -> tuple[PagedConfig, PagedConfig, PagedConfig]:
    """(decode, small, prefill) configs of `head_dim` on `arch` ("sm_90a", "sm_80", ...)."""
    return ARCH_CONFIGS.get(arch, {}).get(head_dim) or CONFIGS[head_dim]


def variant_expression(head_dim: int, config: PagedConfig, bf16: bool) -> str:
    """NVRTC name expression of a variant (window / softcap / ALiBi) instantiation."""
    return expression(head_dim, config, bf16).replace("attention_paged_sm80<", "attention_paged_variants_sm80<")


# Variant kernels (window, softcap, ALiBi: csrc/common/variants.cuh; every variant a run-time choice
# inside one instantiation per (head dim, dtype, layout)) take the base table CONFIGS on every arch:
# 0 spills / 0 stack for sm_80 and sm_90a. (The sm_90a 128x64 prefill tile is at 255 registers
# without the variant code.)
VARIANT_INSTANTIATIONS = tuple(
    variant_expression(d, c, bf16) for d in HEAD_DIMS for bf16 in (False, True) for c in CONFIGS[d])
PLAIN_INSTANTIATIONS = tuple(expression(d, c, bf16) for d in HEAD_DIMS for bf16 in (False, True) for c in CONFIGS[d])
INSTANTIATIONS = PLAIN_INSTANTIATIONS + VARIANT_INSTANTIATIONS
# Instantiations only an arch's table uses: their own family, compiled (and checked) for that arch.
ARCH_FAMILY_NAME = {arch: f"{FAMILY_NAME}_{arch}" for arch in ARCH_CONFIGS}
ARCH_INSTANTIATIONS = {
    arch: tuple(dict.fromkeys(
        expression(d, c, bf16) for d, cs in table.items() for bf16 in (False, True) for c in cs
        if expression(d, c, bf16) not in INSTANTIATIONS))
    for arch, table in ARCH_CONFIGS.items()
}  # fmt: skip
# Candidates `tileattn bench decode` times beside the default chunked-prefill tile (bf16, d=128):
# 128x32 with a third stage (2 K/V tiles of 32 keys in flight instead of 1: 80 KB, still 2 CTAs per
# SM). The sm_80 default 128x32/s2 is an instantiation already.
PREFILL_TUNING: dict[int, tuple[PagedConfig, ...]] = {128: (C(128, 4, 1, 32, 3),)}
# Decode candidates `tileattn bench decode --sweep` times against the default 16x64/w1x4/s3 (bf16,
# d=128; docs/attention_paged.md, "GQA B=8 decode"). The default holds 2 CTAs per SM (100 KB of
# smem, 171 registers x 128 threads), 64 KB of K+V in flight per CTA, 8 warps per SM. Each
# candidate moves one of those while keeping >= 128 KB in flight per SM:
#  - 16x32/w1x2/s3: half the CTA (2 warps, 32-key tiles, 52 KB): 4 CTAs per SM, the same bytes in
#    flight and warps per SM, twice the CTAs for the same splits (finer tail, two CTAs' prologues
#    overlapping each other's loads).
#  - 16x32/w1x2/s4: one more stage (68 KB): 3 CTAs per SM, 3 tiles in flight per CTA, 144 KB per SM.
#  - 16x128/w1x8/s3: twice the CTA (8 warps, 128-key tiles, 200 KB): 1 CTA per SM, half the
#    barriers and loop overhead per byte, half the CTAs (fewer partials to combine).
DECODE_TUNING: dict[int, tuple[PagedConfig, ...]] = {128: (C(16, 1, 2, 32, 3), C(16, 1, 2, 32, 4), C(16, 1, 8, 128, 3))}
TUNING = tuple(expression(d, c, True) for table in (PREFILL_TUNING, DECODE_TUNING) for d, cs in table.items() for c in cs)
FAMILIES = (
    Family(FAMILY_NAME, SOURCE, INSTANTIATIONS, archs=("sm_90a", "sm_80"), tuning=TUNING),
    *(Family(ARCH_FAMILY_NAME[arch], SOURCE, exprs, archs=(arch,)) for arch, exprs in ARCH_INSTANTIATIONS.items()),
)


def pick_config(head_dim: int, rows: int, arch: str = "sm_80", variants: bool = False) -> PagedConfig:
    """The warp layout on `arch` for problems of up to `rows` = max_seqlen_q * (H / Hkv) rows
    (`variants`: the variant kernels' table, CONFIGS on every arch)."""
    decode, small, prefill = CONFIGS[head_dim] if variants else configs(head_dim, arch)
    return decode if rows <= decode.block_m else small if rows <= small.block_m else prefill


def choose_num_splits(ctas: int, sm_count: int, ctas_per_sm: int, capacity: int, block_n: int) -> int:
    """Split-KV count from the launch shape only (never from the device-side lengths).

    `ctas` = B * Hkv * M tiles without splitting; `capacity` = max_blocks * block_size keys. No
    split when the CTAs already fill 80% of the GPU's slots (sm_count * ctas_per_sm). Otherwise as
    many splits as fit in one wave (slots // ctas), with at least two key tiles per split at full
    capacity and at most MAX_SPLITS. A split launch is latency-bound (few CTAs, each a chain of
    dependent reads before its first tile, then its share of the keys): its time follows the
    longest CTA's tile count and the number of waves, each wave paying the chain again. So: one
    wave, as full as it goes. (FlashAttention-3's rule, the smallest count within 85% of the best
    wave efficiency, trades splits for its second combine kernel's work; here the combine runs in
    the last CTA of each group. B=1 MHA at 4k keys: 8 splits of 8 tiles, 256 CTAs, instead of 7 of
    up to 10; B=1 GQA-4: 32 of 2 tiles instead of 28 of up to 3.) This is the grid's count; each
    (M tile, KV head, sequence) group runs min(num_splits, max(1, its key tiles)) of them (one
    where it has at most unsplit_tiles key tiles), decided in the kernel from the device-side
    lengths (the others leave at once), so a table sized for a
    long context costs short sequences no partials or combine work.
    """
    slots = sm_count * ctas_per_sm
    if ctas >= 0.8 * slots:
        return 1
    most = max(1, min(MAX_SPLITS, capacity // (2 * block_n)))
    return max(1, min(most, slots // ctas))


def _load(device_index: int, arch: str, expr: str, smem: int):
    from . import load

    own = arch in ARCH_INSTANTIATIONS and expr in ARCH_INSTANTIATIONS[arch]
    kern = load(ARCH_FAMILY_NAME[arch] if own else FAMILY_NAME, expr, device_index)
    if smem:
        kern.reserve_dynamic_smem(smem)  # > 48 KB needs the opt-in attribute, once
    return kern


UNSPLIT_TILES_ENV = "TILEATTN_PAGED_UNSPLIT_TILES"


def parse_unsplit_tiles(value: str | None) -> int | str:
    """TILEATTN_PAGED_UNSPLIT_TILES's value: None, "" or "auto" -> "auto" (the default), a
    non-negative decimal int -> that int (0: no group runs unsplit). Raises ValueError naming the
    variable otherwise."""
    text = (value or "").strip() or "auto"
    if text == "auto":
        return "auto"
    if not text.isdigit():  # digits only: no sign, no "1.5", no "2e3"
        raise ValueError(f"{UNSPLIT_TILES_ENV} must be a non-negative int or 'auto', got {value!r}")
    return int(text)


@functools.cache
def _unsplit_setting() -> int | str:
    """The parsed TILEATTN_PAGED_UNSPLIT_TILES, read once per process."""
    return parse_unsplit_tiles(os.environ.get(UNSPLIT_TILES_ENV))


def default_unsplit_tiles(config: PagedConfig) -> int:
    """T for launches that do not pass one: TILEATTN_PAGED_UNSPLIT_TILES (read at the first call of
    the process; later changes of the variable are not seen), "auto" meaning config.stages - 1."""
    value = _unsplit_setting()
    return config.stages - 1 if value == "auto" else value


def pdl_launch(device_index: int) -> bool:
    """Whether paged launches on `device_index` carry the PDL attribute now: runtime.pdl_enabled
    (read per call) unless TILEATTN_PAGED_PDL=0."""
    from ..runtime.launcher import pdl_enabled

    return os.environ.get("TILEATTN_PAGED_PDL", "1") != "0" and pdl_enabled(device_index)


def _capture_id(device: int) -> int | None:
    """Id of the CUDA-graph capture the current stream is recording (unique in the process), or
    None when the driver cannot say."""
    from cuda.bindings import driver

    from ..runtime import current_stream_handle

    result = driver.cuStreamGetCaptureInfo(current_stream_handle(device))
    if result[0] != driver.CUresult.CUDA_SUCCESS:
        return None
    return int(result[2])


class _ArrivalCounters:
    """Zeroed int32 counters for the split-KV arrivals of the launches on one stream. The kernel
    leaves them zero (the last split of each group resets its counter), so they need zeroing only
    until the first eager use: torch.zeros during CUDA-graph capture only records the memset (it
    runs at each replay of that graph, not now). So a buffer not yet zeroed eagerly records one
    memset into every graph captured with it (at that graph's first split launch: each replay
    starts from zeros), and is zeroed for good by its first eager use. The buffer is a normal tensor
    even when first made under torch.inference_mode (an engine's graph capture): zero_() on an
    inference tensor outside inference mode raises, and the buffer outlives the mode."""

    __slots__ = ("tensor", "zeroed", "captures")

    def __init__(self, count: int, device: int):
        with torch.inference_mode(False):
            self.tensor = torch.zeros(count, dtype=torch.int32, device=f"cuda:{device}")
        self.zeroed = not torch.cuda.is_current_stream_capturing()
        self.captures: set[int] = set() if self.zeroed else {_capture_id(device)}

    def prepare(self, device: int) -> None:
        if torch.cuda.is_current_stream_capturing():
            capture = _capture_id(device)
            if capture is None or capture not in self.captures:  # unknown capture: record the memset
                self.tensor.zero_()
                self.captures.add(capture)
        else:
            self.tensor.zero_()
            self.zeroed = True


# (device, raw stream) -> counters. One buffer per stream: launches on one stream are ordered, so
# they can share counters; concurrent streams must not. Every buffer ever handed out is kept: a
# captured graph goes on using its pointer.
_counters: dict[tuple[int, int], _ArrivalCounters] = {}
_counters_kept: list[_ArrivalCounters] = []
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or (
    lambda index: torch.cuda.current_stream(index).cuda_stream)


def arrival_counters(device: int, count: int) -> int:
    """Device pointer of >= `count` zeroed int32 counters for a split-KV launch on the current stream."""
    key = (device, _raw_stream(device))
    c = _counters.get(key)
    if c is None or c.tensor.numel() < count:
        c = _counters[key] = _ArrivalCounters(max(count, MIN_COUNTERS), device)
        _counters_kept.append(c)
    if not c.zeroed:
        c.prepare(device)
    return c.tensor.data_ptr()


class PagedLaunch:
    """The launch decisions for one (device, dtype, shapes, strides, flags) combination: config,
    split count, grid, and the packed arguments (a LaunchPlan whose data pointers are rewritten per
    call). Calling it allocates out/lse/workspaces and launches one kernel."""

    def __init__(self, q, k_cache, v_cache, block_table, *, max_seqlen_q: int, causal: bool, scale: float,
                 return_lse: bool, num_splits: int | None, config: PagedConfig | None = None, variants=None,
                 unsplit_tiles: int | None = None, prior_kernel_writes_only_new_keys: bool = False):
        """`variants`: None (the plain kernel) or an attention_fwd_sm80.VariantArgs without dropout
        (window edges with causal folded in, softcap, the ALiBi batch stride): the variant kernel,
        whose launch then takes the slopes (or None) per call; `causal` must be False then.
        `unsplit_tiles`: int >= 0, groups of at most that many key tiles run unsplit (None: the
        process default, default_unsplit_tiles). `prior_kernel_writes_only_new_keys`: the engine
        contract (api_paged.attention_paged's argument of that name). Raises ValueError on a
        negative or non-int unsplit_tiles."""
        from ..runtime import device_arch, device_sm_count, device_smem_optin

        num_tokens, heads, head_dim = q.shape
        num_blocks, block_size, kv_heads, _ = k_cache.shape
        batch, max_blocks = block_table.shape
        group = heads // kv_heads
        device = q.device.index
        bf16 = q.dtype == torch.bfloat16
        arch = device_arch(device)
        # an explicit config: tuning benchmarks
        config = config or pick_config(head_dim, max_seqlen_q * group, arch, variants is not None)
        m_tiles = -(-max_seqlen_q * group // config.block_m)
        smem = config.smem_bytes(head_dim)
        if num_splits is None:
            per_sm = max(1, min(device_smem_optin(device) // (smem + 1024), 4))
            num_splits = choose_num_splits(batch * kv_heads * m_tiles, device_sm_count(device), per_sm,
                                           max_blocks * block_size, config.block_n)
        self.num_splits = num_splits = max(1, min(num_splits, MAX_SPLITS, 65535 // kv_heads))
        if unsplit_tiles is None:
            unsplit_tiles = default_unsplit_tiles(config)
        if isinstance(unsplit_tiles, bool) or not isinstance(unsplit_tiles, (int, np.integer)) or unsplit_tiles < 0:
            raise ValueError(f"unsplit_tiles must be an int >= 0 or None, got {unsplit_tiles!r}")
        # int32 in the kernel: any count past the table's tiles means "never split" already.
        self.unsplit_tiles = min(int(unsplit_tiles), 2**31 - 1)
        self.prewait = bool(prior_kernel_writes_only_new_keys)
        self.config = config
        self.out_shape = (num_tokens, heads, head_dim)
        self.lse_shape = (heads, num_tokens) if return_lse else None
        # Split-KV workspace, one fp32 allocation: o_part [S, Tq, H, d] then lse_part [S, Tq, H]
        # (o_part's byte size is a multiple of 16, so lse_part starts aligned).
        self.part_floats = num_splits * num_tokens * heads * (head_dim + 1)
        self.lse_part_offset = num_splits * num_tokens * heads * head_dim * 4  # bytes
        self.device = q.device
        i64, i32 = np.int64, np.int32
        args = (
            0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,  # q, k, v, block_table, cu_q, seqlens_k, out, lse, parts, counters
            i64(q.stride(0)), i64(q.stride(1)),
            i64(k_cache.stride(0)), i64(k_cache.stride(1)), i64(k_cache.stride(2)),
            i64(v_cache.stride(0)), i64(v_cache.stride(1)), i64(v_cache.stride(2)),
            i32(block_table.stride(0)), i32(num_blocks), i32(max_blocks), i32(block_size.bit_length() - 1),
            i32(num_tokens), i32(heads), i32(group), i32(num_splits), i32(bool(causal)), np.float32(scale * LOG2E),
            i32(self.unsplit_tiles), i32(self.prewait),
        )  # fmt: skip
        dynamic = tuple(range(11))
        self.variants = variants
        if variants is None:
            kern = _load(device, arch, expression(head_dim, config, bf16), smem)
        else:  # VARIANT_PARAMS follow; the slopes' pointer (their first) is a per-call value
            assert not causal and variants.dropout_p == 0, "causal is folded into the window; no dropout here"
            kern = _load(device, arch, variant_expression(head_dim, config, bf16), smem)
            dynamic += (len(args),)
            args += variants.kernel_args(scale)
        grid = (m_tiles, kv_heads * num_splits, batch)
        self.groups = m_tiles * kv_heads * batch  # split-KV arrival counters
        # One LaunchPlan per PDL flag (the same kernel and packed arguments; only the launch call
        # differs), the current flag's built now, the other on the first call that needs it.
        self._plan_args = (kern, grid, (config.threads, 1, 1), args, smem, dynamic)
        self._plans: dict = {}  # PDL flag -> LaunchPlan
        self._plan(pdl_launch(device))

    def _plan(self, pdl: bool):
        """The LaunchPlan launching with (`pdl` True) or without the PDL attribute."""
        plan = self._plans.get(pdl)
        if plan is None:
            from ..runtime import LaunchPlan

            kern, grid, block, args, smem, dynamic = self._plan_args
            plan = self._plans[pdl] = LaunchPlan(kern, grid, block, args, smem, dynamic=dynamic, pdl=pdl)
        return plan

    def __call__(self, q, k_cache, v_cache, block_table, cu_seqlens_q, seqlens_k, out=None, lse=None,
                 alibi_slopes=None):
        """(out [Tq, H, d], lse [H, Tq] fp32 or None), launched on the current stream. `out` / `lse`
        (contiguous, of those shapes) are allocated with torch.empty unless given (tests pass
        NaN-poisoned ones). `alibi_slopes`: the fp32 slopes of a variant launch made with an ALiBi
        batch stride (ignored otherwise)."""
        device = self.device
        if out is None:
            out = torch.empty(self.out_shape, dtype=q.dtype, device=device)
        if lse is None and self.lse_shape:
            lse = torch.empty(self.lse_shape, dtype=torch.float32, device=device)
        lse_ptr = lse.data_ptr() if lse is not None else 0
        ptrs = (q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_table.data_ptr(),
                cu_seqlens_q.data_ptr(), seqlens_k.data_ptr())
        alibi = () if self.variants is None else (0 if alibi_slopes is None else alibi_slopes.data_ptr(),)
        plan = self._plan(pdl_launch(device.index))
        if self.num_splits == 1:
            plan.launch(*ptrs, out.data_ptr(), lse_ptr, 0, 0, 0, *alibi)
        else:
            work = torch.empty(self.part_floats, dtype=torch.float32, device=device)  # alive past the launch
            o_part = work.data_ptr()
            # Under capture the counters' zeroing (if any) is recorded here, between the previous
            # kernel and this one; with PDL the kernel still touches them only after its wait.
            counters = arrival_counters(device.index, self.groups)
            plan.launch(*ptrs, out.data_ptr(), lse_ptr, o_part, o_part + self.lse_part_offset, counters, *alibi)
        return out, lse


def bytes_read(kv_heads: int, seqlens_k, head_dim: int, element_size: int = 2) -> int:
    """K+V bytes a paged call must read: every cached key and value once per KV head."""
    return 2 * kv_heads * int(sum(seqlens_k)) * head_dim * element_size


__all__ = [
    "CONFIGS",
    "FAMILIES",
    "HEAD_DIMS",
    "INSTANTIATIONS",
    "PagedConfig",
    "ARCH_CONFIGS",
    "ARCH_FAMILY_NAME",
    "ARCH_INSTANTIATIONS",
    "PREFILL_TUNING",
    "DECODE_TUNING",
    "PagedLaunch",
    "PLAIN_INSTANTIATIONS",
    "UNSPLIT_TILES_ENV",
    "VARIANT_INSTANTIATIONS",
    "arrival_counters",
    "bytes_read",
    "choose_num_splits",
    "configs",
    "default_unsplit_tiles",
    "expression",
    "parse_unsplit_tiles",
    "pdl_launch",
    "pick_config",
    "variant_expression",
]
