"""Engine behaviour on a tiny Llama (CPU): the paged, prefix-cached, chunked-prefill and preempted
paths give the plain run's tokens; no block leaks; stops, n > 1, abort, bad input."""

import pytest
import torch

from tileattn.engine import LLM, LLMEngine, SamplingParams

from .checkpoints import make_checkpoint

PROMPTS = [[0, 5, 9, 17, 33, 40, 2, 7], [0] + list(range(20, 120)), [0, 300, 301, 302] * 10, [0, 11]]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    make_checkpoint(path, "llama3")
    return str(path)


def run(checkpoint, prompts=PROMPTS, params=GREEDY, **options):
    llm = LLM(checkpoint, device="cpu", **{"max_model_len": 256, "kv_cache_blocks": 128, **options})
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [[c.token_ids for c in o.outputs] for o in outs], llm.engine


def assert_all_free(engine):
    stats = engine.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"], f"blocks leaked: {stats}"
    assert all(b.ref_count == 0 for b in engine.block_manager.blocks)
    assert not engine.scheduler.running and not engine.scheduler.waiting


@pytest.fixture(scope="module")
def plain(checkpoint):
    """One request at a time, a large block, everything in one step: the baseline."""
    tokens = []
    for prompt in PROMPTS:
        out, engine = run(checkpoint, [prompt], block_size=64, kv_cache_blocks=8)
        tokens += out
        assert_all_free(engine)
    return tokens


def test_batched_paged_run_matches_plain(checkpoint, plain):
    out, engine = run(checkpoint, block_size=4)
    assert out == plain
    assert_all_free(engine)


def test_chunked_prefill_matches_plain(checkpoint, plain):
    # 16-token budget: the 101-token prompt takes 7 steps, mixed with the others' decodes
    out, engine = run(checkpoint, max_num_batched_tokens=16, block_size=8)
    assert out == plain
    assert_all_free(engine)


def test_prefix_cache_hits_give_same_tokens(checkpoint, plain):
    llm = LLM(checkpoint, device="cpu", max_model_len=256, kv_cache_blocks=128, block_size=8)
    first_outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    hits_before = llm.engine.stats()["prefix_cache_hits"]
    second_outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    stats = llm.engine.stats()
    first = [[c.token_ids for c in o.outputs] for o in first_outs]
    second = [[c.token_ids for c in o.outputs] for o in second_outs]
    assert first == plain and second == plain
    # The 101-token prompt alone has 12 full blocks before its last token.
    assert stats["prefix_cache_hits"] - hits_before >= 12 * 8, stats
    # Per request: nothing cached the first time; the second time every full block before the last token
    assert [o.num_cached_tokens for o in first_outs] == [0] * len(PROMPTS)
    assert [o.num_cached_tokens for o in second_outs] == [(len(p) - 1) // 8 * 8 for p in PROMPTS]
    assert_all_free(llm.engine)


def test_preemption_by_recompute_matches_plain(checkpoint, plain):
    # 20 blocks of 8 tokens: the four sequences need 2 + 16 + 8 + 2 blocks at the end, so the
    # scheduler must preempt and recompute.
    out, engine = run(checkpoint, block_size=8, kv_cache_blocks=20, max_model_len=160)
    assert out == plain
    assert engine.stats()["num_preemptions"] > 0, "the test did not preempt: make the cache smaller"
    assert_all_free(engine)


def test_n_greater_than_one_and_seeds(checkpoint):
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    a, _ = run(checkpoint, [PROMPTS[0]], params)
    b, engine = run(checkpoint, [PROMPTS[0]], params)
    assert len(a[0]) == 3 and all(len(t) == 12 for t in a[0])
    assert a == b, "same seed, different tokens"
    assert len({tuple(t) for t in a[0]}) > 1, "the n completions of one seeded request are identical"
    c, _ = run(checkpoint, [PROMPTS[0]], SamplingParams(n=3, temperature=1.0, seed=8, max_tokens=12, ignore_eos=True))
    assert c != a
    assert_all_free(engine)


def test_stop_token_ids_eos_and_max_tokens(checkpoint, plain):
    target = plain[0][0][5]
    out = LLM(checkpoint, device="cpu", max_model_len=256, kv_cache_blocks=32).generate(
        PROMPTS[0], SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[target], ignore_eos=True),
        use_tqdm=False)[0].outputs[0]
    first = plain[0][0].index(target)
    assert out.token_ids == plain[0][0][:first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == target
    short = LLM(checkpoint, device="cpu", max_model_len=256, kv_cache_blocks=32).generate(
        PROMPTS[0], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0].outputs[0]
    assert len(short.token_ids) <= 3
    assert short.finish_reason == ("length" if len(short.token_ids) == 3 else "stop")


def _stream(engine):
    """Step one request to its end: (its new_text pieces joined, its final completion)."""
    streamed, last = "", None
    while engine.has_unfinished_requests():
        for out in engine.step():
            streamed += out.outputs[0].new_text
            last = out
    return streamed, last.outputs[0]


@pytest.mark.parametrize("include", [False, True], ids=["cut", "include_stop_str_in_output"])
def test_stop_token_text_only_with_include_stop_str_in_output(checkpoint, plain, include):
    """vLLM's rule: the stop id's own text is left out of the output, unless include_stop_str_in_output
    (before 2026-12-05 it was left out either way); streamed pieces add up to the final text."""
    llm = LLM(checkpoint, device="cpu", max_model_len=256, kv_cache_blocks=32)
    ids = plain[0][0]
    target = next(t for t in ids[3:] if llm.tokenizer.decode([t]).strip())  # a stop id with visible text
    upto = ids[:ids.index(target) + (1 if include else 0)]
    engine = llm.engine
    engine.add_request("s", PROMPTS[0], SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[target],
                                                       ignore_eos=True, include_stop_str_in_output=include))
    streamed, completion = _stream(engine)
    assert completion.stop_reason == target and completion.token_ids == ids[:ids.index(target) + 1]
    assert completion.text == llm.tokenizer.decode(upto)
    assert streamed == completion.text
    assert_all_free(engine)


