"""The public attention op: argument checks, launch plans, autograd, torch.library custom ops.

Two paths run the same plans:
- Eager (plain tensors, not under torch.compile or a dispatch mode): `attention` looks up the launch
  plan for the call's (shapes, strides, dtypes, devices, causal, scale) in a dictionary, allocates
  the outputs and launches; with inputs that require grad it goes through a torch.autograd.Function
  whose backward reuses the forward's plan entry (nothing is validated twice). This keeps the host
  cost of a call to a few microseconds: no custom-op dispatch, no per-call argument checks. Once a
  combination is planned, the compiled path (runtime/host_launch.cpp; TILEATTN_HOST_LAUNCH=0: off) can
  serve it in one C++ call, key to launch (with autograd, a C++ autograd Function whose backward
  runs the backward plan's launches once a backward of that dout layout has been planned here);
  anything it does not hold falls back here.
- Traced (torch.compile, FakeTensor/meta tensors, make_fx): the custom ops `tileattn::attention_fwd`
  and `tileattn::attention_bwd`, with fake implementations (so torch.compile(fullgraph=True) sees
  one opaque node with known output shapes) and `register_autograd`. Their implementations call the
  same plans.
Neither path allocates outside torch or synchronizes with the host, so both can be captured by
`torch.cuda.graph`.

The first call with a new combination runs every argument check below and builds the plan; a later
call with the same combination checks only the data pointers' alignment.

Order of the argument checks (the first failing one is reported):
  1. q, k, v are tensors of rank 4                         ("q must be a torch.Tensor", "... rank-4")
  2. no dimension has size 0                               ("... has an empty dimension")
  3. dtype is float16 or bfloat16, the same for q, k, v
  4. shapes: batch equal, k and v the same shape, head dims equal and in {32, 64, 96, 128, 256},
     Hkv divides H, batch and heads within the CUDA grid limit (65535), Nq and Nk at most 2^31 - 1
  5. scale (when given) is a finite positive number within [1e-12, 1e12]
  6. layout: stride(-1) == 1 and every other stride (of a dimension longer than 1) a multiple of
     8 elements (16 bytes, the cp.async granule)
  7. devices: q, k, v on one device, and that device is CUDA
  8. data pointers 16-byte aligned (checked on every call, right before the launch, so that it also
     holds under torch.compile where data pointers are not visible while tracing)
Checks 1-6 only read metadata, so they report a bad dtype, shape or layout for CPU tensors too;
a CPU tensor with otherwise valid arguments fails at step 7 with "... must be a CUDA tensor".
"""

from __future__ import annotations

import contextlib
import math
from typing import Optional

import torch
import torch.autograd.forward_ad as _forward_ad
from torch import Tensor

from . import dropout as dr
from .launch_limits import MAX_GRID_YZ

__all__ = ["attention"]

