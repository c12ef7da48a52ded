"""Embedding requests (PoolingParams, LLM.embed) on the CPU against transformers' base model: the
last prompt token's final hidden state (after the last norm), normalised or cut to its first
dimensions. Bound: relative error < 1e-5 (both float32; measured 4e-7 to 6e-7)."""

import pytest
import torch

from tileattn.engine import LLM, PoolingParams, SamplingParams

from .checkpoints import make_checkpoint

PROMPTS = [[0, 5, 9, 17, 33], list(range(2, 40)), [7], [0, 300, 301, 302] * 6]


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3-embed")
    hf = make_checkpoint(path, "qwen3")
    # a 16-token budget: the 38- and 24-token prompts are embedded over several chunked-prefill steps
    llm = LLM(str(path), device="cpu", max_model_len=64, kv_cache_blocks=32, block_size=8, max_num_batched_tokens=16)
    return hf, llm


def hidden_last(hf, prompt) -> torch.Tensor:
    with torch.no_grad():
        return hf.model(torch.tensor([prompt])).last_hidden_state[0, -1].double()


def rel(a, b) -> float:
    a = torch.as_tensor(a, dtype=torch.float64)
    return float((a - b).norm() / b.norm())


def test_embeddings_match_transformers_last_hidden_state(qwen3):
    hf, llm = qwen3
    outs = llm.embed(PROMPTS, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        ref = hidden_last(hf, prompt)
        assert out.outputs == [] and out.finished and out.prompt_token_ids == prompt
        assert len(out.embedding) == hf.config.hidden_size
        assert rel(out.embedding, ref / ref.norm()) < 1e-5
    stats = llm.engine.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"] and not llm.engine.pooling_requests


def test_dimensions_and_unnormalised(qwen3):
    hf, llm = qwen3
    ref = hidden_last(hf, PROMPTS[0])
    raw = llm.embed(PROMPTS[0], PoolingParams(normalize=False), use_tqdm=False)[0].embedding
    assert rel(raw, ref) < 1e-5
    cut = llm.embed(PROMPTS[0], PoolingParams(dimensions=10), use_tqdm=False)[0].embedding
    assert len(cut) == 10 and rel(cut, ref[:10] / ref[:10].norm()) < 1e-5  # cut first, then normalised


def test_embeddings_beside_generations_leave_both_unchanged(qwen3):
    """Embedding and generation requests in the same steps (one engine, mixed prefill chunks and
    decodes): the generations' greedy tokens equal those run alone, the embeddings those run alone."""
    hf, llm = qwen3
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy, use_tqdm=False)]
    vectors = [o.embedding for o in llm.embed(PROMPTS, use_tqdm=False)]
    engine = llm.engine
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"gen-{i}", prompt, greedy)
        engine.add_request(f"emb-{i}", prompt, PoolingParams())
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert [done[f"gen-{i}"].outputs[0].token_ids for i in range(len(PROMPTS))] == alone
    for i in range(len(PROMPTS)):
        assert rel(done[f"emb-{i}"].embedding, torch.tensor(vectors[i], dtype=torch.float64)) < 1e-6


def test_prompt_of_max_model_len_and_prefix_cache_hit(qwen3):
    hf, llm = qwen3
    prompt = [(7 * i) % 300 + 2 for i in range(64)]  # max_model_len tokens: no room to generate, fine to embed
    ref = hidden_last(hf, prompt)
    first = llm.embed(prompt, use_tqdm=False)[0]
    again = llm.embed(prompt, use_tqdm=False)[0]  # its full blocks come from the prefix cache
    assert again.num_cached_tokens >= 56
    for out in (first, again):
        assert rel(out.embedding, ref / ref.norm()) < 1e-5
    with pytest.raises(ValueError, match="leaves no room"):
        llm.generate(prompt, SamplingParams(max_tokens=1), use_tqdm=False)


def test_bad_embedding_requests_are_refused_before_queueing(qwen3):
    _, llm = qwen3
    with pytest.raises(ValueError, match="more than max_model_len=64"):
        llm.embed(list(range(65)), use_tqdm=False)
    with pytest.raises(ValueError, match="dimensions=65 exceeds the model's hidden size 64"):
        llm.embed([1, 2], PoolingParams(dimensions=65), use_tqdm=False)
    for bad in (dict(dimensions=0), dict(dimensions=2.0), dict(normalize="yes")):
        with pytest.raises(ValueError, match=next(iter(bad))):
            PoolingParams(**bad)
    assert not llm.engine.has_unfinished_requests() and not llm.engine.pooling_requests


def test_abort_clears_the_pooling_state(qwen3):
    _, llm = qwen3
    engine = llm.engine
    engine.add_request("emb", PROMPTS[1], PoolingParams())
    assert engine.runner.pooling
    engine.step()  # the first chunk only
    engine.abort_request("emb")
    assert not engine.runner.pooling and not engine.has_unfinished_requests()
    stats = engine.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
