"""Lab 2: transpose (coalescing and shared-memory banks); validate every version, then time it.

    python -m labs.transpose [--shapes 4096x8192,...] [--dtypes fp32,bf16] [--ncu] [--json out.json]

Kernels and the idea of each version: labs/csrc/transpose.cu (header comment). Correctness: exact
equality with torch's x.t().contiguous() on fresh random inputs, outputs poisoned with NaN before
the launch, over square, rectangular and edge-tile shapes. Useful bandwidth = 2 x rows x cols x
element size / time, beside torch x.t().contiguous() and a device copy of the same bytes
(y.copy_(x)), all measured in the same run.

--ncu re-runs this module under Nsight Compute (`ncu --clock-control none`) on one shape, one
launch per version and dtype, and records per version: global load/store sectors per request,
shared-memory bank conflicts (l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld/st.sum), shared
wavefronts and DRAM bytes, next to the counts predicted from the kernels' index arithmetic
(`predict_counters`).
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np
import torch

from tileattn import kernels
from labs.kernels.transpose import ELEMENT_TYPES, VERSIONS, expression
from tileattn.runtime import launch, load_kernel, require_gpu

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
SHORT = {"transpose_naive": "naive", "transpose_tiled": "tiled", "transpose_padded": "padded", "transpose_vec4": "vec4"}
# Shapes (rows, cols). Edge tiles: 1, 31, 33, 65, 127 are not multiples of 32/64; 1000x3001 has
# rows whose byte offsets are not 16-byte aligned (vec4 falls back to scalar accesses there).
CHECK_SHAPES = ((1, 1), (1, 37), (37, 1), (31, 33), (33, 31), (64, 64), (65, 127), (128, 192), (1000, 3001), (4096, 8192))
BENCH_SHAPES = ((4096, 8192), (8192, 4096), (1000, 3001), (32768, 32768))
NCU_SHAPE = (4096, 8192)
TILE = {"transpose_naive": 32, "transpose_tiled": 32, "transpose_padded": 32, "transpose_vec4": 64}

NCU_METRICS = (
    "l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum",
    "l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum",
    "l1tex__t_sectors_pipe_lsu_mem_global_op_st.sum",
    "l1tex__t_requests_pipe_lsu_mem_global_op_st.sum",
    "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum",
    "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum",
    "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum",
    "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_st.sum",
    "smsp__sass_inst_executed_op_shared_ld.sum",
    "smsp__sass_inst_executed_op_shared_st.sum",
    "dram__bytes_read.sum",
    "dram__bytes_write.sum",
    "gpu__time_duration.sum",
)
# The counters the issue asks for; retried alone if ncu rejects one of the others by name.
NCU_CORE_METRICS = NCU_METRICS[:6]


def parse_shape(text: str) -> tuple[int, int]:
    """'4096x8192' -> (4096, 8192); ValueError for anything else."""
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise ValueError(f"shape must look like ROWSxCOLS (e.g. 4096x8192), got {text!r}")
    rows, cols = (int(p) for p in parts)
    if rows < 1 or cols < 1:
        raise ValueError(f"shape must have rows, cols >= 1, got {text!r}")
    if rows * cols >= 2**31:
        raise ValueError(f"shape {text} has {rows * cols} elements; the kernels index with 32-bit rows/cols products < 2^31")
    return rows, cols


def check_args(x, version: str, out=None) -> None:
    """Validate a call before anything reaches the GPU. Raises ValueError."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in DTYPES.values():
        raise ValueError(f"x must be float32 or bfloat16, got {x.dtype}")
    if x.dim() != 2 or not x.is_contiguous():
        raise ValueError(f"x must be a contiguous 2-D tensor, got shape {tuple(x.shape)} strides {x.stride()}")
    if not x.is_cuda:
        raise ValueError(f"x must be a CUDA tensor, got device {x.device}")
    if x.numel() >= 2**31:
        raise ValueError(f"x has {x.numel()} elements; at most 2^31 - 1 are supported")
    if version not in VERSIONS:
        raise ValueError(f"unknown version {version!r}; known: {', '.join(VERSIONS)}")
    if x.shape[0] > 65535 * 32:  # one block row per 32 (or 64) input rows: gridDim.y <= 65535
        raise ValueError(f"x has {x.shape[0]} rows; at most {65535 * 32} are supported")
    if out is not None:
        if not isinstance(out, torch.Tensor) or out.dtype != x.dtype or out.device != x.device:
            raise ValueError("out must be a tensor of x's dtype on x's device")
        if tuple(out.shape) != (x.shape[1], x.shape[0]) or not out.is_contiguous():
            raise ValueError(f"out must be contiguous with shape {(x.shape[1], x.shape[0])}, got {tuple(out.shape)}")


