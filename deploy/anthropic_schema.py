"""Anthropic's Messages API request (`POST /v1/messages`, `/v1/messages/count_tokens`), validated
strictly and turned into the chat completion request it means.

Every bound, the chat template, tool prompting and output constraints are the chat endpoint's
own: a Messages body becomes a `ChatCompletionRequest`, and the errors that one raises are named
back by the Messages field they came from. An unknown field, a content block raylm cannot show the
model (a document) or a server tool is a 400 naming its path; image blocks are a vision model's
(chat image parts, decoded and bounded in deploy/image_parts.py). The body's parts (blocks, tools,
thinking) are deploy/anthropic_blocks.py.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import Field, ValidationError, ValidationInfo, model_validator

from deploy.anthropic_blocks import (
    CacheControl,
    ImageBlock,
    Message,
    Metadata,
    StrictModel,
    TextBlock,
    Thinking,
    Tool,
    ToolChoice,
    ToolResultBlock,
    ToolUseBlock,
    num_blocks,
    text_blocks,
    validated_message,
)
from deploy.errors import renamed_error
from deploy.schemas import MAX_MESSAGE_PARTS, MAX_MESSAGES, MAX_TOOLS, ChatCompletionRequest
from scheduler.request import MAX_PRIORITY


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


class CountTokensRequest(StrictModel):
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
        data = _with_system_blocks(data)
        if not isinstance(data.get("messages"), list):
            return data
        raw = data["messages"]
        _check_counts(raw, (info.context or {}).get("max_messages", MAX_MESSAGES))
        return {
            **data,
            "messages": [validated_message(m, f"messages.{i}") for i, m in enumerate(raw)],
        }

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
            fields["tools"] = [_chat_tool(t) for t in self.tools]
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


def _add_message(out: ChatMessages, message: Message, path: str) -> None:
    if isinstance(message.content, str):
        out.add({"role": message.role, "content": message.content}, path)
    elif message.role == "user":
        _add_user_blocks(out, message, path)
    else:
        _add_assistant_blocks(out, message, path)


def _texts(message: Message) -> list[str]:
    return [b.text for b in message.content if isinstance(b, TextBlock)]


def _add_user_blocks(out: ChatMessages, message: Message, path: str) -> None:
    """A user turn's blocks: each tool result a tool message, then the turn's text (or its
    parts, when it has images)."""
    for j, block in enumerate(message.content):
        if isinstance(block, ToolResultBlock):
            result = {"role": "tool", "tool_call_id": block.tool_use_id, "content": block.text()}
            out.add(result, f"{path}.content.{j}")
    if any(isinstance(b, ImageBlock) for b in message.content):
        _add_parts(out, message, path)
    elif texts := _texts(message):
        out.add({"role": "user", "content": "\n".join(texts)}, path)


def _add_assistant_blocks(out: ChatMessages, message: Message, path: str) -> None:
    """An assistant turn's blocks: its text, and its tool_use blocks as tool calls."""
    calls = [
        {
            "id": b.id,
            "type": "function",
            "function": {"name": b.name, "arguments": json.dumps(b.input)},
        }
        for b in message.content
        if isinstance(b, ToolUseBlock)
    ]
    turn: dict[str, Any] = {"role": "assistant", "content": "\n".join(_texts(message))}
    if calls:
        turn["tool_calls"] = calls
    out.add(turn, path)


def _chat_tool(tool: Tool) -> dict[str, Any]:
    """A Messages tool as a chat completion's function tool."""
    return {
        "type": "function",
        "function": {
            "name": tool.name,
            "description": tool.description,
            "parameters": tool.input_schema,
        },
    }


def _with_system_blocks(data: dict[str, Any]) -> dict[str, Any]:
    """The raw request with its `system` blocks validated (a string passes as it is)."""
    if isinstance(data.get("system"), list):
        return {**data, "system": text_blocks(data["system"], "system")}
    if "system" in data and not isinstance(data["system"], (str, type(None))):
        raise ValueError("system: must be a string or a list of text blocks")
    return data


def _check_counts(raw: list[Any], limit: int) -> None:
    """The conversation's messages and content blocks within their bounds."""
    if len(raw) > limit:
        raise ValueError(f"messages: at most {limit} messages, got {len(raw)}")
    if num_blocks(raw) > MAX_MESSAGE_PARTS:
        raise ValueError(
            f"messages: at most {MAX_MESSAGE_PARTS} content blocks over all messages, "
            f"got {num_blocks(raw)}"
        )


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
