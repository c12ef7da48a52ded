"""The public variable-length attention op: argument checks, launch plans, autograd, custom ops.

`attention_varlen` runs B packed sequences of different lengths in one call of the sm_80-path
kernels (csrc/attention_fwd_sm80.cu, attention_bwd_sm80.cu, their *_varlen entry points). It is
built like `tileattn.attention` (api.py):
- Eager (plain tensors, not traced): a plan entry per (shapes, strides, dtypes, devices, number of
  sequences, max lengths, causal, scale) holds the forward LaunchPlan and the backward plans, made
  on the first call after every argument check; later calls check only the data pointers'
  alignment. With inputs that require grad, a torch.autograd.Function reuses the entry.
- Traced (torch.compile, fake tensors): the custom ops `tileattn::attention_varlen_fwd` and
  `tileattn::attention_varlen_bwd` (with variants `attention_varlen_variants_fwd/bwd`, with dropout
  `attention_varlen_dropout_fwd/bwd`, whose rng state is handled as the dense op's, dropout.py) with
  fake implementations and `register_autograd`; their implementations run the same plans.
Nothing synchronizes with the host or allocates outside torch, so both paths can be captured by
`torch.cuda.graph`: the sequence lengths live in the cu_seqlens device tensors, and the grids depend
only on B and max_seqlen_q / max_seqlen_k (host ints), so one captured graph serves any lengths
within those bounds.

Order of the argument checks (the first failing one is reported):
  1. q, k, v are tensors of rank 3; cu_seqlens_q, cu_seqlens_k tensors of rank 1
  2. dtypes: q, k, v float16 or bfloat16, all the same; cu_seqlens int32
  3. shapes: head dims equal and in {32, 64, 96, 128, 256}, H and Hkv >= 1, k and v the same
     shape, Hkv divides H, H <= 65535; cu_seqlens_q and cu_seqlens_k of one length B + 1 >= 2,
     B < 65535; Tq + 132 B + 3 (the backward's workspace rows per head) and Tk below 2^31
  4. max_seqlen_q, max_seqlen_k: ints >= 0 (not bool), at most Tq / Tk
  5. scale (when given) finite and > 0
  6. layout: stride(-1) == 1 and the token and head strides (of dimensions longer than 1)
     multiples of 8 elements; cu_seqlens contiguous
  7. devices: all five tensors on one CUDA device
  8. data pointers 16-byte aligned (every call)
The contents of cu_seqlens are not checked (that needs a sync): they must start at 0, not decrease,
and end at or below Tq / Tk, and no sequence may be longer than max_seqlen_q / max_seqlen_k.
`tileattn.reference.attention_varlen` checks them on the host.
"""

from __future__ import annotations

import math
import numbers
from typing import Optional

import torch
from torch import Tensor

from . import dropout as dr
from .api import (_autocast_inputs, _cached_entry, _check_pointers, _current_device, _eager, _kernel_layout_ok,
                  _laid_out, _snapshot, _typed_window, _with_slopes)
from .launch_limits import MAX_GRID_YZ

__all__ = ["attention_varlen"]

SUPPORTED_HEAD_DIMS = (32, 64, 96, 128, 256)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
_ALIGN_ELEMS = 8  # 16 bytes of a 16-bit dtype: cp.async moves 16-byte chunks
_MAX_PLANS = 4096


