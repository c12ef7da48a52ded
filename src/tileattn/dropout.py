"""Attention variants shared by the CUDA ops and the reference: the dropout mask and the argument checks.

The dropout mask is a pure function of (seed, offset, batch, head, query, key): the keep bit of
score (b, h, i, j) comes from Philox4x32-7 (Salmon et al., SC'11; seven rounds, as FlashAttention-2's
and PyTorch's flash-attention dropout) with
    key     = (seed mod 2^32, (seed >> 32) + (offset >> 32) mod 2^32)
    counter = (4 * (j >> 5) + ((j >> 1) & 3), i, b * H + h, offset mod 2^32)
and is 16-bit half (j & 1) of output word (j >> 3) & 3, kept iff that value >= drop_threshold(p) =
round(p * 65536) (at least 1; so the kept fraction is 1 - round(p * 65536) / 65536). Kept probabilities are scaled by
1 / (1 - p). The kernels (csrc/common/variants.cuh) draw the same bits in whatever tile order they
run, so the mask does not depend on the tile configuration, the forward/backward pass or the run.
In the packed variable-length op, b is the sequence index and i, j count within the sequence.

`dropout_mask` computes the mask on the host with numpy (uint64 arithmetic: every 32 x 32-bit
product is exact), for tests and the reference.
"""

from __future__ import annotations

import math
import numbers

import numpy as np
import torch

__all__ = ["dropout_mask", "philox4x32_7"]

UNBOUNDED = 1 << 29  # a window edge that never limits (kUnbounded in csrc/common/variants.cuh)
MAX_VARIANT_SEQLEN = 1 << 28  # window arithmetic i + Nk - Nq +- UNBOUNDED stays inside int32
_M0, _M1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
_W0, _W1 = np.uint64(0x9E3779B9), np.uint64(0xBB67AE85)
_LO32 = np.uint64(0xFFFFFFFF)
_U64 = 1 << 64


def philox4x32_7(counter, key):
    """Philox4x32-7 of broadcastable uint64 arrays holding 32-bit values: counter (c0, c1, c2, c3),
    key (k0, k1). Returns the four 32-bit output words as uint64 arrays."""
    c0, c1, c2, c3 = (np.asarray(c, dtype=np.uint64) for c in counter)
    k0, k1 = (np.asarray(k, dtype=np.uint64) for k in key)
    s32 = np.uint64(32)
    for _ in range(7):
        p0, p1 = _M0 * c0, _M1 * c2  # < 2^64: exact
        c0, c1, c2, c3 = (p1 >> s32) ^ c1 ^ k0, p1 & _LO32, (p0 >> s32) ^ c3 ^ k1, p0 & _LO32
        k0, k1 = (k0 + _W0) & _LO32, (k1 + _W1) & _LO32
    return c0, c1, c2, c3


def drop_threshold(p: float) -> int:
    """A score is dropped iff its 16-bit uniform is below this: round(p * 65536), at least 1 for
    p > 0 (so that a dropout call always masks, and the forward's and backward's 1 / (1 - p) go
    together), at most 65535."""
    return min(65535, max(1, round(p * 65536))) if p > 0 else 0


