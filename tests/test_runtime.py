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
