"""The decoder layer's elementwise steps as fused tileattn kernels: `add_rms_norm`,
`norm_rotary_`, `norm_rotary_write_kv_cache_`, `silu_mul` (csrc/layer_ops.cu).

Each fused step replaces two to four eager torch kernels with one launch (docs/layer_ops.md has
the count and why it matters at decode). On CUDA tensors of float16/bfloat16 they run tileattn's kernels; on
any other device or dtype (the engine's CPU path, float32 models) the same arithmetic runs as torch
ops. Both paths round to the 16-bit type where transformers' implementations do, so the engine
can be compared with transformers token for token.

Arguments are checked on the host before anything is launched (ValueError naming the argument);
nothing synchronises with the device, so the ops can be captured in CUDA graphs.
"""

from __future__ import annotations

import numbers

import torch
from torch import Tensor

from .api import _current_device

_KERNEL_DTYPES = (torch.float16, torch.bfloat16)
MAX_NORM_DIM = 32768  # add_rms_norm's kernel keeps a row in registers: 1024 threads x 4 chunks x 8
MAX_ROTARY_HEAD_DIM = 256


def add_rms_norm(x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None):
    """RMSNorm of x, or of x + residual with the sum written back into residual.

    Args:
        x: [T, D]; weight: [D], x's dtype and device; D a multiple of 8 (kernel path: at most 32768,
            last dim contiguous, rows and data pointers 16-byte aligned).
        eps: added to the mean of squares.
        residual: None, or [T, D] like x, updated in place to x + residual (rounded to the dtype).

    Returns:
        out [T, D] = weight * round(s / sqrt(mean(s^2) + eps)) with s = x (+ residual), a new
        tensor; with a residual, the tuple (out, residual).

    Raises:
        ValueError: ranks, shapes, dtypes or devices that disagree; a layout the kernel cannot
            read (see above).
    """
    _check_2d("x", x)
    eps = _check_eps(eps)
    dim = x.shape[1]
    if not isinstance(weight, Tensor) or weight.dim() != 1 or weight.shape[0] != dim:
        raise ValueError(f"weight must be [D] = [{dim}], got {_describe(weight)}")
    _same("weight", weight, x)
    if residual is not None:
        _check_2d("residual", residual)
        if residual.shape != x.shape:
            raise ValueError(f"residual must have x's shape {list(x.shape)}, got {list(residual.shape)}")
        _same("residual", residual, x)
    if not _on_kernel(x):
        s = x if residual is None else residual.copy_(x + residual)
        f = s.float()
        out = weight * (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
        return out if residual is None else (out, residual)
    if dim % 8 or dim > MAX_NORM_DIM:
        raise ValueError(f"add_rms_norm's kernel needs D a multiple of 8 and at most {MAX_NORM_DIM}, got D={dim}")
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    for name, t in (("x", x), ("weight", weight.view(1, -1)), ("residual", residual), ("out", out)):
        if t is not None:
            _check_rows(name, t)
    if x.shape[0]:
        from .kernels.layer_ops import launch_add_rms_norm

        with _device_of(x):
            launch_add_rms_norm(out, residual, x, weight, float(eps))
    return out if residual is None else (out, residual)


def norm_rotary_(x: Tensor, positions: Tensor, cos: Tensor, sin: Tensor, q_heads: int | None = None,
                 q_weight: Tensor | None = None, k_weight: Tensor | None = None, eps: float = 1e-6) -> Tensor:
    """Rotate-half rotary embedding of x in place, after a per-head RMSNorm when weights are given
    (Qwen3's q_norm / k_norm).

    Args:
        x: [T, heads, d] (any row and head strides, d contiguous; e.g. the q and k heads of a fused
            qkv projection's output viewed as one tensor), float16/bfloat16 on CUDA or any float.
        positions: int64 [T], x's device: each token's row of the tables. A position outside
            [0, P) leaves that token's heads untouched on the kernel path (never read out of
            bounds); the torch path raises IndexError.
        cos, sin: float32 [P, d] contiguous tables: cos holds (cos f, cos f), sin (-sin f, sin f)
            over the d/2 frequencies f (the engine's Rotary buffers). Rounded to x's dtype before
            use, as transformers hands them to the layers.
        q_heads: heads [0, q_heads) are queries (normalised with q_weight), the rest keys
            (k_weight); required with weights.
        q_weight, k_weight: None (no norm) or both [d] in x's dtype.
        eps: the norm's epsilon.

    Returns x. Raises ValueError for shapes, dtypes, devices or layouts that disagree.
    """
    _check_rotary("x", x, positions, cos, sin)
    norm = _check_norm_weights(x, q_weight, k_weight)
    if norm:
        eps = _check_eps(eps)
        if q_heads is None:
            raise ValueError("a per-head norm needs q_weight, k_weight and q_heads together")
        if not 0 <= q_heads <= x.shape[1]:
            raise ValueError(f"q_heads must be in [0, {x.shape[1]}], got {q_heads}")
    if not _on_kernel(x):
        return x.copy_(_norm_rotary_torch(x, positions, cos, sin, q_heads, q_weight, k_weight, eps))
    if x.shape[0] and x.shape[1]:
        from .kernels.layer_ops import launch_norm_rotary

        qw, kw = (q_weight.contiguous(), k_weight.contiguous()) if norm else (None, None)
        with _device_of(x):
            launch_norm_rotary(x, positions.contiguous(), cos, sin, q_heads or 0, qw, kw, float(eps))
    return x


def norm_rotary_write_kv_cache_(q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor,
                                slot_mapping: Tensor, positions: Tensor, cos: Tensor, sin: Tensor,
                                q_weight: Tensor | None = None, k_weight: Tensor | None = None,
                                eps: float = 1e-6) -> Tensor:
    """`norm_rotary_` of the queries in place and of the keys into the paged KV cache, with the
    values written beside them: what ``norm_rotary_(qk, ...)`` followed by
    ``write_kv_cache(k, v, k_cache, v_cache, slot_mapping)`` does, bit for bit, in one launch.

    Args:
        q: [T, H, d] (any row and head strides, d contiguous), rotated in place (normalised first
            with q_weight when weights are given). d even, at most 256.
        k: [T, Hkv, d], read only: its normalised, rotated rows go to k_cache and k itself is left
            as it was (callers must not expect rotated keys in it).
        v: [T, Hkv, d], copied to v_cache.
        k_cache, v_cache: [num_blocks, block_size, Hkv, d], block_size a power of two; token t's
            rows go to block slot // block_size, row slot % block_size, slot = slot_mapping[t].
        slot_mapping: int64 or int32 [T], contiguous. A negative slot skips the token's k and v
            (padding), and so does a slot at or past num_blocks * block_size (never written
            outside the cache), as in write_kv_cache.
        positions, cos, sin: as in `norm_rotary_` (int64 [T]; float32 [P, d] tables). On the
            kernel path a position outside [0, P) leaves the token's q untouched and writes its k
            unrotated (what the two steps do); the torch path raises IndexError.
        q_weight, k_weight: None (no norm) or both [d] in q's dtype (Qwen3's q_norm / k_norm).
        eps: the norm's epsilon.

    q, k, v and the caches share one dtype. Kernel path: float16/bfloat16 CUDA tensors, with
    write_kv_cache's layout rules for k, v and the caches (16-byte aligned strides and data
    pointers). Any other device or dtype runs the same arithmetic as torch ops and
    tileattn.reference.write_kv_cache. Capturable by CUDA graphs (no sync, no allocation).

    Returns q. Raises ValueError (naming the argument, before anything runs) for shapes, dtypes,
    devices, slot_mapping dtypes or layouts that disagree.
    """
    _check_rotary_write_kv(q, k, v, k_cache, v_cache, slot_mapping, positions, cos, sin, q_weight, k_weight)
    if q_weight is not None:
        eps = _check_eps(eps)
    _rotary_write_kv(q, k, v, k_cache, v_cache, slot_mapping, positions, cos, sin, q_weight, k_weight, eps)
    return q


def _check_rotary_write_kv(q, k, v, k_cache, v_cache, slot_mapping, positions, cos, sin, q_weight, k_weight) -> None:
    """Every check of norm_rotary_write_kv_cache_: the metadata ones (once per combination), and on
    the kernel path the data pointers' alignment."""
    _check_fused_once(q, k, v, k_cache, v_cache, slot_mapping, positions, cos, sin, q_weight, k_weight)
    if _on_kernel(q):
        from .api_paged import _check_pointers

        _check_pointers(k=k, v=v, k_cache=k_cache, v_cache=v_cache)


def _rotary_write_kv(q, k, v, k_cache, v_cache, slot_mapping, positions, cos, sin, q_weight, k_weight, eps) -> None:
    """norm_rotary_write_kv_cache_ on arguments _check_rotary_write_kv has passed."""
    if not _on_kernel(q):
        from . import reference

        q.copy_(_norm_rotary_torch(q, positions, cos, sin, q.shape[1], q_weight, q_weight, eps))
        k_rotated = _norm_rotary_torch(k, positions, cos, sin, 0, k_weight, k_weight, eps)  # [T, Hkv, d]
        reference.write_kv_cache(k_rotated, v, k_cache, v_cache, slot_mapping)
        return
    if q.shape[0] * (q.shape[1] + k.shape[1]):
        from .kernels.layer_ops import launch_norm_rotary_write_kv

        norm = q_weight is not None
        qw, kw = (q_weight.contiguous(), k_weight.contiguous()) if norm else (None, None)
        with _device_of(q):
            launch_norm_rotary_write_kv(q, k, v, k_cache, v_cache, slot_mapping, positions.contiguous(), cos, sin,
                                        qw, kw, float(eps))


_fused_checked: set = set()  # metadata keys norm_rotary_write_kv_cache_ has validated
CHECK_CACHE_LIMIT = 1024


def _check_fused_once(*tensors) -> None:
    """_check_fused, once per combination of the tensors' metadata (the checks read nothing else):
    host time per layer."""
    try:
        key = tuple(None if t is None else (t.shape, t.stride(), t.dtype, t.device) for t in tensors)
    except AttributeError:
        key = None
    if key is None or key not in _fused_checked:
        _check_fused(*tensors)
        if key is not None:
            if len(_fused_checked) >= CHECK_CACHE_LIMIT:
                _fused_checked.clear()
            _fused_checked.add(key)


def _check_fused(q, k, v, k_cache, v_cache, slot_mapping, positions, cos, sin, q_weight, k_weight) -> None:
    """Every metadata check of norm_rotary_write_kv_cache_ (not the data pointers' alignment)."""
    from . import reference

    _check_rotary("q", q, positions, cos, sin)
    _check_norm_weights(q, q_weight, k_weight)
    reference.check_write_kv_args(k, v, k_cache, v_cache, slot_mapping)
    if k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2]:
        raise ValueError(f"k must be [T, Hkv, d] with q's T and d {q.shape[0], q.shape[2]}, got {list(k.shape)}")
    if v.shape != k.shape:
        raise ValueError(f"v must have k's shape {list(k.shape)}, got {list(v.shape)}")
    for name, t in (("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype != q.dtype:
            raise ValueError(f"{name} is {t.dtype}; q, k, v, k_cache and v_cache must share one dtype ({q.dtype})")
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping must be int64 or int32, got {slot_mapping.dtype}")
    if slot_mapping.device != q.device or k.device != q.device:
        raise ValueError(f"k, v, caches and slot_mapping are on {k.device}, q on {q.device}")
    if _on_kernel(q):
        from .api_paged import _check_write

        _check_write(k, v, k_cache, v_cache, slot_mapping)  # write_kv_cache's layout rules
        rows = q.shape[0] * (q.shape[1] + k.shape[1])
        if rows >= 2**31:
            raise ValueError(f"q, k: T * (H + Hkv) = {rows} rows exceeds 2^31 - 1")


def _check_rotary(name: str, x, positions, cos, sin) -> None:
    """The rotary step's checks of x ([T, heads, d]) and its tables, as norm_rotary_ documents."""
    if not isinstance(x, Tensor) or x.dim() != 3:
        raise ValueError(f"{name} must be a [T, heads, d] tensor, got {_describe(x)}")
    tokens, _, head_dim = x.shape
    if head_dim % 2 or head_dim > MAX_ROTARY_HEAD_DIM:
        raise ValueError(f"{name}: head dim must be even and at most {MAX_ROTARY_HEAD_DIM}, got {head_dim}")
    if x.stride(2) != 1:
        raise ValueError(f"{name}'s last dim must be contiguous")
    if not isinstance(positions, Tensor) or positions.shape != (tokens,) or positions.dtype != torch.int64:
        raise ValueError(f"positions must be int64 [T] = [{tokens}], got {_describe(positions)}")
    for table_name, t in (("cos", cos), ("sin", sin)):
        if not isinstance(t, Tensor) or t.dim() != 2 or t.shape[1] != head_dim or t.dtype != torch.float32:
            raise ValueError(f"{table_name} must be float32 [P, {head_dim}], got {_describe(t)}")
        if not t.is_contiguous():
            raise ValueError(f"{table_name} must be contiguous")
    if cos.shape != sin.shape:
        raise ValueError(f"cos and sin must have one shape, got {list(cos.shape)} and {list(sin.shape)}")
    for other_name, t in (("positions", positions), ("cos", cos), ("sin", sin)):
        if t.device != x.device:
            raise ValueError(f"{other_name} is on {t.device}, {name} on {x.device}")


def _check_norm_weights(x: Tensor, q_weight, k_weight) -> bool:
    """Whether a per-head norm is asked for; both weights [d] in x's dtype and device, or neither."""
    if q_weight is None and k_weight is None:
        return False
    if q_weight is None or k_weight is None:
        raise ValueError("a per-head norm needs q_weight, k_weight and q_heads together")
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        if not isinstance(w, Tensor) or w.shape != (x.shape[2],):
            raise ValueError(f"{name} must be [d] = [{x.shape[2]}], got {_describe(w)}")
        _same(name, w, x)
    return True


def _norm_rotary_torch(x, positions, cos, sin, q_heads, q_weight, k_weight, eps):
    f = x.float()  # [T, heads, d]
    if q_weight is not None:
        weight = torch.cat([q_weight.expand(q_heads, -1), k_weight.expand(x.shape[1] - q_heads, -1)])  # [heads, d]
        normed = (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
        f = (weight * normed).float()
    c = cos[positions].to(x.dtype).float().unsqueeze(1)  # [T, 1, d]
    s = sin[positions].to(x.dtype).float().unsqueeze(1)
    return (f * c + f.roll(x.shape[-1] // 2, dims=-1) * s).to(x.dtype)


def silu_mul(x: Tensor) -> Tensor:
    """silu(gate) * up for x = [gate | up] of shape [T, 2F]: returns a new [T, F] tensor,
    round(silu(gate)) * up (transformers rounds the activation before the product).

    Kernel path: F a multiple of 8, last dim contiguous, rows and data pointer 16-byte aligned.
    Raises ValueError for other shapes or layouts."""
    _check_2d("x", x)
    if x.shape[1] % 2:
        raise ValueError(f"x must be [T, 2F], got an odd width {x.shape[1]}")
    width = x.shape[1] // 2
    if not _on_kernel(x):
        gate, up = x.split(width, dim=-1)
        return torch.nn.functional.silu(gate) * up
    if width % 8:
        raise ValueError(f"silu_mul's kernel needs F a multiple of 8, got F={width}")
    _check_rows("x", x)
    out = torch.empty((x.shape[0], width), dtype=x.dtype, device=x.device)
    if out.numel():
        from .kernels.layer_ops import launch_silu_mul

        with _device_of(x):
            launch_silu_mul(out, x)
    return out


# ---- checks ----------------------------------------------------------------------------------

def _on_kernel(x: Tensor) -> bool:
    return x.is_cuda and x.dtype in _KERNEL_DTYPES


def _describe(t) -> str:
    if not isinstance(t, Tensor):
        return type(t).__name__
    return f"{t.dtype} {list(t.shape)} on {t.device}"


def _check_eps(eps) -> float:
    """The norm's epsilon as a float: a finite number >= 0 (the kernels take it as a float32; torch's
    fallback could not add an int past int64 to a tensor)."""
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not 0.0 <= eps < 3.4e38:
        raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")
    return float(eps)


def _check_2d(name: str, t) -> None:
    if not isinstance(t, Tensor) or t.dim() != 2:
        raise ValueError(f"{name} must be a [T, D] tensor, got {_describe(t)}")


def _same(name: str, t: Tensor, x: Tensor) -> None:
    if t.dtype != x.dtype or t.device != x.device:
        raise ValueError(f"{name} is {t.dtype} on {t.device}; x is {x.dtype} on {x.device}")


def _check_rows(name: str, t: Tensor) -> None:
    """The kernels move 16-byte chunks: contiguous rows at 16-byte aligned addresses."""
    if t.stride(-1) != 1 or (t.shape[0] > 1 and t.stride(0) % 8) or t.data_ptr() % 16:
        raise ValueError(f"{name} needs a contiguous last dim, a row stride that is a multiple of 8 "
                         f"elements and a 16-byte aligned data pointer (strides {t.stride()})")


class _device_of:
    """Make x's device current for the launch (cuLaunchKernel uses the thread's context)."""

    def __init__(self, x: Tensor):
        self.index = x.get_device()
        self.guard = None

    def __enter__(self):
        if _current_device() != self.index:
            self.guard = torch.cuda.device(self.index)
            self.guard.__enter__()

    def __exit__(self, *exc):
        if self.guard is not None:
            self.guard.__exit__(*exc)


# ---- projections for small M (decode): csrc/gemv.cu ---------------------------------------------

LINEAR_ACTIVATIONS = (None, "silu_mul")


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, activation: str | None = None) -> Tensor:
    """y = act(x) @ weight^T (+ bias): a projection, optionally fused with the GatedMLP's SiLU(gate) * up.

    Args:
        x: [M, K], or [M, 2K] with activation="silu_mul" (gate = x[:, :K], up = x[:, K:], the
            fused gate_up projection's output).
        weight: [N, K] (nn.Linear's layout); bias: [N] or None. x, weight and bias share one
            dtype and one device.
        activation: None, or "silu_mul": act = round(silu(gate)) * up rounded to x's dtype,
            exactly as `silu_mul` computes it.

    Returns:
        y [M, N], a new tensor of x's dtype: round(sum_k act[m, k] * W[n, k] + bias[n]) with fp32
        accumulation (on CUDA 16-bit tensors; the order of the fp32 sum is the kernel's own).

    Paths: the hand-written GEMV (csrc/gemv.cu; the activation computed once per block into shared
    memory, the weights streamed once) for CUDA float16/bfloat16 with 1 <= M <=
    kernels.dispatch.gemv_max_rows(device), K a multiple of 8, weight contiguous, x's rows
    contiguous with 16-byte aligned rows and pointers, bias contiguous, and M * K * 4 bytes (the
    activation kept as fp32 in shared memory) within the device's per-block shared memory.
    Otherwise the composition `silu_mul(x)` (when asked) then torch.nn.functional.linear: any M
    (0 included), device and float dtype. No sync and no allocation besides y: capturable by CUDA
    graphs.

    Raises:
        ValueError (naming the argument, before anything runs): x not 2-D, weight not [N, K] with
            x's K, bias not [N], dtypes or devices that differ, an unknown activation, an odd x
            width with silu_mul; and, on the composition path, what `silu_mul` raises for a layout
            its kernel cannot read (CUDA 16-bit with K not a multiple of 8).
    """
    if activation not in LINEAR_ACTIVATIONS:
        raise ValueError(f"activation must be one of {LINEAR_ACTIVATIONS}, got {activation!r}")
    _check_2d("x", x)
    if activation is not None and x.shape[1] % 2:
        raise ValueError(f"x must be [M, 2K] = [gate | up] with activation={activation!r}, got an odd width "
                         f"{x.shape[1]}")
    dim = x.shape[1] // 2 if activation is not None else x.shape[1]
    _check_projection(x, dim, weight, bias)
    if _gemv_kernel_takes(x, dim, weight, bias):
        from .kernels.gemv import PROLOGUE_NONE, PROLOGUE_SILU_MUL, launch_gemv

        y = torch.empty((x.shape[0], weight.shape[0]), dtype=x.dtype, device=x.device)  # [M, N]
        with _device_of(x):
            launch_gemv(PROLOGUE_SILU_MUL if activation else PROLOGUE_NONE, y, x, weight, bias)
        return y
    act = silu_mul(x) if activation is not None else x  # [M, K]
    return torch.nn.functional.linear(act, weight, bias)


def add_rms_norm_linear(x: Tensor, residual: Tensor | None, norm_weight: Tensor, eps: float, weight: Tensor,
                        bias: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The residual add, RMSNorm and the projection that reads it, as one kernel at small M:
    `add_rms_norm(x, norm_weight, eps, residual)` then `linear(h, weight, bias)`.

    Args:
        x: [M, K]; residual: [M, K] or None; norm_weight: [K]; eps: the norm's epsilon;
        weight: [N, K]; bias: [N] or None. One dtype, one device.

    Returns:
        (y [M, N], new_residual [M, K]): new_residual = round(x + residual) (x itself when residual
        is None); h = norm_weight * round(s / sqrt(mean(s^2) + eps)) rounded, as `add_rms_norm`
        computes it from s = new_residual; y = round(h @ weight^T + bias) with fp32 accumulation.

    The residual is consumed: the composition path updates it in place (and returns it), the
    kernel path leaves it untouched and returns a new tensor (every block of the kernel reads the
    whole residual row, so none may overwrite it). Callers must use the returned new_residual and
    not read `residual` afterwards.

    Paths: the GEMV kernel with the add + norm as its prologue under linear's conditions (M <=
    gemv_max_rows, K a multiple of 8 and at most 32768, contiguous 16-byte aligned rows, M * K * 4
    bytes of shared memory available); otherwise the composition, any M, device and float dtype.
    Capturable by CUDA graphs.

    Raises:
        ValueError (naming the argument, before anything runs): x or residual not 2-D, shapes that
            disagree (residual not x's shape, norm_weight not [K], weight not [N, K], bias not
            [N]), dtypes or devices that differ; on the composition path, what `add_rms_norm`
            raises for a layout its kernel cannot read.
    """
    eps = _check_eps(eps)
    if _check_norm_linear(x, residual, norm_weight, weight, bias):
        return _norm_linear_kernel(x, residual, norm_weight, eps, weight, bias)
    h, new_residual = _add_rms_norm_consuming(x, residual, norm_weight, eps)
    return torch.nn.functional.linear(h, weight, bias), new_residual


def _add_rms_norm_consuming(x, residual, norm_weight, eps) -> tuple[Tensor, Tensor]:
    """(h, new_residual) of the composition path: add_rms_norm of x + residual with the sum
    written into residual, or of x alone (new_residual is then x) when residual is None."""
    if residual is None:
        return add_rms_norm(x, norm_weight, eps), x
    return add_rms_norm(x, norm_weight, eps, residual)


def _check_norm_linear(x: Tensor, residual, norm_weight, weight, bias) -> bool:
    """add_rms_norm_linear's checks (ValueError); returns whether its GEMV kernel takes the call."""
    _check_2d("x", x)
    dim = x.shape[1]
    if residual is not None:
        _check_2d("residual", residual)
        if residual.shape != x.shape:
            raise ValueError(f"residual must have x's shape {list(x.shape)}, got {list(residual.shape)}")
        _same("residual", residual, x)
    if not isinstance(norm_weight, Tensor) or norm_weight.shape != (dim,):
        raise ValueError(f"norm_weight must be [K] = [{dim}], got {_describe(norm_weight)}")
    _same("norm_weight", norm_weight, x)
    _check_projection(x, dim, weight, bias)
    return (dim <= MAX_NORM_DIM and _gemv_kernel_takes(x, dim, weight, bias) and norm_weight.is_contiguous()
            and norm_weight.data_ptr() % 16 == 0 and (residual is None or _rows_aligned(residual)))


def _norm_linear_kernel(x, residual, norm_weight, eps, weight, bias, y=None) -> tuple[Tensor, Tensor]:
    """add_rms_norm_linear's kernel path (checked); y: the output [M, N] when already allocated."""
    from .kernels.gemv import PROLOGUE_ADD_RMS_NORM, launch_gemv

    if y is None:
        y = torch.empty((x.shape[0], weight.shape[0]), dtype=x.dtype, device=x.device)  # [M, N]
    new_residual = x if residual is None else torch.empty(x.shape, dtype=x.dtype, device=x.device)  # [M, K]
    with _device_of(x):
        launch_gemv(PROLOGUE_ADD_RMS_NORM, y, x, weight, bias, residual=residual, norm_weight=norm_weight,
                    eps=float(eps), new_residual=None if residual is None else new_residual)
    return y, new_residual


def add_rms_norm_qkv_rope_(x: Tensor, residual: Tensor | None, norm_weight: Tensor, eps: float, weight: Tensor,
                           bias: Tensor | None = None, *, heads: int, kv_heads: int, k_cache: Tensor,
                           v_cache: Tensor, slot_mapping: Tensor, positions: Tensor, cos: Tensor, sin: Tensor,
                           q_weight: Tensor | None = None, k_weight: Tensor | None = None,
                           qk_eps: float = 1e-6) -> tuple[Tensor, Tensor]:
    """An attention layer's input stage: the residual add, RMSNorm and fused qkv projection, the
    optional per-head q/k RMSNorm and the rotary embedding, the new keys and values written into
    the paged cache. Exactly `add_rms_norm_linear(x, residual, norm_weight, eps, weight, bias)`
    followed by `norm_rotary_write_kv_cache_(q, k, v, k_cache, v_cache, slot_mapping, positions,
    cos, sin, q_weight, k_weight, qk_eps)` on the q, k, v column views of its output, bit for bit.

    Args:
        x, residual, norm_weight, eps, weight, bias: as in `add_rms_norm_linear`, with weight
            [(heads + 2 kv_heads) d, K] (the q, k, v projections stacked in that order).
        heads, kv_heads: query and key/value heads; d is k_cache's last dim.
        k_cache, v_cache, slot_mapping, positions, cos, sin, q_weight, k_weight, qk_eps: as in
            `norm_rotary_write_kv_cache_` (qk_eps is its eps).

    Returns:
        (qkv [M, (heads + 2 kv_heads) d], new_residual): qkv's q columns rotated (normalised
        first with q_weight), its k and v columns as projected; new_residual as in
        add_rms_norm_linear (the residual is consumed).

    Paths: add_rms_norm_linear's (its GEMV kernel or the composition) writing qkv, then
    norm_rotary_write_kv_cache_ on qkv's column views: two launches where both kernels run.
    Capturable by CUDA graphs.

    Raises:
        ValueError (naming the argument, before anything runs): what either call raises, heads or
            kv_heads not positive integers, k_cache not 4-D, weight's rows not (heads + 2 kv_heads) d.
    """
    for name, n in (("heads", heads), ("kv_heads", kv_heads)):
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"{name} must be a positive int, got {n!r}")
    if not isinstance(k_cache, Tensor) or k_cache.dim() != 4:
        raise ValueError(f"k_cache must be [num_blocks, block_size, Hkv, d], got {_describe(k_cache)}")
    head_dim = k_cache.shape[3]
    width = (heads + 2 * kv_heads) * head_dim
    if not isinstance(weight, Tensor) or weight.dim() != 2 or weight.shape[0] != width:
        raise ValueError(f"weight must be [(heads + 2 kv_heads) d, K] = [{width}, K] for heads={heads}, "
                         f"kv_heads={kv_heads}, d={head_dim}, got {_describe(weight)}")
    takes = _check_norm_linear(x, residual, norm_weight, weight, bias)
    rows = x.shape[0]
    qkv = torch.empty((rows, width), dtype=x.dtype, device=x.device)  # the output, [M, (H + 2 Hkv) d]
    q, k, v = (t.view(rows, n, head_dim) for t, n in zip(  # [M, H, d], [M, Hkv, d] x 2: column views of qkv
        qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=1), (heads, kv_heads, kv_heads)))
    # The rotary + cache-write step's checks before anything runs: the projection consumes the residual.
    _check_rotary_write_kv(q, k, v, k_cache, v_cache, slot_mapping, positions, cos, sin, q_weight, k_weight)
    if takes:
        _, new_residual = _norm_linear_kernel(x, residual, norm_weight, eps, weight, bias, y=qkv)
    else:  # add_rms_norm_linear's composition, into qkv (torch.addmm / mm: the ops F.linear runs on 2-D input)
        h, new_residual = _add_rms_norm_consuming(x, residual, norm_weight, eps)
        if bias is None:
            torch.mm(h, weight.t(), out=qkv)
        else:
            torch.addmm(bias, h, weight.t(), out=qkv)
    _rotary_write_kv(q, k, v, k_cache, v_cache, slot_mapping, positions, cos, sin, q_weight, k_weight, qk_eps)
    return qkv, new_residual


def _check_projection(x: Tensor, dim: int, weight, bias) -> None:
    """weight [N, dim] and bias [N] or None, in x's dtype and on x's device."""
    if not isinstance(weight, Tensor) or weight.dim() != 2 or weight.shape[1] != dim:
        raise ValueError(f"weight must be [N, K] with K = {dim} (x's), got {_describe(weight)}")
    _same("weight", weight, x)
    if bias is not None:
        if not isinstance(bias, Tensor) or bias.shape != (weight.shape[0],):
            raise ValueError(f"bias must be [N] = [{weight.shape[0]}] or None, got {_describe(bias)}")
        _same("bias", bias, x)


def _rows_aligned(t: Tensor) -> bool:
    """Contiguous last dim, rows of whole 16-byte chunks, 16-byte aligned data pointer."""
    return t.stride(-1) == 1 and (t.shape[0] <= 1 or t.stride(0) % 8 == 0) and t.data_ptr() % 16 == 0


def gemv_max_rows(device: torch.device | str | int | None = None) -> int | None:
    """Rows up to which `linear` / `add_rms_norm_linear` run the GEMV kernel on `device` in this
    process (TILEATTN_GEMV_MAX_ROWS, read at import, else the dispatcher's table for the device's
    arch; 0: F.linear for every call), None for a device that is not CUDA. `device` None: the
    current CUDA device. Raises ValueError for a TILEATTN_GEMV_MAX_ROWS that is not an integer in
    [0, 8]."""
    device = torch.device("cuda") if device is None else torch.device(device)
    if device.type != "cuda":
        return None
    from .kernels import dispatch

    return dispatch.gemv_max_rows(device.index if device.index is not None else torch.cuda.current_device())


def _gemv_kernel_takes(x: Tensor, dim: int, weight: Tensor, bias) -> bool:
    """Whether csrc/gemv.cu runs this (already checked) call: see `linear`."""
    if not _on_kernel(x):
        return False
    from .kernels import dispatch

    rows = x.shape[0]
    if not 1 <= rows <= min(dispatch.gemv_max_rows(x.get_device()), dispatch.GEMV_KERNEL_MAX_ROWS):
        return False
    if dim % 8 or dim == 0 or weight.shape[0] == 0 or weight.shape[0] > 2**31 - 8:  # int row indices
        return False
    if not (weight.is_contiguous() and weight.data_ptr() % 16 == 0 and _rows_aligned(x)):
        return False
    if bias is not None and not bias.is_contiguous():
        return False
    from .kernels.gemv import fits_shared_memory

    return fits_shared_memory(rows, dim, x.get_device())