SUPPORTED_HEAD_DIMS = (32, 64, 96, 128, 256)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
_ALIGN_ELEMS = 8  # 16 bytes of a 16-bit dtype: cp.async moves 16-byte chunks
_INT32_MAX = 2**31 - 1
_MAX_PLANS = 4096  # plan entries kept before the cache starts over (shapes seen by one process)


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
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
        scale: multiplies q . k; default 1 / sqrt(d). Must be finite, > 0 and within [1e-12, 1e12]
            (the kernels take float32 parameters derived from it).
        return_lse: also return the log-sum-exp of each query row.
        deterministic: make the backward pass bitwise reproducible (may be slower); also chosen by
            torch.use_deterministic_algorithms(True) in force when the backward runs.
        Variants (keyword-only; docs/attention_variants.md). On sm_90a with d in {64, 128, 256} the
        forward and the backward run the Hopper kernels' variant instantiations (deterministic and
        dropout included) wherever one covers the call, the sm_80 variant kernels otherwise (d = 32
        or 96, other GPUs, dropout combined with softcap or ALiBi where no Hopper instantiation
        exists; docs/attention_variants.md, "Dispatch"). Without variants nothing changes.
        window: (left, right) ints >= -1 (-1: unbounded): query i sees keys j in
            [i + Nk - Nq - left, i + Nk - Nq + right] (with causal: right <= 0). Whole key blocks
            outside every row's window are skipped.
        softcap: c > 0 (within [1e-12, 1e12]): scores s = scale * q . k become c * tanh(s / c) (None
            or 0: off).
        alibi_slopes: float32 [H] or [B, H] on q's device: scores gain -slope * |i + Nk - Nq - j|.
        dropout_p: probability in [0, 1) of dropping each attention probability (kept ones are
            scaled by 1 / (1 - p)); the mask is tileattn.dropout.dropout_mask(seed, offset, B, H, Nq,
            Nk, dropout_p), the same in the forward and backward. lse stays undropped.
        generator, seed, offset: where the dropout mask's seed comes from: seed (and offset,
            default 0) ints in [0, 2^64); or seed an int64 tensor [2] = [seed, offset] (two's
            complement) on q's device, which the kernels read when they run (offset None), so a CUDA
            graph replays with whatever it holds then; or a torch.Generator (a CUDA one gives its seed
            and Philox offset and advances the offset by 4), by default q's device's default
            generator. While the current stream captures a CUDA graph, a call without a seed draws
            [seed, offset] on the device from the (CUDA) generator instead, so every replay applies a
            new mask, as PyTorch's dropout does under capture.

    Autocast: under torch.autocast("cuda"), a call with a float32 or float64 input runs in the
    autocast dtype (every input cast to it, as SDPA does); float16 / bfloat16 inputs run as they are.

    Returns:
        out [B, H, Nq, d] in the input dtype (laid out like q when q is dense, else contiguous),
        and, when return_lse, lse [B, H, Nq] float32 (natural log; not differentiable).

    Raises:
        ValueError: causal, return_lse or deterministic not a bool; a non-tensor argument; rank other than 4;
            an empty dimension; a dtype other than float16/bfloat16 or mixed dtypes; mismatched batch sizes,
            k/v shapes or head dims; a head dim outside {32, 64, 96, 128, 256}; Hkv not dividing H; B or H
            above 65535; Nq or Nk above 2^31 - 1; a scale that is not finite and positive or outside [1e-12,
            1e12]; stride(-1) != 1; strides or data pointers not 16-byte aligned; tensors on different devices
            or not on a CUDA device; a malformed window, softcap, alibi_slopes (shape, dtype, device, layout),
            dropout_p, generator, seed or offset; with any variant, Nq or Nk above 2^28.
        NotImplementedError: dropout_p > 0 with a `generator` under fake tensors outside torch.compile
            (make_fx, export: window, softcap and ALiBi trace as the tileattn::attention_variants_* custom
            ops, dropout as tileattn::attention_dropout_*, with seed/offset or the default CUDA generator;
            under torch.compile a generator is drawn from eagerly, a graph break); a traced dropout_p > 0
            call without a seed tensor run while the stream captures a CUDA graph (the op's host draw would
            fix every replay's mask);
            an input with a forward-mode tangent; a call inside a torch.func transform (vmap, grad, ...).
        tileattn.runtime.NoGPUError: CUDA tensors but no usable GPU.
    """
    if type(causal) is not bool or type(return_lse) is not bool or type(deterministic) is not bool:
        causal, return_lse, deterministic = dr.check_flags(causal=causal, return_lse=return_lse,
                                                           deterministic=deterministic)
    if window is not None or softcap or alibi_slopes is not None or dropout_p:
        q, k, v = _autocast_inputs(q, k, v)
        out, lse = _attention_variants(q, k, v, causal, scale, deterministic, window, softcap, alibi_slopes,
                                       dropout_p, generator, seed, offset)
        return (out, lse) if return_lse else out
    if softcap is not None or dropout_p != 0 or generator is not None or seed is not None or offset is not None:
        dr.check_off_variants(softcap, dropout_p, generator, seed, offset)
    if not torch.compiler.is_compiling() and _host_forward is not None:
        # The compiled path, for a combination already planned: it checks what _eager checks (exact
        # tensors, no dispatch mode, no forward-mode tangent) and builds the autograd node itself when
        # an input requires grad; None for anything it does not serve. (is_compiling first: Dynamo then
        # never reads _host_forward, so the module's loading cannot invalidate a compiled graph's guards.)
        hit = _host_forward(q, k, v, causal, scale, 3 if return_lse else 4, deterministic)
        if hit is not None:
            return hit
    cast = _autocast_inputs(q, k, v)
    if cast[0] is not q or cast[1] is not k or cast[2] is not v:
        # torch.autocast cast a float32 input: run the float16 / bfloat16 call, the compiled path first
        return attention(*cast, causal, scale, return_lse, deterministic)
    if _eager(q, k, v):
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
            out, lse = _AttentionFunction.apply(q, k, v, causal, scale, deterministic)
        else:
            out, lse, _ = _forward(q, k, v, causal, scale, keep_lse=return_lse)
    else:
        _check_args(q, k, v, scale)
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
        out, lse = torch.ops.tileattn.attention_fwd(q, k, v, causal, scale, deterministic)
    return (out, lse) if return_lse else out


def _autocast_inputs(q, k, v) -> tuple:
    """Under torch.autocast("cuda") a call with a floating input outside float16 / bfloat16 (float32,
    float64) runs in the autocast dtype, as SDPA does: q, k and v are cast to it (autograd carries the
    gradients back through the casts). Inputs that are all float16 / bfloat16 run as they are, autocast
    or not, so the compiled path (which serves only those) needs no autocast check; tileattn.attention
    offers a cast call to it again. Anything else (a non-tensor, an integer tensor) is left for the
    argument checks to name."""
    tensors = (q, k, v)
    if all(isinstance(t, Tensor) and t.dtype in SUPPORTED_DTYPES for t in tensors):
        return tensors
    if not torch.is_autocast_enabled("cuda"):
        return tensors
    dtype = torch.get_autocast_dtype("cuda")
    return tuple(t.to(dtype) if isinstance(t, Tensor) and t.is_floating_point() else t for t in tensors)


def _eager(*tensors) -> bool:
    """Whether this call can take the eager path: plain tensors (not FakeTensor or other
    subclasses), not being traced by torch.compile, no dispatch mode (make_fx, FakeTensorMode).
    Raises NotImplementedError for an input with a forward-mode AD tangent (the kernels have no jvp,
    and a result without its tangent would be silently wrong) and inside a torch.func transform (no
    batching rule, and autograd through torch.func needs what neither path has; the kernels would
    otherwise meet wrapper tensors without storage)."""
    for t in tensors:
        if type(t) is not Tensor:
            return False
    if _forward_ad._current_level >= 0 and any(_forward_ad.unpack_dual(t).tangent is not None for t in tensors):
        raise NotImplementedError("tileattn's attention has no forward-mode AD (jvp): an input carries a tangent "
                                  "(torch.autograd.forward_ad.make_dual)")
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() != 0:
        return False
    if torch._C._are_functorch_transforms_active():
        raise NotImplementedError("tileattn's attention does not run inside torch.func transforms (vmap, grad, jvp, "
                                  "jacrev, ...): call it outside the transform (batch by the B dimension; "
                                  "gradients through torch.autograd)")
    return True


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
    if batch > MAX_GRID_YZ or heads > MAX_GRID_YZ:
        raise ValueError(f"q has B={batch}, H={heads}; the launch grid allows at most {MAX_GRID_YZ} of each")
    if q.shape[2] > _INT32_MAX or k.shape[2] > _INT32_MAX:  # the kernels take them as int32 (an expanded k can be)
        raise ValueError(f"Nq={q.shape[2]} and Nk={k.shape[2]} must be at most 2^31 - 1")

    dr.check_scale(scale)

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


def _check_pointers(q: Tensor, k: Tensor, v: Tensor) -> None:
    """Check 8, the only one a planned combination repeats per call (one OR when all is well)."""
    if (q.data_ptr() | k.data_ptr() | v.data_ptr()) & 15:
        for name, t in (("q", q), ("k", k), ("v", v)):
            _check_pointer(name, t)


def _kernel_layout_ok(t: Tensor) -> bool:
    """Whether the kernels can read `t` in place (last dim contiguous, 16-byte aligned rows)."""
    s = t.stride()
    if s[-1] != 1 or t.data_ptr() % 16 != 0:
        return False
    return all(t.shape[d] <= 1 or s[d] % _ALIGN_ELEMS == 0 for d in range(t.dim() - 1))


# ---------------------------------------------------------------------------------------------
# Plans: one entry per (shapes, strides, dtypes, devices, causal, scale), made on first use
# ---------------------------------------------------------------------------------------------
class _PlanEntry:
    """A validated argument combination: its forward plan, and its backward plans by (dout
    strides, deterministic)."""

    __slots__ = ("forward", "backward", "causal", "scale", "device_index", "device", "copy_kv", "out_spec",
                 "lse_spec", "grad_specs", "unread_lse", "host_offered", "host_key", "host_backward", "input_strides")

    def __init__(self, q, k, v, causal: bool, scale: float | None):
        from .kernels import dispatch

        _check_args(q, k, v, scale)
        self.input_strides = (q.stride(), k.stride(), v.stride())  # what the plans were made for
        self.causal = causal
        self.scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
        self.device_index, self.device = q.device.index, q.device
        self.copy_kv = dispatch.needs_contiguous_kv(k) or dispatch.needs_contiguous_kv(v)
        if self.copy_kv:
            k, v = k.contiguous(), v.contiguous()
        out = torch.empty_like(q)  # q's layout when q is dense (a transposed [B, N, H, d] stays so)
        lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
        # (shape, strides) of every tensor a call allocates, so that a call uses torch.empty_strided
        # (measured 2.6 us on the H200 machine) instead of empty_like / empty (3.8 / 4.9 us).
        self.out_spec, self.lse_spec = (out.shape, out.stride()), (lse.shape, lse.stride())
        self.grad_specs = tuple((t.shape, torch.empty_like(t).stride()) for t in (q, k, v))
        self.unread_lse = None  # made by the first call that does not need lse (see _forward)
        self.host_offered = False  # registered with runtime.host_launch, or found not to qualify
        self.host_key = None  # (causal, scale) as registered there: its backwards are offered too
        self.host_backward = set()  # (dout strides, deterministic) pairs offered
        with torch.cuda.device(self.device_index):
            self.forward = dispatch.attention_forward_plan(q, k, v, out, lse, causal=causal, scale=self.scale)
        self.backward: dict[tuple, object] = {}

    def backward_plan(self, q, k, v, out, lse, dout, dq, dk, dv, deterministic: bool):
        """The backward's plan for this dout layout and mode, built once (on the entry's device)."""
        key = (dout.stride(), deterministic)
        plan = self.backward.get(key)
        if plan is None:
            with torch.cuda.device(self.device_index):
                plan = self._build_backward(q, k, v, out, lse, dout, dq, dk, dv, deterministic)
            self.backward[key] = plan
        return plan

    def _build_backward(self, q, k, v, out, lse, dout, dq, dk, dv, deterministic: bool):
        from .kernels import dispatch

        return dispatch.attention_backward_plan(q, k, v, out, lse, dout, dq, dk, dv, causal=self.causal,
                                                scale=self.scale, deterministic=deterministic)


_plans: dict[tuple, _PlanEntry] = {}
_current_device = torch.cuda.current_device  # made torch._C._cuda_getDevice below when it exists
if hasattr(torch._C, "_cuda_getDevice"):
    _current_device = torch._C._cuda_getDevice
# Whether torch's current stream is capturing a CUDA graph (a call that none follows then writes its
# unread lse into a fresh allocation of the graph's pool, not into the entry's buffer, which
# clear_plans may free while the graph lives).
_capturing = torch.cuda.is_current_stream_capturing
if hasattr(torch._C, "_cuda_isCurrentStreamCapturing"):
    _capturing = torch._C._cuda_isCurrentStreamCapturing


def _plan_entry(q, k, v, causal: bool, scale) -> _PlanEntry:
    # get_device(): the CUDA index as an int (-1 on the CPU), cheaper than building torch.device objects
    key = (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, k.dtype, v.dtype,
           q.get_device(), k.get_device(), v.get_device(), causal, scale, type(scale))  # True == 1 == 1.0: typed
    try:
        entry = _plans.get(key)
    except TypeError:  # an unhashable argument (a list as scale): _PlanEntry's checks raise the ValueError
        return _PlanEntry(q, k, v, causal, scale)
    if entry is None:
        entry = _PlanEntry(q, k, v, causal, scale)  # raises ValueError for bad arguments
        if len(_plans) >= _MAX_PLANS:
            clear_plans()
        _plans[key] = entry
    return entry


def _forward(q, k, v, causal: bool, scale, keep_lse: bool = True):
    """(out, lse, plan entry): the forward through the entry's plan, outputs allocated by torch.
    keep_lse=False (no autograd, lse not returned): the kernel writes lse into a buffer the plan entry
    keeps for such calls instead of a fresh one, saving an allocation (~2.6 us of host time on the
    H200 machine). Calls on other streams may write it at the same time; nothing ever reads it."""
    entry = _plan_entry(q, k, v, causal, scale)
    _check_pointers(q, k, v)
    if entry.copy_kv:
        k, v = k.contiguous(), v.contiguous()
    out = torch.empty_strided(*entry.out_spec, dtype=q.dtype, device=entry.device)
    if keep_lse or _capturing():  # a captured graph writes lse on every replay: into memory it owns
        lse = torch.empty_strided(*entry.lse_spec, dtype=torch.float32, device=entry.device)
    else:
        lse = entry.unread_lse
        if lse is None:
            lse = entry.unread_lse = torch.empty_strided(*entry.lse_spec, dtype=torch.float32, device=entry.device)
    if _current_device() == entry.device_index:
        entry.forward.launch(q, k, v, out, lse)
    else:  # cuLaunchKernel uses the thread's current context: make it q's device's
        with torch.cuda.device(entry.device_index):
            entry.forward.launch(q, k, v, out, lse)
    if not entry.host_offered:
        _offer_to_host(q, k, v, causal, scale, entry)
    return out, lse, entry


def clear_plans() -> None:
    """Forget every plan entry (the compiled path's records too): the next call of each
    combination checks its arguments and plans again."""
    _plans.clear()
    if _host_forward is not None:
        from .runtime import host_launch

        host_launch.loaded().clear()  # loaded(), not module(): the switch may have been turned off since


# The compiled path (runtime/host_launch.cpp): module.forward once a combination has been
# registered with it, else None. It serves eager forwards of registered combinations in one C++ call
# (with inputs that require grad, through a C++ autograd Function whose backward runs the backward
# plan's launches registered by _offer_backward_to_host, or calls _backward for a dout layout not
# registered yet) and answers None for anything else, which then takes the Python path above.
_host_forward = None


def _offer_to_host(q, k, v, causal: bool, scale, entry: _PlanEntry) -> None:
    """Register a planned combination with the compiled path once its module is loaded
    (the first call starts its background build; while it builds each Python-path call asks again;
    switched off or failed, never again). Combinations it cannot serve: a copied K/V, a plan that
    copies an operand or launches with PDL, a scale that is not a float (the module's key holds None
    or a float), tensor subclasses."""
    global _host_forward
    from .runtime import host_launch

    module = host_launch.module()
    if module is None:
        entry.host_offered = host_launch.unavailable()  # asked again on later calls while it builds
        return
    entry.host_offered = True
    if entry.copy_kv or not (scale is None or type(scale) is float) or not all(type(t) is Tensor for t in (q, k, v)):
        return
    planned = entry.forward.host_slots()  # (LaunchPlan, slots) or None
    fields = None if planned is None else host_launch.launch_fields(*planned)
    if fields is None:
        return
    if entry.unread_lse is None:
        entry.unread_lse = torch.empty_strided(*entry.lse_spec, dtype=torch.float32, device=entry.device)
    module.register(q, k, v, causal, scale, entry, entry.device_index, fields, entry.out_spec, entry.lse_spec,
                    entry.unread_lse)
    entry.host_key = (causal, scale)
    _host_forward = module.forward


def _offer_backward_to_host(entry: _PlanEntry, plan, q, k, v, dout, deterministic: bool) -> None:
    """Register the backward plan of this dout layout and mode with the compiled path, once per
    pair, for an entry whose forward is registered there (entry.host_key); the module's autograd
    node then runs the plan's launches itself. Plans it cannot launch (variant kernels, copied
    operands, no work, PDL) give None from host_launches and stay on the Python path."""
    from .runtime import host_launch

    pair = (dout.stride(), deterministic)
    if pair in entry.host_backward:
        return
    entry.host_backward.add(pair)
    module, planned = host_launch.loaded(), plan.host_launches()
    if module is None or planned is None:
        return
    launches, workspace_elems, semaphore_elems = planned
    fields = tuple(host_launch.launch_fields(*launch) for launch in launches)
    if None in fields:
        return
    module.register_backward(q, k, v, *entry.host_key, dout, deterministic, fields, entry.grad_specs,
                             workspace_elems, semaphore_elems)


def _laid_out(t: Tensor, strides: tuple) -> Tensor:
    """`t` with these strides: itself, or a copy into a new tensor of that layout."""
    if t.stride() == strides:
        return t
    return torch.empty_strided(t.shape, strides, dtype=t.dtype, device=t.device).copy_(t)


def _backward(entry: _PlanEntry, dout, q, k, v, out, lse, deterministic: bool, extra=()):
    """(dq, dk, dv) in the layouts of q, k, v (contiguous when those are not dense). `extra`: the
    variant plans' per-call values (ALiBi pointer, dropout seed, offset, rng state pointer). Saved tensors that a
    saved-tensor hook (torch.autograd.graph.save_on_cpu, ...) returned in another layout than the
    forward's are copied back into it: the plans hold the forward's strides. The deterministic mode
    also runs under torch.use_deterministic_algorithms(True), as torch's own backwards follow it."""
    deterministic = deterministic or torch.are_deterministic_algorithms_enabled()
    if (q.stride(), k.stride(), v.stride()) != entry.input_strides:
        q, k, v = (_laid_out(t, s) for t, s in zip((q, k, v), entry.input_strides))
    out, lse = _laid_out(out, entry.out_spec[1]), _laid_out(lse, entry.lse_spec[1])
    in_place = _kernel_layout_ok(dout)
    if not in_place:  # e.g. the stride-0 expanded gradient of out.sum(), or a misaligned contiguous one
        dout = dout.clone(memory_format=torch.contiguous_format)  # fresh storage: aligned
    if entry.copy_kv:
        k, v = k.contiguous(), v.contiguous()
    dq, dk, dv = (torch.empty_strided(*spec, dtype=q.dtype, device=entry.device) for spec in entry.grad_specs)
    plan = entry.backward_plan(q, k, v, out, lse, dout, dq, dk, dv, deterministic)
    if _current_device() == entry.device_index:
        plan.launch(q, k, v, out, lse, dout, dq, dk, dv, *extra)
    else:
        with torch.cuda.device(entry.device_index):
            plan.launch(q, k, v, out, lse, dout, dq, dk, dv, *extra)
    if entry.host_key is not None and in_place:  # the compiled path keys its backwards by dout's own layout
        _offer_backward_to_host(entry, plan, q, k, v, dout, deterministic)
    return dq, dk, dv


