"""Tensor parallelism on the CPU: 2 gloo ranks (this process + one spawned worker) against the
same checkpoint at tensor_parallel_size=1 (fp32).

Three tiny checkpoints cover the three KV layouts and the layers that split differently:
- llama3: GQA 4 heads / 2 KV heads -> 1 KV head per rank; untied embedding and LM head;
- llama2: MHA 4/4 -> 2 KV heads per rank; q/k/v, o, gate/up and down biases (row-parallel biases
  added once, after the all-reduce);
- qwen3: 4 heads / 1 KV head -> the KV head replicated on both ranks; q/k RMSNorm, head_dim 24,
  tied embeddings (the vocab-parallel embedding is the LM head).
Then Gemma 2 and 3 (sandwich norms, per-layer rotary tables), Qwen2-MoE (each expert's ffn split
across the ranks under a replicated router, the shared expert split as an MLP, a dense layer) and
Granite (its residual multiplier folded into each rank's slice of o and down), Phi-3 (fused
checkpoint tensors split into their parts before each rank takes its slice; partial rotary) and
gpt-oss (each rank's heads' sinks, the experts' gate/up biases by rank, the down bias added once)
and OLMo 2 / 3 (q/k norms over the whole projection: the sum of squares all-reduced, divided by the
KV head's replication when both ranks hold it).

Bounds: logits ||tp2 - tp1|| / ||tp1|| < 1e-5 (measured 2.8e-7 to 6.1e-7: the row-parallel sums add two
fp32 partial products where one rank sums all); greedy tokens identical (batched, chunked prefill,
small blocks), prompt logprobs and sampled logprobs within 1e-4 absolute, seeded samples identical.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time

import pytest
import torch
import torch.distributed as dist

from tileattn.engine import LLM, SamplingParams
from tileattn.engine.config import EngineConfig, ModelConfig
from tileattn.engine.distributed import (
    INLINE_PAYLOAD,
    MULTICAST_OFF,
    TensorParallel,
    TensorParallelError,
    Workers,
    check_tensor_parallel,
    rank_devices,
)
from tileattn.engine.loader import find_smollm2_gguf
from tileattn.engine.models import LlamaForCausalLM

from .checkpoints import engine_logits, make_checkpoint, rel_error

PROMPTS = [[0, 17, 203, 5, 99, 42, 300, 7, 8, 150, 61, 2, 33, 250, 19, 77, 180, 4, 90, 12],
           [0, 5, 9], [0] + list(range(40, 90)), [0, 300, 301, 302] * 6]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
OPTIONS = dict(device="cpu", max_model_len=128, kv_cache_blocks=64, block_size=8, max_num_batched_tokens=32)

# name -> (architecture, config overrides, KV heads per rank at TP=2)
CASES = {"llama3-gqa": ("llama3", {}, 1),
         "llama2-biases": ("llama2", {}, 2),
         "qwen3-replicated-kv": ("qwen3", {"num_key_value_heads": 1}, 1),
         "gemma2-sandwich-norms": ("gemma2", {}, 1),
         "gemma3-local-rope": ("gemma3", {}, 1),
         "qwen2-moe-experts": ("qwen2-moe", {}, 1),
         "granite-multipliers": ("granite", {}, 1),
         "phi3-fused-partial-rotary": ("phi3", {}, 1),
         "gpt-oss-sinks-biased-experts": ("gpt-oss", {}, 1),
         "olmo2-replicated-kv-whole-k-norm": ("olmo2", {"num_key_value_heads": 1}, 1),
         "olmo3-windows-local-rope": ("olmo3", {}, 1),
         "glm4-interleaved-partial-rotary": ("glm4", {}, 1),
         "exaone4-nope-full-layers": ("exaone4", {}, 1)}


def _tokens(outputs):
    return [[c.token_ids for c in o.outputs] for o in outputs]


@pytest.fixture(scope="class", params=sorted(CASES))
def pair(request, tmp_path_factory):
    """(name, TP=1 LLM, TP=2 LLM) on one checkpoint; the TP=2 engine is shut down afterwards (class
    scope: before the tests outside the class start their own, one process group per process)."""
    arch, overrides, _ = CASES[request.param]
    path = str(tmp_path_factory.mktemp(request.param))
    make_checkpoint(path, arch, overrides=overrides)
    single = LLM(path, **OPTIONS)
    split = LLM(path, tensor_parallel_size=2, **OPTIONS)
    yield request.param, single, split
    split.shutdown()
    assert not dist.is_initialized(), "shutdown left the process group behind"


class TestAgainstSingleRank:
    def test_logits_match_single_rank(self, pair):
        name, single, split = pair
        for prompt in PROMPTS[:3]:
            ref, ours = engine_logits(single.engine, prompt), engine_logits(split.engine, prompt)  # [T, V]
            assert ours.shape == ref.shape
            err = rel_error(ours, ref)
            assert err < 1e-5, f"{name}: TP=2 logits relative error {err:.2e} vs TP=1 (bound 1e-5)"


    def test_kv_cache_holds_this_ranks_heads(self, pair):
        name, single, split = pair
        per_rank = CASES[name][2]
        assert split.engine.runner.kv_cache.shape[-2] == per_rank, name
        assert single.engine.runner.kv_cache.shape[-2] == single.engine.model_config.num_kv_heads


    def test_greedy_batch_matches_single_rank(self, pair):
        """Four prompts at once, chunked prefill (32-token budget) mixed with decodes, 8-token blocks."""
        name, single, split = pair
        ref = _tokens(single.generate(PROMPTS, GREEDY, use_tqdm=False))
        ours = _tokens(split.generate(PROMPTS, GREEDY, use_tqdm=False))
        assert ours == ref, f"{name}: TP=2 greedy tokens differ\n tp2 {ours}\n tp1 {ref}"
        stats = split.engine.stats()
        assert stats["num_free_blocks"] == stats["num_total_blocks"], f"{name}: blocks leaked: {stats}"


    def test_embeddings_match_single_rank(self, pair):
        """Embedding requests (the last prompt token's final hidden state, on rank 0 after the
        all-reduces) of several prompts, one over several chunked-prefill steps."""
        name, single, split = pair
        ref, ours = single.embed(PROMPTS, use_tqdm=False), split.embed(PROMPTS, use_tqdm=False)
        for a, b in zip(ours, ref):
            err = rel_error(torch.tensor(a.embedding), torch.tensor(b.embedding))
            assert err < 1e-5, f"{name}: TP=2 embedding relative error {err:.2e} vs TP=1 (bound 1e-5)"

    def test_logprobs_and_seeded_sampling_match_single_rank(self, pair):
        """Prompt logprobs (scored after the step: the workers' logits command), sampled-token logprobs
        and seeded samples (n = 2) against TP=1."""
        name, single, split = pair
        params = SamplingParams(temperature=0.8, top_p=0.9, seed=3, n=2, max_tokens=8, ignore_eos=True,
                                logprobs=2, prompt_logprobs=2)
        ref, ours = single.generate(PROMPTS[0], params, use_tqdm=False)[0], split.generate(PROMPTS[0], params,
                                                                                         use_tqdm=False)[0]
        assert [c.token_ids for c in ours.outputs] == [c.token_ids for c in ref.outputs], name

        def close(a: dict, b: dict) -> bool:
            return a.keys() == b.keys() and all(abs(a[k] - b[k]) < 1e-4 for k in a)

        assert len(ours.prompt_logprobs) == len(ref.prompt_logprobs)
        assert all(close(a, b) for a, b in zip(ours.prompt_logprobs[1:], ref.prompt_logprobs[1:])), name
        for c_ours, c_ref in zip(ours.outputs, ref.outputs):
            assert all(close(a, b) for a, b in zip(c_ours.logprobs, c_ref.logprobs)), name


def test_prefill_step_larger_than_one_message(tmp_path):
    """Four 400-token prompts prefilled in one step: the step's inputs exceed the first message and
    travel in a second broadcast; greedy tokens identical to TP=1."""
    path = str(tmp_path)
    make_checkpoint(path, "llama3")
    prompts = [[int(t) for t in torch.randint(2, 384, (400,), generator=torch.Generator().manual_seed(i))]
               for i in range(4)]
    assert 3 * 4 * 400 > INLINE_PAYLOAD, "the step would fit one message: make the prompts longer"
    options = {**OPTIONS, "max_model_len": 448, "kv_cache_blocks": 256, "max_num_batched_tokens": 2048}
    ref = _tokens(LLM(path, **options).generate(prompts, GREEDY, use_tqdm=False))
    split = LLM(path, tensor_parallel_size=2, **options)
    try:
        assert _tokens(split.generate(prompts, GREEDY, use_tqdm=False)) == ref
    finally:
        split.shutdown()


def test_bad_divisibility_is_refused_before_any_process_starts(tmp_path):
    path = str(tmp_path)
    make_checkpoint(path, "llama3")  # 4 heads, 2 KV heads, intermediate 96, vocab 384
    before, start = set(multiprocessing.active_children()), time.monotonic()
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 .*num_attention_heads=4.*num_key_value_heads=2"):
        LLM(path, tensor_parallel_size=3, **OPTIONS)
    assert set(multiprocessing.active_children()) <= before, "a worker was started for a model that cannot split"
    assert time.monotonic() - start < 10
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive int"):
        LLM(path, tensor_parallel_size=0, **OPTIONS)


def _config(**fields) -> ModelConfig:
    base = dict(architecture="LlamaForCausalLM", vocab_size=384, hidden_size=64, intermediate_size=96,
                num_layers=1, num_heads=8, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6, rope_theta=1e4,
                max_position_embeddings=64)
    return ModelConfig(**{**base, **fields})


@pytest.mark.parametrize("fields, size, named", [
    ({"num_heads": 6, "num_kv_heads": 6}, 4, "num_attention_heads=6"),
    ({"num_kv_heads": 4}, 8, None),                      # 4 KV heads on 8 ranks: replicated, fine
    ({"num_heads": 12, "num_kv_heads": 6}, 4, "num_key_value_heads=6"),  # neither divides
    ({"intermediate_size": 90}, 4, "intermediate_size=90"),
    ({"vocab_size": 385}, 2, "vocab_size=385"),
])
def test_divisibility_rules(fields, size, named):
    cfg = _config(**fields)
    if named is None:
        check_tensor_parallel(cfg, size)
        return
    with pytest.raises(ValueError, match=named):
        check_tensor_parallel(cfg, size)
    with pytest.raises(ValueError, match=named):  # the model refuses it too, before allocating
        LlamaForCausalLM(cfg, torch.float32, 16, TensorParallel(0, size))


def test_kv_head_of_each_rank_when_replicated():
    # 8 query heads, 2 KV heads, 4 ranks: rank r has query heads 2r, 2r+1, which read KV head r // 2
    assert [TensorParallel(r, 4).kv_heads(2) for r in range(4)] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    assert [TensorParallel(r, 2).kv_heads(4) for r in range(2)] == [(0, 2), (2, 2)]


def test_fewer_gpus_than_asked(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 needs 2 GPUs from cuda:0, but torch sees 1"):
        rank_devices(torch.device("cuda", 0), 2)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    with pytest.raises(ValueError, match=r"needs 2 GPUs from cuda:3"):
        rank_devices(torch.device("cuda", 3), 2)
    assert rank_devices(torch.device("cuda", 2), 2) == [torch.device("cuda", 2), torch.device("cuda", 3)]


def kill_worker_mid_run(engine, pid: int, prompts, bound_s: float) -> None:
    """Queue ``prompts`` with 400 tokens each (seconds of steps), SIGKILL worker ``pid`` from another
    thread 50 ms after the third step (so mid-run, most likely inside a step) and step on: a step
    must raise TensorParallelError naming rank 1 and SIGKILL within ``bound_s`` of the kill."""
    long_run = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"long{i}", prompt, long_run)
    running, killed = threading.Event(), []

    def kill():
        running.wait()
        time.sleep(0.05)
        os.kill(pid, signal.SIGKILL)
        killed.append(time.monotonic())

    killer = threading.Thread(target=kill, daemon=True)
    killer.start()
    steps = 0
    with pytest.raises(TensorParallelError, match=r"worker rank 1 \(pid \d+\) was killed by signal SIGKILL"):
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
            if steps == 3:
                running.set()
    killer.join(5)
    assert killed, f"the step failed after {steps} steps, before the worker was killed"
    elapsed = time.monotonic() - killed[0]
    assert elapsed < bound_s, f"the failure took {elapsed:.1f} s to surface (bound {bound_s} s)"


def test_worker_killed_mid_run_is_a_clear_error(tmp_path):
    """SIGKILL the worker from another thread while rank 0 steps through 16 requests of 400 tokens
    (seconds of work, so the kill lands mid-run, most likely inside a step): the step raises
    TensorParallelError naming rank 1 and the signal within 15 s of the kill, later calls fail at
    once, shutdown leaves no process or process group behind."""
    path = str(tmp_path)
    make_checkpoint(path, "llama3")
    before = set(multiprocessing.active_children())
    llm = LLM(path, tensor_parallel_size=2, **{**OPTIONS, "max_model_len": 512, "kv_cache_blocks": 1024})
    engine = llm.engine
    try:
        (pid,) = engine.workers.pids
        with open(f"/proc/{pid}/environ", "rb") as f:  # what the worker's NCCL would read
            env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
        for key, value in MULTICAST_OFF.items():
            assert env.get(key.encode()) == value.encode(), f"worker environment: {key}={env.get(key.encode())}"
        kill_worker_mid_run(engine, pid, PROMPTS * 4, bound_s=15)
        start = time.monotonic()
        with pytest.raises(TensorParallelError, match="worker rank 1"):
            llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
        assert time.monotonic() - start < 2
    finally:
        llm.shutdown()
    assert set(multiprocessing.active_children()) <= before
    assert not dist.is_initialized()


def test_worker_that_raises_at_start_is_named_with_its_traceback():
    """A worker whose device cannot be selected (cuda:64) raises before the rendezvous: rank 0
    reports its rank and traceback instead of waiting for it, and leaves nothing behind."""
    config = EngineConfig("unused", device="cpu")
    before, start = set(multiprocessing.active_children()), time.monotonic()
    with pytest.raises(TensorParallelError, match=r"worker rank 1 \(pid \d+\) raised:\nTraceback(.|\n)*set_device"):
        Workers(config, [torch.device("cpu"), torch.device("cuda", 64)])
    assert time.monotonic() - start < 60
    assert set(multiprocessing.active_children()) <= before
    assert not dist.is_initialized()


def test_cache_too_small_is_rank_zeros_error_and_stops_the_workers(tmp_path):
    """Every rank finds the same problem building its runner; the user gets rank 0's ValueError
    (not a worker-died error) and no worker or process group is left."""
    path = str(tmp_path)
    make_checkpoint(path, "llama3")
    before = set(multiprocessing.active_children())
    with pytest.raises(ValueError, match=r"cannot hold one sequence of max_model_len=128"):
        LLM(path, tensor_parallel_size=2, **{**OPTIONS, "kv_cache_blocks": 4})
    assert set(multiprocessing.active_children()) <= before
    assert not dist.is_initialized()


def test_smollm2_gguf_on_three_ranks():
    """The real SmolLM2-135M GGUF (9 heads, 3 KV heads: one per rank; Q/K rows un-permuted before
    slicing) on 3 gloo ranks: logits within 1e-5 of one rank (measured 1.4e-6 over the 37-token
    chat prompt), the same greedy answer."""
    try:
        gguf_path = find_smollm2_gguf()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    options = dict(device="cpu", max_model_len=256, kv_cache_blocks=32)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    greedy = SamplingParams(temperature=0, max_tokens=12)
    single = LLM(gguf_path, **options)
    split = LLM(gguf_path, tensor_parallel_size=3, **options)
    try:
        prompt = single.tokenizer.encode(single.tokenizer.apply_chat_template(messages), add_special_tokens=False)
        err = rel_error(engine_logits(split.engine, prompt), engine_logits(single.engine, prompt))
        assert err < 1e-5, f"TP=3 logits relative error {err:.2e} vs TP=1 (bound 1e-5)"
        ours = split.chat(messages, greedy, use_tqdm=False)[0].outputs[0]
        ref = single.chat(messages, greedy, use_tqdm=False)[0].outputs[0]
        assert ours.token_ids == ref.token_ids, f"TP=3 {ours.text!r} vs TP=1 {ref.text!r}"
    finally:
        split.shutdown()


def test_rank_zero_error_mid_step_stops_the_workers(tmp_path, monkeypatch):
    """An exception in rank 0 during a step (here its sampler, after the workers' forward) reaches
    the caller as is; the workers, possibly waiting in a collective rank 0 will not join, are
    stopped, and later calls raise TensorParallelError instead of running out of step."""
    path = str(tmp_path)
    make_checkpoint(path, "llama3")
    llm = LLM(path, tensor_parallel_size=2, **OPTIONS)
    try:
        (pid,) = llm.engine.workers.pids

        def broken(*args):
            raise ZeroDivisionError("sampler bug")

        monkeypatch.setattr(llm.engine.runner.sampler, "sample", broken)
        with pytest.raises(ZeroDivisionError, match="sampler bug"):
            llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
        with pytest.raises(TensorParallelError, match=r"rank 0 raised ZeroDivisionError \(sampler bug\)"):
            llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
        assert not any(p.pid == pid for p in multiprocessing.active_children()), "the worker still runs"
    finally:
        llm.shutdown()
    assert not dist.is_initialized()
