"""OpenAI-compatible HTTP server on the engine's streaming step API (`tileattn serve`).

Two threads share the process. uvicorn's asyncio event loop parses HTTP, validates requests,
tokenizes prompts and writes responses; one engine thread (EngineLoop) calls ``engine.step()`` for
as long as any request is unfinished, so requests that arrive while others run join the next step
(continuous batching across HTTP requests). The engine is only ever touched from its own thread:
the event loop hands it work as commands (add, abort, stats) that run between two steps, and the
engine thread hands each step's outputs back with one ``loop.call_soon_threadsafe`` per step, which
routes them onto per-HTTP-request asyncio queues.

Endpoints: POST /v1/completions, POST /v1/chat/completions, POST /v1/responses (responses.py; all
with ``stream``), POST /v1/embeddings (embeddings.py), GET /v1/models,
GET /health, GET /metrics (Prometheus text), POST /tokenize, POST /detokenize. Errors use OpenAI's
body ``{"error": {"message", "type", "param", "code"}}``. A client that disconnects aborts its
engine requests at once (their KV blocks are freed before the next step).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import dataclasses
import hmac
import json
import logging
import os
import re
import sys
import threading
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from .beam_search import BeamSearch
from .sampling_params import PoolingParams, SamplingParams
from .tokenizer import TEMPLATE_VARIABLES
from .harmony import HarmonyParser, answers_in_harmony
from .reasoning import PARSERS as REASONING_PARSERS
from .reasoning import ReasoningParser
from .reasoning import get_parser as get_reasoning_parser
from .tool_calls import NOT_A_CALL, PARSERS, HarmonyCallsParser, get_parser

log = logging.getLogger("tileattn.serve")

# Seconds; TTFT spans queueing + prefill, ITL one decode step (ms on a GPU, more on CPU).
_TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.2,
                0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
_E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                60.0, 120.0, 240.0, 480.0)


# ---------------------------------------------------------------------------------------------
# Errors


class APIError(Exception):
    """An error answered with OpenAI's error body and ``status``."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, type_: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type_ or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


class EngineDeadError(RuntimeError):
    """The engine thread stopped (shutdown, or step() raised): no request can make progress."""


class BodyLimit:
    """ASGI middleware: a request body longer than ``limit`` bytes gets a 413 before the JSON
    parser sees it (a declared Content-Length at once; a chunked body when its bytes pass the
    limit), so one oversized request cannot fill the server's memory or hold the event loop,
    which every stream shares, while it is parsed."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    def _error(self) -> APIError:
        return APIError(413, f"The request body is longer than the server's limit of {self.limit} bytes "
                             "(tileattn serve --max-request-bytes).", code="request_too_large")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await self._error().response()(scope, receive, send)
        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    # FastAPI re-raises an HTTPException from reading the body: the handler answers 413
                    raise StarletteHTTPException(413, self._error().message)
            return message

        await self.app(scope, limited_receive, send)


# ---------------------------------------------------------------------------------------------
# The engine thread


@dataclasses.dataclass(frozen=True)
class ChoiceDelta:
    """What one step added to one of a request's n completions (copied in the engine thread, so
    the event loop never reads engine objects the next step mutates)."""

    index: int
    token_ids: list[int]                       # new this step
    text: str                                  # new this step
    logprobs: list[dict[int, float]] | None    # one dict per new token, when asked
    finish_reason: str | None
    stop_reason: int | str | None
    final: tuple | None                        # (text, token_ids, logprobs) of the whole output, once finished


@dataclasses.dataclass(frozen=True)
class StepOutput:
    request_id: str
    choices: list[ChoiceDelta]
    finished: bool
    prompt_logprobs: list | None               # with the first output of a request, when asked
    num_cached_tokens: int | None = None       # prompt tokens the prefix cache held (None: not scheduled yet)
    embedding: list[float] | None = None       # an embedding request's vector, with its (only) output


def _snapshot(out) -> StepOutput:
    choices = []
    for c in out.outputs:
        new = list(c.new_token_ids)
        logprobs = None
        if c.logprobs is not None:
            logprobs = list(c.logprobs[len(c.logprobs) - len(new):]) if new else []
        final = None
        if c.finish_reason is not None:
            final = (c.text, list(c.token_ids), None if c.logprobs is None else list(c.logprobs))
        choices.append(ChoiceDelta(c.index, new, c.new_text, logprobs, c.finish_reason,
                                   c.stop_reason, final))
    prompt_logprobs = getattr(out, "prompt_logprobs", None)
    return StepOutput(out.request_id, choices, out.finished,
                      None if prompt_logprobs is None else list(prompt_logprobs), out.num_cached_tokens,
                      out.embedding)


class EngineLoop:
    """Runs ``engine.step()`` in a background thread while any request is unfinished.

    ``add`` / ``abort`` / ``call(fn)`` queue work that runs on that thread between two steps and
    return a concurrent.futures.Future; ``on_outputs(list[StepOutput], t_step_end)`` and
    ``on_error(exc)`` are called on the asyncio ``loop`` (via call_soon_threadsafe).
    ``stats`` is the engine's stats() dict as of the last step or command (read without locking:
    the engine thread replaces the whole dict). ``stop()`` aborts every request this loop added
    that has not finished, so the engine is left empty.
    """

    def __init__(self, engine, loop: asyncio.AbstractEventLoop, on_outputs, on_error):
        self.engine = engine
        self.stats: dict = engine.stats()
        self.error: BaseException | None = None
        self._loop, self._on_outputs, self._on_error = loop, on_outputs, on_error
        self._cond = threading.Condition()
        self._commands: list[tuple[Any, concurrent.futures.Future]] = []
        self._stopping = False
        self._busy = False
        self._live: set[str] = set()  # added through this loop, not finished or aborted (engine thread only)
        self._thread = threading.Thread(target=self._run, name="tileattn-engine", daemon=True)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None and not self._stopping

    @property
    def running(self) -> bool:
        """The thread has not exited (stop() joins it)."""
        return self._thread.is_alive()

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Finish the current step, abort everything left, join the thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.error("engine thread did not stop within %.0f s", timeout)

    def add(self, requests: list[tuple[str, list[int]]], params: SamplingParams | PoolingParams,
            options: dict | None = None) -> concurrent.futures.Future:
        """Add (request_id, prompt ids) pairs all or none (``options``: add_request's lora, cache_salt,
        priority): if the engine refuses one (ValueError), the ones already added are aborted and the
        future raises that error."""
        def add_all(engine):
            added = []
            try:
                for rid, prompt in requests:
                    engine.add_request(rid, prompt, params, **(options or {}))
                    added.append(rid)
            except BaseException:
                for rid in added:
                    engine.abort_request(rid)
                raise
            self._live.update(added)

        return self.call(add_all)

    def abort(self, request_ids: list[str]) -> concurrent.futures.Future:
        def abort_all(engine):
            for rid in request_ids:
                engine.abort_request(rid)
                self._live.discard(rid)

        return self.call(abort_all)

    def call(self, fn) -> concurrent.futures.Future:
        """Run fn(engine) on the engine thread between two steps; its result or exception lands
        in the returned future (EngineDeadError when the loop stopped)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            if self._stopping or self.error is not None:
                fut.set_exception(EngineDeadError("the engine is not running"))
                return fut
            self._commands.append((fn, fut))
            self._cond.notify()
        return fut

    def _run(self) -> None:
        engine = self.engine
        try:
            device = getattr(engine, "device", None)
            if getattr(device, "type", None) == "cuda":
                import torch

                # torch's current device is per thread (default cuda:0), and tileattn's launcher
                # takes the current device; this also makes the device's primary context current here.
                torch.cuda.set_device(device)
            while True:
                with self._cond:
                    while not (self._commands or self._stopping or self._busy):
                        self._cond.wait()
                    commands, self._commands = self._commands, []
                    stopping = self._stopping
                for fn, fut in commands:
                    if stopping:
                        fut.set_exception(EngineDeadError("the server is shutting down"))
                    elif fut.set_running_or_notify_cancel():
                        try:
                            fut.set_result(fn(engine))
                        except Exception as exc:  # noqa: BLE001 - the caller gets it; the engine is unharmed
                            fut.set_exception(exc)
                if stopping:
                    for rid in self._live:
                        engine.abort_request(rid)
                    self._live.clear()
                    break
                outputs = engine.step() if engine.has_unfinished_requests() else []
                t_end = time.monotonic()
                steps = [_snapshot(o) for o in outputs]
                self._live.difference_update(o.request_id for o in steps if o.finished)
                self._busy = engine.has_unfinished_requests()
                self.stats = engine.stats()
                if steps:
                    self._loop.call_soon_threadsafe(self._on_outputs, steps, t_end)
        except BaseException as exc:
            log.exception("engine step failed; the server stops serving")
            self.error = exc
            with self._cond:
                commands, self._commands = self._commands, []
            for _, fut in commands:
                fut.set_exception(EngineDeadError(f"engine failed: {exc!r}"))
            with contextlib.suppress(RuntimeError):  # loop already closed at shutdown
                self._loop.call_soon_threadsafe(self._on_error, exc)


# ---------------------------------------------------------------------------------------------
# Requests (bodies); unknown fields are accepted and ignored, as vLLM and OpenAI do, except those
# that would change the answer and that this server cannot honour (_refuse_unsupported).