def dropout_mask(seed: int, offset: int, batch: int, heads: int, seqlen_q: int, seqlen_k: int, p: float, *,
                 device=None, batch_start: int = 0) -> torch.Tensor:
    """The keep mask the kernels apply with dropout probability p.

    Args:
        seed, offset: the ints passed to tileattn.attention(..., seed=, offset=) (0 <= x < 2^64).
        batch, heads, seqlen_q, seqlen_k: the mask's shape [B, H, Nq, Nk] (H = query heads).
        p: dropout probability in [0, 1).
        device: where the result goes (computed on the host).
        batch_start: batch index of the first row (a varlen sequence b: batch_start=b, batch=1, with
            its own query / key counts).
    Returns:
        bool [batch, heads, seqlen_q, seqlen_k]: True where the probability is kept (and scaled by
        1 / (1 - p)).
    Raises:
        ValueError: negative sizes, seed/offset outside [0, 2^64), p outside [0, 1), a device that
            is no torch device.
    """
    for name, value in (("seed", seed), ("offset", offset)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not 0 <= value < _U64:
            raise ValueError(f"{name} must be an int in [0, 2^64), got {value!r}")
    for name, value in (("batch", batch), ("heads", heads), ("seqlen_q", seqlen_q), ("seqlen_k", seqlen_k),
                        ("batch_start", batch_start)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
            raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    if isinstance(p, bool) or not isinstance(p, numbers.Real) or not 0.0 <= p < 1.0:
        raise ValueError(f"p must be a number in [0, 1), got {p!r}")
    if device is not None:
        try:
            device = torch.device(device)
        except (RuntimeError, TypeError) as exc:
            raise ValueError(f"device {device!r} is not a torch device: {exc}") from None
    seed, offset = int(seed), int(offset)
    thr = drop_threshold(float(p))
    groups = -(-seqlen_k // 32)
    key = (np.uint64(seed & 0xFFFFFFFF), np.uint64(((seed >> 32) + (offset >> 32)) & 0xFFFFFFFF))
    i = np.arange(seqlen_q, dtype=np.uint64)[:, None, None]           # [Nq, 1, 1]
    c0 = (4 * np.arange(groups, dtype=np.uint64)[None, :, None]
          + np.arange(4, dtype=np.uint64)[None, None, :])              # [1, G, 4]: 4 * group + t
    out = np.empty((batch, heads, seqlen_q, groups * 32), dtype=bool)
    for b in range(batch):
        for h in range(heads):
            bh = np.uint64(((batch_start + b) * heads + h) & 0xFFFFFFFF)
            words = philox4x32_7((c0, i, bh, np.uint64(offset & 0xFFFFFFFF)), key)  # 4 x [Nq, G, 4]
            w = np.stack(words, axis=-1)                                 # [Nq, G, t, word]
            halves = np.stack((w & np.uint64(0xFFFF), w >> np.uint64(16)), axis=-1)  # [Nq, G, t, word, half]
            # key j = 32 G + 8 word + 2 t + half
            out[b, h] = (halves.transpose(0, 1, 3, 2, 4) >= thr).reshape(seqlen_q, groups * 32)
    return torch.from_numpy(out[..., :seqlen_k].copy()).to(device)


# ---------------------------------------------------------------------------------------------
# Argument checks of the variants (tileattn.attention, attention_varlen, tileattn.reference)
# ---------------------------------------------------------------------------------------------
def check_flag(name: str, value) -> bool:
    """A flag argument (causal, return_lse, ...) as a bool: True, False or numpy's bool_, read by value.
    Anything else (the string "false", a number, None) is a ValueError, not read by its truthiness."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise ValueError(f"{name} must be a bool (True or False), got {value!r}")


def check_flags(**flags) -> tuple[bool, ...]:
    """check_flag over each keyword in order: ``causal, lse = check_flags(causal=causal, return_lse=lse)``."""
    return tuple(check_flag(name, value) for name, value in flags.items())


def check_off_variants(softcap, dropout_p, generator, seed, offset) -> None:
    """The plain path's check of variant arguments it read as off by their truthiness: a falsy value of
    the wrong type ("", [], {}) is named rather than taken as off, as are a malformed generator, seed
    or offset that dropout_p = 0 does not use."""
    check_softcap(softcap)
    check_dropout(dropout_p, generator, seed, offset)


def check_window(window, causal: bool) -> tuple[int, int]:
    """(left, right) in keys with UNBOUNDED for -1 / None, causal folded in as right <= 0."""
    if window is None:
        left, right = -1, -1
    else:
        if not isinstance(window, (tuple, list)) or len(window) != 2:
            raise ValueError(f"window must be None or a pair (left, right) of ints >= -1, got {window!r}")
        left, right = window
        for name, value in (("window[0] (left)", left), ("window[1] (right)", right)):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < -1:
                raise ValueError(f"{name} must be an int >= -1 (-1: unbounded), got {value!r}")
        left, right = int(left), int(right)
    if causal:
        right = 0 if right == -1 else min(right, 0)
    return (UNBOUNDED if left == -1 else min(left, UNBOUNDED), UNBOUNDED if right == -1 else min(right, UNBOUNDED))


# The kernels take float32 parameters derived from scale and softcap (scale * log2(e), scale / cap,
# cap * log2(e)): inside this range every one of them is a finite, normal float32.
PARAMETER_RANGE = (1e-12, 1e12)


def check_scale(scale) -> None:
    """None, or a finite number > 0 within PARAMETER_RANGE; ValueError otherwise."""
    if scale is None:
        return
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise ValueError(f"scale must be a positive finite number or None, got {type(scale).__name__}")
    low, high = PARAMETER_RANGE
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be finite and > 0, got {scale}")
    if not low <= scale <= high:
        raise ValueError(f"scale must be finite and > 0 within [{low:g}, {high:g}] (the kernels' float32 "
                         f"parameters), got {scale}")


def check_softcap(softcap) -> float:
    """softcap as a float (0.0: off)."""
    if softcap is None:
        return 0.0
    low, high = PARAMETER_RANGE
    if (isinstance(softcap, bool) or not isinstance(softcap, numbers.Real) or not math.isfinite(softcap) or softcap < 0
            or (softcap != 0 and not low <= softcap <= high)):
        raise ValueError(f"softcap must be None, 0 (off) or a finite number > 0 within [{low:g}, {high:g}], "
                         f"got {softcap!r}")
    return float(softcap)


def check_dropout(dropout_p, generator, seed, offset) -> float:
    """dropout_p as a float; checks the generator / seed / offset arguments (a seed tensor's device is
    checked against q's by check_seed_device)."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real) or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be a number in [0, 1), got {dropout_p!r}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise ValueError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
    if generator is not None and seed is not None:
        raise ValueError("pass either generator or seed (with offset), not both")
    if isinstance(seed, torch.Tensor):
        if seed.dtype != torch.int64 or tuple(seed.shape) != (2,) or seed.stride() != (1,):
            raise ValueError(f"a seed tensor must be int64 of shape [2] ([seed, offset], two's complement of the "
                             f"uint64 values) with stride 1, got {seed.dtype} {list(seed.shape)} strides "
                             f"{seed.stride()}")
        if offset is not None:
            raise ValueError("a seed tensor holds the offset as its second element: pass offset=None")
        return float(dropout_p)
    for name, value in (("seed", seed), ("offset", offset)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Integral)
                                  or not 0 <= value < _U64):
            raise ValueError(f"{name} must be None or an int in [0, 2^64), got {value!r}")
    if offset is not None and seed is None:
        raise ValueError("offset needs a seed")
    return float(dropout_p)


def check_alibi(alibi_slopes, batch: int, heads: int, device, *, dtype_strict: bool) -> int:
    """Batch stride of the slopes (0 for [H], H for [B, H]). `dtype_strict`: the CUDA ops need fp32
    contiguous slopes on q's device; the reference takes any floating dtype."""
    if not isinstance(alibi_slopes, torch.Tensor):
        raise ValueError(f"alibi_slopes must be None or a torch.Tensor, got {type(alibi_slopes).__name__}")
    shape = tuple(alibi_slopes.shape)
    if shape not in ((heads,), (batch, heads)):
        raise ValueError(f"alibi_slopes must have shape [H]={[heads]} or [B, H]={[batch, heads]}, got {list(shape)}")
    if dtype_strict and alibi_slopes.dtype != torch.float32:
        raise ValueError(f"alibi_slopes must be float32, got {alibi_slopes.dtype}")
    if not alibi_slopes.is_floating_point():
        raise ValueError(f"alibi_slopes must have a floating dtype, got {alibi_slopes.dtype}")
    if alibi_slopes.device != device:
        raise ValueError(f"alibi_slopes must be on q's device {device}, got {alibi_slopes.device}")
    if dtype_strict and not alibi_slopes.is_contiguous():
        raise ValueError(f"alibi_slopes must be contiguous, got strides {alibi_slopes.stride()}")
    return heads if len(shape) == 2 else 0


def check_variant_lengths(seqlen_q: int, seqlen_k: int) -> None:
    if max(seqlen_q, seqlen_k) > MAX_VARIANT_SEQLEN:
        raise ValueError(f"window/softcap/alibi_slopes/dropout_p need sequence lengths <= 2^28, got Nq={seqlen_q}, "
                         f"Nk={seqlen_k}")


def check_seed_device(seed, device) -> None:
    """A seed tensor (see check_dropout) must be on q's device: the kernels read it there."""
    if isinstance(seed, torch.Tensor) and seed.device != torch.device(device):
        raise ValueError(f"a seed tensor must be on q's device {device} (the kernels read it when they run), got "
                         f"{seed.device}")


def capturing(device) -> bool:
    """Whether a CUDA device's current stream is capturing a CUDA graph (False for other devices)."""
    device = torch.device(device)
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def wants_device_state(generator, seed, device) -> bool:
    """Whether dropout_state gives the kernels a device state for these arguments: a seed tensor, or no
    seed while `device`'s current stream captures a CUDA graph and the generator (default: the device's)
    is a CUDA one. The plan caches key their entries by it (the kernels' kRngState forms)."""
    if isinstance(seed, torch.Tensor):
        return True
    return seed is None and capturing(device) and (
        generator is None or (isinstance(generator, torch.Generator) and generator.device.type == "cuda"))


def dropout_state(generator, seed, offset, device) -> tuple[int, int, torch.Tensor | None]:
    """What the dropout kernels take for one call on `device` (arguments checked by check_dropout):
    (seed, offset, None) with the values by parameter (given, or drawn on the host by draw_seed), or
    (0, 0, state) with an int64 [2] tensor [seed, offset] on the device that the kernels read when they
    run: a given seed tensor, or, while the current stream captures a CUDA graph and no seed is given, a
    fresh device-side draw from `generator` (default: the device's default CUDA generator), so that
    every replay of the graph draws and applies a new mask, as PyTorch's own dropout does under capture
    (a non-default generator must be registered with the graph: torch.cuda.CUDAGraph.register_generator_state)."""
    if isinstance(seed, torch.Tensor):
        check_seed_device(seed, device)
        return 0, 0, seed
    if wants_device_state(generator, seed, device):
        return 0, 0, device_draw(generator, device)
    return (*draw_seed(generator, seed, offset, device), None)


def device_draw(generator, device) -> torch.Tensor:
    """A uniformly random [seed, offset] (int64 [2], every 64-bit value possible) drawn on `device` by
    PyTorch's Philox from `generator` (None: the device's default one): graph-safe, so a captured draw
    draws anew on each replay."""
    return torch.randint(-(1 << 63), (1 << 63) - 1, (2,), dtype=torch.int64, device=device, generator=generator)


def kernel_values(seed: int, offset: int, state: torch.Tensor | None) -> tuple[int, int, int]:
    """The dropout values of the variant kernels' per-call parameters: seed, offset and the rng_state
    pointer (0: the two values apply; csrc/common/variants.cuh) of a dropout_state."""
    return seed, offset, 0 if state is None else state.data_ptr()


def draw_seed(generator, seed, offset, device) -> tuple[int, int]:
    """(seed, offset) of one dropout call: the given ones (a seed tensor's values, read on the host: the
    reference's way), or drawn from `generator` (default: the default generator of `device`). A CUDA
    generator gives its seed and current Philox offset and advances the offset by 4 (no host sync);
    another generator draws a 64-bit seed.

    Raises NotImplementedError for a draw from a CUDA generator while the current stream is capturing a
    CUDA graph (a seed fixed at capture would give every replay the same mask; dropout_state draws on the
    device there instead)."""
    if isinstance(seed, torch.Tensor):
        return rng_values(seed)
    if seed is not None:
        return int(seed), int(offset or 0)
    if generator is None:
        device = torch.device(device)
        if device.type == "cuda":
            generator = torch.cuda.default_generators[device.index if device.index is not None else 0]
        else:
            generator = torch.default_generator
    if generator.device.type == "cuda":
        if torch.cuda.is_current_stream_capturing():
            raise NotImplementedError(
                "dropout_p > 0 drawing its seed on the host from a CUDA generator inside CUDA graph capture: one "
                "draw would fix the mask of every replay (and the generator's offset cannot be read while "
                "capturing); pass seed= as an int64 CUDA tensor [seed, offset] that the kernels read when they "
                "run, or an int seed (and offset) to capture that one mask on purpose")
        off = generator.get_offset()
        generator.set_offset(off + 4)
        return generator.initial_seed() % _U64, off % _U64
    drawn = torch.randint(-(1 << 63), (1 << 63) - 1, (), dtype=torch.int64, generator=generator)
    return int(drawn) % _U64, 0


# ---------------------------------------------------------------------------------------------
# Dropout on the traced path: the rng state of the dropout custom ops (tileattn::attention_dropout_*
# in api.py, tileattn::attention_varlen_dropout_* in api_varlen.py)
# ---------------------------------------------------------------------------------------------
# The Philox seed and offset travel as an int64 tensor [2] (the uint64 values in two's complement), as
# the rng state of PyTorch's own flash-attention ops does: `rng` is either given (seed/offset ints: a
# constant CPU tensor of the traced graph, the same mask on every call; or the caller's seed tensor on
# q's device, which the kernels read when they run) or None, and then drawn inside the implementation,
# at run time, from the default CUDA generator of q's device (a new mask per call; the generator's
# Philox offset advances by 4 as on the eager path). The forward returns the state it used (a copy of a
# device state) and the backward takes it, so both apply the same mask, also when AOTAutograd splits the
# graph. A draw in the op while the stream captures a CUDA graph is refused (draw_seed): the fake
# implementation promised a CPU state, and a host draw would fix every replay's mask; a seed tensor
# captures fine (the eager path draws such a state itself under capture: dropout_state).
def rng_state(seed: int, offset: int) -> torch.Tensor:
    """[seed, offset] as int64 [2] (two's complement of the uint64 values), on the CPU."""
    return torch.tensor([(x + (1 << 63)) % _U64 - (1 << 63) for x in (int(seed), int(offset))], dtype=torch.int64)


def rng_values(rng: torch.Tensor) -> tuple[int, int]:
    """(seed, offset) as uint64 ints from an rng_state tensor (a device tensor is read back: a sync)."""
    seed, offset = rng.tolist()
    return seed % _U64, offset % _U64


def traced_rng(generator, seed, offset, device) -> torch.Tensor | None:
    """The `rng` argument of a dropout custom op for a traced call (arguments already checked by
    check_dropout): a seed tensor itself, rng_state(seed, offset) when an int seed is given, None (drawn in
    the op) otherwise, and for a `generator` under torch.compile the state drawn from it eagerly
    (drawn_rng_state: a graph break).

    Raises NotImplementedError for a generator under fake tensors without torch.compile (make_fx, export):
    a draw there would become a constant of the graph, the same mask on every call."""
    if isinstance(seed, torch.Tensor):
        check_seed_device(seed, device)
        return seed
    if generator is not None:
        if not torch.compiler.is_compiling():
            raise NotImplementedError("dropout_p with a generator under fake tensors outside torch.compile (make_fx, "
                                      "export): pass seed (and offset), or neither (the default CUDA generator)")
        return drawn_rng_state(generator, device)
    return None if seed is None else rng_state(seed, offset or 0)


@torch.compiler.disable
def drawn_rng_state(generator, device) -> torch.Tensor:
    """rng_state of one draw from `generator` (draw_seed), run eagerly: torch.compile cannot pass a
    torch.Generator into a custom op, so the compiled function breaks its graph here and draws on every
    call, advancing the generator exactly as the eager path does (a new mask per call)."""
    return rng_state(*draw_seed(generator, None, None, device))


def op_state(rng: torch.Tensor | None, device) -> tuple[int, int, torch.Tensor | None]:
    """dropout_state inside a dropout custom op's implementation: a device rng's pointer, a CPU rng's
    values, or, for None, values drawn from the default generator of `device` exactly as the eager path
    draws them on the host (draw_seed)."""
    if rng is None:
        return (*draw_seed(None, None, None, device), None)
    if rng.device.type == "cuda":
        return 0, 0, rng
    return (*rng_values(rng), None)


def used_rng_state(seed: int, offset: int, state: torch.Tensor | None) -> torch.Tensor:
    """The rng state a dropout op's forward returns for its backward: the values on the CPU, or a copy of
    the device state (an op's output may not alias its input)."""
    return rng_state(seed, offset) if state is None else state.clone()


def rng_state_fake(rng: torch.Tensor | None) -> torch.Tensor:
    """The fake (shape-only) rng state a dropout op's fake implementation returns: int64 [2] where
    used_rng_state puts it (rng's device; the CPU for a state drawn in the op)."""
    return torch.empty(2, dtype=torch.int64, device="cpu" if rng is None else rng.device)


def register_dropout_autograd(forward_op, backward_op, num_extra: int) -> None:
    """Autograd of a dropout custom op

        forward_op(q, k, v, *extra, rng, *options) -> (out, lse, rng used)
        backward_op(dout, q, k, v, out, lse, *extra, rng used, *options) -> (dq, dk, dv)

    with `num_extra` tensors in extra (e.g. alibi_slopes; cu_seqlens_q, cu_seqlens_k, alibi_slopes).
    The backward gets the rng state the forward used (so the same mask); lse and the state are not
    differentiable, and the extra tensors and options get no gradient."""

    def setup_context(ctx, inputs, output) -> None:
        out, lse, rng_used = output
        ctx.save_for_backward(*inputs[:3], out, lse, *inputs[3:3 + num_extra], rng_used)
        ctx.options = inputs[4 + num_extra:]
        ctx.mark_non_differentiable(lse, rng_used)

    def backward(ctx, dout, _dlse, _drng):
        dq, dk, dv = backward_op(dout, *ctx.saved_tensors, *ctx.options)
        return (dq, dk, dv) + (None,) * (num_extra + 1 + len(ctx.options))

    forward_op.register_autograd(backward, setup_context=setup_context)