def test_min_tokens_holds_off_stop_ids_eos_and_stop_strings(checkpoint, plain):
    llm = LLM(checkpoint, device="cpu", max_model_len=256, kv_cache_blocks=32)
    eos = min(llm.engine.eos_token_ids)
    target = plain[0][0][0]
    for stop_ids, bias_token, ignore_eos, reason in (([target], target, True, target), (None, eos, False, None)):
        # the bias makes the token the argmax at every step: it ends the output at the first step allowed
        params = SamplingParams(temperature=0, max_tokens=12, min_tokens=4, stop_token_ids=stop_ids,
                                logit_bias={bias_token: 100.0}, ignore_eos=ignore_eos)
        out = llm.generate(PROMPTS[0], params, use_tqdm=False)[0].outputs[0]
        assert len(out.token_ids) == 5 and bias_token not in out.token_ids[:4], out.token_ids
        assert out.token_ids[4] == bias_token and out.finish_reason == "stop" and out.stop_reason == reason
    # a stop string completed within the first min_tokens tokens is passed over
    text = llm.tokenizer.decode(plain[0][0][:6])
    stop = next(text[i:i + 2] for i in range(len(text) - 1) if text.count(text[i:i + 2]) == 1)
    cut = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=6, stop=[stop], ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.text == text[:text.index(stop)]
    # a content_stop without a reasoning parser is searched in the whole text, as a stop string
    as_content = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=6, content_stop=[stop],
                                                         ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert (as_content.finish_reason, as_content.stop_reason, as_content.text) == ("stop", stop, cut.text)
    assert as_content.token_ids == cut.token_ids  # it ended the generation there too
    held = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=6, min_tokens=6, stop=[stop],
                                                   ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert held.finish_reason == "length" and held.text == text and held.token_ids == plain[0][0][:6]
    assert_all_free(llm.engine)


def test_allowed_token_ids_restrict_the_sampled_tokens(checkpoint, plain):
    llm = LLM(checkpoint, device="cpu", max_model_len=256, kv_cache_blocks=32)
    allowed = [plain[0][0][3], 77, 301]
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0.8, seed=3, max_tokens=16, ignore_eos=True,
                                                  allowed_token_ids=allowed), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 16 and set(out.token_ids) <= set(allowed), out.token_ids
    with pytest.raises(ValueError, match="allowed_token_ids"):
        llm.generate(PROMPTS[0], SamplingParams(allowed_token_ids=[10**7]), use_tqdm=False)
    assert_all_free(llm.engine)


