"""Anthropic's Messages API on the ingress: `POST /v1/messages` and `/v1/messages/count_tokens`.

A Messages body is the chat completion it means (deploy/anthropic_schema.py), served by the
ingress's one chat path; only the reply's shape is Anthropic's (deploy/anthropic_events.py). A key
may come as `x-api-key`, as Anthropic's clients send it, beside `Authorization: Bearer`.
"""

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from deploy.anthropic_events import MessageBuilder, anthropic_shaped
from deploy.anthropic_schema import CountTokensRequest, MessagesRequest
from deploy.engine_requests import Generation
from deploy.http_app import app
from deploy.image_parts import image_token_counts
from deploy.models import ServedModel
from deploy.reply_format import TypedEvents
from deploy.request_path import RequestPath


def _keyed(request: Request) -> Request:
    """The request with its `x-api-key` as its bearer key, when it sends no Authorization."""
    headers = request.scope["headers"]
    names = {name.lower() for name, _ in headers}
    if b"authorization" in names or b"x-api-key" not in names:
        return request
    key = next(value for name, value in headers if name.lower() == b"x-api-key")
    scope = {**request.scope, "headers": [*headers, (b"authorization", b"Bearer " + key)]}
    return Request(scope, request.receive)


def _prompt_tokens(gen: Generation) -> int:
    """The tokens the engine runs for the prompt: each image's placeholder counted as the tokens
    the model gives that image."""
    request = gen.choices[0].request
    images = image_token_counts(gen.model.vision, request.images)
    return len(request.prompt_token_ids) + sum(images) - len(images)


def _messages_format(body: MessagesRequest, gen: Generation) -> TypedEvents:
    num_prompt_tokens = _prompt_tokens(gen)
    builder = MessageBuilder(gen.name, gen.reply_split(), num_prompt_tokens, body.stop_sequences)
    return TypedEvents(builder, builder.message)


class AnthropicRoutes(RequestPath):
    """The Messages API's routes (a mixin of OpenAIIngress)."""

    @app.post("/v1/messages")
    async def anthropic_messages(self, request: Request) -> Response:
        response = await self._serve(_keyed(request), MessagesRequest, self._anthropic_messages)
        return anthropic_shaped(response)

    @app.post("/v1/messages/count_tokens")
    async def anthropic_count_tokens(self, request: Request) -> Response:
        response = await self._serve(_keyed(request), CountTokensRequest, self._anthropic_count)
        return anthropic_shaped(response)

    async def _anthropic_messages(
        self, m: ServedModel, body: MessagesRequest, tenant: str
    ) -> Response:
        chat, names = body.as_chat(self.config.max_messages)
        try:
            return await self._answer_chat(
                m, chat, tenant, lambda gen: _messages_format(body, gen), body.stream
            )
        except Exception as exc:  # raised before the reply started: a field's error, renamed
            raise names.renamed(exc) from None

    async def _anthropic_count(
        self, m: ServedModel, body: CountTokensRequest, tenant: str
    ) -> Response:
        """The prompt's tokens as a Messages request would send them: the same chat path, up to
        the choices (none is started); each image counted as the tokens the engine gives it."""
        chat, names = body.chat_request(self.config.max_messages, max_tokens=1)
        try:
            gen = await self._chat_generation(m, chat, tenant)
        except Exception as exc:
            raise names.renamed(exc) from None
        return JSONResponse({"input_tokens": _prompt_tokens(gen)})