class RequestBody(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(RequestBody):
    include_usage: bool = False


class SamplingRequest(RequestBody):
    model: str | None = None
    n: int = Field(1, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)            # vLLM extra body field
    min_p: float | None = Field(None, ge=0, le=1)     # vLLM extra body field
    repetition_penalty: float | None = Field(None, gt=0)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None        # token id (as a JSON key) -> bias in [-100, 100]
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    min_tokens: int = Field(0, ge=0)                  # vLLM extra body field
    include_stop_str_in_output: bool = False          # vLLM extra body field
    allowed_token_ids: list[int] | None = None        # vLLM extra body field
    truncate_prompt_tokens: int | None = Field(None, ge=1)  # vLLM extra: keep the prompt's last k tokens
    bad_words: list[str] | None = None                # vLLM extra body field
    prompt_logprobs: int | None = Field(None, ge=0, le=20)  # vLLM extra: per prompt token, non-streamed
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs and guided_* extras
    response_format: dict | None = None
    structured_outputs: dict | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False                    # vLLM extra: token ids beside the text
    cache_salt: str | None = Field(None, min_length=1)  # vLLM extra: prefix-cache blocks shared only under the same salt
    priority: int = 0                                 # vLLM extra: lower runs first (--scheduling-policy priority)


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    use_beam_search: bool = False                     # vLLM extra: n beams, the n best answers (beam_search.py)
    length_penalty: float = 1.0                       # vLLM extra: beam answers ranked by sum / length^this
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=20)
    best_of: int | None = None
    suffix: str | None = None


class ChatMessage(RequestBody):
    role: str
    content: str | list[dict] | None = None
    tool_calls: list[dict] | None = None   # an assistant message's calls (OpenAI's shape)
    tool_call_id: str | None = None        # a tool message: the call it answers
    name: str | None = None
    reasoning_content: str | None = None   # an assistant message's reasoning, as this server returns it


class ChatRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True                # vLLM extra body field
    continue_final_message: bool = False              # vLLM extra: the answer continues the last message
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM extra: more variables for the template
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None             # "auto" (default with tools), "none", "required" or a function
    parallel_tool_calls: bool | None = None


class LoRAAdapterRequest(RequestBody):
    lora_name: str = Field(..., min_length=1)
    lora_path: str | None = None


async def _engine_call(state: ServerState, fn, param: str | None = None):
    """fn(engine) on the engine thread, between two steps; its ValueError or FileNotFoundError is a
    400 naming ``param``."""
    if state.engine_loop is None or not state.engine_loop.alive:
        raise APIError(503, "The engine is not running.", code="engine_unavailable")
    try:
        return await asyncio.wrap_future(state.engine_loop.call(fn))
    except (ValueError, FileNotFoundError) as exc:
        raise APIError(400, str(exc), param=param) from None


class TokenizeRequest(RequestBody):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[dict] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(RequestBody):
    model: str | None = None
    tokens: list[int]


# ---------------------------------------------------------------------------------------------
# Server state shared by the endpoints