def test_bad_words_never_appear_in_the_output(checkpoint, plain):
    llm = LLM(checkpoint, device="cpu", max_model_len=256, kv_cache_blocks=32)

    def contains(tokens, word):
        return any(tuple(tokens[i:i + len(word)]) == word for i in range(len(tokens) - len(word) + 1))

    greedy = plain[0][0]
    word = next(w for w in (llm.tokenizer.decode(greedy[i:i + 2]).strip() for i in range(2, 20)) if w)
    forms = llm.engine._bad_words_token_ids([word])
    assert any(contains(greedy, f) for f in forms), (word, forms, greedy)  # the greedy output has it
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, bad_words=[word]),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 24 and not any(contains(out.token_ids, f) for f in forms), (forms, out.token_ids)
    assert_all_free(llm.engine)


@pytest.mark.parametrize("include", [False, True], ids=["cut", "include_stop_str_in_output"])
def test_stop_string_cuts_text_and_streams_consistently(checkpoint, plain, include):
    llm = LLM(checkpoint, device="cpu", max_model_len=256, kv_cache_blocks=32)
    full = llm.tokenizer.decode(plain[0][0])
    stop = full[len(full) // 2: len(full) // 2 + 3]
    assert len(stop) == 3 and stop in full
    engine = llm.engine
    engine.add_request("s", PROMPTS[0], SamplingParams(temperature=0, max_tokens=24, stop=[stop], ignore_eos=True,
                                                       include_stop_str_in_output=include))
    streamed, completion = _stream(engine)
    assert completion.text == full[:full.index(stop) + (len(stop) if include else 0)]
    assert streamed == completion.text, "new_text pieces do not add up to the final text"
    assert completion.finish_reason == "stop" and completion.stop_reason == stop
    assert_all_free(engine)


def test_abort_frees_blocks_and_other_requests_continue(checkpoint, plain):
    engine = LLMEngine.from_model(checkpoint, device="cpu", max_model_len=256, kv_cache_blocks=64)
    engine.add_request("keep", PROMPTS[0], GREEDY)
    engine.add_request("drop", PROMPTS[1], GREEDY)
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request("bad", [1] * 300, GREEDY)  # one bad request: rejected alone
    engine.step()
    engine.abort_request("drop")
    engine.abort_request("unknown")  # no-op
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert {o.request_id for o in outs} == {"keep"}
    assert outs[-1].outputs[0].token_ids == plain[0][0]
    assert_all_free(engine)


def test_prompt_logprobs_and_logprobs(checkpoint):
    llm = LLM(checkpoint, device="cpu", max_model_len=256, kv_cache_blocks=32, max_num_batched_tokens=16)
    prompt = PROMPTS[1]  # 101 tokens: scored over 7 chunks
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=4, logprobs=2, prompt_logprobs=1,
                                              ignore_eos=True), use_tqdm=False)[0]
    assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
    for token, entry in zip(prompt[1:], out.prompt_logprobs[1:]):
        assert token in entry and 1 <= len(entry) <= 2 and all(v <= 0 for v in entry.values())
    completion = out.outputs[0]
    assert len(completion.logprobs) == 4
    for token, entry in zip(completion.token_ids, completion.logprobs):
        assert max(entry, key=entry.get) == token  # greedy: the chosen token is the most likely
        assert len(entry) == 2
    # per-prompt lists must match the prompts, refused before any request runs
    one = SamplingParams(temperature=0, max_tokens=1)
    with pytest.raises(ValueError, match="^2 sampling params for 1 prompts"):
        llm.generate([prompt], [one, one], use_tqdm=False)
    with pytest.raises(ValueError, match="^2 LoRA names for 1 prompts"):
        llm.generate([prompt], one, lora=[None, None], use_tqdm=False)
    assert not llm.engine.requests


