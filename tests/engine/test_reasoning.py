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
