"""POST /tokenize and /detokenize (vLLM's), as a route mixin of the ingress."""

import asyncio
import functools

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from deploy.chat_prompt import frontend_message
from deploy.errors import BadRequestError
from deploy.http_app import app
from deploy.image_parts import load_message_images
from deploy.models import ServedModel
from deploy.request_path import RequestPath
from deploy.tokenize import (
    DetokenizeRequest,
    TokenizeRequest,
    detokenize,
    tokenize,
    tokenize_response,
    with_image_tokens,
)


class TokenizeRoutes(RequestPath):
    """A prompt or a chat to token ids, and ids back to text, with the model's own frontend."""

    @app.post("/tokenize")
    async def tokenize_route(self, request: Request) -> Response:
        return await self._serve(request, TokenizeRequest, self._tokenize_body)

    @app.post("/detokenize")
    async def detokenize_route(self, request: Request) -> Response:
        return await self._serve(request, DetokenizeRequest, self._detokenize_body)

    async def _tokenize_body(self, m: ServedModel, body: TokenizeRequest, tenant: str) -> Response:
        """The ids the engine would run: a chat's image parts decoded and bounded as a chat's
        (a text model's are a 400), each placeholder repeated for its image's tokens."""
        messages = [frontend_message(msg) for msg in body.messages or []]
        images, _ = await load_message_images(m.name, m.vision, m.metrics, body.messages or [])
        encode = functools.partial(tokenize, m.frontend, body)
        ids = await self._tokenize(m, encode, messages, body.num_chars)
        if images:
            ids = with_image_tokens(ids, m.vision, images)
        max_model_len = await m.max_model_len()
        return JSONResponse(tokenize_response(m.frontend, body, ids, max_model_len))

    async def _detokenize_body(
        self, m: ServedModel, body: DetokenizeRequest, tenant: str
    ) -> Response:
        max_model_len = await m.max_model_len()
        if len(body.tokens) > max_model_len:
            raise BadRequestError(
                f"tokens: at most max_model_len={max_model_len} ids, got {len(body.tokens)}",
                param="tokens",
            )
        return JSONResponse(await asyncio.to_thread(detokenize, m.frontend, body))
