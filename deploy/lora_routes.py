"""Run-time LoRA adapter loading and unloading (vLLM's admin routes), as a route mixin of the
ingress."""

from fastapi import Request
from fastapi.responses import JSONResponse

from deploy.admin_gate import LORA_GATE, AdminBodies
from deploy.errors import error_response
from deploy.http_app import app
from deploy.lora import LoadLoraAdapterRequest, UnloadLoraAdapterRequest


class LoraRoutes(AdminBodies):
    """POST /v1/load_lora_adapter and /v1/unload_lora_adapter (allow_runtime_lora; an admin key)."""

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(self, request: Request) -> JSONResponse:
        """Load a LoRA adapter on every replica of a model (allow_runtime_lora; an admin key)."""
        try:
            m, body = await self._admin_body(request, LoadLoraAdapterRequest, LORA_GATE)
            loaded = await m.lora_admin.load(body.lora_name, body.lora_path)
        except Exception as exc:
            return error_response(exc)
        return JSONResponse({"lora_name": body.lora_name, "status": "loaded", "replicas": loaded})

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(self, request: Request) -> JSONResponse:
        """Unload a LoRA adapter from every replica of a model; refused while requests use it."""
        try:
            m, body = await self._admin_body(request, UnloadLoraAdapterRequest, LORA_GATE)
            loaded = await m.lora_admin.unload(body.lora_name)
        except Exception as exc:
            return error_response(exc)
        return JSONResponse({"lora_name": body.lora_name, "status": "unloaded", "replicas": loaded})
