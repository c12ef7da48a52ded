"""`tileattn serve` end to end on CPU: the official openai client against a real uvicorn server
(127.0.0.1, a free port) running a real engine on a tiny random-init Llama checkpoint.

The checkpoint is the engine tests' 2-layer Llama 3 (tests/engine/checkpoints.py) with a
generation_config.json that says do_sample=false.
"""

from __future__ import annotations

import asyncio
import json
import re
import os
import socket
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

from tests.engine.checkpoints import add_think_tokens
from tests.engine.checkpoints import make_checkpoint as make_arch_checkpoint

try:  # the server's stack ([engine] extra) and the test client ([dev]); the GPU machine may lack them
    import openai
except ImportError:
    openai = None


@pytest.fixture(autouse=True)
def _server_dependencies():
    """Skip (only the tests that run, so `pytest -m gpu` never sees these) without the packages."""
    for name in ("fastapi", "uvicorn", "prometheus_client", "openai"):
        pytest.importorskip(name)


def create_app(*args, **kwargs):
    from tileattn.engine.server import create_app

    return create_app(*args, **kwargs)

MODEL = "tiny-llama"
MAX_MODEL_LEN = 192


def make_checkpoint(path: str, kernel_head_dims: bool = False) -> str:
    """The engine tests' tiny random-init Llama 3 checkpoint (tests/engine/checkpoints.py: weights
    scaled up so greedy argmaxes have clear margins, a byte-level BPE tokenizer with a chat
    template) plus a generation_config.json with do_sample=false, so requests that set no
    temperature are greedy (the server applies it)."""
    from transformers import GenerationConfig

    make_arch_checkpoint(path, "llama3", kernel_head_dims=kernel_head_dims)
    GenerationConfig(bos_token_id=0, eos_token_id=1, do_sample=False).save_pretrained(path)
    return path


def make_engine(path: str, max_model_len: int = MAX_MODEL_LEN):
    from tileattn.engine import LLMEngine

    return LLMEngine.from_model(path, device="cpu", max_model_len=max_model_len, max_num_seqs=64,
                                kv_cache_blocks=256, block_size=16)


class ServerThread:
    """uvicorn serving ``app`` on 127.0.0.1:<free port> in a background thread."""

    def __init__(self, app, graceful_shutdown_s: float = 5):
        import uvicorn

        self.app = app
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=graceful_shutdown_s)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()
        assert not self.thread.is_alive(), "uvicorn did not shut down within 30 s"

    @property
    def state(self):
        return self.app.state.server

    def engine_stats(self) -> dict:
        """engine.stats() run on the engine thread (between two steps)."""
        return self.state.engine_loop.call(lambda engine: engine.stats()).result(timeout=30)

    def wait_idle(self, timeout: float = 20.0) -> dict:
        """Poll until the engine runs nothing and every KV block is free; returns the stats."""
        deadline = time.monotonic() + timeout
        while True:
            stats = self.engine_stats()
            if (stats["num_running"] == 0 and stats["num_waiting"] == 0
                    and stats["num_free_blocks"] == stats["num_total_blocks"]):
                return stats
            assert time.monotonic() < deadline, f"engine not idle after {timeout} s: {stats}"
            time.sleep(0.05)

    def client(self, **kw):
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=60, **kw)

    def http(self, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes]:
        """A raw request (endpoints outside the OpenAI client: /health, /metrics, bad JSON)."""
        req = urllib.request.Request(self.url + path, data=body, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(str(tmp_path_factory.mktemp("tiny_llama")))


@pytest.fixture(scope="module")
def engine(checkpoint):
    return make_engine(checkpoint)


@pytest.fixture(scope="module")
def server(engine):
    with ServerThread(create_app(engine, MODEL, max_queue_depth=256)) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def _extra(**kw):
    return {"extra_body": kw}


# ---------------------------------------------------------------------------------------------


def test_models_health_tokenize(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert server.http("GET", "/health")[0] == 200
    status, body = server.http("POST", "/tokenize", json.dumps({"prompt": "the quick brown fox"}).encode())
    assert status == 200, body
    tokens = json.loads(body)["tokens"]
    assert tokens == server.state.tokenizer.encode("the quick brown fox")
    status, body = server.http("POST", "/detokenize", json.dumps({"tokens": tokens}).encode())
    assert (status, json.loads(body)["prompt"]) == (200, "the quick brown fox")
    # chat_template_kwargs reach the template (the test checkpoint's reads enable_thinking like Qwen3's)
    messages = [{"role": "user", "content": "hi"}]
    rendered = {}
    for kwargs in (None, {"enable_thinking": False}):
        status, body = server.http("POST", "/tokenize", json.dumps({"messages": messages,
                                                                     "chat_template_kwargs": kwargs}).encode())
        assert status == 200, body
        rendered[kwargs is None] = server.state.tokenizer.decode(json.loads(body)["tokens"], skip_special_tokens=False)
    assert rendered[False] == rendered[True] + "no thinking: "
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1,
                                          **_extra(chat_template_kwargs={"enable_thinking": False}))
    assert chat.usage.prompt_tokens == len(server.state.tokenizer.encode(rendered[False], add_special_tokens=False))
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1,
                                       **_extra(chat_template_kwargs={"add_generation_prompt": False}))
    assert _error(info.value)["param"] == "chat_template_kwargs"
    # continue_final_message (vLLM's): the prompt ends right after the last message's content
    partial = messages + [{"role": "assistant", "content": "The answer is"}]
    status, body = server.http("POST", "/tokenize", json.dumps({
        "messages": partial, "add_generation_prompt": False, "continue_final_message": True}).encode())
    assert status == 200, body
    text = server.state.tokenizer.decode(json.loads(body)["tokens"], skip_special_tokens=False)
    assert text == "<s>user: hi</s><s>assistant: The answer is", text
    cont = client.chat.completions.create(model=MODEL, messages=partial, max_tokens=2,
                                          **_extra(add_generation_prompt=False, continue_final_message=True))
    assert cont.usage.prompt_tokens == len(json.loads(body)["tokens"])
    with pytest.raises(openai.BadRequestError) as info:  # with a generation prompt it would start a new turn
        client.chat.completions.create(model=MODEL, messages=partial, max_tokens=1,
                                       **_extra(continue_final_message=True))
    assert _error(info.value)["param"] == "continue_final_message"


def test_completion_greedy_stream_matches_non_stream(server, client):
    r = client.completions.create(model=MODEL, prompt="The quick brown", max_tokens=12, temperature=0,
                                  **_extra(ignore_eos=True, return_token_ids=True))
    (c,) = r.choices
    assert c.finish_reason == "length"
    prompt_ids = server.state.tokenizer.encode("The quick brown")
    assert r.usage.prompt_tokens == len(prompt_ids)
    assert r.usage.completion_tokens == 12 and r.usage.total_tokens == len(prompt_ids) + 12
    assert len(c.token_ids) == 12
    # a finished completion's text is what the tokenizer decodes (incomplete bytes at the end as U+FFFD)
    assert c.text == server.state.tokenizer.decode(c.token_ids), (c.text, c.token_ids)

    chunks = list(client.completions.create(model=MODEL, prompt="The quick brown", max_tokens=12,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True},
                                            **_extra(ignore_eos=True, return_token_ids=True)))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    body = chunks[:-1]
    assert "".join(ch.choices[0].text for ch in body) == c.text
    assert [t for ch in body for t in ch.choices[0].token_ids] == c.token_ids
    assert body[-1].choices[0].finish_reason == "length"
    assert all(ch.choices[0].finish_reason is None for ch in body[:-1])


def test_generation_config_default_is_greedy(server, client):
    """generation_config.json says do_sample=false: a request without temperature is greedy."""
    kw = dict(model=MODEL, prompt="Servers batch", max_tokens=8, **_extra(ignore_eos=True))
    default = client.completions.create(**kw).choices[0].text
    greedy = client.completions.create(temperature=0, **kw).choices[0].text
    sampled = {client.completions.create(temperature=1.5, seed=s, **kw).choices[0].text for s in range(3)}
    assert default == greedy
    assert sampled != {greedy}, "temperature 1.5 with three seeds gave the greedy text each time"


def test_token_id_prompts_batched_prompts_and_echo(server, client):
    tok = server.state.tokenizer
    ids = tok.encode("Attention kernels move")
    by_text = client.completions.create(model=MODEL, prompt="Attention kernels move", max_tokens=6,
                                        temperature=0, **_extra(ignore_eos=True))
    r = client.completions.create(model=MODEL, prompt=[ids, tok.encode("One two")], max_tokens=6,
                                  temperature=0, echo=True, **_extra(ignore_eos=True))
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].text == tok.decode(ids) + by_text.choices[0].text
    assert r.choices[1].text.startswith(tok.decode(tok.encode("One two")))
    assert r.usage.prompt_tokens == len(ids) + len(tok.encode("One two"))
    # truncate_prompt_tokens (vLLM's): the last k tokens are the prompt, in the answer, the echo and the usage
    tail = client.completions.create(model=MODEL, prompt=ids[-3:], max_tokens=6, temperature=0,
                                     **_extra(ignore_eos=True)).choices[0].text
    cut = client.completions.create(model=MODEL, prompt="Attention kernels move", max_tokens=6, temperature=0,
                                    echo=True, **_extra(ignore_eos=True, truncate_prompt_tokens=3))
    assert cut.choices[0].text == tok.decode(ids[-3:]) + tail and cut.usage.prompt_tokens == 3
    messages = [{"role": "user", "content": "hi there"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2,
                                          **_extra(truncate_prompt_tokens=2))
    assert chat.usage.prompt_tokens == 2
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, **_extra(truncate_prompt_tokens=0))
    assert _error(info.value)["param"] == "truncate_prompt_tokens"


def test_logit_bias_bans_and_forces_tokens(server, client):
    """logit_bias reaches the sampler: +100 on one token makes greedy decoding emit only it, -100 on
    the greedy text's first token moves the first token elsewhere (chat too); response_format text
    is accepted."""
    kw = dict(model=MODEL, prompt="Servers batch", max_tokens=6, temperature=0)
    plain = client.completions.create(**kw, **_extra(ignore_eos=True, return_token_ids=True)).choices[0]
    forced = client.completions.create(**kw, logit_bias={"42": 100},
                                       **_extra(ignore_eos=True, return_token_ids=True)).choices[0]
    assert forced.token_ids == [42] * 6 and plain.token_ids != forced.token_ids
    banned = client.completions.create(**kw, logit_bias={str(plain.token_ids[0]): -100},
                                       **_extra(ignore_eos=True, return_token_ids=True)).choices[0]
    assert banned.token_ids[0] != plain.token_ids[0]
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                          temperature=0, logit_bias={"42": 100}, response_format={"type": "text"},
                                          **_extra(ignore_eos=True, return_token_ids=True))
    assert chat.choices[0].token_ids == [42] * 3
    # min_tokens (vLLM's extra) reaches the engine: the forced token is also a stop id, held off for 3 tokens
    held = client.completions.create(**kw, logit_bias={"42": 100},
                                     **_extra(ignore_eos=True, return_token_ids=True, stop_token_ids=[42],
                                              min_tokens=3)).choices[0]
    assert len(held.token_ids) == 4 and 42 not in held.token_ids[:3] and held.token_ids[3] == 42
    assert held.finish_reason == "stop"
    only = client.completions.create(**kw, **_extra(ignore_eos=True, return_token_ids=True,
                                                    allowed_token_ids=[42, 43])).choices[0]
    assert len(only.token_ids) == 6 and set(only.token_ids) <= {42, 43}
    word = server.state.tokenizer.decode(plain.token_ids[:2]).strip() or "x"
    forms = server.state.engine._bad_words_token_ids([word])  # the token sequences the sampler bans
    avoided = client.completions.create(**kw, **_extra(ignore_eos=True, return_token_ids=True,
                                                       bad_words=[word])).choices[0]
    ids = avoided.token_ids
    assert len(ids) == 6 and not any(tuple(ids[i:i + len(f)]) == f for f in forms for i in range(len(ids))), \
        (word, forms, ids)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(**kw, **_extra(bad_words=[" "]))
    assert _error(info.value)["param"] == "bad_words"


