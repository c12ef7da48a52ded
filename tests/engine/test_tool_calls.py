"""Tool-call parsers (tileattn.engine.tool_calls): whole answers, and the same answers streamed in
every way of cutting them into deltas, which must add up to the whole answer's message."""

from __future__ import annotations

import json
import random

import pytest

from tileattn.engine.tool_calls import PARSERS, call_from_json, get_parser

CALL = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
CALL2 = '{"name": "get_time", "arguments": {}}'


def _streamed(parser, text: str, cuts: list[int], stop_reason=None):
    """The answer fed in pieces cut at ``cuts``: (content joined, calls)."""
    stream, content, calls = parser.stream(), [], []
    bounds = [0, *cuts, len(text)]
    for a, b in zip(bounds, bounds[1:]):
        piece, new = stream.feed(text[a:b])
        content.append(piece)
        calls += new
    piece, new = stream.finish(stop_reason)
    content.append(piece)
    calls += new
    return "".join(content) or None, calls


def _every_cutting(parser, text: str, stop_reason=None):
    """Whole, one character at a time, and 50 random cuttings agree; returns the whole answer's."""
    content, calls = parser.parse(text, stop_reason)
    rng = random.Random(0)
    cuttings = [list(range(1, len(text)))] + [
        sorted(rng.sample(range(1, len(text)), rng.randint(1, min(12, len(text) - 1)))) for _ in range(50)
        if len(text) > 1]
    for cuts in cuttings:
        got_content, got_calls = _streamed(parser, text, cuts, stop_reason)
        assert got_content == content, (cuts, got_content, content)
        assert [(c.name, c.arguments) for c in got_calls] == [(c.name, c.arguments) for c in calls], cuts
    return content, calls


@pytest.mark.parametrize("text, content, names", [
    (f"<tool_call>\n{CALL}\n</tool_call>", None, ["get_weather"]),
    (f"Let me look.\n\n<tool_call>\n{CALL}\n</tool_call>\n<tool_call>{CALL2}</tool_call>\n", "Let me look.",
     ["get_weather", "get_time"]),
    (f"A <tool_call>{CALL}</tool_call> B", "A  B", ["get_weather"]),
    ("  no calls at all, 1 < 2 and <tool_ here.  ", "no calls at all, 1 < 2 and <tool_ here.", []),
    ("<tool_call>not json</tool_call> tail", "<tool_call>not json</tool_call> tail", []),      # kept as written
    ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),  # no name
    ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
     []),
    (f"<tool_call>{CALL}", f"<tool_call>{CALL}", []),   # cut off (max_tokens): not a call
    ('<tool_call>{"name": "f", "arguments": {"x": 1e999}}</tool_call>',          # inf: not JSON
     '<tool_call>{"name": "f", "arguments": {"x": 1e999}}</tool_call>', []),
    ("", None, []),
    ("\n \n", None, []),
])
def test_hermes(text, content, names):
    got_content, calls = _every_cutting(PARSERS["hermes"], text)
    assert got_content == content
    assert [c.name for c in calls] == names
    if names and names[0] == "get_weather":
        assert json.loads(calls[0].arguments) == {"city": "Paris", "unit": "celsius"}
    assert len({c.id for c in calls}) == len(calls) and all(c.id.startswith("call_") for c in calls)


def test_hermes_open_block_ended_by_its_stop_string():
    """parallel_tool_calls: false stops the answer at the first </tool_call>, which the text then
    lacks: the block is a call only when that stop string is what ended the answer."""
    hermes = PARSERS["hermes"]
    text = f"Sure.\n<tool_call>\n{CALL}\n"
    content, calls = _every_cutting(hermes, text, stop_reason="</tool_call>")
    assert content == "Sure." and [c.name for c in calls] == ["get_weather"]
    content, calls = _every_cutting(hermes, text, stop_reason="STOP")
    assert content == text.strip() and calls == []


