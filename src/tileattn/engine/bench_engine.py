"""`tileattn bench engine`: the engine beside what a PyTorch user would run instead (GPU only).

Measured, each with its peers in the same run, on random-init weights of real shapes made on the
machine from a config (written once as an HF checkpoint under --workdir, reused afterwards):
- decode: batch-1 greedy, Llama-3-8B shape bf16, 32-token prompt, 256 new tokens. tok/s over the
  decode tokens (first token excluded) and achieved bandwidth = bytes read per token x tok/s,
  where bytes per token = all weights except the input embedding table (one row of it is read)
  + the KV cache of the average context. Peers: transformers eager `generate`, and the gpt-fast
  style decode a PyTorch user would write (engine/compile_peer.py: plain torch over the same
  weights, static KV cache, SDPA, the step under `torch.compile(mode="reduce-overhead", fullgraph=True)`).
- throughput: nano-vllm's workload (256 requests, seed 0, random token ids, prompt and output
  lengths uniform in [100, 1024], ignore EOS): output tokens / wall time, Qwen3-0.6B shape (and
  Llama-3-8B shape). Peer: transformers' continuous-batching `generate_batch` (one max_new_tokens
  for all: the workload's mean, 562, so the output token count matches in expectation).
- ttft: time to first token of one 1024-token prompt (median of 5 distinct prompts, no cache hits).
- startup: engine construction (load from disk + KV-cache sizing + CUDA-graph capture).
--quick: smaller shapes and workloads, no torch.compile peer; finishes in under 2 minutes.
--profile: also print (and record in the JSON rows) where each engine step's time goes, per step
kind: schedule / prepare / h2d / forward / sample / postprocess on the host and the forward and
sampling time on the GPU (profiler.py). --cprofile PATH dumps a cProfile of the measured engine
runs (pstats format). --shape / --requests / --max-len / --new-tokens override the plan, e.g. the
host-overhead profile on a CPU: --device cpu --shape tiny --only throughput --requests 256
--max-len 120 --no-peers --profile.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import random
import statistics
import time

from ..bench.clocks import ClockSampler, format_summary

SHAPES = {
    "llama3-8b": dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=4096,
                      intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256, rms_norm_eps=1e-5, rope_theta=500000.0,
                      max_position_embeddings=8192, tie_word_embeddings=False),
    "llama3.2-1b": dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=2048,
                        intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                        num_key_value_heads=8, vocab_size=128256, rms_norm_eps=1e-5, rope_theta=500000.0,
                        max_position_embeddings=8192, tie_word_embeddings=True),
    "qwen3-0.6b": dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], hidden_size=1024,
                       intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936, rms_norm_eps=1e-6,
                       rope_theta=1000000.0, max_position_embeddings=40960, tie_word_embeddings=True),
    # Gemma 2 2B: head_dim 256, a 4096-key window on every other layer, attention and final caps
    # (the paged kernels' softcap + window variants at d = 256)
    "gemma2-2b": dict(model_type="gemma2", architectures=["Gemma2ForCausalLM"], hidden_size=2304,
                      intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8, num_key_value_heads=4,
                      head_dim=256, vocab_size=256000, rms_norm_eps=1e-6, rope_theta=10000.0,
                      max_position_embeddings=8192, sliding_window=4096, query_pre_attn_scalar=256,
                      attn_logit_softcapping=50.0, final_logit_softcapping=30.0, tie_word_embeddings=True),
    # Gemma 3 1B: head_dim 256, one KV head, 512-key windows on five layers of six, q/k norms
    "gemma3-1b": dict(model_type="gemma3_text", architectures=["Gemma3ForCausalLM"], hidden_size=1152,
                      intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1,
                      head_dim=256, vocab_size=262144, rms_norm_eps=1e-6, max_position_embeddings=32768,
                      sliding_window=512, query_pre_attn_scalar=256, tie_word_embeddings=True),
    # Qwen1.5-MoE-A2.7B (Qwen2-MoE): 60 experts of ffn 1408, top-4 not renormalised, a shared expert
    # of ffn 5632 with its gate, q/k/v biases; 14.3 B parameters, 2.7 B of them active per token
    "qwen1.5-moe-a2.7b": dict(model_type="qwen2_moe", architectures=["Qwen2MoeForCausalLM"], hidden_size=2048,
                              intermediate_size=5632, moe_intermediate_size=1408, shared_expert_intermediate_size=5632,
                              num_experts=60, num_experts_per_tok=4, norm_topk_prob=False, num_hidden_layers=24,
                              num_attention_heads=16, num_key_value_heads=16, vocab_size=151936, rms_norm_eps=1e-6,
                              rope_theta=1000000.0, max_position_embeddings=8192, tie_word_embeddings=False),
    # gpt-oss-20b: 32 biased experts of ffn 2880, top-4, attention sinks, a 128-key window on every other layer,
    # head_dim 64 with GQA 64/8, YaRN; 20.9 B parameters, 3.6 B of them active per token (bf16 here, MXFP4 released)
    "gpt-oss-20b": dict(model_type="gpt_oss", architectures=["GptOssForCausalLM"], hidden_size=2880, intermediate_size=2880,
                        num_local_experts=32, num_experts_per_tok=4, num_hidden_layers=24, num_attention_heads=64,
                        num_key_value_heads=8, head_dim=64, vocab_size=201088, rms_norm_eps=1e-5, sliding_window=128,
                        max_position_embeddings=131072, tie_word_embeddings=False,
                        rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                         "truncate": False, "rope_theta": 150000.0,
                                         "original_max_position_embeddings": 4096}),
    # Host-overhead profiling on a CPU: the model costs little, the engine's bookkeeping shows.
    "tiny": dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=64, intermediate_size=96,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=32000,
                 rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=8192, tie_word_embeddings=True),
}


# What each part runs: the full benchmark, and --quick (< 2 minutes on an H200).
FULL = dict(decode_shape="llama3-8b", new_tokens=256, throughput_shapes=("qwen3-0.6b", "llama3-8b"),
            requests=256, max_len=1024, ttft_shape="llama3-8b", prompt_len=1024)
QUICK = dict(decode_shape="llama3.2-1b", new_tokens=64, throughput_shapes=("qwen3-0.6b",),
             requests=32, max_len=256, ttft_shape="qwen3-0.6b", prompt_len=1024)


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="tileattn bench engine", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small shapes and workloads (< 2 minutes)")
    ap.add_argument("--json", metavar="PATH", help="write the results as JSON")
    ap.add_argument("--workdir", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "tileattn-bench-engine"),
                    help="where the random-init checkpoints are written (reused between runs)")
    ap.add_argument("--only", choices=["decode", "throughput", "ttft"], action="append",
                    help="run only these parts (repeatable)")
    ap.add_argument("--no-peers", action="store_true", help="the engine only")
    ap.add_argument("--no-compile-peer", action="store_true", help="skip the torch.compile peer (slow to compile)")
    ap.add_argument("--tensor-parallel-size", type=int, nargs="+", default=[1], metavar="N",
                    help="run the engine's decode and throughput parts at each of these sizes (e.g. 1 2)")
    ap.add_argument("--profile", action="store_true",
                    help="time each engine step's phases (host and GPU) and print them per step kind")
    ap.add_argument("--cprofile", metavar="PATH", help="dump a cProfile of the measured engine runs")
    ap.add_argument("--kernels", action="store_true",
                    help="decode: device time per step by kernel (torch.profiler), after the measured run")
    ap.add_argument("--kernel-steps", type=int, default=64, metavar="N",
                    help="--kernels: decode steps profiled (one generation of N + 1 tokens; default 64)")
    ap.add_argument("--shape", choices=sorted(SHAPES), help="the model shape of every part (overrides the plan)")
    ap.add_argument("--requests", type=int, help="throughput: number of requests (overrides the plan)")
    ap.add_argument("--max-len", type=int, help="throughput: longest prompt / output (overrides the plan)")
    ap.add_argument("--new-tokens", type=int, help="decode: tokens generated (overrides the plan)")
    ap.add_argument("--decode-runs", type=int, default=5, metavar="N",
                    help="decode: measured generations after the warm-up one; tok/s and TTFT are their medians "
                         "(the runs' tok/s are recorded too)")
    ap.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # "cpu": the tests' smoke run
    args = ap.parse_args(argv)
    if args.decode_runs < 1:
        ap.error(f"--decode-runs must be at least 1, got {args.decode_runs}")
    if args.kernel_steps < 1:
        ap.error(f"--kernel-steps must be at least 1, got {args.kernel_steps}")
    return args


def bench_engine_main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from tileattn.api_layers import gemv_max_rows

    on_gpu = args.device.startswith("cuda")
    if on_gpu and not torch.cuda.is_available():
        print("tileattn bench engine needs a CUDA GPU (none visible to torch); nothing measured")
        return 1
    args.dtype = torch.bfloat16 if on_gpu else torch.float32
    parts = set(args.only or ["decode", "throughput", "ttft"])
    quick = args.quick
    from tileattn.bench.env import environment  # versions, commit, command: what a record must name

    results = {"gpu": torch.cuda.get_device_name(args.device) if on_gpu else "cpu",
               "torch": torch.__version__, "quick": quick, "gemv_max_rows": gemv_max_rows(args.device),
               "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "environment": environment(), "rows": []}
    if on_gpu:
        print(f"projections: tileattn's GEMV kernel up to {results['gemv_max_rows']} rows, cuBLAS above "
              f"(TILEATTN_GEMV_MAX_ROWS={os.environ.get('TILEATTN_GEMV_MAX_ROWS', 'unset')})")
    try:
        import transformers
        results["transformers"] = transformers.__version__
    except ImportError:
        args.no_peers = True
    rows = results["rows"]
    plan = dict(QUICK if quick else FULL)
    if args.shape:
        plan.update(decode_shape=args.shape, throughput_shapes=(args.shape,), ttft_shape=args.shape)
    for key in ("requests", "max_len", "new_tokens"):
        if getattr(args, key) is not None:
            plan[key] = getattr(args, key)
    args.cprofiler = None
    if args.cprofile:
        import cProfile

        args.cprofiler = cProfile.Profile()
    if "decode" in parts:
        model_type = SHAPES[plan["decode_shape"]]["model_type"]
        llama_family = model_type in ("llama", "qwen2", "qwen3")  # what compile_peer covers
        rows += bench_decode(args, plan["decode_shape"], plan["new_tokens"],
                             compile_peer=llama_family and not (quick or args.no_compile_peer or args.no_peers))
    if "throughput" in parts:
        for shape in plan["throughput_shapes"]:
            rows += bench_throughput(args, shape, plan["requests"], plan["max_len"])
    if "ttft" in parts:
        rows += bench_ttft(args, plan["ttft_shape"], plan["prompt_len"])
    print_table(rows)
    if args.cprofiler is not None:
        args.cprofiler.dump_stats(args.cprofile)
        print(f"wrote {args.cprofile} (python -m pstats {args.cprofile}; sort tottime; stats 40)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
        print(f"wrote {args.json}")
    return 0


# ---- checkpoints ---------------------------------------------------------------------------------

def checkpoint(args, shape: str, need_model: bool = True):
    """(path, transformers model on args.device in args.dtype, or None when not needed and the
    checkpoint is already on disk) for a random-init checkpoint of ``shape``. A checkpoint counts
    as on disk when its marker file holds this shape's config (a run cut short leaves none)."""
    import torch
    import transformers

    path = os.path.join(args.workdir, shape)
    marker = os.path.join(path, "bench-shape.json")
    wanted = json.dumps(SHAPES[shape], sort_keys=True)
    on_disk = False
    if os.path.isfile(marker):
        with open(marker) as f:
            on_disk = f.read() == wanted
    if on_disk and not need_model:
        return path, None
    config = transformers.AutoConfig.for_model(**SHAPES[shape])
    config.architectures = SHAPES[shape]["architectures"]
    torch.manual_seed(0)
    with torch.device(args.device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=args.dtype)
    model.eval()
    if not on_disk:
        os.makedirs(path, exist_ok=True)
        model.save_pretrained(path)
        _save_tokenizer(path, SHAPES[shape]["vocab_size"])
        with open(marker, "w") as f:
            f.write(wanted)
    return path, model


