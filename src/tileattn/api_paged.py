"""Public inference ops over a paged KV cache: `attention_paged` and `write_kv_cache`.

Both check their arguments on the host (ValueError naming the argument) before anything is
launched, never synchronise with the device (unless `validate=True`), allocate with torch.empty,
and launch on torch's current stream, so a decode step made of them can be captured in a CUDA
graph. The per-call Python is kept small because an engine calls attention_paged once per layer
per step: the checks and the launch decisions (kernel config, split count, packed arguments) are
made once per (shapes, strides, dtypes, device, flags) combination and cached; a repeated call
costs the cache key, two pointer-alignment tests, the output allocations and the launches.

Contents of the index tensors (block ids, lengths) cannot be checked without a sync. Whatever
they hold, the kernels never read or write outside k_cache / v_cache / q / out: block ids outside
[0, num_blocks) are never dereferenced (their keys are masked), keys past the block table's
capacity are not visited, cache slots outside the cache are skipped. `validate=True` checks the
contents on the host (one sync) and raises ValueError instead.
"""

from __future__ import annotations

import math
import numbers

import torch
from torch import Tensor

from . import dropout as dr
from . import reference
from .launch_limits import MAX_GRID_YZ

__all__ = ["attention_paged", "write_kv_cache"]

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
PAGED_HEAD_DIMS = (32, 64, 96, 128, 256)
_ALIGN_ELEMS = 8  # 16 bytes of a 16-bit dtype: the kernels move 16-byte chunks
_INT32_MAX = 2**31 - 1

# Per-shape caches. An eager engine step changes Tq and max_seqlen_q from step to step, so they are
# bounded: when one reaches CACHE_LIMIT entries it is cleared (rebuilding an entry costs ~0.1 ms).
CACHE_LIMIT = 1024
_current_device = getattr(torch._C, "_cuda_getDevice", torch.cuda.current_device)
_paged_cache: dict[tuple, object] = {}  # metadata key -> kernels.attention_paged_sm80.PagedLaunch
_write_checked: set[tuple] = set()  # metadata keys of write_kv_cache calls that passed the checks


