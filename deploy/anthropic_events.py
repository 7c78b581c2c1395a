"""One Anthropic Messages reply, built from its choice's deltas: the message object, or the
server-sent events that stream it (`message_start`, `content_block_start` / `_delta` / `_stop`,
`message_delta`, `message_stop`), and errors in Anthropic's shape.

The reply's text is split as chat completions split it (deploy/reply.py): reasoning becomes a
thinking block, the answer a text block, each tool call a tool_use block sent whole once the
parser has read it complete (one `input_json_delta`).
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from fastapi.responses import JSONResponse
from starlette.responses import Response

from deploy.errors import error_response
from deploy.generation import ChoiceDelta, UsageTally
from deploy.reply import PieceEvents, ReplySplit

# Anthropic's error type of each HTTP status raylm answers with (anything else: api_error).
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def error_type(status: int) -> str:
    return _ERROR_TYPES.get(status, "api_error")


def anthropic_error(status: int, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": error_type(status), "message": message}}


def anthropic_shaped(response: Response) -> Response:
    """An OpenAI error response (deploy/errors.py, the one mapping of exceptions to statuses) in
    Anthropic's shape, its status and headers kept; any other response as it is."""
    body = _anthropic_body(response)
    if body is None:
        return response
    headers = {
        k: v for k, v in response.headers.items() if k not in ("content-length", "content-type")
    }
    return JSONResponse(body, status_code=response.status_code, headers=headers)


def _anthropic_body(response: Response) -> dict[str, Any] | None:
    """The Anthropic error body of an OpenAI error response (None: not one)."""
    if response.status_code < 400 or not isinstance(response, JSONResponse):
        return None
    try:
        error = json.loads(bytes(response.body))["error"]
        message, param = error["message"], error.get("param")
    except (ValueError, KeyError, TypeError):
        return None
    if param and not message.startswith(param):  # Anthropic's errors have no param: named here
        message = f"{param}: {message}"
    return anthropic_error(response.status_code, message)


class MessageBuilder(PieceEvents):
    """One reply's content blocks, built from its choice's deltas; each step returns the events it
    makes (a non-streamed reply ignores them and takes `message()`)."""

    reasoning_kind = "thinking"
    answer_kind = "text"

    def __init__(
        self,
        model: str,
        split: ReplySplit,
        num_prompt_tokens: int,
        stop_sequences: list[str] | None = None,
    ) -> None:
        self.id = f"msg_{uuid.uuid4().hex}"
        self.model = model
        self.split = split
        self.num_prompt_tokens = num_prompt_tokens
        # Longest first: where two end the text, the one the stop matcher cut at is the longest.
        self.stop_sequences = sorted(stop_sequences or [], key=len, reverse=True)
        self.content: list[dict[str, Any]] = []
        self.stop_reason: str | None = None
        self.stop_sequence: str | None = None
        self.tally = UsageTally()
        self._open: dict[str, Any] | None = None  # the text or thinking block being written

    # ---- the message object --------------------------------------------------------------------
    def message(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": self.content,
            "stop_reason": self.stop_reason,
            "stop_sequence": self.stop_sequence,
            "usage": self._usage(),
        }

    def _usage(self) -> dict[str, int]:
        output = sum(self.tally.outputs.values())
        return {"input_tokens": self.num_prompt_tokens, "output_tokens": output}

    # ---- events --------------------------------------------------------------------------------
    def start(self) -> list[dict[str, Any]]:
        """message_start (empty content, no stop reason yet), then a ping as Anthropic sends."""
        return [
            {"type": "message_start", "message": _copy(self.message())},
            {"type": "ping"},
        ]

    def _shown(self, delta: ChoiceDelta) -> str:
        if delta.finish_reason == "stop":
            return self._cut_stop_sequence(delta.text)
        return delta.text

    def _cut_stop_sequence(self, text: str) -> str:
        """The last delta's text without the stop sequence that ended it (the request keeps the
        matched stop string in the text so that it can be named; the whole string arrives in the
        last delta, since the stop matcher holds back any text that may begin one)."""
        for stop in self.stop_sequences:
            if text.endswith(stop):
                self.stop_sequence = stop
                return text[: len(text) - len(stop)]
        return text

    def _text(self, kind: str, text: str) -> list[dict[str, Any]]:
        """Text for the open text or thinking block (opened first when another is open)."""
        events: list[dict[str, Any]] = []
        if self._open is None or self._open["type"] != kind:
            events += self._close()
            block = {"type": kind, kind: ""}
            if kind == "thinking":
                block["signature"] = ""  # raylm signs nothing; a thinking block sent back is read
            events.append(self._block_start(block))
            self._open = block
        self._open[kind] += text
        delta = {"type": f"{kind}_delta", kind: text}
        events.append(
            {"type": "content_block_delta", "index": len(self.content) - 1, "delta": delta}
        )
        return events

    def _block_start(self, block: dict[str, Any]) -> dict[str, Any]:
        self.content.append(block)
        index = len(self.content) - 1
        return {"type": "content_block_start", "index": index, "content_block": _copy(block)}

    def _close(self) -> list[dict[str, Any]]:
        """Finish the open text or thinking block, if any."""
        if self._open is None:
            return []
        self._open = None
        return [{"type": "content_block_stop", "index": len(self.content) - 1}]

    def _call(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        arguments = call["function"]["arguments"]
        block = {
            "type": "tool_use",
            "id": "toolu_" + call["id"].removeprefix("call_"),
            "name": call["function"]["name"],
            "input": {},
        }
        start = self._block_start(block)
        block["input"] = json.loads(arguments)
        index = len(self.content) - 1
        delta = {"type": "input_json_delta", "partial_json": arguments}
        return [
            start,
            {"type": "content_block_delta", "index": index, "delta": delta},
            {"type": "content_block_stop", "index": index},
        ]

    def _finish(self, reason: str) -> list[dict[str, Any]]:
        events = self._close()
        if reason == "length":
            self.stop_reason = "max_tokens"
        elif self.split.num_calls:
            self.stop_reason = "tool_use"
        elif self.stop_sequence is not None:
            self.stop_reason = "stop_sequence"
        else:
            self.stop_reason = "end_turn"
        delta = {"stop_reason": self.stop_reason, "stop_sequence": self.stop_sequence}
        return events + [
            {"type": "message_delta", "delta": delta, "usage": self._usage()},
            {"type": "message_stop"},
        ]

    def error(self, exc: BaseException) -> dict[str, Any]:
        """The event of an error after the stream started (the status is already sent)."""
        response = error_response(exc)  # the one exception-to-status mapping
        body = _anthropic_body(response)
        assert body is not None  # an error response always has an error body
        return body


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(item))