def _save_tokenizer(path, vocab_size: int) -> None:
    """A word-level tokenizer with one word per id of the model's vocabulary ("<s>", "</s>", then
    "t2", "t3", ...): the benchmarks feed token ids, and every id a random-init model samples decodes
    to text, so servers that stream text (tileattn serve, transformers serve) emit a chunk per token."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = {"<s>": 0, "</s>": 1, **{f"t{i}": i for i in range(2, vocab_size)}}
    tok = Tokenizer(models.WordLevel(words, unk_token="t2"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>", "tokenizer_class": "PreTrainedTokenizerFast"}, f)


def _free() -> None:
    """Return the GPU memory of objects the caller has just dropped (models, engines, graphs)."""
    import torch

    gc.collect()
    torch._dynamo.reset()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _sync(device) -> None:
    import torch

    if str(device).startswith("cuda"):
        torch.cuda.synchronize(device)


def _engine(args, path, **options):
    from .llm import LLMEngine

    return LLMEngine.from_model(path, device=args.device, dtype=args.dtype, **options)


def _run_to_end(engine):
    first = None
    while engine.has_unfinished_requests():
        outs = engine.step()
        if first is None and any(o.outputs[0].token_ids for o in outs):
            first = time.perf_counter()
    return first


# ---- decode --------------------------------------------------------------------------------------

def decode_bytes_per_token(model_cfg, dtype_bytes: int, context: float) -> float:
    """Weights read per decode token (the input embedding table excepted: one row is read; it is
    read in full as the output head when tied; an MoE layer reads its router, the top-k experts a
    token picks and its shared expert) plus the KV cache of ``context`` tokens."""
    c = model_cfg
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    attention = c.hidden_size * (q + 2 * kv) + q * c.hidden_size
    moe = c.extra.get("moe")
    mlps = [3 * c.hidden_size * c.intermediate_size] * c.num_layers
    if moe:
        sparse = c.hidden_size * (moe["num_experts"] + 3 * moe["top_k"] * moe["expert_ffn"]
                                  + (3 * moe["shared_ffn"] + 1 if moe["shared_ffn"] else 0))
        mlps = [sparse if is_sparse else dense for is_sparse, dense in zip(moe["sparse_layers"], mlps)]
    weights = c.num_layers * attention + sum(mlps) + c.vocab_size * c.hidden_size  # + the output head
    kv_cache = 2 * c.num_layers * kv * context
    return (weights + kv_cache) * dtype_bytes


def bench_decode(args, shape, new_tokens, compile_peer):
    import torch

    from .sampling_params import SamplingParams

    path, model = checkpoint(args, shape, need_model=not args.no_peers)
    prompt = random.Random(0).choices(range(1000, 20000), k=32)
    rows = []
    if not args.no_peers:
        ids = torch.tensor([prompt], device=args.device)
        rows.append(_peer("transformers eager", shape, "decode", _hf_decode, model, ids, new_tokens))
        if compile_peer:
            rows.append(_peer("torch.compile static-cache decode (gpt-fast style)", shape, "decode",
                              _compiled_decode, model, ids, new_tokens))
    del model
    _free()
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    for tp in args.tensor_parallel_size:
        engine = _engine(args, path, max_num_seqs=8, max_model_len=2048, tensor_parallel_size=tp)
        runs, ttfts = [], []  # per measured generation: tok/s after the first token, time to it
        # The GPU's clocks and power during the measured runs (rank 0's GPU): bench/clocks.py.
        sampler = ClockSampler(engine.device.index) if engine.device.type == "cuda" else None
        try:
            with contextlib.ExitStack() as sampling:
                for attempt in range(1 + args.decode_runs):  # the first run warms up (kernel compile / load)
                    if attempt == 1 and sampler is not None:
                        sampling.enter_context(sampler)
                    measured = attempt == args.decode_runs  # the profilers watch the last one
                    profiler = engine.enable_profiling() if measured and args.profile else None
                    engine.add_request(f"decode{attempt}", prompt, params)
                    start = time.perf_counter()
                    with _cprofiled(args, measured):
                        first = _run_to_end(engine)
                    end = time.perf_counter()
                    if attempt:
                        runs.append((new_tokens - 1) / (end - first))
                        ttfts.append((first - start) * 1e3)
            kernels = kernel_profile(engine, prompt, args.kernel_steps + 1) if args.kernels else None
        finally:
            engine.shutdown()
        tok_s = statistics.median(runs)
        # Bytes of the whole model (all ranks together): the bandwidth of TP=N is summed over N GPUs.
        per_token = decode_bytes_per_token(engine.model_config, 2, len(prompt) + new_tokens / 2)
        rows.append({"bench": "decode", "shape": shape, "system": _system(tp), "tensor_parallel_size": tp,
                     "tok_s": tok_s, "tok_s_runs": runs, "bandwidth_TBs": per_token * tok_s / 1e12,
                     "bytes_per_token": per_token, "startup_s": engine.startup_seconds,
                     "ttft_ms": statistics.median(ttfts)})
        if sampler is not None:
            rows[-1]["gpu_clocks"] = sampler.summary()
            print(f"decode {shape} TP={tp}: {format_summary(rows[-1]['gpu_clocks'])}")
        _add_profile(rows[-1], profiler, f"decode {shape} TP={tp}")
        if kernels is not None:
            print(format_kernel_profile(kernels, f"decode {shape} TP={tp}"))
            rows[-1]["kernels"] = kernels
        del engine
        _free()
    for row in rows:
        if row.get("tok_s") is not None:
            row.setdefault("bandwidth_TBs", per_token * row["tok_s"] / 1e12)
    return rows


def kernel_profile(engine, prompt, new_tokens: int) -> dict:
    """Where a decode step's device time goes, by kernel: one request of `new_tokens` greedy tokens,
    its prefill step run first and left out, the decode steps under torch.profiler (CUPTI records
    the kernels of CUDA-graph replays one by one). On the CPU it times the CPU ops instead, so the
    tests' CPU run exercises the same code.

    Returns {"steps": decode steps profiled, "device": "cuda" | "cpu", "step_us": kernel time per
    step (summed; overlapping kernels count twice; CPU ops by self time), "wall_us": the profiled
    window (first start to last end) per step, "idle_us": the part of that window in which nothing ran, per step, "kernels": [{"name",
    "calls_per_step", "us_per_step", "share"}, ...] longest first, "gaps": [{"before", "after",
    "count_per_step", "us_per_step"}, ...]: where the idle time sits (the activity that ended last
    before each idle stretch and the one that ends it), longest first}. With programmatic dependent
    launch a kernel's duration includes its wait for the previous one; the wall and idle times do not
    depend on that."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from .sampling_params import SamplingParams

    cuda = engine.device.type == "cuda"
    engine.add_request("kernel-profile", prompt, SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True))
    engine.step()  # the prefill (and, with async scheduling, the first decode launch)
    steps = 0
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
    wanted = DeviceType.CUDA if cuda else DeviceType.CPU
    picked = [e for e in prof.events() if e.device_type == wanted]
    events = sorted(((e.time_range.start, e.time_range.end, e.name) for e in picked),
                    key=lambda e: e[0])  # (start us, end us, name)
    totals: dict[str, list] = {}  # name -> [calls, microseconds]
    for e in picked:
        # Kernels do not nest: a kernel's span is its time. CPU ops do: their self time, so that a
        # parent op does not count its children's time again.
        entry = totals.setdefault(e.name, [0, 0.0])
        entry[0] += 1
        entry[1] += e.time_range.end - e.time_range.start if cuda else e.self_cpu_time_total
    wall, idle, gaps = idle_gaps(events)
    steps = max(steps, 1)
    step_us = sum(us for _, us in totals.values()) / steps
    kernels = [{"name": name, "calls_per_step": calls / steps, "us_per_step": us / steps,
                "share": us / steps / step_us if step_us else 0.0}
               for name, (calls, us) in sorted(totals.items(), key=lambda kv: -kv[1][1])]
    where_idle = [{"before": before, "after": after, "count_per_step": count / steps, "us_per_step": us / steps}
                  for (before, after), (count, us) in sorted(gaps.items(), key=lambda kv: -kv[1][1])]
    return {"steps": steps, "device": "cuda" if cuda else "cpu", "step_us": step_us, "wall_us": wall / steps,
            "idle_us": idle / steps, "kernels": kernels, "gaps": where_idle}


