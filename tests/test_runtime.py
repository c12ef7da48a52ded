"""The runtime without a GPU: NVRTC compile to cubin, the disk cache, the resource report, errors."""

import pytest
import torch

from tileattn import kernels
from tileattn.check import format_table, run_check
from tileattn.runtime import CompileError, NoGPUError, compile_cuda, device_smem_optin, load_kernel, parse_ptxas_log


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TILEATTN_CACHE", str(tmp_path / "cache"))


def test_compile_vector_add_reports_resources():
    fam = kernels.family("vector_add")
    module = compile_cuda(fam.path, fam.instantiations, "sm_90a")
    assert module.cubin[:4] == b"\x7fELF"
    assert set(module.symbols) == set(fam.instantiations)
    for expr in fam.instantiations:
        res = module.resources[expr]
        assert 0 < res.registers <= 255
        assert res.stack_bytes == 0 and res.spills == 0


def test_cache_round_trip(tmp_path):
    fam = kernels.family("vector_add")
    first = compile_cuda(fam.path, ["vector_add_scalar"], "sm_80")
    second = compile_cuda(fam.path, ["vector_add_scalar"], "sm_80")
    assert not first.from_cache and second.from_cache
    assert first.cubin == second.cubin and first.symbols == second.symbols
    assert first.resources == second.resources
    other_arch = compile_cuda(fam.path, ["vector_add_scalar"], "sm_90a")
    assert not other_arch.from_cache  # the arch is part of the key


def test_source_change_misses_cache(tmp_path):
    src = tmp_path / "k.cu"
    src.write_text('extern "C" __global__ void k(float* a) { a[0] = 1.f; }\n')
    assert not compile_cuda(src, ["k"], "sm_90a").from_cache
    assert compile_cuda(src, ["k"], "sm_90a").from_cache
    src.write_text('extern "C" __global__ void k(float* a) { a[0] = 2.f; }\n')
    assert not compile_cuda(src, ["k"], "sm_90a").from_cache


def test_compile_error_shows_file_and_line(tmp_path):
    src = tmp_path / "broken.cu"
    src.write_text('__global__ void k(float* a) {\n  a[0] = undefined_name;\n}\n')
    with pytest.raises(CompileError) as info:
        compile_cuda(src, ["k"], "sm_90a")
    msg = str(info.value)
    assert "broken.cu(2)" in msg and "undefined_name" in msg


def test_parse_ptxas_log():
    log = (
        "ptxas info    : Compiling entry function '_Z3fooPf' for 'sm_90a'\n"
        "ptxas info    : Function properties for _Z3fooPf\n"
        "ptxas         .     8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads\n"
        "ptxas info    : Used 96 registers, used 1 barriers, 16384 bytes smem, 400 bytes cmem[0]\n"
    )
    res = parse_ptxas_log(log)["_Z3fooPf"]
    assert (res.registers, res.stack_bytes, res.spill_store_bytes, res.spill_load_bytes, res.static_smem_bytes) == (
        96, 8, 4, 12, 16384)
    assert res.spills == 16


def test_unknown_kernel_errors():
    with pytest.raises(kernels.UnknownKernelError, match="unknown kernel family"):
        kernels.family("no_such_family")
    with pytest.raises(kernels.UnknownKernelError, match="not a registered instantiation"):
        kernels.load("vector_add", "vector_add_vec4<3>")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error path")
def test_no_gpu_error():
    fam = kernels.family("vector_add")
    with pytest.raises(NoGPUError, match="torch.cuda.is_available"):
        load_kernel(fam.path, "vector_add_scalar")
    with pytest.raises(NoGPUError, match="torch.cuda.is_available"):
        device_smem_optin(0)


def test_check_table_for_vector_add():
    rows = run_check(["sm_90a"], family_filter="vector_add")
    assert len(rows) == len(kernels.family("vector_add").instantiations)
    assert all(r.ok for r in rows)
    assert "vector_add:vector_add_scalar" in format_table(rows)


def test_check_fails_on_wgmma_serialization_warnings():
    from tileattn.check import _SERIALIZATION, Row

    log = ("ptxas warning : (C7510) Potential Performance Loss: wgmma.mma_async instructions are serialized "
           "due to the presence of Extern calls in the function")
    assert _SERIALIZATION.search(log)
    assert not _SERIALIZATION.search("ptxas info    : Used 168 registers, used 1 barriers, 64 bytes smem")
    clean = Row("f", "k", "sm_90a", registers=168, stack=0, spills=0, static_smem=0, seconds=1.0)
    assert clean.ok
    serialized = Row("f", "k", "sm_90a", registers=168, stack=0, spills=0, static_smem=0, seconds=1.0,
                     serialization=log)
    assert not serialized.ok and "wgmma serialized" in format_table([serialized])


def _fake_kernel(layout):
    """A LoadedKernel stand-in (no GPU): a parameter layout and a null CUfunction."""
    from types import SimpleNamespace

    from cuda.bindings import driver

    return SimpleNamespace(expression="fake_kernel", param_layout=layout, function=driver.CUfunction(),
                           _dynamic_smem_limit=48 * 1024, device_index=0, resources=None)


