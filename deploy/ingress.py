"""OpenAIIngress: the OpenAI-compatible HTTP front of the cluster (FastAPI on Ray Serve).

No `from __future__ import annotations` here, and every helper the class uses is defined above it:
@serve.deployment serializes the class when it is decorated, and FastAPI resolves the route
signatures' annotations at run time.
"""

import asyncio
import functools
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

import ray
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.serve.handle import DeploymentHandle

from cluster.fleet_view import replica_reports
from deploy import metrics_page
from deploy.body import MAX_CHARS_PER_TOKEN
from deploy.browser_guard import BrowserPolicy
from deploy.cache_scope import request_salt
from deploy.embeddings import (
    EmbeddingRequest,
    check_fits,
    check_total,
    embed_one,
    embedding_response,
)
from deploy.errors import (
    BadRequestError,
    ContextLengthError,
    RequestTimeoutError,
    error_event,
    error_response,
)
from deploy.fleet_config import FleetConfig
from deploy.generation import Choice, ChoiceDelta, UsageTally, merge_streams, with_deadline
from deploy.http_app import app
from deploy.logprobs import (
    chat_logprobs,
    check_budget,
    completion_logprobs,
    num_entries,
    prompt_logprobs_json,
    response_json,
)
from deploy.lora import (
    scoped_cards,
)
from deploy.lora_routes import LoraRoutes
from deploy.models import ModelTable, ServedModel
from deploy.reply import ReplySplit
from deploy.request_path import RequestPath
from deploy.responses import ResponseBuilder, ResponsesRequest, renamed, sse_event
from deploy.schemas import ChatCompletionRequest, CompletionRequest
from deploy.tenants import TenantLimiter
from deploy.tokenize_routes import TokenizeRoutes
from deploy.tools import (
    DeclaredTools,
    ToolSpec,
    prepare_chat,
    tool_constraint,
)
from frontend.reasoning import ReasoningSplitter
from scheduler.request import EngineRequest
from scheduler.sampling_params import SamplingParams
from scheduler.structured_output import StructuredOutput
from workers.process import set_niceness

logger = logging.getLogger(__name__)

# A response with more log-probabilities than this is built and encoded on a thread.
LOGPROBS_OFF_LOOP = 4096