def attention_varlen(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool = False,
    scale: float | None = None,
    return_lse: bool = False,
    deterministic: bool = False,
    *,
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    alibi_slopes: Tensor | None = None,
    dropout_p: float = 0.0,
    generator: torch.Generator | None = None,
    seed: int | Tensor | None = None,
    offset: int | None = None,
):
    """Fused exact attention over B packed sequences of different lengths, with autograd.

    Args:
        q: [Tq, H, d] queries of all sequences, packed along the token axis; float16 or bfloat16
            on a CUDA device.
        k: [Tk, Hkv, d] keys, same dtype and device; Hkv must divide H (query head h reads kv head
            h // (H // Hkv)).
        v: [Tk, Hkv, d] values, same shape as k.
            Any strides work as long as the last dim is contiguous and the token and head strides
            and the data pointers are 16-byte aligned (multiples of 8 elements).
            d must be one of 32, 64, 96, 128, 256.
        cu_seqlens_q: int32 [B + 1] on q's device: sequence b owns query tokens
            cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1 (0 = cu_seqlens_q[0] <= ... <=
            cu_seqlens_q[B] <= Tq). Query rows past cu_seqlens_q[B] get output 0, lse -inf.
        cu_seqlens_k: int32 [B + 1]: the same for the keys and values.
        max_seqlen_q, max_seqlen_k: host ints >= the longest query / key sequence (they size the
            launch grids; a longer sequence is not detected and its rows beyond are left
            unwritten or ignored). A sequence of length 0 is allowed and produces nothing.
        causal: mask aligned bottom-right per sequence: query i of a sequence with nq queries and
            nk keys sees key j iff j <= i + nk - nq. Queries that see no key get output 0 and lse
            -inf (and zero gradients).
        scale: multiplies q . k; default 1 / sqrt(d). Must be finite and > 0.
        return_lse: also return the log-sum-exp of each query row.
        deterministic: make the backward pass bitwise reproducible (dQ without atomics); also chosen
            by torch.use_deterministic_algorithms(True) in force when the backward runs.
        window, softcap, alibi_slopes, dropout_p, generator, seed, offset: the variants of
            tileattn.attention, per sequence (i, j count within the sequence, nk - nq its diagonal);
            alibi_slopes [H] or [B, H] (row b for sequence b); dropout's batch index is the
            sequence index b (tileattn.dropout.dropout_mask(..., batch_start=b)).

    Autocast: as tileattn.attention (a float32 / float64 input under torch.autocast("cuda") runs in the
    autocast dtype).

    Returns:
        out [Tq, H, d] in the input dtype (laid out like q when q is dense, else contiguous), and,
        when return_lse, lse [H, Tq] float32 (natural log; not differentiable).

    Raises:
        ValueError: causal, return_lse or deterministic not a bool; a non-tensor argument; wrong ranks; dtypes
            other than float16/bfloat16 (q, k, v) or int32 (cu_seqlens), or mixed; mismatched head dims, k/v
            shapes or cu_seqlens lengths; a head dim outside {32, 64, 96, 128, 256}; Hkv not dividing H; H or
            B too large for the grid; max_seqlen_q / max_seqlen_k not ints in [0, Tq] / [0, Tk]; a scale that
            is not finite and positive or outside [1e-12, 1e12]; stride(-1) != 1; strides or data pointers not
            16-byte aligned; non-contiguous cu_seqlens; tensors on different devices or not on a CUDA device;
            malformed variants (as tileattn.attention); with any variant, Tq or Tk above 2^28.
        NotImplementedError: dropout_p > 0 with a `generator` under fake tensors outside torch.compile
            (make_fx, export: dropout traces as the tileattn::attention_varlen_dropout_* custom ops, with
            seed/offset or the default CUDA generator, as tileattn.attention's does; under torch.compile a
            generator is drawn from eagerly, a graph break); a traced dropout_p > 0 call without a seed tensor
            run while the stream captures a CUDA graph (the op's host draw would fix every replay's mask); an
            input with a
            forward-mode tangent; a call inside a torch.func transform (vmap, grad, ...).
        tileattn.runtime.NoGPUError: CUDA tensors but no usable GPU.
    """
    if type(causal) is not bool or type(return_lse) is not bool or type(deterministic) is not bool:
        causal, return_lse, deterministic = dr.check_flags(causal=causal, return_lse=return_lse,
                                                           deterministic=deterministic)
    q, k, v = _autocast_inputs(q, k, v)
    args = (q, k, v, cu_seqlens_q, cu_seqlens_k)
    if window is not None or softcap or alibi_slopes is not None or dropout_p:
        out, lse = _varlen_variants(args, max_seqlen_q, max_seqlen_k, causal, scale, deterministic, window, softcap,
                                    alibi_slopes, dropout_p, generator, seed, offset)
        return (out, lse) if return_lse else out
    if softcap is not None or dropout_p != 0 or generator is not None or seed is not None or offset is not None:
        dr.check_off_variants(softcap, dropout_p, generator, seed, offset)
    if _eager(*args):
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
            out, lse = _VarlenFunction.apply(*args, max_seqlen_q, max_seqlen_k, causal, scale, deterministic)
        else:
            out, lse, _ = _forward(*args, max_seqlen_q, max_seqlen_k, causal, scale)
    else:
        _check_args(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale)
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
        out, lse = torch.ops.tileattn.attention_varlen_fwd(*args, max_seqlen_q, max_seqlen_k, causal, scale,
                                                           deterministic)
    return (out, lse) if return_lse else out


