"""OpenAI error JSON and the one exception-to-status mapping of the HTTP layer."""
from __future__ import annotations

import json
import logging
import math

from fastapi.responses import JSONResponse
from pydantic import ValidationError
from ray.serve.exceptions import BackPressureError

logger = logging.getLogger(__name__)


class APIError(Exception):
    """An error the client caused or must react to, with its HTTP status and OpenAI type."""

    status = 500
    type = "internal_error"

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class BadRequestError(APIError):
    status = 400
    type = "invalid_request_error"


class AuthenticationError(APIError):
    status = 401
    type = "authentication_error"


class ModelNotFoundError(APIError):
    status = 404
    type = "invalid_request_error"


class ContextLengthError(BadRequestError):
    """Prompt plus requested completion exceed the model's context."""

    def __init__(self, max_model_len: int, num_prompt_tokens: int, max_tokens: int) -> None:
        super().__init__(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the prompt, {max_tokens} "
            f"in the completion). Please reduce the prompt or max_tokens.",
            param="max_tokens", code="context_length_exceeded")


class OverloadedError(APIError):
    status = 503
    type = "overloaded_error"


def error_body(type_: str, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def _param_of(loc: tuple) -> str | None:
    parts = [str(p) for p in loc if p not in ("body",)]
    return ".".join(parts) or None


def _classify(exc: BaseException) -> tuple[int, str, str, str | None, str | None]:
    """(status, type, message, param, code) for any exception the handlers let through."""
    if isinstance(exc, APIError):
        return exc.status, exc.type, exc.message, exc.param, exc.code
    if isinstance(exc, json.JSONDecodeError):
        return 400, "invalid_request_error", f"Request body is not valid JSON: {exc}", None, "invalid_json"
    if isinstance(exc, ValidationError):
        first = exc.errors()[0]
        param = _param_of(tuple(first.get("loc", ())))
        return 400, "invalid_request_error", f"{param}: {first.get('msg')}", param, None
    if isinstance(exc, ValueError):
        # Our dataclasses (SamplingParams, ...) raise "field: message".
        message = str(exc)
        field = message.split(":", 1)[0] if ":" in message else None
        return 400, "invalid_request_error", message, field if field and " " not in field else None, None
    if isinstance(exc, BackPressureError):
        status = getattr(exc, "status_code", 503)
        return status, "overloaded_error", "The server is overloaded, retry later.", None, "overloaded"
    logger.exception("unhandled error in the ingress", exc_info=exc)
    return 500, "internal_error", f"Internal error: {type(exc).__name__}", None, None


def error_response(exc: BaseException) -> JSONResponse:
    """The OpenAI error JSON response for exc."""
    status, type_, message, param, code = _classify(exc)
    retry_after = getattr(exc, "retry_after_s", None) if isinstance(exc, BackPressureError) else None
    headers = {"Retry-After": str(math.ceil(retry_after))} if retry_after else None
    return JSONResponse(error_body(type_, message, param, code), status_code=status, headers=headers)


def error_event(exc: BaseException) -> dict:
    """An error raised mid-stream, as the body of one SSE event (the status is already sent)."""
    _, type_, message, param, code = _classify(exc)
    return error_body(type_, message, param, code)
