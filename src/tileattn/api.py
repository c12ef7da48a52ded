"""The public attention op: argument checks, torch.library custom ops, autograd.

`attention(q, k, v, ...)` checks its arguments in Python (raising ValueError before anything is
launched), then calls the custom op `tileattn::attention_fwd`, which allocates the outputs with
torch and launches the forward kernel on the current stream. Its backward (registered with
`register_autograd`) calls the custom op `tileattn::attention_bwd`. Both ops have fake (meta)
implementations, so `torch.compile(fullgraph=True)` treats them as opaque nodes with known output
shapes, and neither allocates outside torch nor synchronizes with the host, so both can be
captured by `torch.cuda.graph`.

Order of the argument checks (the first failing one is reported):
  1. q, k, v are tensors of rank 4                         ("q must be a torch.Tensor", "... rank-4")
  2. no dimension has size 0                               ("... has an empty dimension")
  3. dtype is float16 or bfloat16, the same for q, k, v
  4. shapes: batch equal, k and v the same shape, head dims equal and in {32, 64, 96, 128, 256},
     Hkv divides H, batch and heads within the CUDA grid limit (65535)
  5. scale (when given) is a finite positive number
  6. layout: stride(-1) == 1 and every other stride (of a dimension longer than 1) a multiple of
     8 elements (16 bytes, the cp.async granule)
  7. devices: q, k, v on one device, and that device is CUDA
  8. data pointers 16-byte aligned (checked inside the op, right before the launch, so that it also
     holds under torch.compile where data pointers are not visible while tracing)
Checks 1-6 only read metadata, so they report a bad dtype, shape or layout for CPU tensors too;
a CPU tensor with otherwise valid arguments fails at step 7 with "... must be a CUDA tensor".
"""

from __future__ import annotations

import math
import numbers

import torch
from torch import Tensor

__all__ = ["attention"]

SUPPORTED_HEAD_DIMS = (32, 64, 96, 128, 256)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
_ALIGN_ELEMS = 8  # 16 bytes of a 16-bit dtype: cp.async moves 16-byte chunks
_MAX_GRID_YZ = 65535


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    causal: bool = False,
    scale: float | None = None,
    return_lse: bool = False,
    deterministic: bool = False,
):
    """Fused exact attention softmax(scale * q k^T) v on NVIDIA tensor cores, with autograd.

    Args:
        q: [B, H, Nq, d] query, float16 or bfloat16, on a CUDA device.
        k: [B, Hkv, Nk, d] keys, same dtype and device; Hkv must divide H (GQA / MQA: query head h
            reads kv head h // (H // Hkv)).
        v: [B, Hkv, Nk, d] values, same shape as k.
            Any strides work as long as the last dim is contiguous (stride 1) and the other strides
            and the data pointer are 16-byte aligned (multiples of 8 elements), so a [B, N, H, d]
            tensor viewed through .transpose(1, 2) needs no copy.
            d must be one of 32, 64, 96, 128, 256. Nq != Nk is allowed.
        causal: mask aligned bottom-right: query i sees key j iff j <= i + Nk - Nq. Queries that
            see no key (Nq > Nk) get output 0 and lse -inf (and zero gradients).
        scale: multiplies q . k; default 1 / sqrt(d). Must be finite and > 0.
        return_lse: also return the log-sum-exp of each query row.
        deterministic: make the backward pass bitwise reproducible (may be slower).

    Returns:
        out [B, H, Nq, d] in the input dtype (laid out like q when q is dense, else contiguous),
        and, when return_lse, lse [B, H, Nq] float32 (natural log; not differentiable).

    Raises:
        ValueError: a non-tensor argument; rank other than 4; an empty dimension; a dtype other than
            float16/bfloat16 or mixed dtypes; mismatched batch sizes, k/v shapes or head dims; a
            head dim outside {32, 64, 96, 128, 256}; Hkv not dividing H; B or H above 65535; a
            scale that is not finite and positive; stride(-1) != 1; strides or data pointers not
            16-byte aligned; tensors on different devices or not on a CUDA device.
        tileattn.runtime.NoGPUError: CUDA tensors but no usable GPU.
    """
    _check_args(q, k, v, scale)
    causal = bool(causal)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    out, lse = torch.ops.tileattn.attention_fwd(q, k, v, causal, float(scale), bool(deterministic))
    return (out, lse) if return_lse else out


