"""gpt-oss's harmony format: an answer's messages -> reasoning, content and tool calls
(`tileattn serve --reasoning-parser openai_gptoss --tool-call-parser openai`, vLLM's names; both
are the default for a gpt-oss model).

After the prompt's ``<|start|>assistant`` the model writes one or more messages::

    <|channel|>analysis<|message|>The user wants the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>

or, answering::

    <|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>

A message's header runs to ``<|message|>``: the channel is the word after ``<|channel|>``, the
recipient the word after ``to=`` (before or after the channel). Its body runs to ``<|end|>``,
``<|call|>`` or ``<|return|>`` (the last two are stop tokens, usually not in the text) or to the end
of the answer (complete when the answer stopped by itself, cut off when it ran out of tokens).
Bodies go:
- channel ``analysis`` -> reasoning;
- a recipient ``functions.NAME`` -> a tool call of NAME whose arguments are the body (a JSON
  object); a body that is not one, or a call the answer was cut off in, stays in the content as written;
- anything else (``final``, a ``commentary`` preamble to the user, no channel) -> content.
Text before the first header that is not one (a model that ignores the format) is content too.
Content and reasoning are stripped at their ends as the other parsers strip them, and a stream
sends the same text, so a stream's deltas add up to the non-streamed message.

The markers are special tokens, so the server decodes a harmony answer with skip_special_tokens
false. tool_choice "required" or a named function holds the answer to an optional analysis and one
call (tool_calls.HarmonyCallsParser.forced_calls).
"""

from __future__ import annotations

import json
import re

from .tool_calls import NOT_A_CALL, Content, ToolCall, call_from_value, partial_suffix

MESSAGE, CHANNEL, START = "<|message|>", "<|channel|>", "<|start|>"
BODY_ENDS = ("<|end|>", "<|call|>", "<|return|>")
FINAL_HEADER = "<|channel|>final<|message|>"  # where a structured answer's grammar starts
_RECIPIENT = re.compile(r"to=(\S+?)(?=<\||\s|$)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*([^\s<]+)")
_MARKER = re.compile(r"<\|[a-z_]+\|>")


def answers_in_harmony(engine) -> bool:
    """Whether ``engine``'s model writes harmony answers (gpt-oss); False for an engine without a
    model config (a test's stand-in)."""
    return getattr(getattr(engine, "model_config", None), "architecture", None) == "GptOssForCausalLM"


class HarmonyParser:
    """The harmony reader (see the module docstring); ``stream()`` reads one answer."""

    name = "openai_gptoss"
    grammar_after = FINAL_HEADER
    grammar_after_open = None  # the final channel's header always comes: the grammar waits for it

    def split(self, text: str, finish_reason: str = "stop") -> tuple[str | None, str | None, list[ToolCall]]:
        """A whole answer -> (reasoning or None, content or None, calls)."""
        reasoning, content, calls = self.stream().feed(text, finish_reason)
        return reasoning or None, content or None, calls

    def stream(self, calls: bool = True) -> HarmonyStream:
        """calls False (a request without tools): a body addressed to a function stays content."""
        return HarmonyStream(calls)


class HarmonyStream:
    def __init__(self, calls: bool = True):
        self.calls = calls
        self.pending = ""    # text not yet routed: a header being read, or a body's possible end marker
        self.header = None   # the current message's header once read (None: reading a header)
        self.body = ""       # a function call's body, held until its end
        self.reasoning, self.content = Content(), Content()

    def feed(self, text: str, finish_reason: str | None = None) -> tuple[str, str, list[ToolCall]]:
        """One delta of the answer -> (reasoning, content, calls) to send; with the engine's
        finish_reason the answer's last delta (finish's parts included)."""
        if finish_reason is not None:
            r1, c1, k1 = self.feed(text)
            r2, c2, k2 = self.finish(finish_reason)
            return r1 + r2, c1 + c2, k1 + k2
        self.pending += text
        reasoning, content, calls = [], [], []
        while True:
            if self.header is None:
                i = self.pending.find(MESSAGE)
                if i < 0:
                    break
                self.header, self.pending = self.pending[:i], self.pending[i + len(MESSAGE):]
                continue
            end, at = _first_end(self.pending)
            body = self.pending if end is None else self.pending[:at]
            if end is None:  # the body goes on: send what cannot be the start of an end marker
                keep = max(partial_suffix(body, e) for e in BODY_ENDS)
                body, self.pending = body[:len(body) - keep], body[len(body) - keep:]
            else:
                self.pending = self.pending[at + len(end):].removeprefix(START)
            self._route(body, end is not None, reasoning, content, calls)
            if end is None:
                break
            self.header = None
        return "".join(reasoning), "".join(content), calls

    def finish(self, finish_reason: str = "stop") -> tuple[str, str, list[ToolCall]]:
        """The end of the answer (the engine's finish_reason): an open body ends here, complete when
        the answer stopped by itself ("stop": <|call|> and <|return|> are stop tokens, not in the
        text), cut off otherwise (a call in it stays content); a header never closed by <|message|>
        is text written outside the format (content)."""
        reasoning, content, calls = [], [], []
        if self.header is None:
            stray = _MARKER.sub("", self.pending).removeprefix("assistant")
            content.append(self.content.push(stray))
        else:
            self._route(self.pending, finish_reason == "stop", reasoning, content, calls, last=True)
        self.pending, self.header = "", None
        return "".join(reasoning), "".join(content), calls

    def _route(self, body: str, ended: bool, reasoning: list, content: list, calls: list, last: bool = False):
        channel, recipient = _read_header(self.header)
        if self.calls and recipient is not None and recipient.startswith("functions."):
            self.body += body
            if not (ended or last):
                return
            whole, self.body = self.body, ""
            call = None
            if ended:
                try:
                    call = call_from_value({"name": recipient[len("functions."):], "arguments": json.loads(whole)})
                except NOT_A_CALL:
                    pass
            if call is not None:
                calls.append(call)
            else:
                content.append(self.content.push(whole))
        elif channel == "analysis":
            reasoning.append(self.reasoning.push(body))
        else:
            content.append(self.content.push(body))


def _first_end(text: str) -> tuple[str | None, int]:
    """(the first body end marker in text, its index), (None, -1) without one."""
    found = [(at, e) for e in BODY_ENDS if (at := text.find(e)) >= 0]
    if not found:
        return None, -1
    at, end = min(found)
    return end, at


def _read_header(header: str) -> tuple[str | None, str | None]:
    """(channel, recipient) of a message header (either may be missing)."""
    channel = _CHANNEL.search(header)
    recipient = _RECIPIENT.search(header)
    return (channel.group(1) if channel else None), (recipient.group(1) if recipient else None)