def test_prompts_are_tokenized_off_the_event_loop(server, client, monkeypatch):
    """Every endpoint that tokenizes a prompt does it in a worker thread, never on uvicorn's event
    loop (here server.thread), which streams the other requests' tokens meanwhile; and the
    tokenizer lets other Python threads run while it works (a long text, tokenized in a thread,
    leaves the main thread running)."""
    tokenizer = server.state.tokenizer
    threads = []
    encode = tokenizer.encode

    def recording_encode(*args, **kwargs):
        threads.append(threading.current_thread())
        return encode(*args, **kwargs)

    monkeypatch.setattr(tokenizer, "encode", recording_encode)
    messages = [{"role": "user", "content": "hi"}]
    client.completions.create(model=MODEL, prompt=["the quick", "brown fox"], max_tokens=1)
    client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    client.embeddings.create(model=MODEL, input="the quick brown fox")
    for body in ({"prompt": "the quick brown fox"}, {"messages": messages}):
        assert server.http("POST", "/tokenize", json.dumps(body).encode())[0] == 200
    assert len(threads) == 6 and server.thread not in threads, threads
    monkeypatch.undo()

    done = threading.Event()
    worker = threading.Thread(target=lambda: (tokenizer.encode("the quick brown fox " * 200_000), done.set()))
    ticks = 0
    worker.start()
    while not done.is_set():
        ticks += 1
        time.sleep(0.001)
    worker.join()
    assert ticks >= 20, f"the main thread ran {ticks} times while 4 MB were tokenized: the GIL was held"


def test_stop_strings(server, client):
    kw = dict(model=MODEL, prompt="One two three", max_tokens=24, temperature=0, **_extra(ignore_eos=True))
    full = client.completions.create(**kw).choices[0].text
    assert len(full) > 8, f"greedy text too short to pick a stop string from: {full!r}"
    stop = full[5:8]
    cut = full.index(stop)
    for stream in (False, True):
        if stream:
            chunks = list(client.completions.create(stop=[stop, "\x00never"], stream=True, **kw))
            text = "".join(ch.choices[0].text for ch in chunks)
            finish = chunks[-1].choices[0].finish_reason
        else:
            c = client.completions.create(stop=stop, **kw).choices[0]
            text, finish = c.text, c.finish_reason
        assert (text, finish) == (full[:cut], "stop"), f"stream={stream} stop={stop!r} full={full!r}"
    kept = client.completions.create(stop=stop, model=MODEL, prompt="One two three", max_tokens=24, temperature=0,
                                     **_extra(ignore_eos=True, include_stop_str_in_output=True)).choices[0]
    assert (kept.text, kept.finish_reason) == (full[:cut + len(stop)], "stop")


def test_n_and_seed_reproducible(server, client):
    kw = dict(model=MODEL, prompt="The cat", max_tokens=8, temperature=1.0, n=3, **_extra(ignore_eos=True))
    a = client.completions.create(seed=1234, **kw)
    b = client.completions.create(seed=1234, **kw)
    other = client.completions.create(seed=4321, **kw)
    texts = [c.text for c in sorted(a.choices, key=lambda c: c.index)]
    assert [c.index for c in sorted(a.choices, key=lambda c: c.index)] == [0, 1, 2]
    assert texts == [c.text for c in sorted(b.choices, key=lambda c: c.index)]
    assert texts != [c.text for c in sorted(other.choices, key=lambda c: c.index)]
    assert len(set(texts)) > 1, f"three samples at temperature 1 were identical: {texts}"
    assert a.usage.completion_tokens == 24

    chunks = list(client.completions.create(seed=1234, stream=True, **kw))
    streamed = {i: "".join(ch.choices[0].text for ch in chunks if ch.choices[0].index == i) for i in range(3)}
    assert [streamed[i] for i in range(3)] == texts

    # Choices that finish at different steps: choice 0 hits a stop string from its own text early,
    # the other samples run to max_tokens; every choice reports its finish exactly once.
    stop = texts[0][2:5]
    assert len(stop) == 3, texts
    chunks = list(client.completions.create(seed=1234, stream=True, stop=stop, **kw))
    finishes = sorted((ch.choices[0].index, ch.choices[0].finish_reason) for ch in chunks
                      if ch.choices[0].finish_reason is not None)
    assert [i for i, _ in finishes] == [0, 1, 2], f"each choice must finish exactly once: {finishes}"
    assert finishes[0][1] == "stop" and "length" in {r for _, r in finishes}, (finishes, stop, texts)

    chat = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2,
                                               max_tokens=5, temperature=1.0, seed=5, stream=True,
                                               **_extra(ignore_eos=True)))
    finishes = sorted(ch.choices[0].index for ch in chat if ch.choices[0].finish_reason is not None)
    assert finishes == [0, 1], f"chat: each choice must finish exactly once, got {finishes}"


def test_completion_logprobs_and_echo(server, client):
    tok = server.state.tokenizer
    r = client.completions.create(model=MODEL, prompt="The lazy dog", max_tokens=5, temperature=0, logprobs=2,
                                  **_extra(ignore_eos=True, return_token_ids=True))
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert lp.tokens == [tok.decode([t], skip_special_tokens=False) for t in r.choices[0].token_ids]
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert value <= 0 and 1 <= len(top) <= 3  # distinct ids may decode to one string (a key)
        assert value == pytest.approx(max(top.values()), abs=1e-5), "greedy token is not the most likely"

    prompt_len = len(tok.encode("The lazy dog"))
    e = client.completions.create(model=MODEL, prompt="The lazy dog", max_tokens=5, temperature=0, logprobs=1,
                                  echo=True, **_extra(ignore_eos=True))
    elp = e.choices[0].logprobs
    assert len(elp.tokens) == prompt_len + 5
    assert elp.token_logprobs[0] is None and all(v <= 0 for v in elp.token_logprobs[1:])
    assert elp.token_logprobs[prompt_len:] == pytest.approx(lp.token_logprobs, abs=1e-5)
    assert e.choices[0].text == "The lazy dog" + r.choices[0].text
    assert elp.text_offset[prompt_len] == len("The lazy dog")

    # vLLM's prompt_logprobs: per prompt token {id: {logprob, rank, decoded_token}}, the echo's values
    v = client.completions.create(model=MODEL, prompt="The lazy dog", max_tokens=2, temperature=0,
                                  **_extra(ignore_eos=True, prompt_logprobs=1))
    plp = v.choices[0].model_extra["prompt_logprobs"]
    ids = tok.encode("The lazy dog")
    assert len(plp) == prompt_len and plp[0] is None
    for i, (tid, entry) in enumerate(zip(ids[1:], plp[1:]), start=1):
        assert str(tid) in entry and 1 <= len(entry) <= 2, entry
        assert entry[str(tid)]["logprob"] == pytest.approx(elp.token_logprobs[i], abs=1e-5)
        assert entry[str(tid)]["decoded_token"] == tok.decode([tid], skip_special_tokens=False)
        ranks = sorted(x["rank"] for x in entry.values() if x["rank"] is not None)
        assert ranks == [1] and (len(entry) == 1) == (entry[str(tid)]["rank"] == 1), entry
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1,
                                          **_extra(prompt_logprobs=0))
    assert len(chat.model_extra["prompt_logprobs"]) == chat.usage.prompt_tokens
    for kw in (dict(stream=True, **_extra(prompt_logprobs=1)), dict(echo=True, logprobs=2, **_extra(prompt_logprobs=1))):
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=MODEL, prompt="The lazy dog", max_tokens=2, **kw)
        assert _error(info.value)["param"] == "prompt_logprobs"


def test_chat(server, client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a fox."}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=10, temperature=0,
                                       logprobs=True, top_logprobs=3,
                                       **_extra(ignore_eos=True, return_token_ids=True))
    (c,) = r.choices
    assert c.message.role == "assistant" and c.finish_reason == "length"
    _status, body = server.http("POST", "/tokenize", json.dumps({"messages": messages}).encode())
    assert r.usage.prompt_tokens == json.loads(body)["count"]
    assert r.usage.completion_tokens == 10 == len(c.logprobs.content)
    assert [t.token for t in c.logprobs.content] == [
        server.state.tokenizer.decode([t], skip_special_tokens=False) for t in c.token_ids]
    for t in c.logprobs.content:
        assert len(t.top_logprobs) == 3 and t.top_logprobs[0].logprob == pytest.approx(t.logprob, abs=1e-5)
        assert [x.logprob for x in t.top_logprobs] == sorted((x.logprob for x in t.top_logprobs), reverse=True)

    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 **_extra(ignore_eos=True)))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == c.message.content
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 10


def _error(exc) -> dict:
    body = exc.response.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


