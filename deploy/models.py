"""The models an ingress serves, and the one place a request's `model` finds its entry.

Each ServedModel holds what the ingress needs of one model: its settings, the handle of its
replicas, its tokenizer frontend and what is derived from it. ModelTable.resolve turns a request's
`model` (and the caller's key) into one of them, or into the OpenAI error the caller should see.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
from dataclasses import dataclass, field
from typing import Any

from ray.serve.handle import DeploymentHandle

from cluster.fleet_view import replica_ids, replica_reports
from cluster.metrics import RequestMetrics
from deploy.api_keys import ApiKeyProfile
from deploy.config import AppConfig
from deploy.errors import AuthenticationError, ModelNotFoundError, RequestTimeoutError
from deploy.image_parts import ServedVision
from deploy.logprobs import TokenTexts
from deploy.lora import LoraAdmin, adapter_cards, adapter_of
from deploy.tools import detect_format, template_renders_tools
from frontend.frontend import Frontend
from frontend.reasoning import Reasoning
from router.adapter_affinity import routing_lora_key
from workers.grammar_sandbox import GrammarSandbox, TokenizerSpec


@dataclass(slots=True)
class ServedModel:
    """One model as the ingress sees it (built once, in the ingress's constructor)."""

    config: AppConfig
    replica: DeploymentHandle
    frontend: Frontend
    metrics: RequestMetrics
    texts: TokenTexts
    grammars: GrammarSandbox
    tool_format: Any
    renders_tools: bool
    reasoning: Reasoning | None
    lora_admin: LoraAdmin
    keys: dict[str, ApiKeyProfile] = field(default_factory=dict)  # empty: open to every caller
    reported_max_model_len: int | None = None  # as its replicas report it, once asked
    # A disaggregated model's prefill replicas (`replica` is then its decode replicas).
    prefill: DeploymentHandle | None = None
    # A vision model's image bounds and token counts (None: the model takes no images).
    vision: ServedVision | None = None

    @classmethod
    def load(cls, config: AppConfig, replica: DeploymentHandle) -> ServedModel:
        frontend = Frontend.load(config.engine.model, config.engine.cache_dir)
        spec = TokenizerSpec.of(frontend.tokenizer, frontend.info.vocab_size)
        return cls(
            config=config,
            replica=replica,
            frontend=frontend,
            metrics=RequestMetrics(config.model_name),
            texts=TokenTexts.of(frontend.tokenizer, frontend.info.vocab_size),
            grammars=GrammarSandbox(spec, timeout_s=config.engine.grammar_timeout_s),
            tool_format=detect_format(frontend.chat_template),
            renders_tools=template_renders_tools(frontend.chat_template),
            reasoning=Reasoning.of(config.reasoning_parser, frontend.tokenizer)
            if config.reasoning_parser is not None
            else None,
            lora_admin=LoraAdmin(replica, functools.partial(replica_ids, replica.deployment_name)),
            keys=config.key_profiles(),
            vision=ServedVision.load(
                frontend.info.model_dir, config.images, config.allowed_media_domains
            ),
        )

    @property
    def name(self) -> str:
        return self.config.model_name

    @property
    def deployments(self) -> list[str]:
        """The Serve deployments of its replicas (a disaggregated model's prefill ones too)."""
        handles = [self.replica] if self.prefill is None else [self.replica, self.prefill]
        return [h.deployment_name for h in handles]

    def routing_lora_key(self, lora: str | None) -> str | None:
        """What an adapter request's prompt is hashed under for prefix-affinity routing: the
        identity its replicas report (their caches key the adapter's blocks by it)."""
        if lora is None:
            return None
        reports = [r for d in self.deployments for r in replica_reports(d).values()]
        return routing_lora_key(lora, (i for r in reports for i in r.scheduler.lora_identities))

    @property
    def base_names(self) -> tuple[str, str]:
        """What `model` may name for the base model (an adapter is `<base>:<adapter>` or its own
        name)."""
        return (self.name, self.config.engine.model)

    @property
    def serves_loras(self) -> bool:
        return bool(self.config.engine.num_lora_slots)

    def adapter(self, model: str | None) -> str | None:
        """The LoRA adapter a request's `model` selects on this model (None: the base)."""
        return adapter_of(model, self.base_names)

    @property
    def can_scale_to_zero(self) -> bool:
        scaling = self.config.autoscaling
        return scaling is not None and scaling.min_replicas == 0

    def context_bound(self) -> int:
        """The longest context this model may have, known without asking a replica (which may
        not be running): the reported one, else the configured or the model's own."""
        if self.reported_max_model_len is not None:
            return self.reported_max_model_len
        return self.config.engine.scheduler.max_model_len or self.frontend.info.max_model_len

    async def max_model_len(self) -> int:
        """The context the replicas run with (asked once; at zero replicas this waits for one)."""
        if self.reported_max_model_len is None:
            try:
                info = await asyncio.wait_for(
                    self.replica.model_info.remote(), self.config.request_timeout_s
                )
            except asyncio.TimeoutError:
                raise RequestTimeoutError(
                    f"No replica of `{self.name}` started within request_timeout_s.",
                    code="request_timeout",
                ) from None
            self.reported_max_model_len = int(info["max_model_len"])
        return self.reported_max_model_len

    async def cards(self, created: int) -> list[dict[str, Any]]:
        """Its /v1/models entries, the base and then its loaded adapters; a model that may be at
        zero replicas is not woken for them (its adapters are then the configured ones)."""
        asleep = self.can_scale_to_zero
        length = self.context_bound() if asleep else await self.max_model_len()
        card = {
            "id": self.name,
            "object": "model",
            "created": created,
            "owned_by": "raylm",
            "max_model_len": length,
        }
        if not self.serves_loras:
            return [card]
        if asleep:
            adapters = list(self.config.engine.lora_modules or {})
        else:
            adapters = await self.replica.list_loras.remote()
        return [card, *adapter_cards(adapters, self.name, created)]


@dataclass(slots=True)
class Caller:
    """Who sent a request: the key it gave (None: none, or no model needs one) and its profile."""

    key: str | None
    profile: ApiKeyProfile | None

    @property
    def tenant(self) -> str:
        return self.profile.tenant if self.profile is not None else "default"


class ModelTable:
    """The ingress's models by name, and the caller checks every route makes."""

    def __init__(self, models: list[ServedModel]) -> None:
        self.models = models
        self.by_name = {m.name: m for m in models}
        # A request may also name a model by its `model` path when that is no other's name.
        for m in models:
            self.by_name.setdefault(m.config.engine.model, m)
        self.keys: dict[str, ApiKeyProfile] = {}
        for m in models:
            for key, profile in m.keys.items():
                self.keys.setdefault(key, profile)
        self.open = any(not m.keys for m in models)  # some model needs no key

    @property
    def default(self) -> ServedModel:
        return self.models[0]

    def authenticate(self, authorization: str) -> Caller:
        """The caller of a request with this Authorization header; 401 when every model needs a
        key and it gave none that any model accepts."""
        if not self.keys:
            return Caller(None, None)
        given = authorization[7:].encode() if authorization.lower().startswith("bearer ") else b""
        match = None
        for key in self.keys:  # every key compared, in constant time each
            if hmac.compare_digest(given, key.encode()):
                match = key
        if given and match is not None:
            return Caller(match, self.keys[match])
        if self.open:  # the open models serve it; a keyed one answers 401 in resolve
            return Caller(None, None)
        raise AuthenticationError(
            "Missing or incorrect API key (Authorization: Bearer <key>).", code="invalid_api_key"
        )

    def resolve(self, name: str | None, caller: Caller) -> tuple[ServedModel, Caller]:
        """The model a request names (None: the first), and the caller as that model knows it
        (its profile under that model's keys). Unknown, or not this key's: 404, as OpenAI answers
        both; a keyed model called without a key: 401."""
        model = self.default if name is None else self._lookup(name)
        if model is not None and not model.keys:
            return model, Caller(caller.key, None)
        if model is not None and caller.key is None:
            raise AuthenticationError(
                "Missing or incorrect API key (Authorization: Bearer <key>).",
                code="invalid_api_key",
            )
        if model is not None and caller.key in model.keys:
            return model, Caller(caller.key, model.keys[caller.key])
        served = ", ".join(f"`{m.name}`" for m in self.visible(caller))
        raise ModelNotFoundError(
            f"The model `{name}` does not exist or you do not have access to it; "
            f"this server serves {served or 'no model for this key'}.",
            param="model",
            code="model_not_found",
        )

    def _lookup(self, name: str) -> ServedModel | None:
        """The model `name` names: a model, `<model>:<adapter>`, or an adapter's own name, which
        belongs to the model that declares it, else to the only model serving adapters."""
        if name in self.by_name:
            return self.by_name[name]
        base, sep, _ = name.rpartition(":")
        if sep:
            return self.by_name.get(base)
        declared = [m for m in self.models if name in (m.config.engine.lora_modules or {})]
        serving = [m for m in self.models if m.serves_loras]
        candidates = declared or serving
        return candidates[0] if len(candidates) == 1 else None

    def visible(self, caller: Caller) -> list[ServedModel]:
        """The models this caller may use, in order (what /v1/models lists)."""
        return [m for m in self.models if not m.keys or caller.key in m.keys]