def _compile_options():
    return {"lineinfo": True} if os.environ.get("TILEATTN_LINEINFO") == "1" else None


def _dtype_name(dtype: torch.dtype) -> str:
    return next(k for k, v in DTYPES.items() if v == dtype)


def transpose(x: torch.Tensor, version: str = "transpose_vec4", out: torch.Tensor | None = None) -> torch.Tensor:
    """out = x^T for a contiguous 2-D float32 or bfloat16 CUDA tensor x of shape (rows, cols).

    Returns a contiguous (cols, rows) tensor (`out` when given). Raises ValueError for another
    dtype, rank, layout, device, an unknown version or a mismatched `out`.
    """
    check_args(x, version, out)
    rows, cols = x.shape
    out = torch.empty((cols, rows), dtype=x.dtype, device=x.device) if out is None else out
    if x.numel() == 0:
        return out
    require_gpu()
    fam = kernels.family("transpose")
    k = load_kernel(fam.path, fam.require(expression(version, _dtype_name(x.dtype))), compile_options=_compile_options())
    tile = TILE[version]
    grid = (math.ceil(cols / tile), math.ceil(rows / tile))
    args = [x.data_ptr(), out.data_ptr(), np.int32(rows), np.int32(cols)]
    if version == "transpose_vec4":
        vbytes = 4 * x.element_size()
        vec_ok = rows % 4 == 0 and cols % 4 == 0 and x.data_ptr() % vbytes == 0 and out.data_ptr() % vbytes == 0
        args.append(np.int32(vec_ok))
        launch(k, grid, (256,), args)
    else:
        launch(k, grid, (32, 8), args)
    return out


