"""CPU tests of the reduction, transpose and sanitizer labs (no GPU needed).

- the registry: families, instantiations, broken versions marked; every instantiation compiles for
  sm_90a and sm_80 with NVRTC, with no spills and no stack outside the broken ones;
- argument checks (ValueError before any launch) and command-line refusals;
- the pure-Python parts: the transpose cost model, ncu CSV parsing, compute-sanitizer report parsing
  and attribution, verdicts, and the report generator on small synthetic runs;
- the kernels themselves under a CPU model of the CUDA execution model (one std::thread per CUDA
  thread, std::barrier for __syncthreads, a per-warp exchange for shuffles), driven through the
  labs' real host code: the launch geometry, multi-pass loops, one-launch counter and edge tiles
  are exercised on CPU tensors. Skipped when no C++20 compiler is available.
"""

import ctypes
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "src"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from labs import reduction, sanitize, transpose  # noqa: E402
from tileattn.kernels import families  # noqa: E402


# ---- registry and compilation ---------------------------------------------------------------------
def test_registry_lists_the_lab_families():
    fams = families()
    red, tr = fams["reduction"], fams["transpose"]
    assert red.path.exists() and tr.path.exists()
    assert len(red.broken) == 2 * len(reduction.BROKEN_VERSIONS) == 10
    assert all("_bug_" in e for e in red.broken)
    assert not tr.broken
    for key in reduction.CORRECT:  # every version the lab runs is registered, for both ops
        for op in reduction.OPS:
            assert reduction.VERSIONS[key].expr(op) in red.instantiations
    assert set(tr.instantiations) == {f"{v}<{t}>" for v in transpose.VERSIONS for t in ("float", "unsigned short")}


@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
@pytest.mark.parametrize("name", ["reduction", "transpose"])
def test_every_instantiation_compiles_without_spills(name, arch):
    from tileattn.runtime import compile_cuda

    fam = families()[name]
    mod = compile_cuda(fam.path, fam.instantiations, arch)
    for expr in fam.instantiations:
        res = mod.resources[expr]
        if expr in fam.broken:
            continue
        assert res.spills == 0 and res.stack_bytes == 0, f"{expr} on {arch}: {res}"


# ---- argument checks ---------------------------------------------------------------------------------
def test_reduction_argument_checks():
    x = torch.ones(8)
    with pytest.raises(ValueError, match="CUDA tensor"):
        reduction.reduce(x, "sum")
    with pytest.raises(ValueError, match="float32"):
        reduction.reduce(x.double(), "sum")
    with pytest.raises(ValueError, match="contiguous 1-D"):
        reduction.reduce(torch.ones(4, 4), "sum")
    with pytest.raises(ValueError, match="torch.Tensor"):
        reduction.reduce([1.0, 2.0], "sum")
    for bad, msg in ((dict(op="mean"), "op must be"), (dict(version="v9"), "unknown version"),
                     (dict(version="bug_oob_store"), "deliberately broken")):
        with pytest.raises(ValueError, match=msg):
            reduction.check_args(_CudaLike(x), bad.get("op", "sum"), bad.get("version", reduction.DEFAULT_VERSION))
    with pytest.raises(ValueError, match="one element"):
        reduction.check_args(_CudaLike(x), "sum", "v2_sequential", out=torch.empty(2))
    with pytest.raises(ValueError, match="empty"):
        reduction.check_args(_CudaLike(torch.ones(0)), "max", "v2_sequential")
    with pytest.raises(ValueError, match="n <= 65536"):
        reduction.check_args(_CudaLike(torch.ones(70000)), "sum", "bug_final_reads_all", allow_broken=True)


def test_transpose_argument_checks():
    with pytest.raises(ValueError, match="CUDA tensor"):
        transpose.transpose(torch.ones(4, 4))
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        transpose.transpose(torch.ones(4, 4, dtype=torch.float16))
    with pytest.raises(ValueError, match="contiguous 2-D"):
        transpose.transpose(torch.ones(4, 4).t())
    with pytest.raises(ValueError, match="contiguous 2-D"):
        transpose.transpose(torch.ones(4))
    assert transpose.parse_shape("4096x8192") == (4096, 8192)
    for bad in ("4096", "0x5", "ax3", "65536x65536"):
        with pytest.raises(ValueError):
            transpose.parse_shape(bad)