# ---------------------------------------------------------------------------------------------
# Argument checks
# ---------------------------------------------------------------------------------------------
def _check_args(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale) -> None:
    named = (("q", q), ("k", k), ("v", v))
    cus = (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k))
    for name, t in named:
        if not isinstance(t, Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3:
            layout = "[Tq, H, d]" if name == "q" else "[Tk, Hkv, d]"
            raise ValueError(f"{name} must be rank-3 {layout} (tokens packed), got shape {tuple(t.shape)}")
    for name, t in cus:
        if not isinstance(t, Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 1:
            raise ValueError(f"{name} must be rank-1 [B + 1], got shape {tuple(t.shape)}")

    for name, t in named:
        if t.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"{name} has dtype {t.dtype}; attention_varlen supports torch.float16 and torch.bfloat16")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    for name, t in cus:
        if t.dtype != torch.int32:
            raise ValueError(f"{name} must be int32, got {t.dtype}")

    total_q, heads, head_dim = q.shape
    total_k, kv_heads = k.shape[0], k.shape[1]
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape [Tk, Hkv, d], got k {tuple(k.shape)}, v {tuple(v.shape)}")
    if k.shape[2] != head_dim:
        raise ValueError(f"head dims differ: q has d={head_dim}, k and v have d={k.shape[2]}")
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"q head dim d={head_dim} is not supported; supported: {SUPPORTED_HEAD_DIMS}")
    if heads < 1 or kv_heads < 1:
        raise ValueError(f"q and k need at least one head, got H={heads}, Hkv={kv_heads}")
    if heads % kv_heads != 0:
        raise ValueError(f"k/v heads Hkv={kv_heads} must divide q heads H={heads} (GQA/MQA)")
    if heads > MAX_GRID_YZ:
        raise ValueError(f"q has H={heads} heads; the launch grid allows at most {MAX_GRID_YZ}")
    if cu_seqlens_q.shape[0] != cu_seqlens_k.shape[0]:
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_k must both be [B + 1], got {cu_seqlens_q.shape[0]} and {cu_seqlens_k.shape[0]}"
        )
    batch = cu_seqlens_q.shape[0] - 1
    if batch < 1:
        raise ValueError(f"cu_seqlens_q must hold B + 1 >= 2 offsets (at least one sequence), got {batch + 1}")
    if batch + 1 > MAX_GRID_YZ:
        raise ValueError(f"B={batch} sequences; the launch grid allows at most {MAX_GRID_YZ - 1}")
    from .kernels.attention_bwd_sm80 import VARLEN_WS_GAP  # the backward's workspace rows per sequence

    if total_q + 3 + VARLEN_WS_GAP * batch >= 2**31 or total_k >= 2**31:
        raise ValueError(f"q has Tq={total_q} and k Tk={total_k} tokens; Tq + 132 B + 3 and Tk must be below 2^31")

    for name, value, limit in (("max_seqlen_q", max_seqlen_q, total_q), ("max_seqlen_k", max_seqlen_k, total_k)):
        # torch.SymInt: torch.compile may trace an int argument symbolically after it changed.
        if isinstance(value, bool) or not isinstance(value, (numbers.Integral, torch.SymInt)):
            raise ValueError(f"{name} must be an int (a host value, not a tensor), got {type(value).__name__}")
        if not 0 <= value <= limit:
            raise ValueError(f"{name}={value} must be in [0, {limit}] (no sequence is longer than the packed tensor)")

    dr.check_scale(scale)

    for name, t in named:
        strides = t.stride()
        if strides[-1] != 1:
            raise ValueError(
                f"{name} must have a contiguous last dim (stride(-1) == 1), got strides {tuple(strides)}; "
                "call .contiguous() first"
            )
        for dim in range(2):
            if t.shape[dim] > 1 and strides[dim] % _ALIGN_ELEMS != 0:
                raise ValueError(
                    f"{name}.stride({dim}) = {strides[dim]} is not a multiple of {_ALIGN_ELEMS} elements: rows must "
                    "be 16-byte aligned because the kernel moves 16-byte chunks with cp.async; call .contiguous() first"
                )
    for name, t in cus:
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous, got stride {t.stride()}")

    devices = {t.device for _, t in named + cus}
    if len(devices) != 1:
        raise ValueError(
            "q, k, v, cu_seqlens_q, cu_seqlens_k must be on one device, got "
            + ", ".join(f"{name} {t.device}" for name, t in named + cus)
        )
    if q.device.type != "cuda":
        raise ValueError(
            f"q, k, v, cu_seqlens_q, cu_seqlens_k must be CUDA tensors (tileattn kernels run on NVIDIA GPUs), "
            f"got device {q.device}; move them with .cuda()"
        )