def test_bad_inputs_raise_clear_errors(checkpoint, tmp_path):
    for kwargs, field in [({"temperature": -1}, "temperature"), ({"top_p": 0.0}, "top_p"),
                          ({"top_p": 1.5}, "top_p"), ({"top_k": -2}, "top_k"), ({"max_tokens": 0}, "max_tokens"),
                          ({"n": 0}, "n"), ({"min_p": 2.0}, "min_p"), ({"stop": [""]}, "stop"),
                          ({"seed": 1.5}, "^seed must be an int"), ({"presence_penalty": 2.5}, "^presence_penalty"),
                          ({"frequency_penalty": -3}, "^frequency_penalty"), ({"logprobs": -1}, "^logprobs must"),
                          ({"prompt_logprobs": 1.0}, "^prompt_logprobs must")]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**kwargs)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLMEngine.from_model(str(tmp_path / "nothing"), device="cpu")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}')
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        LLMEngine.from_model(str(bad), device="cpu")
    no_tok = tmp_path / "no_tokenizer"
    no_tok.mkdir()
    for name in ("config.json", "model.safetensors"):
        (no_tok / name).write_bytes((__import__("pathlib").Path(checkpoint) / name).read_bytes())
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        LLMEngine.from_model(str(no_tok), device="cpu")
    (no_tok / "tokenizer.json").write_text('{"version": "1.0", "model": 7}')  # JSON, but no tokenizer
    with pytest.raises(ValueError, match="^cannot read .*tokenizer.json: "):
        LLMEngine.from_model(str(no_tok), device="cpu")
    with pytest.raises(ValueError, match="cannot hold one sequence of max_model_len=256"):
        LLMEngine.from_model(checkpoint, device="cpu", max_model_len=256, kv_cache_blocks=4, block_size=16)
    with pytest.raises(ValueError, match="exceeds the model's limit"):
        LLMEngine.from_model(checkpoint, device="cpu", max_model_len=100000)
    engine = LLMEngine.from_model(checkpoint, device="cpu", max_model_len=64, kv_cache_blocks=8)
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("a", [], GREEDY)
    with pytest.raises(ValueError, match="vocabulary"):
        engine.add_request("a", [0, 10**6], GREEDY)
    vocab = engine.model_config.vocab_size
    for name in ("logprobs", "prompt_logprobs"):  # once accepted, then torch.topk failed the step of every request
        with pytest.raises(ValueError, match=f"^{name}={vocab + 1} exceeds the vocabulary's {vocab} tokens"):
            engine.add_request("a", [0, 1], SamplingParams(temperature=0, **{name: vocab + 1}))
    with pytest.raises(ValueError, match="64 tokens"):
        engine.add_request("a", [0] * 64, GREEDY)
    engine.add_request("a", [0, 1], GREEDY)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("a", [0, 1], GREEDY)
    with pytest.raises(ValueError, match="^request_id must be a str, got int"):
        engine.add_request(7, [0, 1], GREEDY)
    with pytest.raises(ValueError, match="^params must be SamplingParams or PoolingParams, got dict"):
        engine.add_request("b", [0, 1], {"temperature": 0})
    with pytest.raises(ValueError, match="^prompt must be a str or a list of token ids"):
        engine.add_request("b", [0, 1.0], GREEDY)
    with pytest.raises(ValueError, match="^this engine serves no LoRA adapters"):
        engine.remove_lora("x")
    assert list(engine.requests) == ["a"]  # none of the refused calls queued anything


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without a CUDA GPU")
def test_asking_for_cuda_without_a_gpu_is_refused_before_loading(checkpoint):
    for device in ("cuda", "cuda:0"):
        with pytest.raises(ValueError, match=f"^device='{device}' but torch sees no CUDA GPU \\(use device='cpu'\\)"):
            LLMEngine.from_model(checkpoint, device=device)


def test_chat_template_and_text_prompt(checkpoint):
    llm = LLM(checkpoint, device="cpu", max_model_len=256, kv_cache_blocks=32)
    rendered = llm.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert rendered == "<s>user: hi</s><s>assistant: "
    out = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(temperature=0, max_tokens=5,
                                                                       ignore_eos=True), use_tqdm=False)
    assert out[0].prompt_token_ids == llm.tokenizer.encode(rendered, add_special_tokens=False)
    assert len(out[0].outputs[0].token_ids) == 5
    quiet = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(temperature=0, max_tokens=1),
                     use_tqdm=False, chat_template_kwargs={"enable_thinking": False})
    assert quiet[0].prompt_token_ids == llm.tokenizer.encode(rendered + "no thinking: ", add_special_tokens=False)
    for bad in ({"bos_token": "x"}, {"messages": []}, ["enable_thinking"]):
        with pytest.raises(ValueError, match="chat_template_kwargs"):
            llm.chat([{"role": "user", "content": "hi"}], use_tqdm=False, chat_template_kwargs=bad)
    for bad in ("hi", [{"content": "hi"}], [["user", "hi"]]):
        with pytest.raises(ValueError, match=r"^messages must be a list of \{'role': ..., 'content': ...\} dicts"):
            llm.tokenizer.apply_chat_template(bad)
    template, llm.tokenizer.chat_template = llm.tokenizer.chat_template, None
    try:
        with pytest.raises(ValueError, match="^this checkpoint has no chat template"):
            llm.chat([{"role": "user", "content": "hi"}], use_tqdm=False)
    finally:
        llm.tokenizer.chat_template = template


