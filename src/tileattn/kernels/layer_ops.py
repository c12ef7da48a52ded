"""The decoder layer's fused elementwise steps (csrc/layer_ops.cu): registry and launchers.

Launchers trust their caller (tileattn.api_layers checks shapes, dtypes, strides and alignment)
and keep one LaunchPlan per (device, shapes, strides, dtype, flags), with only the data pointers
rewritten per call, like the other inference kernels. Every kernel of the family waits for its
predecessor's writes before touching memory, so where runtime.pdl_enabled (sm_90+, unless
TILEATTN_PDL=0) the plans launch with programmatic dependent launch; the flag is part of each plan's key.
"""

from __future__ import annotations

import numpy as np

from . import Family

FAMILY_NAME = "layer_ops"
SOURCE = "layer_ops.cu"
NORM_MAX_CHUNKS = 4  # kNormMaxChunks: 8-element chunks per thread in add_rms_norm
ROTARY_MAX_PAIRS = 4  # kRotaryMaxPairs: d <= 256
ELEMENTWISE_THREADS = 256
_BF16 = {True: "true", False: "false"}
INDEX_TYPES = {"int32": "int32_t", "int64": "int64_t"}  # slot_mapping's dtype -> the kernel's Index


def norm_expression(bf16: bool) -> str:
    return f"tileattn::add_rms_norm<{_BF16[bf16]}>"


def rotary_expression(bf16: bool, norm: bool) -> str:
    return f"tileattn::norm_rotary<{_BF16[bf16]}, {_BF16[norm]}>"


def rotary_write_kv_expression(bf16: bool, norm: bool, index_dtype: str) -> str:
    """The fused rotary + KV-cache write; `index_dtype` is slot_mapping's, "int32" or "int64"."""
    return f"tileattn::norm_rotary_write_kv<{_BF16[bf16]}, {_BF16[norm]}, {INDEX_TYPES[index_dtype]}>"


def silu_mul_expression(bf16: bool) -> str:
    return f"tileattn::silu_mul<{_BF16[bf16]}>"


INSTANTIATIONS = tuple(
    [norm_expression(b) for b in (True, False)]
    + [rotary_expression(b, n) for b in (True, False) for n in (False, True)]
    + [rotary_write_kv_expression(b, n, i) for b in (True, False) for n in (False, True) for i in INDEX_TYPES]
    + [silu_mul_expression(b) for b in (True, False)]
)
FAMILIES = (Family(FAMILY_NAME, SOURCE, INSTANTIATIONS, archs=("sm_90a", "sm_80")),)

CACHE_LIMIT = 1024  # plans per op; the token count changes from step to step in an eager engine
_plans: dict[tuple, object] = {}


def _cached(key, make):
    plan = _plans.get(key)
    if plan is None:
        if len(_plans) >= CACHE_LIMIT:
            _plans.clear()
        plan = _plans[key] = make()
    return plan


def _load(expression: str, device_index: int):
    from . import load

    return load(FAMILY_NAME, expression, device_index)


def _pdl(device_index: int) -> bool:
    from ..runtime.launcher import pdl_enabled

    return pdl_enabled(device_index)