@pytest.mark.parametrize("module,argv", [
    (reduction, ["--versions", "bug_oob_store"]),
    (reduction, ["--versions", "v99"]),
    (transpose, ["--dtypes", "fp16"]),
    (transpose, ["--shapes", "12"]),
    (sanitize, ["--tools", "valgrind"]),
    (sanitize, ["--cases", "nope"]),
])
def test_command_lines_refuse_bad_arguments(module, argv):
    with pytest.raises(SystemExit) as exc:
        module.main(argv)
    assert exc.value.code == 2


@pytest.mark.parametrize("name", ["vector_add", "gemm", "reduction", "transpose", "pipeline"])
def test_labs_without_a_gpu_say_so_in_one_line(name, monkeypatch, capsys):
    """`python -m labs.<name>` on a machine without a GPU: one stderr line naming the lab and status 1
    (run_lab), not a traceback; any other exception still propagates."""
    import importlib

    from labs import run_lab

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    lab = importlib.import_module(f"labs.{name}")
    assert run_lab(lab.main, name, []) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"python -m labs.{name}: ") and "NVIDIA GPU" in err[0], err

    def broken(argv):
        raise RuntimeError("not a missing GPU")

    with pytest.raises(RuntimeError, match="not a missing GPU"):
        run_lab(broken, name, [])