def attention_paged(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_table: Tensor,
    cu_seqlens_q: Tensor,
    seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool = True,
    scale: float | None = None,
    return_lse: bool = False,
    num_splits: int | None = None,
    validate: bool = False,
    *,
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    alibi_slopes: Tensor | None = None,
    prior_kernel_writes_only_new_keys: bool = False,
):
    """Attention of packed queries of B sequences against a paged KV cache (forward only).

    Serves decode (one query token per sequence), chunked prefill against a cached prefix,
    speculative verification (a few tokens) and any mix of them in one call.

    Positions: query token i (0-based within its sequence) of a sequence with nq queries and nk
    keys sits at key position i + nk - nq (the queries are the sequence's last keys); the causal
    mask, the window and ALiBi's distances use these positions (docs/attention_variants.md).

    Args:
        q: [Tq, H, d] float16/bfloat16 CUDA tensor; sequence b owns tokens
            cu_seqlens_q[b] .. cu_seqlens_q[b+1]. Last dim contiguous, other strides multiples of 8
            elements. d in {32, 64, 96, 128, 256}.
        k_cache, v_cache: [num_blocks, block_size, Hkv, d], q's dtype and device; block_size a power
            of two in 16..256; Hkv divides H (query head h reads KV head h // (H // Hkv)). Same
            stride rules as q.
        block_table: int32 [B, max_blocks], stride(1) == 1: key j of sequence b is row
            j % block_size of cache block block_table[b, j // block_size]. Blocks may be shared
            between sequences (prefix caching); entries past a sequence's length are never used (those of a
            split's first tiles may be read ahead of the length, up to the table's capacity).
        cu_seqlens_q: int32 [B+1], contiguous, from 0, non-decreasing.
        seqlens_k: int32 [B], contiguous: key length of each sequence INCLUDING its query tokens
            (the queries are its last keys, already written to the cache).
        max_seqlen_q: int >= every query length: sizes the launch grid (keep it fixed under CUDA
            graphs; 1 for pure decode). max_seqlen_k: int >= every key length (checked by
            validate; the kernels take their key counts from seqlens_k).
        causal: bottom-right aligned per sequence: query i of a sequence with nq queries and nk
            keys sees key j iff j <= i + nk - nq.
        scale: multiplies q . k; default 1 / sqrt(d); finite and > 0.
        return_lse: also return lse [H, Tq] float32 (natural log).
        num_splits: force the split-KV count (>= 1; at most 128 are used); default: chosen from B, Hkv, max_seqlen_q,
            the SM count and the block table's capacity max_blocks * block_size (never from the
            lengths, which live on the device).
        validate: copy the index tensors to the host (a sync) and raise ValueError on contents
            the kernels would mask or skip (see tileattn.reference.check_paged_contents).
        window: (left, right) ints >= -1 (-1: unbounded), as tileattn.attention: query i sees key
            j iff i + nk - nq - left <= j <= i + nk - nq + right; with causal, right becomes
            min(right, 0). Key tiles wholly outside a CTA's windows are not read, so a sliding
            window costs O(window) per query in decode and prefill.
        softcap: None / 0 (off) or a finite c > 0: scores s = scale * q . k become c * tanh(s / c)
            before the softmax.
        alibi_slopes: None or float32 [H] or [B, H] (row b for sequence b), contiguous, on q's
            device: scores gain -slope[b, h] * |i + nk - nq - j|.
            Any of window / softcap / alibi_slopes runs the variant kernels (the sm_80-path table
            on every arch); without them the plain kernels run, unchanged. With a variant, Tq and
            the table's capacity max_blocks * block_size must be at most 2^28 (int32 window
            arithmetic).
        prior_kernel_writes_only_new_keys: bool, a promise by the caller (an engine) about the
            kernel launched on the stream just before this call: of what this call reads, it
            writes only q and the cache slots of each sequence's newest nq keys (positions
            nk - nq .. nk - 1; no other slot of any block a sequence here maps below nk - nq,
            which holds when blocks shared between sequences are full and never written), and it
            is a tileattn kernel (or any kernel that waits for its predecessors, griddepcontrol.wait,
            before letting the next one be scheduled). With it, under programmatic dependent
            launch, the kernel reads the block table and lengths and starts loading the older keys
            before waiting for that kernel. Default False: nothing is assumed. A False promise
            gives wrong results, not an error. A plain bool is required (ValueError otherwise).

    Returns:
        out [Tq, H, d] in q's dtype (contiguous), and lse [H, Tq] float32 when return_lse. Rows
        that see no key get 0 and lse -inf. Rows past cu_seqlens_q[B] (a token count padded to a
        captured CUDA-graph size) belong to no sequence and get exactly 0 and lse -inf, written
        by the kernel from the device-side cu_seqlens_q (no sync; the grid does not depend on
        it); all of out is 0 and lse -inf when nothing is launched (Tq, B or max_seqlen_q is 0).

    Raises:
        ValueError: causal, return_lse, validate or prior_kernel_writes_only_new_keys not a bool; a malformed
            window, softcap or alibi_slopes (shape, dtype, device, contiguity; checked first, so CPU tensors
            report them too), or with any of them Tq or the table's capacity above 2^28; a non-tensor argument
            or wrong rank; q/k_cache/v_cache dtypes other than one of float16/bfloat16; index tensors that are
            not int32; shapes that disagree (see above), a head dim outside {32, 64, 96, 128, 256}, Hkv not
            dividing H, a block_size that is not a power of two in 16..256, B or Hkv above 65535, more than
            2^31 - 1 keys of table capacity, cache slots, elements in one cache block or Tq * H rows;
            max_seqlen_q / max_seqlen_k not non-negative ints; a bad scale or num_splits; strides or data
            pointers not 16-byte aligned, block_table with stride(1) != 1, cu_seqlens_q / seqlens_k not
            contiguous; tensors on different devices or not on CUDA; with validate=True, bad index contents.
        tileattn.runtime.NoGPUError: CUDA tensors but no usable GPU.
    """
    if (type(causal) is not bool or type(return_lse) is not bool or type(validate) is not bool
            or type(prior_kernel_writes_only_new_keys) is not bool):
        causal, return_lse, validate, prior_kernel_writes_only_new_keys = dr.check_flags(
            causal=causal, return_lse=return_lse, validate=validate,
            prior_kernel_writes_only_new_keys=prior_kernel_writes_only_new_keys)
    variants = None  # (window left, right with causal folded in, softcap, slopes' metadata)
    if window is not None or softcap or alibi_slopes is not None:
        variants = _variant_key(window, causal, softcap, alibi_slopes)
    elif softcap is not None:  # a falsy softcap of the wrong type ("", []) is named, not taken as off
        dr.check_softcap(softcap)
    try:
        # get_device(): the CUDA index as an int (-1 on the CPU), cheaper than torch.device objects.
        key = (
            q.shape, q.stride(), q.dtype, k_cache.shape, k_cache.stride(), k_cache.dtype, v_cache.shape,
            v_cache.stride(), v_cache.dtype, block_table.shape, block_table.stride(), block_table.dtype,
            cu_seqlens_q.shape, cu_seqlens_q.stride(), cu_seqlens_q.dtype, seqlens_k.shape, seqlens_k.stride(),
            seqlens_k.dtype, q.get_device(), k_cache.get_device(), v_cache.get_device(), block_table.get_device(),
            cu_seqlens_q.get_device(), seqlens_k.get_device(), max_seqlen_q, causal, scale, return_lse, num_splits,
            variants, prior_kernel_writes_only_new_keys,
            type(max_seqlen_q), type(causal), type(scale), type(return_lse), type(num_splits),  # True == 1 == 1.0
        )  # fmt: skip
        launch = _paged_cache.get(key)
    except (AttributeError, TypeError):  # not tensors / unhashable arguments: the checks say which
        key, launch = None, None
    # max_seqlen_k does not shape the launch (the kernels read lengths from seqlens_k), so it is not
    # part of the key; it is still checked on every call.
    if launch is None or type(max_seqlen_k) is not int or max_seqlen_k < 0:
        if alibi_slopes is not None:  # before the device check: CPU tensors report it too
            _check_alibi(alibi_slopes, q, block_table)
        scale = _check_paged(q, k_cache, v_cache, block_table, cu_seqlens_q, seqlens_k, max_seqlen_q,
                             max_seqlen_k, scale, num_splits, variants is not None)
    if validate:
        reference.check_paged_contents(k_cache, block_table, cu_seqlens_q, seqlens_k, max_seqlen_q, max_seqlen_k)
    if (q.data_ptr() | k_cache.data_ptr() | v_cache.data_ptr()) & 15:
        _check_pointers(q=q, k_cache=k_cache, v_cache=v_cache)
    if q.shape[0] == 0 or block_table.shape[0] == 0 or max_seqlen_q == 0:
        out = q.new_zeros(q.shape)
        lse = q.new_full((q.shape[1], q.shape[0]), -math.inf, dtype=torch.float32)
        return (out, lse) if return_lse else out
    if launch is None:
        from .kernels import dispatch

        variant_args = None
        if variants is not None:
            from .kernels.attention_fwd_sm80 import VariantArgs

            left, right, cap, _ = variants
            sb = None if alibi_slopes is None else _check_alibi(alibi_slopes, q, block_table)
            variant_args = VariantArgs(left, right, cap, sb)
        launch = dispatch.paged_launch(q, k_cache, v_cache, block_table, max_seqlen_q=int(max_seqlen_q),
                                       causal=bool(causal), scale=float(scale), return_lse=bool(return_lse),
                                       num_splits=num_splits, variants=variant_args,
                                       prior_kernel_writes_only_new_keys=prior_kernel_writes_only_new_keys)
        if key is not None:
            if len(_paged_cache) >= CACHE_LIMIT:
                _paged_cache.clear()
            _paged_cache[key] = launch
    device = q.get_device()
    if _current_device() == device:
        out, lse = launch(q, k_cache, v_cache, block_table, cu_seqlens_q, seqlens_k, alibi_slopes=alibi_slopes)
    else:  # cuLaunchKernel uses the thread's current context: make it q's device's
        with torch.cuda.device(device):
            out, lse = launch(q, k_cache, v_cache, block_table, cu_seqlens_q, seqlens_k, alibi_slopes=alibi_slopes)
    return (out, lse) if return_lse else out


