"""gpt-oss's harmony answers (tileattn.engine.harmony): the parser on whole answers and on every way
of cutting them into stream deltas, then a server over a tiny gpt-oss checkpoint whose tokenizer
has harmony's special tokens: the parsers are its default, the markers never reach the client, a
call ends at the <|call|> stop token, and a stream's deltas add up to the whole message."""

from __future__ import annotations

import json
import random

import pytest

from tileattn.engine.harmony import HarmonyParser

from .checkpoints import make_checkpoint

ANALYSIS = "<|channel|>analysis<|message|>The user asks for the weather.<|end|>"
CALL = '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}'
FINAL = "<|start|>assistant<|channel|>final<|message|>It is sunny in Paris."


def _every_cutting(text: str, finish_reason: str = "stop", calls: bool = True):
    """The parser's (reasoning, content, [(name, arguments)]) of the whole text, checked equal to
    every streamed cutting's."""
    parser = HarmonyParser()

    def run(pieces):
        stream = parser.stream(calls)
        parts = [stream.feed(piece) for piece in pieces] + [stream.finish(finish_reason)]  # (reasoning, content, calls)
        reasoning, content = "".join(p[0] for p in parts), "".join(p[1] for p in parts)
        named = [(call.name, json.loads(call.arguments)) for p in parts for call in p[2]]
        return reasoning or None, content or None, named

    whole = run([text])
    rng = random.Random(0)
    cuttings = [list(range(1, len(text)))] + [
        sorted(rng.sample(range(1, len(text)), rng.randint(1, min(12, len(text) - 1)))) for _ in range(40)
        if len(text) > 1]
    for cuts in cuttings:
        bounds = [0, *cuts, len(text)]
        assert run([text[a:b] for a, b in zip(bounds, bounds[1:])]) == whole, cuts
    return whole


PARIS_CALL = [("get_weather", {"city": "Paris"})]


@pytest.mark.parametrize("text, finish_reason, expected", [
    (ANALYSIS + FINAL, "stop", ("The user asks for the weather.", "It is sunny in Paris.", [])),
    (ANALYSIS + FINAL + "<|return|>", "stop", ("The user asks for the weather.", "It is sunny in Paris.", [])),
    (ANALYSIS + CALL, "stop", ("The user asks for the weather.", None, PARIS_CALL)),  # <|call|> was the stop token
    (ANALYSIS + CALL + "<|call|>", "stop", ("The user asks for the weather.", None, PARIS_CALL)),
    # the recipient in the role part of the header, the format word without <|constrain|>
    (' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}', "stop", (None, None, PARIS_CALL)),
    # a call cut off by max_tokens is content, as written
    (ANALYSIS + CALL[:-3], "length", ("The user asks for the weather.", '{"city": "Pari', [])),
    # arguments that are not a JSON object stay content
    ("<|channel|>commentary to=functions.f <|constrain|>json<|message|>[1, 2]<|call|>", "stop", (None, "[1, 2]", [])),
    ("<|channel|>commentary to=functions.f <|constrain|>json<|message|>{\"x\": NaN}<|call|>", "stop",
     (None, '{"x": NaN}', [])),  # NaN: not JSON
    # a preamble to the user (commentary without a recipient) is content, then the call
    ("<|channel|>commentary<|message|>Checking.<|end|>" + CALL, "stop", (None, "Checking.", PARIS_CALL)),
    # two analysis messages, reasoning cut off by max_tokens
    ("<|channel|>analysis<|message|>One.<|end|><|start|>assistant<|channel|>analysis<|message|> Two", "length",
     ("One. Two", None, [])),
    ("It is sunny.", "stop", (None, "It is sunny.", [])),  # text outside the format
    ("", "stop", (None, None, [])),
])
def test_harmony_answers_whole_and_streamed(text, finish_reason, expected):
    assert _every_cutting(text, finish_reason) == expected


def test_harmony_deeply_nested_arguments_are_content():
    """Arguments nested past the recursion limit are not a call: content, not a RecursionError (a 500)."""
    deep = "[" * 3000 + "]" * 3000
    text = f"<|channel|>commentary to=functions.f <|constrain|>json<|message|>{deep}<|call|>"
    assert HarmonyParser().split(text) == (None, deep, [])


