"""The compiled attention path's module (src/tileattn/runtime/host_launch.cpp) without a GPU: it
compiles with the machine's C++ compiler against torch's headers, imports, and refuses what it must;
a failing compiler becomes a clear error and leaves the Python path in charge. Its launches are
tested on the GPU (tests/gpu/test_host_launch.py)."""

from __future__ import annotations

import ctypes
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import tileattn
from tileattn.runtime import LaunchError, host_launch


@pytest.fixture(scope="module")
def built():
    return host_launch.import_built(host_launch.build())


def test_it_compiles_and_imports(built):
    assert built.record_count() == 0
    assert host_launch.library_path().exists()
    assert host_launch.build() == host_launch.library_path()  # a second build finds the first


def test_calls_it_cannot_hold_get_none(built):
    x = torch.zeros(1, 2, 3, 8, dtype=torch.bfloat16)
    assert built.forward(x, x, x, False, None, 0) is None  # CPU tensors
    assert built.forward(x, x, x, False, 0.5, 1) is None
    assert built.forward(x[0], x[0], x[0], False, None, 0) is None  # rank 3
    assert built.forward(x, x, "v", False, None, 0) is None
    assert built.forward(x, x, x, 1, None, 0) is None  # causal must be a bool


def test_bad_calls_raise(built):
    x = torch.zeros(1, 2, 3, 8, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="6 or 7 arguments"):
        built.forward(x, x, x)
    with pytest.raises(ValueError, match="want must be 0, 1, 2, 3 or 4"):
        built.forward(x, x, x, False, None, 5)
    with pytest.raises(RuntimeError, match="configure the module first"):
        built.register(x, x, x, False, None, None, 0, (0, (1, 1, 1), (1, 1, 1), 0, b"", (), ()), ((), ()), ((), ()), x)
    with pytest.raises(ValueError, match="driver entry points"):
        built.configure(0, 0, len, RuntimeError, {})


def test_the_switch_and_status(monkeypatch):
    monkeypatch.setenv("TILEATTN_HOST_LAUNCH", "0")
    assert host_launch.module() is None and host_launch.wait(0) is None
    assert host_launch.status().startswith("off")


def test_a_failing_compiler_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("TILEATTN_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", "false")  # exits 1 without output
    with pytest.raises(host_launch.HostLaunchBuildError, match="false exited with 1"):
        host_launch.build()
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with pytest.raises(host_launch.HostLaunchBuildError, match="could not run the C\\+\\+ compiler"):
        host_launch.build()
    assert not list(tmp_path.rglob("*.so")), "a failed build left a library behind"


def test_the_library_path_follows_the_source_and_compiler(monkeypatch, tmp_path):
    first = host_launch.library_path()
    monkeypatch.setenv("CXX", "g++")
    assert host_launch.library_path() != first
    copy = tmp_path / "host_launch.cpp"
    copy.write_text(host_launch.SOURCE.read_text() + "\n// changed\n")
    monkeypatch.setattr(host_launch, "SOURCE", copy)
    monkeypatch.delenv("CXX")
    assert host_launch.library_path() != first


# ---- the launch logic, with a stand-in for the driver --------------------------------------------
# configure(..., "cpu") serves CPU tensors (device index -1, a null stream) and calls these ctypes
# functions instead of cuLaunchKernel / cuStreamIsCapturing, so the key, the records, the packed
# parameters, the tensor-map and counter caches and the outputs can be checked without a GPU.
LAUNCH = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, *(ctypes.c_uint,) * 7, ctypes.c_void_p,
                          ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)
CAPTURING = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int))

# A kernel with the Hopper forward's parameter kinds: four 128-byte tensor maps (q, k, v, out),
# lse's pointer, an int32 scalar, the tile-counter pointer.
LAYOUT = ((0, 128), (128, 128), (256, 128), (384, 128), (512, 8), (520, 4), (528, 8))  # (offset, size)
SCALAR = 0x5EED


