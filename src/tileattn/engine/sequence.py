"""One request (Request) and each of its n completions (Sequence): tokens, cache blocks, status,
detokenization state. Plain data; the scheduler, block manager and engine change it."""

from __future__ import annotations

import enum
import itertools
import time

from .sampling_params import SamplingParams

_seq_ids = itertools.count()
_arrivals = itertools.count()  # requests in arrival order (priority scheduling's tie-break)

# Tokens decoded again before the new ones, so a token whose text depends on its left neighbour
# (a leading space, a multi-byte character split over tokens) decodes the way it does in context.
_DETOKENIZE_CONTEXT = 6


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """One completion: prompt + output token ids and where their keys/values live in the cache.

    num_computed_tokens: leading tokens whose k/v are in the cache (prefix-cache hits included);
    the scheduler feeds token_ids[num_computed_tokens:] (or a chunk of them) to the model.
    """

    def __init__(self, request: Request, index: int):
        self.seq_id = next(_seq_ids)
        self.request = request
        self.index = index
        self.params: SamplingParams = request.params
        self.token_ids: list[int] = list(request.prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = None     # prompt tokens the prefix cache held when first scheduled
        self.block_table: list[int] = []
        self.table_row = None             # (block_table, blocks copied, numpy row): ModelRunner's cache
        self.num_hashed_blocks = 0        # leading full blocks registered in the prefix cache
        self.last_block_hash = None       # chained hash of block num_hashed_blocks - 1
        self.hash_seed = request.cache_salt  # the block-hash chain's start: requests of other salts share no blocks
        self.status = SequenceStatus.WAITING
        self.generator = None             # torch.Generator of a seeded request, made by the sampler
        self.matcher = None               # llguidance matcher of a structured-output request (structured.py)
        self.drafts = None                # speculative tokens appended for the step in flight (speculative.py)
        self.history = None               # speculative.History of token_ids (made at the first proposal)
        self.matcher_after = None         # (matcher, tokens to look back) until SamplingParams.grammar_after appears
        self.grammar_opening = None       # (tag token, tokens to look back) until the first token: with matcher
                                          # set, that token is the grammar's or the tag (SamplingParams.grammar_after_open)
        self.logprobs: list[dict] | None = [] if self.params.logprobs is not None else None
        self.finish_reason: str | None = None
        self.stop_reason = None
        self.content_from = None          # where the text's content starts (SamplingParams.content_stop), once known
        # Detokenization: text of the output so far; tokens [prefix_offset, read_offset) are the
        # context decoded again before new tokens (see detokenizer.py).
        self.text = ""
        self.prefix_offset = max(self.num_prompt_tokens - _DETOKENIZE_CONTEXT, 0)
        self.read_offset = self.num_prompt_tokens
        self.num_emitted_tokens = 0       # output tokens already returned by a step
        self.num_emitted_chars = 0        # characters of text already returned

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def __repr__(self):
        return (f"Sequence({self.request.request_id}#{self.index}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={len(self.block_table)}, {self.status.value})")


class Request:
    """A prompt and its n sequences; prompt_logprobs are computed once, by sequence 0. An embedding
    request (pooling set) has one sequence that ends with its prompt."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 prompt_text: str | None = None, bad_words_token_ids: tuple[tuple[int, ...], ...] = (),
                 pooling=None, lora_slot: int = 0, cache_salt=None, priority: int = 0):
        self.request_id = request_id
        self.pooling = pooling  # PoolingParams of an embedding request (one sequence, nothing sampled)
        self.lora_slot = lora_slot  # the LoRA adapter's slot (lora.py; 0: the base model)
        self.cache_salt = cache_salt  # hashable or None: prefix-cache blocks are shared only under the same salt
        self.priority = priority  # lower runs first under the priority scheduling policy (scheduler.py)
        self.arrival_index = next(_arrivals)
        self.embedding: list[float] | None = None  # its result, set by the step that computes the last prompt token
        self.prompt_token_ids = list(prompt_token_ids)
        self.prompt_text = prompt_text
        self.params = params
        self.bad_words_token_ids = bad_words_token_ids  # params.bad_words tokenized (LLMEngine.add_request)
        self.arrival_time = time.time()
        self.first_token_time: float | None = None
        self.finished_time: float | None = None
        # Entry i: {token_id: logprob} for prompt token i (None for token 0, which has no context).
        self.prompt_logprobs: list | None = [None] if params.prompt_logprobs is not None else None
        self.seqs = [Sequence(self, i) for i in range(params.n)]

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.seqs)