# ---------------------------------------------------------------------------------------------
# Plans: one entry per validated argument combination
# ---------------------------------------------------------------------------------------------
class _PlanEntry:
    """A validated combination: its forward plan (None when there is no query token) and its
    backward plans by (dout strides, deterministic)."""

    __slots__ = ("forward", "backward", "causal", "scale", "device_index", "device", "lse_shape", "copy_kv",
                 "max_seqlen_q", "max_seqlen_k", "variants", "input_strides", "out_strides")

    def __init__(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale,
                 variants=None):
        """variants: None, or the sm80 kernels' VariantArgs (then causal is folded into its window)."""
        from .kernels import attention_fwd_sm80, dispatch

        _check_args(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale)
        if variants is not None:
            dr.check_variant_lengths(q.shape[0], k.shape[0])
        self.variants = variants
        self.input_strides = (q.stride(), k.stride(), v.stride())  # what the plans were made for
        self.causal = causal
        self.scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
        self.max_seqlen_q, self.max_seqlen_k = int(max_seqlen_q), int(max_seqlen_k)
        self.device_index, self.device = q.device.index, q.device
        self.lse_shape = (q.shape[1], q.shape[0])
        # The forward addresses a K/V block with 32-bit offsets: token strides >= 2^24 elements go
        # through a contiguous copy (as tileattn.attention does).
        limit = attention_fwd_sm80.MAX_KV_ROW_STRIDE
        self.copy_kv = (k.shape[0] > 1 and k.stride(0) >= limit) or (v.shape[0] > 1 and v.stride(0) >= limit)
        if self.copy_kv:
            k, v = k.contiguous(), v.contiguous()
        self.backward: dict[tuple, object] = {}
        self.forward = None
        out = torch.empty_like(q)
        self.out_strides = out.stride()
        if q.shape[0] == 0:
            return  # no query token: nothing to launch
        lse = torch.empty(self.lse_shape, dtype=torch.float32, device=q.device)
        with torch.cuda.device(self.device_index):
            self.forward = dispatch.varlen_forward_plan(
                q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, self.max_seqlen_q, causal=causal, scale=self.scale,
                variants=variants)

    def backward_plan(self, q, k, v, out, lse, dout, dq, dk, dv, cu_seqlens_q, deterministic: bool):
        key = (dout.stride(), deterministic)
        plan = self.backward.get(key)
        if plan is None:
            from .kernels import dispatch

            with torch.cuda.device(self.device_index):
                plan = dispatch.varlen_backward_plan(
                    q, k, v, out, lse, dout, dq, dk, dv, cu_seqlens_q, self.max_seqlen_q, self.max_seqlen_k,
                    causal=self.causal, scale=self.scale, deterministic=deterministic, variants=self.variants)
            self.backward[key] = plan
        return plan


_plans: dict[tuple, _PlanEntry] = {}



def _plan_entry(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale) -> _PlanEntry:
    key = (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, k.dtype, v.dtype,
           cu_seqlens_q.shape, cu_seqlens_k.shape, cu_seqlens_q.dtype, cu_seqlens_k.dtype, cu_seqlens_q.stride(),
           cu_seqlens_k.stride(), q.get_device(), k.get_device(), v.get_device(), cu_seqlens_q.get_device(),
           cu_seqlens_k.get_device(), type(max_seqlen_q), max_seqlen_q, type(max_seqlen_k), max_seqlen_k, causal,
           scale, type(scale))
    try:
        entry = _plans.get(key)
    except TypeError:  # an unhashable argument (a list as scale): _PlanEntry's checks raise the ValueError
        return _PlanEntry(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale)
    if entry is None:
        entry = _PlanEntry(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale)
        if len(_plans) >= _MAX_PLANS:
            _plans.clear()
        _plans[key] = entry
    return entry


def _forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale):
    """(out, lse, plan entry): the forward through the entry's plan, outputs allocated by torch."""
    entry = _plan_entry(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale)
    _check_pointers(q, k, v)
    if entry.copy_kv:
        k, v = k.contiguous(), v.contiguous()
    out = torch.empty_like(q)  # q's layout when q is dense
    lse = torch.empty(entry.lse_shape, dtype=torch.float32, device=entry.device)
    if entry.forward is not None:
        ptrs = (q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr(), cu_seqlens_q.data_ptr(),
                cu_seqlens_k.data_ptr())
        if _current_device() == entry.device_index:
            entry.forward.launch(*ptrs)
        else:  # cuLaunchKernel uses the thread's current context: make it q's device's
            with torch.cuda.device(entry.device_index):
                entry.forward.launch(*ptrs)
    return out, lse, entry


