"""The Responses API (`POST /v1/responses`), stateless: the request as a chat completion, the reply
as Responses output items, whole or as typed server-sent events.

A Responses body is validated strictly here (an unknown field is a 400 naming it), then turned
into the chat completion request it means, so that every bound, the chat template, tools and
output constraints are the chat endpoint's own. raylm keeps no responses: `store: true` and
`previous_response_id` are refused, and an agent loop sends the whole conversation as `input`
(function calls and their outputs included).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    model_validator,
)

from deploy.errors import APIError, BadRequestError, error_event
from deploy.generation import ChoiceDelta, UsageTally
from deploy.reply import ReplyPiece, ReplySplit
from deploy.schemas import (
    MAX_MESSAGE_PARTS,
    MAX_MESSAGES,
    MAX_TOOLS,
    ChatCompletionRequest,
    count_parts,
)
from scheduler.request import MAX_CACHE_SALT_CHARS, MAX_PRIORITY, MAX_TENANT_CHARS

MAX_ID_CHARS = 256
MAX_METADATA_KEYS = 16  # OpenAI's bounds on metadata
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512

# Fields that would change the output and that raylm does not implement: refused unless they
# carry their neutral value (the bookkeeping fields below are accepted and unused).
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "previous_response_id": (None,),
    "store": (None, False),
    "background": (None, False),
    "conversation": (None,),
    "prompt": (None,),
    "max_tool_calls": (None,),
    "top_logprobs": (None, 0),
    "include": (None, []),
    "truncation": (None, "disabled"),
    "reasoning": (None, {}, {"effort": None}, {"effort": None, "summary": None}),
}
_WHY = {
    "previous_response_id": "raylm keeps no responses; send the whole conversation as input",
    "store": "raylm keeps no responses (omit store or send false)",
}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class TextPart(_Strict):
    """A text part of a message (input_text; output_text from an earlier response)."""

    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[dict[str, Any]] | None = Field(default=None, max_length=0)
    logprobs: list[dict[str, Any]] | None = Field(default=None, max_length=0)


class MessageItem(_Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[TextPart]
    id: str | None = Field(default=None, max_length=MAX_ID_CHARS)
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionCallItem(_Strict):
    """A call the model made earlier, sent back with the conversation."""

    type: Literal["function_call"]
    call_id: str = Field(max_length=MAX_ID_CHARS)
    name: str = Field(max_length=64)
    arguments: str
    id: str | None = Field(default=None, max_length=MAX_ID_CHARS)
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutputItem(_Strict):
    """A call's result, written by the client."""

    type: Literal["function_call_output"]
    call_id: str = Field(max_length=MAX_ID_CHARS)
    output: str | list[TextPart]
    id: str | None = Field(default=None, max_length=MAX_ID_CHARS)
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    def text(self) -> str:
        if isinstance(self.output, str):
            return self.output
        return "".join(part.text for part in self.output)


