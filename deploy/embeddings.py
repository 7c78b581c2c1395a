"""`POST /v1/embeddings`: the served model's pooled final hidden states, one vector per input.

Each input is an engine request of the pooling kind (SamplingParams.pooling): a prefill batched
by the replica's scheduler with every other request, whose one sampled token is dropped and whose
pooled, normalised hidden state comes back (RequestOutput.pooled). `dimensions` is refused: the
vector has the model's hidden size, and cutting a vector the model was not trained to cut
(Matryoshka-style) would silently make it worse.
"""

from __future__ import annotations

import base64
import struct
from typing import Any, Literal, cast

from pydantic import BaseModel, ConfigDict, Field, model_validator

from deploy.errors import BadRequestError, ReplicaUnavailableError, RequestFailedError
from deploy.generation import _route_as_own_request
from scheduler.outputs import RequestOutput
from scheduler.request import MAX_PRIORITY, MAX_TENANT_CHARS, EngineRequest

# OpenAI's bound on the inputs of one request.
MAX_INPUTS = 2048


class EmbeddingRequest(BaseModel):
    """POST /v1/embeddings."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    model: str = Field(max_length=1024)
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: None = None
    user: str | None = Field(default=None, max_length=MAX_TENANT_CHARS)
    priority: int = Field(default=0, ge=-MAX_PRIORITY, le=MAX_PRIORITY)  # raylm extension
    request_timeout_s: float | None = Field(default=None, gt=0, le=86400)

    @model_validator(mode="before")
    @classmethod
    def _bounded(cls, data: Any) -> Any:
        """Counted on the raw JSON, before one input is validated."""
        if not isinstance(data, dict):
            return data
        if data.get("dimensions") is not None:
            raise ValueError(
                "dimensions: not supported; each embedding has the model's hidden size"
            )
        items = data.get("input")
        if isinstance(items, list):
            if not items:
                raise ValueError("input: must not be empty")
            if len(items) > MAX_INPUTS and not all(isinstance(i, int) for i in items):
                raise ValueError(f"input: at most {MAX_INPUTS} inputs, got {len(items)}")
            if any(isinstance(i, (str, list)) and not i for i in items):
                raise ValueError("input: no input may be empty")
        if isinstance(items, str) and not items:
            raise ValueError("input: must not be empty")
        return data

    def inputs(self) -> list[str | list[int]]:
        """The inputs as a batch: each text or token ids."""
        items = self.input
        if isinstance(items, str):
            return [items]
        if all(isinstance(i, int) for i in items):
            return [cast(list[int], list(items))]
        return cast(list[str | list[int]], list(items))


def encoded(vector: list[float], encoding_format: str) -> list[float] | str:
    """A vector as OpenAI sends it: floats, or base64 of little-endian float32."""
    if encoding_format == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()


def embedding_response(
    vectors: list[list[float]], encoding_format: str, model: str, num_prompt_tokens: int
) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [
            {"object": "embedding", "index": i, "embedding": encoded(v, encoding_format)}
            for i, v in enumerate(vectors)
        ],
        "model": model,
        "usage": {"prompt_tokens": num_prompt_tokens, "total_tokens": num_prompt_tokens},
    }


async def embed_one(replica: Any, request: EngineRequest) -> list[float]:
    """One input's vector from a replica; the generation is cancelled if this is."""
    _route_as_own_request()
    response = replica.options(stream=True).generate.remote(request)
    vector: list[float] | None = None
    done = False
    try:
        async for out in response:  # read to its end, so the replica's call is over
            if out.finished:
                vector = _pooled(out, request.request_id)
        done = True
    finally:
        if not done:
            response.cancel()
    if vector is None:
        raise RequestFailedError(request.request_id, "finished without its embedding")
    return vector


def _pooled(out: RequestOutput, request_id: str) -> list[float] | None:
    """A finished output's vector; a failed or handed-back request raises."""
    if out.finish_reason == "error":
        raise RequestFailedError(request_id, out.error)
    if out.finish_reason == "abort":  # handed back by a draining replica
        raise ReplicaUnavailableError(request_id, 0)
    return out.pooled


def check_fits(num_tokens: int, max_model_len: int, index: int) -> None:
    """An input must leave room for the one token an embedding request samples."""
    if num_tokens >= max_model_len:
        raise BadRequestError(
            f"input: input {index} has {num_tokens} tokens; this model's context takes at most "
            f"{max_model_len - 1} for an embedding",
            param="input",
            code="context_length_exceeded",
        )


def check_total(num_tokens: int, limit: int) -> None:
    """The inputs so far must stay within the tokens one embeddings request may take."""
    if num_tokens > limit:
        raise BadRequestError(
            f"input: the inputs have more than {limit} tokens together, this server's bound for "
            f"one embeddings request (max_embedding_tokens); send fewer or shorter inputs",
            param="input",
        )
