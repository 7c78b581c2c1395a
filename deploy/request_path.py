"""The ingress's shared request path: what every route family (a mixin of `OpenAIIngress`)
reaches through `self`. Chat completions, completions, the Responses API (and any other
chat-shaped API) go validate -> tokenize -> EngineRequests -> stream or collect from the replicas
(deadline, migration, aborts) through these methods; only the output format differs.

A route mixin subclasses `RequestPath`, declares its routes on `deploy.http_app.app`, and is
added to `OpenAIIngress`'s bases:

    class AnthropicRoutes(RequestPath):
        @app.post("/v1/messages")
        async def messages(self, request: Request) -> Response:
            return await self._serve(request, MessagesRequest, self._messages)

        async def _messages(self, m: ServedModel, body: MessagesRequest, tenant: str) -> Response:
            chat = body.as_chat()  # the ChatCompletionRequest the body means
            return await self._answer_chat(m, chat, tenant, MessagesFormat.of(body), body.stream)

Entry points (methods of the ingress):
- `_serve(request, schema, answer) -> Response`: authorize the key, admit the tenant (its place is
  held until the response, or its stream, ends), read and validate the body against `schema`,
  resolve its model and cap its priority by the key, then `await answer(model, body, tenant)`. An
  exception from `answer` becomes the OpenAI error JSON of its status (deploy/errors.py).
- `_answer_chat(m, chat, tenant, reply_format, stream) -> Response`: the whole path of a
  `ChatCompletionRequest` (tools, constraint, template, tokenize, choices, deadline), answered by
  `reply_format(generation)`, a `deploy.reply_format.ReplyFormat` (one per output format;
  `TypedEvents` adapts a builder of typed events such as `ResponseBuilder`). Errors before the
  reply starts raise (a caller may rename their fields); after, the format reports them.
- `_chat_generation(m, chat, tenant) -> Generation` and `_generate(m, body, prompts, tenant) ->
  Generation`: the choices alone, for a caller that answers through `reply_format.answer`.
- `_authorize(request) -> Caller`: the caller by its key, for routes that read no body.
- `_tokenize(m, encode, prompt, num_chars, ...)`: encode off the event loop after the size check.
"""

import asyncio
import functools
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from deploy.body import MAX_CHARS_PER_TOKEN, body_limit, parse_body, read_body
from deploy.browser_guard import BrowserPolicy
from deploy.chat_prompt import (
    CHAT_CHARS,
    after_reasoning,
    chat_constraint,
    chat_messages,
    declared_tools,
)
from deploy.config import AppConfig
from deploy.engine_requests import ChoiceBuilder, Generation, Prompts
from deploy.errors import BadRequestError, error_response
from deploy.fields import Ignored
from deploy.image_parts import IMAGE_BODY_BYTES, load_chat_images
from deploy.lora import check_adapter_scope
from deploy.models import Caller, ModelTable, ServedModel
from deploy.reply_format import ReplyFormat, answer
from deploy.schemas import ChatCompletionRequest
from deploy.tenants import TenantLimiter
from deploy.tools import DeclaredTools, ToolSpec
from deploy.tracing import current, ended_with, start_request
from router.sessions import SESSION_HEADER, request_session
from scheduler.structured_output import StructuredOutput

# A route's answer: the body's model, the validated body, the tenant it runs for.
Answer = Callable[[ServedModel, Any, str], Awaitable[Response]]


