"""The Responses API's reply, built from its choice's deltas: the response object, or the typed
server-sent events that stream it (`response.created`, output items and their parts, text and
argument deltas, `response.completed` / `response.incomplete`)."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from typing import Any

from deploy.errors import error_event
from deploy.generation import ChoiceDelta, UsageTally
from deploy.reply import PieceEvents, ReplySplit
from deploy.responses import NamedFunction, ResponsesRequest


def _usage(tally: UsageTally, reasoning_tokens: int) -> dict[str, Any]:
    counts = tally.as_dict()
    return {
        "input_tokens": counts["prompt_tokens"],
        "input_tokens_details": {
            "cached_tokens": counts["prompt_tokens_details"]["cached_tokens"],
            "cache_write_tokens": 0,  # no prompt is written to a cache on request
        },
        "output_tokens": counts["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": counts["total_tokens"],
    }


def _text_item(kind: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """A new reasoning or message output item, in progress, and its one content part."""
    if kind == "reasoning":
        item: dict[str, Any] = {
            "id": f"rs_{uuid.uuid4().hex}",
            "type": "reasoning",
            "summary": [],
            "content": [],
            "status": "in_progress",
        }
        return item, {"type": "reasoning_text", "text": ""}
    item = {
        "id": f"msg_{uuid.uuid4().hex}",
        "type": "message",
        "role": "assistant",
        "status": "in_progress",
        "content": [],
    }
    return item, {"type": "output_text", "text": "", "annotations": [], "logprobs": []}


def _call_item(call: dict[str, Any]) -> dict[str, Any]:
    """A function_call output item for a parsed tool call, its arguments not yet sent."""
    return {
        "id": f"fc_{uuid.uuid4().hex}",
        "type": "function_call",
        "call_id": call["id"],
        "name": call["function"]["name"],
        "arguments": "",
        "status": "in_progress",
    }


class ResponseBuilder(PieceEvents):
    """One response's output items, built from its choice's deltas; each step returns the
    streamed events it makes (a non-streamed response ignores them and takes `response()`).

    Items go out in the order the reply writes them: reasoning, then the message, then function
    calls (each call is sent whole once the parser has read it complete: one arguments delta).
    """

    reasoning_kind = "reasoning"
    answer_kind = "message"

    def __init__(
        self,
        body: ResponsesRequest,
        model: str,
        split: ReplySplit,
        count_reasoning: Callable[[list[int]], int] | None = None,  # None: no reasoning parser
    ) -> None:
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created_at = int(time.time())
        self.body = body
        self.model = model
        self.split = split
        self.count_reasoning = count_reasoning
        self.output: list[dict[str, Any]] = []
        self.status = "in_progress"
        self.incomplete: dict[str, str] | None = None
        self.tally = UsageTally()
        self.token_ids: list[int] = []
        self._seq = 0
        self._open: dict[str, Any] | None = None  # the reasoning or message item being written

    # ---- the response object -------------------------------------------------------------------
    def response(self) -> dict[str, Any]:
        b = self.body
        fmt = b.text.format if b.text is not None and b.text.format is not None else None
        choice = b.tool_choice
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": self.status,
            "error": None,
            "incomplete_details": self.incomplete,
            "instructions": b.instructions,
            "max_output_tokens": b.max_output_tokens,
            "model": self.model,
            "output": self.output,
            "parallel_tool_calls": b.parallel_tool_calls is not False,
            "previous_response_id": None,
            "reasoning": {"effort": None, "summary": None},
            "store": False,
            "temperature": b.temperature if b.temperature is not None else 1.0,
            "text": {
                "format": fmt.model_dump(by_alias=True, exclude_none=True)
                if fmt is not None
                else {"type": "text"}
            },
            "tool_choice": choice.model_dump()
            if isinstance(choice, NamedFunction)
            else (choice or "auto"),
            "tools": [t.model_dump() for t in b.tools or []],
            "top_p": b.top_p if b.top_p is not None else 1.0,
            "truncation": "disabled",
            "usage": _usage(self.tally, self._reasoning_tokens())
            if self.status != "in_progress"
            else None,
            "user": b.user,
            "metadata": b.metadata or {},
        }

    def _reasoning_tokens(self) -> int:
        return self.count_reasoning(self.token_ids) if self.count_reasoning is not None else 0

    # ---- events --------------------------------------------------------------------------------
    def _event(self, type_: str, **fields: Any) -> dict[str, Any]:
        event = {"type": type_, "sequence_number": self._seq, **fields}
        self._seq += 1
        return event

    def start(self) -> list[dict[str, Any]]:
        return [
            self._event("response.created", response=self.response()),
            self._event("response.in_progress", response=self.response()),
        ]

    def feed(self, delta: ChoiceDelta) -> list[dict[str, Any]]:
        """The events of one delta of the choice (its finish included); its tokens are kept to
        count the reasoning ones in the usage."""
        self.token_ids += delta.token_ids
        return super().feed(delta)

    def _text(self, kind: str, text: str) -> list[dict[str, Any]]:
        """Text for the open reasoning or message item (opened first when another is open)."""
        events: list[dict[str, Any]] = []
        if self._open is None or self._open["type"] != kind:
            events += self._close()
            events += self._open_item(kind)
        item = self._open
        assert item is not None
        part = item["content"][0]
        part["text"] += text
        where = {"item_id": item["id"], "output_index": len(self.output) - 1, "content_index": 0}
        if kind == "reasoning":
            events.append(self._event("response.reasoning_text.delta", delta=text, **where))
        else:
            events.append(
                self._event("response.output_text.delta", delta=text, logprobs=[], **where)
            )
        return events

    def _open_item(self, kind: str) -> list[dict[str, Any]]:
        item, part = _text_item(kind)
        index = len(self.output)
        events = [
            self._event("response.output_item.added", output_index=index, item=_copy(item)),
            self._event(
                "response.content_part.added",
                item_id=item["id"],
                output_index=index,
                content_index=0,
                part=_copy(part),
            ),
        ]
        item["content"].append(part)
        self.output.append(item)
        self._open = item
        return events

    def _close(self) -> list[dict[str, Any]]:
        """Finish the open reasoning or message item, if any."""
        item, self._open = self._open, None
        if item is None:
            return []
        item["status"] = "completed"
        part = item["content"][0]
        where = {"item_id": item["id"], "output_index": len(self.output) - 1, "content_index": 0}
        done = "response.reasoning_text.done" if item["type"] == "reasoning" else None
        events = [
            self._event(done, text=part["text"], **where)
            if done
            else self._event("response.output_text.done", text=part["text"], logprobs=[], **where),
            self._event("response.content_part.done", part=_copy(part), **where),
            self._event(
                "response.output_item.done", output_index=where["output_index"], item=_copy(item)
            ),
        ]
        return events

    def _call(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        item = _call_item(call)
        index = len(self.output)
        arguments = call["function"]["arguments"]
        where = {"item_id": item["id"], "output_index": index}
        events = [
            self._event("response.output_item.added", output_index=index, item=_copy(item)),
            self._event("response.function_call_arguments.delta", delta=arguments, **where),
            self._event(
                "response.function_call_arguments.done",
                arguments=arguments,
                name=item["name"],
                **where,
            ),
        ]
        item.update(arguments=arguments, status="completed")
        self.output.append(item)
        events.append(
            self._event("response.output_item.done", output_index=index, item=_copy(item))
        )
        return events

    def _finish(self, reason: str) -> list[dict[str, Any]]:
        events = self._close()
        if not self.output:  # nothing written: an empty message, so output_text is ""
            events += self._open_item("message")
            events += self._close()
        if reason == "length":
            self.status, self.incomplete = "incomplete", {"reason": "max_output_tokens"}
            for item in self.output:
                if item["type"] != "function_call":
                    item["status"] = "incomplete"
        else:
            self.status = "completed"
        kind = "response.incomplete" if self.status == "incomplete" else "response.completed"
        return events + [self._event(kind, response=self.response())]

    def error(self, exc: BaseException) -> dict[str, Any]:
        """The event of an error after the stream started."""
        error = error_event(exc)["error"]
        return self._event(
            "error",
            code=error["code"] or error["type"],
            message=error["message"],
            param=error["param"],
        )


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(item))