def test_errors(server, client):
    bad = [{"temperature": -1}, {"top_p": 1.5}, {"n": 0}, {"max_tokens": 0}, {"logprobs": 50},
           {"presence_penalty": 3.0}, {"stop": [""]}]
    for kw in bad:
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=MODEL, prompt="hi", **kw)
        err = _error(info.value)
        assert info.value.status_code == 400 and err["type"] == "invalid_request_error", (kw, err)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="hi", extra_body={"top_k": -5})
    assert _error(info.value)["param"] == "top_k"
    with pytest.raises(openai.BadRequestError) as info:  # refused by SamplingParams, not the schema
        client.completions.create(model=MODEL, prompt="hi", extra_body={"stop_token_ids": [-1]})
    assert _error(info.value)["param"] == "stop_token_ids"

    # JSON's \ud800 escape gives Python a lone surrogate, which no tokenizer takes: a 400 naming the field
    lone = "a\ud800b"
    for path, body, param in (("/v1/completions", {"prompt": lone}, "prompt"),
                              ("/v1/completions", {"prompt": ["fine", lone]}, "prompt"),
                              ("/v1/completions", {"prompt": "hi", "bad_words": [lone]}, "bad_words"),
                              ("/v1/chat/completions", {"messages": [{"role": "user", "content": lone}]}, "messages"),
                              ("/tokenize", {"prompt": lone}, "prompt"),
                              ("/tokenize", {"messages": [{"role": "user", "content": lone}]}, "messages"),
                              ("/v1/embeddings", {"input": lone}, "input")):
        status, out = server.http("POST", path, json.dumps({"model": MODEL, "max_tokens": 1, **body}).encode())
        error = json.loads(out)["error"]
        assert (status, error["param"]) == (400, param) and "lone surrogate" in error["message"], (path, body, out)

    for bias, what in (({"x": 1}, "token ids"), ({"-1": 1}, "logit_bias"), ({"3": 500}, "logit_bias"),
                       ({"1000000": 1}, "outside the vocabulary")):
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=MODEL, prompt="hi", logit_bias=bias)
        assert _error(info.value)["param"] == "logit_bias" and what in _error(info.value)["message"], (bias, info.value)
    messages = [{"role": "user", "content": "hi"}]
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    for kw, param, says in (({"tools": [tool]}, "tools", "--tool-call-parser"),  # this server has no parser
                            ({"tool_choice": "auto"}, "tool_choice", "needs tools"),
                            ({"parallel_tool_calls": False}, "parallel_tool_calls", "needs tools")):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL, messages=messages, **kw)
        assert _error(info.value)["param"] == param and says in _error(info.value)["message"], kw
    with pytest.raises(openai.BadRequestError) as info:  # tools belong to chat
        client.completions.create(model=MODEL, prompt="hi", **_extra(tools=[tool]))
    assert _error(info.value)["param"] == "tools"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="hi", **_extra(guided_whitespace_pattern=" "))
    assert _error(info.value)["param"] == "guided_whitespace_pattern"
    for name in ("allowed_token_ids", "stop_token_ids"):  # the engine's vocabulary check
        with pytest.raises(openai.BadRequestError) as info:  # stop ids past the vocabulary with min_tokens killed the engine
            client.completions.create(model=MODEL, prompt="hi", max_tokens=4, **_extra(**{name: [10**7], "min_tokens": 2}))
        assert _error(info.value)["param"] == name
    for name, value in (("temperature", 1e999), ("top_p", float("inf")), ("repetition_penalty", 1e999),
                        ("repetition_penalty", 1e-50)):  # inf (a valid JSON number) or past float32: a NaN row
        status, body = server.http("POST", "/v1/completions", json.dumps(
            {"model": MODEL, "prompt": "hi", "max_tokens": 2, name: value}).encode())
        assert status == 400 and json.loads(body)["error"]["param"] == name, (name, value, status, body)
    with pytest.raises(openai.BadRequestError) as info:  # n sequences are made at once: at most max_num_seqs
        client.completions.create(model=MODEL, prompt="hi", max_tokens=1, n=100000)
    assert _error(info.value)["param"] == "n" and "max_num_seqs" in _error(info.value)["message"]
    with pytest.raises(openai.BadRequestError) as info:  # min_tokens above max_tokens: SamplingParams' check
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, **_extra(min_tokens=3))
    assert _error(info.value)["param"] == "min_tokens"
    # vLLM's answer-changing extras the engine lacks get a 400 when set, and pass when left at their default
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=1, **_extra(logits_processors=["p"]))
    assert _error(info.value)["param"] == "logits_processors" and "not supported" in _error(info.value)["message"]
    for name, value in (("use_beam_search", True), ("length_penalty", 0.5),  # beam search: completions only
                        ("chat_template", "{{ messages }}"),
                        ("echo", True), ("modalities", ["text", "audio"]), ("modalities", 3),
                        ("audio", {"voice": "alloy", "format": "wav"})):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, **_extra(**{name: value}))
        assert _error(info.value)["param"] == name, name
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, temperature=0,
                                         **_extra(use_beam_search=False, length_penalty=1.0,
                                                  modalities=["text"], echo=False, prompt_logprobs=None))
    assert out.choices[0].message.content is not None

    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="no-such-model", prompt="hi")
    assert _error(info.value)["code"] == "model_not_found"

    long_prompt = list(range(3, 3 + MAX_MODEL_LEN))
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=long_prompt, max_tokens=1)
    assert _error(info.value)["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as info:  # fits alone, not with max_tokens
        client.completions.create(model=MODEL, prompt=long_prompt[:100], max_tokens=MAX_MODEL_LEN)
    assert _error(info.value)["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=[1, 10**9])
    assert "outside the vocabulary" in _error(info.value)["message"]

    status, body = server.http("POST", "/v1/completions", b'{"model": "tiny-llama", "prompt": ')
    err = json.loads(body)["error"]
    assert status == 400 and "JSON" in err["message"], (status, body)
    status, body = server.http("POST", "/v1/chat/completions", json.dumps({"model": MODEL}).encode())
    assert status == 400 and json.loads(body)["error"]["param"] == "messages", body
    status, body = server.http("GET", "/v1/nothing-here")
    assert status == 404 and "error" in json.loads(body)
    # None of that disturbed the server.
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2).usage.completion_tokens >= 1
    server.wait_idle()


FUZZ_VALUES = [None, "x", 1.5, True, [], {}, -1, 10**30, [1, "a"], {"a": 1}, "", 0, 2.5e308]
FUZZ_ENDPOINTS = [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2},
     ["prompt", "max_tokens", "temperature", "top_p", "top_k", "n", "stop", "seed", "logprobs", "echo", "logit_bias",
      "presence_penalty", "frequency_penalty", "stream", "min_tokens", "stream_options", "suffix", "best_of", "user",
      "response_format", "min_p", "repetition_penalty", "ignore_eos", "stop_token_ids", "skip_special_tokens",
      "priority", "structured_outputs", "return_token_ids", "include_stop_str_in_output", "bad_words",
      "allowed_token_ids", "prompt_logprobs"]),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
     ["messages", "max_tokens", "max_completion_tokens", "tools", "tool_choice", "logprobs", "top_logprobs",
      "response_format", "stream", "n", "chat_template_kwargs", "parallel_tool_calls", "reasoning_effort",
      "add_generation_prompt", "continue_final_message", "stream_options", "stop"]),
    ("/v1/embeddings", {"input": "hi"}, ["input", "dimensions", "encoding_format"]),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 2},
     ["input", "max_output_tokens", "instructions", "tools", "text", "reasoning", "stream"]),
    ("/tokenize", {"prompt": "hi"}, ["prompt", "add_special_tokens", "messages"]),
    ("/detokenize", {"tokens": [1, 2]}, ["tokens"]),
]


def test_a_field_of_any_wrong_type_gets_a_4xx_never_a_5xx(server):
    """Every field of every endpoint set to each of FUZZ_VALUES in turn (JSON types a client may send
    by mistake): the answer is a 2xx (a value the API accepts) or a 4xx naming the problem, never an
    internal error; the server answers a well-formed request afterwards."""
    failures = []
    for path, base, fields in FUZZ_ENDPOINTS:
        for field in fields:
            for value in FUZZ_VALUES:
                code, body = server.http("POST", path, json.dumps({"model": MODEL, **base, field: value}).encode())
                if code >= 500:
                    failures.append((path, field, value, code, body[:120]))
    assert not failures, failures
    code, _ = server.http("POST", "/v1/completions", json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2}).encode())
    assert code == 200


_USER_PARTS = {"role": "user", "content": [{"type": "text", "text": "hi"}]}
_CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
_TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
_SCHEMA = {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "object"}}}
NESTED_FUZZ = [  # (endpoint, a request that is answered, the nested places whose value the fuzz replaces)
    ("/v1/chat/completions", {"messages": [_USER_PARTS, {"role": "assistant", "content": "", "tool_calls": [_CALL]},
                                            {"role": "tool", "tool_call_id": "call_1", "content": "ok"}],
                              "max_tokens": 2, "tools": [_TOOL],
                              "tool_choice": {"type": "function", "function": {"name": "f"}}, "chat_template_kwargs": {"x": 1}},
     [("messages", 0), ("messages", 0, "role"), ("messages", 0, "content"), ("messages", 0, "content", 0),
      ("messages", 0, "content", 0, "type"), ("messages", 0, "content", 0, "text"), ("messages", 1, "tool_calls"),
      ("messages", 1, "tool_calls", 0), ("messages", 1, "tool_calls", 0, "id"), ("messages", 1, "tool_calls", 0, "function"),
      ("messages", 1, "tool_calls", 0, "function", "name"), ("messages", 1, "tool_calls", 0, "function", "arguments"),
      ("messages", 2, "tool_call_id"), ("messages", 2, "content"), ("tools", 0), ("tools", 0, "type"),
      ("tools", 0, "function"), ("tools", 0, "function", "name"), ("tools", 0, "function", "parameters"),
      ("tool_choice", "type"), ("tool_choice", "function"), ("tool_choice", "function", "name"),
      ("chat_template_kwargs", "x"), ("tools", 0, "function", "parameters", "type"),
      ("tools", 0, "function", "parameters", "properties"), ("tools", 0, "function", "description"),
      ("messages", 1, "tool_calls", 0, "type"), ("messages", 0, "name"), ("messages", 1, "content")]),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                              "response_format": _SCHEMA},
     [("response_format", "type"), ("response_format", "json_schema"), ("response_format", "json_schema", "name"),
      ("response_format", "json_schema", "schema"), ("response_format", "json_schema", "strict"),
      ("response_format", "json_schema", "schema", "type"), ("response_format", "json_schema", "schema", "properties")]),
    ("/v1/completions", {"prompt": ["hi", "yo"], "max_tokens": 2, "logit_bias": {"42": 1},
                         "structured_outputs": {"choice": ["a", "b"]}, "stop": ["x"]},
     [("prompt", 0), ("logit_bias", "42"), ("structured_outputs", "choice"), ("structured_outputs", "choice", 0),
      ("structured_outputs", "regex"), ("structured_outputs", "json"), ("structured_outputs", "grammar"), ("stop", 0)]),
    ("/v1/responses", {"input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
                                 {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                                 {"type": "function_call_output", "call_id": "c", "output": "ok"}],
                       "max_output_tokens": 2, "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
                       "tool_choice": {"type": "function", "name": "f"}, "reasoning": {"summary": "auto"}},
     [("input", 0), ("input", 0, "role"), ("input", 0, "content"), ("input", 0, "content", 0),
      ("input", 0, "content", 0, "type"), ("input", 0, "content", 0, "text"), ("input", 1, "type"),
      ("input", 1, "call_id"), ("input", 1, "name"), ("input", 1, "arguments"), ("input", 2, "output"),
      ("tools", 0), ("tools", 0, "type"), ("tools", 0, "name"), ("tools", 0, "parameters"), ("tool_choice", "type"),
      ("tool_choice", "name"), ("reasoning", "effort"), ("reasoning", "summary")]),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 2, "metadata": {"k": "v"},
                       "text": {"format": {"type": "json_schema", "name": "s", "schema": {"type": "object"}}}},
     [("text", "format"), ("text", "format", "type"), ("text", "format", "name"), ("text", "format", "schema"),
      ("metadata",), ("metadata", "k")]),
    ("/v1/completions", {"prompt": [[1, 2, 3], [4, 5]], "max_tokens": 2}, [("prompt", 0), ("prompt", 0, 0)]),
    ("/v1/embeddings", {"input": ["hi", "yo"]}, [("input", 0)]),
    ("/v1/embeddings", {"input": [[1, 2, 3], [4, 5]]}, [("input", 0), ("input", 0, 0)]),
    ("/tokenize", {"messages": [_USER_PARTS]}, [("messages", 0), ("messages", 0, "role"), ("messages", 0, "content"),
                                                ("messages", 0, "content", 0), ("messages", 0, "content", 0, "text")]),
    ("/detokenize", {"tokens": [1, 2]}, [("tokens", 0)]),
]


def _stream_finished(path: str, body: bytes) -> bool:
    """Whether a streamed answer ended as its API ends one: chat and completions with data: [DONE],
    the Responses API with its last event, response.completed or response.incomplete."""
    if path == "/v1/responses":
        last = body.rstrip().rsplit(b"\n\n", 1)[-1]
        return b'"type": "response.completed"' in last or b'"type": "response.incomplete"' in last
    return body.endswith(b"data: [DONE]\n\n")


@pytest.mark.parametrize("stream", [False, True])
def test_a_nested_value_of_any_wrong_type_gets_a_4xx_never_a_5xx(tool_server, stream):
    """As the test above, one level down and further: each place inside a message, a content part, a
    tool call, a tool, a response format, a Responses input item (NESTED_FUZZ) set to each of
    FUZZ_VALUES in turn, on the server that parses tool calls. The unchanged requests are answered
    (2xx), so each place is reached. Streamed (the generating endpoints), a failure could also come
    as an error event inside a 200, or as a stream that ends without its [DONE]: those count too."""
    import copy

    server, _ = tool_server
    failures = []
    for path, base, places in NESTED_FUZZ:
        if stream:
            if path not in ("/v1/completions", "/v1/chat/completions", "/v1/responses"):
                continue
            base = {**base, "stream": True}
        code, body = server.http("POST", path, json.dumps({"model": MODEL, **base}).encode())
        assert code == 200 and b"server_error" not in body and (not stream or _stream_finished(path, body)), (
            path, code, body[-300:])
        for place in places:
            for value in FUZZ_VALUES:
                request = copy.deepcopy({"model": MODEL, **base})
                parent = request
                for key in place[:-1]:
                    parent = parent[key]
                parent[place[-1]] = value
                code, body = server.http("POST", path, json.dumps(request).encode())
                cut = stream and code == 200 and not _stream_finished(path, body)
                if code >= 500 or b"server_error" in body or cut:
                    failures.append((path, place, value, code, body[-160:]))
    assert not failures, failures
    server.wait_idle()


