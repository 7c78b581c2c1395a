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
from dataclasses import dataclass
from typing import Any

from scheduler.structured_output import StructuredOutput


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
    return chat_template is not None and re.search(r"\btools\b", chat_template) is not None


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
            f"start: calls | TEXT\nTEXT: /(.|\\n)+/ & ~/[ \\t\\r\\n]*{marker}(.|\\n)*/\n"
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


# The whitespace a reply may start with before a call: the same set in the `auto` grammar and in the
# parser, so that no text the grammar let through as plain text can be read back as a call.
_WHITESPACE = " \t\r\n"


@dataclass(frozen=True, slots=True)
class DeclaredTools:
    """The calls a reply may make: the model's call format and the functions the request
    declared."""

    fmt: ToolCallFormat
    names: frozenset[str]

    @classmethod
    def of(cls, tools: list[ToolSpec], fmt: ToolCallFormat) -> DeclaredTools:
        return cls(fmt, frozenset(t.name for t in tools))


class ToolCallParser:
    """Splits one choice's text into plain content and tool calls, whole or as it streams.

    Until the text shows whether it is a call (it might still be the start of the marker) it is
    held back; a reply goes out as content, a call block as OpenAI tool calls once each is complete.
    Each character is read once however the text is cut into deltas. Only calls of declared
    functions with object arguments come back; that the arguments fit the function's schema is the
    `tool_constraint` grammar's guarantee, which every request with tools generates under.
    """

    def __init__(self, tools: DeclaredTools) -> None:
        self.fmt = tools.fmt
        self.names = tools.names
        self.text = ""
        self.mode = "undecided"  # "content" | "calls"
        self.calls: list[dict[str, Any]] = []
        self._sent = 0  # characters of `text` already sent as content
        self._reader = _CallReader(tools.fmt)

    def feed(self, delta: str) -> tuple[str, list[dict[str, Any]]]:
        """(content to send, completed calls to send) after `delta` more text."""
        self.text += delta
        if self.mode == "undecided":
            start = _skip_ws(self.text, 0)
            rest = self.text[start : start + len(self.fmt.marker)]
            if rest == self.fmt.marker:
                self.mode = "calls"
                self._reader.pos = start
            elif start < len(self.text) and not self.fmt.marker.startswith(rest):
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
        new = []
        for obj in self._reader.read(self.text):
            name, arguments = obj.get("name"), obj.get(self.fmt.arguments_key, {})
            if name not in self.names or not isinstance(arguments, dict):
                self._reader.stop()  # never a call of an undeclared function
                break
            new.append(_openai_call(name, arguments))
        self.calls += new
        return new


