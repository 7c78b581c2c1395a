"""Structured outputs and tool calls over HTTP: the official openai client against deploy.yaml
(SmolLM2)."""

import json
import re

import httpx
import jsonschema
import pytest
from openai import OpenAI

from tests.deploy.conftest import SMOL

pytestmark = pytest.mark.slow

ORDER = {
    "type": "object",
    "properties": {
        "item": {"type": "string", "maxLength": 20},
        "quantity": {"type": "integer", "minimum": 1, "maximum": 9},
        "size": {"enum": ["small", "medium", "large"]},
        "extras": {"type": "array", "items": {"enum": ["milk", "sugar", "ice"]}, "maxItems": 2},
    },
    "required": ["item", "quantity", "size", "extras"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 30},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Current time in a timezone",
        "parameters": {
            "type": "object",
            "properties": {"timezone": {"type": "string", "maxLength": 30}},
            "required": ["timezone"],
            "additionalProperties": False,
        },
    },
}
PARAMS = {
    "get_weather": WEATHER["function"]["parameters"],
    "get_time": TIME["function"]["parameters"],
}
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]


@pytest.fixture(scope="module")
def client(smol_url):
    return OpenAI(base_url=smol_url, api_key="unused", max_retries=0, timeout=120)


def assert_valid_calls(calls, allowed: set[str]) -> None:
    assert calls, "expected at least one tool call"
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in allowed
        jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])


def streamed_chat(client, **kwargs) -> tuple[str, dict[int, dict], str]:
    """(content, tool calls by index accumulated from deltas, finish_reason) of a streamed chat."""
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(model=SMOL, stream=True, **kwargs):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for d in choice.delta.tool_calls or []:
            call = calls.setdefault(d.index, {"id": d.id, "name": "", "arguments": ""})
            call["name"] += d.function.name or ""
            call["arguments"] += d.function.arguments or ""
        finish = choice.finish_reason or finish
    return content, calls, finish


def test_response_format_json_schema_outputs_validate(client):
    for i, drink in enumerate(["a latte", "an iced tea", "two espressos", "a hot chocolate"]):
        r = client.chat.completions.create(
            model=SMOL,
            messages=[{"role": "user", "content": f"Order {drink} as JSON."}],
            max_tokens=80,
            temperature=0.7,
            seed=i,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "order", "schema": ORDER},
            },
        )
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), ORDER)


def test_json_object_and_structured_outputs_on_completions(client):
    ask = 'Return a JSON object with the keys "name" and "city" for Ada, who lives in Paris.'
    r = client.chat.completions.create(
        model=SMOL,
        messages=[{"role": "user", "content": ask}],
        max_tokens=120,
        temperature=0,
        response_format={"type": "json_object"},
    )
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    r = client.completions.create(
        model=SMOL,
        prompt="A US phone number:",
        max_tokens=20,
        temperature=0.8,
        seed=3,
        n=3,
        extra_body={"structured_outputs": {"regex": r"\(\d{3}\) \d{3}-\d{4}"}},
    )
    assert all(re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", c.text) for c in r.choices), [
        c.text for c in r.choices
    ]
    choices = ["yes", "no", "maybe"]
    r = client.completions.create(
        model=SMOL,
        prompt="Is the sky green? Answer:",
        max_tokens=5,
        temperature=1.0,
        seed=1,
        n=3,
        extra_body={"structured_outputs": {"choice": choices}},
    )
    assert all(c.text in choices for c in r.choices)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_required_tool_choice_makes_a_valid_call(client, stream):
    kwargs = dict(
        messages=ASK, tools=[WEATHER, TIME], tool_choice="required", max_tokens=80, temperature=0
    )
    if stream:
        content, calls, finish = streamed_chat(client, **kwargs)
        assert finish == "tool_calls" and content == ""
        assert len({c["id"] for c in calls.values()}) == len(calls)
        for call in calls.values():
            jsonschema.validate(json.loads(call["arguments"]), PARAMS[call["name"]])
        return
    r = client.chat.completions.create(model=SMOL, **kwargs)
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
    assert_valid_calls(r.choices[0].message.tool_calls, {"get_weather", "get_time"})


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_named_tool_choice_calls_that_function(client, stream):
    kwargs = dict(
        messages=ASK,
        tools=[WEATHER, TIME],
        max_tokens=80,
        temperature=0.5,
        seed=7,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
    )
    if stream:
        _, calls, finish = streamed_chat(client, **kwargs)
        assert finish == "tool_calls" and [c["name"] for c in calls.values()] == ["get_time"]
        jsonschema.validate(json.loads(calls[0]["arguments"]), PARAMS["get_time"])
        return
    r = client.chat.completions.create(model=SMOL, **kwargs)
    assert_valid_calls(r.choices[0].message.tool_calls, {"get_time"})


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_auto_gives_text_or_valid_calls(client, stream):
    prompts = [ASK, [{"role": "user", "content": "Say hello to Bob in one short sentence."}]]
    for i, messages in enumerate(prompts):
        kwargs = dict(
            messages=messages, tools=[WEATHER, TIME], max_tokens=60, temperature=0.7, seed=i
        )
        if stream:
            content, calls, finish = streamed_chat(client, **kwargs)
            if calls:
                assert finish == "tool_calls" and content == ""
                for call in calls.values():
                    jsonschema.validate(json.loads(call["arguments"]), PARAMS[call["name"]])
            else:
                assert content and "<tool_call>" not in content
            continue
        r = client.chat.completions.create(model=SMOL, **kwargs)
        message = r.choices[0].message
        if message.tool_calls:
            assert r.choices[0].finish_reason == "tool_calls"
            assert_valid_calls(message.tool_calls, {"get_weather", "get_time"})
        else:
            assert message.content and "<tool_call>" not in message.content


def test_a_tool_result_conversation_continues(client):
    history = ASK + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "arguments": '{"city": "Paris", "unit": "celsius"}',
                    },
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"},
    ]
    r = client.chat.completions.create(
        model=SMOL,
        messages=history,
        tools=[WEATHER],
        tool_choice="none",
        max_tokens=30,
        temperature=0,
    )
    assert r.choices[0].message.content and not r.choices[0].message.tool_calls


@pytest.mark.parametrize(
    "body, param",
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "objectx"}},
                }
            },
            "response_format.json_schema.schema",
        ),
        ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs.regex"),
        ({"structured_outputs": {"grammar": "start: missing_rule"}}, "structured_outputs.grammar"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        (
            {"structured_outputs": {"whitespace_pattern": " "}},
            "structured_outputs.whitespace_pattern",
        ),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
        (
            {
                "tools": [WEATHER],
                "tool_choice": {"type": "function", "function": {"name": "launch"}},
            },
            "tool_choice",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        (
            {
                "tools": [WEATHER],
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            "response_format",
        ),
        ({"guided_json": "{not json"}, "guided_json"),
    ],
)
def test_bad_constraints_get_400_naming_the_field(smol_url, body, param):
    r = httpx.post(
        f"{smol_url}/chat/completions",
        timeout=60,
        json={"model": SMOL, "messages": ASK, "max_tokens": 4, **body},
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert "Traceback" not in r.text


def test_tools_on_completions_are_refused(smol_url):
    r = httpx.post(
        f"{smol_url}/completions",
        timeout=60,
        json={"model": SMOL, "prompt": "hi", "max_tokens": 4, "tools": [WEATHER]},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
