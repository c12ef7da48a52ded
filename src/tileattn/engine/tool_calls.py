"""Tool calls: an answer's text -> OpenAI `tool_calls`, in the formats open models are trained on.

Parsers (`tileattn serve --tool-call-parser NAME`, vLLM's names):
- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks anywhere in the
  answer (Qwen2.5, Qwen3, Hermes 2 Pro / 3 and the templates written after them); the text outside
  the blocks is the message's content.
- ``llama3_json``: the whole answer is one JSON object ``{"name": ..., "parameters": {...}}``
  (Llama 3.1 / 3.2's JSON tool calling; ``"arguments"`` is accepted too), optionally after the
  ``<|python_tag|>`` token's text when special tokens are not skipped.
- ``mistral``: the whole answer is a JSON list of ``{"name": ..., "arguments": {...}}`` objects,
  after ``[TOOL_CALLS]`` (Mistral 7B Instruct v0.3; a special token, so usually skipped).
- ``pythonic``: the whole answer is a Python list of calls with literal keyword arguments,
  ``[get_weather(city="Paris")]`` (Llama 3.2's pythonic format; read by ast, never run).
- ``openai``: gpt-oss's harmony calls, read with the answer's channels by the ``openai_gptoss``
  reasoning parser (tileattn.engine.harmony), which it needs.

A block that does not parse as a call (bad JSON, no name, arguments not an object) stays in the
content as the model wrote it: nothing is dropped. The content is the text outside the calls with
leading and trailing whitespace removed, None when nothing is left; a stream sends the same text
(whitespace is held back until more content follows, and dropped at the end), so the deltas of a
stream add up to the message a non-streamed request gets.
"""

from __future__ import annotations

import ast
import json
import uuid
from dataclasses import dataclass, field

from .structured import JSON_LAYOUT

# What reading a model's text as JSON (or as Python literals) raises when the text is not a call:
# malformed text, and nesting deeper than the interpreter's recursion limit (a model stuck writing
# "[[[[..." reaches it), which would otherwise escape as a 500
NOT_A_CALL = (ValueError, RecursionError)


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text of an object
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_openai(self, index: int | None = None) -> dict:
        """The message's tool_calls entry; with index, a stream delta's (which carries its position)."""
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


def call_from_json(text: str) -> ToolCall | None:
    """A call from the JSON text of {"name": str, "arguments" | "parameters": object (or the JSON
    text of one)}; None when the text is not one."""
    try:
        return call_from_value(json.loads(text))
    except NOT_A_CALL:
        return None


