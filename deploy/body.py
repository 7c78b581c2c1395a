"""Request bodies: read within a byte cap and a deadline, parsed off the event loop when large.

The cap follows the model's context: a body much larger than any prompt the context can hold is
refused with 413 before a byte of it is parsed.
"""

from __future__ import annotations

import asyncio
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel
from pydantic_core import from_json

from deploy.config import AppConfig
from deploy.errors import BadRequestError, PayloadTooLargeError, RequestTimeoutError
from deploy.fields import Ignored, UnknownFields, check_fields

M = TypeVar("M", bound=BaseModel)

# No tokenizer packs more characters than this into one token of real text: a longer prompt
# cannot fit the context, and is refused before the tokenizer spends time on it.
MAX_CHARS_PER_TOKEN = 32
# The longest JSON spelling of one character (a `\uXXXX` escape).
JSON_BYTES_PER_CHAR = 6
# Room for what a body holds besides its prompt (128 tools, a 200,000-character schema).
MIN_BODY_BYTES = 2 << 20
# Larger bodies are parsed and validated on a thread, so that the event loop's streams go on
# between the parser's steps.
PARSE_OFF_LOOP_BYTES = 64 << 10


def body_limit(config: AppConfig, max_model_len: int) -> int:
    """The largest body accepted: the configured cap, or one context's worth of escaped text."""
    if config.max_request_body_bytes is not None:
        return config.max_request_body_bytes
    return max(MIN_BODY_BYTES, max_model_len * MAX_CHARS_PER_TOKEN * JSON_BYTES_PER_CHAR)


async def read_body(request: Request, limit: int, timeout_s: float) -> bytes:
    """The request body: 413 once it passes `limit` bytes, 408 unless whole within `timeout_s`."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLargeError(
            f"Request body of {declared} bytes exceeds the {limit}-byte limit."
        )
    try:
        return await asyncio.wait_for(_chunks(request, limit), timeout_s)
    except asyncio.TimeoutError:
        raise RequestTimeoutError(
            f"The request body did not arrive within {timeout_s:g} s.",
            code="request_body_timeout",
        ) from None


async def _chunks(request: Request, limit: int) -> bytes:
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLargeError(f"Request body exceeds the {limit}-byte limit.")
        chunks.append(chunk)
    return b"".join(chunks)


async def parse_body(
    raw: bytes,
    schema: type[M],
    max_messages: int,
    unknown_fields: UnknownFields = "reject",
    ignored: Ignored | None = None,
) -> M:
    """The validated body (400 naming the field if not); a large one is parsed on a thread.

    A field the schema does not implement is a 400 naming it, or, under unknown_fields: ignore,
    dropped and added to `ignored` (deploy/fields.py)."""
    ignored = ignored if ignored is not None else Ignored()
    if len(raw) > PARSE_OFF_LOOP_BYTES:
        return await asyncio.to_thread(_parsed, raw, schema, max_messages, unknown_fields, ignored)
    return _parsed(raw, schema, max_messages, unknown_fields, ignored)


def _parsed(
    raw: bytes, schema: type[M], max_messages: int, mode: UnknownFields, ignored: Ignored
) -> M:
    data = _json_object(raw)
    found = check_fields(data, schema, mode)
    ignored.paths, ignored.count = found.paths, found.count
    try:
        return schema.model_validate(data, context={"max_messages": max_messages})
    except RecursionError:
        raise BadRequestError("Request body is nested too deeply.", code="invalid_json") from None


def _json_object(raw: bytes) -> dict[str, Any]:
    # pydantic-core's parser (jiter), not json.loads: both hold the GIL for the whole call, and
    # json.loads spends ~10 ns a character on a long string (a 5.6 MB base64 image: 30-60 ms
    # the event loop's streams wait), jiter well under 1 ms. It refuses lone-surrogate escapes
    # and nesting past 200 levels as invalid JSON.
    try:
        data = from_json(raw)
    except (ValueError, RecursionError):  # invalid JSON or UTF-8, or nested too deeply
        raise BadRequestError("Request body is not valid JSON.", code="invalid_json") from None
    if not isinstance(data, dict):
        raise BadRequestError("Request body must be a JSON object.", code="invalid_json")
    return data
