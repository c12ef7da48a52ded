"""LLMEngine (the streaming step API a server drives) and LLM (offline generate / chat).

One engine step: the scheduler picks sequences and token counts, the model runner computes them
and samples, then here each sampled token is appended, checked against EOS / stop ids / max_tokens
/ max_model_len, detokenized and checked against stop strings; finished sequences give their
blocks back.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
import weakref

import torch

from . import speculative
from .block_manager import BlockManager
from .config import EngineConfig
from .detokenizer import detokenize, find_stop, finish, visible_text_length
from .distributed import Workers, check_tensor_parallel, rank_devices
from .loader import load_model, read_model_config
from .model_runner import ModelRunner, StepResult
from .beam_search import BeamSearch
from .outputs import BeamSearchSequence, CompletionOutput, RequestOutput
from .profiler import NULL, StepProfiler
from .sampling_params import PoolingParams, SamplingParams
from .sampler import reads_sampled_tokens
from .scheduler import Scheduler
from .sequence import Request
from .structured import GrammarCompiler
from .tokenizer import TEMPLATE_VARIABLES


class LLMEngine:
    """Contract B. Construction loads the checkpoint, sizes the KV cache and (on CUDA, unless
    enforce_eager) captures the decode graphs; startup_seconds records how long that took.

    tensor_parallel_size N > 1: the model is split over N ranks (docs/tensor_parallel.md); this
    process is rank 0 and starts N - 1 worker processes, stopped by shutdown() (also called when the
    engine is garbage-collected or at interpreter exit). A worker that dies makes the running call
    raise distributed.TensorParallelError naming its rank.

    Raises FileNotFoundError / ValueError from the loader (missing checkpoint or tokenizer,
    unsupported architecture) and ValueError when max_model_len does not fit the model or the cache;
    with N > 1 also ValueError, before any process starts, when the model's heads, KV heads,
    intermediate size or vocabulary do not split N ways or fewer than N GPUs are visible.
    """

    def __init__(self, config: EngineConfig):
        start = time.perf_counter()
        self.config = config
        device = torch.device(config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device={config.device!r} but torch sees no CUDA GPU (use device='cpu')")
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if device.type == "cuda":
            torch.cuda.set_device(device)  # graphs, streams and the kernels' launches follow it
        self.device = device
        self.workers = None
        tp = None
        if config.tensor_parallel_size > 1:
            check_tensor_parallel(read_model_config(config.model), config.tensor_parallel_size)
            self.workers = Workers(config, rank_devices(device, config.tensor_parallel_size))
            self._finalizer = weakref.finalize(self, self.workers.shutdown)
            tp = self.workers.tp
        try:
            with self._guard():
                loaded = load_model(config.model, device, config.dtype, max_model_len=config.max_model_len, tp=tp)
                self.runner = ModelRunner(loaded, config, device, config.max_model_len, tp=tp)
        except BaseException:
            self.shutdown()
            raise
        if self.workers is not None:
            self.workers.started = True
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.model_name = loaded.name
        self.generation_defaults = dict(loaded.generation_defaults)
        self.eos_token_ids = frozenset(loaded.eos_token_ids)
        self.grammars = GrammarCompiler(self.tokenizer, self.model_config.vocab_size, sorted(self.eos_token_ids))
        self.dtype = loaded.dtype
        self.max_model_len = self.runner.max_model_len
        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.scheduling_policy)
        self.requests: dict[str, Request] = {}
        self.pooling_requests: set[str] = set()  # live embedding requests (their rows are pooled, not sampled)
        self.last_step = {"prefill_tokens": 0, "decode_tokens": 0, "seconds": 0.0}
        # Async scheduling (one decode step run ahead, see _run_ahead): on unless
        # TILEATTN_ENGINE_ASYNC=0; not with tensor parallel (the workers get their inputs from the host).
        self.async_scheduling = self.workers is None and os.environ.get("TILEATTN_ENGINE_ASYNC", "1") != "0"
        self._pending = None  # the step run ahead, launched, its tokens not processed yet
        self.num_speculative_tokens = config.num_speculative_tokens
        if self.num_speculative_tokens:  # drafts come from the tokens on the host: no step runs ahead of them
            self.async_scheduling = False
        self.spec_drafted = self.spec_accepted = 0  # draft tokens proposed / accepted so far
        self.profiler = NULL
        if os.environ.get("TILEATTN_ENGINE_PROFILE", "0") not in ("", "0"):
            self.enable_profiling()
        self.startup_seconds = time.perf_counter() - start

    @classmethod
    def from_model(cls, model: str, **options) -> LLMEngine:
        return cls(EngineConfig(model=model, **options))

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (a no-op with one rank); idempotent. The engine cannot
        step afterwards. With TILEATTN_ENGINE_PROFILE set, prints the step profile to stderr."""
        profiler = getattr(self, "profiler", NULL)  # absent when construction failed
        if os.environ.get("TILEATTN_ENGINE_PROFILE", "0") not in ("", "0") and profiler is not NULL:
            print(profiler.table(), file=sys.stderr)
            profiler.reset()
        if self.workers is not None:
            self.workers.shutdown()

    def _guard(self):
        return self.workers.guard() if self.workers is not None else contextlib.nullcontext()

    # ---- requests -------------------------------------------------------------------------------

    def add_lora(self, name: str, path: str) -> None:
        """Load the PEFT LoRA adapter at ``path`` under ``name`` (requests then name it in
        add_request's ``lora``). Raises ValueError (FileNotFoundError) as lora.LoRAAdapters.load
        does, and when the engine has no LoRA slots (EngineConfig.max_loras)."""
        if self.runner.lora is None:
            raise ValueError("this engine serves no LoRA adapters: create it with max_loras > 0")
        self.runner.lora.load(name, path)

    def remove_lora(self, name: str) -> None:
        """Unload LoRA adapter ``name``, freeing its slot for another. Raises ValueError for an
        unknown name, or while an unfinished request runs with it."""
        lora = self.runner.lora
        if lora is None:
            raise ValueError("this engine serves no LoRA adapters: create it with max_loras > 0")
        if not isinstance(name, str):
            raise ValueError(f"name must be an adapter's name (a str), got {name!r}")
        slot = lora.slot(name)
        users = sum(request.lora_slot == slot for request in self.requests.values())
        if users:
            raise ValueError(f"LoRA adapter {name!r} is in use by {users} unfinished request(s)")
        lora.unload(name)

    @property
    def lora_names(self) -> list[str]:
        """The LoRA adapters loaded, in slot order."""
        return [] if self.runner.lora is None else list(self.runner.lora.names)

    def add_request(self, request_id: str, prompt, params: SamplingParams | PoolingParams | None = None,
                    lora: str | None = None, cache_salt: str | None = None, priority: int = 0) -> None:
        """Queue a prompt (text, encoded with the tokenizer's special tokens, or token ids): a
        generation (SamplingParams), or an embedding (PoolingParams: its output carries the vector);
        ``lora``: the name of a loaded LoRA adapter to run it with (None: the base model);
        ``cache_salt`` (vLLM's): the request shares prefix-cache blocks only with requests of the same
        salt (tenants that must not learn from each other's cache hits; an adapter is a salt of its own);
        ``priority``: under scheduling_policy "priority", lower runs first (0 otherwise).

        Raises ValueError before queueing anything: duplicate or non-string id, empty prompt,
        token ids outside the vocabulary, logprobs or prompt_logprobs above its size, a generation
        prompt of max_model_len tokens or more (an embedding's may have max_model_len),
        PoolingParams.dimensions above the hidden size, bad params, an adapter name not loaded."""
        if not isinstance(request_id, str):
            raise ValueError(f"request_id must be a str, got {type(request_id).__name__}")
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        pooling = params if isinstance(params, PoolingParams) else None
        params = SamplingParams() if params is None else SamplingParams(max_tokens=1) if pooling else params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams or PoolingParams, got {type(params).__name__}")
        params.validate()
        if params.n > self.config.max_num_seqs:  # n sequences are made at once: bounded like a step's batch
            raise ValueError(f"n ({params.n}) must be at most max_num_seqs ({self.config.max_num_seqs})")
        if pooling is not None:
            pooling.validate()
            hidden = self.model_config.hidden_size
            if pooling.dimensions is not None and pooling.dimensions > hidden:
                raise ValueError(f"dimensions={pooling.dimensions} exceeds the model's hidden size {hidden}")
        text = None
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = list(prompt)
        else:
            raise ValueError("prompt must be a str or a list of token ids (ints)")
        if not ids:
            raise ValueError("prompt is empty (no tokens)")
        vocab = self.model_config.vocab_size
        for what, tokens in (("prompt token ids", ids), ("logit_bias token ids", params.logit_bias or ()),
                             ("allowed_token_ids", params.allowed_token_ids or ()),
                             ("stop_token_ids", params.stop_token_ids or ())):
            bad = [t for t in tokens if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"{what} {bad[:4]} are outside the vocabulary [0, {vocab})")
        for name in ("logprobs", "prompt_logprobs"):  # the top-n of the vocabulary (torch.topk in the step)
            if (getattr(params, name) or 0) > vocab:
                raise ValueError(f"{name}={getattr(params, name)} exceeds the vocabulary's {vocab} tokens")
        if pooling is not None and len(ids) > self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens, more than max_model_len={self.max_model_len}")
        if pooling is None and len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens; max_model_len={self.max_model_len} leaves "
                             "no room for an output token")
        matchers = self.grammars.matchers(params.structured_outputs, params.n) if params.structured_outputs else None
        # waits: the grammar starts after grammar_after; opening: (the optional block's tag token, look back),
        # the first token then being the tag (the block opens, the grammar waits) or the grammar's
        waits, opening = False, None
        if matchers is not None and params.grammar_after is not None:
            tail = self.tokenizer.decode(ids[-32:], skip_special_tokens=False).rstrip()
            waits = not tail.endswith(params.grammar_after)  # a prompt may close the block itself
            look_back = len(self.tokenizer.encode(params.grammar_after, add_special_tokens=False)) + 1
            tag = params.grammar_after_open
            if waits and tag is not None and not tail.endswith(tag):  # the block is optional, not opened yet
                opening = (self._tag_token(tag), look_back)
        if lora is not None and self.runner.lora is None:
            raise ValueError(f"lora={lora!r}: this engine serves no LoRA adapters (max_loras=0)")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority must be an int, got {priority!r}")
        if priority and not self.scheduler.by_priority:
            raise ValueError("priority needs scheduling_policy='priority' (this engine schedules first come, first served)")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise ValueError(f"cache_salt must be a str, got {type(cache_salt).__name__}")
        slot = 0 if lora is None else self.runner.lora.slot(lora)
        salt = (cache_salt, None if lora is None else self.runner.lora.keys[lora])
        request = Request(request_id, ids, params, text, self._bad_words_token_ids(params.bad_words or ()), pooling,
                          slot, None if salt == (None, None) else salt, priority)
        if pooling is not None:
            self.pooling_requests.add(request_id)
            self.runner.pooling = True
        if matchers is not None:
            for seq, matcher in zip(request.seqs, matchers):
                if opening is not None:  # the grammar's first tokens or the tag (sampler.apply_grammar_masks)
                    seq.matcher, seq.grammar_opening = matcher, opening
                elif waits:
                    seq.matcher_after = (matcher, look_back)
                else:
                    seq.matcher = matcher
        self.requests[request_id] = request
        for seq in request.seqs:
            self.scheduler.add(seq)

    def _tag_token(self, tag: str) -> int:
        """The one token whose text is ``tag`` (SamplingParams.grammar_after_open); ValueError naming
        the tag when the tokenizer spells it in several tokens."""
        ids = self.tokenizer.encode(tag, add_special_tokens=False)
        if len(ids) != 1 or self.tokenizer.decode(ids, skip_special_tokens=False) != tag:
            raise ValueError(f"structured outputs with an optional {tag!r} block need {tag!r} to be one token of "
                             f"the model's tokenizer, which spells it in {len(ids)} tokens {ids[:8]}: the answer's "
                             f"first token could not tell whether it opens the block (grammar_after_open)")
        return ids[0]

    def _bad_words_token_ids(self, words) -> tuple[tuple[int, ...], ...]:
        """Each bad word's token ids alone and after a space (the word inside a text), the second only
        where the space changes the first token without changing the count (vLLM's rule)."""
        out = []
        for word in words:
            alone = tuple(self.tokenizer.encode(word.lstrip(), add_special_tokens=False))
            spaced = tuple(self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
            out.append(alone)
            if spaced[0] != alone[0] and len(spaced) == len(alone):
                out.append(spaced)
        return tuple(out)

    def abort_request(self, request_id: str) -> None:
        """Drop a request and free its blocks at once; an unknown id is a no-op."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return
        self._forget_pooling(request_id)
        for seq in request.seqs:
            if not seq.finished:
                self.scheduler.finish(seq)
                seq.finish_reason = "abort"

    def _forget_pooling(self, request_id: str) -> None:
        self.pooling_requests.discard(request_id)
        self.runner.pooling = bool(self.pooling_requests)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def stats(self) -> dict:
        bm = self.block_manager
        return {"num_running": len(self.scheduler.running), "num_waiting": len(self.scheduler.waiting),
                "kv_cache_usage": bm.usage(), "prefix_cache_hits": bm.prefix_cache_hits,
                "prefix_cache_queries": bm.prefix_cache_queries, "num_free_blocks": bm.num_free_blocks,
                "num_total_blocks": bm.num_blocks, "num_preemptions": self.scheduler.num_preemptions,
                "spec_drafted_tokens": self.spec_drafted, "spec_accepted_tokens": self.spec_accepted}

    # ---- one step -------------------------------------------------------------------------------

    def step(self, finished_only: bool = False) -> list[RequestOutput]:
        """Run one scheduler step; returns the outputs of requests that got a token (or finished).
        finished_only: build outputs only for requests that finished (offline use: skips copying
        every running request's tokens and text each step)."""
        start = time.perf_counter()
        prof = self.profiler
        prof.begin()
        current, self._pending = self._pending, None
        if current is not None and all(seq.finished for seq, _ in current.scheduled):
            current = None  # every sequence of the step run ahead has finished (or was aborted)
        if current is None:
            scheduled = self.scheduler.schedule()
            if not scheduled:
                return []
            if self.num_speculative_tokens:
                scheduled = self._add_drafts(scheduled)
            prof.lap("schedule")
            with self._guard():
                current = self.runner.launch(scheduled)
        with self._guard():
            if self.async_scheduling:
                self._pending = self._run_ahead(current)
            result = current.result()
        prof.lap("sample")
        # A step run ahead may hold sequences that finished (or were aborted) since it was launched:
        # their token is dropped and their blocks are already free (later steps' writes to those
        # blocks come after this step's on the same stream).
        scheduled = current.scheduled
        if self.num_speculative_tokens:
            scheduled, result = self._verify_drafts(scheduled, result)
        bm, size = self.block_manager, self.block_manager.block_size
        decode = total = 0
        for seq, n in scheduled:
            if seq.finished:
                continue
            total += n
            computed = seq.num_computed_tokens
            # A decode feeds a sequence's last token, which it sampled itself (not a prompt token).
            decode += n == 1 and computed == len(seq.token_ids) - 1 and computed >= seq.num_prompt_tokens
            seq.num_computed_tokens = computed = computed + n
            if computed // size > seq.num_hashed_blocks:  # a block filled up: into the prefix cache
                bm.register_full_blocks(seq)
        for seq, entries in result.prompt_logprobs.items():
            seq.request.prompt_logprobs += entries
        # finished_only (offline): text that no step returns is decoded once, when its sequence
        # finishes, unless stop strings need it every step; streaming decodes every step.
        touched, to_detokenize, finished, catch_up = {}, [], [], []
        now = time.time()
        eos, max_model_len = self.eos_token_ids, self.max_model_len
        for seq, token, logprobs in result.sampled:
            # finish_reason: a token earlier in this step's accepted drafts ended it (EOS, a stop id,
            # max_tokens); the picks after it are not the sequence's
            if seq.finished or seq.finish_reason is not None:
                continue
            request = seq.request
            if not finished_only:
                touched[request.request_id] = request
            if request.first_token_time is None:
                request.first_token_time = now
            tokens = seq.token_ids
            tokens.append(token)
            if seq.logprobs is not None:
                seq.logprobs.append(logprobs)
            params = seq.params
            lazy = finished_only and not params.stop and not params.content_stop
            if seq.grammar_opening is not None:  # the first token: the optional block's tag, or the grammar's
                tag, look_back = seq.grammar_opening
                seq.grammar_opening = None
                if token == tag:  # the block opens: free until grammar_after
                    seq.matcher, seq.matcher_after = None, (seq.matcher, look_back)
            if token in eos and not params.ignore_eos:
                seq.finish_reason = "stop"  # stop_reason None: the model's own end
            elif seq.matcher is not None and not seq.matcher.consume_token(token):
                # Not reached: the sampler allowed only tokens the grammar accepts. Should it be, this
                # sequence ends (abort), not the engine with every other request.
                print(f"tileattn engine: request {request.request_id}: the grammar refused token {token} "
                      f"({seq.matcher.get_error()}); the sequence is aborted", file=sys.stderr)
                seq.finish_reason = "abort"
            elif params.stop_token_ids and token in params.stop_token_ids:
                seq.finish_reason, seq.stop_reason = "stop", token
            else:
                if len(tokens) - seq.num_prompt_tokens >= params.max_tokens or len(tokens) >= max_model_len:
                    seq.finish_reason = "length"
                if not lazy:
                    if not to_detokenize or to_detokenize[-1] is not seq:  # once per step (drafts: several tokens)
                        to_detokenize.append(seq)
                elif seq.finish_reason is not None:
                    catch_up.append((seq, len(tokens)))
            if seq.matcher_after is not None and seq.finish_reason is None:
                matcher, look_back = seq.matcher_after
                if params.grammar_after in self.tokenizer.decode(tokens[-look_back:], skip_special_tokens=False):
                    seq.matcher, seq.matcher_after = matcher, None  # the grammar holds from the next token on
            if seq.finish_reason is not None:
                finished.append(seq)
                if seq.finish_reason == "stop":  # held-back text is flushed; the stop token (a stop id or
                    # EOS) adds its text only with include_stop_str_in_output (vLLM's rule)
                    catch_up.append((seq, len(tokens) - (0 if params.include_stop_str_in_output else 1)))
                    if to_detokenize and to_detokenize[-1] is seq:
                        # an earlier pick of this step's accepted drafts queued it, to decode every
                        # token: the stop token's text would be in the output
                        to_detokenize.pop()
        for seq, hidden in result.pooled:  # an embedding request's prompt has ended: its vector, and done
            if seq.finished:
                continue
            request = seq.request
            request.embedding = request.pooling.apply(hidden)
            request.first_token_time = now
            seq.finish_reason = "stop"
            finished.append(seq)
            touched[request.request_id] = request
        for seq, new_text in zip(to_detokenize, detokenize(self.tokenizer, to_detokenize)):
            stop = find_stop(seq, new_text)
            if stop is not None:
                if seq.finish_reason is None:
                    finished.append(seq)
                seq.finish_reason, seq.stop_reason = "stop", stop
        if catch_up:
            finish(self.tokenizer, [seq for seq, _ in catch_up], [end for _, end in catch_up])
        for seq in finished:
            self.scheduler.finish(seq)
            if finished_only:
                touched[seq.request.request_id] = seq.request
        outputs = [self._output(request) for request in touched.values()
                   if request.finished or not finished_only]
        for request in touched.values():
            if request.finished:
                request.finished_time = now
                del self.requests[request.request_id]
                if request.pooling is not None:
                    self._forget_pooling(request.request_id)
        self.last_step = {"prefill_tokens": total - decode, "decode_tokens": decode,
                          "seconds": time.perf_counter() - start}
        prof.lap("postprocess")
        prof.end("decode" if decode == len(scheduled) else "prefill" if decode == 0 else "mixed",
                 total, len(scheduled))
        return outputs

    def _add_drafts(self, scheduled):
        """Speculative decoding (speculative.py): each eligible decode of ``scheduled`` gets up to
        num_speculative_tokens drafts appended to its tokens, within the step's token budget, its
        max_tokens and max_model_len, and only where its blocks can hold them without preempting.
        Returns the schedule with those sequences feeding 1 + k tokens."""
        budget = self.config.max_num_batched_tokens - sum(n for _, n in scheduled)
        out = []
        for seq, n in scheduled:
            tokens = seq.token_ids
            if (n == 1 and budget > 0 and seq.num_computed_tokens == len(tokens) - 1
                    and seq.num_output_tokens > 0 and speculative.eligible(seq)):
                k = min(self.num_speculative_tokens, budget, seq.params.max_tokens - seq.num_output_tokens - 1,
                        self.max_model_len - len(tokens) - 1)
                if seq.history is None:
                    seq.history = speculative.History()
                drafts = speculative.propose(tokens, k, seq.history) if k > 0 else []
                if drafts and self.block_manager.ensure_slots(seq, len(tokens) + len(drafts)):
                    seq.drafts = drafts
                    tokens.extend(drafts)
                    n += len(drafts)
                    budget -= len(drafts)
            out.append((seq, n))
        return out

    def _verify_drafts(self, scheduled, result):
        """After a step with drafts: each drafting sequence keeps its picked tokens up to and with
        the first that differs from its draft (all of them when every draft stood), its drafts
        leave its tokens, and it counts 1 + accepted tokens as computed. Returns (schedule with
        those counts, result with those tokens)."""
        if not any(seq.drafts for seq, _ in scheduled):
            return scheduled, result
        rows: dict = {}
        for seq, token, logprobs in result.sampled:
            rows.setdefault(seq, []).append((token, logprobs))
        counts, sampled = {}, []
        for seq, picks in rows.items():
            drafts = seq.drafts
            if drafts:
                m = speculative.accepted(drafts, [token for token, _ in picks])
                del seq.token_ids[-len(drafts):]
                seq.drafts = None
                counts[seq] = 1 + m
                picks = picks[:m + 1]
                self.spec_drafted += len(drafts)
                self.spec_accepted += m
            sampled += [(seq, token, logprobs) for token, logprobs in picks]
        scheduled = [(seq, counts.get(seq, n)) for seq, n in scheduled]
        return scheduled, StepResult(sampled, result.prompt_logprobs, result.pooled)

    def _run_ahead(self, current):
        """Async scheduling: launch the decode step that follows ``current`` before current's tokens
        reach the host, so the GPU runs it while the host processes current's tokens. Only when
        that step is known without them: every sequence of current samples, none is waiting to be
        admitted, no sequence reads its tokens on the host to sample (penalties, a min_tokens not yet
        reached, bad words of several tokens, a grammar) or wants logprobs (their host copy would wait for the
        step ahead), and the cache has room for every next token (otherwise the synchronous path
        preempts). Sequences that current's token finishes for certain (max_tokens, max_model_len)
        are left out; one that stops on EOS / a stop id / a stop string costs one dropped token.
        Returns the handle of the step launched, or None."""
        if self.scheduler.waiting or current.prompt_rows or len(current.sample_seqs) != len(current.scheduled):
            return None
        seqs, rows = [], []
        for row, seq in enumerate(current.sample_seqs):
            if seq.finished:
                continue
            p = seq.params
            if p.logprobs is not None or reads_sampled_tokens(seq):
                return None
            length = len(seq.token_ids) + 1  # with current's token
            if length - seq.num_prompt_tokens >= p.max_tokens or length >= self.max_model_len:
                continue
            seqs.append(seq)
            rows.append(row)
        if not seqs or not all(self.block_manager.ensure_slots(seq, len(seq.token_ids) + 1) for seq in seqs):
            return None  # room taken by the sequences before the one that found none stays theirs
        return self.runner.launch_decode_ahead(current, seqs, None if len(rows) == len(current.sample_seqs) else rows)

    def enable_profiling(self) -> StepProfiler:
        """Start timing every step's phases (profiler.py); returns the profiler (its table() and
        report() give mean times per step kind; reset() starts over, e.g. after a warm-up)."""
        self.profiler = self.runner.profiler = StepProfiler(self.device)
        return self.profiler

    def _output(self, request: Request) -> RequestOutput:
        completions = []
        for seq in request.seqs if request.pooling is None else ():
            visible = visible_text_length(seq)
            new_ids = seq.output_token_ids[seq.num_emitted_tokens:]
            new_text = seq.text[seq.num_emitted_chars:visible]
            seq.num_emitted_tokens, seq.num_emitted_chars = seq.num_output_tokens, max(visible, seq.num_emitted_chars)
            completions.append(CompletionOutput(
                index=seq.index, token_ids=seq.output_token_ids, text=seq.text[:visible],
                new_token_ids=new_ids, new_text=new_text,
                logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
                finish_reason=seq.finish_reason, stop_reason=seq.stop_reason))
        return RequestOutput(
            request_id=request.request_id, prompt_token_ids=request.prompt_token_ids, outputs=completions,
            finished=request.finished, prompt=request.prompt_text, num_cached_tokens=request.seqs[0].num_cached_tokens,
            prompt_logprobs=list(request.prompt_logprobs) if request.prompt_logprobs is not None else None,
            metrics={"arrival_time": request.arrival_time, "first_token_time": request.first_token_time,
                     "finished_time": time.time() if request.finished else None},
            embedding=request.embedding)


class LLM:
    """Offline inference: LLM(model_path, **EngineConfig options).generate(...) / .chat(...)."""

    def __init__(self, model: str, **engine_options):
        self.engine = LLMEngine.from_model(model, **engine_options)
        self.tokenizer = self.engine.tokenizer

    def shutdown(self) -> None:
        """Stop the engine's tensor-parallel workers, if any (LLMEngine.shutdown)."""
        self.engine.shutdown()

    def default_sampling_params(self) -> SamplingParams:
        """The checkpoint's generation_config.json defaults (greedy when it sets do_sample False)."""
        return SamplingParams.from_generation_config(self.engine.generation_defaults)

    def generate(self, prompts, sampling_params=None, use_tqdm: bool = True,
                 lora: str | list | None = None, cache_salt: str | None = None) -> list[RequestOutput]:
        """prompts: a str, a list of token ids, or a list of either; sampling_params: one for all
        or a list (one per prompt); lora: a loaded LoRA adapter's name for all, or a list (one per
        prompt, None for the base model); cache_salt: LLMEngine.add_request's, for all.
        Returns finished RequestOutputs in prompt order.
        Raises ValueError for a bad prompt, parameter or adapter before any request runs."""
        prompts = _prompt_list(prompts)
        if sampling_params is None:
            sampling_params = self.default_sampling_params()
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        adapters = lora if isinstance(lora, list) else [lora] * len(prompts)
        if len(adapters) != len(prompts):
            raise ValueError(f"{len(adapters)} LoRA names for {len(prompts)} prompts")
        engine = self.engine
        base = f"generate-{time.monotonic_ns()}-"
        ids = [f"{base}{i}" for i in range(len(prompts))]
        try:
            for request_id, prompt, p, adapter in zip(ids, prompts, params, adapters):
                engine.add_request(request_id, prompt, p, lora=adapter, cache_salt=cache_salt)
        except ValueError:
            for request_id in ids:
                engine.abort_request(request_id)
            raise
        return self._run(ids, use_tqdm)

    def chat(self, messages, sampling_params=None, use_tqdm: bool = True,
             add_generation_prompt: bool = True, chat_template_kwargs: dict | None = None,
             tools: list[dict] | None = None, lora: str | list | None = None) -> list[RequestOutput]:
        """messages: one conversation ([{"role", "content"}, ...]) or a list of them; each is rendered
        with the chat template (chat_template_kwargs: more variables for it, e.g. Qwen3's
        enable_thinking; tools: OpenAI-style function tools, the template's ``tools``; lora: as in
        generate) and encoded
        without adding special tokens (the template has them). The answers' tool calls can be read
        with tileattn.engine.tool_calls.PARSERS[name].parse(text).
        Raises ValueError for chat_template_kwargs that are not a dict of new variables, or tools
        that are not a list (or that chat_template_kwargs also sets)."""
        reserved = TEMPLATE_VARIABLES | ({"tools"} if tools is not None else set())
        if chat_template_kwargs is not None and (not isinstance(chat_template_kwargs, dict)
                                                 or reserved & set(chat_template_kwargs)):
            raise ValueError(f"chat_template_kwargs must be a dict of variables other than {sorted(reserved)} "
                             f"(apply_chat_template sets those), got {chat_template_kwargs!r}")
        if tools is not None and not isinstance(tools, list):
            raise ValueError(f"tools must be a list of tool dicts, got {type(tools).__name__}")
        variables = {**(chat_template_kwargs or {}), **({"tools": tools} if tools is not None else {})}
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.encode(self.tokenizer.apply_chat_template(c, add_generation_prompt, **variables),
                                         add_special_tokens=False) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm, lora=lora)

    def embed(self, prompts, pooling_params: PoolingParams | None = None,
              use_tqdm: bool = True, lora: str | list | None = None) -> list[RequestOutput]:
        """Embeddings of prompts (a str, a list of token ids, or a list of either): the final hidden
        state of each prompt's last token, normalised unless pooling_params says otherwise
        (PoolingParams); lora: as in generate. Returns finished RequestOutputs in prompt order, each
        with .embedding.
        Raises ValueError for a bad prompt or parameter before any request runs."""
        prompts = _prompt_list(prompts)
        return self.generate(prompts, [pooling_params or PoolingParams()] * len(prompts), use_tqdm, lora=lora)

    def beam_search(self, prompts, beam_width: int, max_tokens: int, ignore_eos: bool = False,
                    length_penalty: float = 1.0, lora: str | None = None) -> list[list[BeamSearchSequence]]:
        """Beam search (beam_search.py): per prompt the beam_width best answers of up to max_tokens
        tokens, best first. Raises ValueError for beam_width outside 1..10, max_tokens < 1 or a bad prompt."""
        prompts = [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in _prompt_list(prompts)]
        search = BeamSearch(prompts, beam_width, max_tokens, self.engine.eos_token_ids, ignore_eos, length_penalty)
        while pending := search.pending():
            outs = self.generate(pending, search.step_params, use_tqdm=False, lora=lora)
            search.advance([out.outputs[0].logprobs[0] for out in outs])
        return search.answers(self.tokenizer.decode)

    def _run(self, ids, use_tqdm) -> list[RequestOutput]:
        engine = self.engine
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(ids), desc="generate", dynamic_ncols=True)
        wanted = set(ids)
        prefill_rate = decode_rate = 0.0
        while wanted - done.keys():
            for out in engine.step(finished_only=True):
                if out.request_id in wanted:
                    done[out.request_id] = out
                    if bar is not None:
                        bar.update(1)
            if bar is not None:
                step = engine.last_step
                seconds = max(step["seconds"], 1e-9)
                if step["prefill_tokens"]:
                    prefill_rate = step["prefill_tokens"] / seconds
                if step["decode_tokens"]:
                    decode_rate = step["decode_tokens"] / seconds
                bar.set_postfix_str(f"prefill {prefill_rate:,.0f} tok/s, decode {decode_rate:,.0f} tok/s",
                                    refresh=False)
        if bar is not None:
            bar.close()
        return [done[i] for i in ids]


def _prompt_list(prompts) -> list:
    """One prompt (a str or a list of token ids) as a list of one; a list of prompts as it is."""
    if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        return [prompts]
    return prompts