def write_kv_cache(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor,
                   validate: bool = False) -> None:
    """Store the keys and values of T tokens into their paged-cache slots, in place (one kernel).

    Args:
        k, v: [T, Hkv, d] CUDA tensors of the caches' dtype (any dtype whose d-element row is a
            multiple of 16 bytes: float16, bfloat16, float32, ...). Last dim contiguous, other
            strides and data pointers 16-byte aligned.
        k_cache, v_cache: [num_blocks, block_size, Hkv, d], block_size a power of two, same stride
            rules; modified in place.
        slot_mapping: int64 or int32 [T], contiguous: token t goes to
            cache[slot // block_size, slot % block_size] with slot = slot_mapping[t]. A negative
            slot skips the token (padding); a slot at or past num_blocks * block_size is skipped
            too (never written outside the cache), and raises with validate=True.
        validate: copy slot_mapping to the host (a sync) and raise ValueError on a slot past the
            cache.

    Returns None. Capturable by CUDA graphs (no sync, no allocation).

    Raises:
        ValueError: validate not a bool; non-tensors or wrong ranks; k/v/caches of different dtypes;
            shapes that disagree (k and v [T, Hkv, d], caches [num_blocks, block_size, Hkv, d] with the same
            Hkv and d, slot_mapping [T]); a block_size that is not a power of two; a row that is
            not a multiple of 16 bytes or longer than 4096 bytes; slot_mapping not int32/int64 or
            not contiguous; misaligned strides or pointers; tensors on different devices or not
            on CUDA; with validate=True, a slot past the cache.
        tileattn.runtime.NoGPUError: CUDA tensors but no usable GPU.
    """
    if type(validate) is not bool:
        validate = dr.check_flag("validate", validate)
    try:
        key = (
            k.shape, k.stride(), k.dtype, k.get_device(), v.shape, v.stride(), v.dtype, v.get_device(),
            k_cache.shape, k_cache.stride(), k_cache.dtype, k_cache.get_device(), v_cache.shape, v_cache.stride(),
            v_cache.dtype, v_cache.get_device(), slot_mapping.shape, slot_mapping.stride(), slot_mapping.dtype,
            slot_mapping.get_device(),
        )  # fmt: skip
        checked = key in _write_checked
    except (AttributeError, TypeError):
        key, checked = None, False
    if not checked:
        _check_write(k, v, k_cache, v_cache, slot_mapping)
        if key is not None:
            if len(_write_checked) >= CACHE_LIMIT:
                _write_checked.clear()
            _write_checked.add(key)
    if validate:
        num_slots = k_cache.shape[0] * k_cache.shape[1]
        slots = slot_mapping.to("cpu", torch.int64)
        past = slots >= num_slots
        if bool(past.any()):
            t = int(past.nonzero()[0, 0])
            raise ValueError(
                f"slot_mapping[{t}] = {int(slots[t])} is past the cache's {num_slots} slots "
                f"({k_cache.shape[0]} blocks of {k_cache.shape[1]})"
            )
    _check_pointers(k=k, v=v, k_cache=k_cache, v_cache=v_cache)
    if k.shape[0] == 0 or k.shape[1] == 0:
        return
    from .kernels.kv_cache import launch_write_kv_cache

    device = k.get_device()
    if _current_device() == device:
        launch_write_kv_cache(k, v, k_cache, v_cache, slot_mapping)
    else:  # cuLaunchKernel uses the thread's current context: make it k's device's
        with torch.cuda.device(device):
            launch_write_kv_cache(k, v, k_cache, v_cache, slot_mapping)


