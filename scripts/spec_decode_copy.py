"""Prompt-lookup speculative decoding (engine/speculative.py) on a copy task: SmolLM2 (the packaged
GGUF) asked to copy a code snippet with one renaming, greedy, with and without drafts. Prints, as
JSON, per setting the tokens, engine steps, wall seconds, drafts proposed / accepted, and whether
the tokens are identical.

    PYTHONPATH=src python3 scripts/spec_decode_copy.py [--device cpu|cuda] [--k 4] [--max-tokens 150]
"""

from __future__ import annotations

import argparse
import json
import time

from tileattn.engine import LLM, SamplingParams

SNIPPET = ("def add_rms_norm(x, weight, eps, residual=None):\n"
           "    s = x if residual is None else residual.copy_(x + residual)\n"
           "    f = s.float()\n"
           "    out = weight * (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)\n"
           "    return out, s\n")
MESSAGES = [{"role": "user", "content": "Copy this code exactly, renaming weight to gamma:\n" + SNIPPET}]


def run(device: str, k: int, max_tokens: int) -> dict:
    llm = LLM("smollm2", device=device, max_model_len=1024, kv_cache_blocks=128, num_speculative_tokens=k)
    llm.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)  # warm-up
    engine = llm.engine
    before = engine.stats()
    steps, real_step = [0], engine.step

    def counted(*args, **kwargs):
        steps[0] += 1
        return real_step(*args, **kwargs)

    engine.step = counted
    start = time.perf_counter()
    out = llm.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)[0].outputs[0]
    seconds = time.perf_counter() - start
    after = engine.stats()
    llm.shutdown()
    return {"k": k, "tokens": len(out.token_ids), "steps": steps[0], "seconds": round(seconds, 3),
            "drafted": after["spec_drafted_tokens"] - before["spec_drafted_tokens"],
            "accepted": after["spec_accepted_tokens"] - before["spec_accepted_tokens"], "token_ids": out.token_ids}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=150)
    args = ap.parse_args()
    plain, drafted = run(args.device, 0, args.max_tokens), run(args.device, args.k, args.max_tokens)
    identical = plain.pop("token_ids") == drafted.pop("token_ids")
    print(json.dumps({"device": args.device, "plain": plain, "speculative": drafted, "identical_tokens": identical}))


if __name__ == "__main__":
    main()
