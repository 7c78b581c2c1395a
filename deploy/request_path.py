"""The ingress's shared request path: what every route family (a mixin of `OpenAIIngress`)
reaches through `self`.

A route mixin subclasses `RequestPath` and declares its routes on `deploy.http_app.app`:

    class AnthropicRoutes(RequestPath):
        @app.post("/v1/messages")
        async def messages(self, request: Request) -> Response:
            return await self._serve(request, MessagesRequest, self._messages)

Entry points (methods of the ingress, all on this class):
- `_serve(request, schema, answer)`: authorize the key, admit the tenant, read and validate the
  body against `schema`, resolve its model, then `await answer(model, body, tenant)`. An
  exception from `answer` becomes OpenAI error JSON; the tenant's place is held until the
  response (or its stream) ends.
- `_authorize(request)`: the caller by its key, for routes that read no body.
- `_tokenize(m, encode, prompt, num_chars, ...)`: encode off the event loop after the size check.
- `_message(message)`: a validated chat message as the frontend's dict.
"""

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from deploy.body import MAX_CHARS_PER_TOKEN, body_limit, parse_body, read_body
from deploy.browser_guard import BrowserPolicy
from deploy.config import AppConfig
from deploy.errors import BadRequestError, error_response
from deploy.fields import Ignored
from deploy.lora import check_adapter_scope
from deploy.models import Caller, ModelTable, ServedModel
from deploy.tenants import TenantLimiter

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
        try:
            model, body = await self._parse(request, schema, caller, ignored)
            response = await answer(model, body, lease.tenant)
        except Exception as exc:
            response = error_response(exc)
        except BaseException:  # cancelled: the client is gone
            lease.release()
            raise
        response.headers.update(ignored.header())
        return lease.hold(response)

    async def _parse(
        self, request: Request, schema: type, caller: Caller, ignored: Ignored
    ) -> tuple[ServedModel, Any]:
        """The model the body names and the validated body, its priority capped by the caller's
        key for that model; the fields it dropped (unknown_fields: ignore) go in `ignored`."""
        # Before the body names its model: the largest any model takes (none is woken for it).
        limit = max(body_limit(m.config, m.context_bound()) for m in self.table.models)
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
        return model, body

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

    @staticmethod
    def _message(message: Any) -> dict[str, Any]:
        out: dict[str, Any] = {
            "role": message.role if message.role != "developer" else "system",
            "content": message.text(),
        }
        if message.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in message.tool_calls]
        if message.tool_call_id is not None:
            out["tool_call_id"] = message.tool_call_id
        return out