# ---------------------------------------------------------------------------------------------
# Argument checks
# ---------------------------------------------------------------------------------------------
def _check_args(q, k, v, scale) -> None:
    named = (("q", q), ("k", k), ("v", v))
    for name, t in named:
        if not isinstance(t, Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            layout = "[B, H, Nq, d]" if name == "q" else "[B, Hkv, Nk, d]"
            raise ValueError(f"{name} must be rank-4 {layout}, got shape {tuple(t.shape)}")
    for name, t in named:
        if t.numel() == 0:
            raise ValueError(f"{name} has an empty dimension (shape {tuple(t.shape)}); every size must be >= 1")
    for name, t in named:
        if t.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"{name} has dtype {t.dtype}; tileattn.attention supports torch.float16 and torch.bfloat16")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")

    batch, heads, _, head_dim = q.shape
    if k.shape[0] != batch or v.shape[0] != batch:
        raise ValueError(
            f"batch sizes differ: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} (dim 0 must match)"
        )
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape [B, Hkv, Nk, d], got k {tuple(k.shape)}, v {tuple(v.shape)}")
    if k.shape[3] != head_dim:
        raise ValueError(f"head dims differ: q has d={head_dim}, k and v have d={k.shape[3]}")
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"q head dim d={head_dim} is not supported; supported: {SUPPORTED_HEAD_DIMS}")
    kv_heads = k.shape[1]
    if heads % kv_heads != 0:
        raise ValueError(f"k/v heads Hkv={kv_heads} must divide q heads H={heads} (GQA/MQA)")
    if batch > _MAX_GRID_YZ or heads > _MAX_GRID_YZ:
        raise ValueError(f"q has B={batch}, H={heads}; the launch grid allows at most {_MAX_GRID_YZ} of each")

    if scale is not None:
        if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
            raise ValueError(f"scale must be a positive finite number or None, got {type(scale).__name__}")
        if not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"scale must be finite and > 0, got {scale}")

    for name, t in named:
        _check_strides(name, t)

    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got q {q.device}, k {k.device}, v {v.device}")
    if q.device.type != "cuda":
        raise ValueError(
            f"q, k, v must be CUDA tensors (tileattn kernels run on NVIDIA GPUs), got device {q.device}; "
            "move them with .cuda()"
        )


def _check_strides(name: str, t: Tensor) -> None:
    strides = t.stride()
    if strides[-1] != 1:
        raise ValueError(
            f"{name} must have a contiguous last dim (stride(-1) == 1), got strides {tuple(strides)}; "
            "call .contiguous() first"
        )
    for dim in range(3):
        if t.shape[dim] > 1 and strides[dim] % _ALIGN_ELEMS != 0:
            raise ValueError(
                f"{name}.stride({dim}) = {strides[dim]} is not a multiple of {_ALIGN_ELEMS} elements: rows must "
                "be 16-byte aligned because the kernel moves 16-byte chunks with cp.async; "
                "call .contiguous() first"
            )


def _check_pointer(name: str, t: Tensor) -> None:
    if t.data_ptr() % 16 != 0:
        raise ValueError(
            f"{name}.data_ptr() = {t.data_ptr():#x} is not 16-byte aligned (storage offset {t.storage_offset()}): "
            "the kernel moves 16-byte chunks with cp.async; call .contiguous() (or .clone()) first"
        )


def _kernel_layout_ok(t: Tensor) -> bool:
    """Whether the kernels can read `t` in place (last dim contiguous, 16-byte aligned rows)."""
    s = t.stride()
    if s[-1] != 1 or t.data_ptr() % 16 != 0:
        return False
    return all(t.shape[d] <= 1 or s[d] % _ALIGN_ELEMS == 0 for d in range(t.dim() - 1))


# ---------------------------------------------------------------------------------------------
# Custom ops
# ---------------------------------------------------------------------------------------------
@torch.library.custom_op("tileattn::attention_fwd", mutates_args=(), device_types="cuda")
def _attention_fwd(
    q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, deterministic: bool
) -> tuple[Tensor, Tensor]:
    """(out [B, H, Nq, d] input dtype, lse [B, H, Nq] fp32). `deterministic` is for the backward."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_pointer(name, t)
    from .kernels.attention_fwd_sm80 import launch_forward

    out = torch.empty_like(q)  # q's layout when q is dense (a transposed [B, N, H, d] stays so)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    launch_forward(q, k, v, out, lse, causal=causal, scale=scale)
    return out, lse


@_attention_fwd.register_fake
def _attention_fwd_fake(q, k, v, causal, scale, deterministic):
    return torch.empty_like(q), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op("tileattn::attention_bwd", mutates_args=(), device_types="cuda")
def _attention_bwd(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float,
    deterministic: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) in the layouts of q, k, v (contiguous when those are not dense)."""
    from .kernels.attention_bwd_sm80 import launch_backward  # the backward family may land later

    if not _kernel_layout_ok(dout):  # e.g. the stride-0 expanded gradient of out.sum()
        dout = dout.contiguous()
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    launch_backward(q, k, v, out, lse, dout, dq, dk, dv, causal=causal, scale=scale, deterministic=deterministic)
    return dq, dk, dv


@_attention_bwd.register_fake
def _attention_bwd_fake(dout, q, k, v, out, lse, causal, scale, deterministic):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, causal, scale, deterministic = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.causal, ctx.scale, ctx.deterministic = causal, scale, deterministic
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout, _dlse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = torch.ops.tileattn.attention_bwd(dout, q, k, v, out, lse, ctx.causal, ctx.scale, ctx.deterministic)
    return dq, dk, dv, None, None, None


_attention_fwd.register_autograd(_backward, setup_context=_setup_context)
