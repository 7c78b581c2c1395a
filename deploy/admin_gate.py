"""Run-time admin changes (LoRA adapters, weights and sleep): the setting and key that gate each
kind, and how their bodies are read, once for every admin route."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fastapi import Request

from deploy.body import parse_body, read_body
from deploy.errors import BadRequestError, PermissionDeniedError
from deploy.models import ServedModel
from deploy.request_path import RequestPath

# An admin body names a model, an adapter or a path: far below any prompt's limit.
MAX_ADMIN_BODY_BYTES = 64 * 1024


@dataclass(frozen=True, slots=True)
class AdminGate:
    """One kind of run-time change: the model setting that allows it and how a refusal reads."""

    setting: str  # the ModelConfig flag, e.g. allow_runtime_lora
    change: str  # what the server does not allow, e.g. "Loading ... at run time"
    verb: str  # what the key may not do, e.g. "load or unload LoRA adapters"
    code: str  # the 400's code when the setting is off

    def check(self, allowed: bool, profile_admin: bool | None) -> None:
        """Refuse unless the app allows the change and the caller's key may make it
        (profile_admin None: the app has no keys, so it is open to its callers)."""
        if not allowed:
            raise BadRequestError(
                f"{self.change} is off on this server ({self.setting}: false).", code=self.code
            )
        if profile_admin is False:
            raise PermissionDeniedError(
                f"This API key may not {self.verb} (its profile needs admin: true).",
                code="permission_denied",
            )


LORA_GATE = AdminGate(
    "allow_runtime_lora",
    "Loading and unloading LoRA adapters at run time",
    "load or unload LoRA adapters",
    "runtime_lora_disabled",
)
WEIGHTS_GATE = AdminGate(
    "allow_weight_updates",
    "Updating weights and sleeping at run time",
    "update weights or put the model to sleep",
    "weight_updates_disabled",
)


class AdminBodies(RequestPath):
    """The ingress's reading of an admin route's body, shared by the adapter and weight routes."""

    async def _admin_body(
        self, request: Request, schema: type, gate: AdminGate
    ) -> tuple[ServedModel, Any]:
        """The change's model and body, once that model allows the change and the caller's key
        may make it (`model` in the body: the first model when left out)."""
        caller = self._authorize(request)
        raw = await read_body(request, MAX_ADMIN_BODY_BYTES, self.config.request_body_timeout_s)
        body: Any = await parse_body(raw, schema, self.config.max_messages)
        m, caller = self.table.resolve(body.model, caller)
        admin = None if caller.profile is None else caller.profile.admin
        gate.check(getattr(m.config, gate.setting), admin)
        await m.max_model_len()  # the handle's first call: its router learns the replicas
        return m, body
