"""The Responses API (`POST /v1/responses`), stateless: the request as a chat completion (here),
the reply as Responses output items, whole or as typed server-sent events
(deploy/responses_events.py).

A Responses body is validated strictly here (an unknown field is a 400 naming it), then turned
into the chat completion request it means, so that every bound, the chat template, tools and
output constraints are the chat endpoint's own. raylm keeps no responses: `store: true` and
`previous_response_id` are refused, and an agent loop sends the whole conversation as `input`
(function calls and their outputs included).
"""

from __future__ import annotations

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

from deploy.errors import renamed_error
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


class ImagePart(_Strict):
    """An input_image part: a data URL, or http(s) from allowed_media_domains (a vision model's;
    it becomes a chat image_url part). raylm keeps no files: file_id is refused."""

    type: Literal["input_image"]
    image_url: str
    detail: Literal["auto", "low", "high"] | None = None
    file_id: None = None


class MessageItem(_Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[Annotated[TextPart | ImagePart, Field(discriminator="type")]]
    id: str | None = Field(default=None, max_length=MAX_ID_CHARS)
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content if isinstance(part, TextPart))

    def chat_content(self) -> str | list[dict[str, Any]]:
        """The content as chat reads it: text, or parts when it holds images."""
        if isinstance(self.content, str) or not any(
            isinstance(part, ImagePart) for part in self.content
        ):
            return self.text()
        return [
            {"type": "text", "text": part.text}
            if isinstance(part, TextPart)
            else {"type": "image_url", "image_url": {"url": part.image_url, "detail": part.detail}}
            for part in self.content
        ]


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
_BRANCHES = {
    "message",
    "function_call",
    "function_call_output",
    "reasoning",
    "str",
    "input_text",
    "output_text",
    "input_image",
}
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


# Fields passed on to the chat completion request under the same name.
_PASSED_ON = (
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
)


def _check_neutral(data: dict[str, Any]) -> None:
    for name, neutral in _NEUTRAL.items():
        if name in data and not any(
            data[name] == v and type(data[name]) is type(v) for v in neutral
        ):
            raise ValueError(f"{name}: {_WHY.get(name, 'not supported by this server')}")


def _input_items(items: list[Any], limit: int) -> list[InputItem]:
    """The input items, counted on the raw JSON first; an error names the item's path."""
    if len(items) > limit:
        raise ValueError(f"input: at most {limit} items, got {len(items)}")
    parts = count_parts(items, ("content", "output", "summary"))
    if parts > MAX_MESSAGE_PARTS:
        raise ValueError(
            f"input: at most {MAX_MESSAGE_PARTS} content parts over all items, got {parts}"
        )
    typed = [
        {"type": "message", **item} if isinstance(item, dict) and "type" not in item else item
        for item in items
    ]
    try:  # here, so that an error names the item's path, not a branch of the union
        return _ITEMS.validate_python(typed)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = [p for p in first.get("loc", ()) if p not in _BRANCHES]
        path = ".".join(str(p) for p in ("input", *loc))
        raise ValueError(f"{path}: {first.get('msg', 'invalid value')}") from None


def _check_metadata(metadata: Any) -> None:
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
        _check_neutral(data)
        items = data.get("input")
        if "input" in data and not isinstance(items, (str, list)):
            raise ValueError("input: must be a string or a list of items")
        if isinstance(items, list):
            limit = (info.context or {}).get("max_messages", MAX_MESSAGES)
            data = {**data, "input": _input_items(items, limit)}
        _check_metadata(data.get("metadata"))
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
                out.append({"role": item.role, "content": item.chat_content()})
            elif isinstance(item, FunctionCallItem):
                _add_call(out, item)
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
        for name in _PASSED_ON:
            value = getattr(self, name)
            if value is not None:
                fields[name] = value
        return {**fields, **self._tool_fields(), **self._format_fields()}

    def _tool_fields(self) -> dict[str, Any]:
        fields: dict[str, Any] = {}
        if self.tools:
            fields["tools"] = [_chat_tool(t) for t in self.tools]
        choice = self.tool_choice
        if isinstance(choice, NamedFunction):
            fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        elif choice is not None:
            fields["tool_choice"] = choice
        return fields

    def _format_fields(self) -> dict[str, Any]:
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and fmt.type == "json_schema":
            if fmt.schema_ is None:
                raise ValueError("text.format.schema: needed when type is json_schema")
            schema = {"name": fmt.name or "response", "schema": fmt.schema_, "strict": fmt.strict}
            return {"response_format": {"type": "json_schema", "json_schema": schema}}
        if fmt is not None and fmt.type == "json_object":
            return {"response_format": {"type": "json_object"}}
        return {}

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


def _add_call(out: list[dict[str, Any]], item: FunctionCallItem) -> None:
    """A function call as a tool call of the assistant's turn (its last turn, or a new one)."""
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


def _chat_tool(tool: FunctionTool) -> dict[str, Any]:
    """A Responses function tool as a chat completion's tool."""
    return {
        "type": "function",
        "function": {
            "name": tool.name,
            "description": tool.description or "",
            "parameters": tool.parameters or {},
            "strict": tool.strict,
        },
    }


def _rename(name: str | None) -> str | None:
    if name is None:
        return None
    for chat, ours in _NAMES:
        if name == chat or name.startswith((chat + ".", chat + "[")):  # `messages[0].content`
            return ours + name[len(chat) :]
    if name.startswith("tools.") and ".function." in name:
        return name.replace(".function.", ".", 1)
    if name.startswith("tool_choice.function"):
        return "tool_choice.name"
    return name


def renamed(exc: Exception) -> Exception:
    """An error of the chat request, with the Responses field it came from (other errors as they
    are)."""
    return renamed_error(exc, _rename)