class _Metrics:
    """Prometheus metrics in a registry of their own (one per app, so tests can build several)."""

    def __init__(self, state: ServerState):
        self.registry = CollectorRegistry()
        r = self.registry
        self.prompt_tokens = Counter("tileattn:prompt_tokens", "Prompt tokens of admitted requests.", registry=r)
        self.generation_tokens = Counter("tileattn:generation_tokens", "Tokens generated.", registry=r)
        self.requests = Counter("tileattn:request_success", "Finished completions (choices) by finish reason.",
                                ["finished_reason"], registry=r)
        self.rejected = Counter("tileattn:request_rejected", "Requests refused with 503 (queue full).",
                                registry=r)
        self.ttft = Histogram("tileattn:time_to_first_token_seconds", "Arrival to first token.",
                              buckets=_TTFT_BUCKETS, registry=r)
        self.itl = Histogram("tileattn:inter_token_latency_seconds", "Time between two tokens of a stream.",
                             buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("tileattn:e2e_request_latency_seconds", "Arrival to last token.",
                             buckets=_E2E_BUCKETS, registry=r)
        r.register(_EngineCollector(state))


class _EngineCollector:
    """Gauges and counters read from the engine's last stats() at scrape time."""

    def __init__(self, state: ServerState):
        self.state = state

    def describe(self):
        return []

    def collect(self):
        s = self.state.engine_loop.stats if self.state.engine_loop is not None else self.state.engine.stats()
        for name, key, doc in (("num_requests_running", "num_running", "Requests in the running batch."),
                               ("num_requests_waiting", "num_waiting", "Requests waiting for the batch."),
                               ("kv_cache_usage_perc", "kv_cache_usage", "Fraction of KV-cache blocks in use.")):
            yield GaugeMetricFamily(f"tileattn:{name}", doc, value=float(s.get(key, 0)))
        yield GaugeMetricFamily("tileattn:num_requests_in_flight", "Requests admitted by the server, unfinished.",
                                value=float(self.state.in_flight))
        for name, key, doc in (("prefix_cache_hits", "prefix_cache_hits", "Prefix-cache hits (engine's unit)."),
                               ("prefix_cache_queries", "prefix_cache_queries", "Prefix-cache lookups."),
                               ("num_preemptions", "num_preemptions", "Sequences preempted (recomputed later)."),
                               ("spec_decode_num_draft_tokens", "spec_drafted_tokens",
                                "Prompt-lookup draft tokens proposed (--num-speculative-tokens)."),
                               ("spec_decode_num_accepted_tokens", "spec_accepted_tokens",
                                "Draft tokens the model's argmax accepted.")):
            yield CounterMetricFamily(f"tileattn:{name}", doc, value=float(s.get(key, 0)))


class ServerState:
    """The engine, its thread, the open generations and the metrics of one app."""

    def __init__(self, engine, served_model_name: str, max_queue_depth: int, tool_call_parser: str | None,
                 reasoning_parser: str | None):
        self.engine = engine
        self.served_model_name = served_model_name
        self.max_queue_depth = max_queue_depth
        if tool_call_parser is None and reasoning_parser is None and answers_in_harmony(engine):
            tool_call_parser, reasoning_parser = HarmonyCallsParser.name, HarmonyParser.name  # harmony answers
        harmony = reasoning_parser == HarmonyParser.name
        if tool_call_parser == HarmonyCallsParser.name and not harmony or harmony and tool_call_parser not in (
                None, HarmonyCallsParser.name):
            raise ValueError(f"tool-call parser {tool_call_parser!r} with reasoning parser {reasoning_parser!r}: gpt-oss's "
                             f"harmony answers are read by {HarmonyCallsParser.name!r} and {HarmonyParser.name!r} together")
        self.tool_parser = get_parser(tool_call_parser) if tool_call_parser is not None else None
        self.reasoning_parser = get_reasoning_parser(reasoning_parser) if reasoning_parser is not None else None
        self.harmony = harmony  # answers decoded with their special tokens, read by the harmony parser
        self.tokenizer = engine.tokenizer
        self.lora_names: list[str] = engine.lora_names  # served beside the model, by their names
        # adapters held by requests that run as several engine requests one after another (beam
        # search): between two of them the engine sees none, so the unload endpoint asks here too
        self.lora_pins: dict[str, int] = {}
        self.max_model_len: int = engine.max_model_len
        self.defaults: dict = dict(engine.generation_defaults or {})
        self.engine_loop: EngineLoop | None = None
        self.generations: dict[str, Generation] = {}  # engine request id -> its generation
        self.in_flight = 0                               # engine requests admitted, unfinished
        self.created = int(time.time())
        self.metrics = _Metrics(self)
        self._token_text: dict[int, str] = {}

    # event-loop thread only
    def deliver(self, steps: list[StepOutput], t_end: float) -> None:
        """Event loop: route one engine step's outputs to their generations."""
        tokens = 0
        for step in steps:
            tokens += sum(len(c.token_ids) for c in step.choices)
            gen = self.generations.get(step.request_id)
            if gen is not None:
                gen.receive(step, t_end)
        self.metrics.generation_tokens.inc(tokens)  # once per step: a locked increment per token costs

    def fail_all(self, exc: BaseException) -> None:
        for gen in list(self.generations.values()):
            gen.queue.put_nowait(EngineDeadError(f"engine failed: {exc!r}"))

    def token_text(self, token_id: int) -> str:
        """One token decoded on its own (logprob entries); cached, the vocabulary is finite."""
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def check_model(self, name: str | None) -> str | None:
        """The LoRA adapter a request's ``model`` names (None: the served model itself); 404 for
        anything else."""
        if name is None or name == self.served_model_name:
            return None
        if name in self.lora_names:
            return name
        raise APIError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")


class Generation:
    """The engine requests behind one HTTP request (one per prompt, each with n completions, or
    each an embedding with PoolingParams) and the asyncio queue their step outputs arrive on.
    ``close()`` aborts whatever is unfinished."""

    def __init__(self, state: ServerState, prefix: str, prompts: list[list[int]],
                 params: SamplingParams | PoolingParams, arrival: float, lora: str | None = None,
                 req: RequestBody | None = None):
        """lora: the adapter the request's model names; req: the body whose cache_salt and priority
        (vLLM's extras) reach the engine."""
        self.state, self.params, self.arrival, self.lora = state, params, arrival, lora
        self.options = {"lora": lora, "cache_salt": getattr(req, "cache_salt", None),
                        "priority": getattr(req, "priority", 0)}
        self.prompts = prompts
        self.ids = [f"{prefix}-{i}" for i in range(len(prompts))]
        self.queue: asyncio.Queue = asyncio.Queue()
        self.unfinished = set(self.ids)
        self._last_token_time: dict[str, float] = {}
        self._reported: set[tuple[str, int]] = set()  # (request id, choice) whose finish went out
        self.cached_tokens: dict[str, int] = {}  # engine request id -> prompt tokens found in the prefix cache
        self._admitted = False
        self._closed = False

    async def start(self) -> None:
        """Admit (503 when the queue is full) and add the requests to the engine; ValueError from
        the engine (a bad request) -> 400, with nothing left behind."""
        state = self.state
        if state.engine_loop is None or not state.engine_loop.alive:
            raise APIError(503, "The engine is not running.", code="engine_unavailable")
        if state.in_flight + len(self.ids) > state.max_queue_depth:
            state.metrics.rejected.inc()
            raise APIError(503, f"The server is overloaded: {state.in_flight} requests in flight "
                                f"(--max-queue-depth {state.max_queue_depth}). Retry later.",
                           code="overloaded")
        state.in_flight += len(self.ids)
        self._admitted = True
        for rid in self.ids:
            state.generations[rid] = self
        try:
            await asyncio.wrap_future(state.engine_loop.add(list(zip(self.ids, self.prompts)), self.params, self.options))
        except ValueError as exc:  # the engine's checks against the model (vocabulary, length)
            self.unfinished.clear()
            self.close()
            raise APIError(400, str(exc), param=_sampling_param(exc)) from None
        except EngineDeadError as exc:
            self.unfinished.clear()
            self.close()
            raise APIError(503, str(exc), code="engine_unavailable") from None
        except BaseException:
            self.close()
            raise
        state.metrics.prompt_tokens.inc(sum(len(p) for p in self.prompts))

    def receive(self, step: StepOutput, t_end: float) -> None:
        """Event loop: metrics, then hand the step to whoever reads the queue. A choice that
        finished earlier (n > 1: the engine keeps listing it) is dropped, so each finish is seen once."""
        m = self.state.metrics
        choices = []
        for c in step.choices:
            key = (step.request_id, c.index)
            if key in self._reported:
                continue
            if c.finish_reason is not None:
                self._reported.add(key)
                m.requests.labels(c.finish_reason).inc()
            choices.append(c)
        step = dataclasses.replace(step, choices=choices)
        if step.num_cached_tokens is not None:
            self.cached_tokens[step.request_id] = step.num_cached_tokens
        new = sum(len(c.token_ids) for c in choices)
        if new:
            last = self._last_token_time.get(step.request_id)
            if last is None:
                m.ttft.observe(t_end - self.arrival)
            else:
                m.itl.observe(t_end - last)
            self._last_token_time[step.request_id] = t_end
        if step.finished:
            self.unfinished.discard(step.request_id)
            m.e2e.observe(t_end - self.arrival)
        self.queue.put_nowait(step)

    async def steps(self):
        """Yield lists of StepOutput (everything queued so far, so a slow reader catches up in one
        write) until every request finished. Raises EngineDeadError if the engine stops."""
        while self.unfinished or not self.queue.empty():
            items = [await self.queue.get()]
            while not self.queue.empty():
                items.append(self.queue.get_nowait())
            for item in items:
                if isinstance(item, BaseException):
                    raise item
            yield items

    async def finals(self) -> dict[str, StepOutput]:
        """Wait for the end; the last StepOutput of each request, plus prompt logprobs."""
        last: dict[str, list[ChoiceDelta | None]] = {rid: [None] * self.params.n for rid in self.ids}
        prompt_logprobs: dict[str, list | None] = {}
        async for items in self.steps():
            for step in items:
                if step.prompt_logprobs is not None:
                    prompt_logprobs[step.request_id] = step.prompt_logprobs
                for c in step.choices:
                    if c.final is not None and last[step.request_id][c.index] is None:
                        last[step.request_id][c.index] = c
        return {rid: StepOutput(rid, choices, True, prompt_logprobs.get(rid))
                for rid, choices in last.items()}

    async def embeddings(self) -> dict[str, list[float]]:
        """Wait for the end of embedding requests; request id -> its vector."""
        vectors = {}
        async for items in self.steps():
            for step in items:
                if step.embedding is not None:
                    vectors[step.request_id] = step.embedding
        return vectors

    def close(self) -> None:
        """Abort unfinished requests (frees their KV blocks before the engine's next step)."""
        if self._closed:
            return
        self._closed = True
        state = self.state
        for rid in self.ids:
            state.generations.pop(rid, None)
        if self._admitted:
            state.in_flight -= len(self.ids)
        pending = [rid for rid in self.ids if rid in self.unfinished]
        if pending and state.engine_loop is not None:
            state.engine_loop.abort(pending)
            log.info("aborted %d request(s) of a closed connection: %s", len(pending), pending)


# ---------------------------------------------------------------------------------------------
# Request -> engine inputs


def _structured_spec(req: SamplingRequest) -> tuple[dict | None, str | None]:
    """(the SamplingParams.structured_outputs spec, the request field it came from) of OpenAI's
    response_format or vLLM's structured_outputs / guided_* fields; (None, None) when none is set.
    400 for more than one, or for a response_format that is not text, json_object or json_schema."""
    given = {name: getattr(req, name) for name in ("response_format", "structured_outputs", "guided_json",
                                                   "guided_regex", "guided_choice", "guided_grammar")
             if getattr(req, name) is not None}
    if given.get("response_format", {}).get("type") == "text":
        del given["response_format"]
    if len(given) > 1:
        raise APIError(400, f"Give one way of structuring the output, got {sorted(given)}.", param=sorted(given)[1])
    if not given:
        return None, None
    (name, value), = given.items()
    if name == "response_format":
        kind = value.get("type")
        if kind == "json_object":
            return {"json_object": True}, name
        if kind == "json_schema" and isinstance(value.get("json_schema"), dict) and "schema" in value["json_schema"]:
            return {"json": value["json_schema"]["schema"]}, name
        raise APIError(400, "response_format must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                            "{\"type\": \"json_schema\", \"json_schema\": {\"name\": ..., \"schema\": {...}}}.",
                       param=name)
    if name == "structured_outputs":
        return {kind: v for kind, v in value.items() if v is not None}, name  # vLLM sends unset kinds as null
    return {name.removeprefix("guided_"): value}, name


async def _prepare_grammar(state: ServerState, params: SamplingParams) -> None:
    """Compile a structured-output request's grammar in a worker thread (the engine caches it), so
    the engine thread, which every request shares, only copies it; 400 for an invalid one."""
    if params.structured_outputs is not None:
        try:
            await asyncio.to_thread(state.engine.grammars.prepare, params.structured_outputs)
        except ValueError as exc:
            raise APIError(400, str(exc), param="structured_outputs") from None


@contextlib.contextmanager
def _structured_errors_named(source: str | None):
    """A 400 about the structured_outputs spec (its checks in SamplingParams, its compilation in the
    engine) names the request field the spec came from."""
    try:
        yield
    except APIError as exc:
        if exc.param == "structured_outputs" and source is not None:
            exc.param = source
        raise


# The longest request body the server reads (tileattn serve --max-request-bytes): a prompt of a 128k-token
# context is about 0.5 MB of text or 1 MB of token ids in JSON, so the default leaves room for batches of
# long prompts while a body that would take seconds to parse (or GBs to hold) is refused unread.
DEFAULT_MAX_REQUEST_BYTES = 64 << 20

# The most entries a request's lists may hold (docs/server.md, "Sampling parameters"): each entry costs
# host work on every step of the request (stop strings searched in the new text, stop ids and bad
# words looked up, logit_bias and allowed ids sent to the device) or on the engine thread, which all
# requests share, when it is admitted (bad words tokenized). Beyond them a 400, never a truncation.
# OpenAI takes at most 4 stop strings; vLLM sets no bound.
REQUEST_LIST_LIMITS = {"stop": 64, "bad_words": 256, "stop_token_ids": 4096, "allowed_token_ids": 4096,
                       "logit_bias": 4096}
# The longest stop string or bad word, in characters: a stop string holds back that many characters
# of a streamed answer, and each step searches them again.
MAX_STRING_CHARS = 1024


def _check_list_limits(req: SamplingRequest) -> None:
    """400 naming the field for a list (stop, bad_words, stop_token_ids, allowed_token_ids,
    logit_bias) longer than REQUEST_LIST_LIMITS allows, or a stop string or bad word longer than
    MAX_STRING_CHARS."""
    for name, cap in REQUEST_LIST_LIMITS.items():
        value = getattr(req, name)
        items = [value] if isinstance(value, str) else value or ()
        if len(items) > cap:
            raise APIError(400, f"{name} has {len(items)} entries; at most {cap} are allowed.", param=name)
        if name in ("stop", "bad_words"):
            for i, text in enumerate(items):
                if isinstance(text, str) and len(text) > MAX_STRING_CHARS:
                    raise APIError(400, f"{name}[{i}] has {len(text)} characters; at most {MAX_STRING_CHARS} are "
                                        "allowed.", param=name)


def _sampling_params(state: ServerState, req: SamplingRequest, max_tokens: int,
                     logprobs: int | None, prompt_logprobs: int | None, stop_after: str | None = None,
                     structured: dict | None = None, grammar_after: str | None = None,
                     keep_special_tokens: bool = False, grammar_after_open: str | None = None,
                     thinking: str | None = None) -> SamplingParams:
    """stop_after: one more stop string (the tool-call parser's, for parallel_tool_calls: false),
    searched only after the thinking block that the reasoning parser named `thinking` reads (None:
    in the whole answer);
    structured: the structured_outputs spec (_structured_spec, or the one that forces a tool call);
    grammar_after: where that grammar starts (the reasoning's end tag: the model thinks freely first);
    grammar_after_open: the reasoning's opening tag where its block is optional (the first token decides);
    keep_special_tokens: the text keeps them whatever the request says (a harmony answer's markers,
    which its parser reads and removes)."""
    _check_list_limits(req)
    overrides = {k: getattr(req, k) for k in (
        "n", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
        "frequency_penalty", "seed", "stop", "stop_token_ids", "min_tokens", "include_stop_str_in_output",
        "allowed_token_ids", "bad_words", "ignore_eos", "skip_special_tokens")
        if getattr(req, k) is not None}
    if structured is not None:
        overrides["structured_outputs"] = structured
        overrides["grammar_after"] = grammar_after
        overrides["grammar_after_open"] = grammar_after_open if grammar_after is not None else None
    if keep_special_tokens:
        overrides["skip_special_tokens"] = False
    if stop_after is not None:
        overrides["content_stop"], overrides["reasoning"] = [stop_after], thinking
    if overrides.get("stop") == []:
        del overrides["stop"]
    if req.logit_bias is not None:
        try:
            overrides["logit_bias"] = {int(token): bias for token, bias in req.logit_bias.items()}
        except ValueError:
            raise APIError(400, f"logit_bias keys must be token ids (integers), got {list(req.logit_bias)[:4]}",
                           param="logit_bias") from None
    try:
        return SamplingParams.from_generation_config(
            state.defaults, max_tokens=max_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            **overrides)
    except ValueError as exc:
        raise APIError(400, str(exc), param=_sampling_param(exc)) from None


_SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))