def idle_gaps(events) -> tuple[float, float, dict]:
    """(wall, idle, gaps) of activities [(start, end, name)] sorted by start: the span from the first
    start to the last end, the part of it covered by none of them, and that part by (the name of
    the activity that ended last before a stretch, the name of the one that ends it) -> [count,
    total]. Overlapping and nested activities count once."""
    gaps: dict[tuple, list] = {}
    if not events:
        return 0.0, 0.0, gaps
    idle = 0.0
    reach, last = events[0][1], events[0][2]  # the latest end so far and whose it is
    for start, end, name in events[1:]:
        if start > reach:
            idle += start - reach
            entry = gaps.setdefault((last, name), [0, 0.0])
            entry[0] += 1
            entry[1] += start - reach
        if end >= reach:
            reach, last = end, name
    return reach - events[0][0], idle, gaps


def format_kernel_profile(report: dict, title: str, top: int = 25) -> str:
    """The `top` longest kernels of `kernel_profile`'s report as a text table, then the longest
    idle gaps."""
    what = "kernel" if report["device"] == "cuda" else "CPU op"
    lines = [f"{title}: {report['step_us']:.1f} us of {what} time per decode step ({report['steps']} steps), "
             f"{report['wall_us']:.1f} us of wall time, {report['idle_us']:.1f} us of it idle",
             f"{'us/step':>9} {'share':>6} {'calls':>6}  {what}"]
    for k in report["kernels"][:top]:
        lines.append(f"{k['us_per_step']:9.1f} {k['share']:6.1%} {k['calls_per_step']:6.1f}  {k['name'][:110]}")
    lines.append(f"{'idle us':>9} {'':>6} {'gaps':>6}  between (the one that ended last -> the next to start)")
    for g in report["gaps"][:top // 2]:
        lines.append(f"{g['us_per_step']:9.1f} {'':>6} {g['count_per_step']:6.1f}  {g['before'][:52]} -> {g['after'][:52]}")
    return "\n".join(lines)


def _cprofiled(args, measured: bool):
    """Collect the cProfile of a measured run (--cprofile); a no-op context otherwise."""
    import contextlib

    if args.cprofiler is None or not measured:
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def collect():
        args.cprofiler.enable()
        try:
            yield
        finally:
            args.cprofiler.disable()
    return collect()


def _add_profile(row, profiler, title) -> None:
    """Print the step profile of a measured run (--profile) and keep it in the row."""
    if profiler is None:
        return
    print(profiler.table(title))
    row["profile"] = profiler.report()


def _system(tensor_parallel_size: int) -> str:
    return "tileattn.engine" if tensor_parallel_size == 1 else f"tileattn.engine TP={tensor_parallel_size}"


def _seconds(device, run) -> float:
    """Wall seconds of run(), the device synchronized before and after."""
    _sync(device)
    start = time.perf_counter()
    run()
    _sync(device)
    return time.perf_counter() - start


def _decode_tok_s(device, generate, new_tokens) -> float:
    """Decode tok/s of generate(n) (n greedy tokens from the prompt) = (new_tokens - 1) / (time of
    new_tokens - time of 1 token): the prompt and the first token drop out."""
    one = _seconds(device, lambda: generate(1))
    full = _seconds(device, lambda: generate(new_tokens))
    return (new_tokens - 1) / (full - one)


def _hf_decode(model, ids, new_tokens):
    """transformers' eager `generate`, each length run once untimed first (warm-up)."""
    def generate(n):
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)

    for n in (1, new_tokens):
        generate(n)
    return {"tok_s": _decode_tok_s(ids.device, generate, new_tokens)}


