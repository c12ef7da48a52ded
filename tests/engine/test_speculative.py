"""Speculative decoding by prompt lookup (engine/speculative.py) on a tiny Llama (CPU): the tokens
are exactly greedy decoding's, through chunked prefill, small blocks, a tight token budget,
preemption, stop ids and max_tokens landing inside a step's accepted drafts; drafts are accepted;
sampled tokens keep the distribution of sampling one token at a time (a chi-square test; measured
102.5 with 118 degrees of freedom, p = 0.84; accepting drafts that differ from the sample, even one
time in five at random, puts tokens outside the top-k)."""

from __future__ import annotations

import pytest

from tileattn.engine import LLM, SamplingParams
from tileattn.engine.config import EngineConfig
from tileattn.engine.speculative import History, accepted, propose

from .checkpoints import make_checkpoint

# the random model falls into loops on these, which prompt lookup predicts
PROMPTS = [[0, 5, 9, 17, 33, 40, 2, 7], [0] + list(range(20, 120)), [0, 300, 301, 302] * 10, [0, 11],
           [0, 40, 41, 42, 43, 44, 45] * 6]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    make_checkpoint(path, "llama3")
    return str(path)


def _run(checkpoint, params, k, **options):
    llm = LLM(checkpoint, device="cpu", **{"max_model_len": 256, "kv_cache_blocks": 128, "block_size": 4,
                                           "num_speculative_tokens": k, **options})
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    stats = llm.engine.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"], f"blocks leaked: {stats}"
    return [[(c.token_ids, c.finish_reason, c.stop_reason) for c in o.outputs] for o in outs], stats


def test_propose_and_accept():
    assert propose([1, 2, 3, 4, 1, 2, 3], 3) == [4, 1, 2]       # the 3-gram [1, 2, 3] seen before
    assert propose([5, 6, 7, 9, 6, 7], 2) == [9, 6]             # the 2-gram [6, 7]
    assert propose([5, 6, 7, 9, 8, 7], 4) == [9, 8, 7]          # only the 1-gram [7]; up to the end
    assert propose([1, 2, 3], 4) == [] and propose([], 2) == []
    assert propose([1, 2, 1, 2, 1, 2], 2) == [1, 2]             # the latest occurrence
    assert accepted([4, 5, 6], [4, 5, 9, 1]) == 2 and accepted([4], [3, 0]) == 0 and accepted([], [7]) == 0


def _latest_match_drafts(tokens, k):
    """The proposal rule written out with loops: the latest earlier occurrence of the last 3, else
    2, else 1 tokens, and the up to k tokens after it."""
    for n in (3, 2, 1):
        for i in range(len(tokens) - n - 1, -1, -1):
            if len(tokens) > n and tokens[i:i + n] == tokens[-n:]:
                return tokens[i + n:i + n + k]
    return []


def test_proposals_match_the_rule_with_and_without_history():
    """The vectorised scan, from the list and from the growing array (past its first 256 slots),
    proposes what the loops above do, step by step."""
    import random

    rng = random.Random(0)
    tokens, history = [], History()
    for _ in range(700):
        tokens.append(rng.randrange(12))  # a small alphabet: matches of every length
        want = _latest_match_drafts(tokens, 4)
        assert propose(tokens, 4, history) == want and propose(tokens, 4) == want, len(tokens)
    assert history.ids.shape[0] >= 700


@pytest.mark.parametrize("options", [
    {},                                                   # plain
    {"max_num_batched_tokens": 16},                       # chunked prefill; drafts cut by the budget
    {"kv_cache_blocks": 64, "max_num_batched_tokens": 64},  # preemption by recompute
    {"max_num_seqs": 2},                                  # a queue; drafts beside prefills
], ids=["plain", "budget", "preemption", "queue"])
def test_tokens_are_greedy_decodings(checkpoint, options):
    params = SamplingParams(temperature=0, max_tokens=90, ignore_eos=True)
    plain, _ = _run(checkpoint, params, 0, **options)
    drafted, stats = _run(checkpoint, params, 4, **options)
    assert drafted == plain
    assert stats["spec_accepted_tokens"] > 0 and stats["spec_drafted_tokens"] >= stats["spec_accepted_tokens"], stats
    if "kv_cache_blocks" in options:
        assert stats["num_preemptions"] > 0, stats