def test_launch_plan_pdl_config_and_packing_without_a_gpu(monkeypatch):
    """LaunchPlan(pdl=True) packs the same parameter buffer as a plain plan, builds a launch config
    with the programmatic-stream-serialization attribute, and hands cuLaunchKernelEx that config
    (on the current stream) with kernelParams addresses that hold the new dynamic values."""
    import ctypes

    import numpy as np
    from cuda.bindings import driver

    from tileattn.runtime import launcher

    layout = ((0, 8), (8, 8), (16, 4), (24, 8), (32, 4))  # ptr, ptr, int32, int64, float
    kernel = _fake_kernel(layout)
    args = (0x1000, 0x2000, np.int32(7), np.int64(-3), np.float32(0.5))
    plain = launcher.LaunchPlan(kernel, (5, 2), (128,), args, smem=256, dynamic=(0, 1))
    pdl = launcher.LaunchPlan(kernel, (5, 2), (128,), args, smem=256, dynamic=(0, 1), pdl=True)
    assert not plain.pdl and plain._config is None and pdl.pdl
    assert bytes(plain._buffer) == bytes(pdl._buffer), "the PDL plan packed different parameter bytes"
    config = pdl._config
    assert (config.gridDimX, config.gridDimY, config.gridDimZ) == (5, 2, 1)
    assert (config.blockDimX, config.blockDimY, config.blockDimZ) == (128, 1, 1)
    assert config.sharedMemBytes == 256 and config.numAttrs == 1
    attr = config.attrs[0]
    assert attr.id == driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    assert attr.value.programmaticStreamSerializationAllowed == 1

    calls = []
    stream = driver.CUstream(0xABC0)
    monkeypatch.setattr(launcher, "current_stream_handle", lambda index: stream)
    pdl._launch = lambda *a: calls.append(a) or (driver.CUresult.CUDA_SUCCESS,)
    pdl.launch(0x3000, 0x4000)
    (got_config, function, params, extra), = calls
    assert got_config is config and int(config.hStream) == 0xABC0 and function is kernel.function and extra == 0
    addresses = [ctypes.c_uint64.from_address(params + 8 * i).value for i in range(len(layout))]
    read = [ctypes.c_uint64.from_address(addresses[0]).value, ctypes.c_uint64.from_address(addresses[1]).value,
            ctypes.c_int32.from_address(addresses[2]).value, ctypes.c_int64.from_address(addresses[3]).value,
            ctypes.c_float.from_address(addresses[4]).value]
    assert read == [0x3000, 0x4000, 7, -3, 0.5], f"kernelParams point at {read}"

    plain_calls = []
    plain._launch = lambda *a: plain_calls.append(a) or (driver.CUresult.CUDA_SUCCESS,)
    plain.launch(0x3000, 0x4000)
    (call,) = plain_calls
    assert call[1:7] == (5, 2, 1, 128, 1, 1) and call[7] == 256 and call[8] is stream, "plain cuLaunchKernel call"
    assert bytes(plain._buffer) == bytes(pdl._buffer)


def test_pdl_enabled_reads_the_environment_on_every_call(monkeypatch):
    from tileattn.runtime import launcher

    monkeypatch.setattr(launcher, "_has_griddepcontrol", lambda index: True)
    monkeypatch.delenv("TILEATTN_PDL", raising=False)
    assert launcher.pdl_enabled(0)  # on by default
    monkeypatch.setenv("TILEATTN_PDL", "1")
    assert launcher.pdl_enabled(0)
    monkeypatch.setattr(launcher, "_has_griddepcontrol", lambda index: False)
    assert not launcher.pdl_enabled(0)  # pre-Hopper devices: plain launches
    monkeypatch.setattr(launcher, "_has_griddepcontrol", lambda index: True)
    monkeypatch.setenv("TILEATTN_PDL", "0")
    assert not launcher.pdl_enabled(0)


def test_launch_geometry_is_checked_against_cudas_limits_before_the_driver():
    """`launch` and `LaunchPlan` refuse a grid or block CUDA cannot run with a LaunchError naming the
    kernel, instead of the driver's CUDA_ERROR_INVALID_VALUE; a valid one comes back padded to 3-D."""
    from tileattn.launch_limits import MAX_GRID_X, MAX_GRID_YZ
    from tileattn.runtime import LaunchError
    from tileattn.runtime.launcher import _check_geometry

    class Kernel:  # the two attributes _check_geometry reads
        expression = "k<1>"
        _dynamic_smem_limit = 48 * 1024

    assert _check_geometry(Kernel(), (MAX_GRID_X,), (1024,), 0) == ((MAX_GRID_X, 1, 1), (1024, 1, 1))
    assert _check_geometry(Kernel(), (1, MAX_GRID_YZ, MAX_GRID_YZ), (32, 32), 0)[0] == (1, MAX_GRID_YZ, MAX_GRID_YZ)
    for grid, block in (((MAX_GRID_X + 1,), (128,)), ((1, MAX_GRID_YZ + 1), (128,)), ((1, 1, MAX_GRID_YZ + 1), (128,)),
                        ((4,), (1025,)), ((4,), (32, 32, 2))):
        with pytest.raises(LaunchError, match=r"^k<1>: launch geometry .* exceeds CUDA's limits"):
            _check_geometry(Kernel(), grid, block, 0)
    for grid, block in (((0,), (128,)), ((4,), (0,))):
        with pytest.raises(LaunchError, match=r"^k<1>: empty launch geometry"):
            _check_geometry(Kernel(), grid, block, 0)
