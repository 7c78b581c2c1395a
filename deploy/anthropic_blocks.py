"""The parts of an Anthropic Messages body (content blocks, messages, tools, tool choice,
thinking), each validated strictly; a raw message or block is checked by its own model, so that
an error names its path in the body (`messages.2.content.1.source`)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from deploy.schemas import MAX_MESSAGE_PARTS
from scheduler.request import MAX_TENANT_CHARS
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


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)


class CacheControl(StrictModel):
    """A prompt-caching breakpoint: accepted and unused (raylm caches every prompt's prefix)."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(StrictModel):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: list[dict[str, Any]] | None = Field(default=None, max_length=0)


class ToolUseBlock(StrictModel):
    """A call the assistant made earlier in the conversation."""

    type: Literal["tool_use"]
    id: str = Field(max_length=MAX_ID_CHARS)
    name: str = Field(pattern=TOOL_NAME)
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolResultBlock(StrictModel):
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


class ImageSource(StrictModel):
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


class ImageBlock(StrictModel):
    type: Literal["image"]
    source: ImageSource
    cache_control: CacheControl | None = None


class ThinkingBlock(StrictModel):
    """Earlier thinking, sent back with the conversation: accepted, not shown to the model (chat
    templates drop earlier turns' thinking)."""

    type: Literal["thinking"]
    thinking: str
    signature: str = Field(default="", max_length=65536)


class RedactedThinkingBlock(StrictModel):
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


class Message(StrictModel):
    role: Literal["user", "assistant"]
    content: str | list[Annotated[Block, Field(discriminator="type")]]


class Tool(StrictModel):
    name: str = Field(pattern=TOOL_NAME)
    description: str = Field(default="", max_length=MAX_DESCRIPTION_CHARS)
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: CacheControl | None = None


class ToolChoice(StrictModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = Field(default=None, pattern=TOOL_NAME)
    disable_parallel_tool_use: bool | None = None


class Metadata(StrictModel):
    user_id: str | None = Field(default=None, max_length=MAX_TENANT_CHARS)


class Thinking(StrictModel):
    """Extended thinking: the reply's reasoning comes back as thinking blocks where the model has
    a reasoning parser. budget_tokens is checked as Anthropic checks it; the model ends its
    thinking itself (no budget is enforced)."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(default=None, ge=1024, le=MAX_TOKENS)
    display: Literal["summarized", "omitted"] | None = None


def num_blocks(raw: list[Any]) -> int:
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


def validated_message(raw: Any, path: str) -> Any:
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


def text_blocks(raw: list[Any], path: str) -> list[TextBlock]:
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
