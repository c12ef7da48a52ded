"""`tileattn bench layers`: the decoder's fused elementwise steps at one decode token (residual
add + RMSNorm, q/k rotary, SiLU(gate) * up), tileattn.api_layers beside the eager torch sequence
each replaces (what the engine ran before), GPU only. Median us per call.
Timing: tileattn.bench.harness.measure (CUDA events, L2 flushed before each repetition).
"""

from __future__ import annotations

import argparse

from .harness import positive_int


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="tileattn bench layers", description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=positive_int, default=20)
    ap.add_argument("--json")
    ap.add_argument("--markdown")
    args = ap.parse_args(argv)
    import torch

    from tileattn import api_layers
    from tileattn.runtime import require_gpu

    from .env import environment
    from .harness import measure
    from .records import save_run

    require_gpu()  # NoGPUError, which `tileattn` reports in one line, as for the other kernel benchmarks
    env, records, lines = environment(), [], []
    dtype = torch.bfloat16
    lines += ["### fused steps, one decode token, bf16: median us", "",
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

    def torch_norm():  # the residual add allocates its sum; the fused step writes it into r
        s = x + r
        return F.rms_norm(s, (4096,), w, 1e-5), s

    yield "add + RMSNorm", "1 x 4096", lambda: api_layers.add_rms_norm(x, w, 1e-5, residual=r), torch_norm
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
