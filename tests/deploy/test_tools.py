"""Tool calling without a model: formats from templates, grammars that accept exactly valid calls,
and parsing calls back out of text, whole and as it streams."""

import json

import llguidance
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deploy.tools import (
    HERMES,
    LLAMA3_JSON,
    SMOLLM2,
    DeclaredTools,
    ToolCallFormat,
    ToolCallParser,
    ToolSpec,
    detect_format,
    prepare_chat,
    template_renders_tools,
    tool_constraint,
)
from workers.grammar import to_grammar

WEATHER = ToolSpec(
    "get_weather",
    "Current weather of a city",
    {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
        "required": ["city"],
        "additionalProperties": False,
    },
)
ADD = ToolSpec(
    "add",
    "Sum of two integers",
    {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"],
    },
)


def accepts(grammar_text: str, text: str) -> bool:
    """Whether the grammar accepts `text` exactly (checked at the byte level, no tokenizer
    needed)."""
    tokenizer = llguidance.LLTokenizer("byte")
    matcher = llguidance.LLMatcher(tokenizer, grammar_text)
    ids = tokenizer.tokenize_bytes(text.encode())
    return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()


def parser_for(fmt: ToolCallFormat, tools: tuple[ToolSpec, ...] = (WEATHER, ADD)) -> ToolCallParser:
    return ToolCallParser(DeclaredTools.of(list(tools), fmt))


def test_formats_are_recognised_from_the_chat_template():
    assert detect_format("{{ '<|im_start|>' }}{% for m in messages %}{% endfor %}") is SMOLLM2
    assert detect_format("{% if tools %}<tool_call>{% endif %}") is HERMES
    assert detect_format("<|start_header_id|>{{ role }}<|end_header_id|>") is LLAMA3_JSON
    assert template_renders_tools("{% if tools %}x{% endif %}")
    assert not template_renders_tools("{% for m in messages %}{% endfor %}")


@pytest.mark.parametrize("fmt", [SMOLLM2, HERMES, LLAMA3_JSON], ids=lambda f: f.name)
def test_required_accepts_valid_calls_only(fmt):
    grammar = to_grammar(tool_constraint([WEATHER, ADD], "required", fmt))
    key = fmt.arguments_key
    good = {"name": "get_weather", key: {"city": "Paris", "unit": "c"}}
    body = json.dumps([good]) if fmt.as_list else json.dumps(good)
    assert accepts(grammar, f"{fmt.open}{body}{fmt.close}")
    wrong_args = {"name": "get_weather", key: {"town": "Paris"}}
    wrong_name = {"name": "get_time", key: {}}
    for bad in (wrong_args, wrong_name):
        body = json.dumps([bad]) if fmt.as_list else json.dumps(bad)
        assert not accepts(grammar, f"{fmt.open}{body}{fmt.close}")
    assert not accepts(grammar, "Sure, the weather is nice.")


def test_a_named_choice_allows_that_function_only():
    grammar = to_grammar(tool_constraint([WEATHER, ADD], "add", SMOLLM2))
    assert accepts(
        grammar, '<tool_call>[{"name": "add", "arguments": {"a": 1, "b": 2}}]</tool_call>'
    )
    assert not accepts(
        grammar, '<tool_call>[{"name": "get_weather", "arguments": {"city": "x"}}]</tool_call>'
    )


def test_auto_allows_text_or_calls_but_nothing_malformed_after_the_marker():
    grammar = to_grammar(tool_constraint([WEATHER], "auto", SMOLLM2))
    assert accepts(grammar, "It is sunny, no tool needed.")
    assert accepts(
        grammar, '<tool_call>[{"name": "get_weather", "arguments": {"city": "Oslo"}}]</tool_call>'
    )
    assert not accepts(grammar, "<tool_call>I changed my mind")
    assert not accepts(grammar, '  <tool_call>[{"name": "nope", "arguments": {}}]</tool_call>')


def test_parallel_calls_are_allowed_unless_turned_off():
    two = (
        '<tool_call>[{"name": "add", "arguments": {"a": 1, "b": 2}}, '
        '{"name": "add", "arguments": {"a": 3, "b": 4}}]</tool_call>'
    )
    assert accepts(to_grammar(tool_constraint([ADD], "required", SMOLLM2)), two)
    assert not accepts(to_grammar(tool_constraint([ADD], "required", SMOLLM2, parallel=False)), two)


def test_streamed_parsing_holds_back_a_possible_marker_and_emits_each_call_once_complete():
    parser = parser_for(HERMES)
    pieces = [
        "<tool",
        '_call>\n{"name": "add", "arguments": {"a"',
        ': 1, "b": 2}}\n</tool_call>',
        '\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>',
    ]
    sent = [parser.feed(p) for p in pieces]
    assert [content for content, _ in sent] == ["", "", "", ""]
    assert [len(calls) for _, calls in sent] == [0, 0, 1, 1]
    first, second = sent[2][1][0], sent[3][1][0]
    assert first["function"] == {"name": "add", "arguments": json.dumps({"a": 1, "b": 2})}
    assert json.loads(second["function"]["arguments"]) == {"city": "Rome"}
    assert first["id"] != second["id"] and first["type"] == "function"
    assert parser.finish() == ("", [])