def _backward(entry: _PlanEntry, dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, deterministic: bool,
              extra=()):
    """(dq, dk, dv) in the layouts of q, k, v (contiguous when those are not dense). `extra`: the
    variant plans' per-call values (ALiBi pointer, dropout seed, offset, rng state pointer). Saved tensors that a
    saved-tensor hook returned in another layout than the forward's are copied back into it (the
    plans hold the forward's strides). torch.use_deterministic_algorithms(True) selects the
    deterministic mode too, as in tileattn.api._backward."""
    deterministic = deterministic or torch.are_deterministic_algorithms_enabled()
    if (q.stride(), k.stride(), v.stride()) != entry.input_strides:
        q, k, v = (_laid_out(t, s) for t, s in zip((q, k, v), entry.input_strides))
    out, lse = _laid_out(out, entry.out_strides), lse.contiguous()
    if not _kernel_layout_ok(dout):  # e.g. the stride-0 expanded gradient of out.sum(), or a misaligned one
        dout = dout.clone(memory_format=torch.contiguous_format)  # fresh storage: aligned
    if entry.copy_kv:
        k, v = k.contiguous(), v.contiguous()
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if q.shape[0] == 0:  # no query: the gradients of the keys and values are 0
        return dq, dk.zero_(), dv.zero_()
    plan = entry.backward_plan(q, k, v, out, lse, dout, dq, dk, dv, cu_seqlens_q, deterministic)
    if _current_device() == entry.device_index:
        plan.launch(q, k, v, out, lse, dout, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, *extra)
    else:
        with torch.cuda.device(entry.device_index):
            plan.launch(q, k, v, out, lse, dout, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, *extra)
    return dq, dk, dv


