"""OpenAI tool calling: the call format a chat template speaks, its grammar, and parsing calls back
out.

A model writes tool calls as text in the format it was trained on. The format is recognised from
the chat template; `required` and named choices are constrained to a valid call of the given
tools, and `auto` to either plain text or valid calls, so nothing malformed follows once a call
has started. The output is parsed back into OpenAI `tool_calls`, whole or as it streams.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from scheduler.structured_output import StructuredOutput

_DECODER = json.JSONDecoder()


@dataclass(frozen=True, slots=True)
class ToolCallFormat:
    """How one model family writes tool calls."""

    name: str
    open: str  # text that starts a block of calls
    close: str  # text that ends it
    as_list: bool  # a block holds a JSON array of calls (else one call object per block)
    arguments_key: str  # the call object's key for the arguments
    parallel: bool  # the format can carry several calls

    @property
    def marker(self) -> str:
        """The text that tells a call from a plain reply."""
        return self.open.strip() or "{"


# SmolLM2 was tuned on calls as a JSON list inside <tool_call> tags; its template shows no tools.
SMOLLM2 = ToolCallFormat("smollm2", "<tool_call>", "</tool_call>", True, "arguments", True)
# Hermes-style templates (Qwen 2.5, Hermes, ...) render tools themselves: one object per block.
HERMES = ToolCallFormat("hermes", "<tool_call>\n", "\n</tool_call>", False, "arguments", True)
# Llama 3.1+ answers with one bare JSON object.
LLAMA3_JSON = ToolCallFormat("llama3_json", "", "", False, "parameters", False)


def detect_format(chat_template: str | None) -> ToolCallFormat:
    """The call format of a chat template (SmolLM2's when the template says nothing of tools)."""
    template = chat_template or ""
    if "<tool_call>" in template:
        return HERMES
    if "<|start_header_id|>" in template:
        return LLAMA3_JSON
    return SMOLLM2


def template_renders_tools(chat_template: str | None) -> bool:
    """Whether the template lays out the `tools` it is given (else raylm describes them itself)."""
    return bool(chat_template) and re.search(r"\btools\b", chat_template) is not None


@dataclass(frozen=True, slots=True)
class ToolSpec:
    """One function the model may call."""

    name: str
    description: str
    parameters: dict[str, Any]

    def as_openai(self) -> dict[str, Any]:
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters,
            },
        }


def _call_schema(tool: ToolSpec, fmt: ToolCallFormat) -> dict[str, Any]:
    return {
        "type": "object",
        "additionalProperties": False,
        "required": ["name", fmt.arguments_key],
        "properties": {
            "name": {"const": tool.name},
            fmt.arguments_key: tool.parameters or {"type": "object"},
        },
    }


def _calls_rule(tools: list[ToolSpec], fmt: ToolCallFormat, parallel: bool) -> str:
    """The Lark rule for a block (or blocks) of valid calls of `tools`."""
    schemas = [_call_schema(t, fmt) for t in tools]
    one = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    many = parallel and fmt.parallel
    if fmt.as_list:
        array = {"type": "array", "items": one, "minItems": 1, **({} if many else {"maxItems": 1})}
        return f"calls: {json.dumps(fmt.open)} %json {json.dumps(array)} {json.dumps(fmt.close)}"
    block = " ".join(
        p
        for p in (
            json.dumps(fmt.open) if fmt.open else "",
            f"%json {json.dumps(one)}",
            json.dumps(fmt.close) if fmt.close else "",
        )
        if p
    )
    repeat = ' ("\\n" block)*' if many else ""
    return f"calls: block{repeat}\nblock: {block}"


def tool_constraint(
    tools: list[ToolSpec], choice: str, fmt: ToolCallFormat, parallel: bool = True
) -> StructuredOutput | None:
    """The output constraint of a tool choice: `required` or a named function force a call, `auto`
    allows plain text or valid calls, `none` nothing."""
    if choice == "none" or not tools:
        return None
    if choice == "auto":
        # Plain text is anything that does not open a call; once the marker is written, only
        # valid calls can follow.
        marker = re.escape(fmt.marker)
        grammar = (
            f"start: calls | TEXT\nTEXT: /(.|\\n)+/ & ~/\\s*{marker}(.|\\n)*/\n"
            f"{_calls_rule(tools, fmt, parallel)}"
        )
    else:
        chosen = tools if choice == "required" else [t for t in tools if t.name == choice]
        grammar = f"start: calls\n{_calls_rule(chosen, fmt, parallel)}"
    return StructuredOutput("grammar", grammar, "tools")


def tools_system_prompt(tools: list[ToolSpec], fmt: ToolCallFormat) -> str:
    """Describes the tools and the call format, for templates that do not render tools."""
    example_call = {"name": "<function name>", fmt.arguments_key: {"<parameter>": "<value>"}}
    example = json.dumps([example_call] if fmt.as_list else example_call)
    listing = "\n".join(json.dumps(t.as_openai()["function"]) for t in tools)
    return (
        "You can call the functions listed between <tools> and </tools>.\n"
        f"<tools>\n{listing}\n</tools>\n"
        "To call functions, answer with nothing but the call, written as\n"
        f"{fmt.open}{example}{fmt.close}\n"
        "Otherwise, answer in plain text."
    )