@pytest.mark.parametrize("parser, text, content, names", [
    ("llama3_json", f" {CALL.replace('arguments', 'parameters')}", None, ["get_weather"]),
    ("llama3_json", f"<|python_tag|>{CALL}", None, ["get_weather"]),
    ("llama3_json", '{"name": "f", "parameters": "{\\"x\\": 2}"}', None, ["f"]),   # arguments as a JSON string
    ("llama3_json", "The weather is fine.", "The weather is fine.", []),
    ("llama3_json", "<|python_tag|> then prose", "<|python_tag|> then prose", []),
    ("llama3_json", f"{CALL}; {CALL2}", f"{CALL}; {CALL2}", []),   # two objects: not this format, kept as text
    ("llama3_json", '{"x": 1}', '{"x": 1}', []),
    ("llama3_json", "{", "{", []),
    ("llama3_json", "", None, []),
    # NaN / Infinity, which Python's json reads, are not JSON: such arguments are no call
    ("llama3_json", '{"name": "f", "parameters": {"x": NaN}}', '{"name": "f", "parameters": {"x": NaN}}', []),
    ("mistral", '[{"name": "f", "arguments": {"x": -Infinity}}]', '[{"name": "f", "arguments": {"x": -Infinity}}]', []),
    ("mistral", f"[TOOL_CALLS] [{CALL}, {CALL2}]", None, ["get_weather", "get_time"]),
    ("mistral", f" [{CALL}]", None, ["get_weather"]),               # the tag skipped as a special token
    ("mistral", "The weather is fine.", "The weather is fine.", []),
    ("mistral", "[1] is a citation.", "[1] is a citation.", []),    # a list, not of calls: kept as text
    ("mistral", f"[TOOL_CALLS] [{CALL}", f"[TOOL_CALLS] [{CALL}", []),  # cut off
    ("mistral", "[]", "[]", []),
    ("mistral", "", None, []),
])
def test_whole_answer_formats(parser, text, content, names):
    got_content, calls = _every_cutting(PARSERS[parser], text)
    assert got_content == content
    assert [c.name for c in calls] == names