def _backward_of_saved(dout, q, k, v, out, lse, causal: bool, scale, deterministic: bool):
    """The backward of the compiled path's autograd node when the module holds no launches for it
    (the first backward of a dout layout, or saved tensors in another layout): the entry of the
    saved tensors' combination, as the forward keyed it, and _backward."""
    return _backward(_plan_entry(q, k, v, causal, scale), dout, q, k, v, out, lse, deterministic)


class _AttentionFunction(torch.autograd.Function):
    """The eager path with autograd: forward and backward through one plan entry."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, deterministic):
        out, lse, entry = _forward(q, k, v, causal, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.entry, ctx.deterministic = entry, deterministic
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)  # lse never has a gradient: no zeros tensor is made for it
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        if dout is None:  # out did not reach the loss (possible without materialized grads)
            return None, None, None, None, None, None
        dq, dk, dv = _backward(ctx.entry, dout, q, k, v, out, lse, ctx.deterministic)
        return dq, dk, dv, None, None, None


# ---------------------------------------------------------------------------------------------
# Variants (window, softcap, ALiBi, dropout): the sm_80 variant kernels, eager path
# ---------------------------------------------------------------------------------------------
class _VariantEntry(_PlanEntry):
    """A validated combination with variants: the dispatcher's variant forward plans
    (dispatch.variant_forward_plan; causal folded into the window): `forward` for calls a backward
    may follow, and, built on first use, the one for calls none follows (inference_forward: softcap's
    fixed row max where it applies); and its variant backward plans (dispatch.variant_backward_plan).
    Their launches take (alibi pointer, seed, offset, rng state pointer) last."""

    __slots__ = ("variants", "inference")

    def __init__(self, q, k, v, causal: bool, scale, window, softcap, alibi_slopes, dropout_p, rng_state=False):
        from .kernels import attention_fwd_sm80, dispatch

        # The variants' own checks come first, so that they report on CPU tensors too (as checks 1-6).
        left, right = dr.check_window(window, causal)
        cap = dr.check_softcap(softcap)
        p = dr.check_dropout(dropout_p, None, None, None)
        sb = None
        if alibi_slopes is not None and isinstance(q, Tensor) and q.dim() == 4:
            sb = dr.check_alibi(alibi_slopes, q.shape[0], q.shape[1], q.device, dtype_strict=True)
        _check_args(q, k, v, scale)
        dr.check_variant_lengths(q.shape[2], k.shape[2])
        self.input_strides = (q.stride(), k.stride(), v.stride())
        self.variants = attention_fwd_sm80.VariantArgs(left, right, cap, sb, p, rng_state)
        self.causal = False  # folded into the window
        self.scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
        self.device_index, self.device = q.device.index, q.device
        self.copy_kv = dispatch.needs_contiguous_kv(k) or dispatch.needs_contiguous_kv(v)
        if self.copy_kv:
            k, v = k.contiguous(), v.contiguous()
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
        self.out_spec, self.lse_spec = (out.shape, out.stride()), (lse.shape, lse.stride())
        self.grad_specs = tuple((t.shape, torch.empty_like(t).stride()) for t in (q, k, v))
        with torch.cuda.device(self.device_index):
            self.forward = dispatch.variant_forward_plan(q, k, v, out, lse, scale=self.scale, variants=self.variants)
        self.inference = None if dispatch.inference_forward_differs(q, k, self.variants) else self.forward
        self.backward: dict[tuple, object] = {}
        self.host_key = None  # never on the compiled path (_backward asks)

    def inference_forward(self, q, k, v, out, lse):
        """The forward plan of a call that no backward follows (built on the first such call)."""
        if self.inference is None:
            from .kernels import dispatch

            self.inference = dispatch.variant_forward_plan(q, k, v, out, lse, scale=self.scale, variants=self.variants,
                                                           inference=True)
        return self.inference

    def _build_backward(self, q, k, v, out, lse, dout, dq, dk, dv, deterministic: bool):
        from .kernels import dispatch

        return dispatch.variant_backward_plan(q, k, v, out, lse, dout, dq, dk, dv, scale=self.scale,
                                              deterministic=deterministic, variants=self.variants)


def _attention_variants(q, k, v, causal, scale, deterministic, window, softcap, alibi_slopes, dropout_p, generator,
                        seed, offset):
    """(out, lse) of a call with variants: eager through the plan entry, traced (torch.compile, fake
    tensors) through the tileattn::attention_variants_* custom ops, or the
    tileattn::attention_dropout_* ones when dropout_p > 0."""
    if alibi_slopes is not None and not isinstance(alibi_slopes, Tensor):
        raise ValueError(f"alibi_slopes must be None or a torch.Tensor, got {type(alibi_slopes).__name__}")
    if not _eager(q, k, v, *(() if alibi_slopes is None else (alibi_slopes,))):
        # Checked here with the plan entry's order: the custom op's implementation trusts them.
        left, right = dr.check_window(window, causal)
        cap = dr.check_softcap(softcap)
        p = dr.check_dropout(dropout_p, generator, seed, offset)
        if alibi_slopes is not None and isinstance(q, Tensor) and q.dim() == 4:
            dr.check_alibi(alibi_slopes, q.shape[0], q.shape[1], q.device, dtype_strict=True)
        _check_args(q, k, v, scale)
        dr.check_variant_lengths(q.shape[2], k.shape[2])
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
        if p > 0:
            rng = dr.traced_rng(generator, seed, offset, q.device)
            out, lse, _ = torch.ops.tileattn.attention_dropout_fwd(q, k, v, alibi_slopes, rng, scale, deterministic,
                                                                   left, right, cap, p)
            return out, lse
        needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
        return torch.ops.tileattn.attention_variants_fwd(q, k, v, alibi_slopes, scale, deterministic, left, right, cap,
                                                         not needs_grad)
    alibi_key = None if alibi_slopes is None else (alibi_slopes.shape, alibi_slopes.stride(), alibi_slopes.dtype,
                                                   alibi_slopes.get_device())
    # Whether the kernels read the dropout seed from device memory (their kRngState forms; dropout.py)
    rng_state = dr.wants_device_state(generator, seed, q.device) if dropout_p else False
    key = (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, k.dtype, v.dtype,
           q.get_device(), k.get_device(), v.get_device(), causal, scale, type(scale), "variants",
           _typed_window(window), softcap, type(softcap), alibi_key, dropout_p, type(dropout_p),
           rng_state)  # True == 1 == 1.0
    entry = _cached_entry(key, lambda: _VariantEntry(q, k, v, causal, scale, window, softcap, alibi_slopes, dropout_p,
                                                     rng_state))
    state = None
    if entry.variants.dropout_p > 0:
        dr.check_dropout(dropout_p, generator, seed, offset)
        seed, offset, state = dr.dropout_state(generator, seed, offset, q.device)
    else:
        seed, offset = 0, 0
    extra = (0 if alibi_slopes is None else alibi_slopes.data_ptr(), *dr.kernel_values(seed, offset, state))
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _VariantFunction.apply(q, k, v, entry, alibi_slopes, extra, deterministic, state)
    return _variant_forward(entry, q, k, v, extra, inference=True)


@contextlib.contextmanager
def dispatch_tables(contents):
    """Within: for each (table, keys) of `contents`, the dispatcher's table (a set in
    tileattn.kernels.dispatch) holds exactly `keys`; the tables are restored after. The plan caches of
    tileattn.attention, attention_varlen and attention_paged are emptied on entry and exit, so no plan
    outlives the choice it was made under. For tests and benchmarks (an A/B of kernel choices); not
    thread-safe. Raises ValueError for a table that is not one of tileattn.kernels.dispatch's sets."""
    from . import api_paged, api_varlen
    from .kernels import dispatch

    contents = [(table, set(keys)) for table, keys in contents]
    known = {id(t) for t in vars(dispatch).values() if isinstance(t, set)}
    for table, _ in contents:
        if id(table) not in known:
            raise ValueError(f"dispatch_tables: {type(table).__name__} {table!r:.60} is not a table (set) of "
                             "tileattn.kernels.dispatch")
    saved = [set(table) for table, _ in contents]

    def clear_caches():
        api_varlen._plans.clear()
        api_paged._paged_cache.clear()
        clear_plans()

    for table, keys in contents:
        table.clear()
        table.update(keys)
    clear_caches()
    try:
        yield
    finally:
        for (table, _), old in zip(contents, saved):
            table.clear()
            table.update(old)
        clear_caches()


