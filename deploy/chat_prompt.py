"""A chat request's side of the prompt: the tools its replies may call, its output constraint,
and its messages as the frontend renders them (deploy/request_path.py tokenizes them)."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from deploy.body import MAX_CHARS_PER_TOKEN
from deploy.errors import BadRequestError
from deploy.models import ServedModel
from deploy.schemas import ChatCompletionRequest
from deploy.tools import ToolSpec, prepare_chat, tool_constraint
from scheduler.structured_output import StructuredOutput

# How a chat's size is counted before its template runs, as a context-length error says it.
CHAT_CHARS = f"characters (each message counts {MAX_CHARS_PER_TOKEN} besides its content)"


def frontend_message(message: Any) -> dict[str, Any]:
    """A validated chat message as the chat template reads it (developer is system)."""
    out: dict[str, Any] = {
        "role": message.role if message.role != "developer" else "system",
        "content": message.text() if not message.num_images else _parts(message.content),
    }
    if message.tool_calls:
        out["tool_calls"] = [c.model_dump() for c in message.tool_calls]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    return out


def _parts(content: list[Any]) -> list[dict[str, Any]]:
    """A user turn with images as the template's parts: its text, and one `image` part per image
    (the template writes the model's placeholder; the image itself travels beside the ids)."""
    return [
        {"type": "text", "text": p.text} if p.type == "text" else {"type": "image"} for p in content
    ]


def _num_chars(content: str | list[dict[str, Any]] | None) -> int:
    if isinstance(content, list):
        return sum(len(p.get("text") or "") for p in content)
    return len(content or "")


def declared_tools(body: ChatCompletionRequest) -> list[ToolSpec]:
    """The tools the replies may call (none under tool_choice: none)."""
    if body.tool_choice_name == "none":
        return []
    return [
        ToolSpec(t.function.name, t.function.description, t.function.parameters)
        for t in body.tools or []
    ]


def chat_constraint(
    m: ServedModel, body: ChatCompletionRequest, tools: list[ToolSpec]
) -> StructuredOutput | None:
    """The tool-call grammar when tools are on, else the asked output constraint (not both)."""
    constraint = body.output_constraint()
    if tools and constraint is not None:
        raise BadRequestError(
            f"{constraint.field_name}: cannot be combined with tools unless tool_choice is none",
            param=constraint.field_name,
        )
    if tools:
        return tool_constraint(
            tools, body.tool_choice_name, m.tool_format, body.parallel_tool_calls
        )
    return constraint


def chat_messages(
    m: ServedModel, body: ChatCompletionRequest, tools: list[ToolSpec]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None, int]:
    """The messages and tool arguments the template renders, and their size in characters."""
    messages, tool_args = prepare_chat(
        [frontend_message(msg) for msg in body.messages], tools, m.tool_format, m.renders_tools
    )
    # Each message renders one token at least (its role's markers): counted as a token's worth
    # of characters, a flood of empty messages is refused before the template runs.
    num_chars = (
        sum(_num_chars(msg["content"]) for msg in messages)
        + len(messages) * MAX_CHARS_PER_TOKEN
        + len(json.dumps(tool_args or []))
    )
    return messages, tool_args, num_chars


def after_reasoning(
    m: ServedModel, constraint: StructuredOutput | None, opened: bool | None
) -> StructuredOutput | None:
    """A constraint on a reply that opens inside a reasoning block applies after the block (the
    reasoning is free)."""
    if constraint is None or not opened or m.reasoning is None:
        return constraint
    return replace(constraint, after=m.reasoning.end_id)