def test_chat_renders_tools(checkpoint):
    llm = LLM(checkpoint, device="cpu", max_model_len=256, kv_cache_blocks=32)
    llm.tokenizer.set_chat_template("{% if tools %}tools: {{ tools | tojson }} {% endif %}{{ messages[0]['content'] }}")
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    out = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=1), use_tqdm=False, tools=[tool])
    assert llm.tokenizer.decode(out[0].prompt_token_ids) == 'tools: [{"type": "function", "function": {"name": "f", ' \
                                                             '"parameters": {"type": "object"}}}] hi'
    for kwargs in ({"tools": tool}, {"tools": [tool], "chat_template_kwargs": {"tools": []}}):
        with pytest.raises(ValueError, match="tools"):
            llm.chat([{"role": "user", "content": "hi"}], use_tqdm=False, **kwargs)
    with pytest.raises(ValueError, match="does not compile"):
        llm.tokenizer.set_chat_template("{% if %}")


def test_detokenizer_never_splits_a_multibyte_character(checkpoint):
    from tokenizers.pre_tokenizers import ByteLevel

    from tileattn.engine.detokenizer import detokenize, find_stop
    from tileattn.engine.sequence import Request

    llm = LLM(checkpoint, device="cpu", max_model_len=64, kv_cache_blocks=8)
    tok = llm.tokenizer
    alphabet = sorted(ByteLevel.alphabet())  # the byte-level tokenizer's one-byte tokens
    byte_char = {b: c for b, c in enumerate(_bytes_to_unicode())}
    assert set(byte_char.values()) == set(alphabet)
    text = "a\u00e9\U0001f600b"  # 1 + 2 + 4 + 1 bytes, one token per byte
    ids = [tok.backend.token_to_id(byte_char[b]) for b in text.encode()]
    seq = Request("d", [0], SamplingParams(stop=["\U0001f600b"])).seqs[0]
    for token in ids:
        seq.token_ids.append(token)
        new = detokenize(tok, [seq])[0]
        assert "\ufffd" not in seq.text, f"partial character in {seq.text!r}"
        stop = find_stop(seq, new)
    assert stop == "\U0001f600b" and seq.text == "a\u00e9"


def _bytes_to_unicode():
    """GPT-2's byte -> printable character table (the byte-level alphabet, in byte order)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\u00a1"), ord("\u00ac") + 1)) \
        + list(range(ord("\u00ae"), ord("\u00ff") + 1))
    chars, extra = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


def test_corrupt_weights_and_gguf_raise_value_errors(checkpoint, tmp_path):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(checkpoint, broken)
    (broken / "model.safetensors").write_bytes(b"not a safetensors file" * 4)
    with pytest.raises(ValueError, match="cannot read weights"):
        LLMEngine.from_model(str(broken), device="cpu")
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"GGUF" + b"\x00" * 16)
    with pytest.raises(ValueError, match="cannot read GGUF"):
        LLMEngine.from_model(str(fake), device="cpu")
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    with pytest.raises(ValueError, match="not GGUF"):
        LLMEngine.from_model(str(text), device="cpu")


def test_mixed_sampling_in_one_batch_leaves_greedy_rows_alone(checkpoint, plain):
    llm = LLM(checkpoint, device="cpu", max_model_len=256, kv_cache_blocks=128)
    params = [GREEDY,
              SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=1.0, repetition_penalty=1.3, presence_penalty=0.5,
                             frequency_penalty=0.5, seed=3, max_tokens=24, ignore_eos=True, logprobs=3),
              SamplingParams(n=2, temperature=0, max_tokens=24, ignore_eos=True)]
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert outs[0].outputs[0].token_ids == plain[0][0]
    assert [c.token_ids for c in outs[3].outputs] == [plain[3][0], plain[3][0]]
    assert all(len(c.token_ids) == 24 for o in outs for c in o.outputs)
    assert len(outs[2].outputs[0].logprobs) == 24
    assert_all_free(llm.engine)


class _EagerGraph:
    """Stands in for a CUDA graph on the CPU: replay() runs the model on the static inputs and
    writes the captured output buffer, so the runner's buffer plumbing (copies, padding) is tested."""

    replays = 0

    def __init__(self, runner, size, out):
        self.runner, self.size, self.out = runner, size, out

    def replay(self):
        _EagerGraph.replays += 1
        self.out.copy_(self.runner.static_forward(self.size))


