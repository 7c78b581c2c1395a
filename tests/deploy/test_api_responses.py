"""The Responses API through the official openai client: text, a function tool, a JSON schema,
streamed and not, parsed by the client's own types."""

from __future__ import annotations

import json

import httpx
import pytest
from openai import OpenAI

from tests.deploy.conftest import SMOL

pytestmark = pytest.mark.slow

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
CITY = {
    "type": "json_schema",
    "name": "city",
    "schema": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "population": {"type": "integer"},
        },
        "required": ["name", "population"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def client(smol_url):
    return OpenAI(base_url=smol_url, api_key="unused", max_retries=0, timeout=120)


def test_a_text_response_matches_chat_and_counts_its_tokens(client):
    response = client.responses.create(
        model=SMOL,
        instructions="Answer in one short sentence.",
        input="What is the capital of France?",
        max_output_tokens=12,
        temperature=0,
    )
    chat = client.chat.completions.create(
        model=SMOL,
        messages=[
            {"role": "system", "content": "Answer in one short sentence."},
            {"role": "user", "content": "What is the capital of France?"},
        ],
        max_tokens=12,
        temperature=0,
    )
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.output_text == chat.choices[0].message.content
    assert "Paris" in response.output_text
    assert response.output[0].type == "message" and response.output[0].role == "assistant"
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    assert response.status == (
        "incomplete" if chat.choices[0].finish_reason == "length" else "completed"
    )


def test_streamed_events_are_typed_numbered_and_add_up_to_the_response(client):
    kwargs = dict(model=SMOL, input="Name three colours.", max_output_tokens=10, temperature=0)
    whole = client.responses.create(**kwargs)
    events = list(client.responses.create(stream=True, **kwargs))
    types = [e.type for e in events]
    assert types[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert types[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",  # max_output_tokens cut it
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text
    final = events[-1].response
    assert final.output_text == text and final.incomplete_details.reason == "max_output_tokens"
    assert final.usage.output_tokens == 10


@pytest.mark.parametrize("stream", [False, True])
def test_a_required_function_tool_is_called_and_the_loop_goes_on(client, stream):
    kwargs = dict(
        model=SMOL,
        input=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[WEATHER],
        tool_choice="required",
        max_output_tokens=60,
        temperature=0,
    )
    if stream:
        events = list(client.responses.create(stream=True, **kwargs))
        types = [e.type for e in events]
        assert "response.function_call_arguments.delta" in types
        assert "response.function_call_arguments.done" in types
        assert types[-1] == "response.completed"
        response = events[-1].response
        deltas = "".join(
            e.delta for e in events if e.type == "response.function_call_arguments.delta"
        )
        assert deltas == response.output[0].arguments
    else:
        response = client.responses.create(**kwargs)
    call = response.output[0]
    assert call.type == "function_call" and call.name == "get_weather"
    assert set(json.loads(call.arguments)) == {"city"}
    # The agent loop: the call and its output go back as input, and the model answers.
    follow = client.responses.create(
        model=SMOL,
        input=kwargs["input"]
        + [call.model_dump(exclude_none=True)]
        + [{"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 24 C"}],
        tools=[WEATHER],
        tool_choice="none",
        max_output_tokens=20,
        temperature=0,
    )
    assert follow.output[0].type == "message" and follow.output_text


@pytest.mark.parametrize("stream", [False, True])
def test_a_json_schema_format_gives_valid_json(client, stream):
    kwargs = dict(
        model=SMOL,
        input="Give the largest city of Japan and its population.",
        text={"format": CITY},
        max_output_tokens=60,
        temperature=0,
    )
    if stream:
        events = list(client.responses.create(stream=True, **kwargs))
        response = events[-1].response
        assert events[-1].type == "response.completed"
    else:
        response = client.responses.create(**kwargs)
    city = json.loads(response.output_text)
    assert set(city) == {"name", "population"} and isinstance(city["population"], int)
    assert response.text.format.type == "json_schema"


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"store": True}, "store"),
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"frobnicate": 1}, "frobnicate"),
        ({"max_output_tokens": 2**64}, "max_output_tokens"),
        ({"max_output_tokens": -1}, "max_output_tokens"),
        ({"temperature": "NaN"}, "temperature"),
        ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input.0.content"),
        ({"input": [{}] * 100_000}, "input"),
    ],
)
def test_bad_fields_are_a_400_naming_them(smol_url, fields, param):
    body = {"model": SMOL, "input": "hi", **fields}
    raw = json.dumps(body).replace('"NaN"', "NaN")
    r = httpx.post(
        f"{smol_url}/responses",
        content=raw,
        headers={"content-type": "application/json"},
        timeout=60,
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"].startswith(param) and error["message"].startswith(param)
