"""`tileattn bench layers`: the decoder's non-attention steps at decode, tileattn's kernels beside
what torch runs for them (GPU only).

- linear: y = x W^T for the projections of Llama-3-8B and Qwen3-0.6B (qkv, o, gate/up, down,
  LM head) at 1 and 8 rows of x: median us and the weight-streaming rate (weight bytes / time)
  of tileattn.api_layers.linear (the skinny GEMM) and torch.nn.functional.linear (cuBLAS).
- fused steps at one decode token: residual add + RMSNorm, q/k rotary (+ Qwen3's per-head norm),
  SiLU(gate) * up against the eager torch sequence each replaces (what the engine ran before).
Timing: tileattn.bench.harness.measure (CUDA events, L2 flushed before each repetition).
"""

from __future__ import annotations

import argparse

LINEAR_SHAPES = {  # name -> (N, K)
    "llama3-8b qkv": (6144, 4096), "llama3-8b o": (4096, 4096), "llama3-8b gate/up": (28672, 4096),
    "llama3-8b down": (4096, 14336), "llama3-8b lm head": (128256, 4096),
    "qwen3-0.6b qkv": (4096, 1024), "qwen3-0.6b gate/up": (6144, 1024), "qwen3-0.6b down": (1024, 3072),
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="tileattn bench layers", description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json")
    ap.add_argument("--markdown")
    args = ap.parse_args(argv)
    import torch

    from tileattn import api_layers

    from .env import environment
    from .harness import measure
    from .records import save_run

    if not torch.cuda.is_available():
        print("tileattn bench layers needs a CUDA GPU; nothing measured")
        return 1
    env, records, lines = environment(), [], []
    dtype = torch.bfloat16
    lines += ["### linear, bf16: median us (weight GB/s)", "",
              "| shape | rows | N x K | tileattn | F.linear | tileattn / F.linear |", "|---|---|---|---|---|---|"]
    for name, (n, k) in LINEAR_SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=dtype) / k ** 0.5
        for rows in args.rows:
            x = torch.randn(rows, k, device="cuda", dtype=dtype)
            ours = api_layers.linear(x, w)
            theirs = torch.nn.functional.linear(x, w)
            err = ((ours.float() - theirs.float()).norm() / theirs.float().norm()).item()
            cells = []
            for impl, fn in (("tileattn", lambda: api_layers.linear(x, w)),
                             ("F.linear", lambda: torch.nn.functional.linear(x, w))):
                t = measure(fn, reps=args.reps, memory=False)
                gbps = w.numel() * w.element_size() / (t.median_ms * 1e-3) / 1e9
                records.append({"suite": "layers", "op": "linear", "shape": name, "rows": rows, "n": n, "k": k,
                                "impl": impl, "timing": t.as_dict(), "gbps": gbps, "rel_err_vs_torch": err})
                cells.append((t.median_ms * 1e3, gbps))
            lines.append(f"| {name} | {rows} | {n} x {k} | {cells[0][0]:.1f} ({cells[0][1]:,.0f}) | "
                         f"{cells[1][0]:.1f} ({cells[1][1]:,.0f}) | {cells[1][0] / cells[0][0]:.2f}x |")
    lines += ["", "### fused steps, one decode token, bf16: median us", "",
              "| step | shape | tileattn | eager torch | speed-up |", "|---|---|---|---|---|"]
    for step, shape, ours, theirs in _fused_cases(torch, api_layers, dtype):
        times = [measure(fn, reps=args.reps, memory=False).median_ms * 1e3 for fn in (ours, theirs)]
        records.append({"suite": "layers", "op": step, "shape": shape, "impl": "tileattn", "us": times[0]})
        records.append({"suite": "layers", "op": step, "shape": shape, "impl": "torch", "us": times[1]})
        lines.append(f"| {step} | {shape} | {times[0]:.1f} | {times[1]:.1f} | {times[1] / times[0]:.2f}x |")
    text = "\n".join(lines)
    print(text)
    save_run(records, env, text, args.json, args.markdown)
    return 0


def _fused_cases(torch, api_layers, dtype):
    """(step, shape, tileattn fn, the eager torch sequence it replaced)."""
    F = torch.nn.functional
    dev = "cuda"
    x, r = torch.randn(1, 4096, device=dev, dtype=dtype), torch.randn(1, 4096, device=dev, dtype=dtype)
    w = torch.ones(4096, device=dev, dtype=dtype)

    def torch_norm():
        s = x + r
        return F.rms_norm(s, (4096,), w, 1e-5), s

    yield "add + RMSNorm", "1 x 4096", lambda: api_layers.add_rms_norm(x, w, 1e-5, residual=r.clone()), torch_norm
    qkv = torch.randn(1, 48 * 128, device=dev, dtype=dtype)
    qk = qkv[:, :40 * 128].view(1, 40, 128)
    inv = 1.0 / 500000.0 ** (torch.arange(0, 128, 2, device=dev).float() / 128)
    freqs = torch.arange(8192, device=dev).float()[:, None] * inv
    cos, sin = torch.cat((freqs.cos(), freqs.cos()), -1), torch.cat((-freqs.sin(), freqs.sin()), -1)
    pos = torch.tensor([1000], device=dev)

    def torch_rotary():
        c, s = cos[pos].unsqueeze(1).to(dtype), sin[pos].unsqueeze(1).to(dtype)
        return torch.addcmul(qk * c, qk.roll(64, dims=-1), s)

    yield "rotary", "1 x 40 heads x 128", lambda: api_layers.norm_rotary_(qk, pos, cos, sin), torch_rotary
    gu = torch.randn(1, 2 * 14336, device=dev, dtype=dtype)

    def torch_silu():
        g, u = gu.split(14336, -1)
        return F.silu(g) * u

    yield "SiLU * up", "1 x 14336", lambda: api_layers.silu_mul(gu), torch_silu


if __name__ == "__main__":
    raise SystemExit(main())