@pytest.mark.parametrize("text, content, calls", [
    ('[get_weather(city="Paris", unit="celsius"), get_time()]', None,
     [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {})]),
    ('<|python_start|>[f(x=[1, 2.5, None], y={"k": True})]<|python_end|>', None, [("f", {"x": [1, 2.5, None], "y": {"k": True}})]),
    ("[1, 2, 3]", "[1, 2, 3]", []),                                   # a list, not of calls
    ("[f(1)]", "[f(1)]", []),                                         # positional arguments
    ("[f(x=open('/etc/passwd'))]", "[f(x=open('/etc/passwd'))]", []),  # not a literal: never evaluated
    ("[os.system(x='ls')]", "[os.system(x='ls')]", []),               # not a plain name
    ("[f(x=1)", "[f(x=1)", []),                                       # cut off
    # literals with no JSON spelling: content, not a 500 (TypeError from literal_eval or json.dumps)
    ("[f(x={[1]: 2})]", "[f(x={[1]: 2})]", []),                       # unhashable key
    ("[f(x=1j)]", "[f(x=1j)]", []),
    ("[f(x=b'ab')]", "[f(x=b'ab')]", []),
    ("[f(x={1, 2})]", "[f(x={1, 2})]", []),
    ("[f(x=...)]", "[f(x=...)]", []),
    ("[f(x={(1, 2): 3})]", "[f(x={(1, 2): 3})]", []),                 # a tuple key
    ("[f(x=1e999)]", "[f(x=1e999)]", []),                             # inf: not JSON
    ("Sunny today.", "Sunny today.", []),
])
def test_pythonic(text, content, calls):
    got_content, got = _every_cutting(PARSERS["pythonic"], text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls


def test_forced_calls_are_what_the_parsers_read(tmp_path):
    """Each parser's forced_calls spec (tool_choice required / named) admits the answers that
    parser reads as calls: llguidance's matcher accepts their tokens (the tests' tokenizer)."""
    pytest.importorskip("llguidance")
    from tileattn.engine.structured import GrammarCompiler
    from tileattn.engine.tokenizer import Tokenizer

    from .checkpoints import save_tokenizer

    save_tokenizer(tmp_path)
    tokenizer = Tokenizer.from_hf_dir(str(tmp_path))
    grammars = GrammarCompiler(tokenizer, tokenizer.vocab_size, [tokenizer.eos_token_id])
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    answers = {"hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
               "llama3_json": '{"name": "get_weather", "parameters": {"city": "Paris"}}',
               "mistral": '[{"name": "get_weather", "arguments": {"city": "Paris"}}]'}
    for name, answer in answers.items():
        parser = PARSERS[name]
        (matcher,) = grammars.matchers(parser.forced_calls([tool], several=False), 1)
        assert matcher.consume_tokens(tokenizer.encode(answer, add_special_tokens=False)), (name, matcher.get_error())
        assert matcher.is_accepting(), name
        assert [c.name for c in parser.parse(answer)[1]] == ["get_weather"], name


DEEP = "[" * 3000 + "]" * 3000  # nested past the interpreter's recursion limit (a model stuck writing "[")


@pytest.mark.parametrize("parser, text", [
    ("hermes", f"<tool_call>{DEEP}</tool_call>"),
    ("hermes", '<tool_call>{"name": "f", "arguments": "' + DEEP + '"}</tool_call>'),  # arguments as a JSON string
    ("llama3_json", '{"name": "f", "parameters": ' + DEEP[:3000]),
    ("mistral", DEEP),
    ("pythonic", "[f(x=" + "-" * 5000 + "1)]"),
])
def test_deeply_nested_answers_are_content(parser, text):
    """JSON (or Python) nested deeper than the recursion limit is not a call: content as written, not
    a RecursionError (a 500)."""
    assert PARSERS[parser].parse(text) == (text, [])


def test_call_from_json_and_parser_names():
    call = call_from_json('{"name": "f", "arguments": {"s": "caf\\u00e9"}}')
    assert call.name == "f" and call.arguments == '{"s": "café"}'
    assert call.to_openai() == {"id": call.id, "type": "function", "function": {"name": "f", "arguments": call.arguments}}
    assert call.to_openai(3)["index"] == 3
    for bad in ('{"name": ""}', '{"name": 3}', "[]", '{"name": "f", "arguments": "[1]"}', '{"name": "f", '):
        assert call_from_json(bad) is None, bad
    assert get_parser("hermes") is PARSERS["hermes"]
    with pytest.raises(ValueError, match="hermes"):
        get_parser("xml")
    assert PARSERS["pythonic"].forced_calls([], several=True) is None


def test_a_parser_without_a_grammar_refuses_forced_calls():
    """tool_choice "required" / a named function needs the parser's grammar; pythonic has none: 400."""
    pytest.importorskip("fastapi")
    from types import SimpleNamespace

    from tileattn.engine.server import APIError, ChatRequest, _chat_tools

    state = SimpleNamespace(tool_parser=PARSERS["pythonic"], tokenizer=SimpleNamespace(chat_template="{{ tools }}"))
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    for choice in ("required", {"type": "function", "function": {"name": "f"}}):
        req = ChatRequest(messages=[{"role": "user", "content": "hi"}], tools=[tool], tool_choice=choice)
        with pytest.raises(APIError) as info:
            _chat_tools(state, req)
        assert info.value.param == "tool_choice" and "pythonic" in info.value.message
    req = ChatRequest(messages=[{"role": "user", "content": "hi"}], tools=[tool])
    assert _chat_tools(state, req)[1:] == (PARSERS["pythonic"], None)


def test_sent_back_arguments_nested_too_deep_are_a_400():
    """An assistant message's tool call whose arguments string nests past the recursion limit is
    "not JSON" (a 400), not a RecursionError (a 500)."""
    pytest.importorskip("fastapi")
    from tileattn.engine.server import APIError, _template_tool_call

    with pytest.raises(APIError) as info:
        _template_tool_call(0, 0, {"id": "c", "type": "function", "function": {"name": "f", "arguments": DEEP}})
    assert info.value.status == 400 and "not JSON" in info.value.message
