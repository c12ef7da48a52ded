"""Dropout with its rng state in device memory against the same call with an int seed: the time of the
kRngState kernel forms (what a CUDA-graph-captured dropout call runs) beside the by-value forms.

    PYTHONPATH=src python scripts/rng_state_timing.py

tileattn.attention(q, k, v, causal, dropout_p=0.1, seed=1234 | a [1234, 0] int64 CUDA tensor), B = 4, H = 16,
N = 4096, bf16, d = 128 and 256, causal and not; the forward without autograd and forward+backward; median of
5 x 10 calls timed with CUDA events, the int seed first. Prints a markdown table (ratio = int seed time / seed
tensor time).
"""

import statistics

import torch

import tileattn


def median_ms(fn) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 10)
    return statistics.median(times)


def main() -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    state = torch.tensor([1234, 0], dtype=torch.int64, device="cuda")
    print("| d | causal | pass | int seed ms | seed tensor ms | ratio |\n|---|---|---|---|---|---|")
    for d in (128, 256):
        q, k, v, dout = (torch.randn(4, 16, 4096, d, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(4))
        for causal in (False, True):
            for grad in (False, True):
                qg, kg, vg = (x.detach().requires_grad_(grad) for x in (q, k, v))

                def call(seed):
                    def step():
                        with torch.set_grad_enabled(grad):
                            out = tileattn.attention(qg, kg, vg, causal, dropout_p=0.1, seed=seed)
                            if grad:
                                torch.autograd.grad(out, (qg, kg, vg), dout)
                    return step

                by_value, by_state = median_ms(call(1234)), median_ms(call(state))
                print(f"| {d} | {causal} | {'fwd+bwd' if grad else 'fwd'} | {by_value:.3f} | {by_state:.3f} | "
                      f"{by_value / by_state:.2f} |", flush=True)


if __name__ == "__main__":
    main()