def _compiled_decode(model, ids, new_tokens):
    """The compile peer (engine/compile_peer.py) on the transformers model's weights, after one
    untimed run that compiles the step and records its CUDA graph; compile_s: that first run's
    seconds (compilation included)."""
    from .compile_peer import GreedyDecoder

    decoder = GreedyDecoder(model, max_len=ids.shape[1] + new_tokens)
    compile_s = _seconds(ids.device, lambda: decoder.generate(ids, new_tokens))
    return {"tok_s": _decode_tok_s(ids.device, lambda n: decoder.generate(ids, n), new_tokens),
            "compile_s": compile_s}


def _peer(system, shape, bench, fn, *args):
    """A peer's row; a peer that fails (an API that moved between transformers versions) is
    recorded with its error instead of ending the benchmark."""
    row = {"bench": bench, "shape": shape, "system": system}
    try:
        row.update(fn(*args))
    except Exception as exc:  # noqa: BLE001 (any failure of a peer is reported, not raised)
        row["error"] = f"{type(exc).__name__}: {exc}"[:300]
        print(f"{system}: failed: {row['error']}")
    return row


# ---- throughput ----------------------------------------------------------------------------------

def workload(requests: int, max_len: int):
    """nano-vllm's bench.py workload: seed 0, random ids, lengths uniform in [100, max_len]."""
    rng = random.Random(0)
    prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(100, max_len))] for _ in range(requests)]
    outputs = [rng.randint(100, max_len) for _ in range(requests)]
    return prompts, outputs