def test_stops_and_max_tokens_inside_accepted_drafts(checkpoint):
    """A stop id and max_tokens reached in the middle of a step's accepted tokens end the output
    there, as one token at a time would."""
    base, _ = _run(checkpoint, SamplingParams(temperature=0, max_tokens=90, ignore_eos=True), 0)
    stop = base[4][0][0][60]  # a token the last prompt's greedy output reaches late
    for params in (SamplingParams(temperature=0, max_tokens=90, ignore_eos=True, stop_token_ids=[stop]),
                   SamplingParams(temperature=0, max_tokens=37, ignore_eos=True),
                   SamplingParams(temperature=0, max_tokens=90)):  # EOS
        plain, _ = _run(checkpoint, params, 0)
        drafted, stats = _run(checkpoint, params, 3)
        assert drafted == plain, params
    assert any(o[0][1] == "stop" and o[0][2] == stop for o in _run(
        checkpoint, SamplingParams(temperature=0, max_tokens=90, ignore_eos=True, stop_token_ids=[stop]), 3)[0])


def test_ineligible_sequences_decode_one_token_at_a_time(checkpoint):
    """Penalised, logprob-asking or stop-string sequences get no drafts; their tokens are unchanged."""
    for params in (SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, repetition_penalty=1.3),
                   SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=1),
                   SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=["zz"])):
        plain, _ = _run(checkpoint, params, 0)
        drafted, stats = _run(checkpoint, params, 4)
        assert drafted == plain and stats["spec_drafted_tokens"] == 0, params


def test_config_bounds():
    for bad in (-1, 17, 2.0, True):
        with pytest.raises(ValueError, match="num_speculative_tokens"):
            EngineConfig(model="x", num_speculative_tokens=bad)


def _stream_all(engine):
    """Step the engine's requests (n = 1 each) to their ends: ({request id: its new_text pieces
    joined}, {request id: its final completion})."""
    streamed, final = {}, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            (c,) = out.outputs
            streamed[out.request_id] = streamed.get(out.request_id, "") + c.new_text
            if out.finished:
                final[out.request_id] = c
    return streamed, final


def test_streamed_text_with_drafts(checkpoint):
    """The step API (text every step, several tokens per step with drafts): the streamed deltas add
    up to the final text, which equals the run without drafts, also when max_tokens ends the output
    inside a step's accepted drafts."""
    from tileattn.engine import LLMEngine

    texts = {}
    for k in (0, 4):
        engine = LLMEngine.from_model(checkpoint, device="cpu", max_model_len=256, kv_cache_blocks=128, block_size=4,
                                      num_speculative_tokens=k)
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=37 + i, ignore_eos=True))
        streamed, final = _stream_all(engine)
        assert all(streamed[r] == final[r].text for r in final), k
        texts[k] = {r: (c.text, c.token_ids, c.finish_reason) for r, c in final.items()}
        if k:
            assert engine.stats()["spec_accepted_tokens"] > 0
    assert texts[4] == texts[0]


def test_sampled_tokens_keep_their_distribution(checkpoint):
    """Sampled requests with drafts (temperature 0.7, top-k 3, k = 3): 3000 requests of 10 tokens
    from a prompt the model answers with loops, which prompt lookup drafts and the samples often
    accept. Each context (the tokens before a position) seen at least 50 times has its next tokens
    tested against the exact distribution there, computed from transformers' logits with the same
    transforms: a chi-square over all those contexts together at the 0.001 level (fixed seed).
    Testing each conditional tests the joint (the product of the conditionals)."""
    import collections

    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    prompt, n = [0, 300, 301, 302] * 5, 3000
    torch.manual_seed(0)
    llm = LLM(checkpoint, device="cpu", max_model_len=64, kv_cache_blocks=1024, block_size=4, max_num_seqs=256,
              num_speculative_tokens=3)
    outs = llm.generate([prompt] * n, SamplingParams(temperature=0.7, top_k=3, max_tokens=10, ignore_eos=True),
                        use_tqdm=False)
    stats = llm.engine.stats()
    assert stats["spec_accepted_tokens"] > n / 5, f"too few drafts accepted to test them: {stats}"
    following = collections.defaultdict(collections.Counter)  # context -> next-token counts
    for out in outs:
        tokens = out.outputs[0].token_ids
        for j, token in enumerate(tokens):
            following[tuple(tokens[:j])][token] += 1
    statistic, dof = 0.0, 0
    for context, counts in following.items():
        total = sum(counts.values())
        if total < 50:
            continue
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + list(context)])).logits[0, -1]
        top = logits.topk(3)
        exact = dict(zip(top.indices.tolist(), torch.softmax(top.values.double() / 0.7, 0).tolist()))
        assert set(counts) <= set(exact), f"after {context}: tokens {set(counts) - set(exact)} outside the top 3"
        bins = [(counts[t], p * total) for t, p in exact.items() if p * total >= 5]  # rare tokens pooled
        rest = (total - sum(o for o, _ in bins), total - sum(e for _, e in bins))
        bins += [rest] if rest[1] > 1e-9 else []
        statistic += sum((o - e) ** 2 / e for o, e in bins)
        dof += len(bins) - 1
    assert dof >= 20, f"only {dof} degrees of freedom: too few repeated contexts"
    p_value = float(1 - torch.special.gammainc(torch.tensor(dof / 2, dtype=torch.float64),
                                               torch.tensor(statistic / 2, dtype=torch.float64)))
    assert p_value > 1e-3, f"chi-square {statistic:.1f} with {dof} degrees of freedom: p = {p_value:.2e}"