class RequestPath:
    """The state every route reads (set by `OpenAIIngress.__init__`) and the steps every request
    takes before its route-specific answer."""

    config: AppConfig  # the ingress's own settings; each model's are its ServedModel's
    table: ModelTable
    browser_policy: BrowserPolicy
    _tenants: TenantLimiter
    _created: int
    _actor_name: str | None  # replicas abort this ingress's orphaned requests

    async def _serve(self, request: Request, schema: type, answer: Answer) -> Response:
        """Authorize, admit the tenant, read and check the body, answer. The request holds its
        tenant's place until the answer is ready, or its stream ends."""
        try:
            caller = self._authorize(request)
            lease = self._tenants.admit(caller.tenant)
        except Exception as exc:
            return error_response(exc)
        ignored = Ignored()
        span = start_request(self.config.tracing, request)  # None: off or not sampled
        try:
            with current(span):  # the choices it makes read it (deploy/tracing.py)
                model, body = await self._parse(request, schema, caller, ignored)
                if span is not None:
                    span.describe(model.config.model_name, body)
                response = await answer(model, body, lease.tenant)
        except Exception as exc:
            response = error_response(exc)
        except BaseException:  # cancelled: the client is gone
            lease.release()
            raise
        response.headers.update(ignored.header())
        return lease.hold(ended_with(span, response))

    async def _parse(
        self, request: Request, schema: type, caller: Caller, ignored: Ignored
    ) -> tuple[ServedModel, Any]:
        """The model the body names and the validated body, its priority capped by the caller's
        key for that model; the fields it dropped (unknown_fields: ignore) go in `ignored`."""
        # Before the body names its model: the largest any model takes (none is woken for it).
        limit = max(_body_limit(m) for m in self.table.models)
        raw = await read_body(request, limit, self.config.request_body_timeout_s)
        mode: Any = self.config.unknown_fields
        body: Any = await parse_body(raw, schema, self.config.max_messages, mode, ignored)
        # /tokenize and /detokenize may leave `model` out: the first model answers.
        model, caller = self.table.resolve(body.model, caller)
        # An adapter's name is checked here, its existence by the replica (404 either way).
        scope = None if caller.profile is None else caller.profile.loras
        check_adapter_scope(model.adapter(body.model), scope, body.model or "")
        # The tenant and the priority ceiling are the key's; the request's `user` does not choose
        # them.
        if caller.profile is not None and hasattr(body, "priority"):  # /tokenize has none
            body.priority = max(body.priority, caller.profile.max_priority)
        if hasattr(body, "session_id"):  # the generating routes (router/sessions.py)
            body.session_id = self._session(request, body)
        return model, body

    def _session(self, request: Request, body: Any) -> str | None:
        """The request's session: its body's, its header's, or its user's (session_from_user)."""
        header = request.headers.get(SESSION_HEADER)
        user, from_user = getattr(body, "user", None), self.config.session_from_user
        return request_session(body.session_id, header, user, from_user)

    def _authorize(self, request: Request) -> Caller:
        """The caller by its key (a 401 when no model takes it)."""
        return self.table.authenticate(request.headers.get("authorization", ""))

    async def _tokenize(
        self,
        m: ServedModel,
        encode: Any,
        prompt: Any,
        num_chars: int,
        param: str = "prompt",
        counted: str = "characters",
    ) -> list[int]:
        """Encode off the event loop (a 10 MB prompt must not stall other streams), after a size
        check."""
        limit = await m.max_model_len() * MAX_CHARS_PER_TOKEN
        if num_chars > limit:
            raise BadRequestError(
                f"{param}: {num_chars} {counted} cannot fit this model's context "
                f"(at most {limit} characters)",
                param=param,
                code="context_length_exceeded",
            )
        return await asyncio.to_thread(encode, prompt)

    async def _check(
        self, m: ServedModel, constraint: StructuredOutput | None
    ) -> StructuredOutput | None:
        """A valid constraint (checked in the grammar sandbox, off the event loop) or a 400."""
        if constraint is None:
            return None
        return await asyncio.to_thread(m.grammars.check, constraint)

    def _check_fanout(self, m: ServedModel, num_prompts: int, n: int) -> None:
        limit = m.config.max_sequences_per_request
        if num_prompts * n > limit:
            raise BadRequestError(
                f"n: {num_prompts} prompt(s) x n={n} asks for more than {limit} sequences",
                param="n",
            )

    # ---- prompts -> choices on the replicas ----------------------------------------------------
    async def _generate(
        self, m: ServedModel, body: Any, prompts: Prompts, tenant: str
    ) -> Generation:
        """The choices of a sampling request's prompts (n each), checked and ready to stream."""
        max_len = await m.max_model_len()
        builder = ChoiceBuilder(m, body, prompts, tenant, self._actor_name)
        return Generation(m, body, builder.build(max_len))

    async def _chat_generation(
        self, m: ServedModel, chat: ChatCompletionRequest, tenant: str
    ) -> Generation:
        """A chat's choices: its tools and constraint checked, its messages rendered and
        tokenized off the event loop; the Generation knows the tools and the reasoning state."""
        if chat.max_completion_tokens is not None:
            chat.max_tokens = chat.max_completion_tokens
        self._check_fanout(m, 1, chat.n)
        tools = declared_tools(chat)
        constraint = await self._check(m, chat_constraint(m, chat, tools))
        prompt, images, image_tokens = await self._chat_prompt(m, chat, tools)
        opened = m.reasoning.opened_by(prompt) if m.reasoning is not None else None
        constraint = after_reasoning(m, constraint, opened)
        asked = Prompts(
            [prompt], "messages", "chatcmpl", chat.num_logprobs, constraint, images, image_tokens
        )
        gen = await self._generate(m, chat, asked, tenant)
        gen.tools = DeclaredTools.of(tools, m.tool_format) if tools else None
        gen.opened = opened
        return gen

    async def _chat_prompt(
        self, m: ServedModel, chat: ChatCompletionRequest, tools: list[ToolSpec]
    ) -> tuple[list[int], tuple[Any, ...], int]:
        """The chat's messages rendered by the model's template and tokenized (off the event
        loop), cut to truncate_prompt_tokens; its images, loaded, and their tokens."""
        messages, tool_args, num_chars = chat_messages(m, chat, tools)
        images, image_tokens = await load_chat_images(m.name, m.vision, m.metrics, chat)
        encode = functools.partial(
            m.frontend.encode_chat, tools=tool_args, options=chat.chat_options()
        )
        prompt = await self._tokenize(m, encode, messages, num_chars, "messages", CHAT_CHARS)
        if chat.truncate_prompt_tokens is not None:
            prompt = prompt[-chat.truncate_prompt_tokens :]
        return prompt, images, image_tokens

    async def _answer_chat(
        self,
        m: ServedModel,
        chat: ChatCompletionRequest,
        tenant: str,
        reply_format: Callable[[Generation], ReplyFormat],
        stream: bool,
    ) -> Response:
        """A chat-shaped request answered in `reply_format`'s output format, streamed or whole."""
        gen = await self._chat_generation(m, chat, tenant)
        return await answer(reply_format(gen), gen.deltas(), stream)


def _body_limit(m: ServedModel) -> int:
    """The largest body `m` takes: a vision model's has room for images beside its text."""
    limit = body_limit(m.config, m.context_bound())
    if m.vision is not None and m.config.max_request_body_bytes is None:
        limit += IMAGE_BODY_BYTES
    return limit