class FakeDriver:
    def __init__(self):
        self.launches, self.result, self.capturing = [], 0, 0
        self.launch = LAUNCH(self._launch)
        self.capture = CAPTURING(self._capture)
        self.encoded: list[int] = []
        self.counter_calls: list[int] = []
        self._maps = []

    def _launch(self, function, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        value = [params[i] for i in range(len(LAYOUT))]
        self.launches.append({
            "function": function, "grid": (gx, gy, gz), "block": (bx, by, bz), "smem": smem, "stream": stream,
            "maps": [ctypes.string_at(value[i], 128) for i in range(4)],
            "lse": ctypes.c_uint64.from_address(value[4]).value,
            "scalar": ctypes.c_int32.from_address(value[5]).value,
            "counter": ctypes.c_uint64.from_address(value[6]).value,
            "out_first": ctypes.c_float.from_address(
                int.from_bytes(ctypes.string_at(value[3], 8), "little")).value,
        })
        return self.result

    def _capture(self, stream, status):
        status[0] = self.capturing
        return 0

    def encoder(self, tag: int):
        def encode(address: int):
            self.encoded.append(address)
            data = np.zeros(128, dtype=np.uint8)
            data[:8] = np.frombuffer(address.to_bytes(8, "little"), dtype=np.uint8)
            data[8] = tag
            self._maps.append(data)
            return SimpleNamespace(address=int(data.ctypes.data))
        return encode

    def stream_counters(self, device_index: int) -> int:
        self.counter_calls.append(device_index)
        return 0xC0C0


def _configured(built, namespace, own_process=False):
    if torch.cuda.is_available() and not own_process:  # the module's state is per process: keep the real one
        pytest.skip("a GPU is present: tests/gpu/test_host_launch.py runs the module with the real driver, "
                    "which this stand-in configuration would replace for the rest of the process")
    driver = FakeDriver()
    built.configure(ctypes.cast(driver.launch, ctypes.c_void_p).value, ctypes.cast(driver.capture, ctypes.c_void_p).value,
                    driver.stream_counters, LaunchError, namespace, "cpu")
    return driver


def _register(built, driver, q, k, v, entry="entry", causal=False, scale=None):
    buffer = bytearray(536)
    buffer[520:524] = SCALAR.to_bytes(4, "little")
    slots = (*((1, i, i, driver.encoder(i)) for i in range(4)), (0, 4, 4, None), (2, 6, -1, None))
    unread = torch.empty(q.shape[:3], dtype=torch.float32)
    launch = (0xF00D, (3, 2, 1), (384, 1, 1), 4096, bytes(buffer), LAYOUT, slots)
    built.register(q, k, v, causal, scale, entry, -1, launch, (q.shape, q.stride()),
                   (q.shape[:3], (q.shape[1] * q.shape[2], q.shape[2], 1)), unread)
    return unread


@pytest.fixture
def fake(built):
    namespace = {"_plans": {}}
    driver = _configured(built, namespace)
    q, k, v = (torch.randn(2, 4, 16, 8) for _ in range(3))
    unread = _register(built, driver, q, k, v)
    yield SimpleNamespace(module=built, driver=driver, q=q, k=k, v=v, unread=unread, namespace=namespace)
    built.clear()
    built.set_poison(False)


def test_a_registered_call_is_packed_and_launched(fake):
    m, d, q, k, v = fake.module, fake.driver, fake.q, fake.k, fake.v
    out = m.forward(q, k, v, False, None, 0)
    assert out.shape == q.shape and out.stride() == q.stride() and out.dtype == q.dtype
    (launch,) = d.launches
    assert launch["function"] == 0xF00D and launch["grid"] == (3, 2, 1) and launch["block"] == (384, 1, 1)
    assert launch["smem"] == 4096 and launch["stream"] is None
    for i, t in enumerate((q, k, v, out)):
        assert int.from_bytes(launch["maps"][i][:8], "little") == t.data_ptr() and launch["maps"][i][8] == i
    assert launch["lse"] == fake.unread.data_ptr(), "a call without lse writes the record's unread buffer"
    assert launch["scalar"] == SCALAR and launch["counter"] == 0xC0C0 and d.counter_calls == [-1]


def test_lse_and_entry_on_request(fake):
    m, d = fake.module, fake.driver
    out, lse = m.forward(fake.q, fake.k, fake.v, False, None, 1)
    assert lse.shape == fake.q.shape[:3] and lse.dtype == torch.float32
    assert d.launches[-1]["lse"] == lse.data_ptr() != fake.unread.data_ptr()
    out, lse, entry = m.forward(fake.q, fake.k, fake.v, False, None, 2)
    assert entry == "entry"


def test_maps_and_counters_are_cached(fake):
    m, d = fake.module, fake.driver
    outs = [m.forward(fake.q, fake.k, fake.v, False, None, 0) for _ in range(3)]
    for t in (fake.q, fake.k, fake.v):
        assert d.encoded.count(t.data_ptr()) == 1, "q, k, v are encoded once per address"
    assert sorted(set(d.encoded) - {fake.q.data_ptr(), fake.k.data_ptr(), fake.v.data_ptr()}) == sorted(
        {o.data_ptr() for o in outs}), "each new out address is encoded"
    assert d.counter_calls == [-1], "the stream's counter pair is asked for once"
    many = [m.forward(fake.q, fake.k, fake.v, False, None, 0) for _ in range(100)]  # past the 64 kept per slot
    for o, launch in zip(many, d.launches[3:]):
        assert int.from_bytes(launch["maps"][3][:8], "little") == o.data_ptr()


def test_what_it_declines(fake):
    m, d, q, k, v = fake.module, fake.driver, fake.q, fake.k, fake.v
    assert m.forward(q, k, v, True, None, 0) is None  # another key
    assert m.forward(q, k, v, False, 0.5, 0) is None
    assert m.forward(q.transpose(2, 3).contiguous().transpose(2, 3), k, v, False, None, 0) is None  # strides
    shifted = torch.randn(q.numel() + 1)[1:].view(q.shape)  # same shape and strides, off by 4 bytes
    assert m.forward(shifted, k, v, False, None, 0) is None
    d.capturing = 1  # a persistent grid under stream capture
    assert m.forward(q, k, v, False, None, 0) is None
    fake.namespace["_plans"] = {}  # tileattn.api's plan cache replaced
    d.capturing = 0
    assert m.forward(q, k, v, False, None, 0) is None
    assert not d.launches


def test_under_capture_an_unread_lse_is_a_fresh_allocation(built):
    """A call that does not want lse writes the record's buffer, except under stream capture (a
    one-CTA-per-tile record, which capture does not decline): the graph must own what it writes."""
    namespace = {"_plans": {}}
    driver = _configured(built, namespace)
    q, k, v = (torch.randn(2, 4, 16, 8) for _ in range(3))
    unread = torch.empty(q.shape[:3], dtype=torch.float32)
    slots = (*((1, i, i, driver.encoder(i)) for i in range(4)), (0, 4, 4, None))  # no tile counter
    built.register(q, k, v, False, None, "entry", -1, (0xF00D, (3, 2, 1), (384, 1, 1), 0, bytes(536), LAYOUT, slots),
                   (q.shape, q.stride()), (q.shape[:3], unread.stride()), unread)
    try:
        built.forward(q, k, v, False, None, 0)
        assert driver.launches[-1]["lse"] == unread.data_ptr()
        driver.capturing = 1
        assert built.forward(q, k, v, False, None, 0) is not None, "a per-tile grid is served under capture"
        assert driver.launches[-1]["lse"] != unread.data_ptr()
    finally:
        built.clear()


def test_a_driver_error_is_a_launch_error(fake):
    fake.driver.result = 700
    with pytest.raises(LaunchError, match="CUresult 700"):
        fake.module.forward(fake.q, fake.k, fake.v, False, None, 0)


def test_poisoned_outputs_are_nan_at_launch(fake):
    fake.module.set_poison(True)
    fake.module.forward(fake.q, fake.k, fake.v, False, None, 0)
    assert math.isnan(fake.driver.launches[-1]["out_first"])


def test_register_refuses_malformed_slots(fake):
    q = fake.q

    maps = tuple((1, i, i, len) for i in range(4))  # the four 128-byte parameters' slots

    def register(slots, buffer=bytes(536), layout=LAYOUT, out_spec=(q.shape, q.stride())):
        fake.module.register(q, q, q, True, None, "e", -1, (1, (1, 1, 1), (1, 1, 1), 0, buffer, layout, slots),
                             out_spec, (q.shape[:3], (64, 16, 1)), fake.unread)

    # an unknown kind; a backward source (dout) in a forward; a map of the workspace; an offset on a
    # map; a negative offset; a map at an 8-byte parameter; a pointer at a 128-byte one; a pointer
    # at a 4-byte one
    for bad in [(5, 0, 0, None), (0, 4, 5, None), (1, 0, 9, len), (1, 0, 0, len, 16), (0, 4, 4, None, -8),
                (1, 4, 4, len), (0, 0, 0, None), (0, 5, 4, None)]:
        with pytest.raises(ValueError, match="slot 0 is malformed"):
            register((bad, *maps))
    with pytest.raises(ValueError, match="9 tensor-map slots, at most 8"):
        register(tuple((1, i % 4, i % 4, len) for i in range(9)))
    with pytest.raises(ValueError, match="parameter 3 is a 128-byte tensor map without a tensor-map slot"):
        register(maps[:3])
    with pytest.raises(ValueError, match="outside the 16-byte buffer"):
        register(maps, bytes(16))
    with pytest.raises(ValueError, match="param_layout holds"):
        register(maps, layout=(*LAYOUT[:6], (528,)))
    with pytest.raises(ValueError, match="out_spec must be"):
        register(maps, out_spec=(q.shape, q.stride()[:3]))


def test_the_public_op_uses_a_registered_combination(built, monkeypatch):
    """tileattn.api's glue: _offer_to_host registers an entry's plan (here a stand-in with the Hopper
    plan's slots), after which tileattn.attention is served by the module without the Python path."""
    from tileattn import api

    driver = _configured(built, vars(api))
    monkeypatch.setattr(host_launch, "module", lambda: built)
    monkeypatch.setattr(api, "_host_forward", None)
    q, k, v = (torch.randn(1, 2, 32, 8) for _ in range(3))
    buffer = bytearray(536)

    class Plan:
        def host_fields(self):
            return 0xBEEF, -1, (1, 1, 1), (128, 1, 1), 0, bytes(buffer), LAYOUT

    class Forward:
        def host_slots(self):
            return Plan(), (*((1, i, i, driver.encoder(i)) for i in range(4)), (0, 4, 4, None))

    entry = SimpleNamespace(host_offered=False, copy_kv=False, forward=Forward(), unread_lse=None,
                            lse_spec=(q.shape[:3], (64, 32, 1)), out_spec=(q.shape, q.stride()), device=q.device,
                            device_index=-1)
    try:
        api._offer_to_host(q, k, v, False, None, entry)
        assert entry.host_offered and entry.unread_lse is not None and api._host_forward is built.forward
        out = tileattn.attention(q, k, v)
        assert out.shape == q.shape and len(driver.launches) == 1
        out, lse = tileattn.attention(q, k, v, return_lse=True)
        assert driver.launches[-1]["lse"] == lse.data_ptr()
        with pytest.raises(ValueError, match="supports torch.float16"):  # not registered: the Python checks
            tileattn.attention(q, k, v, causal=True)
    finally:
        built.clear()


def test_an_autocast_call_is_served_after_its_cast(built, monkeypatch):
    """Under torch.autocast("cuda", bfloat16) float32 inputs are cast, and the bfloat16 call is offered
    to the compiled path again: a registered bfloat16 combination serves it (one launch, out in
    bfloat16, the cast recorded by autograd); without autocast float32 stays the Python path's error."""
    from tileattn import api

    driver = _configured(built, vars(api))
    monkeypatch.setattr(api, "_host_forward", None)
    q32, k32, v32 = (torch.randn(1, 2, 32, 8) for _ in range(3))
    q, k, v = (t.to(torch.bfloat16) for t in (q32, k32, v32))
    _register(built, driver, q, k, v)
    monkeypatch.setattr(api, "_host_forward", built.forward)
    enabled, dtype = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
    torch.set_autocast_enabled("cuda", True)
    torch.set_autocast_dtype("cuda", torch.bfloat16)
    try:
        out = tileattn.attention(q32.requires_grad_(), k32, v32)
        assert out.dtype == torch.bfloat16 and len(driver.launches) == 1
        q_read = int.from_bytes(driver.launches[-1]["maps"][0][:8], "little")  # q's map holds the address read
        assert q_read != q32.data_ptr() and q_read != 0, "the kernel reads the cast copy"
        assert out.grad_fn is not None
    finally:
        torch.set_autocast_enabled("cuda", enabled)
        torch.set_autocast_dtype("cuda", dtype)
        built.clear()
    with pytest.raises(ValueError, match="supports torch.float16"):
        tileattn.attention(q32, k32, v32)


def test_switched_off_an_entry_is_offered_once(monkeypatch):
    """Off (the default until the path's first GPU run), the Python path asks once per entry and
    registers nothing; while the module builds it asks again on each call."""
    from tileattn import api

    monkeypatch.setattr(api, "_host_forward", None)
    entry = SimpleNamespace(host_offered=False)
    x = torch.zeros(1, 1, 1, 8)
    monkeypatch.setenv("TILEATTN_HOST_LAUNCH", "0")
    api._offer_to_host(x, x, x, False, None, entry)
    assert entry.host_offered and api._host_forward is None
    monkeypatch.setenv("TILEATTN_HOST_LAUNCH", "1")
    monkeypatch.setattr(host_launch, "module", lambda: None)  # still building
    entry.host_offered = False
    api._offer_to_host(x, x, x, False, None, entry)
    assert not entry.host_offered and api._host_forward is None


def test_autograd_through_the_compiled_forward(fake):
    """want 3: out carries a C++ autograd node; with no backward registered its backward calls the
    namespace's _backward_of_saved with dout, the saved q, k, v, out, lse, the key's causal and scale
    and the deterministic flag; lse is not differentiable; a Python error in the backward reaches
    the caller; a malformed result is refused."""
    calls = []

    def backward(dout, q, k, v, out, lse, causal, scale, deterministic):
        calls.append((dout, q, k, v, out, lse, causal, scale, deterministic))
        return dout * 2, torch.ones_like(k), torch.zeros_like(v)

    fake.namespace["_backward_of_saved"] = backward
    q, k, v = (t.clone().requires_grad_() for t in (fake.q, fake.k, fake.v))
    out, lse = fake.module.forward(q, k, v, False, None, 3, True)
    assert out.requires_grad and out.grad_fn is not None and not lse.requires_grad
    assert fake.driver.launches[-1]["lse"] == lse.data_ptr() != fake.unread.data_ptr()
    dout = torch.randn_like(out)
    out.backward(dout)
    ((got_dout, sq, sk, sv, sout, slse, causal, scale, deterministic),) = calls
    assert (causal, scale, deterministic) == (False, None, True) and torch.equal(got_dout, dout)
    assert sq.data_ptr() == q.data_ptr() and sout.data_ptr() == out.data_ptr() and slse.data_ptr() == lse.data_ptr()
    assert torch.equal(q.grad, dout * 2) and torch.equal(k.grad, torch.ones_like(k)) and not v.grad.any()
    out2, _ = fake.module.forward(q, k, v, False, None, 3)
    out2.sum().backward()
    assert calls[-1][8] is False, "deterministic defaults to False"
    _register(fake.module, fake.driver, q, k, v, causal=True, scale=0.25)
    fake.module.forward(q, k, v, True, 0.25, 3)[0].sum().backward()
    assert calls[-1][6:] == (True, 0.25, False), "the key's causal and scale reach the Python backward"
    out5, _ = fake.module.forward(q, k, v, False, None, 3)
    torch.use_deterministic_algorithms(True)
    try:
        out5.sum().backward()
    finally:
        torch.use_deterministic_algorithms(False)
    assert calls[-1][8] is True, "torch.use_deterministic_algorithms(True) at the backward selects the mode"

    def failing(*args):
        raise KeyError("from the backward")

    fake.namespace["_backward_of_saved"] = failing
    out3, _ = fake.module.forward(q, k, v, False, None, 3)
    with pytest.raises(KeyError, match="from the backward"):
        out3.sum().backward()
    fake.namespace["_backward_of_saved"] = lambda *args: (args[0], None, None)
    out4, _ = fake.module.forward(q, k, v, False, None, 3)
    with pytest.raises(RuntimeError, match="must return"):
        out4.sum().backward()


def test_the_node_and_its_edges(fake):
    """want 3 attaches out to a tileattn::AttentionBackward node: its edges lead to exactly the
    inputs that require grad, in order; without grad mode or a requiring input there is no node and
    lse is still fresh; want 4 is the same with out alone (lse fresh only for a node); a second
    backward through a freed graph raises torch's error; an input with a forward-mode tangent, a
    call under a dispatch mode and one inside a torch.func transform are left to the Python path
    (None), and calls after a transform has ended are served again (its thread state outlives it)."""
    import torch.autograd.forward_ad as fwad
    from torch.utils._python_dispatch import TorchDispatchMode

    fake.namespace["_backward_of_saved"] = lambda dout, q, k, v, *rest: (dout * 3, torch.ones_like(k), torch.zeros_like(v))
    q, v = (t.clone().requires_grad_() for t in (fake.q, fake.v))
    k = fake.k.clone()  # only q and v require grad
    out, lse = fake.module.forward(q, k, v, False, None, 3)
    assert "AttentionBackward" in out.grad_fn.name() and out.is_leaf is False
    # out and the node's lse from one allocation: lse after out's bytes, at a 256-byte boundary
    assert out.untyped_storage().data_ptr() == lse.untyped_storage().data_ptr() == out.data_ptr()
    gap = lse.data_ptr() - out.data_ptr()
    assert gap % 256 == 0 and out.numel() * out.element_size() <= gap < out.numel() * out.element_size() + 256
    assert lse.dtype == torch.float32 and lse.stride() == fake.unread.stride() and not lse._is_view()
    assert fake.driver.launches[-1]["lse"] == lse.data_ptr()
    edges = [fn for fn, _ in out.grad_fn.next_functions]
    assert edges[1] is None and edges[0].variable is q and edges[2].variable is v
    dout = torch.randn_like(out)
    out.backward(dout)
    assert torch.equal(q.grad, dout * 3) and k.grad is None and not v.grad.any()
    with pytest.raises(RuntimeError, match="second time"):
        out.backward(dout)
    with torch.no_grad():
        out, lse = fake.module.forward(q, k, v, False, None, 3)
    assert out.grad_fn is None and fake.driver.launches[-1]["lse"] == lse.data_ptr() != fake.unread.data_ptr()
    out, _ = fake.module.forward(fake.q, fake.k, fake.v, False, None, 3)
    assert out.grad_fn is None and not out.requires_grad
    out = fake.module.forward(q, k, v, False, None, 4)
    assert isinstance(out, torch.Tensor) and "AttentionBackward" in out.grad_fn.name()
    assert fake.driver.launches[-1]["lse"] != fake.unread.data_ptr(), "the node saves a fresh lse"
    out = fake.module.forward(fake.q, fake.k, fake.v, False, None, 4)
    assert out.grad_fn is None and fake.driver.launches[-1]["lse"] == fake.unread.data_ptr()
    launches = len(fake.driver.launches)
    with fwad.dual_level():
        assert fake.module.forward(fwad.make_dual(fake.q, torch.ones_like(fake.q)), k, v, False, None, 3) is None
        assert fake.module.forward(fwad.make_dual(fake.q, torch.ones_like(fake.q)), k, v, False, None, 4) is None

    class Passthrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with Passthrough():
        assert fake.module.forward(fake.q, fake.k, fake.v, False, None, 4) is None

    def inside_a_transform(x):
        assert fake.module.forward(fake.q, fake.k, fake.v, False, None, 4) is None
        return x.sum()

    torch.func.grad(inside_a_transform)(torch.ones(2))
    assert len(fake.driver.launches) == launches, "nothing launched for the calls left to the Python path"
    assert isinstance(fake.module.forward(fake.q, fake.k, fake.v, False, None, 4), torch.Tensor)
    assert len(fake.driver.launches) == launches + 1, "served again once the transform has ended"


def test_the_node_catches_in_place_changes_and_holds_no_cycle(fake):
    """The node's saved tensors keep their version counters: changing out (or q) in place before the
    backward is torch's "modified by an inplace operation" error, not a wrong gradient; and the node
    does not keep out alive through a reference cycle (out is saved through tensor_data(), without its grad_fn)."""
    import gc
    import weakref

    fake.namespace["_backward_of_saved"] = lambda dout, q, k, v, *rest: (dout, torch.zeros_like(k), torch.zeros_like(v))
    q, k, v = (t.clone().requires_grad_() for t in (fake.q, fake.k, fake.v))
    out, _ = fake.module.forward(q, k, v, False, None, 3)
    with torch.no_grad():
        out.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()
    out, _ = fake.module.forward(q, k, v, False, None, 3)
    with torch.no_grad():
        q.mul_(2.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()
    out, _ = fake.module.forward(q, k, v, False, None, 3)
    node = weakref.ref(out.grad_fn) if hasattr(out.grad_fn, "__weakref__") else None
    alive = weakref.ref(out)
    gc.disable()  # freed by reference counts alone, not by the cycle collector
    try:
        del out
        assert alive() is None
    finally:
        gc.enable()
    assert node is None or node() is None


def test_a_graph_alive_at_exit_does_not_crash_the_interpreter(built, tmp_path):
    """A process that exits with a record registered and a graph alive exits cleanly: the records
    are never destroyed (a static map's destructor dropped their Python references after the
    interpreter was gone and aborted the process: a CPU run did, and this test does with that map);
    the graph's node holds no Python object."""
    script = tmp_path / "graph_at_exit.py"
    script.write_text(
        "import torch\n"
        "import tests.test_host_launch as t\n"
        "from tileattn.runtime import host_launch\n"
        "built = host_launch.import_built(host_launch.build())\n"
        "driver = t._configured(built, {'_plans': {}}, own_process=True)\n"
        "q, k, v = (torch.randn(2, 4, 16, 8, requires_grad=True) for _ in range(3))\n"
        "t._register(built, driver, q, k, v)\n"
        "out, lse = built.forward(q, k, v, False, None, 3)\n"
        "assert 'AttentionBackward' in out.grad_fn.name()\n"
        "print('ok')\n")
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(root / "src")])}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_a_real_launch_plan_through_the_glue(built, monkeypatch):
    """The sm80 forward's plan shape end to end without a GPU: a LaunchPlan (a stand-in kernel with
    five pointer parameters and packed scalars) behind dispatch._PointerPlan, registered by
    api._offer_to_host from its host_fields / host_slots; the compiled call passes q, k, v, out and
    lse's addresses at the pointer parameters and the plan's packed scalars unchanged."""
    from cuda.bindings import driver as cuda_driver

    from tileattn import api
    from tileattn.kernels import dispatch
    from tileattn.runtime import launcher

    layout = ((0, 8), (8, 8), (16, 8), (24, 8), (32, 8), (40, 8), (48, 4), (52, 4))  # 5 pointers, i64, i32, f32
    kernel = SimpleNamespace(expression="fake_forward", param_layout=layout, function=cuda_driver.CUfunction(0xF1),
                             _dynamic_smem_limit=48 * 1024, device_index=-1, resources=None)
    plan = launcher.LaunchPlan(kernel, (3, 4, 2), (128,), (1, 2, 3, 4, 5, np.int64(-77), np.int32(9),
                                                            np.float32(0.25)), smem=1024, dynamic=range(5))
    seen = []

    def launch(function, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        seen.append((function, (gx, gy, gz), (bx, by, bz), smem,
                     [ctypes.c_uint64.from_address(params[i]).value for i in range(5)],
                     ctypes.c_int64.from_address(params[5]).value, ctypes.c_int32.from_address(params[6]).value,
                     ctypes.c_float.from_address(params[7]).value))
        return 0

    if torch.cuda.is_available():  # as _configured: keep a GPU process's real configuration
        pytest.skip("a GPU is present: tests/gpu/test_host_launch.py runs the real plans")
    callback = LAUNCH(launch)
    capture = CAPTURING(lambda stream, status: 0)
    built.configure(ctypes.cast(callback, ctypes.c_void_p).value, ctypes.cast(capture, ctypes.c_void_p).value,
                    lambda index: 0, LaunchError, vars(api), "cpu")
    monkeypatch.setattr(host_launch, "module", lambda: built)
    monkeypatch.setattr(api, "_host_forward", None)
    q, k, v = (torch.randn(2, 4, 16, 8) for _ in range(3))
    entry = SimpleNamespace(host_offered=False, copy_kv=False, forward=dispatch._PointerPlan(plan), unread_lse=None,
                            lse_spec=(q.shape[:3], (64, 16, 1)), out_spec=(q.shape, q.stride()), device=q.device,
                            device_index=-1)
    try:
        api._offer_to_host(q, k, v, True, 0.5, entry)
        out, lse = tileattn.attention(q, k, v, causal=True, scale=0.5, return_lse=True)
        ((function, grid, block, smem, pointers, i64, i32, f32),) = seen
        assert function == 0xF1 and grid == (3, 4, 2) and block == (128, 1, 1) and smem == 1024
        assert pointers == [t.data_ptr() for t in (q, k, v, out, lse)]
        assert (i64, i32, f32) == (-77, 9, 0.25), "the plan's packed scalars changed"
    finally:
        built.clear()


def _recording(dynamic, record):
    """A LaunchPlan stand-in: its dynamic parameter indices, and launch(*values) recorded."""
    return SimpleNamespace(dynamic=tuple(dynamic), launch=lambda *values: record.append(values))


def _slot_values(slots, sources):
    """The values the module writes for these slots: data pointers plus offsets, 0 for NULL, and for
    tensor maps what the slot's encoder returns for the source's address."""
    from tileattn.runtime import host_launch as hl

    values = []
    for kind, _param, source, encode, *offset in slots:
        if kind == hl.TENSOR_MAP:
            values.append(encode(sources[source]))
        else:
            values.append(0 if source == hl.NULL else sources[source] + (offset[0] if offset else 0))
    return tuple(values)


@pytest.mark.parametrize("persistent", [True, False])
def test_the_hopper_forward_plans_slots_describe_its_launch(persistent, monkeypatch):
    """attention_fwd_sm90.ForwardPlan.host_slots against its own launch (recording LaunchPlan,
    encoders that tag the address, a stand-in tile counter): maps of q, k, v, out, lse's pointer and
    the tile counter, each the value launch passes; a one-CTA-per-tile grid has no counter slot and
    launch passes the packed 0 there. None for a plan that copies an operand or takes a variant
    kernel's per-call values."""
    from tileattn.kernels import attention_fwd_sm90 as af
    from tileattn.runtime import host_launch as hl

    monkeypatch.setattr(af, "_tile_counter", lambda persistent, index: 0xC0C0 if persistent else 0)
    record = []
    plan = object.__new__(af.ForwardPlan)
    plan.copy_q = plan.copy_k = plan.copy_v = plan.copy_out = plan.variant_values = False
    plan.templates = tuple(SimpleNamespace(encode=lambda address, i=i: ("map", i, address)) for i in range(4))
    plan.config, plan.device_index = SimpleNamespace(persistent=persistent), -1
    plan.plan = _recording((0, 1, 2, 3, 4, af.TILE_COUNTER_ARG), record)
    tensors = [torch.randn(2, 4, 16, 8) for _ in range(5)]
    plan.launch(*tensors)
    launch_plan, slots = plan.host_slots()
    assert launch_plan is plan.plan
    (passed,) = record
    by_param = dict(zip(launch_plan.dynamic, passed))
    sources = {i: t.data_ptr() for i, t in enumerate(tensors)}
    assert _slot_values([s for s in slots if s[0] != hl.TILE_COUNTER], sources) == passed[:5]
    if persistent:
        assert slots[-1] == (hl.TILE_COUNTER, af.TILE_COUNTER_ARG, -1, None) and by_param[af.TILE_COUNTER_ARG] == 0xC0C0
    else:
        assert len(slots) == 5 and by_param[af.TILE_COUNTER_ARG] == 0, "the packed 0 stays"
    for flag in ("copy_q", "copy_k", "copy_v", "copy_out", "variant_values"):
        setattr(plan, flag, True)
        assert plan.host_slots() is None, flag
        setattr(plan, flag, False)


# ---- the compiled backward -----------------------------------------------------------------------
# Three stand-in launches shaped as a backward's: "pre" reads out, dout, lse and writes the
# workspace's three parts; "main" takes tensor maps of q and dK, a workspace part and the semaphore
# pointer (0 when the mode has none); "convert" reads the accumulator and writes dq.
PRE, MAIN, CONVERT = 0xA1, 0xA2, 0xA3
DELTA, ACC = 64, 128  # byte offsets into the workspace
# p pointer, f pointer to floats (its first value read too), s pointer to 12 int32 semaphores (read
# too when not null), m map, i int32
BACKWARD_PARAMS = {PRE: "ppppppi", MAIN: "mmps", CONVERT: "pf"}


def _backward_launches(driver):
    from tileattn.runtime import host_launch as hl

    def launch(function, slots):
        kinds = BACKWARD_PARAMS[function]
        layout, at = [], 0
        for kind in kinds:
            size = {"m": 128, "i": 4}.get(kind, 8)
            layout.append((at, size))
            at += size
        buffer = bytearray(at + 4)
        if "i" in kinds:
            at = layout[kinds.index("i")][0]
            buffer[at:at + 4] = SCALAR.to_bytes(4, "little")
        return function, (5, 1, 1), (128, 1, 1), 0, bytes(buffer), tuple(layout), tuple(slots)

    lse2, delta, acc = (hl.WORKSPACE, 0), (hl.WORKSPACE, DELTA), (hl.WORKSPACE, ACC)
    return (launch(PRE, hl.pointer_slots(range(6), (hl.OUT, hl.DOUT, hl.LSE, lse2, delta, acc))),
            launch(MAIN, [(hl.TENSOR_MAP, 0, hl.Q, driver.encoder(10)), (hl.TENSOR_MAP, 1, hl.DK, driver.encoder(11)),
                          *hl.pointer_slots((2, 3), (delta, hl.SEMAPHORES))]),
            launch(CONVERT, hl.pointer_slots(range(2), (acc, hl.DQ))))


class BackwardDriver(FakeDriver):
    """FakeDriver that also reads the stand-in backward launches' parameters by BACKWARD_PARAMS."""

    def _launch(self, function, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        kinds = BACKWARD_PARAMS.get(function)
        if kinds is None:
            return super()._launch(function, gx, gy, gz, bx, by, bz, smem, stream, params, extra)
        values = []
        for i, kind in enumerate(kinds):
            if kind == "m":
                raw = ctypes.string_at(params[i], 128)
                values.append((int.from_bytes(raw[:8], "little"), raw[8]))
            elif kind == "i":
                values.append(ctypes.c_int32.from_address(params[i]).value)
            else:
                pointer = ctypes.c_uint64.from_address(params[i]).value
                if kind == "f":
                    values.append((pointer, ctypes.c_float.from_address(pointer).value))
                elif kind == "s" and pointer:
                    values.append((pointer, ctypes.string_at(pointer, 48)))
                else:
                    values.append(pointer)
        self.launches.append({"function": function, "values": values, "stream": stream})
        return self.result


@pytest.fixture
def fake_backward(built):
    namespace = {"_plans": {}}
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: tests/gpu/test_host_launch.py runs the compiled backward on it")
    driver = BackwardDriver()
    built.configure(ctypes.cast(driver.launch, ctypes.c_void_p).value, ctypes.cast(driver.capture, ctypes.c_void_p).value,
                    driver.stream_counters, LaunchError, namespace, "cpu")
    q, k, v = (torch.randn(2, 4, 16, 8) for _ in range(3))
    _register(built, driver, q, k, v)
    grad_specs = tuple((t.shape, t.stride()) for t in (q, k, v))
    yield SimpleNamespace(module=built, driver=driver, q=q, k=k, v=v, namespace=namespace, grad_specs=grad_specs)
    built.clear()
    built.set_poison(False)


def test_the_backward_runs_its_registered_launches(fake_backward):
    """Op level: after register_backward, backward(...) allocates dq, dk, dv and the workspace and
    launches pre, main, convert in order with out, dout, lse, the workspace's parts, the maps of q
    and dK, a null semaphore pointer (none registered) and dq; the packed scalar survives."""
    f = fake_backward
    m, q, k, v = f.module, f.q, f.k, f.v
    out, lse = m.forward(q, k, v, False, None, 1)
    dout = torch.randn_like(out)
    assert m.backward(q, k, v, out, lse, dout, False, None, False) is None, "nothing registered yet"
    assert m.register_backward(q, k, v, False, None, dout, False, _backward_launches(f.driver), f.grad_specs, 96, 0)
    assert m.backward_record_count() == 1
    del f.driver.launches[:]
    dq, dk, dv = m.backward(q, k, v, out, lse, dout, False, None, False)
    assert [(t.shape, t.stride()) for t in (dq, dk, dv)] == list(f.grad_specs) and dq.dtype == q.dtype
    pre, main, convert = f.driver.launches
    assert [x["function"] for x in (pre, main, convert)] == [PRE, MAIN, CONVERT]
    ws = pre["values"][3]
    assert pre["values"] == [out.data_ptr(), dout.data_ptr(), lse.data_ptr(), ws, ws + DELTA, ws + ACC, SCALAR]
    assert main["values"] == [(q.data_ptr(), 10), (dk.data_ptr(), 11), ws + DELTA, 0]
    assert convert["values"][0] == ws + ACC and convert["values"][1][0] == dq.data_ptr()
    encoded = len(f.driver.encoded)
    dq2, dk2, _ = m.backward(q, k, v, out, lse, dout, False, None, False)
    assert f.driver.encoded[encoded:] == [dk2.data_ptr()], "q's map is encoded once per address, dK's per new one"
    assert f.driver.launches[-2]["values"][1] == (dk2.data_ptr(), 11)
    torch.use_deterministic_algorithms(True)
    try:  # the deterministic mode, whose launches are not registered: the Python path's
        assert m.backward(q, k, v, out, lse, dout, False, None, False) is None
    finally:
        torch.use_deterministic_algorithms(False)


def test_the_gradients_share_one_allocation(fake_backward):
    """dq, dk, dv come from one allocation: plain tensors (no autograd view) over disjoint parts of one
    storage, each at a 256-byte multiple of it, with the registered sizes and strides (GQA's smaller
    dk / dv and a [B, N, H, d] layout included); a grad spec with an empty size or a negative stride
    is refused at registration."""
    f = fake_backward
    m, q, k, v = f.module, f.q, f.k, f.v
    out, lse = m.forward(q, k, v, False, None, 1)
    dout = torch.randn_like(out)
    kv_spec = ((2, 1, 16, 8), (128, 8, 8, 1))  # one kv head, [B, N, H, d] strides
    specs = (f.grad_specs[0], kv_spec, kv_spec)
    assert m.register_backward(q, k, v, False, None, dout, False, _backward_launches(f.driver), specs, 96, 0)
    dq, dk, dv = m.backward(q, k, v, out, lse, dout, False, None, False)
    assert [(tuple(t.shape), t.stride()) for t in (dq, dk, dv)] == [(tuple(s), tuple(st)) for s, st in specs]
    storage = dq.untyped_storage()
    assert all(t.untyped_storage().data_ptr() == storage.data_ptr() and t._base is None for t in (dk, dv))
    offsets = [t.storage_offset() * t.element_size() for t in (dq, dk, dv)]
    assert offsets[0] == 0 and all(o % 256 == 0 for o in offsets)
    assert offsets[1] >= dq.numel() * 4 and offsets[2] >= offsets[1] + dk.numel() * 4  # float32 here: disjoint
    assert storage.nbytes() >= offsets[2] + dv.numel() * 4
    for value, grad in enumerate((dq, dk, dv), start=1):
        grad.fill_(float(value))
    assert (dq == 1).all() and (dk == 2).all() and (dv == 3).all()
    for bad in (((2, 0, 16, 8), (512, 128, 8, 1)), ((2, 4, 16, 8), (512, 128, -8, 1))):
        with pytest.raises(ValueError, match="sizes >= 1 and strides >= 0"):
            m.register_backward(q, k, v, False, None, dout, True, _backward_launches(f.driver), (bad, kv_spec, kv_spec),
                                96, 0)


def test_the_backward_declines_what_it_was_not_registered_for(fake_backward):
    f = fake_backward
    m, q, k, v = f.module, f.q, f.k, f.v
    out, lse = m.forward(q, k, v, False, None, 1)
    dout = torch.randn_like(out)
    assert m.register_backward(q, k, v, False, None, dout, False, _backward_launches(f.driver), f.grad_specs, 96, 0)
    del f.driver.launches[:]
    other_layout = dout.transpose(1, 2).contiguous().transpose(1, 2)
    shifted = torch.randn(dout.numel() + 1)[1:].view(dout.shape)
    assert m.backward(q, k, v, out, lse, other_layout, False, None, False) is None
    assert m.backward(q, k, v, out, lse, shifted, False, None, False) is None  # off by 4 bytes
    assert m.backward(q, k, v, out, lse, dout.double(), False, None, False) is None
    assert m.backward(q, k, v, out, lse, dout, False, None, True) is None  # the deterministic mode: not registered
    assert m.backward(q, k, v, out, lse, dout, True, None, False) is None  # another forward key
    assert m.backward(q, k, v, out.transpose(1, 2).contiguous().transpose(1, 2), lse, dout, False, None, False) is None
    assert m.backward(q, k, v, out, lse.double(), dout, False, None, False) is None
    assert m.backward(q, k, v, out, "lse", dout, False, None, False) is None
    assert not f.driver.launches
    assert not m.register_backward(q, k, v, True, None, dout, False, _backward_launches(f.driver), f.grad_specs, 96, 0)


def test_register_backward_refuses_malformed_descriptions(fake_backward):
    from tileattn.runtime import host_launch as hl

    f = fake_backward
    m, q, k, v = f.module, f.q, f.k, f.v
    launches = _backward_launches(f.driver)

    def register(launches=launches, grad_specs=f.grad_specs, ws=96, sem=0, dout=q):
        return m.register_backward(q, k, v, False, None, dout, False, launches, grad_specs, ws, sem)

    counter = (*launches[2][:6], ((hl.TILE_COUNTER, 0, -1, None),))
    with pytest.raises(ValueError, match="tile-counter slot"):
        register((launches[0], counter))
    with pytest.raises(ValueError, match="1 to 4 launches, got 5"):
        register(launches + launches[:2])
    with pytest.raises(ValueError, match="grad_specs must hold 3"):
        register(grad_specs=f.grad_specs[:2])
    with pytest.raises(ValueError, match=">= 0"):
        register(sem=-1)
    with pytest.raises(ValueError, match="workspace offset 128 past its 128 bytes"):
        register(ws=32)
    with pytest.raises(TypeError, match="rank 4"):
        register(dout=q[0])
    assert m.backward_record_count() == 0


def test_semaphores_and_poison(fake_backward):
    """A deterministic registration with semaphores gets a zeroed int32 buffer per call at the
    SEMAPHORES slot; with poison on, dq is NaN when its kernel launches."""
    f = fake_backward
    m, q, k, v = f.module, f.q, f.k, f.v
    out, lse = m.forward(q, k, v, False, None, 1)
    dout = torch.randn_like(out)
    assert m.register_backward(q, k, v, False, None, dout, True, _backward_launches(f.driver), f.grad_specs, 96, 12)
    m.set_poison(True)
    m.backward(q, k, v, out, lse, dout, False, None, True)
    main, convert = f.driver.launches[-2:]
    semaphores, contents = main["values"][3]
    assert semaphores != 0 and contents == bytes(48)
    assert math.isnan(convert["values"][1][1])


def test_the_autograd_node_runs_registered_backwards(fake_backward):
    """want 3: the node's backward calls the namespace's _backward while this dout layout is not
    registered, and the registered launches afterwards (the stand-in _backward not called)."""
    f = fake_backward
    m = f.module
    calls = []

    def backward(dout, q, k, v, out, lse, causal, scale, deterministic):
        calls.append(dout)
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)

    f.namespace["_backward_of_saved"] = backward
    q, k, v = (t.clone().requires_grad_() for t in (f.q, f.k, f.v))
    out, _ = m.forward(q, k, v, False, None, 3)
    dout = torch.randn_like(out)
    out.backward(dout)
    assert len(calls) == 1 and not f.driver.launches[1:]
    assert m.register_backward(q, k, v, False, None, dout, False, _backward_launches(f.driver), f.grad_specs, 96, 0)
    out, lse = m.forward(q, k, v, False, None, 3)
    q.grad = k.grad = v.grad = None
    out.backward(dout)
    assert len(calls) == 1, "the registered backward did not run"
    assert [x["function"] for x in f.driver.launches[-3:]] == [PRE, MAIN, CONVERT]
    assert f.driver.launches[-3]["values"][:3] == [out.data_ptr(), dout.data_ptr(), lse.data_ptr()]
    assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape


def test_saved_tensors_in_another_layout_take_the_python_backward(fake_backward):
    """A saved-tensor hook that returns q, k, v or out in another layout (as save_on_cpu may): the
    registered launches, planned for the forward's strides, are not run; _backward_of_saved gets the
    tensors as the hook returned them (tileattn.api._backward copies them back into the planned layout)."""
    f = fake_backward
    m = f.module
    calls = []
    f.namespace["_backward_of_saved"] = lambda dout, q, k, v, out, *rest: calls.append((q, out)) or (
        torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v))
    q, k, v = (t.clone().requires_grad_() for t in (f.q, f.k, f.v))
    dout = torch.randn_like(q)
    assert m.register_backward(q, k, v, False, None, dout, False, _backward_launches(f.driver), f.grad_specs, 96, 0)

    def other_layout(t):
        return t.transpose(2, 3).contiguous().transpose(2, 3) if t.dim() == 4 else t

    def lse_only(t):
        return t if t.dim() == 4 else t.transpose(1, 2).contiguous().transpose(1, 2)

    for unpack, what in ((other_layout, "q, k, v, out"), (lse_only, "lse")):
        del f.driver.launches[:]
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, unpack):
            out, _ = m.forward(q, k, v, False, None, 3)
        out.backward(dout)
        assert not any(x["function"] == PRE for x in f.driver.launches), f"registered launches ran ({what})"
    assert len(calls) == 2 and calls[0][0].stride() != q.stride()
    out, _ = m.forward(q, k, v, False, None, 3)  # no hook: the registered launches
    out.backward(dout)
    assert len(calls) == 2 and f.driver.launches[-3]["function"] == PRE