def test_plain_text_streams_as_content_once_it_cannot_be_a_call():
    parser = parser_for(SMOLLM2)
    assert parser.feed("<") == ("", [])
    assert parser.feed("b>bold</b>") == ("<b>bold</b>", [])
    assert parser.feed(" more") == (" more", [])


def test_a_call_cut_off_before_it_completes_comes_back_as_text():
    parser = parser_for(SMOLLM2)
    assert parser.feed('<tool_call>[{"name": "add", "argu') == ("", [])
    assert parser.finish() == ('<tool_call>[{"name": "add", "argu', [])


def test_templates_without_tools_get_them_described_and_past_calls_written_back():
    history = [
        {"role": "user", "content": "Add 1 and 2"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'},
                }
            ],
        },
        {"role": "tool", "content": "3", "tool_call_id": "c1"},
    ]
    messages, tools_arg = prepare_chat(history, [ADD], SMOLLM2, renders_tools=False)
    assert tools_arg is None
    assert messages[0]["role"] == "system" and '"name": "add"' in messages[0]["content"]
    assert (
        messages[2]["content"]
        == '<tool_call>[{"name": "add", "arguments": {"a": 1, "b": 2}}]</tool_call>'
    )
    messages, tools_arg = prepare_chat(history, [ADD], HERMES, renders_tools=True)
    assert tools_arg == [ADD.as_openai()]
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"a": 1, "b": 2}


# Characters that str.isspace() calls whitespace but a grammar's regex class may not.
_SPACE_LIKE = " \t\r\n\x0b\x0c\x1c\x1d\x1e\x1f\x85\xa0\u2028\u3000"


@settings(max_examples=60, deadline=None)
@given(
    prefix=st.text(alphabet=_SPACE_LIKE, max_size=4),
    fmt=st.sampled_from([SMOLLM2, HERMES]),
    arguments=st.sampled_from([{"city": "Oslo"}, {"town": "Oslo"}, {"city": 3}]),
    name=st.sampled_from(["get_weather", "get_time"]),
)
def test_whatever_the_auto_grammar_passes_comes_back_only_as_valid_declared_calls(
    prefix, fmt, arguments, name
):
    """The grammar and the parser agree on where a call starts: text that the grammar lets through
    as plain text is never read back as a call (a call to an undeclared function, or with
    arguments outside the schema, would otherwise reach the client)."""
    grammar = to_grammar(tool_constraint([WEATHER], "auto", fmt))
    call = {"name": name, fmt.arguments_key: arguments}
    body = json.dumps([call]) if fmt.as_list else json.dumps(call)
    text = f"{prefix}{fmt.open}{body}{fmt.close}"
    if not accepts(grammar, text):
        return
    parser = parser_for(fmt, (WEATHER,))
    calls = parser.feed(text)[1] + parser.finish()[1]
    for c in calls:
        assert c["function"]["name"] == "get_weather"
        assert json.loads(c["function"]["arguments"]) == {"city": "Oslo"}


def test_a_reply_opening_with_a_control_character_is_plain_text():
    text = '\x1c<tool_call>[{"name": "get_time", "arguments": {}}]</tool_call>'
    assert accepts(to_grammar(tool_constraint([WEATHER], "auto", SMOLLM2)), text)  # as TEXT
    parser = parser_for(SMOLLM2)
    assert parser.feed(text) == (text, [])
    assert parser.finish() == ("", []) and not parser.calls


def test_a_call_of_an_undeclared_function_never_comes_back():
    parser = parser_for(SMOLLM2, (ADD,))
    text = '<tool_call>[{"name": "get_weather", "arguments": {"city": "Rome"}}]</tool_call>'
    assert parser.feed(text) == ("", [])
    assert parser.finish() == (text, [])  # what never became a call is the reply's text


def test_streamed_parsing_reads_each_call_once_however_the_text_is_cut(monkeypatch):
    """A long call fed a character at a time is decoded once, when it completes (no re-parse of
    the whole text on every delta)."""
    import deploy.tools

    decoded = []
    real_loads = json.loads
    monkeypatch.setattr(deploy.tools.json, "loads", lambda s: decoded.append(s) or real_loads(s))
    city = "x" * 5000 + '\\"}]{['
    text = (
        f'<tool_call>[{{"name": "get_weather", "arguments": {{"city": "{city}"}}}}, '
        '{"name": "add", "arguments": {"a": 1, "b": 2}}]</tool_call>'
    )
    parser = parser_for(SMOLLM2)
    calls = [c for ch in text for c in parser.feed(ch)[1]]
    assert len(decoded) == 2  # json.loads here is the module's: count before reading the calls
    assert [c["function"]["name"] for c in calls] == ["get_weather", "add"]
    assert json.loads(calls[0]["function"]["arguments"])["city"] == city.replace('\\"', '"')