class ReasoningText(_Strict):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(_Strict):
    """Earlier reasoning, sent back with the conversation: accepted, not shown to the model
    (chat templates drop earlier turns' thinking)."""

    type: Literal["reasoning"]
    id: str | None = Field(default=None, max_length=MAX_ID_CHARS)
    summary: list[ReasoningText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None
    encrypted_content: None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem
# Union branches pydantic names in an error's path: the path a client sees leaves them out.
_BRANCHES = {"message", "function_call", "function_call_output", "reasoning", "str"}
_ITEMS: TypeAdapter[list[InputItem]] = TypeAdapter(
    list[Annotated[InputItem, Field(discriminator="type")]]
)


class FunctionTool(_Strict):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(_Strict):
    type: Literal["function"]
    name: str = Field(max_length=64)


class TextFormat(_Strict):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(default=None, max_length=64)
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(_Strict):
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None


class StreamOptions(_Strict):
    include_obfuscation: bool | None = None


class ResponsesRequest(_Strict):
    """POST /v1/responses."""

    model: str = Field(max_length=1024)
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    # raylm's (vLLM's) sampling extensions, as in chat completions.
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[int, float] | None = None
    tools: list[FunctionTool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    priority: int = Field(default=0, ge=-MAX_PRIORITY, le=MAX_PRIORITY)
    request_timeout_s: float | None = Field(default=None, gt=0, le=86400)
    # vLLM's prefix-cache partition, as in chat completions (deploy/cache_scope.py).
    cache_salt: str | None = Field(default=None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)
    # Bookkeeping: accepted and echoed or unused.
    metadata: dict[str, str] | None = Field(default=None, max_length=MAX_METADATA_KEYS)
    user: str | None = Field(default=None, max_length=MAX_TENANT_CHARS)
    safety_identifier: str | None = Field(default=None, max_length=MAX_TENANT_CHARS)
    prompt_cache_key: str | None = Field(default=None, max_length=MAX_TENANT_CHARS)
    service_tier: Literal["auto", "default"] | None = None
    # Refused unless neutral (_NEUTRAL).
    previous_response_id: str | None = None
    store: bool | None = None
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    max_tool_calls: int | None = None
    top_logprobs: int | None = None
    include: list[str] | None = None
    truncation: str | None = None
    reasoning: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _bounded(cls, data: Any, info: ValidationInfo) -> Any:
        """Neutral values only for what raylm does not implement; the input counted on the raw
        JSON, before one item is validated; items without a type are messages."""
        if not isinstance(data, dict):
            return data
        for name, neutral in _NEUTRAL.items():
            if name in data and not any(
                data[name] == v and type(data[name]) is type(v) for v in neutral
            ):
                raise ValueError(f"{name}: {_WHY.get(name, 'not supported by this server')}")
        items = data.get("input")
        if "input" in data and not isinstance(items, (str, list)):
            raise ValueError("input: must be a string or a list of items")
        if isinstance(items, list):
            limit = (info.context or {}).get("max_messages", MAX_MESSAGES)
            if len(items) > limit:
                raise ValueError(f"input: at most {limit} items, got {len(items)}")
            parts = count_parts(items, ("content", "output", "summary"))
            if parts > MAX_MESSAGE_PARTS:
                raise ValueError(
                    f"input: at most {MAX_MESSAGE_PARTS} content parts over all items, got {parts}"
                )
            typed = [
                {"type": "message", **item}
                if isinstance(item, dict) and "type" not in item
                else item
                for item in items
            ]
            try:  # here, so that an error names the item's path, not a branch of the union
                data = {**data, "input": _ITEMS.validate_python(typed)}
            except ValidationError as exc:
                first = exc.errors()[0]
                loc = [p for p in first.get("loc", ()) if p not in _BRANCHES]
                path = ".".join(str(p) for p in ("input", *loc))
                raise ValueError(f"{path}: {first.get('msg', 'invalid value')}") from None
        metadata = data.get("metadata")
        if isinstance(metadata, dict) and any(
            not isinstance(k, str)
            or len(k) > MAX_METADATA_KEY_CHARS
            or not isinstance(v, str)
            or len(v) > MAX_METADATA_VALUE_CHARS
            for k, v in metadata.items()
        ):
            raise ValueError(
                f"metadata: keys of at most {MAX_METADATA_KEY_CHARS} characters, string values "
                f"of at most {MAX_METADATA_VALUE_CHARS}"
            )
        return data

    def messages(self) -> list[dict[str, Any]]:
        """The conversation as chat messages: instructions first, function calls as the
        assistant's tool calls, their outputs as tool messages."""
        out: list[dict[str, Any]] = []
        if self.instructions is not None:
            out.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            return out + [{"role": "user", "content": self.input}]
        for item in self.input:
            if isinstance(item, MessageItem):
                out.append({"role": item.role, "content": item.text()})
            elif isinstance(item, FunctionCallItem):
                call = {
                    "id": item.call_id,
                    "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments},
                }
                last = out[-1] if out else None
                if last is not None and last["role"] == "assistant":
                    last.setdefault("tool_calls", []).append(call)
                else:
                    out.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif isinstance(item, FunctionCallOutputItem):
                out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
        if not out:
            raise ValueError("input: holds no message")
        return out

    def chat_fields(self) -> dict[str, Any]:
        """The chat completion request this one means, as its JSON fields."""
        fields: dict[str, Any] = {
            "model": self.model,
            "messages": self.messages(),
            "max_completion_tokens": self.max_output_tokens,
            "user": self.user,
        }
        for name in (
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "seed",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
            "logit_bias",
            "parallel_tool_calls",
            "priority",
            "request_timeout_s",
            "prompt_cache_key",
            "cache_salt",
        ):
            value = getattr(self, name)
            if value is not None:
                fields[name] = value
        if self.tools:
            fields["tools"] = [
                {
                    "type": "function",
                    "function": {
                        "name": t.name,
                        "description": t.description or "",
                        "parameters": t.parameters or {},
                        "strict": t.strict,
                    },
                }
                for t in self.tools
            ]
        choice = self.tool_choice
        if isinstance(choice, NamedFunction):
            fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        elif choice is not None:
            fields["tool_choice"] = choice
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and fmt.type == "json_schema":
            if fmt.schema_ is None:
                raise ValueError("text.format.schema: needed when type is json_schema")
            schema = {"name": fmt.name or "response", "schema": fmt.schema_, "strict": fmt.strict}
            fields["response_format"] = {"type": "json_schema", "json_schema": schema}
        elif fmt is not None and fmt.type == "json_object":
            fields["response_format"] = {"type": "json_object"}
        return fields

    def as_chat(self, max_messages: int) -> ChatCompletionRequest:
        """The chat completion request, its errors named by this request's fields."""
        try:
            return ChatCompletionRequest.model_validate(
                self.chat_fields(), context={"max_messages": max_messages}
            )
        except (ValidationError, ValueError) as exc:
            raise renamed(exc) from None


# Chat completion names of the Responses fields, in the order they are tried.
_NAMES = (
    ("max_completion_tokens", "max_output_tokens"),
    ("max_tokens", "max_output_tokens"),
    ("response_format.json_schema.schema", "text.format.schema"),
    ("response_format", "text.format"),
    ("messages", "input"),
    ("top_logprobs", "top_logprobs"),
)


def _rename(name: str | None) -> str | None:
    if name is None:
        return None
    for chat, ours in _NAMES:
        if name == chat or name.startswith(chat + "."):
            return ours + name[len(chat) :]
    if name.startswith("tools.") and ".function." in name:
        return name.replace(".function.", ".", 1)
    if name.startswith("tool_choice.function"):
        return "tool_choice.name"
    return name


def renamed(exc: Exception) -> Exception:
    """An error of the chat request, with the Responses field it came from (other errors as they
    are)."""
    if isinstance(exc, APIError) and exc.status != 400:
        return exc
    if not isinstance(exc, (APIError, ValidationError, ValueError)):
        return exc
    error = error_event(exc)["error"]
    message, param, code = error["message"], error["param"], error["code"]
    ours = _rename(param)
    if param is not None and ours is not None and message.startswith(param):
        message = ours + message[len(param) :]
    elif param is None:
        head = message.split(":", 1)[0]
        if " " not in head and _rename(head) != head:
            ours = _rename(head)
            message = f"{ours}{message[len(head) :]}"
    return BadRequestError(message, param=ours, code=code)


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


class ResponseBuilder:
    """One response's output items, built from its choice's deltas; each step returns the
    streamed events it makes (a non-streamed response ignores them and takes `response()`).

    Items go out in the order the reply writes them: reasoning, then the message, then function
    calls (each call is sent whole once the parser has read it complete: one arguments delta).
    """

    def __init__(
        self,
        body: ResponsesRequest,
        model: str,
        split: ReplySplit,
        count_reasoning: Any = None,  # (output token ids) -> reasoning tokens; None: no parser
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
        """The events of one delta of the choice (its finish included)."""
        self.token_ids += delta.token_ids
        self.tally.add(delta)
        piece = self.split.feed(delta.text)
        if delta.finish_reason is not None:
            piece += self.split.finish()
        events = self._piece(piece)
        if delta.finish_reason is not None:
            events += self._finish(delta.finish_reason)
        return events

    def _piece(self, piece: ReplyPiece) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if piece.reasoning:
            events += self._text("reasoning", piece.reasoning)
        if piece.content:
            events += self._text("message", piece.content)
        for call in piece.calls:
            events += self._close()
            events += self._call(call)
        return events

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
        if kind == "reasoning":
            item: dict[str, Any] = {
                "id": f"rs_{uuid.uuid4().hex}",
                "type": "reasoning",
                "summary": [],
                "content": [],
                "status": "in_progress",
            }
            part: dict[str, Any] = {"type": "reasoning_text", "text": ""}
        else:
            item = {
                "id": f"msg_{uuid.uuid4().hex}",
                "type": "message",
                "role": "assistant",
                "status": "in_progress",
                "content": [],
            }
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
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
        item = {
            "id": f"fc_{uuid.uuid4().hex}",
            "type": "function_call",
            "call_id": call["id"],
            "name": call["function"]["name"],
            "arguments": "",
            "status": "in_progress",
        }
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


def sse_event(event: dict[str, Any]) -> bytes:
    """One typed server-sent event, as OpenAI sends them (`event:` then `data:`)."""
    data = json.dumps(event, separators=(",", ":"))
    return f"event: {event['type']}\ndata: {data}\n\n".encode()