class _VarlenFunction(torch.autograd.Function):
    """The eager path with autograd: forward and backward through one plan entry."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, deterministic):
        out, lse, entry = _forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k)
        ctx.entry, ctx.deterministic = entry, deterministic
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k = ctx.saved_tensors
        if dout is None:
            return (None,) * 10
        dq, dk, dv = _backward(ctx.entry, dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, ctx.deterministic)
        return dq, dk, dv, None, None, None, None, None, None, None


# ---------------------------------------------------------------------------------------------
# Variants (window, softcap, ALiBi, dropout): the sm_80 varlen variant kernels, eager path
# ---------------------------------------------------------------------------------------------
class _VariantEntry(_PlanEntry):
    """A validated varlen combination with variants (causal folded into the window); its plans'
    launches take (alibi pointer, seed, offset, rng state pointer) last."""

    __slots__ = ()

    def __init__(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, window,
                 softcap, alibi_slopes, dropout_p, rng_state=False):
        from .kernels import attention_fwd_sm80

        # The variants' own checks come first, so that they report on CPU tensors too.
        left, right = dr.check_window(window, causal)
        cap = dr.check_softcap(softcap)
        p = dr.check_dropout(dropout_p, None, None, None)
        sb = None
        if (alibi_slopes is not None and isinstance(q, Tensor) and q.dim() == 3 and isinstance(cu_seqlens_q, Tensor)
                and cu_seqlens_q.dim() == 1):
            sb = dr.check_alibi(alibi_slopes, cu_seqlens_q.shape[0] - 1, q.shape[1], q.device, dtype_strict=True)
        super().__init__(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, False, scale,
                         attention_fwd_sm80.VariantArgs(left, right, cap, sb, p, rng_state))


def _varlen_variants(args, max_seqlen_q, max_seqlen_k, causal, scale, deterministic, window, softcap, alibi_slopes,
                     dropout_p, generator, seed, offset):
    """(out, lse) of a varlen call with variants: eager through the plan entry, traced through the
    tileattn::attention_varlen_variants_* custom ops, or with dropout the
    tileattn::attention_varlen_dropout_* ones (seed/offset as the dense op's, see dropout.py)."""
    q, k, v, cu_seqlens_q, cu_seqlens_k = args
    if alibi_slopes is not None and not isinstance(alibi_slopes, Tensor):
        raise ValueError(f"alibi_slopes must be None or a torch.Tensor, got {type(alibi_slopes).__name__}")
    if not _eager(*args, *(() if alibi_slopes is None else (alibi_slopes,))):
        left, right = dr.check_window(window, causal)
        cap = dr.check_softcap(softcap)
        p = dr.check_dropout(dropout_p, generator, seed, offset)
        if (alibi_slopes is not None and isinstance(q, Tensor) and q.dim() == 3 and isinstance(cu_seqlens_q, Tensor)
                and cu_seqlens_q.dim() == 1):
            dr.check_alibi(alibi_slopes, cu_seqlens_q.shape[0] - 1, q.shape[1], q.device, dtype_strict=True)
        _check_args(*args, max_seqlen_q, max_seqlen_k, scale)
        dr.check_variant_lengths(q.shape[0], k.shape[0])
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
        if p > 0:
            rng = dr.traced_rng(generator, seed, offset, q.device)
            out, lse, _ = torch.ops.tileattn.attention_varlen_dropout_fwd(*args, alibi_slopes, rng, max_seqlen_q,
                                                                          max_seqlen_k, scale, deterministic, left,
                                                                          right, cap, p)
            return out, lse
        return torch.ops.tileattn.attention_varlen_variants_fwd(*args, alibi_slopes, max_seqlen_q, max_seqlen_k, scale,
                                                                deterministic, left, right, cap)
    alibi_key = None if alibi_slopes is None else (alibi_slopes.shape, alibi_slopes.stride(), alibi_slopes.dtype,
                                                   alibi_slopes.get_device())
    rng_state = dr.wants_device_state(generator, seed, q.device) if dropout_p else False  # as the dense op
    key = (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, k.dtype, v.dtype,
           cu_seqlens_q.shape, cu_seqlens_k.shape, cu_seqlens_q.dtype, cu_seqlens_k.dtype, cu_seqlens_q.stride(),
           cu_seqlens_k.stride(), q.get_device(), k.get_device(), v.get_device(), cu_seqlens_q.get_device(),
           cu_seqlens_k.get_device(), type(max_seqlen_q), max_seqlen_q, type(max_seqlen_k), max_seqlen_k, causal,
           scale, type(scale), "variants", _typed_window(window), softcap, type(softcap), alibi_key, dropout_p,
           type(dropout_p), rng_state)  # typed: True == 1 == 1.0
    entry = _cached_entry(key, lambda: _VariantEntry(*args, max_seqlen_q, max_seqlen_k, causal, scale, window,
                                                     softcap, alibi_slopes, dropout_p, rng_state))
    state = None
    if entry.variants.dropout_p > 0:
        dr.check_dropout(dropout_p, generator, seed, offset)
        seed, offset, state = dr.dropout_state(generator, seed, offset, q.device)
    else:
        seed, offset = 0, 0
    extra = (0 if alibi_slopes is None else alibi_slopes.data_ptr(), *dr.kernel_values(seed, offset, state))
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _VarlenVariantFunction.apply(*args, entry, alibi_slopes, extra, deterministic, state)
    return _varlen_variant_forward(entry, args, extra)


def _varlen_variant_forward(entry: _VariantEntry, args, extra):
    """(out, lse): `_forward`'s steps with the variant plan's per-call values."""
    q, k, v, cu_seqlens_q, cu_seqlens_k = args
    _check_pointers(q, k, v)
    if entry.copy_kv:
        k, v = k.contiguous(), v.contiguous()
    out = torch.empty_like(q)
    lse = torch.empty(entry.lse_shape, dtype=torch.float32, device=entry.device)
    if entry.forward is not None:
        with torch.cuda.device(entry.device_index):
            entry.forward.launch(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr(),
                                 cu_seqlens_q.data_ptr(), cu_seqlens_k.data_ptr(), *extra)
    return out, lse


class _VarlenVariantFunction(torch.autograd.Function):
    """Autograd of a varlen call with variants (the same slopes and dropout seed/offset backward; a
    device rng state held as the dense op holds it)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, entry, alibi_slopes, extra, deterministic, state):
        out, lse = _varlen_variant_forward(entry, (q, k, v, cu_seqlens_q, cu_seqlens_k), extra)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes)  # as the dense op
        ctx.entry, ctx.extra, ctx.deterministic, ctx.state = entry, extra, deterministic, _snapshot(state)
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes = ctx.saved_tensors
        if dout is None:
            return (None,) * 10
        dq, dk, dv = _backward(ctx.entry, dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, ctx.deterministic,
                               _with_slopes(ctx.extra, alibi_slopes, ctx.state))
        return dq, dk, dv, None, None, None, None, None, None, None


# ---------------------------------------------------------------------------------------------
# Custom ops (the traced path)
# ---------------------------------------------------------------------------------------------
# Variants (no dropout): window edges normalized (causal folded in), softcap 0.0 = off.
@torch.library.custom_op("tileattn::attention_varlen_variants_fwd", mutates_args=(), device_types="cuda")
def _attention_varlen_variants_fwd(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, alibi_slopes: Optional[Tensor],
    max_seqlen_q: int, max_seqlen_k: int, scale: float, deterministic: bool, window_left: int, window_right: int,
    softcap: float,
) -> tuple[Tensor, Tensor]:
    """(out [Tq, H, d], lse [H, Tq] fp32) with window / softcap / ALiBi."""
    args = (q, k, v, cu_seqlens_q, cu_seqlens_k)
    entry = _varlen_variant_op_entry(args, alibi_slopes, max_seqlen_q, max_seqlen_k, scale, window_left,
                                     window_right, softcap)
    return _varlen_variant_forward(entry, args, (0 if alibi_slopes is None else alibi_slopes.data_ptr(), 0, 0, 0))


@_attention_varlen_variants_fwd.register_fake
def _attention_varlen_variants_fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, max_seqlen_q, max_seqlen_k,
                                        scale, deterministic, window_left, window_right, softcap):
    return torch.empty_like(q), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


@torch.library.custom_op("tileattn::attention_varlen_variants_bwd", mutates_args=(), device_types="cuda")
def _attention_varlen_variants_bwd(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor, alibi_slopes: Optional[Tensor], max_seqlen_q: int, max_seqlen_k: int, scale: float,
    deterministic: bool, window_left: int, window_right: int, softcap: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of attention_varlen_variants_fwd."""
    entry = _varlen_variant_op_entry((q, k, v, cu_seqlens_q, cu_seqlens_k), alibi_slopes, max_seqlen_q, max_seqlen_k,
                                     scale, window_left, window_right, softcap)
    extra = (0 if alibi_slopes is None else alibi_slopes.data_ptr(), 0, 0, 0)
    return _backward(entry, dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, deterministic, extra)


@_attention_varlen_variants_bwd.register_fake
def _attention_varlen_variants_bwd_fake(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes,
                                        max_seqlen_q, max_seqlen_k, scale, deterministic, window_left, window_right,
                                        softcap):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _varlen_variant_op_entry(args, alibi_slopes, max_seqlen_q, max_seqlen_k, scale, left, right, softcap,
                             dropout_p=0.0, rng_state=False):
    q, k, v, cu_seqlens_q, cu_seqlens_k = args
    alibi_key = None if alibi_slopes is None else (alibi_slopes.shape, alibi_slopes.stride(), alibi_slopes.dtype,
                                                   alibi_slopes.get_device())
    key = (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, k.dtype, v.dtype,
           cu_seqlens_q.shape, cu_seqlens_k.shape, cu_seqlens_q.dtype, cu_seqlens_k.dtype, cu_seqlens_q.stride(),
           cu_seqlens_k.stride(), q.get_device(), k.get_device(), v.get_device(), cu_seqlens_q.get_device(),
           cu_seqlens_k.get_device(), type(max_seqlen_q), max_seqlen_q, type(max_seqlen_k), max_seqlen_k, False,
           scale, "variants", (left, right), softcap, alibi_key, dropout_p, rng_state)
    return _cached_entry(key, lambda: _VariantEntry(*args, max_seqlen_q, max_seqlen_k, False, scale, (left, right),
                                                    softcap, alibi_slopes, dropout_p, rng_state))


def _varlen_variants_setup_context(ctx, inputs, output) -> None:
    q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes = inputs[:6]
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes)
    ctx.args = inputs[6:]
    ctx.mark_non_differentiable(lse)


