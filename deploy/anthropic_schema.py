"""Anthropic's Messages API request (`POST /v1/messages`, `/v1/messages/count_tokens`), validated
strictly and turned into the chat completion request it means.

Every bound, the chat template, tool prompting and output constraints are the chat endpoint's
own: a Messages body becomes a `ChatCompletionRequest`, and the errors that one raises are named
back by the Messages field they came from. An unknown field, a content block raylm cannot show the
model (a document) or a server tool is a 400 naming its path; image blocks are a vision model's
(chat image parts, decoded and bounded in deploy/image_parts.py).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, model_validator

from deploy.errors import renamed_error
from deploy.schemas import MAX_MESSAGE_PARTS, MAX_MESSAGES, MAX_TOOLS, ChatCompletionRequest
from scheduler.request import MAX_PRIORITY, MAX_TENANT_CHARS
from scheduler.sampling_params import MAX_TOKENS

MAX_ID_CHARS = 256
# Anthropic's tool names.
TOOL_NAME = r"^[a-zA-Z0-9_-]{1,64}$"
MAX_DESCRIPTION_CHARS = 8192
# Blocks Anthropic defines that raylm does not take (yet): refused naming their path.
_UNSUPPORTED_BLOCKS = {
    "document": "document blocks are not supported by this server",
    "search_result": "search_result blocks are not supported by this server",
    "server_tool_use": "server tools are not supported by this server",
    "web_search_tool_result": "server tools are not supported by this server",
    "container_upload": "container uploads are not supported by this server",
}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)


class CacheControl(_Strict):
    """A prompt-caching breakpoint: accepted and unused (raylm caches every prompt's prefix)."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(_Strict):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: list[dict[str, Any]] | None = Field(default=None, max_length=0)


class ToolUseBlock(_Strict):
    """A call the assistant made earlier in the conversation."""

    type: Literal["tool_use"]
    id: str = Field(max_length=MAX_ID_CHARS)
    name: str = Field(pattern=TOOL_NAME)
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolResultBlock(_Strict):
    """A call's result, written by the client."""

    type: Literal["tool_result"]
    tool_use_id: str = Field(max_length=MAX_ID_CHARS)
    content: str | list[TextBlock] = ""
    is_error: bool | None = None
    cache_control: CacheControl | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "\n".join(block.text for block in self.content)


class ImageSource(_Strict):
    """An image as Anthropic sends it: base64 data and its media type, or a URL (fetched only
    from allowed_media_domains); decoded and bounded where every image is (frontend/images.py)."""

    type: Literal["base64", "url"]
    media_type: Literal["image/jpeg", "image/png", "image/gif", "image/webp"] | None = None
    data: str | None = None
    url: str | None = None

    @model_validator(mode="after")
    def _fields_of_its_type(self) -> ImageSource:
        if self.type == "base64" and (self.data is None or self.media_type is None):
            raise ValueError("a base64 source holds media_type and data")
        if self.type == "url" and self.url is None:
            raise ValueError("a url source holds url")
        return self

    def chat_url(self) -> str:
        """The source as a chat image part's URL (a data URL for base64)."""
        if self.type == "url":
            return str(self.url)
        return f"data:{self.media_type};base64,{self.data}"


class ImageBlock(_Strict):
    type: Literal["image"]
    source: ImageSource
    cache_control: CacheControl | None = None


class ThinkingBlock(_Strict):
    """Earlier thinking, sent back with the conversation: accepted, not shown to the model (chat
    templates drop earlier turns' thinking)."""

    type: Literal["thinking"]
    thinking: str
    signature: str = Field(default="", max_length=65536)


class RedactedThinkingBlock(_Strict):
    type: Literal["redacted_thinking"]
    data: str = Field(max_length=65536)


Block = (
    TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock
)
_BLOCKS: dict[str, type[BaseModel]] = {
    "text": TextBlock,
    "image": ImageBlock,
    "tool_use": ToolUseBlock,
    "tool_result": ToolResultBlock,
    "thinking": ThinkingBlock,
    "redacted_thinking": RedactedThinkingBlock,
}
# Which blocks each role may write.
_ROLE_BLOCKS = {
    "user": {"text", "image", "tool_result"},
    "assistant": {"text", "tool_use", "thinking", "redacted_thinking"},
}


class Message(_Strict):
    role: Literal["user", "assistant"]
    content: str | list[Annotated[Block, Field(discriminator="type")]]


class Tool(_Strict):
    name: str = Field(pattern=TOOL_NAME)
    description: str = Field(default="", max_length=MAX_DESCRIPTION_CHARS)
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: CacheControl | None = None


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = Field(default=None, pattern=TOOL_NAME)
    disable_parallel_tool_use: bool | None = None


class Metadata(_Strict):
    user_id: str | None = Field(default=None, max_length=MAX_TENANT_CHARS)


class Thinking(_Strict):
    """Extended thinking: the reply's reasoning comes back as thinking blocks where the model has
    a reasoning parser. budget_tokens is checked as Anthropic checks it; the model ends its
    thinking itself (no budget is enforced)."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(default=None, ge=1024, le=MAX_TOKENS)
    display: Literal["summarized", "omitted"] | None = None


@dataclass(slots=True)
class ChatMessages:
    """The conversation as chat messages, and where each came from in the Messages body (its
    errors are named by that path)."""

    messages: list[dict[str, Any]] = field(default_factory=list)
    origins: list[str] = field(default_factory=list)
    # A message given as content parts (a user turn with images): each part's block path.
    parts: dict[int, list[str]] = field(default_factory=dict)

    def add(self, message: dict[str, Any], origin: str, parts: list[str] | None = None) -> None:
        if parts is not None:
            self.parts[len(self.messages)] = parts
        self.messages.append(message)
        self.origins.append(origin)


class CountTokensRequest(_Strict):
    """POST /v1/messages/count_tokens: what a Messages request would send the model."""

    model: str = Field(max_length=1024)
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    cache_control: CacheControl | None = None

    @model_validator(mode="before")
    @classmethod
    def _bounded(cls, data: Any, info: ValidationInfo) -> Any:
        """The conversation counted and its blocks validated on the raw JSON, so that an error
        names the block's path (`messages.0.content.1.text`)."""
        if not isinstance(data, dict):
            return data
        if isinstance(data.get("system"), list):
            data = {**data, "system": _text_blocks(data["system"], "system")}
        elif "system" in data and not isinstance(data["system"], (str, type(None))):
            raise ValueError("system: must be a string or a list of text blocks")
        if not isinstance(data.get("messages"), list):
            return data
        raw = data["messages"]
        limit = (info.context or {}).get("max_messages", MAX_MESSAGES)
        if len(raw) > limit:
            raise ValueError(f"messages: at most {limit} messages, got {len(raw)}")
        if _num_parts(raw) > MAX_MESSAGE_PARTS:
            raise ValueError(
                f"messages: at most {MAX_MESSAGE_PARTS} content blocks over all messages, "
                f"got {_num_parts(raw)}"
            )
        return {**data, "messages": [_message(m, f"messages.{i}") for i, m in enumerate(raw)]}

    @model_validator(mode="after")
    def _consistent(self) -> CountTokensRequest:
        """Checks across fields, named by their full path (a nested model's own validator would
        be named by its parent only)."""
        for i, tool in enumerate(self.tools or []):
            if tool.input_schema.get("type") != "object":
                raise ValueError(f"tools.{i}.input_schema.type: must be object")
        thinking = self.thinking
        if thinking is not None and (thinking.type == "enabled") != (
            thinking.budget_tokens is not None
        ):
            raise ValueError("thinking.budget_tokens: give it exactly when type is enabled")
        return self._tool_choice_names_a_tool()

    def _tool_choice_names_a_tool(self) -> CountTokensRequest:
        names = [t.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise ValueError("tools: tool names must be unique")
        choice = self.tool_choice
        if choice is not None and (choice.type == "tool") != (choice.name is not None):
            raise ValueError("tool_choice.name: give it exactly when type is tool")
        if choice is not None and choice.type == "none" and choice.disable_parallel_tool_use:
            raise ValueError("tool_choice.disable_parallel_tool_use: not taken when type is none")
        if choice is not None and choice.type in ("any", "tool") and not names:
            raise ValueError(f"tool_choice.type: {choice.type} needs at least one tool")
        if choice is not None and choice.name is not None and choice.name not in names:
            raise ValueError(f"tool_choice.name: no tool named {choice.name!r} in tools")
        return self

    def chat_messages(self) -> ChatMessages:
        """The system prompt, then each message: a user's tool results as tool messages (before
        its text), an assistant's tool uses as its tool calls; thinking is left out."""
        out = ChatMessages()
        if self.system:
            system = self.system
            text = system if isinstance(system, str) else "\n".join(b.text for b in system)
            out.add({"role": "system", "content": text}, "system")
        for i, message in enumerate(self.messages):
            _add_message(out, message, f"messages.{i}")
        return out

    def chat_fields(self, chat: ChatMessages) -> dict[str, Any]:
        """The chat completion fields of the prompt (messages, tools, template options)."""
        fields: dict[str, Any] = {"model": self.model, "messages": chat.messages}
        last = self.messages[-1]
        if last.role == "assistant":  # the reply continues the assistant's last turn
            fields.update(add_generation_prompt=False, continue_final_message=True)
        if self.tools:
            fields["tools"] = [
                {
                    "type": "function",
                    "function": {
                        "name": t.name,
                        "description": t.description,
                        "parameters": t.input_schema,
                    },
                }
                for t in self.tools
            ]
        choice = self.tool_choice
        if choice is not None:
            fields["tool_choice"] = _chat_tool_choice(choice)
            if choice.disable_parallel_tool_use:
                fields["parallel_tool_calls"] = False
        if self.thinking is not None and self.thinking.type == "disabled":
            # Templates of thinking models (Qwen3's) read this flag; others ignore it.
            fields["chat_template_kwargs"] = {"enable_thinking": False}
        return fields

    def chat_request(self, max_messages: int, **more: Any) -> tuple[ChatCompletionRequest, Names]:
        """The chat completion request this one means, and the names that map its errors back."""
        chat = self.chat_messages()
        names = Names(chat.origins, chat.parts)
        try:
            request = ChatCompletionRequest.model_validate(
                {**self.chat_fields(chat), **more}, context={"max_messages": max_messages}
            )
        except (ValidationError, ValueError) as exc:
            raise names.renamed(exc) from None
        return request, names


class MessagesRequest(CountTokensRequest):
    """POST /v1/messages."""

    max_tokens: int
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    metadata: Metadata | None = None
    stream: bool = False
    service_tier: Literal["auto", "standard_only"] | None = None
    # raylm's extension, as in chat completions: the queue's order (a key's ceiling applies).
    priority: int = Field(default=0, ge=-MAX_PRIORITY, le=MAX_PRIORITY)

    @model_validator(mode="after")
    def _budget_under_max_tokens(self) -> MessagesRequest:
        budget = self.thinking.budget_tokens if self.thinking is not None else None
        if budget is not None and budget >= self.max_tokens:
            raise ValueError(
                f"thinking.budget_tokens: must be less than max_tokens ({self.max_tokens})"
            )
        return self

    def as_chat(self, max_messages: int) -> tuple[ChatCompletionRequest, Names]:
        """The chat completion request, its errors named by this request's fields."""
        more: dict[str, Any] = {"max_tokens": self.max_tokens, "priority": self.priority}
        for name in ("temperature", "top_p", "top_k"):
            if getattr(self, name) is not None:
                more[name] = getattr(self, name)
        if self.stop_sequences:
            # The matched stop sequence stays in the text, so the reply can name it
            # (deploy/anthropic_events.py cuts it off).
            more.update(stop=self.stop_sequences, include_stop_str_in_output=True)
        if self.metadata is not None and self.metadata.user_id is not None:
            more["user"] = self.metadata.user_id
        return self.chat_request(max_messages, **more)


def _num_parts(raw: list[Any]) -> int:
    """Content blocks over a raw conversation, a tool result's own blocks included."""
    total = 0
    for message in raw:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            total += len(content)
            total += sum(
                len(b["content"])
                for b in content
                if isinstance(b, dict) and isinstance(b.get("content"), list)
            )
    return total


def _message(raw: Any, path: str) -> Any:
    """One raw message, validated: a block's error names its own path."""
    if not isinstance(raw, dict):
        return raw  # the model's own error names the message
    content, role = raw.get("content"), raw.get("role")
    if not isinstance(content, list):
        return _validated(Message, raw, path)
    blocks = [_block(b, f"{path}.content.{j}", role) for j, b in enumerate(content)]
    if not blocks:
        raise ValueError(f"{path}.content: must hold at least one block")
    shell = _validated(Message, {**raw, "content": "-"}, path)  # role and keys checked
    return shell.model_copy(update={"content": blocks})


def _text_blocks(raw: list[Any], path: str) -> list[TextBlock]:
    if len(raw) > MAX_MESSAGE_PARTS:
        raise ValueError(f"{path}: at most {MAX_MESSAGE_PARTS} blocks, got {len(raw)}")
    blocks = [_block(b, f"{path}.{j}", None) for j, b in enumerate(raw)]
    for j, block in enumerate(blocks):
        if not isinstance(block, TextBlock):
            raise ValueError(f"{path}.{j}.type: must be text")
    return blocks  # type: ignore[return-value]


def _block(raw: Any, path: str, role: Any) -> BaseModel:
    kind = raw.get("type") if isinstance(raw, dict) else None
    if not isinstance(kind, str):
        raise ValueError(f"{path}: must be a content block with a type")
    if kind in _UNSUPPORTED_BLOCKS:
        raise ValueError(f"{path}: {_UNSUPPORTED_BLOCKS[kind]}")
    if kind not in _BLOCKS:
        raise ValueError(f"{path}.type: unknown content block type {kind[:64]!r}")
    if role in _ROLE_BLOCKS and kind not in _ROLE_BLOCKS[role]:
        raise ValueError(f"{path}.type: a {role} message cannot hold {kind} blocks")
    if kind == "tool_result" and isinstance(raw.get("content"), list):
        for k, inner in enumerate(raw["content"]):
            inner_kind = inner.get("type") if isinstance(inner, dict) else None
            if inner_kind in _UNSUPPORTED_BLOCKS:
                raise ValueError(f"{path}.content.{k}: {_UNSUPPORTED_BLOCKS[inner_kind]}")
            if inner_kind == "image":  # a tool message carries text only
                raise ValueError(f"{path}.content.{k}: images in tool results are not supported")
    return _validated(_BLOCKS[kind], raw, path)


def _validated(model: type[BaseModel], raw: dict[str, Any], path: str) -> Any:
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = [str(p) for p in first.get("loc", ()) if not str(p).startswith(("list[", "str"))]
        where = ".".join([path, *loc])
        msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
        raise ValueError(f"{where}: {msg}") from None


def _add_message(out: ChatMessages, message: Message, path: str) -> None:
    if isinstance(message.content, str):
        out.add({"role": message.role, "content": message.content}, path)
        return
    texts = [b.text for b in message.content if isinstance(b, TextBlock)]
    if message.role == "user":
        for j, block in enumerate(message.content):
            if isinstance(block, ToolResultBlock):
                result = {
                    "role": "tool",
                    "tool_call_id": block.tool_use_id,
                    "content": block.text(),
                }
                out.add(result, f"{path}.content.{j}")
        if any(isinstance(b, ImageBlock) for b in message.content):
            _add_parts(out, message, path)
        elif texts:
            out.add({"role": "user", "content": "\n".join(texts)}, path)
        return
    calls = [
        {
            "id": b.id,
            "type": "function",
            "function": {"name": b.name, "arguments": json.dumps(b.input)},
        }
        for b in message.content
        if isinstance(b, ToolUseBlock)
    ]
    turn: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts)}
    if calls:
        turn["tool_calls"] = calls
    out.add(turn, path)