def hopper_kernels_forced():
    """Within: the dispatcher's tables of Hopper kernels not yet dispatched by default (layouts written
    before their device run: kernels.dispatch.UNMEASURED_SM90_TABLES) hold everything those kernels
    implement, so the ops take them wherever the device and the call allow (dispatch_tables: restored
    after, plan caches emptied on entry and exit). For tests and benchmarks; not thread-safe."""
    from .kernels import dispatch

    return dispatch_tables((table, table | implemented) for table, implemented in dispatch.UNMEASURED_SM90_TABLES)


def _cached_entry(key, make):
    """The plan entry under `key`, made (and validated) by make() on first use. A key that cannot
    be hashed (a malformed argument) goes to make(), whose checks raise the ValueError."""
    try:
        entry = _plans.get(key)
    except TypeError:
        return make()
    if entry is None:
        entry = make()
        if len(_plans) >= _MAX_PLANS:
            clear_plans()
        _plans[key] = entry
    return entry


def _variant_forward(entry: _VariantEntry, q, k, v, extra, inference: bool = False):
    """(out, lse): `_forward`'s steps with the variant plan's per-call values (kept apart so that the
    plain path pays nothing for them)."""
    _check_pointers(q, k, v)
    if entry.copy_kv:
        k, v = k.contiguous(), v.contiguous()
    out = torch.empty_strided(*entry.out_spec, dtype=q.dtype, device=entry.device)
    lse = torch.empty_strided(*entry.lse_spec, dtype=torch.float32, device=entry.device)
    with torch.cuda.device(entry.device_index):
        plan = (entry.inference or entry.inference_forward(q, k, v, out, lse)) if inference else entry.forward
        plan.launch(q, k, v, out, lse, *extra)
    return out, lse


