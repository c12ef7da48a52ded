"""Speculative decoding by prompt lookup (n-gram drafts), for greedy sequences.

A decoding sequence whose last n tokens (n = 3, then 2, then 1) occurred earlier in its prompt or
output proposes the k tokens that followed that earlier occurrence as drafts. The step feeds the
last token and the drafts together (1 + k query tokens, like a prefill chunk against the paged
cache) and takes the argmax at every position: draft i is accepted while it equals the argmax
before it, and the argmax after the last accepted draft is the step's extra token. The output is
exactly the tokens greedy decoding gives one at a time (up to the argmax of a differently shaped
batch: bf16 near-ties); what changes is how many forward passes produce them. Copy-heavy answers
(quoting the prompt, editing code, repeated structure) accept many drafts; others cost one slightly
larger step.

Only sequences whose next token depends on nothing but the logits row qualify: greedy, no
logprobs, no penalties, no logit_bias / allowed_token_ids / bad words, no grammar, min_tokens
reached, and no stop strings (found in the text once per step, they could end the output inside
a step's accepted tokens). Drafts are added after the scheduler's choice, within the step's token budget and only
where the sequence's blocks have room without preempting anyone (so a preempted sequence never
holds drafts). Steps with drafts run eagerly (no CUDA graph) and are never run ahead.
"""

from __future__ import annotations

import numpy as np

from .sampler import reads_sampled_tokens

NGRAM_SIZES = (3, 2, 1)  # the longest match first


def eligible(seq) -> bool:
    """Whether a decoding sequence's next tokens can be verified by argmax alone."""
    p = seq.params
    return (p.temperature == 0.0 and p.logprobs is None and not p.stop and not p.logit_bias
            and not p.allowed_token_ids and not p.bad_words and not reads_sampled_tokens(seq))


class History:
    """A sequence's tokens as a growing int64 array (amortised doubling), so that proposing costs
    the new tokens' copy and a vectorised scan, not a list-to-array conversion of the whole
    context every step (~100 us at 8k tokens)."""

    def __init__(self):
        self.ids = np.empty(256, np.int64)
        self.length = 0

    def view(self, tokens: list[int]) -> np.ndarray:
        """tokens (a list that only grows between calls) as an array [len(tokens)]."""
        if len(tokens) > self.ids.shape[0]:
            grown = np.empty(max(2 * self.ids.shape[0], len(tokens)), np.int64)
            grown[:self.length] = self.ids[:self.length]
            self.ids = grown
        if len(tokens) > self.length:
            self.ids[self.length:len(tokens)] = tokens[self.length:]
            self.length = len(tokens)
        return self.ids[:len(tokens)]


def propose(tokens: list[int], k: int, history: History | None = None) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the last n tokens of
    ``tokens`` (n in NGRAM_SIZES, longest first); [] when none occurred. history: the sequence's
    History (None: converted here); the scan is vectorised, since a step looks through every
    drafting sequence's whole context."""
    length = len(tokens)
    if length < 2 or k < 1:
        return []
    ids = history.view(tokens) if history is not None else np.asarray(tokens, dtype=np.int64)  # [L]
    for n in NGRAM_SIZES:
        if length <= n:
            continue
        # starts i < L - n where ids[i:i + n] equals the last n tokens
        match = ids[:length - n] == ids[length - n]  # [L - n]
        for j in range(1, n):
            match &= ids[j:length - n + j] == ids[length - n + j]
        starts = np.flatnonzero(match)
        if starts.size:
            i = int(starts[-1])  # the latest occurrence
            return tokens[i + n:i + n + k]
    return []


def accepted(drafts: list[int], argmax: list[int]) -> int:
    """How many drafts the target accepts: argmax[i] is the model's token after the step's i-th
    input (the last real token, then the drafts), so draft i stands while it equals argmax[i]."""
    m = 0
    while m < len(drafts) and drafts[m] == argmax[m]:
        m += 1
    return m
