"""Reasoning parsers (tileattn.engine.reasoning): whole answers, and the same answers streamed in
every way of cutting them, which must add up to the whole answer's (reasoning, content)."""

from __future__ import annotations

import random

import pytest

from tileattn.engine.reasoning import PARSERS, get_parser


def _every_cutting(parser, text: str):
    whole = parser.split(text)
    rng = random.Random(0)
    cuttings = [list(range(1, len(text)))] + [
        sorted(rng.sample(range(1, len(text)), rng.randint(1, min(12, len(text) - 1)))) for _ in range(50)
        if len(text) > 1]
    for cuts in cuttings:
        stream, reasoning, content = parser.stream(), [], []
        bounds = [0, *cuts, len(text)]
        for a, b in zip(bounds, bounds[1:]):
            r, c = stream.feed(text[a:b])
            reasoning.append(r)
            content.append(c)
        r, c = stream.finish()
        got = ("".join(reasoning + [r]) or None, "".join(content + [c]))
        assert got == whole, (cuts, got, whole)
    return whole


@pytest.mark.parametrize("name, text, reasoning, content", [
    ("qwen3", "<think>\nThe capital of France.\n</think>\n\nParis.", "The capital of France.", "Paris."),
    ("qwen3", "Paris.", None, "Paris."),                                  # enable_thinking false
    ("qwen3", "  <think></think>\n\nParis, <think> in the answer stays.", None, "Paris, <think> in the answer stays."),
    ("qwen3", "<think>\nstill thinking when max_tokens", "still thinking when max_tokens", ""),
    ("qwen3", "<thin", None, "<thin"),
    ("qwen3", "", None, ""),
    ("deepseek_r1", "Let me see.\n</think>\n\n42", "Let me see.", "42"),
    ("deepseek_r1", "<think>\nOK.</think>42", "OK.", "42"),
    ("deepseek_r1", "no end tag yet", "no end tag yet", ""),
    ("deepseek_r1", "</think>only content", None, "only content"),
])
def test_reasoning_split(name, text, reasoning, content):
    assert _every_cutting(PARSERS[name], text) == (reasoning, content)


def test_get_parser():
    assert get_parser("qwen3") is PARSERS["qwen3"]
    with pytest.raises(ValueError, match="deepseek_r1"):
        get_parser("o1")


CONTENT_START_ANSWERS = ["", "  ", "hello", "<thi", " \n<think", "<think>a</think>b", "  <think>\nx</think>\n\nhello",
                         "<think>never closed", "</think>content", "<tool_call>x</tool_call>",
                         "<think>a </think> b </think> c", "\n<thinking>no</thinking>", "<think></think>"]


@pytest.mark.parametrize("name", ["qwen3", "deepseek_r1"])
@pytest.mark.parametrize("text", CONTENT_START_ANSWERS)
def test_content_start_is_where_the_parser_puts_the_content(name, text):
    """content_start (where SamplingParams.content_stop strings are searched) agrees with the
    parser's split of the whole answer, and fed the answer a character at a time (each call with
    `since`, the length its previous call answered None for) finds the same place as soon as it
    can be told."""
    from tileattn.engine.reasoning import START, content_start

    where = content_start(text, name)
    _, content = PARSERS[name].split(text)
    if where is None:
        # thinking to the end, or (qwen3) not yet told whether the answer opens the block
        assert content == "" or (name == "qwen3" and START.startswith(text.lstrip())), (where, content)
    else:
        assert content == text[where:].strip(), (where, content)
    since, seen = 0, None
    for end in range(len(text) + 1):
        seen = content_start(text[:end], name, since)
        if seen is not None:
            break
        since = end
    assert seen == where
    assert content_start(text, None) == 0
    with pytest.raises(ValueError, match="reasoning must be one of"):
        content_start(text, "openai_gptoss")


def test_content_stop_params_are_checked():
    from tileattn.engine import SamplingParams

    assert SamplingParams(content_stop="</tool_call>", reasoning="qwen3").content_stop == ["</tool_call>"]
    for fields, says in (({"content_stop": [""]}, "content_stop"), ({"content_stop": 3}, "content_stop"),
                         ({"reasoning": "qwen3"}, "with content_stop"),
                         ({"content_stop": "x", "reasoning": "openai_gptoss"}, "reasoning must be one of"),
                         ({"content_stop": "x", "reasoning": "llama"}, "reasoning must be one of"),
                         ({"content_stop": "x", "reasoning": ["qwen3"]}, "reasoning must be one of")):
        with pytest.raises(ValueError, match=says):
            SamplingParams(**fields)