def test_the_node_runs_under_compiled_autograd(fake_backward):
    """The node's saved values are plain (bools, a float), so compiled autograd, which hashes them,
    accepts it; the backward then runs as an opaque call (registered launches or the Python one)."""
    from torch._dynamo import compiled_autograd

    f = fake_backward
    m = f.module
    f.namespace["_backward_of_saved"] = lambda dout, q, k, v, *rest: (torch.zeros_like(q), torch.zeros_like(k),
                                                                       torch.zeros_like(v))
    q, k, v = (t.clone().requires_grad_() for t in (f.q, f.k, f.v))
    out, _ = m.forward(q, k, v, False, None, 3)
    with compiled_autograd._enable(torch.compile(backend="eager")):
        out.sum().backward()
    assert q.grad is not None and not q.grad.any()


def test_the_public_op_registers_and_runs_its_backward(built, monkeypatch):
    """tileattn.api's glue end to end: a forward registered by _offer_to_host, then
    tileattn.attention with grad: the first backward runs the entry's plan in Python and
    _offer_backward_to_host registers its host_launches; the next backward is the module's, with the
    plan's launches; a stride-0 dout (out.sum()) stays on the Python path and is not registered."""
    from tileattn import api
    from tileattn.runtime import host_launch as hl

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: tests/gpu/test_host_launch.py runs the real plans")
    driver = BackwardDriver()
    built.configure(ctypes.cast(driver.launch, ctypes.c_void_p).value, ctypes.cast(driver.capture, ctypes.c_void_p).value,
                    driver.stream_counters, LaunchError, vars(api), "cpu")
    monkeypatch.setattr(host_launch, "module", lambda: built)
    monkeypatch.setattr(host_launch, "loaded", lambda: built)
    monkeypatch.setattr(api, "_host_forward", None)
    q, k, v = (torch.randn(1, 2, 32, 8, requires_grad=True) for _ in range(3))
    python_launches = []

    class Plan:  # the forward's LaunchPlan stand-in
        def host_fields(self):
            return 0xBEEF, -1, (1, 1, 1), (128, 1, 1), 0, bytes(536), LAYOUT

    class Forward:
        def host_slots(self):
            return Plan(), (*((1, i, i, driver.encoder(i)) for i in range(4)), (0, 4, 4, None))

    class Backward:
        def launch(self, *tensors):
            python_launches.append(tensors)

        def host_launches(self):
            return tuple((FixedFields(d[:6]), d[6]) for d in _backward_launches(driver)), 96, 0

    class FixedFields:
        def __init__(self, fields):
            self.fields = fields

        def host_fields(self):
            function, grid, block, smem, buffer, layout = self.fields
            return function, -1, grid, block, smem, buffer, layout

    entry = SimpleNamespace(host_offered=False, copy_kv=False, forward=Forward(), unread_lse=None, host_key=None,
                            host_backward=set(), lse_spec=(q.shape[:3], (64, 32, 1)), out_spec=(q.shape, q.stride()),
                            device=q.device, device_index=-1, grad_specs=tuple((t.shape, t.stride()) for t in (q, k, v)),
                            backward_plan=lambda *args: Backward(),
                            input_strides=(q.stride(), k.stride(), v.stride()))
    monkeypatch.setattr(api, "_current_device", lambda: -1)
    monkeypatch.setattr(api, "_plan_entry", lambda *args: entry)  # the cache lookup of _backward_of_saved
    try:
        api._offer_to_host(q, k, v, False, None, entry)
        assert entry.host_key == (False, None)
        out = tileattn.attention(q, k, v)
        assert "AttentionBackward" in out.grad_fn.name()
        dout = torch.randn_like(out)
        out.backward(dout)
        assert len(python_launches) == 1 and entry.host_backward == {(dout.stride(), False)}
        assert built.backward_record_count() == 1
        out = tileattn.attention(q, k, v)
        out.backward(dout)
        assert len(python_launches) == 1, "the second backward took the Python path"
        assert [x["function"] for x in driver.launches[-3:]] == [PRE, MAIN, CONVERT]
        tileattn.attention(q, k, v).sum().backward()  # dout expanded from a scalar: stride 0
        assert len(python_launches) == 2 and built.backward_record_count() == 1
        assert len(entry.host_backward) == 1, "a dout made contiguous is not registered under its own layout"
        assert hl.pointer_slots((7,), ((hl.WORKSPACE, 64),)) == [(hl.POINTER, 7, hl.WORKSPACE, None, 64)]
    finally:
        built.clear()


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("arch", ["sm80", "sm90"])
def test_the_backward_plans_launches_describe_their_launch(arch, deterministic):
    """Each backward plan's host_launches names, for every dynamic parameter of its three launches
    in launch order, exactly the value its Python `launch` passes: the plan's real launch runs
    against recording LaunchPlans (and, for the Hopper plan, its real _TmaOperands with encoders
    that tag the address), and the slots evaluated on the same tensors and workspace give the same
    values. None where the Python path must run."""
    from tileattn.kernels import attention_bwd_sm80 as b80
    from tileattn.kernels import attention_bwd_sm90 as b90
    from tileattn.runtime import host_launch as hl

    record = []
    if arch == "sm90":
        plan = object.__new__(b90.BackwardPlan)
        operands = object.__new__(b90._TmaOperands)
        operands.view, operands.copy = b90._dense_view, (False,) * 6
        operands.templates = tuple(SimpleNamespace(encode=lambda address, i=i: ("map", i, address)) for i in range(6))
        plan.operands, plan.empty, plan.sem_init, plan.sem_elems = operands, False, None, 12
        plan.pre, plan.main, plan.convert = (_recording(r, record) for r in (range(6), range(10), range(2)))
    else:
        plan = object.__new__(b80.BackwardPlan)
        plan.pre, plan.main, plan.last = (_recording(r, record) for r in (range(6), range(9),
                                                                          range(7 if deterministic else 2)))
    plan.deterministic, plan.variant_values, plan.device = deterministic, False, torch.device("cpu")
    plan.ws_elems, plan._delta_offset, plan._acc_offset = 5000, 1024, 2048
    tensors = [torch.randn(2, 4, 16, 8) for _ in range(9)]  # q, k, v, out, lse, dout, dq, dk, dv
    plan.launch(*tensors[:5], tensors[5], *tensors[6:])
    launches, workspace_elems, semaphore_elems = plan.host_launches()
    assert workspace_elems == 5000 and semaphore_elems == (12 if arch == "sm90" and deterministic else 0)
    assert len(launches) == len(record) == 3
    sources = {i: t.data_ptr() for i, t in enumerate(tensors)}
    sources[hl.WORKSPACE] = record[0][3]  # the workspace's base: lse2, the preprocess's fourth pointer
    if semaphore_elems:
        sources[hl.SEMAPHORES] = record[1][9]
    for (launch_plan, slots), passed in zip(launches, record):
        assert [slot[1] for slot in slots] == list(launch_plan.dynamic), "one slot per dynamic parameter, in order"
        assert _slot_values(slots, sources) == passed
    if arch == "sm90":
        plan.operands.copy = (False,) * 5 + (True,)
        assert plan.host_launches() is None, "a copied dV"
        plan.operands.copy, plan.empty = (False,) * 6, True
        assert plan.host_launches() is None, "no work"
        plan.empty = False
    plan.variant_values = True
    assert plan.host_launches() is None, "a variant kernel's per-call values"


def test_the_background_build_runs_in_a_child_process(monkeypatch, tmp_path):
    """build_in_child: the library built by another Python process into this process's cache, found
    without a second build; a failing compiler is the child's clear error, and nothing is left behind."""
    monkeypatch.setenv("TILEATTN_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", "false")
    with pytest.raises(host_launch.HostLaunchBuildError, match="(?s)build process exited with 1.*false exited with 1"):
        host_launch.build_in_child()
    assert not list(tmp_path.rglob("*.so"))
    monkeypatch.delenv("CXX")
    monkeypatch.setattr(host_launch, "build", lambda: pytest.fail("built in this process"))
    path = host_launch.build_in_child()
    assert path == host_launch.library_path() and path.is_relative_to(tmp_path) and path.exists()
    assert host_launch.build_in_child() == path  # found, not rebuilt
    assert host_launch.import_built(path).record_count() == 0