def test_graph_input_plumbing_matches_eager(checkpoint, plain):
    llm = LLM(checkpoint, device="cpu", max_model_len=256, kv_cache_blocks=128, max_num_seqs=8)
    runner = llm.engine.runner
    runner.make_static_inputs()
    hidden = llm.engine.model_config.hidden_size
    for size in runner.graph_batch_sizes():
        out = torch.full((size, hidden), float("nan"))
        runner.graphs[size] = (_EagerGraph(runner, size, out), out, size)
    assert runner.graph_batch_sizes() == [1, 2, 4, 8]
    # 3 prompts: decode steps of 3 sequences replay the size-4 graph with one padded row
    outs = llm.generate(PROMPTS[:3], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [p[0] for p in plain[:3]]
    assert _EagerGraph.replays >= 23, "decode steps did not take the graph path"
    assert_all_free(llm.engine)


def test_prompt_logprobs_survive_preemption(checkpoint):
    """A request scoring its prompt is preempted mid-prefill and recomputed in chunks that do not
    line up with where scoring stopped: every prompt token is still scored exactly once."""
    prompt = PROMPTS[1]  # 101 tokens
    params = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=0, ignore_eos=True)
    alone = LLM(checkpoint, device="cpu", max_model_len=256, kv_cache_blocks=64).generate(
        prompt, params, use_tqdm=False)[0].prompt_logprobs
    engine = LLMEngine.from_model(checkpoint, device="cpu", max_model_len=160, kv_cache_blocks=20,
                                  block_size=8, max_num_batched_tokens=24)
    # "other" holds 13 of the 20 blocks; "scored" (admitted later) runs out of room after two chunks
    engine.add_request("other", list(range(200, 300)), SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    engine.add_request("scored", prompt, params)
    result = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == "scored" and out.finished:
                result = out.prompt_logprobs
    assert engine.stats()["num_preemptions"] > 0, "not preempted: the test needs a smaller cache"
    assert len(result) == len(prompt)
    for got, want in zip(result[1:], alone[1:]):
        assert got.keys() == want.keys()
        assert all(abs(got[t] - want[t]) < 1e-4 for t in got)


def test_memory_profile_step_runs(checkpoint, monkeypatch):
    """The CUDA-only KV sizing forward (max_num_batched_tokens tokens over max_num_seqs sequences,
    then sampling-sized logits) run on the CPU, so its inputs are known to be well formed."""
    engine = LLMEngine.from_model(checkpoint, device="cpu", max_model_len=256, kv_cache_blocks=32,
                                  max_num_seqs=7, max_num_batched_tokens=100)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: None)
    runner = engine.runner
    runner._profile_step()
    assert all(layer.k_cache is None for layer in runner.attention_layers)
    for i, layer in enumerate(runner.attention_layers):  # put the real cache back for other users
        layer.k_cache, layer.v_cache = runner.kv_cache[0, i], runner.kv_cache[1, i]


def test_cuda_kernel_limits_named_before_start():
    from tileattn.engine.model_runner import _check_kernel_support

    _check_kernel_support(128, 16)
    with pytest.raises(ValueError, match="head_dim=80"):
        _check_kernel_support(80, 16)
    with pytest.raises(ValueError, match="block_size=8"):
        _check_kernel_support(64, 8)



def _finish_order(engine, requests):
    """Add (id, prompt, priority) requests before any step; the ids in the order they finish."""
    for rid, prompt, priority in requests:
        engine.add_request(rid, prompt, GREEDY, priority=priority)
    order = []
    while engine.has_unfinished_requests():
        order += [o.request_id for o in engine.step(finished_only=True)]
    return order


def test_priority_scheduling_admits_and_keeps_the_higher_priority(checkpoint, plain):
    """scheduling_policy "priority": with one sequence at a time, requests run by priority (lower
    first, ties by arrival) whatever their arrival; with a cache too small for all of them, the
    lowest-priority running sequence is preempted, never a higher one; the tokens are the plain run's."""
    one = LLMEngine.from_model(checkpoint, device="cpu", max_model_len=256, kv_cache_blocks=128, max_num_seqs=1,
                               scheduling_policy="priority")
    order = _finish_order(one, [("p5", PROMPTS[0], 5), ("p0-first", PROMPTS[1], 0), ("m1", PROMPTS[2], -1),
                                ("p0-second", PROMPTS[3], 0)])
    assert order == ["m1", "p0-first", "p0-second", "p5"]
    fcfs = LLMEngine.from_model(checkpoint, device="cpu", max_model_len=256, kv_cache_blocks=128, max_num_seqs=1)
    assert _finish_order(fcfs, [(f"r{i}", p, 0) for i, p in enumerate(PROMPTS)]) == ["r0", "r1", "r2", "r3"]
    small = LLMEngine.from_model(checkpoint, device="cpu", max_model_len=160, kv_cache_blocks=20, block_size=8,
                                 scheduling_policy="priority")
    preempted = []
    preempt = small.scheduler._preempt
    small.scheduler._preempt = lambda seq: (preempted.append(seq.request.request_id), preempt(seq))
    for i, prompt in enumerate(PROMPTS):  # priorities 3, 2, 1, 0: the last arrival is the most urgent
        small.add_request(f"r{i}", prompt, GREEDY, priority=3 - i)
    outs = {}
    while small.has_unfinished_requests():
        outs.update((o.request_id, o.outputs[0].token_ids) for o in small.step(finished_only=True))
    assert preempted and "r3" not in preempted, f"preempted {preempted}"
    assert [outs[f"r{i}"] for i in range(4)] == [p[0] for p in plain]
    assert_all_free(small)


