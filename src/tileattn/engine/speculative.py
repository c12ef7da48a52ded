"""Speculative decoding by prompt lookup (n-gram drafts), for greedy and sampled sequences.

A decoding sequence whose last n tokens (n = 3, then 2, then 1) occurred earlier in its prompt or
output proposes the k tokens that followed that earlier occurrence as drafts. The step feeds the
last token and the drafts together (1 + k query tokens, like a prefill chunk against the paged
cache) and picks a token at every position as the sequence's sampling would (the argmax, or a
sample of the row's temperature / top-k / top-p / min-p distribution): draft i is accepted while it
equals the token picked before it, and the pick after the last accepted draft is the step's extra
token. Greedy: exactly the tokens greedy decoding gives one at a time (up to the argmax of a
differently shaped batch: bf16 near-ties). Sampled: a draft is one token, not a distribution, so
accepting it when the row's sample equals it is the rejection rule of speculative sampling with a
point-mass draft (accept with probability p(draft); otherwise a sample of p without the draft, which
is the row's sample itself): every output token is a sample of the distribution decoding one token at
a time would draw from, given the same earlier tokens. A seeded sequence stays reproducible for a
given num_speculative_tokens, but draws other samples than without drafts (its generator serves
more rows). What changes is how many forward passes produce the tokens. Copy-heavy answers (quoting
the prompt, editing code, repeated structure) accept many drafts; others cost one slightly larger
step.

Only sequences whose next token depends on nothing but the logits row qualify: no logprobs, no
penalties, no logit_bias / allowed_token_ids / bad words, no grammar, min_tokens reached, and no
stop strings (found in the text once per step, they could end the output inside a step's accepted
tokens). Drafts are added after the scheduler's choice, within the step's token budget and only
where the sequence's blocks have room without preempting anyone (so a preempted sequence never
holds drafts). Steps with drafts run eagerly (no CUDA graph) and are never run ahead.
"""

from __future__ import annotations

import numpy as np

from .sampler import reads_sampled_tokens

NGRAM_SIZES = (3, 2, 1)  # the longest match first


def eligible(seq) -> bool:
    """Whether a decoding sequence's next tokens can be verified by its logits rows alone."""
    p = seq.params
    return (p.logprobs is None and not p.stop and not p.content_stop and not p.logit_bias and not p.allowed_token_ids
            and not p.bad_words and not reads_sampled_tokens(seq))


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


def accepted(drafts: list[int], picks: list[int]) -> int:
    """How many drafts the target accepts: picks[i] is the token the sequence's sampling picked
    after the step's i-th input (the last real token, then the drafts), so draft i stands while it
    equals picks[i]."""
    m = 0
    while m < len(drafts) and drafts[m] == picks[m]:
        m += 1
    return m