def test_harmony_calls_without_tools_stay_content():
    assert _every_cutting(ANALYSIS + CALL, calls=False) == ("The user asks for the weather.", '{"city": "Paris"}', [])


def test_parser_pairing_is_checked():
    from tileattn.engine.server import ServerState

    class Engine:  # only what ServerState reads before the parsers
        tokenizer, lora_names, max_model_len, generation_defaults, model_name = None, [], 64, {}, "m"

    for tool, reasoning in (("openai", None), ("openai", "qwen3"), ("hermes", "openai_gptoss")):
        with pytest.raises(ValueError, match="harmony"):
            ServerState(Engine(), "m", 1, tool, reasoning)
    assert ServerState(Engine(), "m", 1, None, "openai_gptoss").harmony


# ---------------------------------------------------------------------------------------------
# The server over a tiny gpt-oss checkpoint with harmony's special tokens

MARKERS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"]
TEMPLATE = ("{% for m in messages %}<|start|>{{ m['role'] }}<|message|>{{ m['content'] or '' }}<|end|>{% endfor %}"
            "{% if tools %}<|start|>developer<|message|>{{ tools | tojson }}<|end|>{% endif %}"
            "{% if add_generation_prompt %}<|start|>assistant{% endif %}")
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def harmony_checkpoint(tmp_path_factory):
    """A tiny gpt-oss checkpoint whose tokenizer has harmony's markers as special tokens and whose
    generation config stops at <|return|> and <|call|>."""
    from transformers import AutoTokenizer

    path = str(tmp_path_factory.mktemp("gpt_oss") / "ckpt")
    make_checkpoint(path, "gpt-oss")
    tok = AutoTokenizer.from_pretrained(path)
    tok.add_special_tokens({"additional_special_tokens": MARKERS})
    tok.chat_template = TEMPLATE
    tok.save_pretrained(path)
    with open(f"{path}/generation_config.json", "w") as f:
        json.dump({"eos_token_id": [tok.convert_tokens_to_ids(m) for m in ("<|return|>", "<|call|>")]}, f)
    return path


def scripted(engine):
    """Make the engine's model answer a given text: answer(text, end) sets it; the sampler then
    returns its tokens and the stop token ``end`` (None: the random model's own tokens after it)."""
    import torch

    tok = engine.tokenizer
    engine.async_scheduling = False  # the scripted sampler reads each sequence's output count
    script = {"ids": [], "then_model": False}
    real_sample = engine.runner.sampler.sample

    def sample(logits, seqs):
        ids, model = script["ids"], real_sample(logits, seqs).tolist()
        return torch.tensor([ids[s.num_output_tokens] if s.num_output_tokens < len(ids) else
                             t if script["then_model"] else ids[-1] for s, t in zip(seqs, model)], device=logits.device)

    engine.runner.sampler.sample = sample

    def answer(text: str, end: str | None):
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids, skip_special_tokens=False) == text
        script["ids"] = ids + ([tok.encode(end, add_special_tokens=False)[0]] if end else [])
        script["then_model"] = end is None

    return answer


@pytest.fixture(scope="module")
def harmony_server(harmony_checkpoint):
    pytest.importorskip("fastapi")
    from tileattn.engine.server import create_app

    from .test_server import MODEL, ServerThread, make_engine

    engine = make_engine(harmony_checkpoint, max_model_len=512)  # the tools' JSON takes many tiny tokens
    answer = scripted(engine)
    with ServerThread(create_app(engine, MODEL)) as s:  # no parser named: gpt-oss's are the default
        yield s, answer


