"""Chat prompts whose control tokens come only from the template.

A chat template writes each turn between control tokens (`<|im_start|>user ... <|im_end|>`). If
the rendered text were tokenized whole, a control token typed inside a message would become a
real one, and a user could close their turn and open a forged system turn. Message content is
therefore encoded as text, as the OpenAI API treats it; every other client string the template
renders (names, ids, tool arguments and schemas) may not contain a control token at all.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

Render = Callable[[Sequence[dict[str, Any]], "list[dict[str, Any]] | None"], str]

# chat_template_kwargs: a few named flags (`enable_thinking`) for the template, not a second body.
MAX_TEMPLATE_KWARGS = 16
MAX_TEMPLATE_KWARGS_BYTES = 4096
_KWARG_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
# Names the renderer or the template already binds: a kwarg may not replace them (a second
# `messages` would be a TypeError, a `bos_token` a forged control token).
_RESERVED = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
        "processor_kwargs",
        "raise_exception",
        "strftime_now",
        "bos_token",
        "eos_token",
        "unk_token",
        "sep_token",
        "pad_token",
        "cls_token",
        "mask_token",
        "additional_special_tokens",
    }
)


@dataclass(frozen=True, slots=True)
class ChatOptions:
    """How a conversation is rendered: the assistant's turn opened, or the last message continued,
    and the extra variables the template reads (`enable_thinking`). Checked where built."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    template_kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("add_generation_prompt", "continue_final_message"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: must be true or false")
        if self.add_generation_prompt and self.continue_final_message:
            raise ValueError(
                "continue_final_message: needs add_generation_prompt false (the last message is "
                "continued, no new turn is opened)"
            )
        _check_template_kwargs(self.template_kwargs)

    def check(self, messages: Sequence[dict[str, Any]], controls: Sequence[str]) -> None:
        """ValueError unless these messages can be rendered with these options."""
        if self.continue_final_message:
            last = messages[-1] if messages else {}
            if not (isinstance(last.get("content"), str) and last["content"]):
                raise ValueError("continue_final_message: the last message must have text")
        for where, text in _strings("chat_template_kwargs", self.template_kwargs):
            if _holds_control(text, controls):
                raise ValueError(f"{where}: must not contain a control token of the chat template")


def _check_template_kwargs(kwargs: Any) -> None:
    """chat_template_kwargs: a bounded object of identifiers the server does not set, whose
    values are finite JSON."""
    if not isinstance(kwargs, dict) or len(kwargs) > MAX_TEMPLATE_KWARGS:
        raise ValueError(
            f"chat_template_kwargs: must be an object of at most {MAX_TEMPLATE_KWARGS} names"
        )
    for name in kwargs:
        if not isinstance(name, str) or not _KWARG_NAME.fullmatch(name):
            raise ValueError("chat_template_kwargs: names must be identifiers of 1-64 chars")
        if name in _RESERVED:
            raise ValueError(f"chat_template_kwargs: {name} is set by the server")
    try:
        size = len(json.dumps(kwargs, allow_nan=False))
    except (ValueError, TypeError, RecursionError):
        raise ValueError("chat_template_kwargs: values must be finite JSON") from None
    if size > MAX_TEMPLATE_KWARGS_BYTES:
        raise ValueError(
            f"chat_template_kwargs: at most {MAX_TEMPLATE_KWARGS_BYTES} bytes of JSON, got {size}"
        )


DEFAULT_CHAT = ChatOptions()


def control_texts(tokenizer: Any) -> tuple[str, ...]:
    """The text of every token the tokenizer treats as a control token."""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    texts = {t.content for t in added.values() if getattr(t, "special", False)}
    texts.update(getattr(tokenizer, "all_special_tokens", ()))
    return tuple(sorted(t for t in texts if t))