def test_request_lists_beyond_their_limits_are_refused(server, client):
    """stop, bad_words, stop_token_ids, allowed_token_ids and logit_bias hold at most
    REQUEST_LIST_LIMITS entries, a stop string or bad word at most MAX_STRING_CHARS characters: a 400
    naming the field and the limit (before 2026-12 any length was taken: each entry is host work on
    every step of the request, bad words tokenized on the engine thread). At the limits, answered."""
    from tileattn.engine.server import MAX_STRING_CHARS, REQUEST_LIST_LIMITS as caps

    def lists(extra):  # each list at its limit plus extra entries (repeated ids: the vocabulary has 384)
        return {"stop": [f"stop{i}" for i in range(caps["stop"] + extra)],
                "bad_words": [f"word{i}" for i in range(caps["bad_words"] + extra)],
                "stop_token_ids": [5] * (caps["stop_token_ids"] + extra),
                "allowed_token_ids": [42] * (caps["allowed_token_ids"] + extra)}

    for name, value in lists(1).items():
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=MODEL, prompt="hi", max_tokens=2, **_extra(**{name: value}))
        err = _error(info.value)
        assert err["param"] == name and f"at most {caps[name]} are allowed" in err["message"], (name, err)
    with pytest.raises(openai.BadRequestError) as info:  # distinct keys: past the vocabulary too, the limit first
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2,
                                  logit_bias={str(i): 1 for i in range(caps["logit_bias"] + 1)})
    assert _error(info.value)["param"] == "logit_bias" and "at most 4096" in _error(info.value)["message"]
    for name in ("stop", "bad_words"):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                           **_extra(**{name: ["ok", "x" * (MAX_STRING_CHARS + 1)]}))
        err = _error(info.value)
        assert err["param"] == name and f"{name}[1] has {MAX_STRING_CHARS + 1} characters" in err["message"], err
    at_limit = lists(0)
    out = client.completions.create(model=MODEL, prompt="hi", max_tokens=2, logit_bias={"42": 1},
                                    **_extra(**{**at_limit, "stop": at_limit["stop"][:-1] + ["y" * MAX_STRING_CHARS]}))
    assert out.choices[0].finish_reason in ("stop", "length")


def test_metrics(server, client):
    from prometheus_client.parser import text_string_to_metric_families

    client.completions.create(model=MODEL, prompt="metrics please", max_tokens=4, **_extra(ignore_eos=True))
    status, body = server.http("GET", "/metrics")
    assert status == 200
    samples = {s.name: s.value for f in text_string_to_metric_families(body.decode()) for s in f.samples
               if not s.labels or set(s.labels) == {"le"} and s.labels["le"] == "+Inf"}
    assert samples["tileattn:prompt_tokens_total"] > 0
    assert samples["tileattn:generation_tokens_total"] >= 4
    assert samples["tileattn:time_to_first_token_seconds_count"] >= 1
    assert samples["tileattn:inter_token_latency_seconds_count"] >= 3
    for name in ("tileattn:num_requests_running", "tileattn:num_requests_waiting",
                 "tileattn:kv_cache_usage_perc", "tileattn:prefix_cache_hits_total"):
        assert name in samples, name
    assert samples["tileattn:spec_decode_num_draft_tokens_total"] == 0  # this server drafts nothing


def test_cancel_stream_frees_blocks(server, client):
    stream = client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=150,
                                       temperature=0, stream=True, **_extra(ignore_eos=True))
    for got, _ in enumerate(stream, 1):
        if got == 3:
            break
    stats = server.engine_stats()
    assert stats["num_running"] + stats["num_waiting"] == 1, f"request not running mid-stream: {stats}"
    stream.close()
    server.wait_idle(timeout=10)

    # A non-streaming client that hangs up mid-answer also aborts its request.
    body = json.dumps({"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 150, "temperature": 0,
                       "ignore_eos": True}).encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        deadline = time.monotonic() + 10
        while server.engine_stats()["num_running"] == 0:
            assert time.monotonic() < deadline, "the non-streaming request never started running"
            time.sleep(0.01)
    server.wait_idle(timeout=10)
    assert server.state.in_flight == 0


def test_overload_gets_503(checkpoint):
    # Tests that start their own server get their own engine: one engine thread per engine.
    with ServerThread(create_app(make_engine(checkpoint), MODEL, max_queue_depth=1)) as s:
        client = s.client()
        stream = client.completions.create(model=MODEL, prompt="hold the queue", max_tokens=150,
                                           temperature=0, stream=True, **_extra(ignore_eos=True))
        next(iter(stream))
        with pytest.raises(openai.InternalServerError) as info:
            client.completions.create(model=MODEL, prompt="one too many", max_tokens=2)
        assert info.value.status_code == 503 and _error(info.value)["code"] == "overloaded"
        stream.close()
        s.wait_idle(timeout=10)
        assert client.completions.create(model=MODEL, prompt="room again", max_tokens=2).choices


def test_request_bodies_beyond_the_limit_get_413_unread(checkpoint):
    """A body longer than max_request_bytes gets a 413 with OpenAI's error body, whether it
    declares its Content-Length (refused before it is read) or comes chunked (refused once its
    bytes pass the limit); one just under the limit is served, and so are requests after."""
    import http.client

    limit = 4096
    with ServerThread(create_app(make_engine(checkpoint), MODEL, max_request_bytes=limit)) as s:
        def post(body: bytes, chunked: bool) -> tuple[int, dict]:
            conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=30)
            if chunked:  # an iterable body without a length goes out with Transfer-Encoding: chunked
                conn.request("POST", "/v1/completions", body=iter([body[:1000], body[1000:]]),
                             headers={"Content-Type": "application/json"}, encode_chunked=True)
            else:
                conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
            r = conn.getresponse()
            status, answer = r.status, json.loads(r.read())
            conn.close()
            return status, answer

        def body(size: int) -> bytes:  # a short prompt, padded to `size` bytes with JSON whitespace
            short = json.dumps({"model": MODEL, "max_tokens": 1, "prompt": "hi"}).encode()
            return short[:-1] + b" " * (size - len(short)) + b"}"

        for chunked in (False, True):
            status, answer = post(body(limit + 1), chunked)
            assert status == 413, (chunked, answer)
            assert "4096 bytes" in answer["error"]["message"], answer
            assert (answer["error"]["type"], answer["error"]["code"]) == ("invalid_request_error", "request_too_large")
            status, answer = post(body(limit), chunked)
            assert status == 200 and answer["choices"], (chunked, answer)
        assert s.client().completions.create(model=MODEL, prompt="still serving", max_tokens=1).choices


def test_64_concurrent_streams_match_alone_then_clean_shutdown(checkpoint):
    """64 greedy streams at once, beside 16 clients that hang up after two chunks and 8 bad
    requests: the 64 get exactly their lone tokens, in a few batched steps; nothing leaks."""
    import random

    engine = make_engine(checkpoint)
    rng = random.Random(0)
    vocab = engine.tokenizer.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randrange(4, 40))] for _ in range(64)]
    max_tokens = [rng.randrange(4, 12) for _ in range(64)]
    app = create_app(engine, MODEL, max_queue_depth=128)
    with ServerThread(app) as s:
        kw = {"model": MODEL, "temperature": 0, "extra_body": {"ignore_eos": True, "return_token_ids": True}}
        client = s.client()
        alone = [client.completions.create(prompt=p, max_tokens=m, **kw).choices[0].token_ids
                 for p, m in zip(prompts, max_tokens)]

        async def one(aclient, p, m):
            stream = await aclient.completions.create(prompt=p, max_tokens=m, stream=True, **kw)
            ids = []
            async for chunk in stream:
                ids += chunk.choices[0].token_ids or []
            return ids

        async def quitter(aclient, p):
            stream = await aclient.completions.create(prompt=p, max_tokens=150, stream=True, **kw)
            chunks = 0
            async for _ in stream:
                chunks += 1
                if chunks == 2:
                    break
            await stream.close()
            return chunks

        async def bad(aclient, overrides):
            try:
                await aclient.completions.create(**{**kw, "max_tokens": 2, **overrides})
            except openai.BadRequestError as exc:
                return exc.status_code
            return None

        bad_requests = [{"prompt": "x", "temperature": -1}, {"prompt": list(range(3, 3 + MAX_MODEL_LEN))},
                        {"prompt": [1, 10**9]}, {"prompt": "x", "n": 0}] * 2

        async def all_at_once():
            aclient = openai.AsyncOpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=120)
            try:
                return await asyncio.wait_for(asyncio.gather(
                    *(one(aclient, p, m) for p, m in zip(prompts, max_tokens)),
                    *(quitter(aclient, p) for p in prompts[:16]),
                    *(bad(aclient, b) for b in bad_requests)), 120)
            finally:
                await aclient.close()

        steps = []
        real_step = engine.step
        engine.step = lambda: steps.append(1) or real_step()  # count steps (engine thread only)
        try:
            t0 = time.monotonic()
            results = asyncio.run(all_at_once())
            elapsed = time.monotonic() - t0
        finally:
            del engine.step
        together, quits, bads = results[:64], results[64:80], results[80:]
        assert quits == [2] * 16 and bads == [400] * len(bad_requests), (quits, bads)
        for i, (a, b) in enumerate(zip(alone, together)):
            assert a == b, f"request {i}: alone {a} vs concurrent {b}"
        assert len(steps) < sum(max_tokens) / 4, (
            f"{len(steps)} engine steps for {sum(max_tokens)} tokens: the streams were not batched together")
        assert s.http("GET", "/health")[0] == 200
        stats = s.wait_idle(timeout=10)
        assert s.state.in_flight == 0 and not s.state.generations
        print(f"64 concurrent streams in {elapsed:.2f} s, {len(steps)} engine steps; engine stats after: {stats}")
        engine_loop = s.state.engine_loop
    assert not engine_loop.running, "engine thread still running after shutdown"


def test_bench_serve_against_the_server(server, checkpoint, tmp_path):
    from tileattn.engine.bench_serve import bench_serve_main

    out = tmp_path / "bench.json"
    # return_token_ids: chunks of tokens without text yet (a random model's byte fragments) still
    # count as token events.
    common = ["--base-url", server.url, "--num-prompts", "12", "--random-input-len", "24", "--random-output-len",
              "6", "--tokenizer", checkpoint, "--ignore-eos", "--extra-body", '{"return_token_ids": true}',
              "--result-json", str(out)]
    assert bench_serve_main([*common, "--request-rate", "50", "inf", "--max-concurrency", "6"]) == 0
    record = json.loads(out.read_text())
    runs = record["runs"]
    assert {"git_commit", "git_dirty", "command", "torch", "python"} <= set(record["client_environment"])
    assert [r["request_rate"] for r in runs] == [50.0, "inf"]
    for r in runs:
        assert (r["completed"], r["failed"], r["total_output_tokens"], r["total_input_tokens"]) == (12, 0, 72, 288), r
        assert r["output_tokens_from_usage"], r
        assert 0 < r["ttft_ms"]["median"] <= r["e2el_ms"]["median"] and r["tpot_ms"]["mean"] > 0, r
        assert r["output_throughput"] == pytest.approx(72 / r["duration_s"])

    assert bench_serve_main([*common, "--endpoint", "/v1/chat/completions", "--prompt-format", "text"]) == 0
    (chat,) = json.loads(out.read_text())["runs"]
    assert (chat["completed"], chat["total_output_tokens"]) == (12, 72), chat
    assert chat["total_input_tokens"] > 12 * 20, "usage prompt_tokens (template included) not used"
    # A server that is not there: a clear failure, not a hang.
    assert bench_serve_main(["--base-url", "http://127.0.0.1:9", "--vocab-size", "100", "--num-prompts", "1",
                             "--timeout", "5"]) == 2


