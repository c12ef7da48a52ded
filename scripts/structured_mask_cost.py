"""Host time of structured outputs (docs/server.md, "Structured outputs"): wrapping the tokenizer
for llguidance, compiling a JSON schema (and taking it from the cache), and the per-step token
masks of a batch of constrained rows, walked token by token through a valid answer.

    PYTHONPATH=src python3 scripts/structured_mask_cost.py [--model smollm2] [--batch 1 --batch 8 --batch 64]

Prints one JSON object. The masks run on the host (in parallel over the rows, llguidance's
threads), so the figures depend on the CPU: the record says which and how many cores.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch

from tileattn.engine import LLM
from tileattn.engine.structured import fill_bitmasks

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags", "address"],
          "properties": {"name": {"type": "string", "maxLength": 40}, "age": {"type": "integer"},
                         "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
                         "address": {"type": "object", "required": ["city", "zip"],
                                     "properties": {"city": {"type": "string"},
                                                    "zip": {"type": "string", "pattern": "[0-9]{5}"}}}}}
ANSWER = '{"name": "Ada Lovelace", "age": 36, "tags": ["math", "poetry"], "address": {"city": "London", "zip": "12345"}}'


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--batch", type=int, action="append")
    args = parser.parse_args()
    llm = LLM(args.model, device="cpu", max_model_len=256, kv_cache_blocks=16)  # the model only names the vocabulary
    grammars, spec = llm.engine.grammars, {"json": SCHEMA}
    start = time.perf_counter()
    grammars._llguidance()  # wraps the tokenizer (once per engine)
    wrap = time.perf_counter() - start
    start = time.perf_counter()
    grammars.prepare(spec)
    compile_s = time.perf_counter() - start
    start = time.perf_counter()
    grammars.prepare(spec)
    cached = time.perf_counter() - start
    vocab = llm.engine.model_config.vocab_size
    ids = llm.engine.tokenizer.encode(ANSWER, add_special_tokens=False)
    masks = {}
    for batch in args.batch or [1, 8, 64]:
        matchers = grammars.matchers(spec, batch)
        bitmask = torch.empty((batch, (vocab + 31) // 32), dtype=torch.int32)
        times = []
        for token in ids:
            start = time.perf_counter()
            fill_bitmasks(matchers, bitmask)
            times.append(time.perf_counter() - start)
            for matcher in matchers:
                assert matcher.consume_token(token), matcher.get_error()
        times.sort()
        masks[batch] = {"steps": len(times), "median_us": round(1e6 * times[len(times) // 2], 1),
                        "p90_us": round(1e6 * times[int(0.9 * len(times))], 1), "max_us": round(1e6 * times[-1], 1),
                        "total_ms": round(1e3 * sum(times), 2)}
    print(json.dumps({"model": args.model, "vocab": vocab, "cpu": platform.processor() or platform.machine(),
                      "cores": os.cpu_count(), "wrap_tokenizer_s": round(wrap, 3), "compile_s": round(compile_s, 4),
                      "cached_prepare_us": round(1e6 * cached, 1), "masks_per_batch": masks}, indent=1))


if __name__ == "__main__":
    main()