def call_from_value(obj) -> ToolCall | None:
    """call_from_json of a parsed JSON value."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except NOT_A_CALL:
            return None
    if not isinstance(args, dict):
        return None
    try:  # Python's json reads NaN and Infinity, which are not JSON: arguments holding them are no call
        return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False, allow_nan=False))
    except NOT_A_CALL:
        return None


class Content:
    """The content of a stream: emits what the non-streamed message's content would hold (the
    text outside the calls, stripped), holding whitespace back until non-whitespace follows."""

    def __init__(self):
        self.held = ""
        self.started = False

    def push(self, text: str) -> str:
        self.held += text
        body = self.held.rstrip()
        if not body:
            return ""
        self.held = self.held[len(body):]
        if not self.started:
            body, self.started = body.lstrip(), True
        return body


class _Parser:
    name: str
    one_call_stop: str | None  # a stop string that ends the answer after its first call, if any
    grammar_from_start = False  # a forced call's grammar holds the reasoning too (else it starts after it)

    def stream(self):
        raise NotImplementedError

    def forced_calls(self, tools: list[dict], several: bool) -> dict | None:
        """The structured_outputs spec (engine/structured.py) of an answer that is nothing but calls
        of ``tools`` in this format (tool_choice "required" or a named function): one call, or with
        ``several`` one or more; None when the format has no grammar here."""
        raise NotImplementedError

    def parse(self, text: str, stop_reason=None) -> tuple[str | None, list[ToolCall]]:
        """A whole answer -> (content or None, calls); stop_reason: the engine's (the stop string
        that ended the answer, if one did)."""
        stream = self.stream()
        content, calls = stream.feed(text)
        tail, more = stream.finish(stop_reason)
        return (content + tail) or None, calls + more


class HermesParser(_Parser):
    """<tool_call> JSON </tool_call> blocks (see the module docstring)."""

    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"
    one_call_stop = END

    def forced_calls(self, tools: list[dict], several: bool) -> dict:
        block = f'block: "{START_LARK}" call "{END_LARK}"\ncall: %json {json.dumps(call_schema(tools, "arguments"))}'
        return {"grammar": ("start: block (\"\\n\" block)*\n" if several else "start: block\n") + block}

    def stream(self) -> _HermesStream:
        return _HermesStream()


class _HermesStream:
    def __init__(self):
        self.pending = ""      # text not yet emitted (a possible start tag's prefix, or a call's body)
        self.in_call = False
        self.content = Content()

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """One delta of the answer -> (content to send, calls completed by it)."""
        self.pending += text
        out, calls = [], []
        start, end = HermesParser.START, HermesParser.END
        while True:
            if not self.in_call:
                i = self.pending.find(start)
                if i < 0:
                    keep = partial_suffix(self.pending, start)
                    out.append(self.content.push(self.pending[:len(self.pending) - keep]))
                    self.pending = self.pending[len(self.pending) - keep:]
                    break
                out.append(self.content.push(self.pending[:i]))
                self.pending, self.in_call = self.pending[i + len(start):], True
            else:
                j = self.pending.find(end)
                if j < 0:
                    break
                body, self.pending, self.in_call = self.pending[:j], self.pending[j + len(end):], False
                call = call_from_json(body.strip())
                if call is None:
                    out.append(self.content.push(start + body + end))
                else:
                    calls.append(call)
        return "".join(out), calls

    def finish(self, stop_reason=None) -> tuple[str, list[ToolCall]]:
        """The end of the answer: an open block whose end tag was the stop string that ended the
        answer (parallel_tool_calls: false) is a call; any other open block is content."""
        if not self.in_call:
            text, self.pending = self.pending, ""
            return self.content.push(text), []
        body, self.pending, self.in_call = self.pending, "", False
        call = call_from_json(body.strip()) if stop_reason == HermesParser.END else None
        if call is not None:
            return "", [call]
        return self.content.push(HermesParser.START + body), []


class _WholeAnswerParser(_Parser):
    """Formats where the whole answer is the calls after an optional tag (see the module
    docstring): ``tag``, the calls' first characters ``opens``, and ``read(body)`` -> the calls
    written in the body (the answer without the tag), or None when it is not this format's."""

    tag: str
    opens: str

    def read(self, body: str) -> list[ToolCall] | None:
        raise NotImplementedError

    def stream(self) -> _WholeAnswerStream:
        return _WholeAnswerStream(self)


class Llama3JsonParser(_WholeAnswerParser):
    """One JSON object as the whole answer."""

    name, tag, opens = "llama3_json", "<|python_tag|>", "{"
    one_call_stop = None  # the format holds one call per answer

    def forced_calls(self, tools: list[dict], several: bool) -> dict:
        return {"json": call_schema(tools, "parameters")}

    def read(self, body):
        call = call_from_json(body)
        return None if call is None else [call]


class MistralParser(_WholeAnswerParser):
    """A JSON list of calls as the whole answer, after [TOOL_CALLS] (Mistral 7B Instruct v0.3's
    format; the tag is a special token, so with skip_special_tokens the list stands alone)."""

    name, tag, opens = "mistral", "[TOOL_CALLS]", "["
    one_call_stop = None  # a forced answer holds one list; parallel_tool_calls false caps it at one call

    def forced_calls(self, tools: list[dict], several: bool) -> dict:
        schema = call_schema(tools, "arguments")
        return {"json": {"type": "array", "items": {k: v for k, v in schema.items() if k != "x-guidance"},
                         "minItems": 1, **({} if several else {"maxItems": 1}), "x-guidance": schema["x-guidance"]}}

    def read(self, body):
        try:
            value = json.loads(body)
        except NOT_A_CALL:
            return None
        if not isinstance(value, list) or not value:
            return None
        calls = [call_from_value(item) for item in value]
        return None if None in calls else calls


class PythonicParser(_WholeAnswerParser):
    """A Python list of calls with keyword arguments as the whole answer,
    ``[get_weather(city="Paris"), get_time()]`` (Llama 3.2's pythonic tool calling; Llama 4 wraps
    it in <|python_start|> ... <|python_end|>, special tokens). Arguments must be literals
    (strings, numbers, booleans, None, lists, dicts): ast.literal_eval reads them, nothing runs."""

    name, tag, opens = "pythonic", "<|python_start|>", "["
    one_call_stop = None

    def forced_calls(self, tools: list[dict], several: bool) -> dict | None:
        return None  # no grammar of Python calls here: tool_choice required / named gets a 400

    def read(self, body):
        body = body.removesuffix("<|python_end|>").strip()
        try:
            tree = ast.parse(body, mode="eval").body
        except (SyntaxError, *NOT_A_CALL, MemoryError):  # MemoryError: the parser's stack, on some versions
            return None
        if not isinstance(tree, ast.List) or not tree.elts:
            return None
        calls = []
        for node in tree.elts:
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
                return None
            try:
                arguments = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg is not None}
                # a literal with no JSON spelling (complex, bytes, a set, Ellipsis, a tuple key) is no call either
                text = json.dumps(arguments, ensure_ascii=False, allow_nan=False)  # 1e999 is inf
            except (*NOT_A_CALL, TypeError):  # not a literal, an unhashable key ({[1]: 2}), not JSON
                return None
            if len(arguments) != len(node.keywords):
                return None  # a **mapping
            calls.append(ToolCall(node.func.id, text))
        return calls