# ---- the model: what each version should cost, from its index arithmetic ------------------------
def _warp_requests(version: str, esize: int):
    """Per warp-level memory instruction of one full interior tile: (space, op, byte addresses of
    the 32 lanes, access size). Addresses are relative to the tile origin, for a matrix whose
    row pitch is a multiple of 128 bytes (so the tile's rows start 128-byte aligned)."""
    pitch_in = pitch_out = 1 << 20  # large, 128-byte multiple: rows never share a sector
    reqs = []
    lanes = np.arange(32)
    if version in ("transpose_naive", "transpose_tiled", "transpose_padded"):
        pad = 4 // esize if version == "transpose_padded" else 0  # one 4-byte word
        stride = (32 + pad) * esize  # shared row stride in bytes
        for ty in range(8):  # warp ty of the 32x8 block: threadIdx.y = ty, threadIdx.x = lane
            for j in range(0, 32, 8):
                r, c = ty + j, lanes
                reqs.append(("global", "ld", r * pitch_in + c * esize, esize))
                if version == "transpose_naive":
                    reqs.append(("global", "st", c * pitch_out + r * esize, esize))
                else:
                    reqs.append(("shared", "st", r * stride + c * esize, esize))
            for j in range(0, 32, 8):
                if version != "transpose_naive":
                    reqs.append(("shared", "ld", lanes * stride + (ty + j) * esize, esize))
                    reqs.append(("global", "st", (ty + j) * pitch_out + lanes * esize, esize))
        return reqs
    if version == "transpose_vec4":
        stride = (64 + 4 // esize) * esize  # 64 elements + one word
        m, q = lanes % 8, lanes // 8
        for w in range(8):
            col4 = 32 * (w % 2) + 4 * m
            for s in range(4):
                row = 16 * s + 4 * (w // 2) + q
                reqs.append(("global", "ld", row * pitch_in + col4 * esize, 4 * esize))
            for s in range(4):
                row = 16 * s + 4 * (w // 2) + q
                for i in range(4):
                    reqs.append(("shared", "st", (col4 + i) * stride + row * esize, esize))
            for s in range(4):
                j = 16 * s + 4 * (w // 2) + q
                for i in range(4):
                    reqs.append(("shared", "ld", j * stride + (col4 + i) * esize, esize))
                reqs.append(("global", "st", j * pitch_out + col4 * esize, 4 * esize))
        return reqs
    raise ValueError(version)


def _sectors(addrs: np.ndarray, size: int) -> int:
    first, last = addrs // 32, (addrs + size - 1) // 32
    return len(set(first.tolist()) | set(last.tolist()))


def _wavefronts(addrs: np.ndarray, size: int) -> int:
    """Shared-memory wavefronts of one warp access of <= 4 bytes per lane: 32 banks of 4-byte
    words; lanes touching the same word share it (broadcast), different words in one bank
    serialize."""
    assert size <= 4
    words = set((addrs // 4).tolist())
    per_bank: dict[int, int] = {}
    for wd in words:
        per_bank[wd % 32] = per_bank.get(wd % 32, 0) + 1
    return max(per_bank.values())


def predict_counters(version: str, dtype: str, rows: int, cols: int) -> dict:
    """Predicted Nsight Compute counters for one launch on a (rows, cols) matrix whose sides are
    multiples of the version's tile (full tiles only: the profiled shape is chosen that way)."""
    esize = 4 if dtype == "fp32" else 2
    tile = TILE[version]
    if rows % tile or cols % tile:
        raise ValueError(f"prediction needs rows, cols multiples of {tile}; got {rows}x{cols}")
    tiles = (rows // tile) * (cols // tile)
    acc = {k: 0 for k in ("ld_req", "ld_sec", "st_req", "st_sec", "sh_ld_inst", "sh_ld_wf", "sh_st_inst", "sh_st_wf")}
    for space, op, addrs, size in _warp_requests(version, esize):
        if space == "global":
            acc[f"{op}_req"] += 1
            acc[f"{op}_sec"] += _sectors(addrs, size)
        else:
            acc[f"sh_{op}_inst"] += 1
            acc[f"sh_{op}_wf"] += _wavefronts(addrs, size)
    return {
        "ld_sectors_per_request": acc["ld_sec"] / acc["ld_req"],
        "st_sectors_per_request": acc["st_sec"] / acc["st_req"],
        "bank_conflicts_ld": tiles * (acc["sh_ld_wf"] - acc["sh_ld_inst"]),
        "bank_conflicts_st": tiles * (acc["sh_st_wf"] - acc["sh_st_inst"]),
        "shared_ld_wavefronts_per_inst": acc["sh_ld_wf"] / acc["sh_ld_inst"] if acc["sh_ld_inst"] else 0.0,
        "shared_st_wavefronts_per_inst": acc["sh_st_wf"] / acc["sh_st_inst"] if acc["sh_st_inst"] else 0.0,
        "dram_bytes": 2 * rows * cols * esize,
    }


# ---- Nsight Compute -------------------------------------------------------------------------------
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _child_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(ROOT, "src"), ROOT] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


def ncu_command(child_args: list[str], ncu: str = "ncu", metrics=NCU_METRICS) -> list[str]:
    return [ncu, "--clock-control", "none", "--kernel-name", "regex:^transpose_", "--metrics", ",".join(metrics),
            "--csv", "--print-units", "base", sys.executable, "-m", "labs.transpose", *child_args]


def _number(text: str):
    t = text.strip().replace(",", "")
    try:
        return float(t) if any(ch in t for ch in ".eE") else int(t)
    except ValueError:
        return None


def parse_ncu_csv(text: str) -> list[dict]:
    """ncu --csv (details page) output -> one dict per profiled kernel, in launch (ID) order:
    {'id', 'kernel', metric name: value, ...}. Lines before the CSV header are ignored."""
    lines = text.splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.startswith('"ID"')), None)
    if start is None:
        return []
    rows = [ln for ln in lines[start:] if ln.startswith('"')]
    kernels_: dict[int, dict] = {}
    for row in csv.DictReader(io.StringIO("\n".join(rows))):
        try:
            kid = int(row["ID"])
        except (KeyError, ValueError):
            continue
        k = kernels_.setdefault(kid, {"id": kid, "kernel": row.get("Kernel Name", "")})
        name = row.get("Metric Name")
        if name:
            k[name] = _number(row.get("Metric Value", ""))
    return [kernels_[i] for i in sorted(kernels_)]


def summarize_ncu(kernel_row: dict) -> dict:
    """Derived quantities from one kernel's raw metrics (None where a metric is missing)."""
    def ratio(a, b):
        x, y = kernel_row.get(a), kernel_row.get(b)
        return x / y if isinstance(x, (int, float)) and isinstance(y, (int, float)) and y else None

    g = kernel_row.get
    return {
        "ld_sectors_per_request": ratio("l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum", "l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum"),
        "st_sectors_per_request": ratio("l1tex__t_sectors_pipe_lsu_mem_global_op_st.sum", "l1tex__t_requests_pipe_lsu_mem_global_op_st.sum"),
        "bank_conflicts_ld": g("l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum"),
        "bank_conflicts_st": g("l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum"),
        "shared_ld_wavefronts_per_inst": ratio("l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum", "smsp__sass_inst_executed_op_shared_ld.sum"),
        "shared_st_wavefronts_per_inst": ratio("l1tex__data_pipe_lsu_wavefronts_mem_shared_op_st.sum", "smsp__sass_inst_executed_op_shared_st.sum"),
        "dram_bytes": (g("dram__bytes_read.sum") or 0) + (g("dram__bytes_write.sum") or 0) or None,
        "duration_ns": g("gpu__time_duration.sum"),
    }


def profile_child(shape: tuple[int, int], dtypes: list[str], versions: list[str], order_file: str | None) -> int:
    """Launch each (dtype, version) once, in a fixed order written to `order_file` (ncu IDs follow it)."""
    require_gpu()
    rows, cols = shape
    order = []
    for d in dtypes:
        x = torch.randn(rows, cols, device="cuda").to(DTYPES[d])
        for v in versions:
            out = torch.full((cols, rows), float("nan"), dtype=x.dtype, device="cuda")
            transpose(x, v, out)
            torch.cuda.synchronize()
            order.append({"version": v, "dtype": d, "correct": bool(torch.equal(out, x.t()))})
    if order_file:
        with open(order_file, "w") as f:
            json.dump(order, f)
    return 0


def run_ncu(shape, dtypes, versions, timeout: int = 300) -> dict:
    """Run the profile child under ncu; returns {'command', 'records' or 'error', 'stdout_tail'}."""
    ncu = shutil.which("ncu")
    if ncu is None:
        return {"error": "ncu not found on PATH"}
    with tempfile.TemporaryDirectory() as tmp:
        order_file = os.path.join(tmp, "order.json")
        child = ["--profile-child", "--ncu-shape", f"{shape[0]}x{shape[1]}", "--dtypes", ",".join(dtypes),
                 "--versions", ",".join(versions), "--order-file", order_file]
        for metrics in (NCU_METRICS, NCU_CORE_METRICS):
            cmd = ncu_command(child, ncu, metrics)
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=_child_env())
            except subprocess.TimeoutExpired:
                return {"command": " ".join(cmd), "error": f"ncu timed out after {timeout} s"}
            out = proc.stdout + "\n" + proc.stderr
            kernels_ = parse_ncu_csv(proc.stdout)
            if kernels_:
                break
        order = json.load(open(order_file)) if os.path.exists(order_file) else []
    result = {"command": " ".join(cmd), "returncode": proc.returncode, "stdout_tail": out[-3000:]}
    if not kernels_:
        result["error"] = f"no ncu CSV rows parsed (exit {proc.returncode}); see stdout_tail"
        return result
    if len(kernels_) != len(order):
        result["error"] = f"{len(kernels_)} profiled kernels for {len(order)} launches; matched by name where possible"
    records = []
    for i, k in enumerate(kernels_):
        launch_ = order[i] if i < len(order) else {}
        name = k.get("kernel", "")
        # The kernel's own name, where ncu prints it, must agree with the launch order.
        if launch_ and launch_["version"] not in name and name:
            launch_ = next((o for o in order if o["version"] in name and ELEMENT_TYPES[o["dtype"]] in name), launch_)
        rec = {"suite": "transpose", "kind": "ncu", "impl": SHORT.get(launch_.get("version"), name), "version": launch_.get("version"),
               "dtype": launch_.get("dtype"), "rows": shape[0], "cols": shape[1], "kernel": name,
               "raw": {m: k.get(m) for m in NCU_METRICS}, **summarize_ncu(k)}
        if launch_.get("version") and shape[0] % TILE[launch_["version"]] == 0 and shape[1] % TILE[launch_["version"]] == 0:
            rec["predicted"] = predict_counters(launch_["version"], launch_["dtype"], *shape)
        records.append(rec)
    result["records"] = records
    return result


# ---- the lab ------------------------------------------------------------------------------------------
def _random(rows, cols, dtype):
    return torch.randn(rows, cols, device="cuda").to(dtype)


def check_version(version: str, rows: int, cols: int, dtype: str) -> bool:
    """One fresh random input, output poisoned with NaN; exact equality with torch's transpose."""
    x = _random(rows, cols, DTYPES[dtype])
    out = torch.full((cols, rows), float("nan"), dtype=x.dtype, device="cuda")
    transpose(x, version, out)
    return bool(torch.equal(out, x.t().contiguous()))


def main(argv=None) -> int:
    from tileattn.bench import measure, write_run

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", help="benchmark shapes ROWSxCOLS, comma-separated (default: %s)" % ",".join(f"{r}x{c}" for r, c in BENCH_SHAPES))
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--versions", help="comma-separated kernel names (default: all)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--ncu", action="store_true", help="also collect Nsight Compute counters (re-runs this module under ncu)")
    ap.add_argument("--ncu-only", action="store_true", help="only the Nsight Compute pass")
    ap.add_argument("--ncu-shape", default=f"{NCU_SHAPE[0]}x{NCU_SHAPE[1]}")
    ap.add_argument("--json", help="write the records here")
    ap.add_argument("--profile-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--order-file", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    try:
        dtypes = [d for d in args.dtypes.split(",") if d]
        for d in dtypes:
            if d not in DTYPES:
                raise ValueError(f"unknown dtype {d!r}; known: {', '.join(DTYPES)}")
        versions = args.versions.split(",") if args.versions else list(VERSIONS)
        for v in versions:
            if v not in VERSIONS:
                raise ValueError(f"unknown version {v!r}; known: {', '.join(VERSIONS)}")
        shapes = [parse_shape(s) for s in args.shapes.split(",")] if args.shapes else list(BENCH_SHAPES)
        ncu_shape = parse_shape(args.ncu_shape)
    except ValueError as exc:
        ap.error(str(exc))
    if args.profile_child:
        return profile_child(ncu_shape, dtypes, versions, args.order_file)

    require_gpu()
    records: list[dict] = []
    failures: list[str] = []
    rows_out: list[dict] = []
    if not args.ncu_only:
        # 1. correctness
        check_shapes = list(dict.fromkeys(list(CHECK_SHAPES) + shapes))
        print("correctness: exact equality with x.t().contiguous(), output poisoned with NaN")
        for d in dtypes:
            for v in versions:
                bad = [f"{r}x{c}" for r, c in check_shapes if not check_version(v, r, c, d)]
                records.append({"suite": "transpose", "kind": "correctness", "impl": SHORT[v], "version": v, "dtype": d,
                                "shapes": [f"{r}x{c}" for r, c in check_shapes], "failed": bad, "correct": not bad})
                print(f"  {d} {SHORT[v]:<7} {'ok' if not bad else 'WRONG at ' + ', '.join(bad)} ({len(check_shapes)} shapes)")
                failures += [f"{d} {v} {s}" for s in bad]
        torch.cuda.empty_cache()
        # 2. bandwidth
        for (r, c) in shapes:
            for d in dtypes:
                x = _random(r, c, DTYPES[d])
                y = torch.empty((c, r), dtype=x.dtype, device="cuda")
                copy_dst = torch.empty_like(x)
                nbytes = 2 * r * c * x.element_size()
                impls = {SHORT[v]: (lambda v=v: transpose(x, v, y)) for v in versions}
                impls["torch t().contiguous()"] = lambda: x.t().contiguous()
                impls["copy"] = lambda: copy_dst.copy_(x)
                for name, fn in impls.items():
                    t = measure(fn, reps=args.reps)
                    rec = {"suite": "transpose", "kind": "bandwidth", "impl": name, "dtype": d, "rows": r, "cols": c,
                           "shape": f"{r}x{c}", "tbps": nbytes / (t.median_ms * 1e-3) / 1e12, **t.as_dict()}
                    records.append(rec)
                    rows_out.append(rec)
                group = [q for q in rows_out if q["shape"] == f"{r}x{c}" and q["dtype"] == d]
                torch_bw = next(q["tbps"] for q in group if q["impl"].startswith("torch"))
                copy_bw = next(q["tbps"] for q in group if q["impl"] == "copy")
                for q in group:
                    q["x_torch"] = q["tbps"] / torch_bw
                    q["of_copy"] = q["tbps"] / copy_bw
                del x, y, copy_dst
                torch.cuda.empty_cache()
    ncu_result = None
    if args.ncu or args.ncu_only:
        print(f"\nNsight Compute on {ncu_shape[0]}x{ncu_shape[1]} ...", flush=True)
        ncu_result = run_ncu(ncu_shape, dtypes, versions)
        records += ncu_result.get("records", [])
    if args.json:
        from tileattn.bench import environment

        env = environment()
        if ncu_result is not None:
            env["ncu"] = {k: v for k, v in ncu_result.items() if k != "records"}
        write_run(args.json, records, env)

    # tables last
    if rows_out:
        print(f"\nuseful bandwidth 2*rows*cols*size/time, median of up to {args.reps} reps, L2 flushed")
        print(f"{'shape':<13}{'dtype':<6}{'impl':<24}{'median ms':>11}{'TB/s':>8}{'x torch':>9}{'of copy':>9}")
        for q in rows_out:
            print(f"{q['shape']:<13}{q['dtype']:<6}{q['impl']:<24}{q['median_ms']:>11.4f}{q['tbps']:>8.3f}{q['x_torch']:>9.2f}{q['of_copy']:>9.2f}")
        big = [q for q in rows_out if q["shape"] == "32768x32768" and q["dtype"] == "fp32" and q["impl"] in SHORT.values()]
        if big:
            best = max(big, key=lambda q: q["tbps"])
            print(f"best fp32 32768x32768: {best['impl']} {best['tbps']:.3f} TB/s = {best['x_torch']:.2f}x torch (target >= 3), "
                  f"{best['of_copy']:.0%} of copy (target >= 85%)")
    if ncu_result is not None:
        if "error" in ncu_result:
            print(f"ncu: {ncu_result['error']}")
        recs = ncu_result.get("records", [])
        if recs:
            print(f"\nncu counters, {ncu_shape[0]}x{ncu_shape[1]} (measured / predicted)")
            print(f"{'dtype':<6}{'version':<8}{'ld sec/req':>14}{'st sec/req':>14}{'bank confl ld':>24}{'bank confl st':>24}")
            for rec in recs:
                p = rec.get("predicted", {})

                def cell(key, fmt):
                    m, e = rec.get(key), p.get(key)
                    return (format(m, fmt) if m is not None else "-") + " / " + (format(e, fmt) if e is not None else "-")

                print(f"{rec['dtype'] or '-':<6}{rec['impl']:<8}{cell('ld_sectors_per_request', '.1f'):>14}{cell('st_sectors_per_request', '.1f'):>14}"
                      f"{cell('bank_conflicts_ld', '.0f'):>24}{cell('bank_conflicts_st', '.0f'):>24}")
    if failures:
        print(f"\n{len(failures)} WRONG results: {', '.join(failures)}")
        return 1
    return 0


if __name__ == "__main__":
    from labs import run_lab

    raise SystemExit(run_lab(main, "transpose"))
