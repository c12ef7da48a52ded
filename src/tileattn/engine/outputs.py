"""What a step returns (contract B): RequestOutput with one CompletionOutput per sequence, or with the
embedding of an embedding request."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    """One of a request's n completions. token_ids/text: everything so far; new_token_ids/new_text:
    what this step added. Until the request finishes, text never ends inside a multi-byte character
    (nor inside a run of byte-fallback tokens) and, while stop strings are set, the last (longest
    stop - 1) characters are held back until they cannot start one; once it finishes, text is what
    the tokenizer decodes, invalid or incomplete bytes at the end included (as U+FFFD)."""

    index: int
    token_ids: list[int]
    text: str
    new_token_ids: list[int]
    new_text: str
    logprobs: list[dict] | None = None
    finish_reason: str | None = None   # None | "stop" | "length" | "abort"
    stop_reason: object = None         # the matched stop string, stop token id, or None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class BeamSearchSequence:
    """One of beam search's answers: its tokens (after the prompt), their text, the sum of their
    log-probabilities and the score it was ranked by (that sum / length ** length_penalty)."""

    token_ids: list[int]
    text: str
    cumulative_logprob: float
    score: float
    finished: bool  # ended with EOS (else it reached max_tokens)


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list | None = None
    prompt: str | None = None
    num_cached_tokens: int | None = None  # prompt tokens found in the prefix cache (None: not scheduled yet)
    metrics: dict = field(default_factory=dict)  # arrival_time, first_token_time, finished_time (time.time())
    embedding: list[float] | None = None  # an embedding request's vector (PoolingParams); its outputs are empty