class _VariantFunction(torch.autograd.Function):
    """Autograd of a call with variants: the backward reuses the forward's entry and per-call values
    (the same ALiBi slopes and dropout seed/offset, so the same mask; `state`: the device rng state
    whose pointer `extra` holds, or None)."""

    @staticmethod
    def forward(ctx, q, k, v, entry, alibi_slopes, extra, deterministic, state):
        out, lse = _variant_forward(entry, q, k, v, extra)
        # The slopes are saved like the tensors: autograd then refuses a backward after an in-place
        # change to them (the backward reads them again), and a saved-tensor hook's copy is what it reads.
        ctx.save_for_backward(q, k, v, out, lse, alibi_slopes)
        ctx.entry, ctx.extra, ctx.deterministic = entry, extra, deterministic
        ctx.state = _snapshot(state)
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, alibi_slopes = ctx.saved_tensors
        if dout is None:
            return (None,) * 8
        dq, dk, dv = _backward(ctx.entry, dout, q, k, v, out, lse, ctx.deterministic,
                               _with_slopes(ctx.extra, alibi_slopes, ctx.state))
        return dq, dk, dv, None, None, None, None, None


def _typed_window(window):
    """A window argument as a plan-cache key part: each edge with its type (True == 1 in a tuple,
    but a bool edge is an error the checks must see)."""
    return tuple((w, type(w)) for w in window) if isinstance(window, (tuple, list)) else window