def _varlen_variants_backward_op(ctx, dout, _dlse):
    q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes = ctx.saved_tensors
    dq, dk, dv = torch.ops.tileattn.attention_varlen_variants_bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                                                                  alibi_slopes, *ctx.args)
    return (dq, dk, dv) + (None,) * 10


_attention_varlen_variants_fwd.register_autograd(_varlen_variants_backward_op,
                                                 setup_context=_varlen_variants_setup_context)


# Dropout (and any other variant) on the traced path: the rng state as for the dense op's
# tileattn::attention_dropout_* (dropout.py, "Dropout on the traced path"): a constant [seed, offset]
# of the graph, or None, drawn in the op at run time from q's device's default CUDA generator; the
# forward returns the state it used, the backward takes it.
@torch.library.custom_op("tileattn::attention_varlen_dropout_fwd", mutates_args=(), device_types="cuda")
def _attention_varlen_dropout_fwd(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, alibi_slopes: Optional[Tensor],
    rng: Optional[Tensor], max_seqlen_q: int, max_seqlen_k: int, scale: float, deterministic: bool,
    window_left: int, window_right: int, softcap: float, dropout_p: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """(out [Tq, H, d], lse [H, Tq] fp32, rng state int64 [2] on rng's device, the CPU for None) with
    dropout; rng: the [seed, offset] to use, or None to draw them."""
    args = (q, k, v, cu_seqlens_q, cu_seqlens_k)
    seed, offset, state = dr.op_state(rng, q.device)
    entry = _varlen_variant_op_entry(args, alibi_slopes, max_seqlen_q, max_seqlen_k, scale, window_left,
                                     window_right, softcap, dropout_p, state is not None)
    out, lse = _varlen_variant_forward(entry, args, (0 if alibi_slopes is None else alibi_slopes.data_ptr(),
                                                     *dr.kernel_values(seed, offset, state)))
    return out, lse, dr.used_rng_state(seed, offset, state)


@_attention_varlen_dropout_fwd.register_fake
def _attention_varlen_dropout_fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, rng, max_seqlen_q,
                                       max_seqlen_k, scale, deterministic, window_left, window_right, softcap,
                                       dropout_p):
    return torch.empty_like(q), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32), dr.rng_state_fake(rng)


