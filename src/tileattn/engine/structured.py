"""Structured outputs: sampling held to a JSON schema, a regex, a list of choices or a grammar,
through llguidance (a parser that works on tokens: before each token it computes which vocabulary
entries keep the text inside the language).

A request's spec (``SamplingParams.structured_outputs``, one key of SPEC_KINDS) is compiled into a
grammar when the request comes in (a bad schema, regex or grammar is a ValueError then); each of its
sequences gets a matcher. Before sampling, sampler.apply_grammar_masks sets the logits of the tokens a
sequence's matcher forbids to -inf; after sampling, the engine hands the token to the matcher. When
the grammar is complete only EOS remains allowed, so the answer ends the way the model ends any.

JSON is compiled without free whitespace, with ", " and ": " between items (the layout of Python's
json.dumps): a model cannot fill its answer with whitespace, which the JSON grammar would otherwise
allow between any two tokens.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict

import torch

# spec kind -> what its value must be
SPEC_KINDS = {
    "json": "a JSON schema (a dict, or its JSON text)",
    "json_object": "true (any JSON object)",
    "regex": "a regular expression (Rust regex syntax) the whole answer matches",
    "choice": "a non-empty list of strings, the answer being exactly one of them",
    "grammar": "a Lark grammar (llguidance's dialect) or a GBNF one (llama.cpp's)",
}
# How generated JSON is laid out (", ", ": ", no free whitespace): structured outputs and forced tool calls
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def check_spec(spec) -> None:
    """ValueError naming structured_outputs unless ``spec`` is one {kind: value} of SPEC_KINDS."""
    if not isinstance(spec, dict) or len(spec) != 1 or next(iter(spec)) not in SPEC_KINDS:
        raise ValueError(f"structured_outputs must be a dict with exactly one of {sorted(SPEC_KINDS)}, got {spec!r}")
    (kind, value), = spec.items()
    ok = {"json": isinstance(value, (dict, str)), "json_object": value is True,
          "regex": isinstance(value, str) and value != "", "grammar": isinstance(value, str) and value.strip() != "",
          "choice": isinstance(value, (list, tuple)) and value and all(isinstance(c, str) and c for c in value),
          }[kind]
    if not ok:
        raise ValueError(f"structured_outputs[{kind!r}] must be {SPEC_KINDS[kind]}, got {value!r}")


class GrammarCompiler:
    """Specs -> matchers for one tokenizer, with the compiled grammars of the last CACHE_SIZE specs
    kept (one JSON schema is often sent with every request). Compiling a large schema takes up to
    ~1 s: a server calls ``prepare`` in a worker thread before it hands the request to the engine,
    whose thread then only copies the prepared matcher. Thread-safe. llguidance is imported on
    first use, so engines that never constrain an answer do not need it."""

    CACHE_SIZE = 128

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids):
        self.tokenizer, self.vocab_size, self.eos_token_ids = tokenizer, vocab_size, list(eos_token_ids)
        self._ll_tokenizer = None
        self._lock = threading.Lock()
        self._prepared: OrderedDict[str, object] = OrderedDict()  # spec as JSON -> a fresh matcher to copy
        self.compilations = 0

    def _llguidance(self):
        try:
            import llguidance
        except ImportError:
            raise ValueError("structured_outputs needs the llguidance package "
                             "(pip install 'tileattn[engine]')") from None
        with self._lock:
            if self._ll_tokenizer is None:
                # the model's vocabulary may be wider than the tokenizer's (padded): those ids are never allowed
                self._ll_tokenizer = llguidance.LLTokenizer(self.tokenizer.backend.to_str(), n_vocab=self.vocab_size,
                                                            eos_token=self.eos_token_ids)
        return llguidance

    def prepare(self, spec: dict):
        """The template matcher of a checked spec, compiled now unless cached; ValueError naming
        structured_outputs when the schema, regex or grammar is invalid."""
        key = json.dumps(spec, sort_keys=True)
        with self._lock:
            template = self._prepared.get(key)
            if template is not None:
                self._prepared.move_to_end(key)
                return template
        template = self._compile(spec)
        with self._lock:
            self._prepared[key] = template
            while len(self._prepared) > self.CACHE_SIZE:
                self._prepared.popitem(last=False)
        return template

    def matchers(self, spec: dict, n: int) -> list:
        """n fresh matchers of a checked spec (one per sequence: each tracks its own answer)."""
        template = self.prepare(spec)
        return [template.deep_copy() for _ in range(n)]

    def _compile(self, spec: dict):
        llguidance = self._llguidance()
        (kind, value), = spec.items()
        try:
            if kind == "json":
                grammar = llguidance.LLMatcher.grammar_from_json_schema(value, defaults=JSON_LAYOUT)
            elif kind == "json_object":
                grammar = llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_LAYOUT)
            elif kind == "choice":
                grammar = llguidance.grammar_from("choice", json.dumps(list(value)))
            else:
                grammar = llguidance.grammar_from(kind, value)
        except (ValueError, TypeError) as exc:  # JSON text that does not parse, a GBNF grammar that does not convert
            raise ValueError(f"structured_outputs[{kind!r}] is not valid: {exc}") from None
        template = llguidance.LLMatcher(self._ll_tokenizer, grammar, log_level=0)
        self.compilations += 1
        if template.is_error():
            raise ValueError(f"structured_outputs[{kind!r}] is not valid: {template.get_error()}")
        return template


_executor = None


def fill_bitmasks(matchers, bitmask: torch.Tensor) -> None:
    """Row k of ``bitmask`` (int32 [R, ceil(V / 32)] on the host, contiguous) := the tokens
    matchers[k] allows now, one bit per token id; the rows are computed in parallel."""
    global _executor
    if _executor is None:
        from llguidance import LLExecutor

        _executor = LLExecutor()
    _executor.unsafe_compute_mask_ptr([(m, k) for k, m in enumerate(matchers)], bitmask.data_ptr(),
                                      bitmask.shape[1] * 4, bitmask.shape[0])
