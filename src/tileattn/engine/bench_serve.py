"""`tileattn bench serve`: a load generator for any OpenAI-compatible server, in the style of
`vllm bench serve`.

Random prompts of a given input length (token ids, or text made from random ids with a
tokenizer), a fixed output length (with ``ignore_eos`` where the server accepts it), sent as
streaming requests with Poisson arrivals at each of a sweep of request rates ("inf" sends all at
once) and/or under a concurrency cap. Per rate it reports, as `vllm bench serve` defines them:
TTFT (send -> first content chunk), TPOT ((latency - TTFT) / (output tokens - 1), per request),
ITL (every gap between two content chunks), E2EL (send -> end of stream): mean, median, p90, p99;
and request / output-token / total-token throughput over the run's wall time.

Output token counts come from the server's streamed ``usage`` when it sends one (requested with
``stream_options.include_usage``); otherwise from the number of content chunks (a lower bound for
servers that group tokens into words), and the result says which.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import sys
import time
from dataclasses import dataclass, field

try:  # the GPU machine has httpx; this repo's CPU venv ships the same API as httpx2
    import httpx
except ImportError:  # pragma: no cover - depends on the environment
    import httpx2 as httpx


@dataclass
class RequestResult:
    prompt_len: int
    success: bool = False
    error: str = ""
    ttft: float = 0.0                 # s
    latency: float = 0.0              # s, send -> end of stream
    itl: list[float] = field(default_factory=list)  # s, gaps between content chunks
    output_tokens: int = 0
    usage_reported: bool = False


def _percentiles(values: list[float], scale: float = 1000.0) -> dict:
    """mean / median / p90 / p99 / std of ``values`` (seconds) in ms; zeros when empty."""
    if not values:
        return {"mean": 0.0, "median": 0.0, "p90": 0.0, "p99": 0.0, "std": 0.0}
    ordered = sorted(values)

    def pct(p):  # linear interpolation between closest ranks (numpy's default)
        k = (len(ordered) - 1) * p / 100
        lo, hi = math.floor(k), math.ceil(k)
        return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)

    return {"mean": statistics.fmean(values) * scale, "median": pct(50) * scale, "p90": pct(90) * scale,
            "p99": pct(99) * scale, "std": (statistics.pstdev(values) if len(values) > 1 else 0.0) * scale}


def make_prompts(num: int, input_len: int, output_len: int, range_ratio: float, vocab_size: int,
                 tokenizer=None, as_text: bool = False, seed: int = 0) -> list[tuple[object, int, int]]:
    """``num`` (prompt, prompt_len, output_len): lengths uniform in [len*(1-r), len*(1+r)], token ids
    uniform in [0, vocab_size). as_text: decode the ids with ``tokenizer``, re-encode and cut to the
    length (so the server sees about prompt_len tokens). Raises ValueError for bad sizes."""
    if num < 1 or input_len < 1 or output_len < 1 or vocab_size < 2:
        raise ValueError(f"num_prompts, input_len, output_len must be >= 1 and vocab_size >= 2, got "
                         f"{num}, {input_len}, {output_len}, {vocab_size}")
    if not 0 <= range_ratio < 1:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    if as_text and tokenizer is None:
        raise ValueError("text prompts need a tokenizer (--tokenizer)")
    rng = random.Random(seed)
    out = []
    for _ in range(num):
        n_in = rng.randint(max(1, int(input_len * (1 - range_ratio))), int(input_len * (1 + range_ratio)))
        n_out = rng.randint(max(1, int(output_len * (1 - range_ratio))), int(output_len * (1 + range_ratio)))
        ids = [rng.randrange(vocab_size) for _ in range(n_in)]
        if as_text:
            ids = tokenizer.encode(tokenizer.decode(ids), add_special_tokens=False)[:n_in]
            out.append((tokenizer.decode(ids), len(ids), n_out))
        else:
            out.append((ids, n_in, n_out))
    return out


def _payload(args, prompt, output_len: int) -> dict:
    body = {"model": args.model, "stream": True, "stream_options": {"include_usage": True},
            "max_tokens": output_len, "temperature": args.temperature}
    if args.endpoint.endswith("/chat/completions"):
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if args.ignore_eos:
        body["ignore_eos"] = True
    body.update(args.extra_body)
    return body


def _has_tokens(chunk: dict) -> bool:
    """A chunk that carries generated text, or token ids (tileattn/vLLM with return_token_ids:
    tokens whose text is held back, such as the first bytes of a multi-byte character)."""
    choices = chunk.get("choices") or []
    if not choices:
        return False
    c = choices[0]
    part = (c.get("delta") or {}) if "delta" in c else c
    return bool(part.get("content") or part.get("text") or part.get("token_ids"))


async def send_request(client, url: str, body: dict, prompt_len: int, headers: dict) -> RequestResult:
    """One streaming request. Times are perf_counter at send and at each network read that carried
    content (events that arrive in one read arrive together: their gaps are 0). The SSE lines are
    split here from raw bytes, one library call per read instead of one per line, so the client
    keeps up with tens of thousands of events per second."""
    result = RequestResult(prompt_len=prompt_len)
    chunks = 0
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                result.error = f"HTTP {resp.status_code}: {(await resp.aread())[:300].decode(errors='replace')}"
                return result
            pending = b""
            done = False
            async for data in resp.aiter_bytes():
                now = time.perf_counter()
                *lines, pending = (pending + data).split(b"\n")
                for line in lines:
                    if not line.startswith(b"data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == b"[DONE]":
                        done = True
                        break
                    chunk = json.loads(payload)
                    if "error" in chunk:
                        result.error = f"stream error: {chunk['error']}"
                        return result
                    usage = chunk.get("usage")
                    if usage and usage.get("completion_tokens") is not None:
                        result.output_tokens, result.usage_reported = usage["completion_tokens"], True
                        result.prompt_len = usage.get("prompt_tokens") or prompt_len  # chat: with the template
                    if _has_tokens(chunk):
                        if chunks == 0:
                            result.ttft = now - start
                        else:
                            result.itl.append(now - last)
                        last = now
                        chunks += 1
                if done:
                    break
        result.latency = time.perf_counter() - start
        if not result.usage_reported:
            result.output_tokens = chunks
        result.success = chunks > 0
        if not result.success:
            result.error = ("the stream carried no text (for tileattn/vLLM, --extra-body "
                            "'{\"return_token_ids\": true}' makes tokens without text count)")
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


async def run_load(args, prompts, rate: float, client) -> tuple[list[RequestResult], float]:
    """Send every prompt with Poisson (gamma, when burstiness != 1) arrivals at ``rate`` req/s,
    at most args.max_concurrency in flight. Returns the results and the wall time in s."""
    url = args.base_url.rstrip("/") + args.endpoint
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limit = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    rng = random.Random(args.seed + 1)

    async def limited(prompt, prompt_len, output_len):
        if limit is None:
            return await send_request(client, url, _payload(args, prompt, output_len), prompt_len, headers)
        async with limit:
            return await send_request(client, url, _payload(args, prompt, output_len), prompt_len, headers)

    tasks = []
    start = time.perf_counter()
    for i, (prompt, prompt_len, output_len) in enumerate(prompts):
        if i and math.isfinite(rate):
            await asyncio.sleep(rng.gammavariate(args.burstiness, 1.0 / (rate * args.burstiness)))
        tasks.append(asyncio.create_task(limited(prompt, prompt_len, output_len)))
    results = await asyncio.gather(*tasks)
    return list(results), time.perf_counter() - start


def summarize(results: list[RequestResult], duration: float, rate: float, max_concurrency) -> dict:
    ok = [r for r in results if r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return {
        "request_rate": "inf" if math.isinf(rate) else rate, "max_concurrency": max_concurrency,
        "duration_s": duration, "completed": len(ok), "failed": len(results) - len(ok),
        "total_input_tokens": total_in, "total_output_tokens": total_out,
        "output_tokens_from_usage": all(r.usage_reported for r in ok) if ok else False,
        "request_throughput": len(ok) / duration, "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
        "ttft_ms": _percentiles([r.ttft for r in ok]), "tpot_ms": _percentiles(tpot),
        "itl_ms": _percentiles([x for r in ok for x in r.itl]), "e2el_ms": _percentiles([r.latency for r in ok]),
        "errors": sorted({r.error for r in results if not r.success})[:5],
    }


def format_summary(s: dict) -> str:
    lines = [f"{' Serving benchmark: rate ' + str(s['request_rate']) + ' req/s, max concurrency ' + str(s['max_concurrency']) + ' ':=^72}",
             f"{'Successful / failed requests:':<40}{s['completed']} / {s['failed']}",
             f"{'Benchmark duration (s):':<40}{s['duration_s']:.2f}",
             f"{'Total input / output tokens:':<40}{s['total_input_tokens']} / {s['total_output_tokens']}"
             + ("" if s["output_tokens_from_usage"] else "  (output counted as chunks)"),
             f"{'Request throughput (req/s):':<40}{s['request_throughput']:.2f}",
             f"{'Output token throughput (tok/s):':<40}{s['output_throughput']:.2f}",
             f"{'Total token throughput (tok/s):':<40}{s['total_token_throughput']:.2f}",
             f"{'':<16}{'mean':>11}{'median':>11}{'p90':>11}{'p99':>11}  (ms)"]
    for name, key in (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"), ("E2EL", "e2el_ms")):
        v = s[key]
        lines.append(f"{name:<16}{v['mean']:>11.2f}{v['median']:>11.2f}{v['p90']:>11.2f}{v['p99']:>11.2f}")
    lines += [f"error: {e}" for e in s["errors"]]
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tileattn bench serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (no /v1)")
    p.add_argument("--endpoint", default="/v1/completions", help="/v1/completions or /v1/chat/completions")
    p.add_argument("--model", default=None, help="model name to send (default: the first of /v1/models)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--prompt-format", choices=["ids", "text"], default="ids",
                   help="token ids (completions only) or text decoded from random ids (needs --tokenizer)")
    p.add_argument("--tokenizer", default=None, help="HF checkpoint directory whose tokenizer.json makes text prompts")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="token ids are drawn from [0, V) (default: the tokenizer's vocabulary)")
    p.add_argument("--request-rate", nargs="+", default=["inf"],
                   help="requests/s, one run per value (a sweep); inf sends all at once")
    p.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight at once")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrival gaps (1 = Poisson)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action="store_true", help="send ignore_eos (vLLM/tileattn extra field)")
    p.add_argument("--extra-body", type=json.loads, default={}, help="JSON merged into every request body")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--result-json", default=None, help="write config + per-rate results here")
    return p


async def _main(args) -> list[dict]:
    tokenizer = None
    if args.tokenizer:
        from .tokenizer import Tokenizer

        tokenizer = Tokenizer.from_hf_dir(args.tokenizer)
    vocab = args.vocab_size or (tokenizer.vocab_size if tokenizer is not None else None)
    if vocab is None:
        raise ValueError("give --vocab-size or --tokenizer (random token ids need a vocabulary size)")
    if args.prompt_format == "ids" and args.endpoint.endswith("/chat/completions"):
        raise ValueError("chat endpoints take text: use --prompt-format text --tokenizer DIR")
    rates = [float(r) for r in args.request_rate]
    if any(not r > 0 for r in rates):
        raise ValueError(f"request rates must be > 0 (or inf), got {args.request_rate}")

    def prompts_for(num, seed):
        return make_prompts(num, args.random_input_len, args.random_output_len, args.random_range_ratio,
                            vocab, tokenizer, args.prompt_format == "text", seed)

    limits = httpx.Limits(max_connections=args.max_concurrency, max_keepalive_connections=args.max_concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout), limits=limits) as client:
        if args.model is None:
            resp = await client.get(args.base_url.rstrip("/") + "/v1/models")
            resp.raise_for_status()
            args.model = resp.json()["data"][0]["id"]
        url = args.base_url.rstrip("/") + args.endpoint
        ((prompt, prompt_len, _),) = prompts_for(1, args.seed - 1)
        probe = await send_request(client, url, _payload(args, prompt, 4), prompt_len,
                                   {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {})
        if not probe.success:
            raise RuntimeError(f"the test request to {url} failed: {probe.error}")
        summaries = []
        for i, rate in enumerate(rates):
            # Fresh prompts per run: a server's prefix cache must not carry one run into the next.
            results, duration = await run_load(args, prompts_for(args.num_prompts, args.seed + 1000 * i), rate, client)
            summary = summarize(results, duration, rate, args.max_concurrency)
            print(format_summary(summary), flush=True)
            summaries.append(summary)
    return summaries


def bench_serve_main(argv=None) -> int:
    """CLI entry: parse ``argv`` (see --help), run the sweep, print and optionally save JSON.
    Returns 0 when every request of every run succeeded, 1 otherwise, 2 for bad options."""
    args = _parser().parse_args(argv)
    try:
        summaries = asyncio.run(_main(args))
    except (ValueError, RuntimeError, httpx.HTTPError) as exc:
        print(f"tileattn bench serve: {exc}", file=sys.stderr)
        return 2
    if args.result_json:
        from tileattn.bench.env import environment  # versions, commit, command: what a record must name

        config = {k: v for k, v in vars(args).items() if k != "api_key"}
        with open(args.result_json, "w") as f:
            # the client's environment: the server (its GPU, its commit) may be another machine
            json.dump({"config": config, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                       "client_environment": environment(), "runs": summaries}, f, indent=2)
    return 0 if all(s["failed"] == 0 for s in summaries) else 1


if __name__ == "__main__":
    raise SystemExit(bench_serve_main())

