"""Run-time LoRA adapter loading and unloading (vLLM's admin routes), as a route mixin of the
ingress."""

from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from deploy.body import parse_body, read_body
from deploy.errors import error_response
from deploy.http_app import app
from deploy.lora import LoadLoraAdapterRequest, UnloadLoraAdapterRequest, check_admin
from deploy.models import ServedModel
from deploy.request_path import RequestPath

# An adapter change's body names an adapter and a path: far below any prompt's limit.
MAX_ADMIN_BODY_BYTES = 64 * 1024


class LoraRoutes(RequestPath):
    """POST /v1/load_lora_adapter and /v1/unload_lora_adapter (allow_runtime_lora; an admin key)."""

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(self, request: Request) -> JSONResponse:
        """Load a LoRA adapter on every replica of a model (allow_runtime_lora; an admin key)."""
        try:
            m, body = await self._admin_body(request, LoadLoraAdapterRequest)
            loaded = await m.lora_admin.load(body.lora_name, body.lora_path)
        except Exception as exc:
            return error_response(exc)
        return JSONResponse({"lora_name": body.lora_name, "status": "loaded", "replicas": loaded})

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(self, request: Request) -> JSONResponse:
        """Unload a LoRA adapter from every replica of a model; refused while requests use it."""
        try:
            m, body = await self._admin_body(request, UnloadLoraAdapterRequest)
            loaded = await m.lora_admin.unload(body.lora_name)
        except Exception as exc:
            return error_response(exc)
        return JSONResponse({"lora_name": body.lora_name, "status": "unloaded", "replicas": loaded})

    async def _admin_body(self, request: Request, schema: type) -> tuple[ServedModel, Any]:
        """A run-time adapter change's model and body, once that model allows them and the
        caller's key may make them (`model` in the body: the first model when left out)."""
        caller = self._authorize(request)
        raw = await read_body(request, MAX_ADMIN_BODY_BYTES, self.config.request_body_timeout_s)
        body: Any = await parse_body(raw, schema, self.config.max_messages)
        m, caller = self.table.resolve(body.model, caller)
        check_admin(
            m.config.allow_runtime_lora, None if caller.profile is None else caller.profile.admin
        )
        await m.max_model_len()  # the handle's first call: its router learns the replicas
        return m, body
