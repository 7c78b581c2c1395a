"""OpenAI error JSON and the one exception-to-status mapping of the HTTP layer."""

from __future__ import annotations

import logging
import math
import re
import uuid
from collections.abc import Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from ray.exceptions import ActorUnavailableError, RayActorError, RayError, RayTaskError
from ray.serve.exceptions import BackPressureError

from engine.asleep import EngineAsleepError
from scheduler.lora_slots import UnknownLoraError

logger = logging.getLogger(__name__)


class APIError(Exception):
    """An error the client caused or must react to, with its HTTP status and OpenAI type."""

    status = 500
    type = "internal_error"

    def __init_subclass__(cls, status: int = 0, error_type: str = "", **kwargs: Any) -> None:
        """`class X(APIError, status=404, error_type="invalid_request_error")`: a subclass
        declares its HTTP status and OpenAI type in its header (inherited when not given)."""
        super().__init_subclass__(**kwargs)
        cls.status = status or cls.status
        cls.type = error_type or cls.type

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class BadRequestError(APIError, status=400, error_type="invalid_request_error"):
    """The request itself is wrong (a field out of bounds, a malformed body)."""


class AuthenticationError(APIError, status=401, error_type="authentication_error"):
    """No key, or a key this server does not know."""


class PermissionDeniedError(APIError, status=403, error_type="invalid_request_error"):
    """The key is valid but may not make this call (e.g. a run-time adapter change)."""


class NoReplicasError(APIError, status=503, error_type="overloaded_error"):
    """No replica of the model is known to this ingress, or one left mid-change: retry."""


class ModelNotFoundError(APIError, status=404, error_type="invalid_request_error"):
    """The request names a model (or adapter) this server does not serve."""


class NotFoundError(APIError, status=404, error_type="invalid_request_error"):
    """A file or batch that does not exist, or is another key's (the same 404 either way)."""


class ContextLengthError(BadRequestError):
    """Prompt plus requested completion exceed the model's context; a prompt that leaves no room
    for one token is named by itself (`prompt_param`: `messages` or `prompt`), as OpenAI does."""

    def __init__(
        self,
        max_model_len: int,
        num_prompt_tokens: int,
        max_tokens: int,
        prompt_param: str = "prompt",
    ) -> None:
        message, param = _context_excess(max_model_len, num_prompt_tokens, max_tokens, prompt_param)
        super().__init__(message, param=param, code="context_length_exceeded")


def _context_excess(
    max_model_len: int, num_prompt_tokens: int, max_tokens: int, prompt_param: str
) -> tuple[str, str]:
    """OpenAI's message for a request past the context, and the field it names."""
    if num_prompt_tokens >= max_model_len:
        return (
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"{prompt_param} resulted in {num_prompt_tokens} tokens. Please reduce the length "
            f"of the {prompt_param}.",
            prompt_param,
        )
    return (
        f"This model's maximum context length is {max_model_len} tokens. However, you requested "
        f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the prompt, "
        f"{max_tokens} in the completion). Please reduce the prompt or max_tokens.",
        "max_tokens",
    )