def assert_blocks_consistent(engine):
    """Between steps: every block's reference count is the number of live sequences' tables holding it,
    the free list is exactly the unreferenced blocks, a waiting sequence holds none, a running one holds
    blocks for its computed tokens, and no more than max_num_seqs run."""
    scheduler, bm = engine.scheduler, engine.block_manager
    refs = [0] * bm.num_blocks
    for seq in scheduler.running:
        assert len(seq.block_table) * bm.block_size >= seq.num_computed_tokens, seq
        for block_id in seq.block_table:
            refs[block_id] += 1
    assert all(not seq.block_table and seq.num_computed_tokens == 0 for seq in scheduler.waiting), scheduler.waiting
    assert [b.ref_count for b in bm.blocks] == refs
    assert set(bm.free_blocks) == {i for i, r in enumerate(refs) if r == 0}
    assert len(scheduler.running) <= scheduler.max_num_seqs


def _priority_engine(checkpoint, mode, policy="priority", **options):
    engine = LLMEngine.from_model(checkpoint, device="cpu", scheduling_policy=policy, block_size=8,
                                  num_speculative_tokens=2 if mode == "speculative" else 0, **options)
    engine.async_scheduling = mode == "async"
    preempted = []
    preempt = engine.scheduler._preempt
    engine.scheduler._preempt = lambda seq: (preempted.append(seq.request.request_id), preempt(seq))
    return engine, preempted


def _running(engine, request_id):
    return any(seq.request.request_id == request_id for seq in engine.scheduler.running)


def _drive(engine, outs, steps=None):
    """Step (all steps, or ``steps``), checking the blocks after each; finished tokens into outs."""
    while engine.has_unfinished_requests() and (steps is None or steps > 0):
        outs.update((o.request_id, o.outputs[0].token_ids) for o in engine.step(finished_only=True))
        assert_blocks_consistent(engine)
        steps = None if steps is None else steps - 1


@pytest.mark.parametrize("mode", ["sync", "async", "speculative"])
@pytest.mark.parametrize("limit", [{"max_num_seqs": 1, "kv_cache_blocks": 32}, {"kv_cache_blocks": 8}],
                         ids=["max_num_seqs", "blocks"])
def test_priority_arrival_preempts_a_lower_priority_running_request(checkpoint, limit, mode):
    """A request of strictly higher priority that finds no room (max_num_seqs running, or too few free
    blocks) preempts the lower-priority one running, in the step after it arrives (async: the step run
    ahead comes first); the preempted request finishes later with its unpreempted tokens. Equal priority
    and first come, first served wait for it to finish instead. Before 2026-12-05 every case waited."""
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    low_prompt, high_prompt = PROMPTS[2], [0, 5, 9, 17, 33, 40, 2, 7] * 4 + [3]  # 40 and 33 tokens
    want = {}
    for rid, prompt in (("low", low_prompt), ("high", high_prompt)):
        want[rid] = run(checkpoint, [prompt], params, max_model_len=64, block_size=8)[0][0][0]
    for policy, high_priority in (("priority", 0), ("priority", 5), ("fcfs", 0)):
        engine, preempted = _priority_engine(checkpoint, mode, policy, max_model_len=64, **limit)
        engine.add_request("low", low_prompt, params, priority=5 if policy == "priority" else 0)
        outs = {}
        _drive(engine, outs, steps=3)
        engine.add_request("high", high_prompt, params, priority=high_priority if policy == "priority" else 0)
        assert not _running(engine, "high")
        steps = 0
        while not _running(engine, "high"):
            _drive(engine, outs, steps=1)
            steps += 1
        if policy == "priority" and high_priority < 5:
            assert steps <= 2 and preempted == ["low"] and "low" not in outs, (steps, preempted)
            assert engine.stats()["num_preemptions"] == 1
        else:  # no preemption: high waits for low to finish
            assert "low" in outs and not preempted and engine.stats()["num_preemptions"] == 0, (steps, preempted)
        _drive(engine, outs)
        assert outs == want, (policy, high_priority)
        assert_all_free(engine)