def bench_throughput(args, shape, requests, max_len):

    from .llm import LLM
    from .sampling_params import SamplingParams

    path, model = checkpoint(args, shape, need_model=not args.no_peers)
    prompts, lengths = workload(requests, max_len)
    rows = []
    if not args.no_peers:
        rows.append(_peer("transformers generate_batch", shape, "throughput", _hf_batch, model, prompts,
                          round(statistics.mean(lengths))))
    del model
    _free()
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    for tp in args.tensor_parallel_size:
        llm = LLM(path, device=args.device, dtype=args.dtype, max_model_len=2 * max_len + 16,
                  max_num_seqs=min(256, requests), tensor_parallel_size=tp)
        try:
            llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
            profiler = llm.engine.enable_profiling() if args.profile else None
            _sync(args.device)
            start = time.perf_counter()
            with _cprofiled(args, True):
                outs = llm.generate(prompts, params, use_tqdm=False)
            _sync(args.device)
            seconds = time.perf_counter() - start
        finally:
            llm.shutdown()
        produced = sum(len(o.outputs[0].token_ids) for o in outs)
        rows.append({"bench": "throughput", "shape": shape, "system": _system(tp), "tensor_parallel_size": tp,
                     "requests": requests, "output_tokens": produced, "seconds": seconds,
                     "tok_s": produced / seconds, "startup_s": llm.engine.startup_seconds,
                     "preemptions": llm.engine.stats()["num_preemptions"],
                     "kv_blocks": llm.engine.block_manager.num_blocks})
        _add_profile(rows[-1], profiler, f"throughput {shape} TP={tp}")
        del llm
        _free()
    return rows