# ---------------------------------------------------------------------------------------------
# Argument checks
# ---------------------------------------------------------------------------------------------
def _variant_key(window, causal, softcap, alibi_slopes) -> tuple:
    """Checks window and softcap (tileattn.attention's rules) and returns the variants' part of the
    launch key: (left, right) with causal folded in (UNBOUNDED: none), the softcap (0.0: off), and
    the slopes' (shape, stride, dtype, device) or None. The slopes' contents and pointer are per-call."""
    left, right = dr.check_window(window, causal)
    cap = dr.check_softcap(softcap)
    if alibi_slopes is None:
        return left, right, cap, None
    if not isinstance(alibi_slopes, Tensor):
        raise ValueError(f"alibi_slopes must be None or a torch.Tensor, got {type(alibi_slopes).__name__}")
    return left, right, cap, (alibi_slopes.shape, alibi_slopes.stride(), alibi_slopes.dtype,
                              alibi_slopes.get_device())


def _check_alibi(alibi_slopes, q, block_table) -> int | None:
    """The slopes' checks (tileattn.attention's: [H] or [B, H] float32, contiguous, on q's device);
    returns their batch stride (0 or H), or None when q / block_table are malformed themselves
    (_check_paged then names them)."""
    if not (isinstance(q, Tensor) and q.dim() == 3 and isinstance(block_table, Tensor) and block_table.dim() == 2):
        return None
    return dr.check_alibi(alibi_slopes, block_table.shape[0], q.shape[1], q.device, dtype_strict=True)