def test_priority_preempts_only_lower_priorities_and_only_what_it_needs(checkpoint):
    """The arrival preempts the lowest-priority, latest running request and no more; where preempting
    every lower-priority one would still not make room, nobody is preempted."""
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    prompts = {"a": PROMPTS[0], "b": [0, 11, 12, 13], "c": [0, 21, 22, 23], "h": PROMPTS[3]}
    want = {rid: run(checkpoint, [p], params, max_model_len=64, block_size=8)[0][0][0] for rid, p in prompts.items()}
    engine, preempted = _priority_engine(checkpoint, "sync", max_model_len=64, kv_cache_blocks=64, max_num_seqs=3)
    for rid, priority in (("a", 1), ("b", 5), ("c", 5)):
        engine.add_request(rid, prompts[rid], params, priority=priority)
    outs = {}
    _drive(engine, outs, steps=2)
    engine.add_request("h", prompts["h"], params, priority=0)
    _drive(engine, outs, steps=1)
    assert _running(engine, "h") and preempted == ["c"], preempted
    assert len(engine.scheduler.running) == 3
    _drive(engine, outs)
    assert outs == want
    assert_all_free(engine)

    # a (priority 0) holds 6 of 10 blocks, b (5) one: b's block and the 3 free ones are not the 6 that
    # h (1) needs, so b keeps running and h waits
    prompts = {"a": PROMPTS[2], "b": [0, 11, 12, 13], "h": [0] + list(range(60, 100))}
    want = {rid: run(checkpoint, [p], params, max_model_len=64, block_size=8)[0][0][0] for rid, p in prompts.items()}
    engine, preempted = _priority_engine(checkpoint, "sync", max_model_len=64, kv_cache_blocks=10)
    engine.add_request("a", prompts["a"], params, priority=0)
    engine.add_request("b", prompts["b"], params, priority=5)
    outs = {}
    _drive(engine, outs, steps=3)
    assert [len(seq.block_table) for seq in engine.scheduler.running] == [6, 1]
    engine.add_request("h", prompts["h"], params, priority=1)
    _drive(engine, outs, steps=2)
    assert not _running(engine, "h") and not preempted and _running(engine, "b")
    _drive(engine, outs)
    assert outs == want
    assert_all_free(engine)


def test_priority_needs_its_policy(checkpoint):
    engine = LLMEngine.from_model(checkpoint, device="cpu", max_model_len=64, kv_cache_blocks=8)
    with pytest.raises(ValueError, match="priority needs scheduling_policy='priority'"):
        engine.add_request("x", PROMPTS[0], GREEDY, priority=1)
    with pytest.raises(ValueError, match="priority must be an int"):
        engine.add_request("x", PROMPTS[0], GREEDY, priority=1.5)
    with pytest.raises(ValueError, match="scheduling_policy must be 'fcfs' or 'priority'"):
        LLMEngine.from_model(checkpoint, device="cpu", scheduling_policy="lifo")
    assert not engine.has_unfinished_requests()


def test_copies_of_a_cached_block_do_not_crowd_the_prefix_cache(checkpoint):
    """n = 4 computes the prompt's blocks four times; only one copy of each can be found by the
    cache, so the other copies are freed first. Before 2026-12-05 every copy kept its hash and sat
    at the protected end of the free list: one unrelated request then evicted the findable blocks
    and the same prompt again found 28 of its 40 cacheable tokens (found by a review helper)."""
    engine = LLMEngine.from_model(checkpoint, device="cpu", max_model_len=64, kv_cache_blocks=48, block_size=4)

    def cached_tokens(rid, prompt, n=1):
        engine.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=1, n=n))
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    return out.num_cached_tokens

    prompt = [0] + list(range(100, 140))  # 41 tokens: 10 full blocks before the last one
    cached_tokens("b", prompt, n=4)
    cached_tokens("c", [0] + list(range(200, 240)))  # an unrelated request of 11 blocks
    assert cached_tokens("b2", prompt) == 40
    assert_all_free(engine)
