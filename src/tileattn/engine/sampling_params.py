"""SamplingParams: how one request is sampled and when it stops (contract B)."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from .structured import check_spec
from .tokenizer import lone_surrogate

_FLOAT32_TINY, _FLOAT32_MAX = 2.0**-126, (2 - 2.0**-23) * 2.0**127  # float32's smallest normal, largest finite


@dataclass
class SamplingParams:
    """Per-request sampling options.

    temperature 0 means greedy (argmax; top_k/top_p/min_p and seed are then irrelevant).
    top_k -1 (or 0) keeps every token; top_p in (0, 1]; min_p in [0, 1] keeps tokens whose
    probability is at least min_p times the most likely one's. repetition_penalty (> 0, 1 = off)
    divides positive / multiplies negative logits of tokens seen in the prompt or the output;
    presence_penalty / frequency_penalty (in [-2, 2]) subtract from logits of tokens in the output
    (once / per occurrence). logit_bias: {token id: bias in [-100, 100]} added to those logits
    before the penalties (OpenAI's; -100 bans a token, +100 all but forces it). seed: the same seed
    gives the same tokens. stop: strings that end the output (not included in the text, unless
    include_stop_str_in_output); stop_token_ids: token ids that end it. min_tokens (vLLM's): the
    first min_tokens output tokens are never EOS (unless ignore_eos) or a stop_token_id, and no stop
    string ends the output before them. allowed_token_ids: the only tokens that may be sampled
    (None: all). bad_words (vLLM's): words never generated: each is tokenized alone and after a
    space, and the last token of such a sequence is banned whenever the output ends with the rest of
    it (a one-token word: always). logprobs / prompt_logprobs: the top-n log-probabilities (of the
    model's raw distribution, before logit_bias, penalties and temperature) plus the chosen token's,
    per sampled / prompt token. structured_outputs (vLLM's): {kind: value} with one kind of
    structured.SPEC_KINDS ("json": a schema, "json_object": True, "regex", "choice": a list of
    strings, "grammar": Lark or GBNF): the answer is held to it (structured.py); not with
    ignore_eos, min_tokens, allowed_token_ids or bad_words (an answer the grammar ends must be able
    to end, and a ban could leave no token the grammar allows). grammar_after: the grammar starts
    once this text has been generated (e.g. "</think>": a thinking model thinks freely first), or at
    once when the prompt already ends with it (and whitespace); None: from the first token.
    grammar_after_open: the tag that opens the block grammar_after closes, where the answer may
    skip that block (qwen3's "<think>"; None: the answer starts inside it, or before grammar_after
    whatever it writes). The first token then decides: this tag's own token (the tokenizer must
    have the tag as one token, else LLMEngine.add_request refuses the request) opens the block and
    the grammar waits for grammar_after; any other token is one the grammar allows from its start,
    and the grammar holds from there. Only that exact token at the first position opens the block
    (not whitespace first, not the tag in pieces). A prompt that already ends with grammar_after
    starts the grammar at once, and one that ends with this tag waits for grammar_after, as without it.
    content_stop: stop strings, like stop, searched only in the answer's content: the text after
    the thinking block as the reasoning parser named by `reasoning` ("qwen3": an optional <think>
    block first; "deepseek_r1": the answer starts inside the block; tileattn.engine.reasoning)
    splits it, so a model that writes one while it thinks goes on (the server's one-call stop of
    a tool-call parser, for parallel_tool_calls: false); reasoning None: the whole text, as stop.
    Raises ValueError naming the bad field, from the constructor and from validate().
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    structured_outputs: dict | None = None
    grammar_after: str | None = None
    grammar_after_open: str | None = None
    content_stop: str | list[str] | None = None
    reasoning: str | None = None

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        def is_int(value):
            return isinstance(value, int) and not isinstance(value, bool)

        def is_number(value):
            return isinstance(value, (int, float)) and not isinstance(value, bool)

        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            if not is_number(getattr(self, name)) or not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number, got {getattr(self, name)!r}")
        if not is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an int >= 1, got {self.n!r}")
        if self.temperature < 0 or self.temperature != self.temperature:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be an int >= -1 (-1 or 0: off), got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None and not is_int(self.seed):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not _FLOAT32_TINY <= self.repetition_penalty <= _FLOAT32_MAX:  # the sampler divides by it in float32
            raise ValueError(f"repetition_penalty must be > 0 and within float32's normal range "
                             f"[{_FLOAT32_TINY:.3g}, {_FLOAT32_MAX:.3g}], got {self.repetition_penalty}")
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an int in [0, max_tokens = {self.max_tokens}], got {self.min_tokens!r}")
        for name in ("stop", "content_stop"):
            stops = getattr(self, name)
            if isinstance(stops, str):
                stops = [stops]
            if stops is not None:
                if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) and s for s in stops):
                    raise ValueError(f"{name} must be a non-empty string or a list of them, got {stops!r}")
                setattr(self, name, list(stops))
        if self.reasoning is not None:
            from .reasoning import thinking_parser

            thinking_parser(self.reasoning)
            if self.content_stop is None:
                raise ValueError(f"reasoning goes with content_stop (the stops it places), got reasoning="
                                 f"{self.reasoning!r} alone")
        for name, empty_ok in (("stop_token_ids", True), ("allowed_token_ids", False)):
            value = getattr(self, name)
            if value is None:
                continue
            if not isinstance(value, (list, tuple)) or not (value or empty_ok) or not all(
                    is_int(t) and t >= 0 for t in value):
                raise ValueError(f"{name} must be a {'' if empty_ok else 'non-empty '}list of ints >= 0, got {value!r}")
            setattr(self, name, list(value))
        if self.bad_words is not None:
            if not isinstance(self.bad_words, (list, tuple)) or not all(
                    isinstance(w, str) and w.strip() for w in self.bad_words):
                raise ValueError(f"bad_words must be a list of non-blank strings, got {self.bad_words!r}")
            for i, word in enumerate(self.bad_words):  # the engine tokenizes them
                if lone_surrogate(word) is not None:
                    raise ValueError(f"bad_words[{i}] has a lone surrogate, which is not Unicode text")
            self.bad_words = list(self.bad_words)
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or not all(
                    is_int(t) and t >= 0 and is_number(b) and -100.0 <= b <= 100.0 for t, b in self.logit_bias.items()):
                raise ValueError("logit_bias must be a dict of token ids (ints >= 0) to biases in [-100, 100], "
                                 f"got {self.logit_bias!r}")
            self.logit_bias = {t: float(b) for t, b in self.logit_bias.items()}
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or value < 0):
                raise ValueError(f"{name} must be an int >= 0 or None, got {value!r}")
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.structured_outputs is not None:
            check_spec(self.structured_outputs)
            clashes = [name for name, on in (("ignore_eos", self.ignore_eos), ("min_tokens", self.min_tokens),
                                             ("allowed_token_ids", self.allowed_token_ids),
                                             ("bad_words", self.bad_words)) if on]
            if clashes:
                raise ValueError(f"structured_outputs cannot be combined with {', '.join(clashes)}: the grammar "
                                 "decides which tokens may come and when the answer ends")
        if self.grammar_after is not None and (not isinstance(self.grammar_after, str) or not self.grammar_after.strip()
                                               or self.structured_outputs is None):
            raise ValueError(f"grammar_after must be a non-blank string, with structured_outputs, got {self.grammar_after!r}")
        if self.grammar_after_open is not None and (not isinstance(self.grammar_after_open, str)
                                                    or not self.grammar_after_open.strip() or self.grammar_after is None):
            raise ValueError("grammar_after_open must be a non-blank string, with grammar_after, "
                             f"got {self.grammar_after_open!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @classmethod
    def from_generation_config(cls, defaults: dict, **overrides) -> SamplingParams:
        """SamplingParams with a checkpoint's generation_config.json defaults (temperature, top_p,
        top_k, min_p, repetition_penalty; do_sample False -> greedy) under ``overrides``."""
        known = {f.name for f in fields(cls)}
        values = {k: defaults[k] for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
                  if defaults.get(k) is not None}
        if defaults.get("do_sample") is False:
            values["temperature"] = 0.0
        values.update({k: v for k, v in overrides.items() if k in known})
        return cls(**values)


@dataclass
class PoolingParams:
    """An embedding request (LLMEngine.add_request with these instead of SamplingParams, LLM.embed):
    the final hidden state of the prompt's last token (after the model's last norm; the pooling of
    decoder embedding models such as Qwen3-Embedding and e5-mistral), in float32, cut to its first
    ``dimensions`` (None: all; Matryoshka-trained models) and then, when ``normalize``, scaled to unit
    L2 norm. Nothing is sampled. Raises ValueError naming the bad field."""

    normalize: bool = True
    dimensions: int | None = None

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        if not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be a bool, got {self.normalize!r}")
        d = self.dimensions
        if d is not None and (not isinstance(d, int) or isinstance(d, bool) or d < 1):
            raise ValueError(f"dimensions must be a positive int or None, got {d!r}")

    def apply(self, hidden):
        """hidden float32 [hidden_size] (a torch tensor) -> the embedding as a list of floats."""
        vector = hidden[:self.dimensions] if self.dimensions is not None else hidden
        if self.normalize:
            vector = vector / vector.norm().clamp_min(1e-12)
        return vector.tolist()