def error_body(type_: str, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class RequestFailedError(APIError, status=500, error_type="internal_error"):
    """One request failed inside the engine (its own inputs); the others in its batch went on."""

    def __init__(self, request_id: str, reason: str | None) -> None:
        incident = uuid.uuid4().hex[:16]
        logger.error(
            "request %s failed in the engine (incident %s): %s", request_id, incident, reason
        )
        super().__init__(
            f"The request failed in the engine (incident {incident}).", code="request_failed"
        )


class ReplicaUnavailableError(APIError, status=503, error_type="overloaded_error"):
    """A choice lost its replica more times than max_migrations allows."""

    def __init__(self, request_id: str, max_migrations: int) -> None:
        super().__init__(
            f"The request lost its model replica more than {max_migrations} times; retry later.",
            code="replica_unavailable",
        )


class RepeatedReplicaFailureError(APIError, status=500, error_type="internal_error"):
    """A choice was in flight on MAX_REPLICA_FAULTS replicas that failed: it may be what failed
    them, so it is not carried to a third."""

    def __init__(self, request_id: str, faults: int) -> None:
        incident = uuid.uuid4().hex[:16]
        logger.error(
            "request %s was in flight on %d failed replicas; not resumed again (incident %s)",
            request_id,
            faults,
            incident,
        )
        super().__init__(
            f"The request was in flight on {faults} replicas that failed; it is not resumed "
            f"again, since it may be the cause (incident {incident}).",
            code="replica_failures",
        )


class RequestTimeoutError(APIError, status=408, error_type="timeout"):
    """The body did not arrive within the configured time."""


class PayloadTooLargeError(APIError, status=413, error_type="invalid_request_error"):
    """The body, or a file in it, is over its configured size."""


class TooManyRequestsError(APIError, status=429, error_type="rate_limit_error"):
    """The caller's tenant has as many requests in flight as it may."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message, code="rate_limit_exceeded")
        self.retry_after_s = retry_after_s


_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]|\x1b\[[0-9;]*[A-Za-z]")
_MAX_MESSAGE = 1000


def _clean(message: str) -> str:
    """A client-facing message: no ANSI escapes or control characters, bounded in length."""
    return _CONTROL.sub("", message)[:_MAX_MESSAGE]


def _param_of(loc: tuple) -> str | None:
    parts = [str(p) for p in loc if p not in ("body",)]
    return ".".join(parts) or None


def _field_of(message: str) -> str | None:
    """Our dataclasses raise "field: message"; the field is the part before the colon."""
    head = message.split(":", 1)[0] if ":" in message else ""
    return head if head and " " not in head else None


def cause_of(exc: BaseException) -> BaseException:
    """The error a Ray wrapper (RayTaskError, ...) carries, so it is classified by cause, never by
    text."""
    seen = 0
    while isinstance(exc, RayTaskError) and exc.cause is not None and seen < 8:
        exc, seen = exc.cause, seen + 1
    return exc


_Classified = tuple[int, str, str, str | None, str | None]  # (status, type, message, param, code)


def _classify(exc: BaseException) -> _Classified:
    """(status, type, message, param, code) for any exception the handlers let through."""
    exc = cause_of(exc)
    known = _classify_request_error(exc) or _classify_serving_error(exc)
    if known is not None:
        return known
    incident = uuid.uuid4().hex[:16]
    logger.error("internal error %s", incident, exc_info=exc)
    return 500, "internal_error", f"Internal server error (incident {incident}).", None, None


def _classify_request_error(exc: BaseException) -> _Classified | None:
    """Ours, and the request's own bad values (pydantic's, our dataclasses' "field: message")."""
    if isinstance(exc, APIError):
        return exc.status, exc.type, _clean(exc.message), exc.param, exc.code
    if isinstance(exc, UnknownLoraError):  # a LookupError: the model (adapter) does not exist
        return 404, "invalid_request_error", _clean(str(exc)), "model", "model_not_found"
    if isinstance(exc, ValidationError):
        first = exc.errors()[0]
        msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
        param = _param_of(tuple(first.get("loc", ()))) or _field_of(msg)
        message = msg if param is None or msg.startswith(f"{param}:") else f"{param}: {msg}"
        return 400, "invalid_request_error", _clean(message), param, None
    if isinstance(exc, EngineAsleepError):  # a ValueError to the engine, not the client's fault
        return 503, "overloaded_error", _clean(str(exc)), None, "model_asleep"
    if isinstance(exc, ValueError) and not isinstance(exc, RayError):
        message = _clean(str(exc))
        return 400, "invalid_request_error", message, _field_of(message), None
    return None


def _classify_serving_error(exc: BaseException) -> _Classified | None:
    """Serve's back-pressure and a replica lost: the client retries."""
    if isinstance(exc, BackPressureError):
        status = getattr(exc, "status_code", 503)
        return (
            status,
            "overloaded_error",
            "The server is overloaded, retry later.",
            None,
            "overloaded",
        )
    if isinstance(exc, (RayActorError, ActorUnavailableError)):
        logger.warning("a replica became unavailable: %s", type(exc).__name__)
        message = "The model replica serving this request is unavailable, retry later."
        return 503, "overloaded_error", message, None, "replica_unavailable"
    return None


def http_error(request: Request, exc: Exception) -> JSONResponse:
    """Starlette's own errors (an unknown path: 404, a method the path does not take: 405) as
    OpenAI error JSON instead of FastAPI's {"detail": ...}."""
    status = getattr(exc, "status_code", 500)
    where = f"{request.method} {request.url.path}"
    if status == 404:
        message, code = f"Invalid URL ({where})", "unknown_url"
    elif status == 405:
        message, code = f"Method not allowed ({where})", "method_not_allowed"
    else:
        message, code = str(getattr(exc, "detail", "") or "HTTP error"), None
    return JSONResponse(
        error_body("invalid_request_error", _clean(message), None, code),
        status_code=status,
        headers=getattr(exc, "headers", None),
    )


def error_response(exc: BaseException) -> JSONResponse:
    """The OpenAI error JSON response for exc."""
    status, type_, message, param, code = _classify(exc)
    retry_after = (
        getattr(exc, "retry_after_s", None)
        if isinstance(exc, (BackPressureError, TooManyRequestsError, EngineAsleepError))
        else None
    )
    headers = {"Retry-After": str(math.ceil(retry_after))} if retry_after else None
    return JSONResponse(
        error_body(type_, message, param, code), status_code=status, headers=headers
    )


def error_event(exc: BaseException) -> dict:
    """An error raised mid-stream, as the body of one SSE event (the status is already sent)."""
    _, type_, message, param, code = _classify(exc)
    return error_body(type_, message, param, code)


def renamed_error(exc: Exception, rename: Callable[[str | None], str | None]) -> Exception:
    """A 400 of the chat request that another API (Responses, Messages) was translated into,
    naming the field of that API it came from (`rename`: chat field -> ours); other errors as
    they are."""
    if isinstance(exc, APIError) and exc.status != 400:
        return exc
    if not isinstance(exc, (APIError, ValidationError, ValueError)):
        return exc
    _, _, message, param, code = _classify(exc)
    param = param if param is not None else _field_of(message)
    ours = rename(param)
    if param is not None and ours is not None and message.startswith(param):
        message = ours + message[len(param) :]
    return BadRequestError(message, param=ours, code=code)