def test_server_reads_harmony_answers(harmony_server):
    server, answer = harmony_server
    client = server.client()
    from .test_server import MODEL

    messages = [{"role": "user", "content": "Weather in Paris?"}]
    answer(ANALYSIS + FINAL, "<|return|>")
    r = client.chat.completions.create(model=MODEL, messages=messages)
    (c,) = r.choices
    assert (c.message.content, c.message.reasoning_content, c.finish_reason) == (
        "It is sunny in Paris.", "The user asks for the weather.", "stop")
    assert not c.message.tool_calls

    answer(ANALYSIS + CALL, "<|call|>")
    for stream in (False, True):
        if stream:
            with client.beta.chat.completions.stream(model=MODEL, messages=messages, tools=[WEATHER]) as s:
                for _ in s:
                    pass
                c = s.get_final_completion().choices[0]
        else:
            c = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER]).choices[0]
        # (a stream's first delta carries content "", so its accumulation reads "" where the message has None)
        assert c.finish_reason == "tool_calls" and c.message.content == ("" if stream else None), stream
        assert c.message.reasoning_content == "The user asks for the weather."
        assert [(t.function.name, json.loads(t.function.arguments)) for t in c.message.tool_calls] == PARIS_CALL

    server.wait_idle()


def test_tool_choice_required_holds_a_harmony_answer_to_a_call(harmony_server):
    """tool_choice "required" / a named function: after an analysis (scripted here), the random
    model is held to a call of one of the tools in harmony's header and the tool's schema."""
    pytest.importorskip("llguidance")
    server, answer = harmony_server
    from .test_server import MODEL

    city = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
            "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": city}},
             {"type": "function", "function": {"name": "get_time", "parameters": {
                 "type": "object", "properties": {"zone": {"enum": ["UTC"]}}, "required": ["zone"],
                 "additionalProperties": False}}}]
    answer(ANALYSIS + "<|start|>assistant", end=None)
    for choice, names in (("required", {"get_weather", "get_time"}),
                          ({"type": "function", "function": {"name": "get_time"}}, {"get_time"})):
        r = server.client().chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Weather?"}], tools=tools, tool_choice=choice, n=2,
            temperature=1.0, seed=3, max_tokens=120)
        for c in r.choices:
            assert c.finish_reason == "tool_calls" and c.message.reasoning_content == "The user asks for the weather."
            (call,) = c.message.tool_calls
            assert call.function.name in names, call
            args = json.loads(call.function.arguments)
            assert args in ({"city": "Paris"}, {"city": "Rome"}, {"zone": "UTC"}), args
    server.wait_idle()


def test_structured_answer_after_harmony_analysis(harmony_server):
    """A response_format's grammar starts at the final channel's <|message|>: the analysis is free
    (here scripted), the final answer (the random model, masked) follows the schema."""
    server, answer = harmony_server
    from .test_server import MODEL

    answer(ANALYSIS + "<|start|>assistant<|channel|>final<|message|>", end=None)
    schema = {"type": "object", "additionalProperties": False, "required": ["city"],
              "properties": {"city": {"enum": ["Paris", "Rome"]}}}
    r = server.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "A city?"}], n=2, temperature=1.0, seed=1, max_tokens=200,
        response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}})
    for c in r.choices:
        assert c.message.reasoning_content == "The user asks for the weather." and c.finish_reason == "stop"
        assert json.loads(c.message.content)["city"] in ("Paris", "Rome"), c.message.content
    server.wait_idle()


def test_chat_cli_shows_the_final_channel(harmony_checkpoint):
    """`tileattn chat` on gpt-oss: the final answer on stdout and in the conversation, the analysis
    on the thoughts stream, no markers anywhere."""
    import io

    from tileattn.engine import LLM, SamplingParams
    from tileattn.engine.cli import stream_reply

    llm = LLM(harmony_checkpoint, device="cpu", max_model_len=256)
    scripted(llm.engine)(ANALYSIS + FINAL, "<|return|>")
    out, thoughts = io.StringIO(), io.StringIO()
    reply, _ = stream_reply(llm, [{"role": "user", "content": "Weather?"}], SamplingParams(max_tokens=100), out,
                            thoughts=thoughts)
    assert (reply, out.getvalue(), thoughts.getvalue()) == (
        "It is sunny in Paris.", "It is sunny in Paris.\n", "The user asks for the weather.")