def _hf_batch(model, prompts, new_tokens):
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    # untimed warm-up, as the engine gets one: one-off set-up (cuBLAS handles, kernels' first loads) out
    # of the timed batch
    model.generate_batch(inputs=prompts[:2], generation_config=GenerationConfig(
        max_new_tokens=min(new_tokens, 16), do_sample=False, eos_token_id=-1, pad_token_id=0))
    _sync(model.device)
    start = time.perf_counter()
    out = model.generate_batch(inputs=prompts, generation_config=config)
    _sync(model.device)
    seconds = time.perf_counter() - start
    produced = sum(len(o.generated_tokens) for o in out.values())
    return {"requests": len(prompts), "output_tokens": produced, "seconds": seconds, "tok_s": produced / seconds}


# ---- time to first token -------------------------------------------------------------------------

def bench_ttft(args, shape, prompt_len):

    from .sampling_params import SamplingParams

    path, model = checkpoint(args, shape, need_model=False)
    del model
    _free()
    engine = _engine(args, path, max_model_len=4096, max_num_seqs=8)
    rng = random.Random(1)
    times = []
    for i in range(6):  # the first one warms up
        prompt = [rng.randint(1000, 30000) for _ in range(prompt_len)]
        _sync(args.device)
        start = time.perf_counter()
        engine.add_request(f"ttft{i}", prompt, SamplingParams(temperature=0, max_tokens=1))
        while engine.has_unfinished_requests():
            engine.step()
        times.append(time.perf_counter() - start)
    row = {"bench": "ttft", "shape": shape, "system": "tileattn.engine", "prompt_tokens": prompt_len,
           "ttft_ms": statistics.median(times[1:]) * 1e3, "startup_s": engine.startup_seconds}
    del engine
    _free()
    return [row]


def print_table(rows) -> None:
    print(f"{'bench':<11}{'shape':<13}{'system':<44}{'tok/s':>10}{'TB/s':>7}{'TTFT ms':>9}{'startup s':>10}")
    for r in rows:
        def num(key, fmt):
            return format(r[key], fmt) if r.get(key) is not None else "-"
        print(f"{r['bench']:<11}{r['shape']:<13}{r['system']:<44}{num('tok_s', ',.0f'):>10}"
              f"{num('bandwidth_TBs', '.2f'):>7}{num('ttft_ms', '.1f'):>9}{num('startup_s', '.1f'):>10}"
              + (f"  failed: {r['error'][:60]}" if "error" in r else ""))


if __name__ == "__main__":
    raise SystemExit(bench_engine_main())