def _with_slopes(extra: tuple, alibi_slopes, state) -> tuple:
    """The variant plans' per-call values (ALiBi pointer, seed, offset, rng state pointer) with the pointers
    of these slopes and this device rng state (the saved ones, in a backward)."""
    return (0 if alibi_slopes is None else alibi_slopes.data_ptr(), *extra[1:3], 0 if state is None else state.data_ptr())


def _snapshot(state):
    """A device rng state as the forward read it, for the backward: a copy (16 bytes, enqueued on the
    forward's stream after its kernels, so holding the values they read), since a caller's seed tensor
    may be rewritten before the backward runs. Holding it also keeps its memory from reuse under
    capture until the backward's kernels have read it."""
    return None if state is None else state.clone()


# ---------------------------------------------------------------------------------------------
# Custom ops (the traced path)
# ---------------------------------------------------------------------------------------------
# Variants (no dropout): window edges already normalized (causal folded in, UNBOUNDED for none),
# softcap 0.0 = off. The implementations run the eager plan entries.
@torch.library.custom_op("tileattn::attention_variants_fwd", mutates_args=(), device_types="cuda")
def _attention_variants_fwd(
    q: Tensor, k: Tensor, v: Tensor, alibi_slopes: Optional[Tensor], scale: float, deterministic: bool,
    window_left: int, window_right: int, softcap: float, inference: bool,
) -> tuple[Tensor, Tensor]:
    """(out [B, H, Nq, d], lse [B, H, Nq] fp32) with window / softcap / ALiBi. inference: no backward
    follows (the caller traced it without grad), so the entry's inference plan may run."""
    entry = _variant_op_entry(q, k, v, alibi_slopes, scale, window_left, window_right, softcap)
    return _variant_forward(entry, q, k, v, (0 if alibi_slopes is None else alibi_slopes.data_ptr(), 0, 0, 0),
                            inference=inference)