def _sse(payload: dict | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


async def _prepend(
    first: ChoiceDelta | None, rest: AsyncIterator[ChoiceDelta]
) -> AsyncIterator[ChoiceDelta]:
    if first is not None:
        yield first
        async for delta in rest:
            yield delta


@dataclass(slots=True)
class _PromptSide:
    """What a response shows of each choice's prompt: its echoed text, its log-probabilities."""

    prefixes: list[str] | None = None  # echo: the text each choice begins with
    first_tokens: list[int] = field(default_factory=list)  # each choice's first prompt token
    echo_logprobs: int | None = None  # echo with logprobs: alternatives shown per position
    prompt_logprobs: bool = False  # a `prompt_logprobs` list per choice (or for the chat)


async def _response_events(
    builder: ResponseBuilder, deltas: AsyncIterator[ChoiceDelta]
) -> AsyncIterator[bytes]:
    """A Responses stream: its typed events, an error event if it fails after the start."""
    for event in builder.start():
        yield sse_event(event)
    try:
        async for delta in deltas:
            for event in builder.feed(delta):
                yield sse_event(event)
    except Exception as exc:
        yield sse_event(builder.error(exc))


class _ChatSplit:
    """One chat choice's text as OpenAI message fields: reasoning (with a reasoning parser), plain
    content, or tool calls when tools are on."""

    def __init__(self, tools: DeclaredTools | None, reasoning: ReasoningSplitter | None) -> None:
        self.split = ReplySplit(tools, reasoning)

    def message(self, text: str) -> dict[str, Any]:
        """The whole reply as a message."""
        piece = self.split.whole(text)
        message: dict[str, Any] = {
            "role": "assistant",
            "content": piece.content or (None if piece.calls else ""),
        }
        if self.split.reasoning is not None:
            message["reasoning_content"] = piece.reasoning or None
        if piece.calls:
            message["tool_calls"] = piece.calls
        return message

    def delta(self, text: str, last: bool, first: bool) -> dict[str, Any]:
        """The streamed delta for `text` more (empty when nothing can be sent yet)."""
        piece = self.split.feed(text)
        if last:
            piece += self.split.finish()
        start = self.split.num_calls - len(piece.calls)  # this delta's first call's index
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if piece.reasoning:
            delta["reasoning_content"] = piece.reasoning
        if piece.content or (first and not piece.calls and not piece.reasoning):
            delta["content"] = piece.content
        if piece.calls:
            delta["tool_calls"] = [
                {"index": start + k, **call} for k, call in enumerate(piece.calls)
            ]
        return delta

    def finish_reason(self, reason: str | None) -> str | None:
        """A reply that made calls and stopped by itself finishes with "tool_calls"."""
        if reason == "stop" and self.split.num_calls:
            return "tool_calls"
        return reason


@serve.deployment(name="OpenAIIngress")
@serve.ingress(app)
class OpenAIIngress(TokenizeRoutes, LoraRoutes, RequestPath):
    """Validates, tokenizes and hashes prompts, streams detokenized text, maps errors to OpenAI
    JSON."""

    def __init__(
        self,
        fleet: FleetConfig,
        replicas: list[DeploymentHandle],
        prefills: dict[str, DeploymentHandle] | None = None,
    ) -> None:
        """replicas: each model's replicas (a disaggregated model's decode replicas); prefills:
        a disaggregated model's prefill replicas, by model name."""
        config = fleet.ingress
        if config.engine.process_niceness is not None:
            # The ingress streams every token the engine makes: it runs at the engine's priority.
            set_niceness(config.engine.process_niceness)
        self.config = config  # the ingress's own settings; each model's are its ServedModel's
        self.table = ModelTable([ServedModel.load(c, r) for c, r in zip(fleet.models, replicas)])
        for m in self.table.models:
            m.prefill = (prefills or {}).get(m.name)
        self._tenants = TenantLimiter(config.max_requests_per_tenant, config.overload_retry_after_s)
        self.browser_policy = BrowserPolicy.of(
            self.table.open, config.allowed_hosts, config.allowed_origins
        )
        self._created = int(time.time())
        self._actor_name = ray.get_runtime_context().get_actor_name()  # replicas abort our orphans

    # ---- routes --------------------------------------------------------------------------------
    @app.get("/health")
    async def health(self) -> JSONResponse:
        return JSONResponse({"status": "ok"})

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi(self, request: Request) -> JSONResponse:
        try:
            self._authorize(request)
        except Exception as exc:
            return error_response(exc)
        return JSONResponse(app.openapi())

    @app.get("/v1/models")
    async def models(self, request: Request) -> JSONResponse:
        try:
            caller = self._authorize(request)
            cards = [c for m in self.table.visible(caller) for c in await m.cards(self._created)]
            cards = scoped_cards(cards, None if caller.profile is None else caller.profile.loras)
        except Exception as exc:
            return error_response(exc)
        return JSONResponse({"object": "list", "data": cards})

    @app.get("/metrics")
    async def prometheus_metrics(self, request: Request) -> Response:
        """The caller's view: an admin key (or a server without keys) sees every model, any other
        key the models and adapters it may use and its own tenant's requests in flight."""
        try:
            caller = self._authorize(request)
        except Exception as exc:
            return error_response(exc)
        full = not self.table.keys or (caller.profile is not None and caller.profile.admin)
        models = self.table.models if full else self.table.visible(caller)
        in_flight = self._tenants.in_flight
        page = metrics_page.render(
            [m.metrics for m in models],
            {k: v for m in models for d in m.deployments for k, v in replica_reports(d).items()},
            sum(in_flight.values()) if full else in_flight.get(caller.tenant, 0),
            None if full or caller.profile is None else caller.profile.loras,
        )
        return Response(page, media_type=metrics_page.CONTENT_TYPE)

    @app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self._serve(request, CompletionRequest, self._complete)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        return await self._serve(request, ChatCompletionRequest, self._chat)

    @app.post("/v1/responses")
    async def responses(self, request: Request) -> Response:
        return await self._serve(request, ResponsesRequest, self._responses)

    @app.post("/v1/embeddings")
    async def embeddings(self, request: Request) -> Response:
        return await self._serve(request, EmbeddingRequest, self._embed)

    async def _complete(self, m: ServedModel, body: CompletionRequest, tenant: str) -> Response:
        raw_prompts = body.prompts()
        self._check_fanout(m, len(raw_prompts), body.n)
        prompts = [
            await self._tokenize(m, m.frontend.encode_prompt, p, len(p))
            if isinstance(p, str)
            else p
            for p in raw_prompts
        ]
        k = body.truncate_prompt_tokens
        if k is not None:
            prompts = [p[-k:] for p in prompts]
        echoes = None
        if body.echo:  # the prompt's text as the model saw it (decoded when given as ids)
            echoes = [
                p if isinstance(p, str) and k is None else m.frontend.decode(ids)
                for p, ids in zip(raw_prompts, prompts)
            ]
        constraint = await self._check(m, body.output_constraint())
        choices = await self._choices(m, body, prompts, body.logprobs, tenant, constraint)
        side = _PromptSide(
            [echoes[c.prompt_index] for c in choices] if echoes is not None else None,
            [c.request.prompt_token_ids[0] for c in choices],
            body.logprobs if body.echo_logprobs else None,
            body.prompt_logprobs is not None,
        )
        return await self._respond(m, body, choices, chat=False, side=side)

    async def _chat(self, m: ServedModel, body: ChatCompletionRequest, tenant: str) -> Response:
        choices, declared, opened = await self._chat_choices(m, body, tenant)
        side = _PromptSide(
            first_tokens=[c.request.prompt_token_ids[0] for c in choices],
            prompt_logprobs=body.prompt_logprobs is not None,
        )
        return await self._respond(
            m, body, choices, chat=True, tools=declared, opened=opened, side=side
        )

    async def _responses(self, m: ServedModel, body: ResponsesRequest, tenant: str) -> Response:
        """POST /v1/responses: the chat completion it means, answered as a Responses object."""
        try:
            chat = body.as_chat(self.config.max_messages)
            chat.priority = body.priority  # already capped by the key
            choices, declared, opened = await self._chat_choices(m, chat, tenant)
        except Exception as exc:
            raise renamed(exc) from None
        reasoning = m.reasoning
        builder = ResponseBuilder(
            body,
            self._answering_model(m, chat, choices),
            ReplySplit(declared, self._splitter(m, opened)),
            functools.partial(reasoning.num_reasoning_tokens, opened=bool(opened))
            if reasoning is not None
            else None,
        )
        deltas = self._deltas(m, chat, choices)
        if body.stream:
            try:
                first = await anext(deltas, None)
            except Exception as exc:
                return error_response(exc)
            return StreamingResponse(
                _response_events(builder, _prepend(first, deltas)),
                media_type="text/event-stream",
            )
        try:
            async for delta in deltas:
                builder.feed(delta)
        except Exception as exc:
            return error_response(exc)
        return JSONResponse(builder.response())

    async def _embed(self, m: ServedModel, body: EmbeddingRequest, tenant: str) -> Response:
        """POST /v1/embeddings: one pooling request per input, all in flight at once."""
        if m.adapter(body.model) is not None:
            raise BadRequestError(
                "model: embeddings come from the base model, not a LoRA adapter", param="model"
            )
        max_len = await m.max_model_len()
        base_id = f"embd-{uuid.uuid4().hex}"
        params = SamplingParams(max_tokens=1, temperature=0.0, pooling=m.config.embedding_pooling)
        requests = []
        salt = request_salt(m.config.cache_scope, tenant)
        inputs = body.inputs()
        limit = m.config.max_sequences_per_request  # one engine request per input
        if len(inputs) > limit:
            raise BadRequestError(
                f"input: {len(inputs)} inputs, more than this server takes at once ({limit})",
                param="input",
            )
        total = 0  # tokens over the inputs so far (max_embedding_tokens)
        for i, item in enumerate(inputs):
            ids = (
                await self._tokenize(m, m.frontend.encode_prompt, item, len(item), "input")
                if isinstance(item, str)
                else item
            )
            try:
                m.frontend.check_token_ids(ids, "input")
            except ValueError as exc:
                raise BadRequestError(str(exc), param="input") from None
            check_fits(len(ids), max_len, i)
            total += len(ids)
            check_total(total, m.config.max_embedding_tokens)
            requests.append(
                EngineRequest(
                    request_id=f"{base_id}-{i}",
                    prompt_token_ids=ids,
                    sampling_params=params,
                    priority=body.priority,
                    tenant=tenant,
                    block_hashes=m.frontend.block_hashes(
                        ids, m.config.engine.block_size, salt=salt
                    ),
                    caller=self._actor_name,
                    cache_salt=salt,
                )
            )
        timeout = m.config.request_timeout_s
        if body.request_timeout_s is not None:
            timeout = min(timeout, body.request_timeout_s)
        try:
            vectors = await asyncio.wait_for(
                asyncio.gather(*(embed_one(m.replica, r) for r in requests)), timeout
            )
        except TimeoutError:
            raise RequestTimeoutError(
                "The request did not finish within its deadline (request_timeout_s).",
                code="request_timeout",
            ) from None
        answer = functools.partial(
            embedding_response,
            vectors,
            body.encoding_format,
            m.config.model_name,
            sum(len(r.prompt_token_ids) for r in requests),
        )
        content = await asyncio.to_thread(lambda: json.dumps(answer()).encode())
        return Response(content, media_type="application/json")

    async def _chat_choices(
        self, m: ServedModel, body: ChatCompletionRequest, tenant: str
    ) -> tuple[list[Choice], DeclaredTools | None, bool | None]:
        """A chat request's choices, the tools its replies may call, and whether its replies start
        inside a reasoning block (None: no reasoning parser)."""
        if body.max_completion_tokens is not None:
            body.max_tokens = body.max_completion_tokens
        self._check_fanout(m, 1, body.n)
        tools = (
            [
                ToolSpec(t.function.name, t.function.description, t.function.parameters)
                for t in body.tools or []
            ]
            if body.tool_choice_name != "none"
            else []
        )
        constraint = body.output_constraint()
        if tools and constraint is not None:
            raise BadRequestError(
                f"{constraint.field_name}: cannot be combined with tools unless "
                "tool_choice is none",
                param=constraint.field_name,
            )
        if tools:
            constraint = tool_constraint(
                tools, body.tool_choice_name, m.tool_format, body.parallel_tool_calls
            )
        constraint = await self._check(m, constraint)
        messages, tool_args = prepare_chat(
            [self._message(msg) for msg in body.messages],
            tools,
            m.tool_format,
            m.renders_tools,
        )
        # Each message renders one token at least (its role's markers): counted as a token's
        # worth of characters, a flood of empty messages is refused before the template runs.
        num_chars = (
            sum(len(m["content"]) for m in messages)
            + len(messages) * MAX_CHARS_PER_TOKEN
            + len(json.dumps(tool_args or []))
        )
        prompt = await self._tokenize(
            m,
            functools.partial(m.frontend.encode_chat, tools=tool_args, options=body.chat_options()),
            messages,
            num_chars,
            "messages",
            f"characters (each message counts {MAX_CHARS_PER_TOKEN} besides its content)",
        )
        if body.truncate_prompt_tokens is not None:
            prompt = prompt[-body.truncate_prompt_tokens :]
        opened = m.reasoning.opened_by(prompt) if m.reasoning is not None else None
        if constraint is not None and opened and m.reasoning is not None:
            # The reasoning block is free; the constraint applies to the answer after it.
            constraint = replace(constraint, after=m.reasoning.end_id)
        choices = await self._choices(m, body, [prompt], body.num_logprobs, tenant, constraint)
        declared = DeclaredTools.of(tools, m.tool_format) if tools else None
        return choices, declared, opened

    def _check_fanout(self, m: ServedModel, num_prompts: int, n: int) -> None:
        limit = m.config.max_sequences_per_request
        if num_prompts * n > limit:
            raise BadRequestError(
                f"n: {num_prompts} prompt(s) x n={n} asks for more than {limit} sequences",
                param="n",
            )

    async def _check(
        self, m: ServedModel, constraint: StructuredOutput | None
    ) -> StructuredOutput | None:
        """A valid constraint (checked in the grammar sandbox, off the event loop) or a 400."""
        if constraint is None:
            return None
        return await asyncio.to_thread(m.grammars.check, constraint)

    def _splitter(self, m: ServedModel, opened: bool | None) -> ReasoningSplitter | None:
        """A reply's reasoning splitter; None without a reasoning parser."""
        if m.reasoning is None or opened is None:
            return None
        return ReasoningSplitter(m.reasoning.fmt, opened)

    async def _choices(
        self,
        m: ServedModel,
        body: Any,
        prompts: list[list[int]],
        logprobs: int | None,
        tenant: str,
        constraint: StructuredOutput | None,
    ) -> list[Choice]:
        max_len = await m.max_model_len()
        lora = m.adapter(body.model)
        kind = "chatcmpl" if isinstance(body, ChatCompletionRequest) else "cmpl"
        base_id = f"{kind}-{uuid.uuid4().hex}"
        choices = []
        asked_logprobs = 0
        bad_words = m.frontend.bad_words_token_ids(body.bad_words or [])
        salt = request_salt(m.config.cache_scope, tenant, body.cache_salt, body.prompt_cache_key)
        for p, prompt in enumerate(prompts):
            try:
                m.frontend.check_token_ids(prompt)
            except ValueError as exc:
                raise BadRequestError(str(exc), param="prompt") from None
            max_tokens = body.max_tokens if body.max_tokens is not None else max_len - len(prompt)
            if max_tokens < 1 or len(prompt) + max_tokens > max_len:
                raise ContextLengthError(
                    max_len,
                    len(prompt),
                    max(max_tokens, body.max_tokens or 0),
                    "messages" if kind == "chatcmpl" else "prompt",
                )
            if logprobs is not None:
                asked_logprobs += body.n * max_tokens * (logprobs + 1)
            if body.asked_prompt_logprobs is not None:
                asked_logprobs += body.n * len(prompt) * (body.asked_prompt_logprobs + 1)
            hashes = m.frontend.block_hashes(
                prompt, m.config.engine.block_size, m.routing_lora_key(lora), salt
            )
            too_long = [s for s in body.stop if len(s) > m.config.max_stop_string_chars]
            if too_long:
                raise BadRequestError(
                    f"stop: stop strings may have at most {m.config.max_stop_string_chars} "
                    "characters",
                    param="stop",
                )
            for i in range(body.n):
                params = body.sampling_params(max_tokens, logprobs, constraint, i, bad_words)
                params.check_vocab(m.frontend.info.vocab_size)
                request = EngineRequest(
                    request_id=f"{base_id}-{p * body.n + i}",
                    prompt_token_ids=prompt,
                    sampling_params=params,
                    priority=body.priority,
                    tenant=tenant,
                    block_hashes=hashes,
                    caller=self._actor_name,
                    lora_name=lora,
                    cache_salt=salt,
                )
                choices.append(
                    Choice(
                        p * body.n + i,
                        p,
                        request,
                        m.frontend,
                        m.metrics,
                        m.config.max_migrations,
                        prefill=m.prefill,
                    )
                )
        check_budget(
            asked_logprobs,
            m.config.max_logprob_entries,
            body.field_name("logprobs"),
            body.field_name("max_tokens"),
        )
        return choices

    # ---- responses -----------------------------------------------------------------------------
    def _deltas(
        self, m: ServedModel, body: Any, choices: list[Choice]
    ) -> AsyncIterator[ChoiceDelta]:
        """The choices' deltas as they arrive, until the request's deadline."""
        timeout = m.config.request_timeout_s
        if body.request_timeout_s is not None:
            timeout = min(timeout, body.request_timeout_s)
        return with_deadline(
            merge_streams([c.stream(m.replica) for c in choices]), time.monotonic() + timeout
        )

    async def _respond(
        self,
        m: ServedModel,
        body: Any,
        choices: list[Choice],
        chat: bool,
        tools: DeclaredTools | None = None,
        opened: bool | None = None,
        side: _PromptSide | None = None,
    ) -> Response:
        """side: what each choice shows of its prompt (echo, prompt log-probabilities)."""
        side = side if side is not None else _PromptSide()
        rid = choices[0].request.request_id.rsplit("-", 1)[0]
        model = self._answering_model(m, body, choices)
        deltas = self._deltas(m, body, choices)
        if body.stream:
            # Wait for the first delta so that admission errors (overload, a replica's rejection)
            # still get their HTTP status instead of an in-band error after a 200.
            try:
                first = await anext(deltas, None)
            except Exception as exc:
                return error_response(exc)
            options = body.stream_options
            include_usage = bool(options and options.include_usage)
            continuous_usage = bool(options and options.continuous_usage_stats)
            return StreamingResponse(
                self._sse_stream(
                    m,
                    rid,
                    _prepend(first, deltas),
                    chat,
                    include_usage,
                    tools,
                    opened,
                    side.prefixes,
                    model,
                    continuous_usage,
                ),
                media_type="text/event-stream",
            )
        try:
            return await self._collect(
                m, rid, deltas, len(choices), chat, tools, opened, side, model
            )
        except Exception as exc:
            return error_response(exc)

    @staticmethod
    def _answering_model(m: ServedModel, body: Any, choices: list[Choice]) -> str:
        """The `model` a reply names: the adapter's as the client named it, else the served
        model's."""
        if choices and choices[0].request.lora_name is not None:
            return str(body.model)
        return m.config.model_name

    async def _collect(
        self,
        m: ServedModel,
        rid: str,
        deltas: AsyncIterator[ChoiceDelta],
        n: int,
        chat: bool,
        tools: DeclaredTools | None,
        opened: bool | None,
        side: _PromptSide,
        model: str,
    ) -> Response:
        texts = list(side.prefixes) if side.prefixes is not None else [""] * n
        logprobs: list[list] = [[] for _ in range(n)]
        prompt_logprobs: list[list] = [[] for _ in range(n)]
        finish: list[str | None] = [None] * n
        tally = UsageTally()
        async for d in deltas:
            texts[d.index] += d.text
            if d.logprobs:
                logprobs[d.index] += d.logprobs
            if d.prompt_logprobs:
                prompt_logprobs[d.index] = d.prompt_logprobs
            if d.finish_reason is not None:
                finish[d.index] = d.finish_reason
            tally.add(d)
        if side.echo_logprobs is not None:  # the prompt's entries lead each choice's logprobs
            k = side.echo_logprobs
            logprobs = [[e[: k + 1] for e in p] + g for p, g in zip(prompt_logprobs, logprobs)]
        encode = functools.partial(
            functools.partial(self._response_body, m),
            rid,
            texts,
            logprobs,
            finish,
            tally,
            chat,
            tools,
            opened,
            model=model,
        )
        if side.prompt_logprobs or side.echo_logprobs is not None:
            encode = functools.partial(encode, side=side, prompt_logprobs=prompt_logprobs)
        entries = logprobs + prompt_logprobs
        large = sum(num_entries(lp) for lp in entries) > LOGPROBS_OFF_LOOP
        content = await asyncio.to_thread(encode) if large else encode()
        return Response(content, media_type="application/json")

    def _response_body(
        self,
        m: ServedModel,
        rid: str,
        texts: list[str],
        logprobs: list[list],
        finish: list[str | None],
        tally: UsageTally,
        chat: bool,
        tools: DeclaredTools | None,
        opened: bool | None,
        side: _PromptSide | None = None,
        prompt_logprobs: list[list] | None = None,
        model: str | None = None,
    ) -> bytes:
        """The whole response as JSON bytes (on a thread when its logprobs are many)."""
        side = side if side is not None else _PromptSide()
        echo_first = side.first_tokens if side.echo_logprobs is not None else None
        out_choices, out_logprobs = [], []
        for i in range(len(texts)):
            if chat:
                split = _ChatSplit(tools, self._splitter(m, opened))
                message = split.message(texts[i])
                out_choices.append(
                    {
                        "index": i,
                        "message": message,
                        "finish_reason": split.finish_reason(finish[i]),
                    }
                )
                lp = chat_logprobs(logprobs[i], m.texts) if logprobs[i] else None
            else:
                out_choices.append({"index": i, "text": texts[i], "finish_reason": finish[i]})
                first = echo_first[i] if echo_first is not None else None
                lp = (
                    completion_logprobs(logprobs[i], m.texts, first)
                    if logprobs[i] or first is not None
                    else None
                )
                if side.prompt_logprobs and prompt_logprobs is not None:
                    out_choices[-1]["prompt_logprobs"] = prompt_logprobs_json(
                        prompt_logprobs[i], m.texts
                    )
            out_logprobs.append(lp)
        head: dict[str, Any] = {
            "id": rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": model or m.config.model_name,
            "usage": tally.as_dict(),
        }
        if chat and side.prompt_logprobs and prompt_logprobs:  # one prompt: at the top, as vLLM
            head["prompt_logprobs"] = prompt_logprobs_json(prompt_logprobs[0], m.texts)
        return response_json(head, out_choices, out_logprobs)

    async def _sse_stream(
        self,
        m: ServedModel,
        rid: str,
        deltas: AsyncIterator[ChoiceDelta],
        chat: bool,
        include_usage: bool,
        tools: DeclaredTools | None,
        opened: bool | None,
        prefixes: list[str] | None = None,
        model: str | None = None,
        continuous_usage: bool = False,
    ) -> AsyncIterator[bytes]:
        """continuous_usage: every chunk carries the usage so far (vLLM's
        stream_options.continuous_usage_stats)."""
        created = int(time.time())
        head = {
            "id": rid,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created,
            "model": model or m.config.model_name,
        }
        splits: dict[int, _ChatSplit] = {}
        unechoed = set(range(len(prefixes))) if prefixes is not None else set()
        tally = UsageTally()
        try:
            async for d in deltas:
                tally.add(d)
                usage = {"usage": tally.as_dict()} if continuous_usage else {}
                lp = None
                if d.logprobs:
                    lp = (chat_logprobs if chat else completion_logprobs)(d.logprobs, m.texts)
                if not chat:
                    text = d.text
                    if d.index in unechoed and prefixes is not None:  # the echo goes first
                        unechoed.discard(d.index)
                        text = prefixes[d.index] + text
                    if text or lp or d.finish_reason is not None:
                        choice = {
                            "index": d.index,
                            "text": text,
                            "logprobs": lp,
                            "finish_reason": d.finish_reason,
                        }
                        yield _sse({**head, "choices": [choice], **usage})
                else:
                    first = d.index not in splits
                    split = splits.setdefault(d.index, _ChatSplit(tools, self._splitter(m, opened)))
                    delta = split.delta(d.text, d.finish_reason is not None, first)
                    # A delta whose text is held back (partial UTF-8, a possible stop string or
                    # tool-call marker) sends nothing.
                    if delta or lp or d.finish_reason is not None:
                        choice = {
                            "index": d.index,
                            "delta": delta,
                            "logprobs": lp,
                            "finish_reason": split.finish_reason(d.finish_reason),
                        }
                        yield _sse({**head, "choices": [choice], **usage})
            if include_usage:
                yield _sse({**head, "choices": [], "usage": tally.as_dict()})
        except Exception as exc:
            yield _sse(error_event(exc))
        yield _sse("[DONE]")