def test_bench_serve_refuses_bad_options_before_sending(capsys):
    """Each bad option exits 2 with its reason before any request is sent (nothing listens on port 9)."""
    from tileattn.engine.bench_serve import bench_serve_main, make_prompts

    base = ["--base-url", "http://127.0.0.1:9", "--num-prompts", "1", "--timeout", "5"]
    for argv, reason in ((base, "give --vocab-size or --tokenizer"),
                         ([*base, "--vocab-size", "100", "--endpoint", "/v1/chat/completions"],
                          "chat endpoints take text: use --prompt-format text --tokenizer DIR"),
                         ([*base, "--vocab-size", "100", "--request-rate", "0"], "request rates must be > 0")):
        assert bench_serve_main(argv) == 2
        assert reason in capsys.readouterr().err
    # the prompt maker's own refusals (it runs once the server answers)
    for args, kwargs, match in (((0, 8, 8, 0.0, 100), {}, "^num_prompts, input_len, output_len must be >= 1"),
                                ((1, 8, 8, 0.0, 1), {}, "and vocab_size >= 2, got 1, 8, 8, 1"),
                                ((1, 8, 8, 1.0, 100), {}, r"^range_ratio must be in \[0, 1\), got 1.0"),
                                ((1, 8, 8, 0.0, 100), {"as_text": True}, "^text prompts need a tokenizer")):
        with pytest.raises(ValueError, match=match):
            make_prompts(*args, **kwargs)


def test_bench_percentiles_match_numpy():
    import numpy as np

    from tileattn.engine.bench_serve import _percentiles

    values = [random_value / 7 for random_value in (5, 1, 9, 3, 3, 8, 13, 2, 21, 4, 6)]
    got = _percentiles(values, scale=1.0)
    for key, p in (("median", 50), ("p90", 90), ("p99", 99)):
        assert got[key] == pytest.approx(np.percentile(values, p)), key
    assert got["mean"] == pytest.approx(np.mean(values)) and got["std"] == pytest.approx(np.std(values))


def test_engine_failure_is_reported_not_hung(checkpoint):
    """A step that raises ends the engine thread: open requests get an error (stream: an error event;
    otherwise 503), /health says 503, and the server still shuts down cleanly."""
    engine = make_engine(checkpoint)
    real_step = engine.step

    def failing_step():
        if engine.stats()["num_running"] >= 2:
            raise RuntimeError("injected step failure")
        return real_step()

    engine.step = failing_step
    with ServerThread(create_app(engine, MODEL)) as s:
        client = s.client()
        stream = client.completions.create(model=MODEL, prompt="stream me", max_tokens=100, stream=True,
                                           **_extra(ignore_eos=True))
        next(iter(stream))
        with pytest.raises(openai.InternalServerError) as info:  # the second request trips the failure
            client.completions.create(model=MODEL, prompt="and me", max_tokens=100, **_extra(ignore_eos=True))
        assert info.value.status_code == 503 and "injected step failure" in _error(info.value)["message"]
        with pytest.raises(openai.APIError, match="injected step failure"):
            list(stream)
        assert s.http("GET", "/health")[0] == 503
        with pytest.raises(openai.InternalServerError):
            client.completions.create(model=MODEL, prompt="after", max_tokens=2)


def test_cli_serve_bad_options_exit_2_with_the_reason(checkpoint, tmp_path, capsys):
    import argparse

    from tileattn.engine.server import add_serve_command

    ap = argparse.ArgumentParser(prog="tileattn")
    add_serve_command(ap.add_subparsers())
    for argv, reason in ((["serve", str(tmp_path / "missing")], "does not exist"),
                         (["serve", checkpoint, "--device", "cpu", "--max-queue-depth", "0"], "max_queue_depth"),
                         (["serve", checkpoint, "--device", "cpu", "--max-request-bytes", "0"], "max_request_bytes"),
                         (["serve", checkpoint, "--device", "cpu", "--chat-template", "{% for m in messages %}"],
                          "does not compile"),
                         (["serve", checkpoint, "--device", "cpu", "--chat-template", str(tmp_path / "none.jinja")],
                          "neither a file nor a jinja2 template"),
                         (["serve", checkpoint, "--port", "65536"], "--port must be in 0..65535, got 65536"),
                         (["serve", checkpoint, "--lora-modules", "noequals"], "--lora-modules takes NAME=PATH"),
                         (["serve", checkpoint, "--served-model-name", "m", "--lora-modules", f"m={tmp_path}"],
                          "an adapter may not be named like the served model ('m')"),
                         (["serve", checkpoint, "--lora-modules", f"a={tmp_path}", f"b={tmp_path}", "--max-loras", "1"],
                          "--max-loras 1 is fewer than the 2 --lora-modules")):
        args = ap.parse_args(argv)
        assert args.fn(args) == 2
        assert reason in capsys.readouterr().err


