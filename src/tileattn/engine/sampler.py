"""Batched sampling on the logits' device: one set of tensor ops for the whole batch, whatever
mix of greedy, temperature, top-k, top-p, min-p, logit bias, penalties, min_tokens, allowed tokens,
bad words, grammars (structured outputs) and seeds its requests ask for.

Sampling uses the exponential race: argmax_i p_i / E_i with E_i ~ Exp(1) picks i with
probability p_i, so a seeded request only needs its own noise row (drawn from its own
torch.Generator) while the selection stays one batched argmax.
Log-probabilities are those of the model's raw distribution (before logit bias, penalties and temperature).
"""

from __future__ import annotations

import math

import torch

from .profiler import NULL
from .structured import fill_bitmasks

_TINY = torch.finfo(torch.float32).tiny


class Sampler:
    def __init__(self, eos_token_ids=()):
        self.eos_token_ids = tuple(eos_token_ids)  # banned with the stop ids while min_tokens holds

    def __call__(self, logits: torch.Tensor, seqs, profiler=NULL) -> tuple[list[int], list[dict | None]]:
        """logits float32 [N, vocab], one row per sequence in ``seqs`` (its next token).

        Returns (token ids [N], per row {token_id: logprob} of the top-n plus the chosen token,
        or None when that sequence asked for no logprobs). profiler: records its CUDA event 2
        after the sampling kernels, before the tokens' copy to the host (the step's sync point)."""
        tokens = self.sample(logits, seqs)
        profiler.record(2)
        return tokens.tolist(), self.logprobs(logits, tokens, seqs)

    def sample(self, logits: torch.Tensor, seqs) -> torch.Tensor:
        """The sampled token ids, int64 [N] on the logits' device. Only enqueues device work: the
        per-row parameters go up from pinned memory without waiting for the stream, so a step can
        be sampled while the GPU still runs the previous one (penalties excepted: they read the
        sequences' tokens on the host)."""
        logits = apply_penalties(apply_logit_bias(logits, seqs), seqs)
        logits = apply_allowed_tokens(apply_bans(logits, seqs, self.eos_token_ids), seqs)
        logits = apply_grammar_masks(logits, seqs, self.eos_token_ids)
        if all(s.params.temperature == 0.0 for s in seqs):
            return argmax_rows(logits)  # [N]
        return self._sample(logits, seqs)

    @staticmethod
    def logprobs(raw: torch.Tensor, tokens: torch.Tensor, seqs) -> list[dict | None]:
        """Per row the {token_id: logprob} of the raw logits [N, vocab] for the sequences that asked
        (None for the others); reads the device (a sync) only when some sequence asked."""
        wanted = [s.params.logprobs for s in seqs]
        if all(w is None for w in wanted):
            return [None] * len(seqs)
        return top_logprobs(raw, tokens, wanted)

    def _sample(self, logits, seqs):  # logits [N, V]
        device = logits.device
        params = [s.params for s in seqs]
        temperature = _on_device([p.temperature for p in params], torch.float32, device)  # [N]
        is_greedy = temperature == 0
        # Divided after the row's max is subtracted, so every scaled logit is <= 0: a tiny temperature
        # sends the others to -inf instead of overflowing to inf (which made softmax NaN).
        top = logits.amax(dim=-1, keepdim=True)  # [N, 1]
        scaled = (logits - top) / torch.where(is_greedy, 1.0, temperature)[:, None]  # [N, V]
        scaled = apply_top_k_top_p(scaled, [p.top_k for p in params], [p.top_p for p in params])
        probs = scaled.softmax(dim=-1)  # [N, V]
        if any(p.min_p > 0 for p in params):
            min_p = _on_device([p.min_p for p in params], torch.float32, device)  # [N]
            probs = probs.masked_fill(probs < min_p[:, None] * probs.amax(-1, keepdim=True), 0.0)
        noise = torch.empty_like(probs).exponential_()  # [N, V]
        for row, seq in enumerate(seqs):  # seeded rows draw their own noise (randomness only)
            if seq.params.seed is not None and seq.params.temperature > 0:
                if seq.generator is None:
                    seq.generator = torch.Generator(device=device)
                    seq.generator.manual_seed(hash((seq.params.seed, seq.index)) & (2**63 - 1))
                noise[row].exponential_(generator=seq.generator)
        sampled = argmax_rows(probs / noise.clamp_min_(_TINY))  # [N]
        return torch.where(is_greedy, argmax_rows(logits), sampled)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(dim=-1) for x [N, V] (the first maximum of each row; NaN counts as the maximum),
    in two passes when V splits into >= 64 equal groups: a row's argmax is one block's reduction
    on CUDA, 26 us for a 128256-entry vocabulary on the H200 at N = 1 (a tenth of the lm_head
    projection); the group maxima ([N, G, V / G] -> [N, G]) spread that over G rows."""
    n, vocab = x.shape
    groups = math.gcd(vocab, 1024)
    if groups < 64:
        return x.argmax(dim=-1)
    width = vocab // groups
    best, within = x.view(n, groups, width).max(dim=-1)  # [N, G]: each group's first maximum
    group = best.argmax(dim=-1, keepdim=True)  # [N, 1]: the first group holding the row's maximum
    return (group * width + within.gather(-1, group)).squeeze(-1)  # [N]


def _on_device(values: list, dtype: torch.dtype, device) -> torch.Tensor:
    """A small per-row parameter tensor on ``device``. On CUDA it goes through pinned memory with a
    non-blocking copy: a copy from pageable memory would make the host wait for the stream, i.e.
    for the whole forward in flight before it."""
    tensor = torch.tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


def apply_top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Set to -inf every logit outside each row's top-k (k <= 0: all), then outside the smallest
    set of the remaining tokens whose probability reaches top_p. logits [N, V] -> [N, V]."""
    vocab = logits.shape[-1]
    use_k = any(0 < k < vocab for k in top_k)
    use_p = any(p < 1.0 for p in top_p)
    if not (use_k or use_p):
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [N, V]
    if use_k:
        k = _on_device([k if 0 < k < vocab else vocab for k in top_k], torch.int64, logits.device)  # [N]
        rank = torch.arange(vocab, device=logits.device)  # [V]
        sorted_logits = sorted_logits.masked_fill(rank[None, :] >= k[:, None], float("-inf"))
    if use_p:
        p = _on_device(top_p, torch.float32, logits.device)  # [N]
        probs = sorted_logits.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # [N, V] mass of the tokens ranked above each
        outside = before >= p[:, None]
        outside[:, 0] = False  # the most likely token always stays (a top_p that rounds to 0 in float32)
        sorted_logits = sorted_logits.masked_fill(outside, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def apply_logit_bias(logits: torch.Tensor, seqs) -> torch.Tensor:
    """Each row's logit_bias added to its logits. logits [N, V] -> [N, V] (a new tensor when any
    row has a bias; token ids were checked against the vocabulary when the request came in)."""
    if not any(seq.params.logit_bias for seq in seqs):
        return logits
    entries = [(row, token, bias) for row, seq in enumerate(seqs) for token, bias in (seq.params.logit_bias or {}).items()]
    rows, tokens, biases = zip(*entries)
    index = _on_device([rows, tokens], torch.int64, logits.device)  # [2, E]
    return logits.index_put((index[0], index[1]), _on_device(biases, logits.dtype, logits.device), accumulate=True)


def apply_bans(logits: torch.Tensor, seqs, eos_token_ids) -> torch.Tensor:
    """-inf at the tokens each row may not sample now. logits [N, V] -> [N, V] (a new tensor when
    any row bans one).
    - min_tokens: while a sequence has fewer output tokens, its stop token ids (and EOS, unless
      ignore_eos): the token sampled now cannot end it.
    - bad words: the last token of each bad word's token sequence whose other tokens end the output.
    Both read the sequence's tokens on the host, so a step run ahead, one token behind, must not
    sample such a row (LLMEngine._run_ahead)."""
    entries = []
    for row, seq in enumerate(seqs):
        p = seq.params
        if not (p.min_tokens or p.bad_words):  # the common row: nothing to look up
            continue
        banned = set()
        if seq.num_output_tokens < p.min_tokens:
            banned |= set(p.stop_token_ids or ()) | (set() if p.ignore_eos else set(eos_token_ids))
        if p.bad_words:
            tokens = seq.token_ids
            for word in seq.request.bad_words_token_ids:  # the output's last len(word) - 1 tokens
                start = max(seq.num_prompt_tokens, len(tokens) - (len(word) - 1))
                if tuple(tokens[start:]) == word[:-1]:
                    banned.add(word[-1])
        entries += [(row, token) for token in banned]
    if not entries:
        return logits
    index = _on_device(list(zip(*entries)), torch.int64, logits.device)  # [2, E]
    return logits.index_put((index[0], index[1]), logits.new_full((), float("-inf")))  # filled on the device: no copy


def reads_sampled_tokens(seq) -> bool:
    """Whether sampling this sequence's next token reads the tokens it sampled before, on the host:
    penalties, a min_tokens not yet reached, bad words of several tokens, a grammar. Such a row can
    be sampled neither by a step launched before the previous token reached the host
    (LLMEngine._run_ahead) nor after drafts that are not its tokens yet (speculative.py)."""
    p = seq.params
    return (p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
            or seq.num_output_tokens < p.min_tokens or seq.matcher is not None or seq.matcher_after is not None
            or any(len(w) > 1 for w in seq.request.bad_words_token_ids))


def apply_grammar_masks(logits: torch.Tensor, seqs, eos_token_ids) -> torch.Tensor:
    """-inf at the tokens each constrained row's grammar forbids now (structured outputs). logits
    [N, V] -> [N, V] (a new tensor when any row is constrained). A grammar that allows no token
    (one the vocabulary cannot finish) allows EOS: the answer ends there instead of taking a token
    the grammar refuses. A row whose first token decides whether an optional thinking block opens
    (Sequence.grammar_opening) may also take the block's tag token. The masks come from the
    matchers' states on the host, which hold every token sampled so far: a step run ahead must not
    sample such a row (LLMEngine._run_ahead)."""
    rows = [row for row, seq in enumerate(seqs) if seq.matcher is not None]
    if not rows:
        return logits
    vocab = logits.shape[1]
    words = (vocab + 31) // 32
    bitmask = torch.empty((len(rows), words), dtype=torch.int32, pin_memory=logits.is_cuda)  # [R, W]
    fill_bitmasks([seqs[row].matcher for row in rows], bitmask)
    stuck = (bitmask == 0).all(dim=1)  # [R]
    if stuck.any():
        for token in eos_token_ids:
            bitmask[stuck, token // 32] |= torch.tensor(1 << (token % 32)).to(torch.int32)
    for k, row in enumerate(rows):
        opening = seqs[row].grammar_opening
        if opening is not None:  # the grammar's first tokens or the block's tag
            bitmask[k, opening[0] // 32] |= torch.tensor(1 << (opening[0] % 32)).to(torch.int32)
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)  # made there: no host copy
    bits = bitmask.to(logits.device, non_blocking=True)[:, :, None] >> shifts  # [R, W, 32]
    allowed = (bits & 1).view(len(rows), words * 32)[:, :vocab].bool()  # [R, V]: bit j of word w is token 32 w + j
    index = _on_device(rows, torch.int64, logits.device)
    return logits.index_put((index,), logits[index].masked_fill(~allowed, float("-inf")))


def apply_allowed_tokens(logits: torch.Tensor, seqs) -> torch.Tensor:
    """-inf everywhere but at each row's allowed_token_ids, for the rows that have them. logits
    [N, V] -> [N, V] (a new tensor when any row has them; ids were checked against the vocabulary
    when the request came in)."""
    rows = [row for row, seq in enumerate(seqs) if seq.params.allowed_token_ids]
    if not rows:
        return logits
    entries = [(row, token) for row in rows for token in seqs[row].params.allowed_token_ids]
    index = _on_device(list(zip(*entries)), torch.int64, logits.device)  # [2, E]: (row, allowed token)
    kept = logits[index[0], index[1]]  # [E]
    out = logits.index_fill(0, _on_device(rows, torch.int64, logits.device), float("-inf"))
    return out.index_put_((index[0], index[1]), kept)


def apply_penalties(logits: torch.Tensor, seqs) -> torch.Tensor:
    """Repetition (prompt + output tokens), presence and frequency (output tokens) penalties,
    as OpenAI / vLLM define them. logits [N, V] -> [N, V] (a new tensor when any applies)."""
    params = [s.params for s in seqs]
    use_rep = any(p.repetition_penalty != 1.0 for p in params)
    use_freq = any(p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 for p in params)
    if not (use_rep or use_freq):
        return logits
    device, vocab = logits.device, logits.shape[-1]
    counts = _token_counts([s.output_token_ids for s in seqs], vocab, device)  # [N, V]
    if use_rep:
        seen = counts > 0
        seen |= _token_counts([s.token_ids[:s.num_prompt_tokens] for s in seqs], vocab, device) > 0
        rep = torch.tensor([p.repetition_penalty for p in params], device=device)[:, None]  # [N, 1]
        logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    if use_freq:
        freq = torch.tensor([p.frequency_penalty for p in params], device=device)[:, None]
        presence = torch.tensor([p.presence_penalty for p in params], device=device)[:, None]
        logits = logits - freq * counts - presence * (counts > 0)
    return logits


def _token_counts(token_lists, vocab: int, device) -> torch.Tensor:
    """[N, V] float32 occurrence counts; ragged lists are padded with an extra column, dropped."""
    width = max((len(t) for t in token_lists), default=0)
    padded = torch.full((len(token_lists), max(width, 1)), vocab, dtype=torch.int64)
    for row, tokens in enumerate(token_lists):
        padded[row, :len(tokens)] = torch.tensor(tokens, dtype=torch.int64)
    counts = torch.zeros(len(token_lists), vocab + 1, device=device)
    counts.scatter_add_(1, padded.to(device), torch.ones(padded.shape, device=device))
    return counts[:, :vocab]


def top_logprobs(logits: torch.Tensor, chosen: torch.Tensor, top_n: list[int | None]) -> list[dict | None]:
    """Per row {token_id: logprob} for the row's top-n tokens and its chosen token.
    logits [N, V] float32, chosen int [N]; rows with top_n None get None."""
    logprobs = logits.log_softmax(dim=-1)  # [N, V]
    chosen_lp = logprobs.gather(1, chosen.view(-1, 1)).squeeze(1).tolist()  # [N]
    chosen_ids = chosen.tolist()
    width = max(n or 0 for n in top_n)
    top_vals = top_ids = None
    if width:
        top_vals, top_ids = logprobs.topk(width, dim=-1)  # [N, width]
        top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
    out = []
    for row, n in enumerate(top_n):
        if n is None:
            out.append(None)
            continue
        entry = dict(zip(top_ids[row][:n], top_vals[row][:n])) if n else {}
        entry[chosen_ids[row]] = chosen_lp[row]
        out.append(entry)
    return out
