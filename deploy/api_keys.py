"""API keys: who each key belongs to (its tenant, priority ceiling, admin right and adapters),
from the app's `api_keys` or the environment variable `api_keys_env` names."""

from __future__ import annotations

import json
import os
from dataclasses import MISSING, dataclass

from deploy.lora import check_scope_setting
from scheduler.request import MAX_PRIORITY, MAX_TENANT_CHARS
from settings import build, check_settings, clipped, setting


@dataclass(slots=True)
class ApiKeyProfile:
    """Who a key belongs to: its tenant (the fair policy's unit) and its priority ceiling."""

    tenant: str = setting(MISSING, "the fair policy's unit of accounting")
    # Lower is more urgent: a request asking for more urgency than this gets this.
    max_priority: int = setting(
        0, "the most urgent priority the key may ask for", ge=-MAX_PRIORITY, le=MAX_PRIORITY
    )
    admin: bool = setting(
        False, "the key may load and unload LoRA adapters at run time (allow_runtime_lora)"
    )
    loras: list[str] | None = setting(
        None,
        "the LoRA adapters the key may name and see in /v1/models (others are a 404, as if they "
        "did not exist); unset: every adapter",
    )

    def __post_init__(self) -> None:
        check_settings(self)
        self.loras = check_scope_setting(self.loras)
        if not 1 <= len(self.tenant) <= MAX_TENANT_CHARS:
            raise ValueError(
                f"tenant: must have 1 to {MAX_TENANT_CHARS} characters, got {len(self.tenant)}"
            )


def _env_value(name: str) -> str:
    """The environment variable's value; ValueError when it is unset or empty."""
    try:
        raw = os.environ.get(name)
    except ValueError:  # a name no environment can hold (a NUL character)
        raw = None
    if not raw:
        # On a cluster the app is built by a Ray task on some node: it has the environment that
        # node's `ray start` had, never the shell of `serve run` or `serve deploy`.
        raise ValueError(
            f"api_keys_env: environment variable {clipped(name)} is not set where the app is "
            "built (on a running cluster: in the environment of `ray start` on every node, not "
            "of `serve run`; docs/operations.md#where-api_keys_env-is-read)"
        )
    return raw


UNLIMITED_KEY = ApiKeyProfile(tenant="default", max_priority=-MAX_PRIORITY, admin=True)


def keys_from_env(name: str) -> dict[str, ApiKeyProfile]:
    """The key profiles the environment variable `name` holds as JSON (ValueError naming the
    variable, never its content, when it is unset or malformed)."""
    raw = _env_value(name)
    try:
        data = json.loads(raw)
        return {str(k): build(ApiKeyProfile, v) for k, v in dict(data).items()}
    except (ValueError, TypeError) as exc:
        # The message names the variable, never its content: it holds secrets.
        raise ValueError(
            f"api_keys_env: {clipped(name)} must hold a JSON object key -> "
            f"{{tenant, max_priority}} ({type(exc).__name__})"
        ) from None