def _spawned_children(pid: int) -> list[int]:
    """Pids of the multiprocessing-spawned children of ``pid`` (tensor-parallel workers), from /proc."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:  # exited meanwhile
            continue
        if ppid == pid and b"spawn_main" in cmdline:
            found.append(int(entry))
    return found


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # exited, not yet reaped
    except OSError:
        return True


@pytest.mark.parametrize("tensor_parallel_size", [1, 2])
def test_cli_serve_starts_answers_and_stops_on_sigint(checkpoint, tensor_parallel_size):
    """`tileattn serve` through add_serve_command in a subprocess: /health, one chat, then SIGINT
    gives a clean exit (uvicorn shutdown, engine thread joined, exit code 0). With
    --tensor-parallel-size 2 the server drives a spawned gloo worker from its engine thread, and
    the worker is gone after the exit."""
    import signal
    import subprocess

    import tileattn

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    code = ("import argparse, sys; from tileattn.engine.server import add_serve_command;"
            "ap = argparse.ArgumentParser(); add_serve_command(ap.add_subparsers());"
            "args = ap.parse_args(sys.argv[1:]); sys.exit(args.fn(args))")
    cmd = [sys.executable, "-c", code, "serve", checkpoint, "--port", str(port), "--served-model-name", MODEL,
           "--device", "cpu", "--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-blocks", "64",
           "--log-level", "warning", "--tensor-parallel-size", str(tensor_parallel_size)]
    src = os.path.dirname(os.path.dirname(tileattn.__file__))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, f"serve exited early: {proc.communicate()[0][-2000:]}"
            assert time.monotonic() < deadline, "serve did not come up within 120 s"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.2)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=60)
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                           **_extra(ignore_eos=True))
        assert r.usage.completion_tokens == 3
        workers = _spawned_children(proc.pid) if sys.platform == "linux" else []
        if sys.platform == "linux":
            assert len(workers) == tensor_parallel_size - 1, f"tensor-parallel workers: {workers}"
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 0, out[-2000:]
        deadline = time.monotonic() + 5
        while not all(_gone(w) for w in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert all(_gone(w) for w in workers), "tensor-parallel workers outlived the server"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def test_shutdown_with_a_stream_in_flight_leaves_the_engine_empty(checkpoint):
    """uvicorn's graceful period ends while a stream still runs: its task is cancelled, the request
    aborted, the engine thread joined, and the engine holds nothing afterwards."""
    engine = make_engine(checkpoint)
    real_step = engine.step
    engine.step = lambda: time.sleep(0.02) or real_step()  # ~170 tokens take > 3 s
    with ServerThread(create_app(engine, MODEL), graceful_shutdown_s=0.5) as s:
        stream = s.client().completions.create(model=MODEL, prompt="long answer", max_tokens=170, stream=True,
                                               **_extra(ignore_eos=True))
        next(iter(stream))
        engine_loop = s.state.engine_loop
    assert not engine_loop.running
    stats = engine.stats()
    assert not engine.has_unfinished_requests() and stats["num_free_blocks"] == stats["num_total_blocks"], stats


# ---------------------------------------------------------------------------------------------
# Tool calls: a chat template that renders tools, and a sampler that writes a given answer

TOOL_TEMPLATE = (
    "{% if tools %}<s>system: tools:{% for t in tools %} {{ t | tojson }}{% endfor %}</s>{% endif %}"
    "{% for m in messages %}<s>{{ m['role'] }}: "
    "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}"
    "{% if m.thinking %}<analysis>{{ m.thinking }}</analysis>{% endif %}"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{\"name\": \"{{ c.function.name }}\", "
    "\"arguments\": {{ c.function.arguments | tojson }}}</tool_call>{% endfor %}"
    "{% else %}{{ m['content'] }}{% endif %}</s>{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant: {% endif %}")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
PARIS = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
ROME = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'


class ScriptedAnswer:
    """The engine's model runs as usual, but its sampler returns the tokens of a given answer, then
    EOS: everything else (scheduler, detokenizer, stop strings, server, stream) is the real path.
    answer(None): the real sampler again (the random model speaks); answer(text, then_model=True):
    the text, then the real sampler."""

    def __init__(self, engine):
        import torch

        self.tokenizer, self.ids, self.then_model = engine.tokenizer, None, False
        eos = engine.tokenizer.eos_token_id
        engine.async_scheduling = False  # the sampler reads each sequence's output count
        real_sample = engine.runner.sampler.sample

        def sample(logits, seqs):
            if self.ids is None:
                return real_sample(logits, seqs)
            after = real_sample(logits, seqs).tolist() if self.then_model else [eos] * len(seqs)
            return torch.tensor([self.ids[s.num_output_tokens] if s.num_output_tokens < len(self.ids) else t
                                 for s, t in zip(seqs, after)], device=logits.device)

        engine.runner.sampler.sample = sample

    def __call__(self, text: str | None, then_model: bool = False) -> int:
        self.then_model = then_model
        if text is None:
            self.ids = None
            return 0
        self.ids = self.tokenizer.encode(text, add_special_tokens=False)
        assert self.tokenizer.decode(self.ids) == text
        return len(self.ids)


@pytest.fixture(scope="module")
def tool_server(checkpoint, tmp_path_factory):
    """A server with --tool-call-parser hermes and --reasoning-parser qwen3 over the tiny checkpoint
    with TOOL_TEMPLATE and Qwen3's "<think>" / "</think>" tokens, and the ScriptedAnswer that
    decides what its model says."""
    import shutil

    path = str(tmp_path_factory.mktemp("tool_llama") / "ckpt")
    shutil.copytree(checkpoint, path)
    add_think_tokens(path)  # qwen3's optional block: the answer's first token opens it, or not
    with open(os.path.join(path, "chat_template.jinja"), "w", encoding="utf-8") as f:
        f.write(TOOL_TEMPLATE)
    engine = make_engine(path, max_model_len=512)  # the tools' JSON takes many of the tiny vocabulary's tokens
    answer = ScriptedAnswer(engine)
    with ServerThread(create_app(engine, MODEL, tool_call_parser="hermes", reasoning_parser="qwen3")) as s:
        yield s, answer


def _rendered(server, body: dict) -> str:
    status, out = server.http("POST", "/tokenize", json.dumps(body).encode())
    assert status == 200, out
    return server.state.tokenizer.decode(json.loads(out)["tokens"], skip_special_tokens=False)


def test_tool_calls_parsed_streamed_and_rendered_back(tool_server):
    server, answer = tool_server
    client = server.client()
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    answer("Let me check.\n" + PARIS)

    r = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER])
    (c,) = r.choices
    assert c.finish_reason == "tool_calls" and c.message.content == "Let me check."
    (call,) = c.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    # The model saw the tools: the request's prompt is the one /tokenize renders with them.
    shown = _rendered(server, {"messages": messages, "tools": [WEATHER]})
    assert '"name": "get_weather"' in shown and "The weather in a city now" in shown
    assert r.usage.prompt_tokens == len(server.state.tokenizer.encode(shown, add_special_tokens=False))

    # Streamed: the deltas add up to the same message (the openai client's own accumulation).
    with client.beta.chat.completions.stream(model=MODEL, messages=messages, tools=[WEATHER]) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    (sc,) = final.choices
    assert sc.finish_reason == "tool_calls" and sc.message.content == "Let me check."
    assert [(t.function.name, json.loads(t.function.arguments)) for t in sc.message.tool_calls] == [
        ("get_weather", {"city": "Paris"})]

    # The next turn: the assistant's call (arguments as the JSON string the API carries) and the
    # tool's answer render through the template, the arguments as a mapping (not a quoted string).
    turn = messages + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                       {"role": "tool", "tool_call_id": call.id, "content": "18 C, sunny"}]
    shown = _rendered(server, {"messages": turn, "tools": [WEATHER]})
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in shown
    assert "<s>tool: 18 C, sunny</s>" in shown
    # The assistant's reasoning sent back reaches the template as reasoning_content (Qwen3's
    # templates) and thinking (gpt-oss's); on a message of another role it is refused.
    reasoned = [*turn[:1], {**turn[1], "reasoning_content": "I need the weather."}, *turn[2:]]
    shown = _rendered(server, {"messages": reasoned, "tools": [WEATHER]})
    assert "<s>assistant: <think>I need the weather.</think><analysis>I need the weather.</analysis><tool_call>" in shown
    status, out = server.http("POST", "/tokenize", json.dumps(
        {"messages": [{"role": "user", "content": "hi", "reasoning_content": "no"}]}).encode())
    assert status == 400 and "reasoning_content belongs to assistant messages" in out.decode()
    answer("It is 18 C and sunny in Paris.")
    r = client.chat.completions.create(model=MODEL, messages=turn, tools=[WEATHER])
    assert r.choices[0].message.content == "It is 18 C and sunny in Paris." and r.choices[0].finish_reason == "stop"
    assert not r.choices[0].message.tool_calls
    server.wait_idle()


def test_parallel_tool_calls_and_tool_choice(tool_server):
    server, answer = tool_server
    client = server.client()
    messages = [{"role": "user", "content": "Paris and Rome?"}]
    length = answer(PARIS + "\n" + ROME)

    r = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], n=2)
    for c in r.choices:
        assert c.finish_reason == "tool_calls" and c.message.content is None
        assert [json.loads(t.function.arguments)["city"] for t in c.message.tool_calls] == ["Paris", "Rome"]
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], stream=True))
    deltas = [t for ch in chunks for t in (ch.choices[0].delta.tool_calls or [])]
    assert [(t.index, json.loads(t.function.arguments)["city"]) for t in deltas] == [(0, "Paris"), (1, "Rome")]
    assert len({t.id for t in deltas}) == 2 and chunks[-1].choices[0].finish_reason == "tool_calls"

    # parallel_tool_calls: false ends the answer at the first call's end tag
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], parallel_tool_calls=False)
    (c,) = r.choices
    assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1
    assert r.usage.completion_tokens < length
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], stream=True,
                                                 parallel_tool_calls=False))
    deltas = [t for ch in chunks for t in (ch.choices[0].delta.tool_calls or [])]
    assert [json.loads(t.function.arguments)["city"] for t in deltas] == ["Paris"]
    # ... but not at an end tag the model writes while it thinks (the stop is searched in the content)
    thinking = "<think>I close with </tool_call> after the call.</think>"
    length = answer(thinking + PARIS + "\n" + ROME)
    for stream in (False, True):
        out = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], stream=stream,
                                             parallel_tool_calls=False)
        if stream:
            out = list(out)
            reasoning = "".join(getattr(ch.choices[0].delta, "reasoning_content", None) or "" for ch in out)
            calls = [t for ch in out for t in (ch.choices[0].delta.tool_calls or [])]
            finish = out[-1].choices[0].finish_reason
        else:
            reasoning, calls = out.choices[0].message.reasoning_content, out.choices[0].message.tool_calls
            finish = out.choices[0].finish_reason
            assert out.usage.completion_tokens < length
        assert reasoning == "I close with </tool_call> after the call.", (stream, reasoning)
        assert [json.loads(t.function.arguments)["city"] for t in calls] == ["Paris"] and finish == "tool_calls"

    # tool_choice "none": the model is not shown the tools, and its answer is plain text
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], tool_choice="none")
    assert r.choices[0].message.content == PARIS + "\n" + ROME and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.prompt_tokens == json.loads(server.http(
        "POST", "/tokenize", json.dumps({"messages": messages}).encode())[1])["count"]

    # a block that is not a call stays in the content as written
    answer("<tool_call>{get_weather Paris}</tool_call>")
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER])
    assert r.choices[0].message.content == "<tool_call>{get_weather Paris}</tool_call>"
    assert not r.choices[0].message.tool_calls and r.choices[0].finish_reason == "stop"
    server.wait_idle()


def test_tool_request_errors(tool_server, server):
    plain_server = server
    server, _answer = tool_server
    client = server.client()
    messages = [{"role": "user", "content": "hi"}]
    cases = [
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "required"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
         "tool_choice", "not among the tools"),
        ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
         "response_format", "cannot be combined"),
        ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools", "name"),
        ({"tools": [{"type": "function", "function": {"name": 'say"hi'}}]}, "tools", "1 to 64 letters"),
        ({"tools": [{"type": "function", "function": {"name": "get weather"}}]}, "tools", "1 to 64 letters"),
        ({"tools": [{"type": "function", "function": {"name": "f" * 65}}]}, "tools", "1 to 64 letters"),
        ({"tools": [{"type": "retrieval"}]}, "tools", "function"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, "tools", "parameters"),
        ({"tools": [WEATHER], "extra_body": {"chat_template_kwargs": {"tools": []}}}, "chat_template_kwargs", "tools"),
        ({"tools": [WEATHER], "messages": messages + [
            {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                  "function": {"name": "f", "arguments": "{not json"}}]}]},
         "messages", "arguments"),
        ({"tools": [WEATHER], "extra_body": {"functions": [WEATHER["function"]]}}, "functions", "use tools"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice", '{"type": "function", "function"'),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": 5}}}, "tool_choice", "must be"),
        ({"tools": [WEATHER], "messages": messages + [
            {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {"arguments": "{}"}}]}]},
         "messages", "messages[1].tool_calls[0] must have a function with a name"),
        ({"tools": [WEATHER], "messages": messages + [
            {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                  "function": {"name": "f", "arguments": "[1, 2]"}}]}]},
         "messages", "messages[1].tool_calls[0].function.arguments must be a JSON object"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
         "messages", "Only text content parts are supported, got 'image_url'"),
        ({"messages": messages + [{"role": "assistant", "content": ""}],
          "extra_body": {"continue_final_message": True, "add_generation_prompt": False}},
         "continue_final_message", "does not appear in the rendered prompt"),
    ]
    for kw, param, says in cases:
        kw = {"messages": messages, **kw}
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL, **kw)
        err = _error(info.value)
        assert err["param"] == param and says in err["message"], (kw, err)
    # a template without tools in it (the plain server's): the model would not see them
    status, body = plain_server.http("POST", "/tokenize", json.dumps({"messages": messages, "tools": [WEATHER]}).encode())
    assert status == 400 and "does not render tools" in json.loads(body)["error"]["message"], body
    status, body = plain_server.http("POST", "/detokenize", json.dumps({"model": MODEL, "tokens": [1, 10**6]}).encode())
    err = json.loads(body)["error"]
    assert status == 400 and err["param"] == "tokens" and "[1000000] are outside the tokenizer's vocabulary" in err["message"]
    assert client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1).choices
    server.wait_idle()


def test_tool_choice_required_and_named_hold_the_answer_to_calls(tool_server):
    """tool_choice "required" / a named function: the answer is held to calls in the hermes format,
    whatever the (random) model would say after its (scripted) thinking; the arguments follow the
    tool's schema."""
    server, answer = tool_server
    client = server.client()
    answer("<think>\nA call.\n</think>", then_model=True)  # the server's reasoning parser: the grammar starts after
    city = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]}}, "required": ["city"],
            "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": city}},
             {"type": "function", "function": {"name": "get_time", "parameters": {
                 "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
                 "additionalProperties": False}}}]
    messages = [{"role": "user", "content": "Weather?"}]
    for choice, names in (("required", {"get_weather", "get_time"}),
                          ({"type": "function", "function": {"name": "get_time"}}, {"get_time"})):
        r = client.chat.completions.create(model=MODEL, messages=messages, tools=tools, tool_choice=choice, n=3,
                                           temperature=1.0, seed=5, max_tokens=100, parallel_tool_calls=False)
        for c in r.choices:
            assert c.finish_reason == "tool_calls" and c.message.content is None, c
            (call,) = c.message.tool_calls
            assert call.function.name in names
            args = json.loads(call.function.arguments)
            assert args in ([{"city": x} for x in ("Paris", "Rome", "Oslo")] if call.function.name == "get_weather"
                            else [{"zone": "UTC"}, {"zone": "CET"}]), args
    server.wait_idle()


def test_structured_outputs_through_the_server(server, client, monkeypatch):
    """response_format (json_schema, json_object) on chat, vLLM's guided_* and structured_outputs
    on both endpoints: the random model's answers stay inside; grammars compile outside the engine
    thread, once per spec; bad specs get a 400 naming the field."""
    import threading

    grammars = server.state.engine.grammars
    compiled_on = []
    real_compile = grammars._compile

    def compile_and_record(spec):
        compiled_on.append(threading.current_thread().name)
        return real_compile(spec)

    monkeypatch.setattr(grammars, "_compile", compile_and_record)
    grammars._prepared.clear()  # whatever earlier tests on this server compiled
    schema = {"type": "object", "additionalProperties": False, "required": ["city", "n"],
              "properties": {"city": {"enum": ["Paris", "Rome"]}, "n": {"type": "integer", "minimum": 0, "maximum": 99}}}
    messages = [{"role": "user", "content": "A city?"}]
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": schema, "strict": True}}
    r = client.chat.completions.create(model=MODEL, messages=messages, response_format=fmt, temperature=1.0, seed=3,
                                       n=2, max_tokens=100)
    for c in r.choices:
        value = json.loads(c.message.content)
        assert c.finish_reason == "stop" and value["city"] in ("Paris", "Rome") and 0 <= value["n"] <= 99, value
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, response_format=fmt, temperature=1.0,
                                                 seed=3, n=2, max_tokens=100, stream=True))
    for c in r.choices:  # the same seed streams the same answers
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks
                       if ch.choices and ch.choices[0].index == c.index) == c.message.content
    r = client.chat.completions.create(model=MODEL, messages=messages, response_format={"type": "json_object"},
                                       max_tokens=60)
    assert r.choices[0].message.content.startswith("{")
    assert len(compiled_on) == 2 and "tileattn-engine" not in compiled_on, compiled_on  # the schema, then json_object

    for extra, ok in (({"guided_choice": ["red", "green"]}, lambda t: t in ("red", "green")),
                      ({"guided_regex": "[0-9]{3}"}, lambda t: re.fullmatch("[0-9]{3}", t)),
                      ({"structured_outputs": {"choice": ["up", "down"], "regex": None}}, lambda t: t in ("up", "down")),
                      ({"guided_grammar": 'start: "a" | "b"', "guided_decoding_backend": "xgrammar"},
                       lambda t: t in ("a", "b"))):
        out = client.completions.create(model=MODEL, prompt="the quick", max_tokens=20, n=2, temperature=1.0,
                                        **_extra(**extra))
        assert all(c.finish_reason == "stop" and ok(c.text) for c in out.choices), (extra, out.choices)

    for kw, param, says in (
            ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
             "response_format", "not valid"),
            ({"response_format": {"type": "xml"}}, "response_format", "json_schema"),
            ({"response_format": {"type": "json_object"}, "extra_body": {"guided_regex": "a"}}, "response_format", "one way"),
            ({"extra_body": {"guided_regex": "a(b"}}, "guided_regex", "not valid"),
            ({"extra_body": {"guided_choice": ["a"], "ignore_eos": True}}, "guided_choice", "ignore_eos"),
            ({"extra_body": {"structured_outputs": {"xml": "<a/>"}}}, "structured_outputs", "exactly one of")):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, **kw)
        err = _error(info.value)
        assert err["param"] == param and says in err["message"], (kw, err)
    server.wait_idle()