def _sampling_param(exc: ValueError) -> str | None:
    """The SamplingParams field a ValueError names (SamplingParams' messages and the engine's checks
    of token ids against the vocabulary start with it), else None."""
    name = re.split(r"[ \[:]", str(exc), maxsplit=1)[0]  # "structured_outputs['json'] is ...": the field
    return name if name in _SAMPLING_FIELDS else None


def _truncated(req: SamplingRequest, ids: list[int]) -> list[int]:
    """The prompt the engine gets: its last truncate_prompt_tokens tokens (vLLM's), or all of it."""
    return ids[-req.truncate_prompt_tokens:] if req.truncate_prompt_tokens else ids


def _check_length(state: ServerState, prompt_len: int, max_tokens: int | None, what: str) -> int:
    """The max_tokens to use; 400 when the prompt (plus max_tokens) does not fit the context."""
    limit = state.max_model_len
    if prompt_len >= limit:
        raise APIError(400, f"This model's maximum context length is {limit} tokens. However, your "
                            f"{what} has {prompt_len} tokens, leaving no room for a completion. "
                            f"Please reduce the length of the {what}.",
                       param=what, code="context_length_exceeded")
    if max_tokens is None:
        return limit - prompt_len
    if prompt_len + max_tokens > limit:
        raise APIError(400, f"This model's maximum context length is {limit} tokens. However, you "
                            f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the {what}, "
                            f"{max_tokens} in the completion). Please reduce the length of the {what} "
                            f"or completion.", param="max_tokens", code="context_length_exceeded")
    return max_tokens


def prompt_token_ids(state: ServerState, prompt, field: str = "prompt") -> list[list[int]]:
    """prompt: str | list[str] | list[int] | list[list[int]] -> token-id lists (a 400 naming
    ``field`` for an empty one). The endpoints call it, as _chat_prompt, in a worker thread: the
    tokenizer runs without the GIL there (Tokenizer.encode), so a long prompt does not hold up the
    event loop, which streams every other request's tokens."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise APIError(400, f"{field} must not be empty.", param=field)
    if isinstance(prompt[0], int):
        prompt = [prompt]
    out = []
    for p in prompt:
        ids = _encoded(state, p, field, add_special_tokens=True) if isinstance(p, str) else list(p)
        if not ids:
            raise APIError(400, f"{field} must not be empty.", param=field)
        out.append(ids)  # the engine checks the ids against the model's vocabulary
    return out


def _chat_tools(state: ServerState, req: ChatRequest):
    """(the tools to render, the parser of the answer, the structured_outputs spec that forces
    calls or None) for a chat request: (None, None, None) without tools or with tool_choice "none"
    (the model is not shown them). tool_choice "required" or {"type": "function", "function":
    {"name": ...}} holds the answer to calls in the parser's format (all tools / the named one; with
    "required" one or more unless parallel_tool_calls is false). 400 for another tool_choice, for
    tools on a server started without a tool-call parser, and for tools the model's template does
    not render."""
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none"):
            raise APIError(400, "tool_choice needs tools.", param="tool_choice")
        if req.parallel_tool_calls is not None:
            raise APIError(400, "parallel_tool_calls needs tools.", param="parallel_tool_calls")
        return None, None, None
    _check_tool_schemas(req.tools)
    named = None
    if isinstance(choice, dict):
        function = choice.get("function")
        named = function.get("name") if choice.get("type") == "function" and isinstance(function, dict) else None
        if not isinstance(named, str):
            raise APIError(400, "tool_choice must be \"none\", \"auto\", \"required\" or "
                                "{\"type\": \"function\", \"function\": {\"name\": ...}}.", param="tool_choice")
    elif choice not in (None, "auto", "none", "required"):
        raise APIError(400, f"tool_choice must be \"none\", \"auto\", \"required\" or a function, got {choice!r}.",
                       param="tool_choice")
    if choice == "none":
        return None, None, None
    parser = state.tool_parser
    if parser is None:
        raise APIError(400, "This server parses no tool calls: start it with --tool-call-parser "
                            "(hermes for Qwen2.5 / Qwen3 / Hermes, llama3_json for Llama 3.x, mistral for Mistral "
                            "v0.3, pythonic for Llama 3.2's pythonic calls, openai with --reasoning-parser openai_gptoss for "
                            "gpt-oss).", param="tools")
    _check_template_renders_tools(state)
    forced = None
    if choice == "required":
        forced = parser.forced_calls(req.tools, several=req.parallel_tool_calls is not False)
    elif named is not None:
        tools = [t for t in req.tools if t["function"]["name"] == named]
        if not tools:
            raise APIError(400, f"tool_choice names {named!r}, which is not among the tools.", param="tool_choice")
        forced = parser.forced_calls(tools[:1], several=False)
    if choice == "required" or named is not None:
        if forced is None:
            raise APIError(400, f"tool_choice {choice!r} is not supported with the {parser.name} tool-call parser "
                                "(no grammar of its call syntax); use \"auto\".", param="tool_choice")
    return req.tools, parser, forced


# A tool's name as OpenAI's API takes it. Names are written into the forced-call grammars (tool_choice
# "required" / named) and the harmony recipient: a quote or a newline in one broke those with a grammar
# error instead of naming the field.
_TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def _check_tool_schemas(tools: list[dict]) -> None:
    for i, tool in enumerate(tools):
        function = tool.get("function")
        if tool.get("type") != "function" or not isinstance(function, dict):
            raise APIError(400, f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}.", param="tools")
        name = function.get("name")
        if not isinstance(name, str) or not _TOOL_NAME.fullmatch(name):
            raise APIError(400, f"tools[{i}].function.name must be 1 to 64 letters, digits, underscores or dashes "
                                f"(OpenAI's rule), got {name!r}.", param="tools")
        if not isinstance(function.get("parameters", {}), dict):
            raise APIError(400, f"tools[{i}].function.parameters must be a JSON Schema object.", param="tools")


def _check_template_renders_tools(state: ServerState) -> None:
    if "tools" not in (state.tokenizer.chat_template or ""):
        raise APIError(400, "The model's chat template does not render tools, so the model would not see them.",
                       param="tools")


def _template_message(i: int, m: ChatMessage) -> dict:
    """A message as chat templates read it: text content; an assistant's reasoning (as
    reasoning_content and as thinking) and tool calls with their arguments as a mapping (templates
    write them with tojson), a tool message's tool_call_id."""
    content = m.content
    if isinstance(content, list):  # OpenAI content parts: only text is supported
        texts = []
        for part in content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise APIError(400, f"Only text content parts are supported, got {part.get('type')!r}.",
                               param="messages")
            texts.append(part["text"])
        content = "\n".join(texts)
    message = {"role": m.role, "content": content or ""}
    if m.reasoning_content is not None:
        if m.role != "assistant":
            raise APIError(400, f"messages[{i}]: reasoning_content belongs to assistant messages, not {m.role!r}.",
                           param="messages")
        # Qwen3's and DeepSeek's templates read reasoning_content, gpt-oss's reads thinking (each
        # decides which turns keep it: Qwen3 the ones after the last user message, gpt-oss a turn
        # that ended in a tool call)
        message["reasoning_content"] = message["thinking"] = m.reasoning_content
    if m.tool_calls is not None:
        message["tool_calls"] = [_template_tool_call(i, j, call) for j, call in enumerate(m.tool_calls)]
    for key in ("tool_call_id", "name"):
        if getattr(m, key) is not None:
            message[key] = getattr(m, key)
    return message


def _template_tool_call(i: int, j: int, call: dict) -> dict:
    where = f"messages[{i}].tool_calls[{j}]"
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise APIError(400, f"{where} must have a function with a name.", param="messages")
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except NOT_A_CALL:  # malformed, or nested past the recursion limit: a 400, not a 500
            raise APIError(400, f"{where}.function.arguments is not JSON.", param="messages") from None
    if not isinstance(arguments, dict):
        raise APIError(400, f"{where}.function.arguments must be a JSON object.", param="messages")
    return {**call, "type": "function", "function": {**function, "arguments": arguments}}


