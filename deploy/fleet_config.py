"""Several models behind one ingress: deploy.yaml's `models:` list.

```yaml
args:
  max_num_seqs: 16          # shared: every model's default
  models:
    - {name: chat, model: default, num_replicas: 2, api_key: k1}
    - {name: small, model: /models/tiny, autoscaling: {min_replicas: 0, max_replicas: 2}}
```

Each entry is a whole AppConfig: the settings beside `models` first, the entry's own over them
(a key of the entry replaces the shared one, a section included). Settings of the one ingress
(INGRESS_ONLY) may stand beside `models` only. Args without `models` are one model, as before.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from deploy.api_keys import ApiKeyProfile
from deploy.config import AppConfig
from settings import shown

# One ingress routes to every model; a Serve app of more deployments than this is no longer one
# app anyone can read.
MAX_MODELS = 64
# Settings of the ingress itself (one for all models): set beside `models`, never in an entry.
INGRESS_ONLY = (
    "ingress_replicas",
    "ingress_num_cpus",
    "allow_unauthenticated",
    "max_requests_per_tenant",
    "request_body_timeout_s",
    "max_request_body_bytes",
    # The body is parsed before it names its model.
    "max_messages",
    "unknown_fields",
    # The browser guard runs before a request names its model.
    "allowed_hosts",
    "allowed_origins",
)
# Serve deployment names: what a model name may keep (the rest becomes `_`).
_DEPLOYMENT_CHARS = re.compile(r"[^A-Za-z0-9_.-]")


@dataclass(slots=True)
class FleetConfig:
    """The ingress's settings (those beside `models`) and each model's AppConfig, in order; the
    first model answers requests that name none (/tokenize may)."""

    ingress: AppConfig
    models: list[AppConfig]
    single: bool = True  # the one-model form (no `models:`): deployment names as before

    def __post_init__(self) -> None:
        if not 1 <= len(self.models) <= MAX_MODELS:
            raise ValueError(f"models: 1 to {MAX_MODELS} entries, got {len(self.models)}")
        names = [m.model_name for m in self.models]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"models: each name once, {shown(repeated)} repeated")
        deployments = [self.deployment_name(i) for i in range(len(self.models))]
        if len(set(deployments)) < len(deployments):
            raise ValueError(
                f"models: names {shown(names)} give equal deployment names {shown(deployments)}; "
                "rename one"
            )
        _check_tenants(self.models)

    @classmethod
    def from_args(cls, args: dict[str, Any] | None) -> FleetConfig:
        """deploy.yaml args, with or without `models`; the ValueError names the field by its path
        (`models[1].max_num_seqs: ...`)."""
        shared = dict(args or {})
        entries = shared.pop("models", None)
        if entries is None:
            config = AppConfig.from_args(shared)
            return cls(config, [config])
        if not isinstance(entries, list):
            raise ValueError(
                f"invalid raylm app args: models: a list, got {type(entries).__name__}"
            )
        if len(entries) > MAX_MODELS:
            raise ValueError(
                f"invalid raylm app args: models: at most {MAX_MODELS} entries, got {len(entries)}"
            )
        ingress = AppConfig.from_args(shared)
        models = [_model(shared, entry, i) for i, entry in enumerate(entries)]
        try:
            return cls(ingress, models, single=False)
        except ValueError as exc:
            raise ValueError(f"invalid raylm app args: {exc}") from None

    def deployment_name(self, index: int) -> str:
        """The Serve deployment of model `index`'s replicas (LLMReplica in the one-model form)."""
        if self.single:
            return "LLMReplica"
        name = _DEPLOYMENT_CHARS.sub("_", self.models[index].model_name)
        return f"LLMReplica-{name[:100]}"

    def key_profiles(self) -> dict[str, ApiKeyProfile]:
        """Every key some model accepts, with its profile (equal tenants: _check_tenants)."""
        profiles: dict[str, ApiKeyProfile] = {}
        for model in self.models:
            for key, profile in model.key_profiles().items():
                profiles.setdefault(key, profile)
        return profiles


def _model(shared: dict[str, Any], entry: Any, index: int) -> AppConfig:
    where = f"models[{index}]"
    if not isinstance(entry, dict):
        raise ValueError(f"invalid raylm app args: {where}: a mapping, got {type(entry).__name__}")
    entry = dict(entry)
    for key in INGRESS_ONLY:
        if key in entry:
            raise ValueError(
                f"invalid raylm app args: {where}.{key}: a setting of the one ingress; set it "
                "beside `models`"
            )
    if "name" in entry:
        entry["served_model_name"] = _entry_name(entry, where)
    try:
        return AppConfig.from_args({**shared, **entry})
    except ValueError as exc:
        message = str(exc).removeprefix("invalid raylm app args: ")
        raise ValueError(f"invalid raylm app args: {where}.{message}") from None


def _entry_name(entry: dict[str, Any], where: str) -> str:
    """A model entry's `name` (taken out of it), the short form of served_model_name."""
    if "served_model_name" in entry:
        raise ValueError(
            f"invalid raylm app args: {where}.name: set name or served_model_name, not both"
        )
    name = entry.pop("name")
    if not isinstance(name, str) or not 1 <= len(name) <= 256:
        raise ValueError(
            f"invalid raylm app args: {where}.name: a string of 1 to 256 characters, got "
            f"{shown(name)}"
        )
    return name


def _check_tenants(models: list[AppConfig]) -> None:
    """A key names one tenant: the per-tenant cap counts a request before its model is known."""
    tenants: dict[str, str] = {}
    for i, model in enumerate(models):
        for key, profile in model.key_profiles().items():
            seen = tenants.setdefault(key, profile.tenant)
            if seen != profile.tenant:
                raise ValueError(
                    f"models[{i}].api_keys: a key shared with an earlier model names tenant "
                    f"{shown(profile.tenant)} there and {shown(seen)} here; one key, one tenant"
                )