def encode_chat(
    tokenizer: Any,
    render: Render,
    controls: Sequence[str],
    messages: Sequence[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """The token ids of a chat, its message content encoded as text.

    A conversation without control text in any message is encoded exactly as its rendered text
    always was; only content that carries control text takes the piecewise path.
    """
    _refuse_controls_outside_content(messages, tools, controls)
    if not any(_content_holds_control(m.get("content"), controls) for m in messages):
        return tokenizer.encode(render(messages, tools), add_special_tokens=False)
    return _encode_piecewise(tokenizer, render, messages, tools)


def _encode_piecewise(
    tokenizer: Any,
    render: Render,
    messages: Sequence[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
) -> list[int]:
    """Render with a placeholder for each message's content, then encode the template's text with
    its control tokens and each content as plain text (control texts split into ordinary tokens)."""
    contents: dict[str, str] = {}
    rendered = render(_marked_messages(messages, contents), tools)
    ids: list[int] = []
    for piece in re.split("(" + "|".join(map(re.escape, contents)) + ")", rendered):
        if piece in contents:
            text = contents[piece]
            ids += tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)
        elif piece:
            ids += tokenizer.encode(piece, add_special_tokens=False)
    return ids


def _marked_messages(
    messages: Sequence[dict[str, Any]], contents: dict[str, str]
) -> list[dict[str, Any]]:
    """The messages with each content replaced by a mark no text holds (a nonce's), recorded in
    contents."""
    nonce = uuid.uuid4().hex
    placed = []
    for i, message in enumerate(messages):
        content = message.get("content")
        if isinstance(content, str):
            mark = f"\ue000{nonce}-{i}\ue001"
            contents[mark] = content
            message = {**message, "content": mark}
        elif isinstance(content, list):  # content parts: each text part is content too
            message = {**message, "content": _marked_parts(content, f"{nonce}-{i}", contents)}
        placed.append(message)
    return placed


def _marked_parts(parts: list[Any], prefix: str, contents: dict[str, str]) -> list[Any]:
    """Content parts with each text part's text replaced by a mark (recorded in contents); image
    parts stay, for the template to write its image placeholder."""
    out = []
    for j, part in enumerate(parts):
        if (
            isinstance(part, dict)
            and part.get("type") == "text"
            and isinstance(part.get("text"), str)
        ):
            mark = f"\ue000{prefix}-{j}\ue001"
            contents[mark] = part["text"]
            part = {**part, "text": mark}
        out.append(part)
    return out


def _content_holds_control(content: Any, controls: Sequence[str]) -> bool:
    """Whether a message's content (a string, or content parts) carries control text."""
    if isinstance(content, list):
        return any(isinstance(p, dict) and _holds_control(p.get("text"), controls) for p in content)
    return _holds_control(content, controls)


def _holds_control(value: Any, controls: Sequence[str]) -> bool:
    return isinstance(value, str) and any(c in value for c in controls)


def _refuse_controls_outside_content(
    messages: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None, controls: Sequence[str]
) -> None:
    fields = [
        (f"messages[{i}].{key}", value)
        for i, m in enumerate(messages)
        for key, value in m.items()
        if key != "content"
    ]
    fields += [(f"tools[{i}]", tool) for i, tool in enumerate(tools or ())]
    for path, value in fields:
        for where, text in _strings(path, value):
            if _holds_control(text, controls):
                raise ValueError(f"{where}: must not contain a control token of the chat template")


def _strings(path: str, value: Any) -> Iterator[tuple[str, str]]:
    """Every string inside a JSON-like value, with its path (keys count too); iterative, so a
    deeply nested value costs no stack."""
    stack = [(path, value)]
    while stack:
        where, item = stack.pop()
        if isinstance(item, str):
            yield where, item
        elif isinstance(item, dict):
            for key, child in item.items():
                stack += [(f"{where}.{key}", key), (f"{where}.{key}", child)]
        elif isinstance(item, (list, tuple)):
            stack += [(f"{where}[{i}]", child) for i, child in enumerate(item)]