@_attention_variants_fwd.register_fake
def _attention_variants_fwd_fake(q, k, v, alibi_slopes, scale, deterministic, window_left, window_right, softcap,
                                 inference):
    return torch.empty_like(q), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op("tileattn::attention_variants_bwd", mutates_args=(), device_types="cuda")
def _attention_variants_bwd(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, alibi_slopes: Optional[Tensor],
    scale: float, deterministic: bool, window_left: int, window_right: int, softcap: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of attention_variants_fwd."""
    entry = _variant_op_entry(q, k, v, alibi_slopes, scale, window_left, window_right, softcap)
    extra = (0 if alibi_slopes is None else alibi_slopes.data_ptr(), 0, 0, 0)
    return _backward(entry, dout, q, k, v, out, lse, deterministic, extra)


@_attention_variants_bwd.register_fake
def _attention_variants_bwd_fake(dout, q, k, v, out, lse, alibi_slopes, scale, deterministic, window_left,
                                 window_right, softcap):
    return _gradients_fake(q, k, v)


def _variant_op_entry(q, k, v, alibi_slopes, scale, left, right, softcap, dropout_p=0.0,
                      rng_state=False) -> _VariantEntry:
    alibi_key = None if alibi_slopes is None else (alibi_slopes.shape, alibi_slopes.stride(), alibi_slopes.dtype,
                                                   alibi_slopes.get_device())
    key = (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, k.dtype, v.dtype,
           q.get_device(), k.get_device(), v.get_device(), False, scale, "variants", (left, right), softcap,
           alibi_key, dropout_p, rng_state)
    return _cached_entry(key, lambda: _VariantEntry(q, k, v, False, scale, (left, right), softcap, alibi_slopes,
                                                    dropout_p, rng_state))


def _variants_setup_context(ctx, inputs, output) -> None:
    q, k, v, alibi_slopes, scale, deterministic, window_left, window_right, softcap, _inference = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, alibi_slopes)
    ctx.args = (scale, deterministic, window_left, window_right, softcap)
    ctx.mark_non_differentiable(lse)


def _variants_backward_op(ctx, dout, _dlse):
    q, k, v, out, lse, alibi_slopes = ctx.saved_tensors
    dq, dk, dv = torch.ops.tileattn.attention_variants_bwd(dout, q, k, v, out, lse, alibi_slopes, *ctx.args)
    return dq, dk, dv, None, None, None, None, None, None, None


_attention_variants_fwd.register_autograd(_variants_backward_op, setup_context=_variants_setup_context)


# Dropout on the traced path: the rng state travels as an int64 tensor [2] (dropout.py, "Dropout on the
# traced path"), given (seed/offset on the CPU, or a seed tensor on q's device) or drawn in the op; the
# backward gets the state the forward used.
@torch.library.custom_op("tileattn::attention_dropout_fwd", mutates_args=(), device_types="cuda")
def _attention_dropout_fwd(
    q: Tensor, k: Tensor, v: Tensor, alibi_slopes: Optional[Tensor], rng: Optional[Tensor], scale: float,
    deterministic: bool, window_left: int, window_right: int, softcap: float, dropout_p: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """(out [B, H, Nq, d], lse [B, H, Nq] fp32, rng state int64 [2] on rng's device, the CPU for None) with
    dropout (and any other variant); rng: the [seed, offset] to use, or None to draw them (see above)."""
    seed, offset, state = dr.op_state(rng, q.device)
    entry = _variant_op_entry(q, k, v, alibi_slopes, scale, window_left, window_right, softcap, dropout_p,
                              state is not None)
    out, lse = _variant_forward(entry, q, k, v, (0 if alibi_slopes is None else alibi_slopes.data_ptr(),
                                                 *dr.kernel_values(seed, offset, state)))
    return out, lse, dr.used_rng_state(seed, offset, state)


@_attention_dropout_fwd.register_fake
def _attention_dropout_fwd_fake(q, k, v, alibi_slopes, rng, scale, deterministic, window_left, window_right, softcap,
                                dropout_p):
    return torch.empty_like(q), q.new_empty(q.shape[:3], dtype=torch.float32), dr.rng_state_fake(rng)


@torch.library.custom_op("tileattn::attention_dropout_bwd", mutates_args=(), device_types="cuda")
def _attention_dropout_bwd(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, alibi_slopes: Optional[Tensor],
    rng: Tensor, scale: float, deterministic: bool, window_left: int, window_right: int, softcap: float,
    dropout_p: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of attention_dropout_fwd, with the rng state it returned."""
    seed, offset, state = dr.op_state(rng, q.device)
    entry = _variant_op_entry(q, k, v, alibi_slopes, scale, window_left, window_right, softcap, dropout_p,
                              state is not None)
    extra = (0 if alibi_slopes is None else alibi_slopes.data_ptr(), *dr.kernel_values(seed, offset, state))
    return _backward(entry, dout, q, k, v, out, lse, deterministic, extra)


@_attention_dropout_bwd.register_fake
def _attention_dropout_bwd_fake(dout, q, k, v, out, lse, alibi_slopes, rng, scale, deterministic, window_left,
                                window_right, softcap, dropout_p):
    return _gradients_fake(q, k, v)


dr.register_dropout_autograd(_attention_dropout_fwd, torch.ops.tileattn.attention_dropout_bwd, num_extra=1)

@torch.library.custom_op("tileattn::attention_fwd", mutates_args=(), device_types="cuda")
def _attention_fwd(
    q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, deterministic: bool
) -> tuple[Tensor, Tensor]:
    """(out [B, H, Nq, d] input dtype, lse [B, H, Nq] fp32). `deterministic` is for the backward."""
    hit = None if _host_forward is None else _host_forward(q, k, v, causal, scale, 1)
    if hit is not None:
        return hit
    out, lse, _ = _forward(q, k, v, causal, scale)
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
    return _backward(_plan_entry(q, k, v, causal, scale), dout, q, k, v, out, lse, deterministic)


@_attention_bwd.register_fake
def _attention_bwd_fake(dout, q, k, v, out, lse, causal, scale, deterministic):
    return _gradients_fake(q, k, v)


def _gradients_fake(q, k, v) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) as the backward ops lay them out: like q, k, v, except that dk and dv follow
    the contiguous copies of K and V that an entry with copy_kv plans for (grad_specs)."""
    from .kernels import dispatch

    if dispatch.needs_contiguous_kv(k) or dispatch.needs_contiguous_kv(v):
        k, v = k.contiguous(), v.contiguous()
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, causal, scale, deterministic = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.causal, ctx.scale, ctx.deterministic = causal, scale, deterministic
    ctx.mark_non_differentiable(lse)


def _backward_op(ctx, dout, _dlse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = torch.ops.tileattn.attention_bwd(dout, q, k, v, out, lse, ctx.causal, ctx.scale, ctx.deterministic)
    return dq, dk, dv, None, None, None


_attention_fwd.register_autograd(_backward_op, setup_context=_setup_context)