def render_call_text(calls: list[dict[str, Any]], fmt: ToolCallFormat) -> str:
    """An assistant turn's earlier tool calls, written back in the model's own format."""
    objs = [
        {
            "name": c["function"]["name"],
            fmt.arguments_key: _arguments(c["function"].get("arguments")),
        }
        for c in calls
    ]
    if fmt.as_list:
        return f"{fmt.open}{json.dumps(objs)}{fmt.close}"
    return "\n".join(f"{fmt.open}{json.dumps(o)}{fmt.close}" for o in objs)


def _arguments(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return arguments if arguments is not None else {}


@dataclass(slots=True)
class ToolCallParser:
    """Splits one choice's text into plain content and tool calls, whole or as it streams.

    Until the text shows whether it is a call (it might still be the start of the marker) it is
    held back; a reply goes out as content, a call block as OpenAI tool calls once each is complete.
    """

    fmt: ToolCallFormat
    text: str = ""
    mode: str = "undecided"  # "content" | "calls"
    calls: list[dict[str, Any]] = field(default_factory=list)
    _sent: int = 0  # characters of `text` already sent as content

    def feed(self, delta: str) -> tuple[str, list[dict[str, Any]]]:
        """(content to send, completed calls to send) after `delta` more text."""
        self.text += delta
        if self.mode == "undecided":
            stripped = self.text.lstrip()
            if stripped.startswith(self.fmt.marker):
                self.mode = "calls"
            elif stripped and not self.fmt.marker.startswith(stripped):
                self.mode = "content"
        if self.mode == "content":
            out, self._sent = self.text[self._sent :], len(self.text)
            return out, []
        if self.mode == "calls":
            return "", self._new_calls()
        return "", []

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """At the end: what is left. Text that never became a complete call goes out as content;
        after complete calls, a remainder cut off by max_tokens is dropped (finish_reason says
        so)."""
        if self.mode == "calls":
            new = self._new_calls()
            if self.calls:
                return "", new
        out, self._sent = self.text[self._sent :], len(self.text)
        self.mode = "content"
        return out, []

    def _new_calls(self) -> list[dict[str, Any]]:
        objs = _complete_call_objects(self.text.lstrip(), self.fmt)
        new = [_openai_call(o, self.fmt) for o in objs[len(self.calls) :]]
        self.calls += new
        return new


def _complete_call_objects(text: str, fmt: ToolCallFormat) -> list[dict[str, Any]]:
    """The call objects that are complete so far in a calls block (in order)."""
    objs: list[dict[str, Any]] = []
    pos = 0
    while text.startswith(fmt.open, pos) and (fmt.open or not objs):
        pos += len(fmt.open)
        if fmt.as_list:
            pos = _skip_ws(text, pos)
            if not text.startswith("[", pos):
                return objs
            pos += 1
            while True:
                obj, pos = _decode_at(text, _skip_ws(text, pos))
                if obj is None:
                    return objs
                objs.append(obj)
                pos = _skip_ws(text, pos)
                if text.startswith(",", pos):
                    pos += 1
                    continue
                if not text.startswith("]", pos):
                    return objs
                pos += 1
                break
        else:
            obj, pos = _decode_at(text, pos)
            if obj is None:
                return objs
            objs.append(obj)
        if not text.startswith(fmt.close, pos) or not fmt.close:
            return objs
        pos += len(fmt.close)
        if text.startswith("\n", pos):
            pos += 1
    return objs


def _skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos


def _decode_at(text: str, pos: int) -> tuple[dict[str, Any] | None, int]:
    try:
        obj, end = _DECODER.raw_decode(text, pos)
    except json.JSONDecodeError:
        return None, pos
    return (obj, end) if isinstance(obj, dict) else (None, pos)


def _openai_call(obj: dict[str, Any], fmt: ToolCallFormat) -> dict[str, Any]:
    arguments = obj.get(fmt.arguments_key, {})
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": str(obj.get("name", "")), "arguments": json.dumps(arguments)},
    }


def prepare_chat(
    messages: list[dict[str, Any]], tools: list[ToolSpec], fmt: ToolCallFormat, renders_tools: bool
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The template's messages and `tools` argument for a conversation that may involve tools.

    A template that lays out tools gets them (and earlier calls as structured `tool_calls`);
    otherwise the tools are described in the system turn and earlier calls written as text.
    """
    out = []
    for message in messages:
        message = dict(message)
        calls = message.pop("tool_calls", None) or []
        if calls and renders_tools:
            message["tool_calls"] = [
                {
                    "type": "function",
                    "function": {
                        "name": c["function"]["name"],
                        "arguments": _arguments(c["function"].get("arguments")),
                    },
                }
                for c in calls
            ]
        elif calls:
            text = message.get("content") or ""
            message["content"] = (
                f"{text}\n{render_call_text(calls, fmt)}" if text else render_call_text(calls, fmt)
            )
        out.append(message)
    if not tools:
        return out, None
    if renders_tools:
        return out, [t.as_openai() for t in tools]
    prompt = tools_system_prompt(tools, fmt)
    if out and out[0]["role"] == "system":
        out[0] = {
            **out[0],
            "content": f"{out[0]['content']}\n\n{prompt}" if out[0]["content"] else prompt,
        }
    else:
        out.insert(0, {"role": "system", "content": prompt})
    return out, None
