"""Lab 6: the Triton route. Vector add, reduction, matmul and attention forward in Triton, measured
with the shared harness beside the CUDA versions and torch.

    PYTHONPATH=src:. python -m labs.triton_lab [--quick] [--json out.json] [--ir-dir DIR]

(The module is `triton_lab`, not `triton`: a `labs/triton.py` would shadow the `triton` package for
every module inside labs/.)

Kernels (each a block program: one program instance = one CUDA thread block; Triton picks the
thread mapping, vector widths, shared-memory layout and pipelining from the block shapes,
`num_warps` and `num_stages`):
  add_kernel         c = a + b, BLOCK elements per program, masked tail.
                     Beside: labs.vector_add.vector_add (CUDA, 16-byte loads) and torch `a + b`.
  sum_kernel         two-pass sum: each program reduces BLOCK elements to one fp32 partial, a
                     second launch of the same kernel reduces the partials (programs cannot wait
                     on each other inside one launch). Beside: labs.reduction.reduce (CUDA, its
                     default version) and torch.sum.
  matmul_kernel      C = A @ Bt.T, bf16/fp16 in, fp32 accumulate (tl.dot), grouped tile order.
                     At rung 9's geometry (128x128x32, 8 warps, 3 stages) and at a larger tile
                     (128x256x64, 8 warps, 3 stages). Beside: gemm rung 9 and 10, cuBLAS.
                     Its TTIR, TTGIR and PTX are written to --ir-dir (docs/labs/triton_ir/).
  attn_fwd_kernel    FlashAttention-style forward: one program per (128-query block, batch*head),
                     keys in blocks of 64 (128 at d=64), online softmax in base 2 (log2 e folded
                     into the scale), causal blocks skipped. Beside: torch SDPA (flash, efficient,
                     cuDNN backends where they run) and the naive matmul-softmax-matmul.
Validation first (fresh random inputs, outputs NaN-poisoned), then timing (L2 flushed, events,
median of the repetitions); the table is printed last.

CPU: tests/test_triton_interpret.py runs these kernels under TRITON_INTERPRET=1 (fp16 and fp32; the
interpreter's bf16 dot is broken) in a child process, so the variable never leaks into a GPU run.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


# ---- kernels ------------------------------------------------------------------------------------
@triton.jit
def add_kernel(a_ptr, b_ptr, c_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    a = tl.load(a_ptr + offs, mask=mask)
    b = tl.load(b_ptr + offs, mask=mask)
    tl.store(c_ptr + offs, a + b, mask=mask)


@triton.jit
def sum_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)  # identity 0 past the end
    tl.store(out_ptr + tl.program_id(0), tl.sum(x, axis=0))


@triton.jit
def matmul_kernel(a_ptr, b_ptr, c_ptr, M, N, K, stride_am, stride_bn, stride_cm,
                  BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr):
    # C [M, N] = A [M, K] @ Bt [N, K]^T; unit inner strides (K-major operands, row-major C).
    pid = tl.program_id(0)
    tiles_m, tiles_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    rows = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % rows
    pid_n = (pid % per_group) // rows
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + offs_n[None, :] * stride_bn + offs_k[:, None]  # [BK, BN] view of Bt
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        a = tl.load(a_ptrs, mask=(offs_m[:, None] < M) & (k0 + offs_k[None, :] < K), other=0.0)
        b = tl.load(b_ptrs, mask=(offs_n[None, :] < N) & (k0 + offs_k[:, None] < K), other=0.0)
        acc = tl.dot(a, b, acc)
        a_ptrs += BK
        b_ptrs += BK
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


@triton.jit
def attn_fwd_kernel(q_ptr, k_ptr, v_ptr, o_ptr, n_q, n_k, qk_scale,
                    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    # q/o [BH, n_q, D], k/v [BH, n_k, D], contiguous. qk_scale = log2(e) / sqrt(D).
    # Causal: query i sees key j when j <= i + (n_k - n_q) (queries are the last n_q positions).
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    q = tl.load(q_ptr + bh * n_q * D + offs_m[:, None] * D + offs_d[None, :], mask=offs_m[:, None] < n_q, other=0.0)
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, D), dtype=tl.float32)
    shift = n_k - n_q
    end_n = n_k
    if CAUSAL:
        end_n = tl.minimum(n_k, start_m + BLOCK_M + shift)
    for start_n in range(0, end_n, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kv_mask = offs_n[:, None] < n_k
        k = tl.load(k_ptr + bh * n_k * D + offs_n[:, None] * D + offs_d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k)) * qk_scale  # [BLOCK_M, BLOCK_N], base-2 logits
        valid = offs_n[None, :] < n_k
        if CAUSAL:
            valid = valid & (offs_n[None, :] <= offs_m[:, None] + shift)
        s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # fully masked row so far: no NaN
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + bh * n_k * D + offs_n[:, None] * D + offs_d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # fully masked rows: 0
    tl.store(o_ptr + bh * n_q * D + offs_m[:, None] * D + offs_d[None, :], out.to(o_ptr.dtype.element_ty),
             mask=offs_m[:, None] < n_q)


# ---- host wrappers ------------------------------------------------------------------------------
def _check(name, t, dtypes, dim):
    if not isinstance(t, torch.Tensor) or t.dtype not in dtypes or t.dim() != dim or not t.is_contiguous():
        raise ValueError(f"{name} must be a contiguous {dim}-D tensor of {dtypes}, got "
                         f"{type(t).__name__} {getattr(t, 'dtype', None)} {tuple(getattr(t, 'shape', ()))}")


def add(a: torch.Tensor, b: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """a + b for contiguous 1-D float tensors of one length and dtype."""
    _check("a", a, (torch.float32, torch.float16), 1)
    _check("b", b, (a.dtype,), 1)
    if a.shape != b.shape:
        raise ValueError(f"length mismatch {tuple(a.shape)} vs {tuple(b.shape)}")
    c = torch.empty_like(a)
    if a.numel():
        add_kernel[(triton.cdiv(a.numel(), block),)](a, b, c, a.numel(), BLOCK=block)
    return c


def reduce_sum(x: torch.Tensor, block: int = 4096) -> torch.Tensor:
    """Sum of a contiguous 1-D float tensor as a 0-d fp32 tensor (two passes, fp32 partials)."""
    _check("x", x, (torch.float32, torch.float16), 1)
    n = x.numel()
    if n == 0:
        return torch.zeros((), device=x.device)
    while True:
        parts = torch.empty(triton.cdiv(n, block), device=x.device, dtype=torch.float32)
        sum_kernel[(parts.numel(),)](x, parts, n, BLOCK=block)
        if parts.numel() == 1:
            return parts[0]
        x, n = parts, parts.numel()


MATMUL_CONFIGS = {
    "rung9-like 128x128x32 w8 s3": dict(BM=128, BN=128, BK=32, num_warps=8, num_stages=3),
    "128x256x64 w8 s3": dict(BM=128, BN=256, BK=64, num_warps=8, num_stages=3),
}


def matmul(a: torch.Tensor, bt: torch.Tensor, config: str = "128x256x64 w8 s3", out=None):
    """C = A @ Bt.T; A [M, K], Bt [N, K] contiguous, one of fp16/bf16/fp32; C in the same dtype."""
    _check("a", a, (torch.float16, torch.bfloat16, torch.float32), 2)
    _check("bt", bt, (a.dtype,), 2)
    (M, K), (N, K2) = a.shape, bt.shape
    if K != K2:
        raise ValueError(f"a is [M, K] and bt is [N, K]; got {tuple(a.shape)} and {tuple(bt.shape)}")
    cfg = dict(MATMUL_CONFIGS[config]) if isinstance(config, str) else dict(config)
    out = torch.empty(M, N, device=a.device, dtype=a.dtype) if out is None else out
    grid = (triton.cdiv(M, cfg["BM"]) * triton.cdiv(N, cfg["BN"]),)
    return matmul_kernel[grid](a, bt, out, M, N, K, a.stride(0), bt.stride(0), out.stride(0), GROUP_M=8, **cfg), out


def attention(q, k, v, causal: bool = False, block_m: int = 128, block_n: int | None = None,
              num_warps: int = 8, num_stages: int = 2) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v for q [B, H, Nq, D], k/v [B, H, Nk, D] (D in 16..256, a power of 2)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check(name, t, (torch.float16, torch.bfloat16, torch.float32), 4)
    B, H, n_q, D = q.shape
    n_k = k.shape[2]
    if k.shape != (B, H, n_k, D) or v.shape != k.shape or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"shape/dtype mismatch q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)}")
    if D & (D - 1) or not 16 <= D <= 256:
        raise ValueError(f"head dim must be a power of two in [16, 256], got {D}")
    block_n = block_n or (64 if D > 64 else 128)
    o = torch.empty_like(q)
    grid = (triton.cdiv(n_q, block_m), B * H)
    attn_fwd_kernel[grid](q, k, v, o, n_q, n_k, LOG2E / math.sqrt(D), D=D, BLOCK_M=block_m, BLOCK_N=block_n,
                          CAUSAL=causal, num_warps=num_warps, num_stages=num_stages)
    return o


def attention_reference(q, k, v, causal=False):
    s = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if causal:
        n_q, n_k = s.shape[-2:]
        i = torch.arange(n_q, device=s.device)[:, None] + (n_k - n_q)
        s = s.masked_fill(torch.arange(n_k, device=s.device)[None, :] > i, float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return p @ v.double()


def _interpreter_numpy_compat() -> None:
    """Triton 3.6's interpreter turns a scalar into an int with int(ndarray of shape (1,)) (its
    `tensor.__index__`, used by `range(0, K, BK)`), which NumPy >= 2.4 refuses ("only 0-dimensional
    arrays can be converted"). Re-patch __index__ to read the single element."""
    from triton.runtime import interpreter as itp

    if getattr(itp, "_tileattn_index_compat", False) or not hasattr(itp, "_patch_lang_tensor"):
        return
    original = itp._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    itp._patch_lang_tensor = patched
    itp._tileattn_index_compat = True


def interpret_selfcheck() -> dict:
    """Run every kernel on small shapes (meant for TRITON_INTERPRET=1 on the CPU); {case: [ok, err]}."""
    torch.manual_seed(0)
    interpret = bool(getattr(getattr(triton, "knobs", None), "runtime", None) and triton.knobs.runtime.interpret)
    if interpret:
        _interpreter_numpy_compat()
    dev = "cuda" if torch.cuda.is_available() and not interpret else "cpu"
    res = {}
    rel = lambda x, r: float(torch.linalg.norm(x.double() - r) / max(torch.linalg.norm(r), 1e-30))  # noqa: E731
    for dt, tol in ((torch.float32, 1e-5), (torch.float16, 2e-3)):
        name = str(dt).removeprefix("torch.")
        for n in (1, 31, 1003):
            a, b = torch.randn(n, device=dev, dtype=dt), torch.randn(n, device=dev, dtype=dt)
            c = add(a, b, block=256)
            res[f"add {name} n={n}"] = [bool(torch.equal(c, a + b)), 0.0]
        for n in (1, 33, 5000):
            x = torch.randn(n, device=dev, dtype=dt)
            e = rel(reduce_sum(x, block=512).reshape(1), x.double().sum().reshape(1))
            res[f"sum {name} n={n}"] = [e < 1e-5, e]
        for M, N, K in ((17, 33, 40), (64, 32, 16)):
            a, bt = torch.randn(M, K, device=dev, dtype=dt), torch.randn(N, K, device=dev, dtype=dt)
            _, c = matmul(a, bt, dict(BM=16, BN=32, BK=16, num_warps=4, num_stages=1))
            e = rel(c, a.double() @ bt.double().T)
            res[f"matmul {name} {M}x{N}x{K}"] = [e < tol, e]
        for causal in (False, True):
            for n_q, n_k, D in ((5, 5, 16), (20, 37, 32), (37, 20, 32)):  # last: rows with no visible key
                q = torch.randn(1, 2, n_q, D, device=dev, dtype=dt)
                k = torch.randn(1, 2, n_k, D, device=dev, dtype=dt)
                v = torch.randn(1, 2, n_k, D, device=dev, dtype=dt)
                o = attention(q, k, v, causal, block_m=16, block_n=16, num_warps=4, num_stages=1)
                e = rel(o, attention_reference(q, k, v, causal))
                res[f"attention {name} causal={causal} {n_q}x{n_k}x{D}"] = [e < 5 * tol, e]
    return res


# ---- the lab ------------------------------------------------------------------------------------
def compile_matmul_offline(arch: int = 90, config: str = "rung9-like 128x128x32 w8 s3"):
    """Compile matmul_kernel for sm_<arch> without a GPU (Triton's own ptxas), with the specialization
    the JIT gives a 4096^3 bf16 call (every pointer 16-byte aligned, every integer divisible by 16).
    Returns the CompiledKernel (its .asm has ttir, ttgir, llir, ptx, cubin)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    cfg = dict(MATMUL_CONFIGS[config])
    sig = {"a_ptr": "*bf16", "b_ptr": "*bf16", "c_ptr": "*bf16", "M": "i32", "N": "i32", "K": "i32",
           "stride_am": "i32", "stride_bn": "i32", "stride_cm": "i32",
           "BM": "constexpr", "BN": "constexpr", "BK": "constexpr", "GROUP_M": "constexpr"}
    consts = {"BM": cfg["BM"], "BN": cfg["BN"], "BK": cfg["BK"], "GROUP_M": 8}
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(9)}
    src = ASTSource(fn=matmul_kernel, signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]})


def save_ir(compiled, ir_dir: Path) -> list[Path]:
    ir_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for key, ext in (("ttir", "ttir"), ("ttgir", "ttgir"), ("ptx", "ptx")):
        text = compiled.asm.get(key)
        if text is None:
            continue
        p = ir_dir / f"matmul_128x128x32_w8_s3.{ext}"
        p.write_text(text if isinstance(text, str) else text.decode())
        written.append(p)
    return written


def main(argv=None) -> int:
    from labs.vector_add import vector_add
    from tileattn.bench import cold_start, environment, measure, write_run

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--ir-dir", help="write the rung9-like matmul's TTIR/TTGIR/PTX here")
    ap.add_argument("--ir-offline", metavar="DIR", help="no GPU needed: compile the rung9-like matmul for sm_90 "
                    "with Triton's bundled ptxas, write its TTIR/TTGIR/PTX to DIR and exit")
    args = ap.parse_args(argv)
    if args.ir_offline:
        for p in save_ir(compile_matmul_offline(), Path(args.ir_offline)):
            print(f"wrote {p}")
        return 0
    if not torch.cuda.is_available():
        raise SystemExit("labs.triton_lab needs a CUDA GPU (the CPU route is tests/test_triton_interpret.py)")
    torch.backends.cuda.matmul.allow_tf32 = False
    start = time.perf_counter()
    records, failures = [], []

    def run(suite, impl, fn, check, work, unit, **extra):
        """check() -> (ok, err) on the first output; then timing."""
        rec = {"suite": suite, "impl": impl, **extra}
        try:
            cold = cold_start(fn)  # first call: Triton JIT / NVRTC compile + module load, end to end
            ok, err = check(fn())
            t = measure(fn, warmup=3, reps=20, max_seconds=2.0, memory=False)
            rate = work / (t.median_ms * 1e-3) / 1e12
            rec.update(correct=ok, rel_err=err, cold_s=cold, rate=rate, unit=unit, **t.as_dict())
        except Exception as exc:
            rec.update(correct=False, error=f"{type(exc).__name__}: {exc}"[:600])
            if impl.startswith("torch SDPA"):  # a backend that does not run this case is a fact, not a failure
                rec.update(correct=None, unavailable=True)
        if rec.get("correct") is False:
            failures.append(rec)
        records.append(rec)
        r = rec.get("rate")
        print(f"  {suite:<10}{impl:<42}{rec.get('median_ms', float('nan')):>10.4f} ms (cold {rec.get('cold_s') or float('nan'):.2f} s)"
              f"{(r if r is not None else float('nan')):>9.3f} {unit}  {'ok' if rec.get('correct') else ('unavailable: ' if rec.get('unavailable') else 'FAILED ') + rec.get('error', '')}",
              flush=True)

    # vector add (TB/s: 3 streams of 4 bytes)
    n = 1 << (24 if args.quick else 28)
    a, b = torch.randn(n, device="cuda"), torch.randn(n, device="cuda")
    want = a + b
    exact = lambda out: (bool(torch.equal(out, want)), 0.0)  # noqa: E731
    for impl, fn in (("triton add_kernel BLOCK=1024", lambda: add(a, b)), ("CUDA vector_add (vec4)", lambda: vector_add(a, b)),
                     ("torch a + b", lambda: a + b)):
        run("add", impl, fn, exact, 12.0 * n, "TB/s", n=n)
    # reduction (TB/s read)
    ref = a.double().sum()
    close = lambda out: ((abs(float(out) - float(ref)) / abs(float(ref)) < 1e-4), abs(float(out) - float(ref)) / abs(float(ref)))  # noqa: E731
    sums = [("triton sum_kernel 2-pass BLOCK=4096", lambda: reduce_sum(a))]
    try:  # the CUDA reduction lab (labs/reduction.py), at its default version
        from labs.reduction import reduce as cuda_reduce

        sums.append(("CUDA labs.reduction (default version)", lambda: cuda_reduce(a, "sum")))
    except ImportError as exc:
        print(f"  (CUDA reduction lab not available: {exc})")
    sums.append(("torch.sum", lambda: a.sum()))
    for impl, fn in sums:
        run("sum", impl, fn, close, 4.0 * n, "TB/s", n=n)
    # matmul (TFLOP/s)
    from labs import gemm as glab
    sizes = ((4096, 4096, 4096),) if args.quick else ((4096, 4096, 4096), (8192, 8192, 8192))
    for M, N, K in sizes:
        a = torch.randn(M, K, device="cuda").bfloat16()
        bt = torch.randn(N, K, device="cuda").bfloat16()
        ref = a.double() @ bt.double().T
        relc = lambda out: ((e := glab.rel_err(out, ref)) < 1e-2, e)  # noqa: E731
        impls = {f"triton {c}": (lambda c=c: matmul(a, bt, c)[1]) for c in MATMUL_CONFIGS}
        impls["CUDA rung 9 (cp.async, 3 stages)"] = lambda: glab.hgemm(a, bt, 9)
        if torch.cuda.get_device_capability()[0] == 9:
            impls["CUDA rung 10 (TMA + wgmma)"] = lambda: glab.hgemm(a, bt, 10)
        impls["cuBLAS (torch.matmul)"] = lambda: torch.matmul(a, bt.T)
        for impl, fn in impls.items():
            run("matmul", impl, fn, relc, 2.0 * M * N * K, "TFLOP/s", M=M, N=N, K=K, dtype="bf16")
        if args.ir_dir and (M, N, K) == sizes[0]:
            compiled, _ = matmul(a, bt, "rung9-like 128x128x32 w8 s3")
            for p in save_ir(compiled, Path(args.ir_dir)):
                print(f"  wrote {p}")
    # attention forward (TFLOP/s, 4 B H N^2 D, halved when causal)
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F

    B, H, D = 4, 32, 128
    for N_ in ((2048,) if args.quick else (1024, 4096)):
        for causal in (False, True):
            q, k, v = (torch.randn(B, H, N_, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=causal)
            attn_check = lambda out: ((e := glab.rel_err(out, ref.double())) < 1e-2, e)  # noqa: E731
            flops = 4.0 * B * H * N_ * N_ * D / (2 if causal else 1)
            impls = {"triton attn_fwd_kernel 128x64 w8 s2": lambda: attention(q, k, v, causal)}
            for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("efficient", SDPBackend.EFFICIENT_ATTENTION),
                                  ("cudnn", SDPBackend.CUDNN_ATTENTION)):
                def sdpa(backend=backend):
                    with sdpa_kernel(backend):
                        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                impls[f"torch SDPA {name}"] = sdpa

            def naive():
                s = (q @ k.transpose(-1, -2)).float() / math.sqrt(D)
                if causal:
                    s = s.masked_fill(torch.ones(N_, N_, device="cuda", dtype=torch.bool).triu(1), float("-inf"))
                return torch.softmax(s, -1).to(q.dtype) @ v
            impls["torch naive (matmul, softmax fp32, matmul)"] = naive
            for impl, fn in impls.items():
                run("attention", impl, fn, attn_check, flops, "TFLOP/s", B=B, H=H, N=N_, D=D, causal=causal, dtype="bf16")
    if args.json:
        env = environment()
        env["wall_seconds"] = time.perf_counter() - start
        write_run(args.json, records, env)
    print("\n| suite | impl | shape | median ms | rate | first call s | check |")
    print("|---|---|---|---|---|---|---|")
    for r in records:
        shape = ", ".join(f"{k}={r[k]}" for k in ("n", "M", "N", "K", "causal") if k in r)
        rate = f"{r['rate']:.3g} {r['unit']}" if r.get("rate") is not None else "-"
        ms = f"{r['median_ms']:.4f}" if r.get("median_ms") is not None else "-"
        check = "ok" if r.get("correct") else ("unavailable" if r.get("unavailable") else "FAILED")
        cold = f"{r['cold_s']:.2f}" if r.get("cold_s") is not None else "-"
        print(f"| {r['suite']} | {r['impl']} | {shape} | {ms} | {rate} | {cold} | {check} |")
    print(f"\n{len(records)} records, {len(failures)} failed, {time.perf_counter() - start:.0f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