class _CallReader:
    """Reads the call objects of a calls block as its text grows, resuming where it stopped."""

    def __init__(self, fmt: ToolCallFormat) -> None:
        self.fmt = fmt
        self.pos = 0  # where reading resumes
        self._expect = "open"  # open | list | object | next | close | gap | done
        self._scanning: _ObjectEnd | None = None
        self._blocks = 0

    def stop(self) -> None:
        self._expect = "done"

    def read(self, text: str) -> list[dict[str, Any]]:
        """The call objects completed since the last call (in order)."""
        objs: list[dict[str, Any]] = []
        while self._expect != "done":
            step = getattr(self, f"_{self._expect}")(text, objs)
            if step is None:  # needs more text
                break
        return objs

    def _literal(self, text: str, literal: str, then: str) -> bool | None:
        """Consume `literal` at pos (True); None while the text so far is a prefix of it; anything
        else ends the block."""
        got = text[self.pos : self.pos + len(literal)]
        if got == literal:
            self.pos += len(literal)
            self._expect = then
            return True
        if literal.startswith(got):
            return None
        self._expect = "done"
        return True

    def _open(self, text: str, objs: list[dict[str, Any]]) -> bool | None:
        if not self.fmt.open and self._blocks:  # a bare object format carries one call
            self._expect = "done"
            return True
        return self._literal(text, self.fmt.open, "list" if self.fmt.as_list else "object")

    def _list(self, text: str, objs: list[dict[str, Any]]) -> bool | None:
        self.pos = _skip_ws(text, self.pos)
        return self._literal(text, "[", "object")

    def _object(self, text: str, objs: list[dict[str, Any]]) -> bool | None:
        if self._scanning is None:
            if self.fmt.as_list:
                self.pos = _skip_ws(text, self.pos)
            if self.pos >= len(text):
                return None
            if text[self.pos] != "{":
                self._expect = "done"
                return True
            self._scanning = _ObjectEnd(self.pos)
        end = self._scanning.scan(text)
        if end is None:
            return None
        try:
            obj = json.loads(text[self._scanning.start : end])
        except json.JSONDecodeError:
            self._expect = "done"
            return True
        self._scanning, self.pos = None, end
        objs.append(obj)
        self._expect = "next" if self.fmt.as_list else "close"
        return True

    def _next(self, text: str, objs: list[dict[str, Any]]) -> bool | None:
        self.pos = _skip_ws(text, self.pos)
        if self.pos >= len(text):
            return None
        if text[self.pos] == ",":
            self.pos += 1
            self._expect = "object"
            return True
        return self._literal(text, "]", "close")

    def _close(self, text: str, objs: list[dict[str, Any]]) -> bool | None:
        self._blocks += 1
        if not self.fmt.close:
            self._expect = "done"
            return True
        return self._literal(text, self.fmt.close, "gap")

    def _gap(self, text: str, objs: list[dict[str, Any]]) -> bool | None:
        if self.pos >= len(text):
            return None
        if text[self.pos] == "\n":
            self.pos += 1
        self._expect = "open"
        return True


class _ObjectEnd:
    """Finds where a JSON object starting at `start` ends, reading each character once."""

    def __init__(self, start: int) -> None:
        self.start = self.pos = start
        self.depth = 0
        self.in_string = self.escaped = False

    def scan(self, text: str) -> int | None:
        """The end (exclusive) once the object is complete, else None (read on next time)."""
        for i in range(self.pos, len(text)):
            ch = text[i]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.pos = i + 1
                    return i + 1
        self.pos = len(text)
        return None


def _skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in _WHITESPACE:
        pos += 1
    return pos


def _openai_call(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments)},
    }


def prepare_chat(
    messages: list[dict[str, Any]], tools: list[ToolSpec], fmt: ToolCallFormat, renders_tools: bool
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The template's messages and `tools` argument for a conversation that may involve tools.

    A template that lays out tools gets them (and earlier calls as structured `tool_calls`);
    otherwise the tools are described in the system turn and earlier calls written as text.
    """
    out = [_with_calls(message, fmt, renders_tools) for message in messages]
    if not tools:
        return out, None
    if renders_tools:
        return out, [t.as_openai() for t in tools]
    return _with_system_prompt(out, tools_system_prompt(tools, fmt)), None


def _with_system_prompt(messages: list[dict[str, Any]], prompt: str) -> list[dict[str, Any]]:
    """prompt appended to the conversation's system turn, or as one when it has none."""
    if messages and messages[0]["role"] == "system":
        first = messages[0]
        text = f"{first['content']}\n\n{prompt}" if first["content"] else prompt
        return [{**first, "content": text}, *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]


def _structured_call(call: dict[str, Any]) -> dict[str, Any]:
    """An earlier call as a template's `tool_calls` item (arguments parsed back into JSON)."""
    function = call["function"]
    return {
        "type": "function",
        "function": {"name": function["name"], "arguments": _arguments(function.get("arguments"))},
    }


def _with_calls(
    message: dict[str, Any], fmt: ToolCallFormat, renders_tools: bool
) -> dict[str, Any]:
    """A copy of message whose earlier tool calls are structured `tool_calls` (a template that
    lays out tools) or written into its text."""
    message = dict(message)
    calls = message.pop("tool_calls", None) or []
    if calls and renders_tools:
        message["tool_calls"] = [_structured_call(c) for c in calls]
    elif calls:
        text = message.get("content") or ""
        call_text = render_call_text(calls, fmt)
        message["content"] = f"{text}\n{call_text}" if text else call_text
    return message