def _check_variant_sizes(q, k_cache, block_table) -> None:
    capacity = block_table.shape[1] * k_cache.shape[1]
    if max(q.shape[0], capacity) > dr.MAX_VARIANT_SEQLEN:
        raise ValueError(
            f"window/softcap/alibi_slopes need Tq and the block table's capacity max_blocks * block_size <= 2^28 "
            f"(int32 window arithmetic), got Tq={q.shape[0]}, capacity={capacity}")


def _check_paged(q, k_cache, v_cache, block_table, cu_seqlens_q, seqlens_k, max_seqlen_q, max_seqlen_k, scale,
                 num_splits, variants: bool = False) -> float:
    """All metadata checks of attention_paged (`variants`: the sizes the variant kernels need too);
    returns the scale to use."""
    reference.check_paged_args(q, k_cache, v_cache, block_table, cu_seqlens_q, seqlens_k)
    if q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"q has dtype {q.dtype}; attention_paged supports torch.float16 and torch.bfloat16")
    for name, t in (("block_table", block_table), ("cu_seqlens_q", cu_seqlens_q), ("seqlens_k", seqlens_k)):
        if t.dtype != torch.int32:
            raise ValueError(f"{name} must be int32, got {t.dtype}")
    num_blocks, block_size, kv_heads, head_dim = k_cache.shape
    if q.shape[1] == 0:
        raise ValueError(f"q must have at least one head, got shape {tuple(q.shape)}")
    if head_dim not in PAGED_HEAD_DIMS:
        raise ValueError(f"q head dim d={head_dim} is not supported by attention_paged; supported: {PAGED_HEAD_DIMS}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache {tuple(v_cache.shape)} must have k_cache's shape {tuple(k_cache.shape)}")
    if block_size & (block_size - 1) or not 16 <= block_size <= 256:
        raise ValueError(f"k_cache block_size (dim 1) must be a power of two in 16..256, got {block_size}")
    batch, max_blocks = block_table.shape
    if batch > MAX_GRID_YZ or kv_heads > MAX_GRID_YZ:
        raise ValueError(f"B={batch} and Hkv={kv_heads} must be at most {MAX_GRID_YZ} (launch grid limit)")
    if max_blocks * block_size > _INT32_MAX:
        raise ValueError(f"block_table capacity {max_blocks} * {block_size} keys exceeds 2^31 - 1")
    if block_table.stride(0) > _INT32_MAX:  # the kernels take it as an int32
        raise ValueError(f"block_table row stride {block_table.stride(0)} exceeds 2^31 - 1")
    if block_size * max(k_cache.stride(1), v_cache.stride(1)) > _INT32_MAX:
        raise ValueError(
            f"one cache block spans more than 2^31 - 1 elements (block_size {block_size} x row stride "
            f"{max(k_cache.stride(1), v_cache.stride(1))}): the kernels address rows in a block with 32-bit offsets"
        )
    if num_blocks * block_size > _INT32_MAX or q.shape[0] * q.shape[1] > _INT32_MAX:
        raise ValueError(
            f"k_cache has {num_blocks * block_size} slots and q {q.shape[0] * q.shape[1]} rows; at most 2^31 - 1"
        )
    for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
            raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    if max_seqlen_q * (q.shape[1] // kv_heads) > _INT32_MAX:
        raise ValueError(f"max_seqlen_q={max_seqlen_q} times the GQA group size exceeds 2^31 - 1")
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    else:
        dr.check_scale(scale)
    if num_splits is not None and (
        isinstance(num_splits, bool) or not isinstance(num_splits, numbers.Integral) or num_splits < 1
    ):
        raise ValueError(f"num_splits must be None or an int >= 1, got {num_splits!r}")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        _check_strides(name, t)
    if block_table.stride(1) != 1 and max_blocks > 1:
        raise ValueError(f"block_table must have stride(1) == 1, got strides {tuple(block_table.stride())}")
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("seqlens_k", seqlens_k)):
        if t.stride(0) != 1 and t.shape[0] > 1:
            raise ValueError(f"{name} must be contiguous, got stride {t.stride(0)}")
    if variants:
        _check_variant_sizes(q, k_cache, block_table)
    if q.device.type != "cuda":
        raise ValueError(f"attention_paged needs CUDA tensors, got device {q.device}; move them with .cuda()")
    return float(scale)