def _chat_prompt(state: ServerState, req: ChatRequest | TokenizeRequest, tools: list[dict] | None) -> list[int]:
    """The token ids of req.messages rendered by the model's chat template, with ``tools`` when not
    None. chat_template_kwargs (vLLM's, e.g. Qwen3's enable_thinking) are more variables for it;
    continue_final_message (vLLM's) renders without a generation prompt and cuts the text right
    after the last message's content, so the answer continues that message."""
    template_kwargs = dict(req.chat_template_kwargs or {})
    taken = sorted((TEMPLATE_VARIABLES | ({"tools"} if tools is not None else set())) & set(template_kwargs))
    if taken:
        raise APIError(400, f"chat_template_kwargs may not set {taken}: the server sets them.",
                       param="chat_template_kwargs")
    if tools is not None:
        template_kwargs["tools"] = tools
    if req.continue_final_message and req.add_generation_prompt:
        raise APIError(400, "continue_final_message needs add_generation_prompt: false (the answer continues "
                            "the last message instead of starting a new one).", param="continue_final_message")
    conversation = [_template_message(i, m) for i, m in enumerate(req.messages)]
    try:
        text = state.tokenizer.apply_chat_template(conversation, add_generation_prompt=req.add_generation_prompt,
                                                   **template_kwargs)
    except Exception as exc:  # noqa: BLE001 - template errors (roles it rejects, ...) are the client's
        raise APIError(400, f"The chat template rejected the messages: {exc}", param="messages") from None
    if req.continue_final_message:
        last = conversation[-1]["content"]
        end = text.rfind(last) if last else -1
        if end < 0:
            raise APIError(400, "continue_final_message: the last message's content does not appear in the "
                                "rendered prompt (empty, or changed by the template).", param="continue_final_message")
        text = text[:end + len(last)]
    return _encoded(state, text, "messages", add_special_tokens=False)


def _encoded(state: ServerState, text: str, field: str, add_special_tokens: bool) -> list[int]:
    """The token ids of a request's text; a 400 naming ``field`` for text that is not Unicode."""
    try:
        return state.tokenizer.encode(text, add_special_tokens=add_special_tokens)
    except ValueError as exc:
        raise APIError(400, f"{field}: {exc}", param=field) from None


# ---------------------------------------------------------------------------------------------
# Responses


def _completion_logprobs(state: ServerState, token_ids: list[int], logprobs: list | None,
                         text_offset: int, leading_none: bool = False) -> dict:
    """OpenAI completions logprobs: tokens, token_logprobs, top_logprobs, text_offset."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for i, tid in enumerate(token_ids):
        text = state.token_text(tid)
        tokens.append(text)
        offsets.append(text_offset)
        text_offset += len(text)
        entry = logprobs[i] if logprobs is not None and i < len(logprobs) else None
        if entry is None or (leading_none and i == 0):
            token_lps.append(None)
            tops.append(None)
        else:
            token_lps.append(float(entry.get(tid, float("-inf"))))
            top: dict[str, float] = {}
            for t, lp in entry.items():  # distinct ids can decode alike: keep the likelier
                key = state.token_text(t)
                top[key] = max(float(lp), top.get(key, float("-inf")))
            tops.append(top)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def _vllm_prompt_logprobs(state: ServerState, prompt: list[int], entries: list | None, top_n: int) -> list:
    """vLLM's prompt_logprobs: per prompt token None (the first) or {token id: {logprob, rank,
    decoded_token}} of the top_n and the token itself. rank is the place in the vocabulary for the
    top_n; the token's own rank when it is not among them is not computed (None)."""
    out = [None]
    for tid, entry in zip(prompt[1:], (entries or [None])[1:]):
        ranked = sorted(entry.items(), key=lambda kv: -kv[1])
        top = [t for t, _ in ranked if t != tid or len(entry) == top_n][:top_n]
        out.append({str(t): {"logprob": float(lp), "rank": top.index(t) + 1 if t in top else None,
                             "decoded_token": state.token_text(t)} for t, lp in ranked})
    return out


def _prompt_logprobs_param(req, echo_logprobs: int | None) -> int | None:
    """The engine's prompt_logprobs for a request: vLLM's prompt_logprobs (non-streamed only) or the
    echo's logprobs; 400 when both are asked with different counts."""
    if req.prompt_logprobs is None:
        return echo_logprobs
    if req.stream:
        raise APIError(400, "prompt_logprobs is only returned without stream.", param="prompt_logprobs")
    if echo_logprobs is not None and echo_logprobs != req.prompt_logprobs:
        raise APIError(400, "prompt_logprobs and echo with logprobs ask for different counts.", param="prompt_logprobs")
    return req.prompt_logprobs


def _chat_logprobs(state: ServerState, token_ids: list[int], logprobs: list, top_n: int) -> list[dict]:
    content = []
    for tid, entry in zip(token_ids, logprobs):
        text = state.token_text(tid)
        ranked = sorted(entry.items(), key=lambda kv: -kv[1])[:top_n]
        content.append({
            "token": text, "logprob": float(entry.get(tid, float("-inf"))), "bytes": list(text.encode()),
            "top_logprobs": [{"token": state.token_text(t), "logprob": float(lp),
                              "bytes": list(state.token_text(t).encode())} for t, lp in ranked]})
    return content


def _usage(gen: Generation, completion_tokens: int) -> dict:
    """OpenAI's usage of a generation, with the prompt tokens its requests found in the prefix cache."""
    prompt_tokens = sum(len(p) for p in gen.prompts)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": sum(gen.cached_tokens.values())}}


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'), ensure_ascii=False)}\n\n"