def launch_add_rms_norm(out, residual, x, weight, eps: float) -> None:
    """out [T, D] <- RMSNorm(x (+ residual)); residual [T, D] <- x + residual when given."""
    rows, dim = x.shape
    chunks = dim // 8
    pdl = _pdl(x.device.index)
    key = ("norm", x.device.index, x.shape, x.stride(), out.stride(), None if residual is None else residual.stride(),
           x.dtype, eps, pdl)

    def make():
        from ..runtime import LaunchPlan

        threads = -(-min(chunks, 1024) // 32) * 32  # one chunk per thread up to 1024 threads
        kern = _load(norm_expression(x.dtype == _bf16()), x.device.index)
        res_stride = 0 if residual is None else residual.stride(0) // 8
        args = (out.data_ptr(), 0 if residual is None else residual.data_ptr(), x.data_ptr(), weight.data_ptr(),
                np.int32(chunks), np.int64(out.stride(0) // 8), np.int64(res_stride), np.int64(x.stride(0) // 8),
                np.float32(eps), np.int32(residual is not None))
        return LaunchPlan(kern, (rows, 1, 1), (threads, 1, 1), args, dynamic=(0, 1, 2, 3), pdl=pdl)

    _cached(key, make).launch(out.data_ptr(), 0 if residual is None else residual.data_ptr(), x.data_ptr(),
                              weight.data_ptr())


def launch_norm_rotary(x, positions, cos, sin, q_heads: int, q_weight, k_weight, eps: float) -> None:
    """x [T, heads, d] rotated in place (after a per-head RMSNorm when q_weight/k_weight are given)."""
    tokens, heads, head_dim = x.shape
    norm = q_weight is not None
    pdl = _pdl(x.device.index)
    key = ("rotary", x.device.index, x.shape, x.stride(), x.dtype, q_heads, norm, eps, cos.shape, pdl)

    def make():
        from ..runtime import LaunchPlan

        kern = _load(rotary_expression(x.dtype == _bf16(), norm), x.device.index)
        rows = tokens * heads
        warps = ELEMENTWISE_THREADS // 32
        args = (x.data_ptr(), positions.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                q_weight.data_ptr() if norm else 0, k_weight.data_ptr() if norm else 0,
                np.int32(rows), np.int32(heads), np.int32(q_heads), np.int32(head_dim),
                np.int64(x.stride(0)), np.int64(x.stride(1)), np.int64(cos.shape[0]), np.float32(eps))
        return LaunchPlan(kern, (-(-rows // warps), 1, 1), (ELEMENTWISE_THREADS, 1, 1), args,
                          dynamic=(0, 1, 2, 3, 4, 5), pdl=pdl)

    _cached(key, make).launch(x.data_ptr(), positions.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                              q_weight.data_ptr() if norm else 0, k_weight.data_ptr() if norm else 0)


def launch_norm_rotary_write_kv(q, k, v, k_cache, v_cache, slot_mapping, positions, cos, sin, q_weight, k_weight,
                                eps: float) -> None:
    """q [T, H, d] rotated in place (after a per-head RMSNorm when q_weight/k_weight are given);
    k [T, Hkv, d] normalised and rotated into k_cache, v [T, Hkv, d] copied into v_cache, both at
    slot_mapping's slots (k itself is read only)."""
    tokens, q_heads, head_dim = q.shape
    kv_heads = k.shape[1]
    norm = q_weight is not None
    pdl = _pdl(q.device.index)
    key = ("rotary_write_kv", q.device.index, q.shape, q.stride(), k.shape, k.stride(), v.stride(), k_cache.shape,
           k_cache.stride(), v_cache.stride(), q.dtype, slot_mapping.dtype, norm, eps, cos.shape, pdl)

    def make():
        from ..runtime import LaunchPlan

        index = str(slot_mapping.dtype).removeprefix("torch.")
        kern = _load(rotary_write_kv_expression(q.dtype == _bf16(), norm, index), q.device.index)
        rows = tokens * (q_heads + kv_heads)
        warps = ELEMENTWISE_THREADS // 32
        num_blocks, block_size = k_cache.shape[:2]
        i64 = np.int64

        def chunks(t, dims):  # strides of a tensor read or written in 16-byte (8-element) chunks
            return tuple(i64(t.stride(d) // 8) for d in dims)

        args = (q.data_ptr(), k.data_ptr(), v.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                slot_mapping.data_ptr(), positions.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                q_weight.data_ptr() if norm else 0, k_weight.data_ptr() if norm else 0,
                np.int32(rows), np.int32(q_heads), np.int32(kv_heads), np.int32(head_dim),
                i64(q.stride(0)), i64(q.stride(1)), i64(k.stride(0)), i64(k.stride(1)), *chunks(v, (0, 1)),
                i64(k_cache.stride(0)), i64(k_cache.stride(1)), i64(k_cache.stride(2)), *chunks(v_cache, (0, 1, 2)),
                np.int32(block_size.bit_length() - 1), i64(num_blocks * block_size), i64(cos.shape[0]),
                np.float32(eps))
        return LaunchPlan(kern, (-(-rows // warps), 1, 1), (ELEMENTWISE_THREADS, 1, 1), args,
                          dynamic=tuple(range(11)), pdl=pdl)

    _cached(key, make).launch(q.data_ptr(), k.data_ptr(), v.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                              slot_mapping.data_ptr(), positions.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                              q_weight.data_ptr() if norm else 0, k_weight.data_ptr() if norm else 0)


def launch_silu_mul(out, x) -> None:
    """out [T, F] <- silu(x[:, :F]) * x[:, F:]."""
    tokens, width = out.shape
    pdl = _pdl(x.device.index)
    key = ("silu", x.device.index, x.shape, x.stride(), out.stride(), x.dtype, pdl)

    def make():
        from ..runtime import LaunchPlan

        kern = _load(silu_mul_expression(x.dtype == _bf16()), x.device.index)
        per_row = width // 8
        total = tokens * per_row
        args = (out.data_ptr(), x.data_ptr(), np.int64(total), np.int32(per_row), np.int64(x.stride(0) // 8),
                np.int64(out.stride(0) // 8))
        return LaunchPlan(kern, (-(-total // ELEMENTWISE_THREADS), 1, 1), (ELEMENTWISE_THREADS, 1, 1), args,
                          dynamic=(0, 1), pdl=pdl)

    _cached(key, make).launch(out.data_ptr(), x.data_ptr())


def _bf16():
    import torch

    return torch.bfloat16


__all__ = ["FAMILIES", "INSTANTIATIONS", "launch_add_rms_norm", "launch_norm_rotary", "launch_norm_rotary_write_kv",
           "launch_silu_mul"]
