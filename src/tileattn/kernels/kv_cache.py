"""Paged KV-cache writes (csrc/kv_cache.cu): registry and launcher.

Kernel conventions: k/v [T, Hkv, d] and k_cache/v_cache [num_blocks, block_size, Hkv, d] of one
dtype, last dim contiguous, every other stride and every data pointer a multiple of 16 bytes, the
row (d elements) a multiple of 16 bytes; block_size a power of two; slot_mapping int32 or int64
[T], contiguous. One thread per 16-byte chunk of a (token, kv head) row, blocks of 256 threads.
The kernel waits for its predecessor's writes before touching memory, so where
runtime.pdl_enabled (sm_90+, unless TILEATTN_PDL=0) its plans launch with programmatic dependent launch.
"""

from __future__ import annotations

import numpy as np

from . import Family

FAMILY_NAME = "kv_cache"
SOURCE = "kv_cache.cu"
THREADS = 256
INDEX_TYPES = {"int32": "int32_t", "int64": "int64_t"}


def expression(index_dtype: str) -> str:
    """NVRTC name expression for a slot_mapping of dtype `index_dtype` ("int32" or "int64")."""
    return f"tileattn::write_kv_cache<{INDEX_TYPES[index_dtype]}>"


INSTANTIATIONS = tuple(expression(name) for name in INDEX_TYPES)
FAMILIES = (Family(FAMILY_NAME, SOURCE, INSTANTIATIONS, archs=("sm_90a", "sm_80")),)

# (device, shapes, strides, dtypes) -> LaunchPlan with the five data pointers dynamic. The token
# count changes from step to step in an eager engine, so the dict is cleared when it reaches
# CACHE_LIMIT entries (a plan costs ~0.1 ms to rebuild).
CACHE_LIMIT = 1024
_plans: dict[tuple, object] = {}


def _plan(k, v, k_cache, v_cache, slot_mapping):
    from ..runtime.launcher import pdl_enabled

    pdl = pdl_enabled(k.device.index)
    key = (
        k.device.index, k.shape, k.stride(), v.stride(), k_cache.shape, k_cache.stride(), v_cache.stride(),
        k.element_size(), slot_mapping.dtype, pdl,
    )
    plan = _plans.get(key)
    if plan is None:
        from ..runtime import LaunchPlan
        from . import load

        num_tokens, kv_heads, head_dim = k.shape
        num_blocks, block_size = k_cache.shape[:2]
        per_chunk = 16 // k.element_size()  # elements per 16-byte chunk
        chunks = head_dim // per_chunk
        rows_per_block = max(THREADS // chunks, 1)
        kern = load(FAMILY_NAME, expression(str(slot_mapping.dtype).removeprefix("torch.")), k.device.index)
        i64 = np.int64

        def strides(t, dims):
            return tuple(i64(t.stride(d) // per_chunk) for d in dims)

        args = (
            k.data_ptr(), v.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), slot_mapping.data_ptr(),
            np.int32(num_tokens * kv_heads), np.int32(kv_heads),
            *strides(k, (0, 1)), *strides(v, (0, 1)), *strides(k_cache, (0, 1, 2)), *strides(v_cache, (0, 1, 2)),
            np.int32(block_size.bit_length() - 1), i64(num_blocks * block_size),
        )  # fmt: skip
        grid = (-(-num_tokens * kv_heads // rows_per_block), 1, 1)
        plan = LaunchPlan(kern, grid, (chunks, rows_per_block, 1), args, dynamic=(0, 1, 2, 3, 4), pdl=pdl)
        if len(_plans) >= CACHE_LIMIT:
            _plans.clear()
        _plans[key] = plan
    return plan


def launch_write_kv_cache(k, v, k_cache, v_cache, slot_mapping) -> None:
    """k_cache/v_cache[slot] <- k/v for every token whose slot lies in the cache, on the current
    stream. Trusts its caller (tileattn.api_paged.write_kv_cache checks the arguments); T >= 1."""
    _plan(k, v, k_cache, v_cache, slot_mapping).launch(
        k.data_ptr(), v.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), slot_mapping.data_ptr()
    )


__all__ = ["FAMILIES", "INSTANTIATIONS", "expression", "launch_write_kv_cache"]