async def _wait_disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class EventStream(StreamingResponse):
    """An SSE response that watches for the client going away while it streams: a disconnect (or
    any end) cancels the stream and closes the Generation, which aborts its engine requests."""

    def __init__(self, events, generation: Generation):
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.generation = generation

    async def __call__(self, scope, receive, send) -> None:
        streamer = asyncio.ensure_future(self.stream_response(send))
        watcher = asyncio.ensure_future(_wait_disconnect(receive))
        try:
            await asyncio.wait({streamer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (streamer, watcher):
                task.cancel()
            results = await asyncio.gather(streamer, watcher, return_exceptions=True)
            await self.body_iterator.aclose()
            self.generation.close()
        error = results[0]
        if isinstance(error, Exception) and not isinstance(error, OSError):  # OSError: client gone
            log.error("streaming response failed", exc_info=error)


async def finals_or_disconnect(request: Request, gen: Generation, wait=None):
    """Non-streaming: wait for the whole answer (``wait()``, default gen.finals: dict[str,
    StepOutput]), or return None (after aborting) if the client disconnects first."""
    collector = asyncio.ensure_future((wait or gen.finals)())
    watcher = asyncio.ensure_future(_wait_disconnect(request.receive))
    try:
        await asyncio.wait({collector, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if collector.done():
            return collector.result()
        return None
    finally:
        for task in (collector, watcher):
            task.cancel()
        await asyncio.gather(collector, watcher, return_exceptions=True)
        gen.close()


def _stream_error(exc: BaseException) -> str:
    return _sse(APIError(500, str(exc), code="engine_error").body()) + "data: [DONE]\n\n"


# ---------------------------------------------------------------------------------------------
# The two generation endpoints


def _refuse_unsupported(req: RequestBody) -> None:
    """400 for request fields that would change the answer and that the engine cannot honour (tool
    calls, structured output, ...): ignoring them, as unknown fields are, would answer a different
    question without saying so."""
    extra = req.model_extra or {}
    for name, value in extra.items():
        refused = _UNHONOURED_EXTRAS.get(name)
        if refused is None and name.startswith("guided_") and name != "guided_decoding_backend":
            refused = (lambda v: v is not None, "the guided_* fields served are guided_json, guided_regex, "
                                                "guided_choice and guided_grammar")  # e.g. guided_whitespace_pattern
        if refused is not None and refused[0](value):
            raise APIError(400, f"{name} is not supported: {refused[1]}.", param=name)


# Extra body fields that change the answer when set and that the endpoint does not serve (tools on
# completions, the deprecated functions API, beam search, audio, ...): field -> (is it set?, why not).
_NO_TOOLS = "tools are read in chat completions only"
_UNHONOURED_EXTRAS = {
    "tools": (bool, _NO_TOOLS),  # a chat request declares tools, tool_choice and parallel_tool_calls
    "tool_choice": (lambda v: v not in (None, "none"), _NO_TOOLS),
    "functions": (bool, "the deprecated functions API is not served; use tools"),
    "function_call": (lambda v: v not in (None, "none"), "the deprecated functions API is not served; use tool_choice"),
    "logits_processors": (bool, "the sampler runs no custom logits processors"),
    "use_beam_search": (bool, "beam search is served on /v1/completions only"),
    "length_penalty": (lambda v: v not in (None, 1), "beam search is served on /v1/completions only"),
    "chat_template": (lambda v: v is not None, "the server renders its own template (the model's, or the one "
                                               "given with --chat-template), not one from a request"),
    "echo": (bool, "a chat answer never repeats the prompt"),
    "modalities": (lambda v: v not in (None, ["text"]), "the server answers with text only"),
    "audio": (lambda v: v is not None, "the server answers with text only"),
}


async def serve_completion(state: ServerState, req: CompletionRequest, request: Request):
    """POST /v1/completions: a JSON answer, or an EventStream when req.stream."""
    arrival = time.monotonic()
    lora = state.check_model(req.model)
    _refuse_unsupported(req)
    if req.suffix:
        raise APIError(400, "suffix is not supported.", param="suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise APIError(400, "best_of is not supported (only best_of == n).", param="best_of")
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options is only allowed with stream: true.", param="stream_options")
    prompts = [_truncated(req, p) for p in await asyncio.to_thread(prompt_token_ids, state, req.prompt)]
    max_tokens = min(_check_length(state, len(p), req.max_tokens, "prompt") for p in prompts)
    if req.use_beam_search:
        return await _serve_beam_search(state, req, request, prompts, max_tokens, lora, arrival)
    structured, source = _structured_spec(req)
    rid = f"cmpl-{uuid.uuid4().hex}"
    with _structured_errors_named(source):
        params = _sampling_params(state, req, max_tokens, req.logprobs,
                                  _prompt_logprobs_param(req, req.logprobs if req.echo else None), None, structured)
        await _prepare_grammar(state, params)
        gen = Generation(state, rid, prompts, params, arrival, lora, req)
        await gen.start()
    base = {"id": rid, "object": "text_completion", "created": int(time.time()),
            "model": gen.lora or state.served_model_name}
    n = params.n

    def prompt_text(i):  # echo: the prompt as given, or as the engine saw it once truncated or given as ids
        p = req.prompt
        if req.truncate_prompt_tokens:
            return state.tokenizer.decode(prompts[i])
        if isinstance(p, str):
            return p
        if isinstance(p, list) and p and isinstance(p[i], str):
            return p[i]
        return state.tokenizer.decode(prompts[i])

    def echo_logprobs(i, prompt_logprobs):
        return _completion_logprobs(state, prompts[i], prompt_logprobs, 0, leading_none=True)

    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        async def events():
            counts = 0
            offsets = {}  # (prompt, choice) -> text offset for logprobs
            echoed = set()
            try:
                async for items in gen.steps():
                    chunks = []
                    for step in items:
                        p = gen.ids.index(step.request_id)
                        for c in step.choices:
                            key = (p, c.index)
                            text, lp = c.text, None
                            if req.echo and key not in echoed:
                                echoed.add(key)
                                text = prompt_text(p) + text
                                if req.logprobs is not None:
                                    lp = echo_logprobs(p, step.prompt_logprobs)
                                    offsets[key] = len(prompt_text(p))
                            if req.logprobs is not None and c.token_ids:
                                gen_lp = _completion_logprobs(state, c.token_ids, c.logprobs,
                                                              offsets.get(key, 0))
                                offsets[key] = gen_lp["text_offset"][-1] + len(gen_lp["tokens"][-1])
                                lp = gen_lp if lp is None else {k: lp[k] + gen_lp[k] for k in lp}
                            counts += len(c.token_ids)
                            if text or c.token_ids or c.finish_reason is not None or lp is not None:
                                choice = {"index": p * n + c.index, "text": text, "logprobs": lp,
                                          "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                                if req.return_token_ids:
                                    choice["token_ids"] = c.token_ids
                                chunks.append({**base, "choices": [choice]})
                    if include_usage:
                        for chunk in chunks:
                            chunk["usage"] = None
                    if chunks:  # one write for everything this wake-up produced
                        yield "".join(_sse(chunk) for chunk in chunks)
                if include_usage:
                    yield _sse({**base, "choices": [], "usage": _usage(gen, counts)})
                yield "data: [DONE]\n\n"
            except EngineDeadError as exc:
                yield _stream_error(exc)

        return EventStream(events(), gen)

    finals = await finals_or_disconnect(request, gen)
    if finals is None:
        return Response(status_code=499)
    choices, completion_tokens = [], 0
    for p, rid_p in enumerate(gen.ids):
        out = finals[rid_p]
        for c in out.choices:
            text, token_ids, logprobs = c.final
            completion_tokens += len(token_ids)
            lp = None
            if req.logprobs is not None:
                lp = _completion_logprobs(state, token_ids, logprobs,
                                          len(prompt_text(p)) if req.echo else 0)
                if req.echo:
                    head = echo_logprobs(p, out.prompt_logprobs)
                    lp = {k: head[k] + lp[k] for k in lp}
            choice = {"index": p * n + c.index, "text": (prompt_text(p) if req.echo else "") + text,
                      "logprobs": lp, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
            if req.prompt_logprobs is not None:
                choice["prompt_logprobs"] = _vllm_prompt_logprobs(state, prompts[p], out.prompt_logprobs,
                                                                  req.prompt_logprobs)
            if req.return_token_ids:
                choice.update(prompt_token_ids=prompts[p], token_ids=token_ids)
            choices.append(choice)
    return {**base, "choices": choices, "usage": _usage(gen, completion_tokens)}


async def _serve_beam_search(state: ServerState, req: CompletionRequest, request: Request, prompts, max_tokens: int,
                             lora: str | None, arrival: float):
    """/v1/completions with use_beam_search (vLLM's): req.n beams per prompt, the n best answers as
    its choices (best first; finish_reason "stop" for an answer that ended with EOS, else "length").
    Each step's one-token requests run through the engine thread like any request's, so other
    requests keep running between them. Sampling fields do not apply; every one that would change the
    answer (stream, logprobs, echo, structured outputs, stops, the sampling and penalty fields, token
    restrictions, min_tokens) is a 400 when set, not ignored."""
    for name, value in (("stream", req.stream), ("logprobs", req.logprobs is not None), ("echo", req.echo),
                        ("stop", bool(req.stop or req.stop_token_ids)), ("prompt_logprobs", req.prompt_logprobs is not None),
                        ("response_format", _structured_spec(req)[0] is not None), ("temperature", bool(req.temperature)),
                        ("top_p", req.top_p not in (None, 1.0)), ("top_k", req.top_k not in (None, -1, 0)),
                        ("min_p", bool(req.min_p)), ("seed", req.seed is not None),
                        ("repetition_penalty", req.repetition_penalty not in (None, 1.0)),
                        ("presence_penalty", bool(req.presence_penalty)), ("frequency_penalty", bool(req.frequency_penalty)),
                        ("logit_bias", bool(req.logit_bias)), ("allowed_token_ids", req.allowed_token_ids is not None),
                        ("bad_words", bool(req.bad_words)), ("min_tokens", bool(req.min_tokens))):
        if value:
            raise APIError(400, f"{name} is not supported with use_beam_search.", param=name)
    try:
        search = BeamSearch(prompts, req.n, max_tokens, state.engine.eos_token_ids, req.ignore_eos, req.length_penalty)
    except ValueError as exc:
        raise APIError(400, str(exc), param="n") from None
    rid = f"cmpl-{uuid.uuid4().hex}"
    step = 0
    if lora is not None:
        state.lora_pins[lora] = state.lora_pins.get(lora, 0) + 1
    try:
        while pending := search.pending():
            gen = Generation(state, f"{rid}-{step}", pending, search.step_params, arrival, lora, req)
            await gen.start()
            finals = await finals_or_disconnect(request, gen)
            if finals is None:
                return Response(status_code=499)
            search.advance([finals[r].choices[0].final[2][0] for r in gen.ids])
            step += 1
    finally:
        if lora is not None:
            state.lora_pins[lora] -= 1
    choices, completion_tokens = [], 0
    for p, answers in enumerate(search.answers(state.tokenizer.decode)):
        for j, answer in enumerate(answers):
            completion_tokens += len(answer.token_ids)
            choice = {"index": p * req.n + j, "text": answer.text, "logprobs": None,
                      "finish_reason": "stop" if answer.finished else "length", "stop_reason": None}
            if req.return_token_ids:
                choice.update(prompt_token_ids=prompts[p], token_ids=answer.token_ids)
            choices.append(choice)
    prompt_tokens = sum(map(len, prompts))
    return {"id": rid, "object": "text_completion", "created": int(time.time()),
            "model": lora or state.served_model_name, "choices": choices,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}


class ChatAnswer:
    """One chat choice's text -> its reasoning, content and tool calls, through the server's
    reasoning parser (first) and the request's tool-call parser (on the content), whole or delta by
    delta; the deltas of a stream add up to the whole answer's parts."""

    def __init__(self, reasoning_parser, tool_parser):
        # harmony (gpt-oss): one reader for the channels and the calls (calls only with tools)
        self.harmony = reasoning_parser.stream(tool_parser is not None) if isinstance(
            reasoning_parser, HarmonyParser) else None
        self.reasoning = reasoning_parser.stream() if reasoning_parser is not None and self.harmony is None else None
        self.tools = tool_parser.stream() if tool_parser is not None and self.harmony is None else None
        self.calls_sent = 0

    def feed(self, text: str, finish_reason=None, stop_reason=None) -> tuple[str, str, list]:
        """(reasoning, content, calls) of the next delta; finish_reason set: the answer's last."""
        if self.harmony is not None:
            reasoning, content, calls = self.harmony.feed(text, finish_reason)
            self.calls_sent += len(calls)
            return reasoning, content, calls
        reasoning, content, calls = "", text, []
        if self.reasoning is not None:
            reasoning, content = self.reasoning.feed(text)
            if finish_reason is not None:
                more_reasoning, more_content = self.reasoning.finish()
                reasoning, content = reasoning + more_reasoning, content + more_content
        if self.tools is not None:
            content, calls = self.tools.feed(content)
            if finish_reason is not None:
                more_content, more_calls = self.tools.finish(stop_reason)
                content, calls = content + more_content, calls + more_calls
        self.calls_sent += len(calls)
        return reasoning, content, calls

    def finish_reason(self, finish_reason: str) -> str:
        """OpenAI's "tool_calls" for an answer that ended by itself with calls in it."""
        return "tool_calls" if self.calls_sent and finish_reason == "stop" else finish_reason

    def message(self, text: str, finish_reason: str, stop_reason) -> dict:
        """The non-streamed message of a whole answer (content None when parsers left nothing)."""
        reasoning, content, calls = self.feed(text, finish_reason, stop_reason)
        if self.reasoning is None and self.tools is None and self.harmony is None:
            return {"role": "assistant", "content": text}
        message = {"role": "assistant", "content": content or None}
        if self.reasoning is not None or self.harmony is not None:
            message["reasoning_content"] = reasoning or None
        if calls:
            message["tool_calls"] = [call.to_openai() for call in calls]
        return message


async def start_chat(state: ServerState, req: ChatRequest, prefix: str):
    """Check a chat request, render its prompt and hand it to the engine: (request id, Generation,
    prompt ids, tool-call parser or None). The chat and the Responses endpoints share it."""
    arrival = time.monotonic()
    lora = state.check_model(req.model)
    _refuse_unsupported(req)
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options is only allowed with stream: true.", param="stream_options")
    if req.top_logprobs and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true.", param="top_logprobs")
    tools, parser, forced = _chat_tools(state, req)
    structured, source = _structured_spec(req)
    if forced is not None:
        if structured is not None:
            raise APIError(400, f"tool_choice {req.tool_choice!r} cannot be combined with {source}: the answer is "
                                "held to the tool calls.", param=source)
        structured, source = forced, "tool_choice"
    prompt = _truncated(req, await asyncio.to_thread(_chat_prompt, state, req, tools))
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if max_tokens is None and state.defaults.get("max_new_tokens"):
        max_tokens = min(int(state.defaults["max_new_tokens"]), state.max_model_len - len(prompt))
    max_tokens = _check_length(state, len(prompt), max_tokens, "messages")
    top_n = req.top_logprobs or 0
    stop_after = parser.one_call_stop if parser is not None and req.parallel_tool_calls is False else None
    rid = f"{prefix}-{uuid.uuid4().hex}"
    with _structured_errors_named(source):
        reasoning = state.reasoning_parser
        grammar_after = reasoning.grammar_after if reasoning is not None else None
        if forced is not None and parser.grammar_from_start:
            grammar_after = None
        params = _sampling_params(state, req, max_tokens, top_n if req.logprobs else None,
                                  _prompt_logprobs_param(req, None), stop_after, structured, grammar_after,
                                  keep_special_tokens=state.harmony,
                                  grammar_after_open=reasoning.grammar_after_open if reasoning is not None else None,
                                  thinking=reasoning.name if isinstance(reasoning, ReasoningParser) else None)
        await _prepare_grammar(state, params)
        gen = Generation(state, rid, [prompt], params, arrival, lora, req)
        await gen.start()
    return rid, gen, prompt, parser


async def serve_chat(state: ServerState, req: ChatRequest, request: Request):
    """POST /v1/chat/completions: a JSON answer, or an EventStream when req.stream."""
    rid, gen, prompt, parser = await start_chat(state, req, "chatcmpl")
    params, top_n = gen.params, req.top_logprobs or 0
    base = {"id": rid, "object": "chat.completion", "created": int(time.time()),
            "model": gen.lora or state.served_model_name}

    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        chunk_base = {**base, "object": "chat.completion.chunk"}

        def chunk(index, delta, finish_reason=None, logprobs=None, stop_reason=None):
            body = {**chunk_base, "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                                               "finish_reason": finish_reason}]}
            if finish_reason is not None:
                body["choices"][0]["stop_reason"] = stop_reason
            if include_usage:
                body["usage"] = None
            return _sse(body)

        answers = [ChatAnswer(state.reasoning_parser, parser) for _ in range(params.n)]

        async def events():
            counts = 0
            try:
                for i in range(params.n):
                    yield chunk(i, {"role": "assistant", "content": ""})
                async for items in gen.steps():
                    parts = []
                    for step in items:
                        for c in step.choices:
                            counts += len(c.token_ids)
                            lp = None
                            if req.logprobs and c.token_ids:
                                lp = {"content": _chat_logprobs(state, c.token_ids, c.logprobs, top_n)}
                            answer = answers[c.index]
                            first = answer.calls_sent
                            reasoning, content, calls = answer.feed(c.text, c.finish_reason, c.stop_reason)
                            if reasoning or content or calls or c.token_ids or lp is not None:
                                delta = {"content": content} if content or not (calls or reasoning) else {}
                                if reasoning:
                                    delta["reasoning_content"] = reasoning
                                if calls:
                                    delta["tool_calls"] = [call.to_openai(first + k) for k, call in enumerate(calls)]
                                if req.return_token_ids:
                                    delta["token_ids"] = c.token_ids
                                parts.append(chunk(c.index, delta, logprobs=lp))
                            if c.finish_reason is not None:
                                parts.append(chunk(c.index, {}, answer.finish_reason(c.finish_reason),
                                                   stop_reason=c.stop_reason))
                    if parts:  # one write for everything this wake-up produced
                        yield "".join(parts)
                if include_usage:
                    yield _sse({**chunk_base, "choices": [], "usage": _usage(gen, counts)})
                yield "data: [DONE]\n\n"
            except EngineDeadError as exc:
                yield _stream_error(exc)

        return EventStream(events(), gen)

    finals = await finals_or_disconnect(request, gen)
    if finals is None:
        return Response(status_code=499)
    choices, completion_tokens = [], 0
    out = finals[gen.ids[0]]
    for c in out.choices:
        text, token_ids, logprobs = c.final
        completion_tokens += len(token_ids)
        lp = {"content": _chat_logprobs(state, token_ids, logprobs, top_n)} if req.logprobs else None
        answer = ChatAnswer(state.reasoning_parser, parser)
        message = answer.message(text, c.finish_reason, c.stop_reason)
        choice = {"index": c.index, "message": message, "logprobs": lp,
                  "finish_reason": answer.finish_reason(c.finish_reason), "stop_reason": c.stop_reason}
        if req.return_token_ids:
            choice.update(prompt_token_ids=prompt, token_ids=token_ids)
        choices.append(choice)
    body = {**base, "choices": choices, "usage": _usage(gen, completion_tokens)}
    if req.prompt_logprobs is not None:  # vLLM puts the chat prompt's at the top level
        body["prompt_logprobs"] = _vllm_prompt_logprobs(state, prompt, out.prompt_logprobs, req.prompt_logprobs)
    return body


# ---------------------------------------------------------------------------------------------
# The app


def create_app(engine, served_model_name: str | None = None, *, max_queue_depth: int = 1024,
               tool_call_parser: str | None = None, reasoning_parser: str | None = None,
               api_key: str | None = None, lora_updates: bool = False,
               max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> FastAPI:
    """A FastAPI app serving ``engine`` (a tileattn.engine.LLMEngine, or anything with its API).

    served_model_name: the name clients pass as ``model`` (None -> engine.model_name).
    max_queue_depth: the most engine requests (one per prompt) admitted and unfinished at once,
        running or waiting; beyond it requests get 503 instead of growing memory without bound.
    tool_call_parser: how chat answers are read for tool calls when a request has ``tools`` (a name
        in tileattn.engine.tool_calls.PARSERS: "hermes", "llama3_json", "mistral", "pythonic", "openai"); None:
        requests with tools get a 400.
    reasoning_parser: how chat answers are split into reasoning_content and content (a name in
        tileattn.engine.reasoning.PARSERS: "qwen3", "deepseek_r1", "openai_gptoss"); None: no split.
        "openai" and "openai_gptoss" read gpt-oss's harmony answers together (the default for a
        gpt-oss engine when neither parser is given).
    api_key: when set, every request but GET /health and GET /metrics must carry
        ``Authorization: Bearer <api_key>`` (OpenAI clients send their api_key so); others get a 401.
    lora_updates: serve POST /v1/load_lora_adapter {"lora_name", "lora_path"} and POST
        /v1/unload_lora_adapter {"lora_name"} (vLLM's), which change the engine's adapters while it runs.
    max_request_bytes: the longest request body taken; a longer one gets a 413 before it is parsed.
    The engine thread starts with the app's lifespan and stops (aborting what is left) at shutdown.
    Raises ValueError for max_queue_depth < 1, max_request_bytes < 1, an unknown parser or an empty api_key.
    """
    if not isinstance(max_queue_depth, int) or max_queue_depth < 1:
        raise ValueError(f"max_queue_depth must be an int >= 1, got {max_queue_depth!r}")
    if api_key is not None and (not isinstance(api_key, str) or not api_key.strip()):
        raise ValueError("api_key must be a non-empty string (None: no key)")
    if not isinstance(max_request_bytes, int) or max_request_bytes < 1:
        raise ValueError(f"max_request_bytes must be an int >= 1, got {max_request_bytes!r}")
    state = ServerState(engine, served_model_name or engine.model_name, max_queue_depth, tool_call_parser,
                        reasoning_parser)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        loop = asyncio.get_running_loop()
        state.engine_loop = EngineLoop(engine, loop, state.deliver, state.fail_all)
        state.engine_loop.start()
        try:
            yield
        finally:
            for gen in list(state.generations.values()):
                gen.close()
            await asyncio.to_thread(state.engine_loop.stop)

    app = FastAPI(title="tileattn", lifespan=lifespan)
    app.state.server = state
    app.add_middleware(BodyLimit, limit=max_request_bytes)

    if api_key is not None:
        expected = f"Bearer {api_key}".encode()

        @app.middleware("http")
        async def authenticate(request: Request, call_next):
            open_path = request.method == "GET" and request.url.path in ("/health", "/metrics")
            given = request.headers.get("authorization", "").encode()
            if not open_path and not hmac.compare_digest(given, expected):
                return APIError(401, "Incorrect API key provided: send Authorization: Bearer <the server's "
                                     "--api-key>.", code="invalid_api_key").response()
            return await call_next(request)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        if first.get("type") == "json_invalid":
            message = f"Malformed JSON body: {first.get('ctx', {}).get('error', first.get('msg'))}"
            param = None
        else:
            message = "; ".join(f"{'.'.join(str(x) for x in e.get('loc', ()) if x != 'body') or 'body'}: "
                                f"{e.get('msg')}" for e in errors)
            param = loc[0] if loc else None
        return APIError(400, message, param=param).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        return APIError(exc.status_code, str(exc.detail),
                        code="request_too_large" if exc.status_code == 413 else None).response()  # BodyLimit

    @app.exception_handler(EngineDeadError)
    async def engine_dead(request: Request, exc: EngineDeadError):
        return APIError(503, str(exc), code="engine_unavailable").response()

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):
        log.exception("request failed")
        return APIError(500, f"Internal server error: {exc!r}", code="internal_error").response()

    @app.get("/health")
    async def health():
        if state.engine_loop is None or not state.engine_loop.alive:
            raise APIError(503, "The engine is not running.", code="engine_unavailable")
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models():
        served = {"id": state.served_model_name, "object": "model", "created": state.created,
                  "owned_by": "tileattn", "root": engine.model_name, "max_model_len": state.max_model_len}
        adapters = [{**served, "id": name, "root": name, "parent": state.served_model_name} for name in state.lora_names]
        return {"object": "list", "data": [served, *adapters]}

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(state.metrics.registry),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        state.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "Give exactly one of prompt and messages.", param="prompt")
        if req.messages is not None:
            if req.tools:
                _check_tool_schemas(req.tools)
                _check_template_renders_tools(state)
            ids = await asyncio.to_thread(_chat_prompt, state, req, req.tools or None)
        else:
            ids = await asyncio.to_thread(_encoded, state, req.prompt, "prompt", True)
        return {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        state.check_model(req.model)
        vocab = state.tokenizer.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"Token ids {bad[:4]} are outside the tokenizer's vocabulary [0, {vocab}).",
                           param="tokens")
        return {"prompt": state.tokenizer.decode(req.tokens)}

    if lora_updates:
        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter(req: LoRAAdapterRequest):
            if not req.lora_path:
                raise APIError(400, "lora_path is required.", param="lora_path")
            if req.lora_name == state.served_model_name:
                raise APIError(400, "lora_name must differ from the served model's name.", param="lora_name")
            await _engine_call(state, lambda engine: engine.add_lora(req.lora_name, req.lora_path), "lora_path")
            state.lora_names = await _engine_call(state, lambda engine: engine.lora_names)
            return Response(f"Success: LoRA adapter '{req.lora_name}' added successfully.", media_type="text/plain")

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(req: LoRAAdapterRequest):
            if state.lora_pins.get(req.lora_name):
                raise APIError(400, f"LoRA adapter {req.lora_name!r} is in use by a running beam search",
                               param="lora_name")
            await _engine_call(state, lambda engine: engine.remove_lora(req.lora_name), "lora_name")
            state.lora_names = await _engine_call(state, lambda engine: engine.lora_names)
            return Response(f"Success: LoRA adapter '{req.lora_name}' removed successfully.", media_type="text/plain")

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        return await serve_completion(state, req, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatRequest, request: Request):
        return await serve_chat(state, req, request)

    from .embeddings import add_embeddings_endpoint  # they build on this module
    from .responses import add_responses_endpoint

    add_responses_endpoint(app, state)
    add_embeddings_endpoint(app, state)

    return app


# ---------------------------------------------------------------------------------------------
# CLI


def add_serve_command(subparsers) -> argparse.ArgumentParser:
    """Register `tileattn serve MODEL ...` on an argparse subparsers object."""
    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, streaming)")
    p.add_argument("model", help='HF checkpoint directory, .gguf file, or "smollm2" (the packaged GGUF)')
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None, help="the `model` clients send (default: MODEL)")
    p.add_argument("--max-queue-depth", type=int, default=1024,
                   help="most requests admitted at once (running + waiting); more get 503")
    p.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                   help=f"longest request body taken; longer ones get a 413 unread (default {DEFAULT_MAX_REQUEST_BYTES})")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--disable-access-log", action="store_true", help="no uvicorn line per HTTP request")
    p.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                   help="send a chat answer's <think> part as reasoning_content (qwen3: Qwen3; deepseek_r1: "
                        "DeepSeek-R1 and its distillations, whose template opens the block; openai_gptoss: gpt-oss's "
                        "harmony channels, the default for gpt-oss with --tool-call-parser openai)")
    p.add_argument("--api-key", default=os.environ.get("TILEATTN_API_KEY") or None,
                   help="require Authorization: Bearer KEY on every endpoint but /health and /metrics "
                        "(default: $TILEATTN_API_KEY; unset: no key)")
    p.add_argument("--chat-template", metavar="FILE_OR_TEMPLATE", default=None,
                   help="render chats with this jinja2 template (a file, or the template itself) instead of the "
                        "model's: for checkpoints without one or with a broken one")
    p.add_argument("--tool-call-parser", default=None, choices=sorted(PARSERS),
                   help="read chat answers for tool calls in this format (hermes: Qwen2.5 / Qwen3 / Hermes; "
                        "llama3_json: Llama 3.x; mistral: Mistral v0.3; pythonic: Llama 3.2's Python-style calls; "
                        "openai: gpt-oss, with --reasoning-parser openai_gptoss); "
                        "without it, requests with tools get a 400")
    g = p.add_argument_group("engine")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-num-batched-tokens", type=int, default=8192)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--dtype", default=None, help="auto | bfloat16 | float16 | float32")
    g.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    g.add_argument("--device", default=None, help="cuda | cuda:N | cpu (default: cuda when present)")
    g.add_argument("--kv-cache-blocks", type=int, default=None)
    g.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="split the model over N GPUs (N processes, NCCL; gloo ranks with --device cpu)")
    g.add_argument("--num-speculative-tokens", type=int, default=0, metavar="K",
                   help="requests decode up to K prompt-lookup drafts per step (0: off; no async scheduling)")
    g.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                   help="serve these PEFT LoRA adapters beside the model; a request's `model` picks one by NAME "
                        "(one GPU; steps with adapter tokens run eagerly)")
    g.add_argument("--max-lora-rank", type=int, default=16, help="the largest rank of --lora-modules (default 16)")
    g.add_argument("--max-loras", type=int, default=None,
                   help="LoRA adapter slots (default: as many as --lora-modules; with --enable-lora-updates at least 1)")
    g.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"],
                   help="fcfs: arrival order; priority: requests' priority field (lower first), then arrival")
    g.add_argument("--enable-lora-updates", action="store_true",
                   help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (adapters changed at run time)")
    p.set_defaults(fn=serve_main)
    return p


_ENGINE_OPTIONS = ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size",
                   "gpu_memory_utilization", "dtype", "enforce_eager", "device", "kv_cache_blocks",
                   "tensor_parallel_size", "num_speculative_tokens", "max_lora_rank", "scheduling_policy")


