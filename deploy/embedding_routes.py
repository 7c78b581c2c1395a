"""POST /v1/embeddings as a route mixin of the ingress: one pooling request per input, all in
flight at once (deploy/embeddings.py holds the schema and the vectors' encoding)."""

import asyncio
import functools
import json
import uuid

from fastapi import Request
from fastapi.responses import Response

from deploy.cache_scope import request_salt
from deploy.embeddings import (
    EmbeddingRequest,
    check_fits,
    check_total,
    embed_one,
    embedding_response,
)
from deploy.engine_requests import request_timeout
from deploy.errors import BadRequestError, RequestTimeoutError
from deploy.http_app import app
from deploy.models import ServedModel
from deploy.request_path import RequestPath
from scheduler.request import EngineRequest
from scheduler.sampling_params import SamplingParams


class EmbeddingRoutes(RequestPath):
    """The served model's pooled hidden states, one vector per input."""

    @app.post("/v1/embeddings")
    async def embeddings(self, request: Request) -> Response:
        return await self._serve(request, EmbeddingRequest, self._embed)

    async def _embed(self, m: ServedModel, body: EmbeddingRequest, tenant: str) -> Response:
        if m.adapter(body.model) is not None:
            raise BadRequestError(
                "model: embeddings come from the base model, not a LoRA adapter", param="model"
            )
        requests = await self._pooling_requests(m, body, tenant)
        vectors = await self._vectors(m, body, requests)
        answer = functools.partial(
            embedding_response,
            vectors,
            body.encoding_format,
            m.config.model_name,
            sum(len(r.prompt_token_ids) for r in requests),
        )
        content = await asyncio.to_thread(lambda: json.dumps(answer()).encode())
        return Response(content, media_type="application/json")

    async def _pooling_requests(
        self, m: ServedModel, body: EmbeddingRequest, tenant: str
    ) -> list[EngineRequest]:
        """One engine request per input, once each fits the context and all fit the budget."""
        inputs = body.inputs()
        limit = m.config.max_sequences_per_request  # one engine request per input
        if len(inputs) > limit:
            raise BadRequestError(
                f"input: {len(inputs)} inputs, more than this server takes at once ({limit})",
                param="input",
            )
        max_len = await m.max_model_len()
        total = 0  # tokens over the inputs so far (max_embedding_tokens)
        ids_of = []
        for i, item in enumerate(inputs):
            ids = await self._input_ids(m, item)
            check_fits(len(ids), max_len, i)
            total += len(ids)
            check_total(total, m.config.max_embedding_tokens)
            ids_of.append(ids)
        return self._requests(m, body, tenant, ids_of)

    async def _input_ids(self, m: ServedModel, item: str | list[int]) -> list[int]:
        ids = (
            await self._tokenize(m, m.frontend.encode_prompt, item, len(item), "input")
            if isinstance(item, str)
            else item
        )
        try:
            m.frontend.check_token_ids(ids, "input")
        except ValueError as exc:
            raise BadRequestError(str(exc), param="input") from None
        return ids

    def _requests(
        self, m: ServedModel, body: EmbeddingRequest, tenant: str, ids_of: list[list[int]]
    ) -> list[EngineRequest]:
        base_id = f"embd-{uuid.uuid4().hex}"
        params = SamplingParams(max_tokens=1, temperature=0.0, pooling=m.config.embedding_pooling)
        salt = request_salt(m.config.cache_scope, tenant)
        block_size = m.config.engine.block_size
        return [
            EngineRequest(
                request_id=f"{base_id}-{i}",
                prompt_token_ids=ids,
                sampling_params=params,
                priority=body.priority,
                tenant=tenant,
                block_hashes=m.frontend.block_hashes(ids, block_size, salt=salt),
                caller=self._actor_name,
                cache_salt=salt,
            )
            for i, ids in enumerate(ids_of)
        ]

    async def _vectors(
        self, m: ServedModel, body: EmbeddingRequest, requests: list[EngineRequest]
    ) -> list[list[float]]:
        """Every input's vector, all in flight at once, within the request's deadline."""
        timeout = request_timeout(m, body.request_timeout_s)
        try:
            return await asyncio.wait_for(
                asyncio.gather(*(embed_one(m.replica, r) for r in requests)), timeout
            )
        except TimeoutError:
            raise RequestTimeoutError(
                "The request did not finish within its deadline (request_timeout_s).",
                code="request_timeout",
            ) from None