def test_api_key(checkpoint):
    """--api-key: the OpenAI endpoints and /tokenize need the key (a 401 otherwise, before any work);
    /health and /metrics stay open for monitoring."""
    with pytest.raises(ValueError, match="api_key"):
        create_app(make_engine(checkpoint), MODEL, api_key=" ")
    with ServerThread(create_app(make_engine(checkpoint), MODEL, api_key="s3cret")) as s:
        for key in ("wrong", "s3cre"):
            with pytest.raises(openai.AuthenticationError) as info:
                openai.OpenAI(base_url=s.url + "/v1", api_key=key, max_retries=0).completions.create(
                    model=MODEL, prompt="hi", max_tokens=2)
            assert _error(info.value)["code"] == "invalid_api_key"
        assert s.http("POST", "/tokenize", json.dumps({"prompt": "hi"}).encode())[0] == 401
        assert s.http("GET", "/v1/models")[0] == 401
        assert s.http("GET", "/health")[0] == 200 and s.http("GET", "/metrics")[0] == 200
        good = openai.OpenAI(base_url=s.url + "/v1", api_key="s3cret", max_retries=0)
        assert good.completions.create(model=MODEL, prompt="hi", max_tokens=2).usage.completion_tokens == 2
        assert good.models.list().data[0].id == MODEL
        assert s.engine_stats()["num_running"] == 0


def test_reasoning_apart_from_content_and_calls(tool_server):
    """--reasoning-parser qwen3: the <think> block goes to reasoning_content, whole and streamed; a
    tool call after it is still a call; an answer without the block is all content."""
    server, answer = tool_server
    client = server.client()
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    for text, reasoning, content, calls in (
            ("<think>\nThe user wants Paris.\n</think>\n\n" + PARIS, "The user wants Paris.", None, 1),
            ("<think>\nEasy.\n</think>\n\nIt is sunny.", "Easy.", "It is sunny.", 0),
            ("It is sunny.", None, "It is sunny.", 0)):
        answer(text)
        r = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER])
        message = r.choices[0].message
        assert (message.reasoning_content, message.content, len(message.tool_calls or [])) == (reasoning, content, calls)
        assert r.choices[0].finish_reason == ("tool_calls" if calls else "stop")
        chunks = list(client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], stream=True))
        deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
        assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == (reasoning or "")
        assert "".join(d.content or "" for d in deltas) == (content or "")
        assert sum(len(d.tool_calls or []) for d in deltas) == calls
    server.wait_idle()


def test_reasoning_then_structured_answer(tool_server):
    """With a reasoning parser a response_format's grammar starts after </think>: the model thinks
    (here scripted), then answers inside the schema (the random model, masked)."""
    server, answer = tool_server
    client = server.client()
    answer("<think>\nA city, as JSON.\n</think>", then_model=True)
    schema = {"type": "object", "additionalProperties": False, "required": ["city"],
              "properties": {"city": {"enum": ["Paris", "Rome"]}}}
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "A city?"}], n=2,
                                       temperature=1.0, seed=1, max_tokens=100,
                                       response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}})
    for c in r.choices:
        assert c.message.reasoning_content == "A city, as JSON." and c.finish_reason == "stop"
        assert json.loads(c.message.content)["city"] in ("Paris", "Rome"), c.message.content
    # qwen3's block is optional: an answer that does not open it (Qwen3-Instruct-2507, Qwen2.5) is held
    # to the schema from its first token (here scripted, then the random model, masked); it waited
    # for a "</think>" that never came, and ran free to max_tokens
    answer('{"', then_model=True)
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "A city?"}], n=2,
                                       temperature=1.0, seed=1, max_tokens=100,
                                       response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}})
    for c in r.choices:
        assert c.message.reasoning_content is None and c.finish_reason == "stop", c
        assert json.loads(c.message.content)["city"] in ("Paris", "Rome"), c.message.content
    server.wait_idle()


