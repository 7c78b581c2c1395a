"""Weight updates and sleep at run time (docs/rl.md), as a route mixin of the ingress: every
replica of a model gets the command in turn (cluster/weights_admin.py), under the admin key.

- POST /v1/update_weights `{model?, path, in_flight?}`: new weights from a safetensors checkpoint
  every replica's host can read; a bad one is a 400 naming the tensor, and the old weights keep
  serving on every replica that had not taken the new ones.
- POST /v1/sleep `{model?, level?, discard_weights?}` and /v1/wake_up `{model?}`: while a model
  sleeps its requests answer 503 with Retry-After, and /health says so.
"""

from __future__ import annotations

import asyncio
from typing import Any, Literal

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool

from cluster.weights_admin import MAX_WEIGHTS_PATH_CHARS, WeightsCommand
from deploy.admin_gate import WEIGHTS_GATE, AdminBodies
from deploy.errors import (
    NoReplicasError,
    error_response,
)
from deploy.http_app import app
from deploy.lora import MAX_MODEL_NAME_CHARS


class UpdateWeightsRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = Field(default=None, max_length=MAX_MODEL_NAME_CHARS)
    path: str = Field(min_length=1, max_length=MAX_WEIGHTS_PATH_CHARS)
    in_flight: Literal["finish", "recompute"] = "finish"


class SleepRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = Field(default=None, max_length=MAX_MODEL_NAME_CHARS)
    level: Literal[1, 2] = 1
    discard_weights: StrictBool = False


class WakeUpRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = Field(default=None, max_length=MAX_MODEL_NAME_CHARS)


class AdminRoutes(AdminBodies):
    """POST /v1/update_weights, /v1/sleep and /v1/wake_up (allow_weight_updates; an admin key)."""

    # Made on first use (the ingress's __init__ is not this mixin's): each model's sleep level as
    # this ingress last set it, and one weights change at a time.
    _asleep: dict[str, int]
    _weights_lock_: asyncio.Lock

    @app.post("/v1/update_weights")
    async def update_weights(self, request: Request) -> JSONResponse:
        return await self._weights(request, UpdateWeightsRequest, "update_weights")

    @app.post("/v1/sleep")
    async def sleep(self, request: Request) -> JSONResponse:
        return await self._weights(request, SleepRequest, "sleep")

    @app.post("/v1/wake_up")
    async def wake_up(self, request: Request) -> JSONResponse:
        return await self._weights(request, WakeUpRequest, "wake_up")

    def health_report(self) -> dict[str, Any]:
        """/health's body: `asleep` with each sleeping model's level, else `ok`."""
        asleep = {name: level for name, level in self._sleep_levels().items() if level}
        return {"status": "asleep", "asleep": asleep} if asleep else {"status": "ok"}

    def _sleep_levels(self) -> dict[str, int]:
        levels = getattr(self, "_asleep", None)
        if levels is None:
            levels = self._asleep = {}
        return levels

    async def _weights(self, request: Request, schema: type, op: str) -> JSONResponse:
        try:
            m, body = await self._admin_body(request, schema, WEIGHTS_GATE)
            fields = body.model_dump(exclude={"model"})
            replicas = sorted(m.lora_admin.replica_ids())
            if not replicas:
                raise NoReplicasError("No model replica is known yet; retry.", code="no_replicas")
            async with self._weights_lock():
                states = {
                    r: await m.lora_admin.handle.weights_command.remote(
                        WeightsCommand(r, op, **fields)
                    )
                    for r in replicas
                }
            self._sleep_levels()[m.name] = max(s["sleep_level"] for s in states.values())
        except Exception as exc:
            return error_response(exc)
        return JSONResponse({"model": m.name, "op": op, "replicas": states})

    def _weights_lock(self) -> asyncio.Lock:
        lock = getattr(self, "_weights_lock_", None)
        if lock is None:
            lock = self._weights_lock_ = asyncio.Lock()
        return lock