def _own_loop_prompt(checkpoint):
    """A prompt ending in the model's own greedy loop (so prompt-lookup drafts get accepted): (prompt,
    its greedy continuation without drafts, the first position of each of its first 24 distinct tokens)."""
    llm = LLM(checkpoint, device="cpu", max_model_len=256, kv_cache_blocks=128, block_size=4, num_speculative_tokens=0)
    loop = [0, 40, 41, 42, 43, 44, 45] * 6
    greedy = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    prompt = loop + llm.generate([loop], greedy, use_tqdm=False)[0].outputs[0].token_ids[:40]
    base = llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids
    return prompt, base, [j for j, t in enumerate(base) if t not in base[:j]][:24]


def test_eos_or_stop_id_among_accepted_drafts_ends_the_output_there(checkpoint):
    """With the model's own greedy loop in the prompt, prompt lookup drafts get accepted; a stop id
    (or EOS) that arrives as one of a step's accepted drafts must end the output there. Before
    2026-12-05 the picks after it in the same step were kept (found by a review: ...244, 21)."""
    prompt, base, firsts = _own_loop_prompt(checkpoint)
    drafted = LLM(checkpoint, device="cpu", max_model_len=256, kv_cache_blocks=128, block_size=4,
                  num_speculative_tokens=4)
    params = [SamplingParams(temperature=0, max_tokens=60, ignore_eos=True, stop_token_ids=[base[j]]) for j in firsts]
    outs = drafted.generate([prompt] * len(firsts), params, use_tqdm=False)
    assert drafted.engine.stats()["spec_accepted_tokens"] > 0
    for j, out in zip(firsts, outs):
        assert out.outputs[0].token_ids == base[:j + 1], f"stop id {base[j]} at {j}"
        assert (out.outputs[0].finish_reason, out.outputs[0].stop_reason) == ("stop", base[j])


def test_stop_id_among_accepted_drafts_adds_no_text_when_streaming(checkpoint):
    """The step API decodes every step; a stop id that arrives after other picks of the same step
    ends the text before it, as it does one token at a time and offline. Before 2026-12-05 the
    step's whole pick list was decoded, the stop token's text with it (found by a review)."""
    from tileattn.engine import LLMEngine

    prompt, base, firsts = _own_loop_prompt(checkpoint)
    engine = LLMEngine.from_model(checkpoint, device="cpu", max_model_len=256, kv_cache_blocks=128, block_size=4,
                                  num_speculative_tokens=4)
    for j in firsts:
        engine.add_request(f"r{j}", prompt, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True,
                                                           stop_token_ids=[base[j]]))
    streamed, final = _stream_all(engine)
    assert engine.stats()["spec_accepted_tokens"] > 0
    for j in firsts:
        c = final[f"r{j}"]
        assert (c.token_ids, c.finish_reason, c.stop_reason) == (base[:j + 1], "stop", base[j])
        assert c.text == streamed[f"r{j}"] == engine.tokenizer.decode(base[:j]), f"stop id {base[j]} at {j}"
