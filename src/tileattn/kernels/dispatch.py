"""The dispatcher: which kernel family and tile configuration runs a call.

Decided by the device's arch (`tileattn.runtime.device_arch`: "sm_90a" on Hopper, "sm_80" on an
A100, "sm_86" ...), the dtype, the head dim, causal, and the layout. Each family keeps its tile
tables keyed by arch (`DEFAULTS[arch][(head_dim, causal)]`); an arch without a table of its own
uses the sm_80 one, shrunk to the device's shared memory where a family provides that.

Families, in the order they are considered:
- attention_fwd_sm90 (forward on Hopper: TMA, wgmma, warp specialization) where SM90_FORWARD lists
  the (head dim, causal) pair as measured faster than the sm80 kernel on the H200;
- attention_fwd_sm80 / attention_bwd_sm80: mma.sync + cp.async, every NVIDIA GPU from sm_80 on,
  every supported head dim (32, 64, 96, 128, 256), fp16 and bf16.

A forward plan is an object with `launch(q, k, v, out, lse)`.
"""

from __future__ import annotations

from . import attention_bwd_sm80, attention_fwd_sm80

# (head dim, causal) that the Hopper forward runs on sm_90a, by measurement (bench attention with
# the forced tileattn_sm80 / tileattn_sm90 columns, H200, bf16, B=4 H=32, 2026-12-01 15:25 UTC):
# d=128: 650/687 TFLOP/s non-causal at N=2048/8192 against 382/374 for the sm80 kernel, causal
# 518/682 against 317/388.
SM90_FORWARD = {(128, False), (128, True)}


class _PointerPlan:
    """A forward LaunchPlan whose dynamic parameters are the data pointers of q, k, v, out, lse."""

    __slots__ = ("plan",)

    def __init__(self, plan):
        self.plan = plan

    def launch(self, q, k, v, out, lse) -> None:
        self.plan.launch(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr())


def needs_contiguous_kv(t) -> bool:
    """Whether K or V must be copied before the forward can read it (row stride too large for the
    forward kernel's 32-bit tile offsets; see attention_fwd_sm80.MAX_KV_ROW_STRIDE)."""
    return t.stride(2) >= attention_fwd_sm80.MAX_KV_ROW_STRIDE


def forward_family(arch: str, dtype, head_dim: int, causal: bool) -> str:
    """Name of the kernel family that runs this forward."""
    if arch == "sm_90a" and (head_dim, bool(causal)) in SM90_FORWARD:
        return "attention_fwd_sm90"
    return "attention_fwd_sm80"


def attention_forward_plan(q, k, v, out, lse, *, causal: bool, scale: float):
    """The forward plan for these (already validated) tensors on their device:
    `.launch(q, k, v, out, lse)`."""
    from ..runtime import device_arch

    family = forward_family(device_arch(q.device.index), q.dtype, q.shape[3], causal)
    if family == "attention_fwd_sm90":
        from . import attention_fwd_sm90

        return attention_fwd_sm90.ForwardPlan(q, k, v, out, lse, causal=causal, scale=scale)
    return _PointerPlan(attention_fwd_sm80.forward_plan(q, k, v, out, lse, causal=causal, scale=scale))


def attention_backward_plan(q, k, v, out, lse, dout, dq, dk, dv, *, causal: bool, scale: float,
                            deterministic: bool):
    """The backward plan for these (already validated) tensors: `.launch(q, k, v, out, lse, dout,
    dq, dk, dv)`."""
    return attention_bwd_sm80.backward_plan(q, k, v, out, lse, dout, dq, dk, dv, causal=causal, scale=scale,
                                            deterministic=deterministic)