# ---- the transpose cost model and ncu parsing ---------------------------------------------------------------
def test_predicted_counters_match_the_textbook():
    p = {v: transpose.predict_counters(v, "fp32", 64, 128) for v in transpose.VERSIONS}
    assert p["transpose_naive"]["ld_sectors_per_request"] == 4 and p["transpose_naive"]["st_sectors_per_request"] == 32
    assert p["transpose_tiled"]["shared_ld_wavefronts_per_inst"] == 32  # a column of a 32-wide tile: one bank
    assert p["transpose_tiled"]["bank_conflicts_ld"] == 31 * 32 * (64 // 32) * (128 // 32)
    for v in ("transpose_padded", "transpose_vec4"):
        assert p[v]["bank_conflicts_ld"] == p[v]["bank_conflicts_st"] == 0
    assert p["transpose_vec4"]["ld_sectors_per_request"] == 16  # 4 rows x 128 B per warp request
    b = transpose.predict_counters("transpose_padded", "bf16", 64, 64)
    assert b["bank_conflicts_ld"] == 0 and b["ld_sectors_per_request"] == 2
    with pytest.raises(ValueError):
        transpose.predict_counters("transpose_vec4", "fp32", 96, 64)


NCU_CSV = """==PROF== Connected to process 1234 (/usr/bin/python3)
==PROF== Profiling "transpose_naive": 0%....50%....100% - 3 passes
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"
"0","1234","python3","127.0.0.1","void transpose_naive<float>(const float *, float *, int, int)","1","7","(32, 8, 1)","(256, 128, 1)","0","9.0","Command line profiler metrics","l1tex__t_sectors_pipe_lsu_mem_global_op_st.sum","sector","33,554,432"
"0","1234","python3","127.0.0.1","void transpose_naive<float>(const float *, float *, int, int)","1","7","(32, 8, 1)","(256, 128, 1)","0","9.0","Command line profiler metrics","l1tex__t_requests_pipe_lsu_mem_global_op_st.sum","request","1,048,576"
"0","1234","python3","127.0.0.1","void transpose_naive<float>(const float *, float *, int, int)","1","7","(32, 8, 1)","(256, 128, 1)","0","9.0","Command line profiler metrics","l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum","","0"
"1","1234","python3","127.0.0.1","void transpose_tiled<float>(const float *, float *, int, int)","1","7","(32, 8, 1)","(256, 128, 1)","0","9.0","Command line profiler metrics","l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum","","32505856"
"1","1234","python3","127.0.0.1","void transpose_tiled<float>(const float *, float *, int, int)","1","7","(32, 8, 1)","(256, 128, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","ns","120,512.5"
==PROF== Disconnected from process 1234
"""


def test_parse_ncu_csv():
    ks = transpose.parse_ncu_csv(NCU_CSV)
    assert [k["id"] for k in ks] == [0, 1]
    assert "transpose_naive<float>" in ks[0]["kernel"]
    s = transpose.summarize_ncu(ks[0])
    assert s["st_sectors_per_request"] == 32.0 and s["ld_sectors_per_request"] is None
    assert ks[1]["l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum"] == 32505856
    assert ks[1]["gpu__time_duration.sum"] == 120512.5
    assert transpose.parse_ncu_csv("no csv here") == []
    cmd = transpose.ncu_command(["--profile-child"])
    assert cmd[:3] == ["ncu", "--clock-control", "none"] and "regex:^transpose_" in cmd


# ---- compute-sanitizer reports --------------------------------------------------------------------------------
SANITIZER_LOG = """========= COMPUTE-SANITIZER
========= Invalid __global__ write of size 4 bytes
=========     at void reduce_bug_oob_store<SumOp, (int)256>(const float *, float *, long)+0x2d0 in /r/labs/csrc/reduction.cu:262
=========     by thread (0,0,0) in block (3,0,0)
=========     Address 0x7f0000000010 is out of bounds
=========     and is 1 bytes after the nearest allocation at 0x7f0000000000 of size 16 bytes
=========     Saved host backtrace up to driver entry point at kernel launch time
=========         Host Frame: [0x123456] in libcuda.so
=========
========= Error: Race reported between Write access at void reduce_bug_missing_barrier<MaxOp, (int)256>(const float *, float *, long)+0xd0 in reduction.cu:250
=========     and Read access at void reduce_bug_missing_barrier<MaxOp, (int)256>(const float *, float *, long)+0x110 in reduction.cu:250 [1020 hazards]
========= Barrier error detected. Divergent thread(s) in block
=========     at 0x2c8 in /r/reduction.cu:236:void reduce_bug_barrier_in_branch<SumOp, 256>(const float *, float *, long)
=========     by thread (0,0,0) in block (0,0,0)
========= Uninitialized __global__ memory read of size 4 bytes
=========     at _Z26reduce_bug_final_reads_allI5SumOpLi256EEvPKfPfl+0x80
=========     by thread (4,0,0) in block (0,0,0)
========= Uninitialized __global__ memory read of size 4 bytes
=========     at void at::native::reduce_kernel<512, 1>(float *)+0x80
========= Invalid __global__ read of size 16 bytes
=========     at void transpose_vec4<unsigned short>(const unsigned short *, unsigned short *, int, int, int)+0x80 in transpose.cu:130
========= Program hit cudaErrorLaunchFailure (error 719) due to "unspecified launch failure" on CUDA API call to cudaDeviceSynchronize.
========= ERROR SUMMARY: 6 errors
"""


def test_parse_and_attribute_sanitizer_reports():
    reports, summary = sanitize.parse_sanitizer_log(SANITIZER_LOG)
    assert summary["errors"] == 6
    assert len(reports) == 6  # the API note and the summaries are not reports
    oob = reports[0]
    assert oob.kernel == "reduce_bug_oob_store<SumOp,256>" and oob.where == "reduction.cu:262"
    assert oob.first_line == "Invalid __global__ write of size 4 bytes in reduce_bug_oob_store<SumOp,256> at reduction.cu:262"
    assert reports[1].first_line.startswith("Error: Race reported between Write access and Read access (1020 hazards)")
    assert reports[2].kernel == "reduce_bug_barrier_in_branch<SumOp,256>"  # the older "at 0x.. in file:line:kernel" form
    assert reports[3].kernel == "reduce_bug_final_reads_all<?>"  # mangled: attributed by base name
    mine, other = sanitize.attribute(reports, sanitize.all_cases())
    assert set(mine) == {"reduction:bug_oob_store", "reduction:bug_missing_barrier", "reduction:bug_barrier_in_branch",
                         "reduction:bug_final_reads_all", "transpose:transpose_vec4"}
    assert [r.kernel for r in other] == ["at::native::reduce_kernel<512,1>"]


def test_normalize_kernel_names():
    assert sanitize.normalize_kernel("reduce_vec4<SumOp, (int)256, (int)4>") == "reduce_vec4<SumOp,256,4>"
    assert sanitize.normalize_kernel("transpose_naive<unsigned short>") == "transpose_naive<unsignedshort>"
    assert sanitize.normalize_kernel("vector_add_vec4<4>") == "vector_add_vec4<4>"


def test_cases_order_and_quick_selection():
    cases = sanitize.all_cases()
    keys = [c.key for c in cases]
    assert keys[-2:] == ["reduction:bug_barrier_in_branch", "reduction:bug_oob_store"]  # may kill the process: last
    first_broken = next(i for i, c in enumerate(cases) if c.broken)
    assert all(c.broken for c in cases[first_broken:])
    quick = sanitize.select_cases(True)
    assert {c.family for c in quick} == {"reduction"} and sum(1 for c in quick if c.broken) == 5


def test_verdicts():
    case = {c.version: c for c in sanitize.all_cases()}
    tools = list(sanitize.TOOLS) + ["none"]
    clean = {t: {"outcome": "clean", "result_ok": True} for t in tools}
    assert sanitize.verdict(case["v2_sequential"], clean, tools).startswith("clean under")
    flagged = dict(clean, racecheck={"outcome": "CAUGHT"})
    assert sanitize.verdict(case["v2_sequential"], flagged, tools).startswith("PROBLEM")
    assert sanitize.verdict(case["bug_missing_barrier"], flagged, tools).startswith("caught by racecheck, as aimed")
    assert sanitize.verdict(case["bug_uninit_shared"], clean, tools).startswith("none caught it, as expected")
    assert sanitize.verdict(case["bug_barrier_in_branch"], clean, tools).startswith("NONE caught it")
    assert "but not by memcheck" in sanitize.verdict(case["bug_oob_store"], dict(clean, initcheck={"outcome": "CAUGHT"}), tools)


# ---- the report generator -------------------------------------------------------------------------------------
def _write_run(path, records, **env):
    base = {"gpu": "NVIDIA H200", "driver": "580", "torch": "2.11", "nvrtc": "13.0", "date_utc": "2026-11-29", "command": "test"}
    path.write_text(json.dumps({"environment": {**base, **env}, "records": records}))
    return path


def _load_make_report():
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_report", ROOT / "docs" / "labs" / "make_report.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_make_report_from_synthetic_runs(tmp_path):
    pytest.importorskip("matplotlib")
    mr = _load_make_report()
    timing = dict(median_ms=1.0, min_ms=0.9, max_ms=1.2, q1_ms=0.95, q3_ms=1.05, reps=20, peak_extra_bytes=0)
    red = [{"suite": "reduction", "kind": "correctness", "impl": "v2_sequential", "op": "sum", "n": 33, "correct": True, "rel_err": 1e-8},
           {"suite": "reduction", "kind": "correctness", "impl": "v2_sequential", "op": "max", "n": 33, "correct": True, "exact": True},
           {"suite": "reduction", "kind": "bandwidth", "impl": "v6_onepass_b256_u4", "op": "sum", "n": 1 << 30, "tbps": 4.2, "ratio_to_torch": 0.98, **timing},
           {"suite": "reduction", "kind": "bandwidth", "impl": "torch.sum", "op": "sum", "n": 1 << 30, "tbps": 4.3, "ratio_to_torch": 1.0, **timing},
           {"suite": "reduction", "kind": "sweep", "impl": "torch.sum", "op": "sum", "n": 1 << 16, "tbps": 0.1, **timing},
           {"suite": "reduction", "kind": "sweep", "impl": "torch.sum", "op": "sum", "n": 1 << 18, "tbps": 0.4, **timing}]
    tr = [{"suite": "transpose", "kind": "correctness", "impl": "padded", "version": "transpose_padded", "dtype": "fp32", "shapes": ["1x1"], "failed": [], "correct": True},
          {"suite": "transpose", "kind": "bandwidth", "impl": "padded", "dtype": "fp32", "rows": 32768, "cols": 32768, "shape": "32768x32768", "tbps": 3.5, "x_torch": 3.2, "of_copy": 0.86, **timing},
          {"suite": "transpose", "kind": "bandwidth", "impl": "copy", "dtype": "fp32", "rows": 32768, "cols": 32768, "shape": "32768x32768", "tbps": 4.1, "x_torch": 3.7, "of_copy": 1.0, **timing},
          {"suite": "transpose", "kind": "ncu", "impl": "tiled", "version": "transpose_tiled", "dtype": "fp32", "rows": 64, "cols": 128,
           "ld_sectors_per_request": 4.0, "bank_conflicts_ld": 7936, "predicted": transpose.predict_counters("transpose_tiled", "fp32", 64, 128)}]
    sa = [{"suite": "sanitize", "kind": "cell", "impl": "reduction:bug_oob_store", "broken": "x", "tool": "memcheck", "outcome": "CAUGHT", "reports": 1, "first": "Invalid __global__ write"},
          {"suite": "sanitize", "kind": "cell", "impl": "reduction:bug_oob_store", "broken": "x", "tool": "none", "outcome": "clean", "result_ok": False},
          {"suite": "sanitize", "kind": "verdict", "impl": "reduction:bug_oob_store", "verdict": "caught by memcheck, as aimed."}]
    docs = tmp_path / "docs"
    docs.mkdir()
    for name in ("reduction", "transpose", "sanitizer"):
        (docs / f"{name}.md").write_text(f"# {name}\n<!-- BEGIN GENERATED: {name} -->\nold\n<!-- END GENERATED: {name} -->\ntail\n")
    rc = mr.main(["--reduction", str(_write_run(tmp_path / "r.json", red)), "--transpose", str(_write_run(tmp_path / "t.json", tr)),
                  "--sanitize", str(_write_run(tmp_path / "s.json", sa, compute_sanitizer="2025.3", sanitize={"wall_seconds": 99})),
                  "--docs", str(docs)])
    assert rc == 0
    r = (docs / "reduction.md").read_text()
    assert "old" not in r and r.endswith("tail\n") and "0.980x torch.sum" in r and "met" in r and "NVIDIA H200" in r
    t = (docs / "transpose.md").read_text()
    assert "3.20x" in t and "86%" in t and "7936 / 7936" in t
    s = (docs / "sanitizer.md").read_text()
    assert "**CAUGHT**" in s and "**wrong result**" in s and "caught by memcheck" in s
    for png in ("reduction_bandwidth.png", "reduction_sweep.png", "transpose_bandwidth_fp32.png"):
        assert (docs / "img" / png).stat().st_size > 1000
    with pytest.raises(ValueError, match="no '<!-- BEGIN GENERATED: x -->'"):
        mr.replace_block("nothing", "x", "y")


# ---- the kernels under a CPU model of CUDA ----------------------------------------------------------------------
EMU_HEADER = r"""
// CPU model of the CUDA execution model for the lab kernels: one std::thread per CUDA thread,
// blocks one after another (so a function-local `static` is a faithful __shared__), a std::barrier
// per block for __syncthreads and per warp for shuffles; a returning thread drops out of both (as
// an exited thread counts as arrived on sm_70+).
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>
#define __global__
#define __device__
#define __forceinline__ inline
#define __restrict__ __restrict
#define __launch_bounds__(...)
#define __shared__ static
struct dim3 { unsigned x = 1, y = 1, z = 1; };
thread_local dim3 threadIdx, blockIdx;
dim3 blockDim, gridDim;
struct alignas(16) float4 { float x, y, z, w; };
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
inline float __int_as_float(unsigned v) { float f; std::memcpy(&f, &v, 4); return f; }
template <class T> inline T __ldcg(const T* p) { return *p; }
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline unsigned atomicInc(unsigned* p, unsigned bound) {
  unsigned old = __atomic_load_n(p, __ATOMIC_SEQ_CST);
  while (!__atomic_compare_exchange_n(p, &old, old >= bound ? 0u : old + 1u, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {}
  return old;
}
struct EmuWarp { std::unique_ptr<std::barrier<>> bar; float buf[32]; };
thread_local std::barrier<>* emu_block_bar;
thread_local EmuWarp* emu_warp;
thread_local int emu_lane;
std::atomic<int> emu_bad_masks{0};
inline void __syncthreads() { emu_block_bar->arrive_and_wait(); }
inline float __shfl_xor_sync(unsigned mask, float v, int offset) {
  if (mask != 0xffffffffu) emu_bad_masks++;
  emu_warp->buf[emu_lane] = v;
  emu_warp->bar->arrive_and_wait();
  float r = emu_warp->buf[emu_lane ^ offset];
  emu_warp->bar->arrive_and_wait();
  return r;
}
inline void emu_run(dim3 grid, dim3 block, const std::function<void()>& body) {
  gridDim = grid; blockDim = block;
  const int nthreads = block.x * block.y * block.z;
  for (unsigned bz = 0; bz < grid.z; ++bz) for (unsigned by = 0; by < grid.y; ++by) for (unsigned bx = 0; bx < grid.x; ++bx) {
    std::barrier<> block_bar(nthreads);
    std::vector<EmuWarp> warps((nthreads + 31) / 32);
    for (size_t w = 0; w < warps.size(); ++w) warps[w].bar = std::make_unique<std::barrier<>>(std::min(32, nthreads - int(32 * w)));
    std::vector<std::thread> threads;
    threads.reserve(nthreads);
    for (int t = 0; t < nthreads; ++t) {
      threads.emplace_back([&, t] {
        threadIdx = {unsigned(t % block.x), unsigned((t / block.x) % block.y), unsigned(t / (block.x * block.y))};
        blockIdx = {bx, by, bz};
        emu_block_bar = &block_bar; emu_warp = &warps[t / 32]; emu_lane = t % 32;
        body();
        emu_warp->bar->arrive_and_drop();
        block_bar.arrive_and_drop();
      });
    }
    for (auto& th : threads) th.join();
  }
}
template <class... P, size_t... I>
void emu_call_impl(void (*f)(P...), void** a, std::index_sequence<I...>) { f(*reinterpret_cast<std::remove_reference_t<P>*>(a[I])...); }
template <class... P>
void emu_call(void (*f)(P...), void** a) { emu_call_impl(f, a, std::index_sequence_for<P...>{}); }
"""


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    cxx = shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no C++ compiler for the CPU model of the kernels")
    d = tmp_path_factory.mktemp("emu")
    (d / "cuda" / "std").mkdir(parents=True)
    (d / "cuda" / "std" / "cstdint").write_text("#include <cstdint>\n")
    (d / "emu.h").write_text(EMU_HEADER)
    exprs = [e for name in ("reduction", "transpose") for e in families()[name].instantiations if e not in families()[name].broken]
    regs = "\n".join(f'  t["{e}"] = [](void** a) {{ emu_call(&{e}, a); }};' for e in exprs)
    (d / "driver.cpp").write_text(
        '#include "emu.h"\n'
        f'#include "{ROOT / "labs" / "csrc" / "reduction.cu"}"\n'
        f'#include "{ROOT / "labs" / "csrc" / "transpose.cu"}"\n'
        "static std::map<std::string, std::function<void(void**)>>& table() {\n"
        "  static std::map<std::string, std::function<void(void**)>> t;\n"
        f"  if (t.empty()) {{\n{regs}\n  }}\n  return t;\n}}\n"
        'extern "C" int emu_launch(const char* name, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz, void** a) {\n'
        "  auto it = table().find(name);\n  if (it == table().end()) return -1;\n"
        "  emu_run({gx, gy, gz}, {bx, by, bz}, [&] { it->second(a); });\n  return 0;\n}\n"
        'extern "C" int emu_bad_mask_count() { return emu_bad_masks.load(); }\n')
    so = d / "emu.so"
    proc = subprocess.run([cxx, "-std=c++20", "-O1", "-shared", "-fPIC", "-pthread", "-Wno-unknown-pragmas", f"-I{d}",
                           str(d / "driver.cpp"), "-o", str(so)], capture_output=True, text=True)
    if proc.returncode != 0:
        if "barrier" in proc.stderr and "No such file" in proc.stderr:
            pytest.skip(f"{cxx} has no C++20 <barrier>")
        raise AssertionError(f"the CPU model does not compile:\n{proc.stderr[-4000:]}")
    lib = ctypes.CDLL(str(so))
    lib.emu_launch.argtypes = [ctypes.c_char_p] + [ctypes.c_uint] * 6 + [ctypes.POINTER(ctypes.c_void_p)]
    return lib


class _EmuKernel:
    def __init__(self, expr):
        self.expression = expr


def _emu_launch(lib):
    def launch(kernel, grid, block, args, smem=0):
        grid = tuple(grid) + (1,) * (3 - len(grid))
        block = tuple(block) + (1,) * (3 - len(block))
        boxes = []
        for a in args:
            if isinstance(a, np.int64):
                boxes.append(ctypes.c_int64(int(a)))
            elif isinstance(a, np.int32):
                boxes.append(ctypes.c_int32(int(a)))
            elif isinstance(a, int):
                boxes.append(ctypes.c_void_p(a))
            else:
                raise TypeError(f"unexpected kernel argument {a!r}")
        arr = (ctypes.c_void_p * len(boxes))(*[ctypes.cast(ctypes.pointer(b), ctypes.c_void_p) for b in boxes])
        assert lib.emu_launch(kernel.expression.encode(), *grid, *block, arr) == 0, kernel.expression
    return launch


@pytest.fixture
def emu_reduction(emulator, monkeypatch):
    counter = torch.zeros(1, dtype=torch.int32)
    monkeypatch.setattr(reduction, "launch", _emu_launch(emulator))
    monkeypatch.setattr(reduction, "_kernel", _EmuKernel)
    monkeypatch.setattr(reduction, "require_gpu", lambda: 0)
    monkeypatch.setattr(reduction, "_one_wave", lambda expr, block, dev: 3)  # small: several blocks, grid-stride loops
    monkeypatch.setattr(reduction, "_counter", lambda device: counter)
    orig = reduction.check_args
    # CPU tensors stand in for CUDA ones; everything else is checked as usual.
    monkeypatch.setattr(reduction, "check_args", lambda x, op, version, allow_broken=False, out=None: orig(
        _CudaLike(x), op, version, allow_broken, None))
    return counter


class _CudaLike:
    """A CPU tensor that passes the `is_cuda` check (the rest of its interface is the tensor's)."""

    def __init__(self, t):
        self._t = t

    def __getattr__(self, name):
        return True if name == "is_cuda" else getattr(self._t, name)



@pytest.fixture(autouse=True)
def _tensor_check(monkeypatch):
    # check_args tests isinstance(x, torch.Tensor); let the stand-in pass it.
    real = isinstance

    def patched(obj, cls):
        if cls is torch.Tensor and type(obj) is _CudaLike:
            return True
        return real(obj, cls)
    monkeypatch.setattr(reduction, "isinstance", patched, raising=False)
    monkeypatch.setattr(transpose, "isinstance", patched, raising=False)


@pytest.mark.parametrize("op", ["sum", "max"])
def test_reduction_kernels_on_the_cpu_model(emu_reduction, op):
    gen = torch.Generator().manual_seed(1234)
    for version in reduction.CORRECT:
        for n in (1, 33, 1003, 5000):  # single block, partial blocks, several blocks / passes
            x = torch.rand(n, generator=gen) * 2 - 0.5
            if op == "max" and n == 33:
                x = -1 - x  # all negative: the identity must be -inf, not 0
            got = reduction.reduce(x, op, version, out=torch.full((1,), float("nan")))
            rec = reduction.check_result(x, op, got)
            assert rec["correct"], f"{version} {op} n={n}: {rec}"
        assert int(emu_reduction.item()) == 0, f"{version} left the one-launch counter at {int(emu_reduction.item())}"


def test_reduction_misaligned_views_on_the_cpu_model(emu_reduction):
    base = torch.rand(3000, generator=torch.Generator().manual_seed(7))
    for version in ("v5_vec4_b256_u4", "v6_onepass_b256_u2"):
        for offset in (1, 2, 3):
            for n in (1, 3, 7, 2990):
                x = base[offset:offset + n]
                rec = reduction.check_result(x, "sum", reduction.reduce(x, "sum", version))
                assert rec["correct"], f"{version} offset={offset} n={n}: {rec}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_transpose_kernels_on_the_cpu_model(emulator, monkeypatch, dtype):
    monkeypatch.setattr(transpose, "launch", _emu_launch(emulator))
    monkeypatch.setattr(transpose, "load_kernel", lambda path, expr, compile_options=None: _EmuKernel(expr))
    monkeypatch.setattr(transpose, "require_gpu", lambda: 0)
    orig = transpose.check_args
    monkeypatch.setattr(transpose, "check_args", lambda x, version, out=None: orig(_CudaLike(x), version, None))
    gen = torch.Generator().manual_seed(99)
    for version in transpose.VERSIONS:
        # edge tiles, one full 64x64 tile, and full tiles with edges (the vec4 path and its fallback)
        for rows, cols in ((1, 37), (37, 1), (31, 33), (64, 64), (65, 127), (128, 192)):
            x = torch.randn(rows, cols, generator=gen).to(dtype)
            out = torch.full((cols, rows), float("nan"), dtype=dtype)
            transpose.transpose(x, version, out)
            assert torch.equal(out, x.t()), f"{version} {dtype} {rows}x{cols}"
    assert emulator.emu_bad_mask_count() == 0


FAKE_SANITIZER = r'''#!/usr/bin/env python3
# Stands in for compute-sanitizer: case 1 runs and gets one report, case 2 hangs; a rerun finishes.
import json, sys, time
argv = sys.argv[1:]
log = argv[argv.index("--log-file") + 1]
progress = argv[argv.index("--progress") + 1]
cases = argv[argv.index("--cases") + 1].split(",")
def note(**e):
    with open(progress, "a") as f:
        f.write(json.dumps(e) + "\n")
with open(log, "w") as f:
    f.write("========= COMPUTE-SANITIZER\n")
    if len(cases) == 3:
        f.write("========= Invalid __global__ write of size 4 bytes\n"
                "=========     at void reduce_bug_oob_store<SumOp, (int)256>(const float *, float *, long)+0x10 in reduction.cu:9\n")
    f.write("========= ERROR SUMMARY: 1 error\n")
for i, c in enumerate(cases):
    note(case=c, event="start")
    if len(cases) == 3 and i == 1:
        time.sleep(60)
    note(case=c, event="done", ok=True, detail="")
'''


def test_run_tool_records_reports_hangs_and_reruns(tmp_path):
    fake = tmp_path / "fake-sanitizer"
    fake.write_text(FAKE_SANITIZER)
    fake.chmod(0o755)
    by_version = {c.version: c for c in sanitize.all_cases()}
    cases = [by_version["bug_oob_store"], by_version["bug_barrier_in_branch"], by_version["v2_sequential"]]
    cells = sanitize.run_tool("memcheck", cases, quick=True, timeout=5, workdir=tmp_path, sanitizer=str(fake))
    attempts = cells.pop("_attempts")
    assert cells.pop("_other") == []
    assert [a["hung"] for a in attempts] == [True, False] and attempts[1]["cases"] == ["reduction:v2_sequential"]
    oob, barrier, seq = (cells[c.key] for c in cases)
    assert oob["outcome"] == "CAUGHT" and oob["first"].endswith("in reduce_bug_oob_store<SumOp,256> at reduction.cu:9")
    assert barrier["outcome"] == "hung" and "timed out" in barrier["detail"]
    assert seq["outcome"] == "clean" and seq["result_ok"] is True
