"""POST /v1/embeddings: OpenAI's embeddings endpoint on the engine's embedding requests.

Each input (a string, a list of strings, a list of token ids or a list of those) becomes one engine
request with PoolingParams: the final hidden state of its last token, cut to ``dimensions`` when
given and normalised to unit length (the pooling of decoder embedding models such as
Qwen3-Embedding; a chat model gives vectors too, of whatever use). The requests share the engine's
steps with generations (continuous batching, chunked prefill, the prefix cache). ``encoding_format``
"float" returns lists of numbers, "base64" the little-endian float32 bytes (what the openai client
asks for by default and decodes itself).
"""

from __future__ import annotations

import asyncio
import base64
import time
import uuid
from typing import Literal

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import Field

from .sampling_params import PoolingParams
from .server import APIError, Generation, RequestBody, ServerState, finals_or_disconnect, prompt_token_ids


class EmbeddingRequest(RequestBody):
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    truncate_prompt_tokens: int | None = Field(None, ge=1)  # vLLM extra: keep each input's last k tokens
    user: str | None = None  # accepted, not used


async def serve_embeddings(state: ServerState, req: EmbeddingRequest, request: Request):
    arrival = time.monotonic()
    lora = state.check_model(req.model)
    prompts = [p[-req.truncate_prompt_tokens:] if req.truncate_prompt_tokens else p
               for p in await asyncio.to_thread(prompt_token_ids, state, req.input, "input")]
    limit = state.max_model_len
    for i, ids in enumerate(prompts):
        if len(ids) > limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens. However, input {i} has "
                                f"{len(ids)} tokens. Please reduce the length of the input.",
                           param="input", code="context_length_exceeded")
    hidden = state.engine.model_config.hidden_size
    if req.dimensions is not None and req.dimensions > hidden:
        raise APIError(400, f"dimensions={req.dimensions} exceeds the model's embedding size {hidden}.",
                       param="dimensions")
    gen = Generation(state, f"embd-{uuid.uuid4().hex}", prompts, PoolingParams(dimensions=req.dimensions), arrival,
                     lora)
    await gen.start()
    vectors = await finals_or_disconnect(request, gen, gen.embeddings)
    if vectors is None:
        return Response(status_code=499)
    data = []
    for i, rid in enumerate(gen.ids):
        vector = vectors[rid]
        if req.encoding_format == "base64":
            vector = base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
        data.append({"object": "embedding", "index": i, "embedding": vector})
    tokens = sum(len(p) for p in prompts)
    return {"id": gen.ids[0].rsplit("-", 1)[0], "object": "list", "created": int(time.time()),
            "model": gen.lora or state.served_model_name, "data": data,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def add_embeddings_endpoint(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/embeddings")
    async def embeddings(req: EmbeddingRequest, request: Request):
        return await serve_embeddings(state, req, request)
