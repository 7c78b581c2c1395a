"""A Messages body as the chat completion request it means, and its refusals: every unknown field,
wrong type, out-of-range value and unsupported block is a 400 naming its path in the Messages
body, through the same body parser the ingress runs."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from pydantic import ValidationError

from deploy.anthropic_schema import CountTokensRequest, MessagesRequest, Names
from deploy.body import parse_body
from deploy.errors import APIError, BadRequestError, error_event
from deploy.schemas import MAX_MESSAGES

WEATHER = {
    "name": "get_weather",
    "description": "The current weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}


def _body(**fields: Any) -> dict[str, Any]:
    return {
        "model": "m",
        "max_tokens": 16,
        "messages": [{"role": "user", "content": "hi"}],
        **fields,
    }


def _parse(body: dict[str, Any], schema: type = MessagesRequest) -> Any:
    raw = json.dumps(body).replace('"NaN"', "NaN").encode()
    return asyncio.run(parse_body(raw, schema, MAX_MESSAGES))


def _chat(body: dict[str, Any]) -> Any:
    return _parse(body).as_chat(MAX_MESSAGES)[0]


def _refusal(body: dict[str, Any]) -> dict[str, Any]:
    """The OpenAI error the server would map into Anthropic's shape."""
    with pytest.raises((ValidationError, ValueError, APIError)) as info:
        _chat(body)
    error = error_event(info.value)["error"]
    assert error["type"] == "invalid_request_error", error
    return error


def test_a_tool_round_trip_becomes_the_chat_conversation_it_means():
    body = _body(
        system=[{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Use tools."}],
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "I should call it.", "signature": ""},
                    {"type": "text", "text": "Checking."},
                    {
                        "type": "tool_use",
                        "id": "toolu_1",
                        "name": "get_weather",
                        "input": {"city": "Paris"},
                    },
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny"},
                    {"type": "text", "text": "And tomorrow?"},
                ],
            },
        ],
        tools=[WEATHER],
        tool_choice={"type": "auto", "disable_parallel_tool_use": True},
    )
    chat = _chat(body)
    messages = [m.model_dump(exclude_none=True) for m in chat.messages]
    assert messages == [
        {"role": "system", "content": "Be brief.\nUse tools."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "content": "Sunny", "tool_call_id": "toolu_1"},
        {"role": "user", "content": "And tomorrow?"},
    ]
    assert chat.tool_choice == "auto" and chat.parallel_tool_calls is False
    (tool,) = chat.tools
    assert tool.function.name == "get_weather"
    assert tool.function.parameters == WEATHER["input_schema"]
    assert chat.max_tokens == 16 and chat.add_generation_prompt


@pytest.mark.parametrize(
    "choice, chat_choice",
    [
        ({"type": "auto"}, "auto"),
        ({"type": "any"}, "required"),
        ({"type": "none"}, "none"),
        ({"type": "tool", "name": "get_weather"}, "get_weather"),
    ],
)
def test_each_tool_choice_is_the_chat_choice_it_means(choice, chat_choice):
    chat = _chat(_body(tools=[WEATHER], tool_choice=choice))
    assert chat.tool_choice_name == chat_choice
    assert chat.parallel_tool_calls is True


def test_sampling_stops_and_metadata_reach_the_chat_request():
    chat = _chat(
        _body(
            temperature=0.5,
            top_p=0.9,
            top_k=40,
            stop_sequences=["END", "\n\n"],
            metadata={"user_id": "u-1"},
            thinking={"type": "disabled"},
        )
    )
    assert (chat.temperature, chat.top_p, chat.top_k) == (0.5, 0.9, 40)
    # The stop string is kept in the text so that the reply can name the one that matched.
    assert chat.stop == ["END", "\n\n"] and chat.include_stop_str_in_output
    assert chat.user == "u-1"
    assert chat.chat_template_kwargs == {"enable_thinking": False}


def test_without_sampling_fields_the_chat_defaults_apply():
    chat = _chat(_body())
    assert (chat.temperature, chat.top_p, chat.top_k) == (1.0, 1.0, 0)
    assert chat.stop == [] and not chat.include_stop_str_in_output


def test_a_final_assistant_turn_is_continued():
    body = _body(
        messages=[
            {"role": "user", "content": "Pick A or B."},
            {"role": "assistant", "content": "The answer is ("},
        ]
    )
    chat = _chat(body)
    assert chat.continue_final_message and not chat.add_generation_prompt


def test_count_tokens_takes_the_prompt_fields_only():
    body = _body(tools=[WEATHER])
    del body["max_tokens"]
    request = _parse(body, CountTokensRequest)
    chat, _ = request.chat_request(MAX_MESSAGES, max_tokens=1)
    assert chat.tools[0].function.name == "get_weather"
    with pytest.raises(ValidationError) as info:
        _parse({**body, "max_tokens": 5}, CountTokensRequest)
    assert error_event(info.value)["error"]["param"] == "max_tokens"


