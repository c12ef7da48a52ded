"""Structured outputs on a tiny random-init Llama (CPU): whatever the model would say, the answer
stays inside the JSON schema, regex, choice list or grammar; free rows of the same batch are
untouched; bad specs are refused before anything is queued."""

from __future__ import annotations

import json
import re

import pytest
import torch

pytest.importorskip("llguidance")

from tileattn.engine import LLMEngine, SamplingParams  # noqa: E402
from tileattn.engine import sampler as sampler_module  # noqa: E402
from tileattn.engine import speculative  # noqa: E402

from tileattn.engine.reasoning import get_parser  # noqa: E402

from .checkpoints import add_think_tokens, make_checkpoint  # noqa: E402

PROMPTS = ["hello world", "the quick brown fox", "paged attention keeps"]
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "n", "ok"],
          "properties": {"city": {"type": "string", "maxLength": 6}, "n": {"type": "integer", "minimum": 0,
                                                                          "maximum": 999},
                         "ok": {"type": "boolean"}, "unit": {"enum": ["C", "F"]}}}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    make_checkpoint(path, "llama3")
    return LLMEngine.from_model(str(path), device="cpu", max_model_len=256, kv_cache_blocks=128, block_size=8)


def generate(engine, prompts, params_list) -> list[list]:
    """All requests in one batch; per request its completions (CompletionOutput)."""
    for i, (prompt, params) in enumerate(zip(prompts, params_list)):
        engine.add_request(f"r{i}", prompt, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step(finished_only=True):
            done[out.request_id] = out.outputs
    return [done[f"r{i}"] for i in range(len(prompts))]


def _check_schema(value):
    assert isinstance(value, dict) and set(value) - {"unit"} == {"city", "n", "ok"}, value
    assert isinstance(value["city"], str) and len(value["city"]) <= 6
    assert isinstance(value["n"], int) and not isinstance(value["n"], bool) and 0 <= value["n"] <= 999
    assert isinstance(value["ok"], bool) and value.get("unit", "C") in ("C", "F")


CASES = {
    "json": ({"json": SCHEMA}, lambda text: _check_schema(json.loads(text))),
    "regex": ({"regex": r"[a-z]{2,6}-[0-9]{2}"}, lambda text: re.fullmatch(r"[a-z]{2,6}-[0-9]{2}", text) or 1 / 0),
    "choice": ({"choice": ["paris", "rome", "lazy dog"]}, lambda text: text in ("paris", "rome", "lazy dog") or 1 / 0),
    "lark": ({"grammar": 'start: "yes" | "no" " sir" | "n=" /[0-9]{1,3}/'},
             lambda text: re.fullmatch(r"yes|no sir|n=[0-9]{1,3}", text) or 1 / 0),
    "gbnf": ({"grammar": 'root ::= "alpha" | "beta" [0-9]'}, lambda text: text in ("alpha", *(f"beta{d}" for d in range(10))) or 1 / 0),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_kind_holds_every_answer(engine, case, temperature):
    spec, check = CASES[case]
    params = SamplingParams(temperature=temperature, seed=7, n=2, max_tokens=80, structured_outputs=spec)
    for completions in generate(engine, PROMPTS, [params] * len(PROMPTS)):
        for c in completions:
            assert c.finish_reason == "stop" and c.stop_reason is None, (case, c.text, c.finish_reason)
            check(c.text)
    assert engine.stats()["num_free_blocks"] == engine.stats()["num_total_blocks"]


def test_json_object(engine):
    """Any JSON object: unbounded, so a random model may run out of tokens inside one; every answer
    that ended by itself parses to a dict, and every answer starts as one."""
    params = SamplingParams(temperature=1.0, seed=3, n=4, max_tokens=120, structured_outputs={"json_object": True})
    outs = [c for completions in generate(engine, PROMPTS, [params] * len(PROMPTS)) for c in completions]
    ended = [c for c in outs if c.finish_reason == "stop"]
    assert ended, [c.text for c in outs]
    for c in ended:
        assert isinstance(json.loads(c.text), dict), c.text
    assert all(c.text.startswith("{") for c in outs)


def test_constrained_rows_beside_free_rows(engine):
    """A batch that mixes constrained and free requests (async scheduling on, as by default): the
    free ones get exactly the tokens they get alone, the constrained ones stay in their language."""
    assert engine.async_scheduling
    free = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    alone = [c.token_ids for (c,) in generate(engine, PROMPTS, [free] * 3)]
    choice = SamplingParams(temperature=0, max_tokens=20, structured_outputs={"choice": ["yes", "no"]})
    regex = SamplingParams(temperature=1.0, seed=1, max_tokens=20, structured_outputs={"regex": "[0-9]{4}"})
    mixed = generate(engine, PROMPTS + PROMPTS[:2], [free] * 3 + [choice, regex])
    assert [c.token_ids for (c,) in mixed[:3]] == alone
    assert mixed[3][0].text in ("yes", "no") and re.fullmatch("[0-9]{4}", mixed[4][0].text)


def test_grammar_masks_unpack_bits_and_fall_back_to_eos(monkeypatch):
    """apply_grammar_masks on hand-made bitmasks: bit j of word w is token 32 w + j; a row whose
    grammar allows nothing may take EOS only; rows without a grammar are untouched."""
    class Seq:
        def __init__(self, matcher, opening=None):
            self.matcher, self.grammar_opening = matcher, opening

    allowed = {"a": [5, 40, 95], "b": []}

    def fill(matchers, bitmask):
        bitmask.zero_()
        for k, m in enumerate(matchers):
            for t in allowed[m]:
                bitmask[k, t // 32] |= torch.tensor(1 << (t % 32)).to(torch.int32)

    monkeypatch.setattr(sampler_module, "fill_bitmasks", fill)
    logits = torch.randn(3, 100)
    out = sampler_module.apply_grammar_masks(logits, [Seq("a"), Seq(None), Seq("b")], eos_token_ids=(1, 63))
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == [5, 40, 95]
    assert torch.equal(out[1], logits[1])
    assert torch.isfinite(out[2]).nonzero().flatten().tolist() == [1, 63]
    assert torch.equal(out[0, [5, 40, 95]], logits[0, [5, 40, 95]])
    # An optional thinking block's first token: the grammar's tokens or the opening tag's (70)
    out = sampler_module.apply_grammar_masks(logits, [Seq("a", (70, 3)), Seq("b", (70, 3))], eos_token_ids=(1,))
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == [5, 40, 70, 95]
    assert torch.isfinite(out[1]).nonzero().flatten().tolist() == [1, 70]


@pytest.mark.parametrize("spec, says", [
    ({"json": "{not json"}, "structured_outputs['json'] is not valid"),
    ({"json": {"type": "strin"}}, "structured_outputs['json'] is not valid"),
    ({"regex": "a(b"}, "structured_outputs['regex'] is not valid"),
    ({"grammar": "start: ???"}, "structured_outputs['grammar'] is not valid"),
])
def test_bad_specs_raise_before_queueing(engine, spec, says):
    with pytest.raises(ValueError, match=re.escape(says)):
        engine.add_request("bad", "hello", SamplingParams(structured_outputs=spec))
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize("fields, says", [
    ({"structured_outputs": {"json": SCHEMA, "regex": "a"}}, "exactly one of"),
    ({"structured_outputs": {"xml": "<a/>"}}, "exactly one of"),
    ({"structured_outputs": ["json"]}, "exactly one of"),
    ({"structured_outputs": {"choice": []}}, "non-empty list"),
    ({"structured_outputs": {"json_object": "yes"}}, "true"),
    ({"structured_outputs": {"regex": ""}}, "regular expression"),
    ({"structured_outputs": {"choice": ["a"]}, "ignore_eos": True}, "ignore_eos"),
    ({"structured_outputs": {"choice": ["a"]}, "min_tokens": 2}, "min_tokens"),
    ({"structured_outputs": {"choice": ["a"]}, "allowed_token_ids": [3]}, "allowed_token_ids"),
    ({"structured_outputs": {"choice": ["a"]}, "bad_words": ["a"]}, "bad_words"),
])
def test_sampling_params_refuse_malformed_specs(fields, says):
    with pytest.raises(ValueError, match=says) as info:
        SamplingParams(**fields)
    assert str(info.value).startswith("structured_outputs")


def test_compiled_grammars_are_cached_and_copied(engine):
    """One compilation per distinct spec (kept for the next requests); each sequence gets its own
    copy, whose state moves on its own."""
    grammars = engine.grammars
    spec = {"regex": "(ab)+c"}
    before = grammars.compilations
    first, second = grammars.matchers(spec, 2)
    grammars.prepare({"regex": "(ab)+c"})
    assert grammars.compilations == before + 1
    ids = engine.tokenizer.encode("ab", add_special_tokens=False)
    assert first.consume_tokens(ids) and not first.is_accepting()
    assert second.consume_tokens(engine.tokenizer.encode("abc", add_special_tokens=False)) and second.is_accepting()
    (third,) = grammars.matchers(spec, 1)  # a fresh copy: the cached template was not moved by the others
    assert third.consume_tokens(engine.tokenizer.encode("abc", add_special_tokens=False)) and third.is_accepting()
    assert grammars.compilations == before + 1


def _script_then_model(engine, script: str):
    """The engine's sampler writes ``script`` first (whatever the masks say), then samples as usual."""
    ids = engine.tokenizer.encode(script, add_special_tokens=False)
    real = engine.runner.sampler.sample

    def sample(logits, seqs):
        sampled = real(logits, seqs)
        return torch.tensor([ids[s.num_output_tokens] if s.num_output_tokens < len(ids) else int(t)
                             for s, t in zip(seqs, sampled.tolist())], device=logits.device)

    return sample


def test_grammar_after_lets_the_answer_think_first(engine, monkeypatch):
    """grammar_after="</think>": the text up to the marker is free (here scripted, and no digits),
    the rest is held to the grammar; a prompt that already ends with the marker starts it at once."""
    think = "<think>\nthe lazy dog, no digits at all!\n</think>"
    monkeypatch.setattr(engine.runner.sampler, "sample", _script_then_model(engine, think))
    params = SamplingParams(temperature=1.0, seed=2, n=2, max_tokens=80, structured_outputs={"regex": "[0-9]{3}"},
                            grammar_after="</think>")
    for c in generate(engine, PROMPTS[:2], [params] * 2)[0] + generate(engine, PROMPTS[2:], [params])[0]:
        assert c.text.startswith(think) and re.fullmatch("[0-9]{3}", c.text[len(think):]), c.text
        assert c.finish_reason == "stop"
    monkeypatch.undo()
    (c,), = generate(engine, ["hello <think>\nhmm\n</think>\n\n"],
                     [SamplingParams(temperature=0, max_tokens=20, structured_outputs={"regex": "[0-9]{3}"},
                                     grammar_after="</think>")])
    assert re.fullmatch("[0-9]{3}", c.text), c.text
    with pytest.raises(ValueError, match="grammar_after"):
        SamplingParams(grammar_after="</think>")


# ---- an optional thinking block (qwen3's reasoning parser): the first token decides ----------------

OPTIONAL = {"grammar_after": "</think>", "grammar_after_open": "<think>"}  # what the server sets for qwen3


@pytest.fixture(scope="module")
def thinking_engine(tmp_path_factory):
    """The tiny Llama with "<think>" and "</think>" as added tokens (one token each), as Qwen3's."""
    path = tmp_path_factory.mktemp("llama_think")
    make_checkpoint(path, "llama3")
    add_think_tokens(str(path))
    return LLMEngine.from_model(str(path), device="cpu", max_model_len=256, kv_cache_blocks=128, block_size=8)


def _first_token_biased(engine, monkeypatch, bias: float, then: str = ""):
    """The engine's sampler with ``bias`` added to the "<think>" logit at the first output position
    (the masks still apply after it), then the tokens of ``then`` written whatever the masks say,
    then the model."""
    (tag,) = engine.tokenizer.encode("<think>", add_special_tokens=False)
    scripted = engine.tokenizer.encode(then, add_special_tokens=False)
    real = engine.runner.sampler.sample

    def sample(logits, seqs):
        logits = logits.clone()
        for row, s in enumerate(seqs):
            if s.num_output_tokens == 0:
                logits[row, tag] += bias
        sampled = real(logits, seqs).tolist()
        return torch.tensor([scripted[s.num_output_tokens - 1] if 1 <= s.num_output_tokens <= len(scripted) else t
                             for s, t in zip(seqs, sampled)], device=logits.device)

    monkeypatch.setattr(engine.runner.sampler, "sample", sample)


def test_optional_block_skipped_the_grammar_holds_from_the_first_token(thinking_engine, monkeypatch):
    """grammar_after_open: an answer whose first token is not "<think>" (here the tag is pushed
    away) gets no block, so it never writes "</think>": the grammar holds from its first token (it
    waited for "</think>" before, and the answer ran free to max_tokens)."""
    engine = thinking_engine
    # Until its first token is known the row reads its tokens on the host: never run ahead, never drafted
    engine.add_request("undecided", "hello", SamplingParams(structured_outputs={"json": SCHEMA}, **OPTIONAL))
    (seq,) = engine.requests["undecided"].seqs
    assert seq.grammar_opening is not None and seq.matcher is not None and seq.matcher_after is None
    assert sampler_module.reads_sampled_tokens(seq) and not speculative.eligible(seq)
    engine.abort_request("undecided")
    assert engine.async_scheduling
    _first_token_biased(engine, monkeypatch, float("-inf"))
    for temperature in (0.0, 1.0):
        params = SamplingParams(temperature=temperature, seed=4, n=2, max_tokens=80, structured_outputs={"json": SCHEMA},
                                **OPTIONAL)
        for completions in generate(engine, PROMPTS, [params] * len(PROMPTS)):
            for c in completions:
                assert c.finish_reason == "stop", c.text
                _check_schema(json.loads(c.text))
    assert engine.stats()["num_free_blocks"] == engine.stats()["num_total_blocks"]


def test_optional_block_opened_thinks_freely_then_the_grammar_holds(thinking_engine, monkeypatch):
    """The first token may be "<think>" (the masks let the tag through beside the grammar's tokens):
    the block is open, the thinking free (no digits here), and the grammar holds after "</think>"."""
    engine = thinking_engine
    think = "\nthe lazy dog, no digits at all!\n</think>"
    _first_token_biased(engine, monkeypatch, 100.0, then=think)
    params = SamplingParams(temperature=1.0, seed=2, n=2, max_tokens=80, structured_outputs={"regex": "[0-9]{3}"},
                            **OPTIONAL)
    for completions in generate(engine, PROMPTS[:2], [params] * 2):
        for c in completions:
            assert c.text.startswith("<think>" + think), c.text
            assert re.fullmatch("[0-9]{3}", c.text[len("<think>" + think):]), c.text
            assert c.finish_reason == "stop"


def test_optional_block_prompt_that_closes_or_opens_it(thinking_engine):
    """A prompt that closes the block (Qwen3 with enable_thinking false) starts the grammar at once;
    one that opens it waits for "</think>" (the model never writes it here: the answer runs free)."""
    engine = thinking_engine
    params = SamplingParams(temperature=0, max_tokens=20, structured_outputs={"regex": "[0-9]{3}"}, **OPTIONAL)
    (closed,), (opened,) = generate(engine, ["hello <think>\n\n</think>\n\n", "hello <think>\n"], [params] * 2)
    assert re.fullmatch("[0-9]{3}", closed.text), closed.text
    assert opened.finish_reason == "length" and not re.fullmatch("[0-9]{3}", opened.text), opened.text


def test_block_that_starts_in_the_prompt_is_unchanged(thinking_engine, monkeypatch):
    """deepseek_r1 (the template opens the block) and harmony set no grammar_after_open: the answer
    is inside the block from its first token, and the grammar waits for the end tag as before."""
    assert get_parser("qwen3").grammar_after_open == "<think>"
    assert get_parser("deepseek_r1").grammar_after_open is None and get_parser("openai_gptoss").grammar_after_open is None
    engine = thinking_engine
    think = "the lazy dog, no digits at all!\n</think>"
    monkeypatch.setattr(engine.runner.sampler, "sample", _script_then_model(engine, think))
    params = SamplingParams(temperature=1.0, seed=2, n=2, max_tokens=80, structured_outputs={"regex": "[0-9]{3}"},
                            grammar_after="</think>")
    for c in generate(engine, PROMPTS[:1], [params])[0]:
        assert c.text.startswith(think) and re.fullmatch("[0-9]{3}", c.text[len(think):]), c.text


def test_optional_block_needs_the_tag_as_one_token(engine):
    """A tokenizer that spells "<think>" in several tokens cannot let the first token decide: the
    request is refused (a 400 on the server), nothing queued, rather than run unconstrained. A
    prompt that closes the block, or opens it, needs no decision and is served."""
    params = SamplingParams(max_tokens=4, structured_outputs={"regex": "[0-9]{3}"}, **OPTIONAL)
    with pytest.raises(ValueError, match="'<think>' to be one token"):
        engine.add_request("bad", "hello", params)
    assert not engine.has_unfinished_requests()
    (closed,), _ = generate(engine, ["hello <think>\n\n</think>\n\n", "hello <think>\n"], [params] * 2)
    assert re.fullmatch("[0-9]{1,3}", closed.text), closed.text
    with pytest.raises(ValueError, match="grammar_after_open"):
        SamplingParams(structured_outputs={"regex": "a"}, grammar_after_open="<think>")