def _add_parts(out: ChatMessages, message: Message, path: str) -> None:
    """A user turn with images as chat content parts, in block order (its tool results are
    already added before it)."""
    parts: list[dict[str, Any]] = []
    paths: list[str] = []
    for j, block in enumerate(message.content):
        if isinstance(block, TextBlock):
            parts.append({"type": "text", "text": block.text})
        elif isinstance(block, ImageBlock):
            parts.append({"type": "image_url", "image_url": {"url": block.source.chat_url()}})
        else:
            continue
        paths.append(f"{path}.content.{j}")
    out.add({"role": "user", "content": parts}, path, paths)


def _chat_tool_choice(choice: ToolChoice) -> Any:
    if choice.type == "tool":
        return {"type": "function", "function": {"name": choice.name}}
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]


# Chat completion names of the Messages fields, in the order they are tried.
_NAMES = (
    ("stop", "stop_sequences"),
    ("user", "metadata.user_id"),
    ("chat_template_kwargs", "thinking"),
    ("continue_final_message", "messages"),
    ("tool_choice.function.name", "tool_choice.name"),
    ("parallel_tool_calls", "tool_choice.disable_parallel_tool_use"),
)


@dataclass(slots=True)
class Names:
    """Maps a chat completion error's field back to the Messages field it came from."""

    origins: list[str]  # each chat message's path in the Messages body
    parts: dict[int, list[str]] = field(default_factory=dict)  # ChatMessages.parts

    def rename(self, name: str | None) -> str | None:
        if name is None:
            return None
        if name.startswith("messages"):
            return self._message(name)
        for chat, ours in _NAMES:
            if name == chat or name.startswith(chat + "."):
                return ours + name[len(chat) :]
        if name.startswith(("tools.", "tools[")):
            dotted = name.replace("[", ".").replace("]", "")
            return dotted.replace(".function.parameters", ".input_schema").replace(
                ".function.", "."
            )
        return name

    def _message(self, name: str) -> str:
        """`messages[3].content` / `messages.3.content` -> the Messages path of chat message 3."""
        rest = name[len("messages") :]
        head, _, tail = rest.lstrip(".[").partition("]" if rest.startswith("[") else ".")
        if not (head.isascii() and head.isdecimal()) or int(head) >= len(self.origins):
            return name
        tail = tail.lstrip(".")
        part = re.match(r"content(?:\[(\d+)\]|\.(\d+))", tail)
        paths = self.parts.get(int(head))
        if part is not None and paths is not None and int(part[1] or part[2]) < len(paths):
            # An image part's chat field (`.image_url.url`) is the block's `source`.
            rest = tail[part.end() :].replace(".image_url.url", ".source", 1)
            return paths[int(part[1] or part[2])] + rest
        return self.origins[int(head)] + (f".{tail}" if tail else "")

    def renamed(self, exc: Exception) -> Exception:
        """A chat request's error, with the Messages field it came from (others as they are)."""
        return renamed_error(exc, self.rename)