def _check_write(k, v, k_cache, v_cache, slot_mapping) -> None:
    """All metadata checks of write_kv_cache: the reference's, then what the kernel needs."""
    reference.check_write_kv_args(k, v, k_cache, v_cache, slot_mapping)
    if not (k.dtype == v.dtype == k_cache.dtype):
        raise ValueError(f"k, v, k_cache, v_cache must share one dtype, got {k.dtype}, {v.dtype}, {k_cache.dtype}")
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping must be int64 or int32, got {slot_mapping.dtype}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache {tuple(v_cache.shape)} must have k_cache's shape {tuple(k_cache.shape)}")
    block_size = k_cache.shape[1]
    if block_size < 1 or block_size & (block_size - 1):
        raise ValueError(f"k_cache block_size (dim 1) must be a power of two, got {block_size}")
    row_bytes = k.shape[2] * k.element_size()
    if row_bytes == 0 or row_bytes % 16 or row_bytes > 4096:
        raise ValueError(
            f"k: a row of d={k.shape[2]} {k.dtype} elements is {row_bytes} bytes; it must be a multiple of 16 "
            "bytes and at most 4096 (one thread per 16-byte chunk, 256 threads per block)"
        )
    if k.shape[0] * k.shape[1] > _INT32_MAX - 256:  # the kernel's int32 row index also counts a last partial block
        raise ValueError(f"k: T * Hkv = {k.shape[0] * k.shape[1]} rows exceeds 2^31 - 257")
    align = 16 // k.element_size()
    for name, t in (("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        _check_strides(name, t, align)
    if slot_mapping.stride(0) != 1 and slot_mapping.shape[0] > 1:
        raise ValueError(f"slot_mapping must be contiguous, got stride {slot_mapping.stride(0)}")
    if k.device.type != "cuda":
        raise ValueError(f"write_kv_cache needs CUDA tensors, got device {k.device}; move them with .cuda()")


def _check_strides(name: str, t: Tensor, align: int = _ALIGN_ELEMS) -> None:
    strides = t.stride()
    if t.shape[-1] > 1 and strides[-1] != 1:
        raise ValueError(f"{name} must have a contiguous last dim (stride(-1) == 1), got strides {tuple(strides)}")
    for dim in range(t.dim() - 1):
        if t.shape[dim] > 1 and strides[dim] % align != 0:
            raise ValueError(
                f"{name}.stride({dim}) = {strides[dim]} is not a multiple of {align} elements: rows must be "
                "16-byte aligned because the kernels move 16-byte chunks"
            )


def _check_pointers(**tensors: Tensor) -> None:
    for name, t in tensors.items():
        if t.data_ptr() % 16:
            raise ValueError(
                f"{name}.data_ptr() = {t.data_ptr():#x} is not 16-byte aligned (storage offset "
                f"{t.storage_offset()}); the kernels move 16-byte chunks"
            )
