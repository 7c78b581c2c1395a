"""Anthropic's Messages API through the official anthropic client, against the shared session apps:
text, a tool round trip and a multi-turn conversation, streamed and not, each event parsed by the
client's own types; the reply is the chat completion the request means (greedy: the same text and
token counts), and count_tokens is the prompt the request sends."""

from __future__ import annotations

import anthropic
import httpx
import pytest
from anthropic.types import (
    RawContentBlockDeltaEvent,
    RawContentBlockStartEvent,
    RawContentBlockStopEvent,
    RawMessageDeltaEvent,
    RawMessageStartEvent,
    RawMessageStopEvent,
)
from openai import OpenAI

from tests.deploy.conftest import SMOL, THINK, TINY, TINY_KEY

pytestmark = pytest.mark.slow

GREEDY = {"temperature": 0}  # sent as extra_body: the client's create() no longer declares it
WEATHER = {
    "name": "get_weather",
    "description": "The current weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
RAW_TYPES = (
    RawMessageStartEvent,
    RawContentBlockStartEvent,
    RawContentBlockDeltaEvent,
    RawContentBlockStopEvent,
    RawMessageDeltaEvent,
    RawMessageStopEvent,
)


def _client(url: str, key: str = "unused") -> anthropic.Anthropic:
    return anthropic.Anthropic(
        base_url=url.removesuffix("/v1"), api_key=key, max_retries=0, timeout=300
    )


@pytest.fixture(scope="module")
def client(smol_url):
    return _client(smol_url)


@pytest.fixture(scope="module")
def openai_client(smol_url):
    return OpenAI(base_url=smol_url, api_key="unused", max_retries=0, timeout=120)


def _text(message) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def test_a_text_message_is_the_chat_completion_it_means(client, openai_client):
    system, question = "Answer in one short sentence.", "What is the capital of France?"
    message = client.messages.create(
        model=SMOL,
        system=system,
        messages=[{"role": "user", "content": question}],
        max_tokens=12,
        extra_body=GREEDY,
    )
    chat = openai_client.chat.completions.create(
        model=SMOL,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
        max_tokens=12,
        temperature=0,
    )
    assert message.type == "message" and message.role == "assistant"
    assert message.id.startswith("msg_") and message.model == SMOL
    assert _text(message) == chat.choices[0].message.content and "Paris" in _text(message)
    assert message.usage.input_tokens == chat.usage.prompt_tokens
    assert message.usage.output_tokens == chat.usage.completion_tokens
    finish = chat.choices[0].finish_reason
    assert message.stop_reason == ("max_tokens" if finish == "length" else "end_turn")
    counted = client.messages.count_tokens(
        model=SMOL, system=system, messages=[{"role": "user", "content": question}]
    )
    assert counted.input_tokens == message.usage.input_tokens


def test_streamed_events_are_typed_and_add_up_to_the_message(client):
    kwargs = dict(
        model=SMOL,
        messages=[{"role": "user", "content": "Name three colours."}],
        max_tokens=10,
        extra_body=GREEDY,
    )
    whole = client.messages.create(**kwargs)
    events = list(client.messages.create(stream=True, **kwargs))
    assert all(isinstance(e, RAW_TYPES) for e in events)  # pings are the client's to skip
    types = [e.type for e in events]
    assert types[:2] == ["message_start", "content_block_start"]
    assert types[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(types[2:-3]) == {"content_block_delta"}
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert text == _text(whole)
    assert events[-2].delta.stop_reason == whole.stop_reason == "max_tokens"
    assert events[-2].usage.output_tokens == whole.usage.output_tokens == 10
    assert events[0].message.usage.input_tokens == whole.usage.input_tokens
    # The client's own accumulator builds the same message from the events.
    with client.messages.stream(**kwargs) as stream:
        final = stream.get_final_message()
        assert stream.get_final_text() == _text(whole)
    assert [b.type for b in final.content] == ["text"] and final.usage.output_tokens == 10


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_round_trip(client, stream):
    """tool_use -> tool_result -> an answer, the assistant's blocks sent back as the client
    returned them."""
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    kwargs = dict(
        model=SMOL,
        messages=question,
        tools=[WEATHER],
        tool_choice={"type": "any"},
        max_tokens=60,
        extra_body=GREEDY,
    )
    if stream:
        with client.messages.stream(**kwargs) as s:
            events = list(s)
            message = s.get_final_message()
        deltas = [e for e in events if e.type == "content_block_delta"]
        assert {e.delta.type for e in deltas} == {"input_json_delta"}
    else:
        message = client.messages.create(**kwargs)
    assert message.stop_reason == "tool_use"
    (call,) = [b for b in message.content if b.type == "tool_use"]
    assert call.name == "get_weather" and set(call.input) == {"city"}
    assert call.id.startswith("toolu_")
    follow = client.messages.create(
        model=SMOL,
        messages=question
        + [{"role": "assistant", "content": message.content}]
        + [
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": call.id, "content": "Sunny, 24 C"}
                ],
            }
        ],
        tools=[WEATHER],
        tool_choice={"type": "none"},
        max_tokens=20,
        extra_body=GREEDY,
    )
    assert [b.type for b in follow.content] == ["text"] and _text(follow)
    assert follow.stop_reason in ("end_turn", "max_tokens")


