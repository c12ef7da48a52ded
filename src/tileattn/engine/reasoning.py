"""Reasoning: the thinking part of an answer (``<think> ... </think>``) apart from the rest, for
models that think before they answer (`tileattn serve --reasoning-parser NAME`, vLLM's names).

- ``qwen3``: the answer may open with ``<think>``; what runs to ``</think>`` is the reasoning and the
  rest the content. An answer without the opening tag (Qwen3 with enable_thinking false, whose
  template closes an empty block in the prompt) is all content.
- ``deepseek_r1``: the template opens the block in the prompt, so the answer starts inside it
  (a ``<think>`` it writes anyway is dropped); everything up to ``</think>`` is reasoning.
- ``openai_gptoss``: gpt-oss's harmony channels (tileattn.engine.harmony), which also carry its
  tool calls.
An answer cut off before ``</think>`` is all reasoning. Both parts are stripped of the whitespace at
their ends; a stream sends the same text (whitespace held back until more follows), so its deltas
add up to the non-streamed message.
"""

from __future__ import annotations

import re

from .harmony import HarmonyParser
from .tool_calls import Content, partial_suffix

START, END = "<think>", "</think>"
_LEADING_SPACE = re.compile(r"\s*")


class ReasoningParser:
    grammar_after = END  # a structured answer's grammar starts after the thinking

    def __init__(self, name: str, starts_inside: bool):
        self.name, self.starts_inside = name, starts_inside
        # The block is optional unless the prompt opens it: the answer's first token is then either
        # the opening tag's token or the grammar's (SamplingParams.grammar_after_open).
        self.grammar_after_open = None if starts_inside else START

    def split(self, text: str) -> tuple[str | None, str]:
        """A whole answer -> (reasoning or None, content)."""
        stream = self.stream()
        reasoning, content = stream.feed(text)
        more_reasoning, more_content = stream.finish()
        return (reasoning + more_reasoning) or None, content + more_content

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self.starts_inside)


class ReasoningStream:
    def __init__(self, starts_inside: bool):
        self.pending = ""
        self.state = "open" if starts_inside else "start"  # start -> (open ->) reasoning -> content
        self.reasoning, self.content = Content(), Content()

    def feed(self, text: str) -> tuple[str, str]:
        """One delta of the answer -> (reasoning to send, content to send)."""
        self.pending += text
        reasoning = content = ""
        if self.state in ("start", "open"):  # before the opening tag: does the answer start with it?
            head = self.pending.lstrip()
            if head.startswith(START):
                self.pending, self.state = head[len(START):], "reasoning"
            elif START.startswith(head):
                return "", ""  # whitespace, or a part of the tag: undecided
            else:
                self.state = "reasoning" if self.state == "open" else "content"
        if self.state == "reasoning":
            i = self.pending.find(END)
            if i < 0:
                keep = partial_suffix(self.pending, END)
                reasoning = self.reasoning.push(self.pending[:len(self.pending) - keep])
                self.pending = self.pending[len(self.pending) - keep:]
                return reasoning, ""
            reasoning = self.reasoning.push(self.pending[:i])
            self.pending, self.state = self.pending[i + len(END):], "content"
        if self.state == "content":
            content, self.pending = self.content.push(self.pending), ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """The end of the answer: text held back goes where it stood (a block never closed is reasoning)."""
        text, self.pending = self.pending, ""
        if self.state == "content" or (self.state == "start" and text.strip()):
            return "", self.content.push(text)
        if self.state == "start":
            return "", ""
        return self.reasoning.push(text.removeprefix(START) if self.state == "open" else text), ""


def content_start(text: str, parser: str | None, since: int = 0) -> int | None:
    """Where the content of answer `text` begins as reasoning parser `parser` (a name in PARSERS
    with a thinking block) splits it: 0 without a parser, or for a qwen3 answer that does not open
    with <think> (leading whitespace aside); just after </think> once the block has closed; None
    while the answer may still be thinking. since: the length of the text an earlier call answered
    None for (</think> is then searched only where it could end in the rest)."""
    if parser is None:
        return 0
    if not thinking_parser(parser).starts_inside:
        lead = _LEADING_SPACE.match(text).end()  # as ReasoningStream's lstrip, without copying the text
        head = text[lead:lead + len(START)]
        if head != START:
            return None if START.startswith(head) and lead + len(head) == len(text) else 0
    at = text.find(END, max(since - len(END) + 1, 0))
    return None if at < 0 else at + len(END)


PARSERS = {p.name: p for p in (ReasoningParser("qwen3", starts_inside=False),
                               ReasoningParser("deepseek_r1", starts_inside=True), HarmonyParser())}


def thinking_parser(name: str) -> ReasoningParser:
    """The parser named ``name`` that splits off a <think> block (not harmony's channels);
    ValueError naming the choices otherwise."""
    parser = PARSERS.get(name) if isinstance(name, str) else None
    if not isinstance(parser, ReasoningParser):
        choices = sorted(n for n, p in PARSERS.items() if isinstance(p, ReasoningParser))
        raise ValueError(f"reasoning must be one of {choices}, got {name!r}")
    return parser


def get_parser(name: str) -> ReasoningParser:
    """The parser named ``name``; ValueError naming the choices otherwise."""
    try:
        return PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r}; choose one of {sorted(PARSERS)}") from None