class _WholeAnswerStream:
    def __init__(self, parser: _WholeAnswerParser):
        self.parser = parser
        self.pending = ""
        self.mode = None       # None: undecided; "calls": buffering a JSON answer; "text": content
        self.content = Content()

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self.pending += text
        if self.mode is None:
            head, tag = self.pending.lstrip(), self.parser.tag
            if head.startswith(tag):
                head = head[len(tag):].lstrip()
            elif tag.startswith(head):
                return "", []  # whitespace, or the start of the tag: undecided
            if not head:
                return "", []
            self.mode = "calls" if head.startswith(self.parser.opens) else "text"
        if self.mode == "calls":
            return "", []
        text, self.pending = self.pending, ""
        return self.content.push(text), []

    def finish(self, stop_reason=None) -> tuple[str, list[ToolCall]]:
        text, self.pending = self.pending, ""
        if self.mode == "calls":
            calls = self.parser.read(text.strip().removeprefix(self.parser.tag).strip())
            if calls is not None:
                return "", calls
        return self.content.push(text), []


# the hermes block's delimiters as Lark string literals (the newlines Qwen's and Hermes' templates put inside)
START_LARK, END_LARK = "<tool_call>\\n", "\\n</tool_call>"


def _arguments_schema(tool: dict) -> dict:
    """A tool's parameters schema, laid out as call_schema lays out JSON."""
    return {**(tool["function"].get("parameters") or {"type": "object"}), "x-guidance": JSON_LAYOUT}


def call_schema(tools: list[dict], arguments_key: str) -> dict:
    """The JSON schema of one call of any of ``tools``: {"name": one tool's name, arguments_key:
    that tool's parameters}, laid out as structured.py lays out JSON (", ", ": ", no free whitespace)."""
    options = [{"type": "object", "additionalProperties": False, "required": ["name", arguments_key],
                "properties": {"name": {"const": t["function"]["name"]},
                               arguments_key: t["function"].get("parameters") or {"type": "object"}}}
               for t in tools]
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    return {**schema, "x-guidance": JSON_LAYOUT}


class HarmonyCallsParser(_Parser):
    """gpt-oss's calls (``<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>``):
    the harmony reader (engine/harmony.py) reads them together with the answer's channels, so a
    server with this parser reads answers through --reasoning-parser openai_gptoss, not ``stream``.
    A forced call's grammar holds the whole answer (an analysis may come first)."""

    grammar_from_start = True

    name = "openai"
    one_call_stop = None  # <|call|> is a stop token: an answer holds one call

    def forced_calls(self, tools: list[dict], several: bool) -> dict:
        """An optional analysis message, then one call of one of ``tools`` (the markers are special
        tokens: llguidance's <|...|> in Lark); the <|call|> stop token ends it. The grammar covers the
        whole answer, so it starts with the answer (grammar_from_start), not after the reasoning."""
        calls = [f'call_{i}: <|channel|> "commentary to=functions.{t["function"]["name"]} " <|constrain|> "json" '
                 f'<|message|> %json {json.dumps(_arguments_schema(t))}' for i, t in enumerate(tools)]
        return {"grammar": "\n".join([
            "start: analysis? (" + " | ".join(f"call_{i}" for i in range(len(tools))) + ")",
            'analysis: <|channel|> "analysis" <|message|> /(?s:.*)/ <|end|> <|start|> "assistant"', *calls])}

    def stream(self):
        raise ValueError("the openai tool-call parser reads gpt-oss's harmony answers through the openai_gptoss "
                         "reasoning parser")


PARSERS = {p.name: p for p in (HermesParser(), Llama3JsonParser(), MistralParser(), PythonicParser(),
                               HarmonyCallsParser())}


def get_parser(name: str):
    """The parser named ``name``; ValueError naming the choices otherwise."""
    try:
        return PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r}; choose one of {sorted(PARSERS)}") from None


def partial_suffix(text: str, tag: str) -> int:
    """The length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