HUGE = [2**64, -1, "NaN", 1e300]


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"frobnicate": 1}, "frobnicate"),
        ({"max_tokens": "many"}, "max_tokens"),
        ({"max_tokens": None}, "max_tokens"),
        ({"temperature": 1.5}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"stream": "yes"}, "stream"),
        ({"system": 5}, "system"),
        ({"system": [{"type": "text", "text": "x", "extra": 1}]}, "system.0.extra"),
        ({"metadata": {"user_id": "u", "tier": "gold"}}, "metadata.tier"),
        ({"metadata": {"user_id": "u" * 257}}, "metadata.user_id"),
        ({"stop_sequences": ["a"] * 5}, "stop_sequences"),
        ({"stop_sequences": "END"}, "stop_sequences"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "system", "content": "x"}]}, "messages.0.role"),
        ({"messages": [{"role": "user", "content": "x", "name": "n"}]}, "messages.0.name"),
        ({"messages": [{"role": "user", "content": []}]}, "messages.0.content"),
        ({"messages": [{"role": "user", "content": [{"text": "x"}]}]}, "messages.0.content.0"),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]},
            "messages.0.content.0.text",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "y": 1}]}]},
            "messages.0.content.0.y",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "video"}]}]},
            "messages.0.content.0.type",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": "hi"},
                    {
                        "role": "user",
                        "content": [{"type": "text", "text": "x"}, {"type": "image", "source": {}}],
                    },
                ]
            },
            "messages.1.content.1.source.type",  # an image block's source is checked here
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "tool_result",
                                "tool_use_id": "t",
                                "content": [{"type": "image"}],
                            }
                        ],
                    }
                ]
            },
            "messages.0.content.0.content.0",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}],
                    }
                ]
            },
            "messages.0.content.0.type",
        ),
        (
            {
                "messages": [
                    {"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t"}]}
                ]
            },
            "messages.0.content.0.type",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": "x"},
                    {
                        "role": "assistant",
                        "content": [{"type": "tool_use", "id": "t", "name": "f", "input": []}],
                    },
                ]
            },
            "messages.1.content.0.input",
        ),
        ({"tools": [{**WEATHER, "input_schema": {"type": "string"}}]}, "tools.0.input_schema.type"),
        ({"tools": [{**WEATHER, "name": "bad name"}]}, "tools.0.name"),
        ({"tools": [{**WEATHER, "type": "web_search_20250305"}]}, "tools.0.type"),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        ({"tools": [WEATHER] * 100_000}, "tools"),
        ({"tool_choice": {"type": "any"}}, "tool_choice.type"),
        ({"tools": [WEATHER], "tool_choice": {"type": "tool"}}, "tool_choice.name"),
        ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice.name"),
        ({"tools": [WEATHER], "tool_choice": {"type": "required"}}, "tool_choice.type"),
        ({"thinking": {"type": "enabled"}}, "thinking.budget_tokens"),
        ({"thinking": {"type": "enabled", "budget_tokens": 10}}, "thinking.budget_tokens"),
        ({"thinking": {"type": "disabled", "budget_tokens": 2048}}, "thinking.budget_tokens"),
        ({"cache_control": {"type": "persistent"}}, "cache_control.type"),
        ({"service_tier": "priority"}, "service_tier"),
        ({"messages": [{"role": "user", "content": "x"}] * (MAX_MESSAGES + 1)}, "messages"),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": ""}] * 100_000}]},
            "messages",
        ),
    ]
    + [({"max_tokens": v}, "max_tokens") for v in HUGE]
    + [({"temperature": v}, "temperature") for v in HUGE]
    + [({"top_p": v}, "top_p") for v in HUGE]
    + [({"top_k": v}, "top_k") for v in HUGE]
    + [
        ({"thinking": {"type": "enabled", "budget_tokens": v}}, "thinking.budget_tokens")
        for v in HUGE[1:]
    ]
    # A negative priority is valid (more urgent): its bounds are +-(2^31 - 1).
    + [({"priority": v}, "priority") for v in [2**64, -(2**64), "NaN", 1e300]],
)
def test_bad_fields_are_a_400_naming_their_path(fields, param):
    error = _refusal(_body(**fields))
    assert error["param"] == param, error
    assert error["message"].startswith(param), error


def test_a_thinking_budget_of_two_to_the_64_is_refused_naming_it():
    # Anthropic's only bound is the floor: the budget is bounded by max_tokens here.
    error = _refusal(_body(max_tokens=4096, thinking={"type": "enabled", "budget_tokens": 2**64}))
    assert error["param"] == "thinking.budget_tokens"


def test_a_chat_error_on_a_message_names_the_messages_block_it_came_from():
    names = Names(["system", "messages.0", "messages.2.content.1", "messages.2"])
    assert names.rename("messages.2.content") == "messages.2.content.1.content"
    assert names.rename("messages[3].tool_calls") == "messages.2.tool_calls"
    assert names.rename("messages") == "messages"
    assert names.rename("messages.9") == "messages.9"  # no such chat message: as it is
    assert names.rename("tools[0].function.parameters") == "tools.0.input_schema"
    assert names.rename("tool_choice.function.name") == "tool_choice.name"
    assert names.rename("stop") == "stop_sequences"
    error = names.renamed(ValueError("messages[2].content: must not contain a control token"))
    assert isinstance(error, BadRequestError)
    assert error.param == "messages.2.content.1.content"
    assert error.message.startswith("messages.2.content.1.content: must not")
