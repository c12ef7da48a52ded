"""The compiled forward path's module (src/tileattn/runtime/host_launch.cpp) without a GPU: it
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
    with pytest.raises(ValueError, match="want must be 0, 1, 2 or 3"):
        built.forward(x, x, x, False, None, 4)
    with pytest.raises(RuntimeError, match="configure the module first"):
        built.register(x, x, x, False, None, None, 0, 0, (1, 1, 1), (1, 1, 1), 0, b"", (), (), (), (), (), (), x)
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
OFFSETS = (0, 128, 256, 384, 512, 520, 528)
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
        value = [params[i] for i in range(len(OFFSETS))]
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
    built.register(q, k, v, causal, scale, entry, 0xF00D, -1, (3, 2, 1), (384, 1, 1), 4096, bytes(buffer), OFFSETS,
                   slots, q.shape, q.stride(), q.shape[:3], (q.shape[1] * q.shape[2], q.shape[2], 1), unread)
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
    bad = ((5, 0, 0, None),)
    with pytest.raises(ValueError, match="slot 0 is malformed"):
        fake.module.register(q, q, q, True, None, "e", 1, -1, (1, 1, 1), (1, 1, 1), 0, bytes(536), OFFSETS, bad,
                             q.shape, q.stride(), q.shape[:3], (64, 16, 1), fake.unread)
    nine_maps = tuple((1, i % 4, i % 4, len) for i in range(9))
    with pytest.raises(ValueError, match="9 tensor-map slots, at most 8"):
        fake.module.register(q, q, q, True, None, "e", 1, -1, (1, 1, 1), (1, 1, 1), 0, bytes(536), OFFSETS, nine_maps,
                             q.shape, q.stride(), q.shape[:3], (64, 16, 1), fake.unread)
    with pytest.raises(ValueError, match="outside the"):
        fake.module.register(q, q, q, True, None, "e", 1, -1, (1, 1, 1), (1, 1, 1), 0, bytes(16), OFFSETS, (),
                             q.shape, q.stride(), q.shape[:3], (64, 16, 1), fake.unread)


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
            return 0xBEEF, -1, (1, 1, 1), (128, 1, 1), 0, bytes(buffer), OFFSETS

    class Forward:
        def host_slots(self):
            return Plan(), (*((1, i, i, driver.encoder(i)) for i in range(4)), (0, 4, 4, None))

    entry = SimpleNamespace(host_offered=False, copy_kv=False, forward=Forward(), unread_lse=None,
                            lse_spec=(q.shape[:3], (64, 32, 1)), out_spec=(q.shape, q.stride()), device=q.device)
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
    """want 3: out carries a C++ autograd node whose backward calls the namespace's _backward with
    the entry, dout, the saved q, k, v, out, lse and the deterministic flag; lse is not
    differentiable; a Python error in the backward reaches the caller."""
    calls = []

    def backward(entry, dout, q, k, v, out, lse, deterministic):
        calls.append((entry, dout, q, k, v, out, lse, deterministic))
        return dout * 2, torch.ones_like(k), torch.zeros_like(v)

    fake.namespace["_backward"] = backward
    q, k, v = (t.clone().requires_grad_() for t in (fake.q, fake.k, fake.v))
    out, lse = fake.module.forward(q, k, v, False, None, 3, True)
    assert out.requires_grad and out.grad_fn is not None and not lse.requires_grad
    assert fake.driver.launches[-1]["lse"] == lse.data_ptr() != fake.unread.data_ptr()
    dout = torch.randn_like(out)
    out.backward(dout)
    ((entry, got_dout, sq, sk, sv, sout, slse, deterministic),) = calls
    assert entry == "entry" and deterministic is True and torch.equal(got_dout, dout)
    assert sq.data_ptr() == q.data_ptr() and sout.data_ptr() == out.data_ptr() and slse.data_ptr() == lse.data_ptr()
    assert torch.equal(q.grad, dout * 2) and torch.equal(k.grad, torch.ones_like(k)) and not v.grad.any()
    out2, _ = fake.module.forward(q, k, v, False, None, 3)
    out2.sum().backward()
    assert calls[-1][7] is False, "deterministic defaults to False"

    def failing(*args):
        raise KeyError("from the backward")

    fake.namespace["_backward"] = failing
    out3, _ = fake.module.forward(q, k, v, False, None, 3)
    with pytest.raises(KeyError, match="from the backward"):
        out3.sum().backward()
    fake.namespace["_backward"] = lambda *args: (args[1], None, None)
    out4, _ = fake.module.forward(q, k, v, False, None, 3)
    with pytest.raises(RuntimeError, match="must return"):
        out4.sum().backward()


def test_a_graph_alive_at_exit_does_not_crash_the_interpreter(built, tmp_path):
    """A process that exits with a record registered and a graph alive exits cleanly: the records
    are never destroyed (a static map's destructor dropped their Python references after the
    interpreter was gone and aborted the process: a CPU run did, and this test does with that map),
    and a graph freed during shutdown keeps its entry reference."""
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
        "assert 'AttentionFunction' in out.grad_fn.name()\n"
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
                            lse_spec=(q.shape[:3], (64, 16, 1)), out_spec=(q.shape, q.stride()), device=q.device)
    try:
        api._offer_to_host(q, k, v, True, 0.5, entry)
        out, lse = tileattn.attention(q, k, v, causal=True, scale=0.5, return_lse=True)
        ((function, grid, block, smem, pointers, i64, i32, f32),) = seen
        assert function == 0xF1 and grid == (3, 4, 2) and block == (128, 1, 1) and smem == 1024
        assert pointers == [t.data_ptr() for t in (q, k, v, out, lse)]
        assert (i64, i32, f32) == (-77, 9, 0.25), "the plan's packed scalars changed"
    finally:
        built.clear()


def test_the_hopper_plans_slots():
    """attention_fwd_sm90.ForwardPlan.host_slots: maps of q, k, v, out with their templates' encoders,
    lse's pointer, and the tile counter only on a persistent grid; None for a plan that copies an
    operand or takes a variant kernel's per-call values."""
    from tileattn.kernels import attention_fwd_sm90 as af

    def plan(persistent, **flags):
        p = object.__new__(af.ForwardPlan)
        p.copy_q = p.copy_k = p.copy_v = p.copy_out = p.variant_values = False
        for name, value in flags.items():
            setattr(p, name, value)
        p.templates = tuple(SimpleNamespace(encode=f"encode-{i}") for i in range(4))
        p.config = SimpleNamespace(persistent=persistent)
        p.plan = SimpleNamespace(dynamic=(0, 1, 2, 3, 4, af.TILE_COUNTER_ARG))
        return p

    launch_plan, slots = plan(True).host_slots()
    assert slots == ((1, 0, 0, "encode-0"), (1, 1, 1, "encode-1"), (1, 2, 2, "encode-2"), (1, 3, 3, "encode-3"),
                     (0, 4, 4, None), (2, af.TILE_COUNTER_ARG, -1, None))
    assert plan(False).host_slots()[1] == slots[:5], "a one-CTA-per-tile grid keeps its packed 0 counter"
    for flag in ("copy_q", "copy_k", "copy_v", "copy_out", "variant_values"):
        assert plan(True, **{flag: True}).host_slots() is None, flag