def _lora_modules(values: list[str]) -> list[tuple[str, str]]:
    """--lora-modules NAME=PATH ... -> [(name, path)]; ValueError for a value without both."""
    modules = []
    for value in values:
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules takes NAME=PATH, got {value!r}")
        modules.append((name, path))
    return modules


def _template_source(value: str) -> str:
    """--chat-template's value: a file's contents, or the value itself when it is no file (a
    template has braces or newlines a path does not)."""
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{" not in value:
        raise ValueError(f"--chat-template {value!r} is neither a file nor a jinja2 template")
    return value


def serve_main(args: argparse.Namespace) -> int:
    """Load the engine, then serve until Ctrl-C; the engine thread stops with the server, then the
    engine's tensor-parallel workers (if any)."""
    import uvicorn

    from .llm import LLMEngine

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    t0 = time.perf_counter()
    engine = None
    try:
        modules = _lora_modules(args.lora_modules)
        served = args.served_model_name or args.model
        if served in {name for name, _ in modules}:  # requests for it would get the base model
            raise ValueError(f"--lora-modules: an adapter may not be named like the served model ({served!r})")
        if not 0 <= args.port <= 65535:
            raise ValueError(f"--port must be in 0..65535, got {args.port}")
        max_loras = args.max_loras if args.max_loras is not None else max(len(modules), int(args.enable_lora_updates))
        if max_loras < len(modules):
            raise ValueError(f"--max-loras {max_loras} is fewer than the {len(modules)} --lora-modules")
        engine = LLMEngine.from_model(args.model, max_loras=max_loras,
                                      **{k: getattr(args, k) for k in _ENGINE_OPTIONS})
        for name, path in modules:
            engine.add_lora(name, path)
        if args.chat_template is not None:
            engine.tokenizer.set_chat_template(_template_source(args.chat_template))
        app = create_app(engine, served, max_queue_depth=args.max_queue_depth,
                         tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser,
                         api_key=args.api_key, lora_updates=args.enable_lora_updates,
                         max_request_bytes=args.max_request_bytes)
    except (ValueError, FileNotFoundError) as exc:  # bad checkpoint or option: say which, no traceback
        if engine is not None:
            engine.shutdown()
        print(f"tileattn serve: {exc}", file=sys.stderr)
        return 2
    log.info("engine ready in %.1f s: %s, max_model_len %d, tensor_parallel_size %d", time.perf_counter() - t0,
             engine.model_name, engine.max_model_len, args.tensor_parallel_size)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5,
                    access_log=not args.disable_access_log)
    finally:
        engine.shutdown()
    engine_loop = app.state.server.engine_loop
    if engine_loop is not None and engine_loop.running:
        log.error("the engine thread is still running after shutdown")
        return 1
    return 0

