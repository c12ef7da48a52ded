"""Shared GPU-test helpers."""

from __future__ import annotations

import contextlib

import pytest
import torch

# The Hopper kernels' tests: wgmma, TMA and setmaxnreg need a compute capability 9.0 GPU.
requires_sm90 = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
    reason="the Hopper (sm_90a) kernels need a compute capability 9.0 GPU (H100/H200): wgmma, TMA, setmaxnreg",
)


@contextlib.contextmanager
def poisoned_allocations():
    """Every tensor made with torch.empty / empty_like / empty_strided inside the block, and every
    output of the compiled path (runtime.host_launch), starts out as NaN (floats) or -1
    (integers): outputs and workspaces that tileattn allocates are poisoned for sure, so an element
    a kernel forgets to write, or a workspace it reads before writing, shows up in the result
    instead of passing on leftover memory."""
    real = {name: getattr(torch, name) for name in ("empty", "empty_like", "empty_strided")}

    def poison(t):
        if t.is_floating_point():
            t.fill_(float("nan"))
        elif t.dtype != torch.bool:
            t.fill_(-1)
        return t

    wrapped = {name: (lambda fn: lambda *a, **kw: poison(fn(*a, **kw)))(fn) for name, fn in real.items()}
    from tileattn.runtime import host_launch

    host_launch.set_poison(True)  # the compiled path allocates in C++: it poisons there
    try:
        with pytest.MonkeyPatch.context() as mp:
            for name, fn in wrapped.items():
                mp.setattr(torch, name, fn)
            yield
    finally:
        host_launch.set_poison(False)
