"""What the eager backwards hand their plans, without a GPU: tileattn.api._backward and
tileattn.api_varlen._backward with stand-in plan entries and a plan that records its launch.

The plans pack the forward's strides and need 16-byte aligned addresses, so the backward must give
them tensors in the layout they were planned for: saved tensors that a saved-tensor hook returned
in another layout (torch.autograd.graph.save_on_cpu hands back contiguous copies) are copied back,
and a dout the kernels cannot read in place (stride 0, or contiguous at a misaligned address, as
the gradient of a slice of a concatenation can be) is copied to fresh storage."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tileattn import api, api_varlen


class RecordingPlan:
    def __init__(self):
        self.calls = []

    def launch(self, *tensors):
        self.calls.append(tensors)


def _dense_entry(q, k, v, out, lse):
    plan = RecordingPlan()
    entry = SimpleNamespace(input_strides=(q.stride(), k.stride(), v.stride()), out_spec=(out.shape, out.stride()),
                            lse_spec=(lse.shape, lse.stride()), grad_specs=tuple((t.shape, t.stride()) for t in (q, k, v)),
                            copy_kv=False, device=q.device, device_index=-1, host_key=None,
                            backward_plan=lambda *args: plan)
    return entry, plan


def _bnhd(*shape):
    """A [B, H, N, d] tensor in [B, N, H, d] storage."""
    b, h, n, d = shape
    return torch.randn(b, n, h, d).to(torch.float16).transpose(1, 2)


def _misaligned(like):
    """A contiguous tensor like `like` two bytes past an aligned address."""
    storage = torch.randn(like.numel() + 1).to(like.dtype)
    return storage[1:].view(like.shape)


def test_dense_saved_tensors_in_another_layout_are_copied_back(monkeypatch):
    monkeypatch.setattr(api, "_current_device", lambda: -1)
    q, k, v, out = (_bnhd(2, 4, 8, 32) for _ in range(4))
    lse = torch.randn(2, 4, 8)
    entry, plan = _dense_entry(q, k, v, out, lse)
    dout = torch.randn_like(out)
    hooked = [t.contiguous() for t in (q, k, v, out)] + [lse.transpose(1, 2).contiguous().transpose(1, 2)]
    assert hooked[0].stride() != q.stride()
    api._backward(entry, dout, *hooked[:3], hooked[3], hooked[4], False)
    (launched,) = plan.calls
    for name, got, want in zip(("q", "k", "v", "out", "lse"), launched[:5], (q, k, v, out, lse)):
        assert got.stride() == want.stride() and torch.equal(got, want), name
    api._backward(entry, dout, q, k, v, out, lse, False)
    assert all(got is want for got, want in zip(plan.calls[1][:5], (q, k, v, out, lse))), "no copy when in layout"


def test_dense_misaligned_contiguous_dout_is_copied_to_aligned_storage(monkeypatch):
    monkeypatch.setattr(api, "_current_device", lambda: -1)
    q = k = v = out = torch.zeros(2, 4, 8, 32, dtype=torch.float16)
    entry, plan = _dense_entry(q, k, v, out, torch.zeros(2, 4, 8))
    dout = _misaligned(out)
    assert dout.is_contiguous() and dout.data_ptr() % 16
    api._backward(entry, dout, q, k, v, out, torch.zeros(2, 4, 8), False)
    launched = plan.calls[0][5]
    assert launched.data_ptr() % 16 == 0 and launched.is_contiguous() and torch.equal(launched, dout)
    expanded = torch.ones(()).to(torch.float16).expand(out.shape)  # the gradient of out.sum()
    api._backward(entry, expanded, q, k, v, out, torch.zeros(2, 4, 8), False)
    assert plan.calls[1][5].stride() == out.stride()


def test_varlen_saved_tensors_and_dout(monkeypatch):
    monkeypatch.setattr(api_varlen, "_current_device", lambda: -1)
    fused = torch.randn(40, 12, 32).to(torch.float16)  # [T, 3H, d]: q, k, v as slices
    q, k, v = fused[:, :4], fused[:, 4:8], fused[:, 8:]
    out, lse = torch.randn(40, 4, 32).to(torch.float16), torch.randn(4, 40)
    plan = RecordingPlan()
    entry = SimpleNamespace(input_strides=(q.stride(), k.stride(), v.stride()), out_strides=out.stride(),
                            copy_kv=False, device_index=-1, backward_plan=lambda *args: plan)
    cu = torch.tensor([0, 15, 40], dtype=torch.int32)
    api_varlen._backward(entry, _misaligned(out), q.contiguous(), k.contiguous(), v.contiguous(), out, lse, cu, cu,
                         False)
    (launched,) = plan.calls
    for name, got, want in zip(("q", "k", "v"), launched[:3], (q, k, v)):
        assert got.stride() == want.stride() and torch.equal(got, want), name
    assert launched[5].data_ptr() % 16 == 0, "the misaligned dout reached the plan"


def test_plan_keys_tell_bools_from_numbers(monkeypatch):
    """True == 1 == 1.0 with one hash: a cached entry of scale=1.0 must not serve scale=True, which
    the checks reject (dense, varlen, variant and paged keys hold each such argument's type)."""
    q = k = v = torch.zeros(1, 1, 8, 32, dtype=torch.float16)
    planned = SimpleNamespace()
    real = api._PlanEntry
    monkeypatch.setattr(api, "_plans", {})
    monkeypatch.setattr(api, "_PlanEntry", lambda *args: planned)
    assert api._plan_entry(q, k, v, False, 1.0) is planned
    monkeypatch.setattr(api, "_PlanEntry", real)
    with pytest.raises(ValueError):  # the real checks run: the scale=1.0 entry did not serve it
        api._plan_entry(q, k, v, False, True)
    assert api._typed_window((True, 0)) != api._typed_window((1, 0))
