"""The dispatcher: which kernel family and tile configuration runs a call.

Decided by the device's arch (`tileattn.runtime.device_arch`: "sm_90a" on Hopper, "sm_80" on an
A100, "sm_86" ...), the dtype, the head dim, causal, and the layout. Each family keeps its tile
tables keyed by arch (`DEFAULTS[arch][(head_dim, causal)]`); an arch without a table of its own
uses the sm_80 one, shrunk to the device's shared memory where a family provides that.

Families, in the order they are considered:
- attention_fwd_sm80 / attention_bwd_sm80: mma.sync + cp.async, every NVIDIA GPU from sm_80 on,
  every supported head dim (32, 64, 96, 128, 256), fp16 and bf16.
"""

from __future__ import annotations

from . import attention_bwd_sm80, attention_fwd_sm80


def needs_contiguous_kv(t) -> bool:
    """Whether K or V must be copied before the forward can read it (row stride too large for the
    forward kernel's 32-bit tile offsets; see attention_fwd_sm80.MAX_KV_ROW_STRIDE)."""
    return t.stride(2) >= attention_fwd_sm80.MAX_KV_ROW_STRIDE


def attention_forward_plan(q, k, v, out, lse, *, causal: bool, scale: float):
    """The LaunchPlan of the forward for these (already validated) tensors on their device:
    launch it with the data pointers of q, k, v, out, lse."""
    return attention_fwd_sm80.forward_plan(q, k, v, out, lse, causal=causal, scale=scale)


def attention_backward_plan(q, k, v, out, lse, dout, dq, dk, dv, *, causal: bool, scale: float,
                            deterministic: bool):
    """The backward plan for these (already validated) tensors: `.launch(q, k, v, out, lse, dout,
    dq, dk, dv)`."""
    return attention_bwd_sm80.backward_plan(q, k, v, out, lse, dout, dq, dk, dv, causal=causal, scale=scale,
                                            deterministic=deterministic)
