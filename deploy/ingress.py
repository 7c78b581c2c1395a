"""OpenAIIngress: the OpenAI-compatible HTTP front of the cluster (FastAPI on Ray Serve).

Routing and wiring only. Every route is declared on `deploy.http_app.app`; route families live in
mixin modules listed among the class's bases (`@serve.ingress` serves inherited routes too), and
every request takes the shared path of `deploy.request_path.RequestPath` (validate, tokenize,
EngineRequests, stream or collect) answered in its route's output format (deploy/chat_format.py,
deploy/completion_format.py, deploy/responses_events.py).

No `from __future__ import annotations` in a module that declares routes: FastAPI resolves the
route signatures' annotations at run time, and @serve.deployment serializes the class when it is
decorated.
"""

import time

import ray
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from ray import serve
from ray.serve.handle import DeploymentHandle

from cluster.fleet_view import replica_reports
from deploy import metrics_page
from deploy.admin_routes import AdminRoutes
from deploy.anthropic_routes import AnthropicRoutes
from deploy.batch_routes import BatchRoutes
from deploy.browser_guard import BrowserPolicy
from deploy.chat_format import ChatFormat
from deploy.completion_format import CompletionFormat, PromptSide
from deploy.embedding_routes import EmbeddingRoutes
from deploy.engine_requests import Generation, Prompts
from deploy.errors import error_response
from deploy.fleet_config import FleetConfig
from deploy.http_app import app
from deploy.lora import scoped_cards
from deploy.lora_routes import LoraRoutes
from deploy.models import ModelTable, ServedModel
from deploy.reply_format import TypedEvents, answer
from deploy.request_path import RequestPath
from deploy.responses import ResponsesRequest, renamed
from deploy.responses_events import ResponseBuilder
from deploy.schemas import ChatCompletionRequest, CompletionRequest
from deploy.stream_priority import align_proxy_priority
from deploy.tenants import TenantLimiter
from deploy.tokenize_routes import TokenizeRoutes
from workers.process import set_niceness


def _responses_format(body: ResponsesRequest, gen: Generation) -> TypedEvents:
    """A Responses reply (typed events, or the response object) of a chat generation."""
    builder = ResponseBuilder(body, gen.name, gen.reply_split(), gen.reasoning_counter())
    return TypedEvents(builder, builder.response)


@serve.deployment(name="OpenAIIngress")
@serve.ingress(app)
class OpenAIIngress(
    AdminRoutes,
    TokenizeRoutes,
    LoraRoutes,
    EmbeddingRoutes,
    AnthropicRoutes,
    BatchRoutes,
    RequestPath,
):
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
            # The ingress streams every token the engine makes: it runs at the engine's priority,
            # and so does the Serve proxy that writes them (deploy/stream_priority.py).
            set_niceness(config.engine.process_niceness)
            align_proxy_priority(config.engine.process_niceness)
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

    # ---- the server ----------------------------------------------------------------------------
    @app.get("/health")
    async def health(self) -> JSONResponse:
        return JSONResponse(self.health_report())  # `asleep` while a model sleeps

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

    # ---- generation ----------------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self._serve(request, CompletionRequest, self._complete)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        return await self._serve(request, ChatCompletionRequest, self._chat)

    @app.post("/v1/responses")
    async def responses(self, request: Request) -> Response:
        return await self._serve(request, ResponsesRequest, self._responses)

    async def _chat(self, m: ServedModel, body: ChatCompletionRequest, tenant: str) -> Response:
        return await self._answer_chat(m, body, tenant, ChatFormat, body.stream)

    async def _responses(self, m: ServedModel, body: ResponsesRequest, tenant: str) -> Response:
        """POST /v1/responses: the chat completion it means, answered as a Responses object."""
        try:
            chat = body.as_chat(self.config.max_messages)
            chat.priority = body.priority  # already capped by the key
            gen = await self._chat_generation(m, chat, tenant)
        except Exception as exc:
            raise renamed(exc) from None
        return await answer(_responses_format(body, gen), gen.deltas(), bool(body.stream))

    async def _complete(self, m: ServedModel, body: CompletionRequest, tenant: str) -> Response:
        prompts, echoes = await self._completion_prompts(m, body)
        constraint = await self._check(m, body.output_constraint())
        asked = Prompts(prompts, "prompt", "cmpl", body.logprobs, constraint)
        gen = await self._generate(m, body, asked, tenant)
        side = PromptSide(
            [echoes[c.prompt_index] for c in gen.choices] if echoes is not None else None,
            [c.request.prompt_token_ids[0] for c in gen.choices],
            body.logprobs if body.echo_logprobs else None,
            body.prompt_logprobs is not None,
        )
        return await answer(CompletionFormat(gen, side), gen.deltas(), body.stream)

    async def _completion_prompts(
        self, m: ServedModel, body: CompletionRequest
    ) -> tuple[list[list[int]], list[str] | None]:
        """Each prompt's token ids (truncated as asked), and with echo its text as the model saw
        it (decoded when given as ids, or when truncated)."""
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
        if not body.echo:
            return prompts, None
        echoes = [
            p if isinstance(p, str) and k is None else m.frontend.decode(ids)
            for p, ids in zip(raw_prompts, prompts)
        ]
        return prompts, echoes
