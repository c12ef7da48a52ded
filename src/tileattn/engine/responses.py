"""POST /v1/responses: OpenAI's Responses API on the chat path.

A request is translated into a chat request (``instructions`` and ``input`` items into messages,
function tools and ``text.format`` into their chat forms) and runs through the same prompt
rendering, sampling, reasoning split and tool-call parsing as /v1/chat/completions; the answer
comes back as output items (``reasoning``, ``message`` with ``output_text``, ``function_call``), or,
with ``stream``, as the Responses API's typed events. Nothing is stored: ``previous_response_id``
gets a 400 (send the whole conversation as ``input``), and ``store`` has no effect.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import Field

from .server import (APIError, ChatAnswer, ChatRequest, EngineDeadError, EventStream, SamplingRequest, ServerState,
                     finals_or_disconnect, start_chat)

# Sampling fields that pass from a Responses request to the chat request as they are (vLLM's extras
# among them: top_k, min_p, seed, stop, ...); n stays 1 (a response has one answer).
_PASSED = tuple(name for name in SamplingRequest.model_fields if name not in ("n", "stream", "stream_options"))
# Responses fields that do not change the answer here: not passed on (metadata is echoed back)
_IGNORED = frozenset({"metadata", "include", "truncation", "user", "service_tier", "prompt_cache_key",
                      "safety_identifier"})
# Responses fields that refer to state stored at OpenAI (prompt templates, conversations)
_STORED = ("prompt", "conversation")
# metadata: (pairs, characters per key, characters per value), OpenAI's documented limits
METADATA_LIMITS = (16, 64, 512)


class ResponsesRequest(SamplingRequest):
    input: str | list[dict]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    text: dict | None = None                          # {"format": {"type": "text" | "json_object" | "json_schema", ...}}
    reasoning: dict | None = None
    previous_response_id: str | None = None
    store: bool | None = None
    background: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM extra, as for chat


def to_chat(req: ResponsesRequest) -> ChatRequest:
    """The chat request a Responses request amounts to; 400 for what the translation cannot carry."""
    if req.previous_response_id is not None:
        raise APIError(400, "previous_response_id is not supported: this server stores no responses; send the "
                            "whole conversation as input.", param="previous_response_id")
    if req.background:
        raise APIError(400, "background responses are not supported.", param="background")
    if req.reasoning and req.reasoning.get("effort") is not None:
        raise APIError(400, "reasoning.effort is not supported (a model's thinking is switched by its chat template: "
                            "chat_template_kwargs, e.g. {\"enable_thinking\": false}).", param="reasoning")
    for name in _STORED:
        if (req.model_extra or {}).get(name) is not None:
            raise APIError(400, f"{name} is not supported: this server stores no prompts or conversations.",
                           param=name)
    if req.n != 1:
        raise APIError(400, "n is not supported by the Responses API (one answer per response).", param="n")
    _check_metadata((req.model_extra or {}).get("metadata"))
    for name in ("tools", "tool_choice", "text"):  # echoed in the response object, which is strict JSON
        try:
            json.dumps(getattr(req, name), allow_nan=False)
        except ValueError:
            raise APIError(400, f"{name} holds a number JSON cannot carry (NaN or Infinity).", param=name) from None
    messages = [{"role": "system", "content": req.instructions}] if req.instructions is not None else []
    items = [{"role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
    if not items:
        raise APIError(400, "input must not be empty.", param="input")
    for i, item in enumerate(items):
        messages += _message(i, item, messages[-1] if messages else None)
    fields = {name: getattr(req, name) for name in _PASSED if getattr(req, name) is not None}
    fields.update(messages=messages, stream=req.stream, max_completion_tokens=req.max_output_tokens,
                  tools=[_chat_tool(i, t) for i, t in enumerate(req.tools)] if req.tools else None,
                  tool_choice=_chat_tool_choice(req.tool_choice), parallel_tool_calls=req.parallel_tool_calls,
                  response_format=_chat_format(req.text), chat_template_kwargs=req.chat_template_kwargs,
                  **{k: v for k, v in (req.model_extra or {}).items() if k not in _IGNORED})
    return ChatRequest(**{k: v for k, v in fields.items() if v is not None})


def _check_metadata(metadata) -> None:
    """OpenAI's metadata: at most METADATA_LIMITS' pairs of string keys and values, echoed back as sent."""
    if metadata is None:
        return
    pairs, key_chars, value_chars = METADATA_LIMITS
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise APIError(400, "metadata must be an object of string values.", param="metadata")
    if len(metadata) > pairs:
        raise APIError(400, f"metadata has {len(metadata)} pairs; at most {pairs} are allowed.", param="metadata")
    for key, value in metadata.items():
        if len(key) > key_chars or len(value) > value_chars:
            raise APIError(400, f"metadata[{key[:key_chars]!r}]: keys are at most {key_chars} characters and values "
                                f"at most {value_chars}.", param="metadata")


def _message(i: int, item: dict, previous: dict | None) -> list[dict]:
    """One input item -> the chat messages it adds (a function call joins the assistant message
    of the calls right before it)."""
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in ("user", "system", "developer", "assistant"):
            raise APIError(400, f"input[{i}].role must be user, system, developer or assistant, got {role!r}.",
                           param="input")
        content = item.get("content")
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict):
                    raise APIError(400, f"input[{i}].content[{j}] must be an object (a content part), got "
                                        f"{type(part).__name__}.", param="input")
                if part.get("type") not in ("input_text", "output_text"):
                    raise APIError(400, f"input[{i}]: only text content parts are supported, got "
                                        f"{part.get('type')!r}.", param="input")
                if not isinstance(part.get("text"), str):
                    raise APIError(400, f"input[{i}].content[{j}].text must be a string.", param="input")
                texts.append(part["text"])
            content = "\n".join(texts)
        if not isinstance(content, str):
            raise APIError(400, f"input[{i}].content must be a string or a list of text parts.", param="input")
        return [{"role": "system" if role == "developer" else role, "content": content}]
    if kind == "function_call":
        if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
            raise APIError(400, f"input[{i}]: a function_call needs call_id, name and arguments (strings).",
                           param="input")
        call = {"id": item["call_id"], "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]}}
        if previous is not None and previous["role"] == "assistant" and previous.get("tool_calls") \
                and not previous["content"]:
            previous["tool_calls"].append(call)
            return []
        return [{"role": "assistant", "content": "", "tool_calls": [call]}]
    if kind == "function_call_output":
        if not isinstance(item.get("call_id"), str) or not isinstance(item.get("output"), str):
            raise APIError(400, f"input[{i}]: a function_call_output needs call_id and output (strings).",
                           param="input")
        return [{"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]}]
    if kind == "reasoning":
        return []  # earlier thinking: chat templates leave it out of the prompt
    raise APIError(400, f"input[{i}]: items of type {kind!r} are not supported.", param="input")


def _chat_tool(i: int, tool: dict) -> dict:
    if tool.get("type") != "function":
        raise APIError(400, f"tools[{i}]: only function tools are supported, got {tool.get('type')!r}.",
                       param="tools")
    function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
    return {"type": "function", "function": function}


def _chat_tool_choice(choice):
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def _chat_format(text: dict | None) -> dict | None:
    fmt = (text or {}).get("format")
    if fmt is not None and not isinstance(fmt, dict):
        raise APIError(400, f"text.format must be an object, got {type(fmt).__name__}.", param="text")
    if fmt is None or fmt.get("type") in ("text", "json_object"):
        return fmt
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}}
    raise APIError(400, "text.format must be text, json_object or json_schema.", param="text")


class _Items:
    """The output items of one answer as they form: reasoning, then the message, then each call;
    streamed, the events that open, fill and close them."""

    def __init__(self, rid: str):
        self.rid, self.items, self.open, self.events = rid, [], None, []

    def _event(self, kind: str, **fields) -> None:
        self.events.append({"type": f"response.{kind}", **fields})

    def _start(self, item: dict) -> dict:
        self.close()
        self.items.append(item)
        self.open = item
        self._event("output_item.added", output_index=len(self.items) - 1, item=_snapshot(item, "in_progress"))
        return item

    def close(self, status: str = "completed") -> None:
        """Close the open item (if any) with ``status`` (incomplete: the answer was cut off in it)."""
        item, self.open = self.open, None
        if item is None:
            return
        item["status"] = status
        index = len(self.items) - 1
        if item["type"] == "reasoning":
            self._event("reasoning_text.done", item_id=item["id"], output_index=index, content_index=0,
                        text=item["content"][0]["text"])
        elif item["type"] == "message":
            part = item["content"][0]
            self._event("output_text.done", item_id=item["id"], output_index=index, content_index=0,
                        text=part["text"], logprobs=[])
            self._event("content_part.done", item_id=item["id"], output_index=index, content_index=0, part=part)
        self._event("output_item.done", output_index=index, item=_snapshot(item, status))

    def add(self, reasoning: str, content: str, calls: list) -> None:
        if reasoning:
            item = self.open if self.open is not None and self.open["type"] == "reasoning" else self._start(
                {"type": "reasoning", "id": f"rs_{uuid.uuid4().hex}", "summary": [],
                 "content": [{"type": "reasoning_text", "text": ""}]})
            item["content"][0]["text"] += reasoning
            self._event("reasoning_text.delta", item_id=item["id"], output_index=len(self.items) - 1,
                        content_index=0, delta=reasoning)
        if content:
            item = self.open
            if item is None or item["type"] != "message":
                item = self._start({"type": "message", "id": f"msg_{uuid.uuid4().hex}", "role": "assistant",
                                    "content": []})
                part = {"type": "output_text", "text": "", "annotations": []}
                self._event("content_part.added", item_id=item["id"], output_index=len(self.items) - 1,
                            content_index=0, part=dict(part))
                item["content"].append(part)
            item["content"][0]["text"] += content
            self._event("output_text.delta", item_id=item["id"], output_index=len(self.items) - 1,
                        content_index=0, delta=content, logprobs=[])
        for call in calls:
            item = self._start({"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call.id,
                                "name": call.name, "arguments": ""})
            index = len(self.items) - 1
            item["arguments"] = call.arguments
            self._event("function_call_arguments.delta", item_id=item["id"], output_index=index,
                        delta=call.arguments)
            self._event("function_call_arguments.done", item_id=item["id"], output_index=index,
                        arguments=call.arguments)
            self.close()


def _item_status(finish_reason: str) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def _snapshot(item: dict, status: str) -> dict:
    """A copy of ``item`` as it stands, with ``status`` (an in-progress message has no parts yet)."""
    out = json.loads(json.dumps(item))
    out["status"] = status
    if status == "in_progress" and out["type"] == "message":
        out["content"] = []
    return out


async def serve_responses(state: ServerState, req: ResponsesRequest, request: Request):
    """POST /v1/responses: a response object, or an EventStream of its events when req.stream."""
    chat = to_chat(req)
    rid, gen, prompt, parser = await start_chat(state, chat, "resp")
    created = time.time()
    answer, items = ChatAnswer(state.reasoning_parser, parser), _Items(rid)

    def response(status: str, output_tokens: int) -> dict:
        body = {"id": rid, "object": "response", "created_at": created, "model": gen.lora or state.served_model_name,
                "status": status, "output": [json.loads(json.dumps(item)) for item in items.items],
                "error": None, "incomplete_details": None, "instructions": req.instructions,
                "max_output_tokens": req.max_output_tokens, "temperature": req.temperature, "top_p": req.top_p,
                "tools": req.tools or [], "tool_choice": req.tool_choice or "auto",
                "parallel_tool_calls": req.parallel_tool_calls is not False, "text": req.text or {"format": {"type": "text"}},
                "previous_response_id": None, "store": False, "metadata": (req.model_extra or {}).get("metadata") or {},
                "usage": None}
        if status in ("completed", "incomplete"):
            body["usage"] = {"input_tokens": len(prompt), "output_tokens": output_tokens,
                             "total_tokens": len(prompt) + output_tokens,
                             "input_tokens_details": {"cached_tokens": sum(gen.cached_tokens.values())}}
        if status == "incomplete":
            body["incomplete_details"] = {"reason": "max_output_tokens"}
        return body

    if not req.stream:
        finals = await finals_or_disconnect(request, gen)
        if finals is None:
            return Response(status_code=499)
        (c,) = finals[gen.ids[0]].choices
        text, token_ids, _ = c.final
        items.add(*answer.feed(text, c.finish_reason, c.stop_reason))
        items.close(_item_status(c.finish_reason))
        return response(_item_status(c.finish_reason), len(token_ids))

    async def events():
        number = 0

        def sse(event: dict) -> str:
            nonlocal number
            event["sequence_number"], number = number, number + 1
            return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"

        yield sse({"type": "response.created", "response": response("in_progress", 0)})
        yield sse({"type": "response.in_progress", "response": response("in_progress", 0)})
        tokens = 0
        try:
            async for steps in gen.steps():
                for step in steps:
                    for c in step.choices:
                        tokens += len(c.token_ids)
                        items.add(*answer.feed(c.text, c.finish_reason, c.stop_reason))
                        if c.finish_reason is not None:
                            items.close(_item_status(c.finish_reason))
                            status = _item_status(c.finish_reason)
                            items.events.append({"type": f"response.{status}",
                                                 "response": response(status, tokens)})
                if items.events:
                    yield "".join(sse(e) for e in items.events)
                    items.events.clear()
        except EngineDeadError as exc:
            yield sse({"type": "error", "code": "engine_error", "message": str(exc), "param": None})

    return EventStream(events(), gen)


def add_responses_endpoint(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/responses")
    async def responses(req: ResponsesRequest, request: Request):
        return await serve_responses(state, req, request)