def test_a_multi_turn_conversation_is_the_chat_it_means(client, openai_client):
    turns = ["My name is Ada.", "What is my name?"]
    anthropic_messages: list = []
    chat_messages: list = []
    sent = 0  # the conversation's tokens so far: each turn's prompt holds the earlier ones
    for turn in turns:
        anthropic_messages.append({"role": "user", "content": turn})
        chat_messages.append({"role": "user", "content": turn})
        message = client.messages.create(
            model=SMOL, messages=anthropic_messages, max_tokens=16, extra_body=GREEDY
        )
        chat = openai_client.chat.completions.create(
            model=SMOL, messages=chat_messages, max_tokens=16, temperature=0
        )
        assert _text(message) == chat.choices[0].message.content
        assert message.usage.input_tokens == chat.usage.prompt_tokens
        assert message.usage.input_tokens > sent
        sent = message.usage.input_tokens + message.usage.output_tokens
        anthropic_messages.append({"role": "assistant", "content": message.content})
        chat_messages.append({"role": "assistant", "content": _text(message)})


def test_a_stop_sequence_ends_the_reply_and_is_named(client):
    kwargs = dict(
        model=SMOL,
        messages=[{"role": "user", "content": "Count from one to ten in words."}],
        max_tokens=30,
        extra_body=GREEDY,
    )
    free = _text(client.messages.create(**kwargs))
    stop = free.split()[2]  # a word the greedy reply certainly writes
    cut = client.messages.create(stop_sequences=[stop, "unlikely-stop"], **kwargs)
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert _text(cut) == free[: free.index(stop)]
    events = list(client.messages.create(stop_sequences=[stop], stream=True, **kwargs))
    assert events[-2].delta.stop_sequence == stop
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == _text(cut)


def test_count_tokens_is_the_prompt_of_a_request_with_tools(client):
    kwargs = dict(
        model=SMOL,
        system=[{"type": "text", "text": "You are terse."}],
        messages=[{"role": "user", "content": "Weather in Oslo?"}],
        tools=[WEATHER],
    )
    counted = client.messages.count_tokens(**kwargs)
    message = client.messages.create(max_tokens=40, tool_choice={"type": "any"}, **kwargs)
    assert counted.input_tokens == message.usage.input_tokens > 0


def test_thinking_is_the_reasoning_parsers_split(think_url):
    """On a model with a reasoning parser, the reasoning is a thinking block: the chat
    completion's reasoning_content, streamed as thinking deltas."""
    client = _client(think_url)
    kwargs = dict(
        model=THINK,
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=8,
        thinking={"type": "adaptive"},  # "enabled" needs a budget of 1,024 under max_tokens
        extra_body=GREEDY,
    )
    message = client.messages.create(**kwargs)
    chat = OpenAI(base_url=think_url, api_key="unused", max_retries=0).chat.completions.create(
        model=THINK, messages=kwargs["messages"], max_tokens=8, temperature=0
    )
    reasoning = chat.choices[0].message.reasoning_content  # type: ignore[attr-defined]
    assert message.content[0].type == "thinking" and message.content[0].thinking == reasoning
    events = list(client.messages.create(stream=True, **kwargs))
    thinking = "".join(e.delta.thinking for e in events if e.type == "content_block_delta")
    assert thinking == reasoning


def test_x_api_key_is_accepted_beside_a_bearer_key(tiny_url):
    body = dict(model=TINY, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert _client(tiny_url, TINY_KEY).messages.create(**body).usage.output_tokens == 2
    bearer = anthropic.Anthropic(
        base_url=tiny_url.removesuffix("/v1"), auth_token=TINY_KEY, max_retries=0, timeout=300
    )
    assert bearer.messages.create(**body).usage.output_tokens == 2
    with pytest.raises(anthropic.AuthenticationError) as info:
        _client(tiny_url, "wrong").messages.create(**body)
    assert info.value.status_code == 401
    assert info.value.body["type"] == "error"
    assert info.value.body["error"]["type"] == "authentication_error"
    r = httpx.post(f"{tiny_url}/messages", json=body, timeout=300)  # no key at all
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


def test_an_unknown_model_is_anthropics_not_found_error(client):
    with pytest.raises(anthropic.NotFoundError) as info:
        client.messages.create(
            model="no-such-model", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
    assert info.value.body["error"]["type"] == "not_found_error"


def test_an_image_block_to_a_text_model_is_refused_naming_its_path(client):
    image = {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": "AA=="},
    }
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(
            model=SMOL,
            messages=[
                {"role": "user", "content": [{"type": "text", "text": "What is it?"}, image]}
            ],
            max_tokens=2,
        )
    error = info.value.body["error"]
    assert error["type"] == "invalid_request_error"
    assert error["message"].startswith("messages.0.content.1.source: the model")
    assert "takes no images" in error["message"]