@torch.library.custom_op("tileattn::attention_varlen_dropout_bwd", mutates_args=(), device_types="cuda")
def _attention_varlen_dropout_bwd(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor, alibi_slopes: Optional[Tensor], rng: Tensor, max_seqlen_q: int, max_seqlen_k: int,
    scale: float, deterministic: bool, window_left: int, window_right: int, softcap: float, dropout_p: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of attention_varlen_dropout_fwd, with the rng state it returned."""
    seed, offset, state = dr.op_state(rng, q.device)
    entry = _varlen_variant_op_entry((q, k, v, cu_seqlens_q, cu_seqlens_k), alibi_slopes, max_seqlen_q, max_seqlen_k,
                                     scale, window_left, window_right, softcap, dropout_p, state is not None)
    extra = (0 if alibi_slopes is None else alibi_slopes.data_ptr(), *dr.kernel_values(seed, offset, state))
    return _backward(entry, dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, deterministic, extra)


@_attention_varlen_dropout_bwd.register_fake
def _attention_varlen_dropout_bwd_fake(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, rng,
                                       max_seqlen_q, max_seqlen_k, scale, deterministic, window_left, window_right,
                                       softcap, dropout_p):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


dr.register_dropout_autograd(_attention_varlen_dropout_fwd, torch.ops.tileattn.attention_varlen_dropout_bwd,
                             num_extra=3)

@torch.library.custom_op("tileattn::attention_varlen_fwd", mutates_args=(), device_types="cuda")
def _attention_varlen_fwd(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
    max_seqlen_k: int, causal: bool, scale: float, deterministic: bool,
) -> tuple[Tensor, Tensor]:
    """(out [Tq, H, d] input dtype, lse [H, Tq] fp32). `deterministic` is for the backward."""
    out, lse, _ = _forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale)
    return out, lse


@_attention_varlen_fwd.register_fake
def _attention_varlen_fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale,
                               deterministic):
    return torch.empty_like(q), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


@torch.library.custom_op("tileattn::attention_varlen_bwd", mutates_args=(), device_types="cuda")
def _attention_varlen_bwd(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int, causal: bool, scale: float, deterministic: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) in the layouts of q, k, v (contiguous when those are not dense)."""
    entry = _plan_entry(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale)
    return _backward(entry, dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, deterministic)


@_attention_varlen_bwd.register_fake
def _attention_varlen_bwd_fake(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               causal, scale, deterministic):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, deterministic = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k)
    ctx.max_seqlen_q, ctx.max_seqlen_k = max_seqlen_q, max_seqlen_k
    ctx.causal, ctx.scale, ctx.deterministic = causal, scale, deterministic
    ctx.mark_non_differentiable(lse)


def _backward_op(ctx, dout, _dlse):
    q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k = ctx.saved_tensors
    dq, dk, dv = torch.ops.tileattn.attention_varlen_bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                                                         ctx.max_seqlen_q, ctx.max_seqlen_k, ctx.causal, ctx.scale,
                                                         ctx.deterministic)
    return dq, dk, dv, None, None, None, None, None, None, None


_attention_varlen_fwd.register_autograd(_backward_op, setup_context=_setup_context)