def test_responses_api(server, client):
    """POST /v1/responses through the openai client: text, instructions, a JSON-schema format,
    streamed events (numbered, deltas adding up), max_output_tokens giving "incomplete"; the
    prompt is the chat prompt of the same conversation; what cannot be served gets a 400."""
    r = client.responses.create(model=MODEL, input="Name a fox.", instructions="Be brief.", max_output_tokens=6,
                                temperature=0)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    chat = client.chat.completions.create(model=MODEL, max_tokens=6, temperature=0, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a fox."}])
    assert r.output_text == chat.choices[0].message.content
    assert (r.usage.input_tokens, r.usage.output_tokens) == (chat.usage.prompt_tokens, 6)
    assert [o.type for o in r.output] == ["message"] and r.output[0].status == "incomplete"
    metadata = {f"k{i}": "v" * 512 for i in range(16)}  # at the limits: echoed as sent
    assert client.responses.create(model=MODEL, input="hi", max_output_tokens=1, metadata=metadata).metadata == metadata

    fmt = {"format": {"type": "json_schema", "name": "pick", "schema": {
        "type": "object", "properties": {"a": {"enum": ["x", "y"]}}, "required": ["a"], "additionalProperties": False}}}
    r = client.responses.create(model=MODEL, input=[{"role": "user", "content": [{"type": "input_text", "text": "?"}]}],
                                text=fmt, max_output_tokens=40, temperature=0)
    assert r.status == "completed" and json.loads(r.output_text)["a"] in ("x", "y")
    with client.responses.stream(model=MODEL, input=[{"role": "user", "content": [{"type": "input_text", "text": "?"}]}],
                                 text=fmt, max_output_tokens=40, temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[-1].type == "response.completed" and final.output_text == r.output_text
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text

    for kw, param in (({"previous_response_id": "resp_1"}, "previous_response_id"),
                      ({"input": [{"type": "input_image", "image_url": "x"}]}, "input"),
                      ({"tools": [{"type": "web_search"}]}, "tools"),
                      ({"reasoning": {"effort": "high"}}, "reasoning"),
                      ({"text": {"format": {"type": "xml"}}}, "text"),
                      ({"extra_body": {"prompt": {"id": "pmpt_1"}}}, "prompt"),
                      ({"input": []}, "input"),
                      ({"input": [{"role": "user", "content": ["a bare string, not a content part"]}]}, "input"),
                      ({"text": {"format": "json_object"}}, "text"),
                      ({"metadata": {"n": 1}}, "metadata"),
                      ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
                      ({"metadata": {"k": "v" * 513}}, "metadata"),
                      ({"background": True}, "background"),
                      ({"extra_body": {"n": 2}}, "n"),
                      ({"input": [{"role": "robot", "content": "hi"}]}, "input"),
                      ({"input": [{"role": "user", "content": [{"type": "input_text", "text": 5}]}]}, "input"),
                      ({"input": [{"role": "user", "content": None}]}, "input"),
                      ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input"),
                      ({"input": [{"type": "function_call_output", "call_id": "c"}]}, "input")):
        kw = {"input": "hi", **kw}
        with pytest.raises(openai.BadRequestError) as info:
            client.responses.create(model=MODEL, max_output_tokens=2, **kw)
        assert _error(info.value)["param"] == param, (kw, _error(info.value))
    server.wait_idle()


def test_responses_api_reasoning_and_function_calls(tool_server):
    """Responses on the server with the hermes and qwen3 parsers: a reasoning item then a
    function_call item, whole and streamed; the next turn's function_call / function_call_output
    items render as the chat messages of the same conversation."""
    server, answer = tool_server
    client = server.client()
    tool = {"type": "function", "name": "get_weather", "description": "The weather in a city now",
            "parameters": WEATHER["function"]["parameters"]}
    answer("<think>\nThe user wants Paris.\n</think>\n\n" + PARIS)
    r = client.responses.create(model=MODEL, input="Weather in Paris?", tools=[tool])
    assert [o.type for o in r.output] == ["reasoning", "function_call"] and r.status == "completed"
    assert r.output[0].content[0].text == "The user wants Paris."
    call = r.output[1]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"} and call.call_id.startswith("call_")
    with client.responses.stream(model=MODEL, input="Weather in Paris?", tools=[tool]) as stream:
        types = [e.type for e in stream]
        final = stream.get_final_response()
    assert [o.type for o in final.output] == ["reasoning", "function_call"]
    assert "response.reasoning_text.delta" in types and "response.function_call_arguments.done" in types

    answer("It is 18 C.")
    turn = [{"role": "user", "content": "Weather in Paris?"},
            {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": "18 C, sunny"}]
    r = client.responses.create(model=MODEL, input=turn, tools=[tool])
    assert r.output_text == "It is 18 C." and [o.type for o in r.output] == ["message"]
    chat = client.chat.completions.create(model=MODEL, tools=[WEATHER], messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": call.call_id, "type": "function",
                                                             "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "18 C, sunny"}])
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    server.wait_idle()


def test_usage_counts_prompt_tokens_found_in_the_prefix_cache(server, client):
    """usage.prompt_tokens_details.cached_tokens (chat, completions, streamed usage) and the Responses
    API's input_tokens_details: 0 for a new prompt, its full blocks before the last token once cached."""
    messages = [{"role": "user", "content": "cached tokens: the quick brown fox jumps over the lazy dog " * 3}]
    block = 16  # make_engine's block_size
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    second = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, stream=True,
                                            stream_options={"include_usage": True})
    usage = list(second)[-1].usage
    n = first.usage.prompt_tokens
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert usage.prompt_tokens_details.cached_tokens == (n - 1) // block * block > 0
    out = client.completions.create(model=MODEL, prompt=["cached prompt " * 10] * 2, max_tokens=1)
    assert 0 <= out.usage.prompt_tokens_details.cached_tokens <= out.usage.prompt_tokens
    r = client.responses.create(model=MODEL, input=messages[0]["content"], max_output_tokens=2)
    assert r.usage.input_tokens_details.cached_tokens == (r.usage.input_tokens - 1) // block * block
    server.wait_idle()


def test_speculative_decoding_through_the_server(checkpoint):
    """--num-speculative-tokens: a greedy completion (streamed and not) gives the text the server
    without drafts gives, and /metrics counts the drafts."""
    from prometheus_client.parser import text_string_to_metric_families

    from tileattn.engine import LLMEngine

    prompt = [0, 300, 301, 302] * 10
    texts = []
    for k in (0, 4):
        engine = LLMEngine.from_model(checkpoint, device="cpu", max_model_len=MAX_MODEL_LEN, kv_cache_blocks=64,
                                      block_size=16, num_speculative_tokens=k)
        with ServerThread(create_app(engine, MODEL)) as s:
            client = s.client()
            whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=60, temperature=0,
                                              **_extra(ignore_eos=True)).choices[0].text
            streamed = "".join(c.choices[0].text for c in client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=60, temperature=0, stream=True, **_extra(ignore_eos=True)))
            assert streamed == whole
            texts.append(whole)
            body = s.http("GET", "/metrics")[1].decode()
            samples = {m.name: m.value for f in text_string_to_metric_families(body) for m in f.samples}
            drafted = samples["tileattn:spec_decode_num_draft_tokens_total"]
            assert (drafted > 0) == bool(k), drafted
            assert samples["tileattn:spec_decode_num_accepted_tokens_total"] <= drafted
    assert texts[0] == texts[1]


def test_embeddings_endpoint(server, client, checkpoint):
    """POST /v1/embeddings through the openai client (base64 by default, decoded by the client) and
    as floats: each input's last-token final hidden state, normalised, against transformers' base
    model; dimensions; token-id inputs; usage; the 400s and 404 before anything is queued."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    tok = server.state.tokenizer
    texts = ["the quick brown fox", "hello world! paged attention keeps keys"]

    def reference(ids, dims=None):
        with torch.no_grad():
            h = hf.model(torch.tensor([ids])).last_hidden_state[0, -1].double()
        h = h[:dims] if dims else h
        return (h / h.norm()).numpy()

    def close(vector, ref):
        vector = np.asarray(vector, dtype=np.float64)
        return float(np.linalg.norm(vector - ref) / np.linalg.norm(ref)) < 1e-5

    r = client.embeddings.create(model=MODEL, input=texts)  # the client asks for base64
    assert [d.index for d in r.data] == [0, 1] and r.model == MODEL
    ids = [tok.encode(t) for t in texts]
    assert r.usage.prompt_tokens == r.usage.total_tokens == sum(map(len, ids))
    for d, i in zip(r.data, ids):
        assert close(d.embedding, reference(i))
    floats = client.embeddings.create(model=MODEL, input=texts[0], encoding_format="float", dimensions=8)
    assert len(floats.data) == 1 and len(floats.data[0].embedding) == 8
    assert close(floats.data[0].embedding, reference(ids[0], 8))
    by_ids = client.embeddings.create(model=MODEL, input=[ids[1], [5, 6, 7]], encoding_format="float")
    assert close(by_ids.data[0].embedding, reference(ids[1])) and close(by_ids.data[1].embedding, reference([5, 6, 7]))
    status, body = server.http("POST", "/v1/embeddings", json.dumps({"input": ids[0]}).encode())
    assert status == 200 and close(json.loads(body)["data"][0]["embedding"], reference(ids[0]))
    for bad, param in (({"input": []}, "input"), ({"input": ""}, "input"),
                       ({"input": "x", "dimensions": 65}, "dimensions"), ({"input": "x", "dimensions": 0}, "dimensions"),
                       ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
                       ({"input": [[1, 2], [10**6]]}, None), ({"input": list(range(3, MAX_MODEL_LEN + 4))}, "input")):
        status, body = server.http("POST", "/v1/embeddings", json.dumps(bad).encode())
        error = json.loads(body)["error"]
        assert status == 400 and (param is None or error["param"] == param), (bad, status, error)
    assert json.loads(server.http("POST", "/v1/embeddings", json.dumps(
        {"input": list(range(3, MAX_MODEL_LEN + 4))}).encode())[1])["error"]["code"] == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="other", input="x")
    server.wait_idle()


def test_lora_adapters_served_by_name(checkpoint, tmp_path):
    """--lora-modules' path: an engine with an adapter (tests/engine/test_lora.py's writer), its name
    in /v1/models with the served model as parent, a request whose `model` names it answered by the
    adapter (the merged model's greedy tokens), the served name still the base model, and
    --lora-modules values without NAME=PATH refused."""
    import torch
    from transformers import AutoModelForCausalLM

    from tests.engine.test_lora import ALL, write_adapter
    from tileattn.engine import LLMEngine
    from tileattn.engine.server import _lora_modules

    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    merged = write_adapter(tmp_path / "adapter", hf, ALL, rank=8, alpha=16, seed=11)
    engine = LLMEngine.from_model(checkpoint, device="cpu", max_model_len=MAX_MODEL_LEN, kv_cache_blocks=64,
                                  max_loras=1, max_lora_rank=8)
    engine.add_lora("tuned", str(tmp_path / "adapter"))
    prompt = [0, 17, 203, 5, 99, 42, 300, 7]
    want = {}
    for name, model in (("tuned", merged), (MODEL, hf)):
        with torch.no_grad():
            want[name] = model.generate(torch.tensor([prompt]), max_new_tokens=8, min_new_tokens=8, do_sample=False,
                                        pad_token_id=1)[0, len(prompt):].tolist()
    assert want["tuned"] != want[MODEL]
    with ServerThread(create_app(engine, MODEL)) as s:
        client = s.client()
        models = client.models.list().data
        assert [m.id for m in models] == [MODEL, "tuned"] and models[1].model_extra["parent"] == MODEL
        for name in ("tuned", MODEL):
            r = client.completions.create(model=name, prompt=prompt, max_tokens=8, temperature=0,
                                          **_extra(min_tokens=8, return_token_ids=True))
            assert r.choices[0].model_extra["token_ids"] == want[name] and r.model == name, name
        chat = client.chat.completions.create(model="tuned", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert chat.choices[0].message.content is not None
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="untuned", prompt="x", max_tokens=1)
        s.wait_idle()
    for bad in (["tuned"], ["=path"], ["tuned="]):
        with pytest.raises(ValueError, match="NAME=PATH"):
            _lora_modules(bad)


def test_lora_adapters_loaded_and_unloaded_at_run_time(checkpoint, tmp_path):
    """lora_updates (--enable-lora-updates): POST /v1/load_lora_adapter adds an adapter that requests
    then name, /v1/unload_lora_adapter takes it away (404 for it afterwards); bad paths and names are
    400s; without the option both endpoints are 404. cache_salt (vLLM's extra) reaches the engine."""
    import torch
    from transformers import AutoModelForCausalLM

    from tests.engine.test_lora import ALL, write_adapter
    from tileattn.engine import LLMEngine

    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    write_adapter(tmp_path / "adapter", hf, ALL, rank=8, alpha=16, seed=12)
    engine = LLMEngine.from_model(checkpoint, device="cpu", max_model_len=MAX_MODEL_LEN, kv_cache_blocks=64,
                                  max_loras=1, max_lora_rank=8)

    def post(s, path, body):
        status, text = s.http("POST", path, json.dumps(body).encode())
        return status, text.decode()

    with ServerThread(create_app(engine, MODEL, lora_updates=True)) as s:
        client = s.client()
        assert post(s, "/v1/load_lora_adapter", {"lora_name": "live", "lora_path": str(tmp_path / "adapter")}) == (
            200, "Success: LoRA adapter 'live' added successfully.")
        assert [m.id for m in client.models.list().data] == [MODEL, "live"]
        answer = client.completions.create(model="live", prompt=[0, 17, 203], max_tokens=4, temperature=0)
        assert answer.model == "live"  # the name the request gave
        for body, param in (({"lora_name": "other", "lora_path": str(tmp_path / "missing")}, "lora_path"),
                            ({"lora_name": "live", "lora_path": str(tmp_path / "adapter")}, "lora_path"),
                            ({"lora_name": "other"}, "lora_path"), ({"lora_name": MODEL, "lora_path": "x"}, "lora_name")):
            status, text = post(s, "/v1/load_lora_adapter", body)
            assert status == 400 and json.loads(text)["error"]["param"] == param, (body, text)
        salted = client.completions.create(model=MODEL, prompt=[0, 17, 203] * 12, max_tokens=1, **_extra(cache_salt="t1"))
        again = client.completions.create(model=MODEL, prompt=[0, 17, 203] * 12, max_tokens=1, **_extra(cache_salt="t1"))
        other = client.completions.create(model=MODEL, prompt=[0, 17, 203] * 12, max_tokens=1, **_extra(cache_salt="t2"))
        cached = [r.usage.prompt_tokens_details.cached_tokens for r in (salted, again, other)]
        assert cached[1] > 0 and cached[2] == 0, cached
        s.state.lora_pins["live"] = 1  # as a beam search between two of its engine requests holds it
        status, text = post(s, "/v1/unload_lora_adapter", {"lora_name": "live"})
        assert status == 400 and "in use by a running beam search" in text
        s.state.lora_pins["live"] = 0
        assert post(s, "/v1/unload_lora_adapter", {"lora_name": "live"}) == (
            200, "Success: LoRA adapter 'live' removed successfully.")
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="live", prompt="x", max_tokens=1)
        status, text = post(s, "/v1/unload_lora_adapter", {"lora_name": "live"})
        assert status == 400 and "unknown LoRA adapter" in text
        s.wait_idle()
    with ServerThread(create_app(engine, MODEL)) as s:
        assert s.http("POST", "/v1/load_lora_adapter", b"{}")[0] == 404


def test_priority_field_reaches_the_engine(server, client):
    """vLLM's priority extra: under first-come-first-served scheduling a non-zero one is a 400 naming
    the policy it needs (the engine's priority tests are in test_engine.py); 0 is the default."""
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="x", max_tokens=1, **_extra(priority=2))
    assert "scheduling_policy='priority'" in _error(info.value)["message"]
    assert client.completions.create(model=MODEL, prompt="x", max_tokens=1, **_extra(priority=0)).choices
    server.wait_idle()


def test_completions_with_beam_search(server, client, checkpoint):
    """use_beam_search (vLLM's extra) on /v1/completions: n beams per prompt, the n best answers as
    its choices, equal to transformers' beam search with EOS an ordinary token (ignore_eos);
    answer-changing fields with it and n beyond 10 are 400s."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    prompts = [[0, 5, 9, 17, 33, 40, 3, 7], [0, 300, 301, 302] * 3]
    r = client.completions.create(model=MODEL, prompt=prompts, max_tokens=5, n=3,
                                  **_extra(use_beam_search=True, ignore_eos=True, return_token_ids=True))
    assert [c.index for c in r.choices] == list(range(6)) and r.usage.completion_tokens == 30
    for p, prompt in enumerate(prompts):
        with torch.no_grad():
            want = hf.generate(torch.tensor([prompt]), num_beams=3, num_return_sequences=3, max_new_tokens=5,
                               do_sample=False, pad_token_id=1)[:, len(prompt):].tolist()
        got = [c.model_extra["token_ids"] for c in r.choices[3 * p:3 * p + 3]]
        assert got == want and all(c.finish_reason == "length" for c in r.choices[3 * p:3 * p + 3])
    for name, value in (("stream", True), ("logprobs", 1), ("echo", True), ("stop", ["x"]), ("temperature", 0.5),
                        ("top_p", 0.5), ("seed", 3), ("presence_penalty", 1.0), ("logit_bias", {"15": -100})):
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=MODEL, prompt="hi", max_tokens=2, **{name: value},
                                      **_extra(use_beam_search=True))
        assert _error(info.value)["param"] == name, name
    for name, value in (("allowed_token_ids", [7]), ("repetition_penalty", 5.0), ("top_k", 3), ("min_p", 0.1),
                        ("bad_words", ["x"]), ("min_tokens", 1)):  # were ignored: the same beams came back
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=MODEL, prompt="hi", max_tokens=2, **_extra(use_beam_search=True,
                                                                                      **{name: value}))
        assert _error(info.value)["param"] == name, name
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, n=11, **_extra(use_beam_search=True))
    assert _error(info.value)["param"] == "n"
    server.wait_idle()
