"""Which request fields a body may carry (deploy/fields.py), without Ray: every key is one the
schema implements, a neutral value of one it does not, or refused naming its path; under
`ignore` it is dropped and listed in a bounded, ASCII-only header."""

from __future__ import annotations

import json
import typing

import pytest

from deploy.body import _parsed
from deploy.errors import BadRequestError
from deploy.fields import IGNORED_HEADER, MAX_LISTED, Ignored, _known, check_fields
from deploy.schemas import ChatCompletionRequest, CompletionRequest
from deploy.tokenize import DetokenizeRequest, TokenizeRequest

CHAT = {"model": "m", "messages": [{"role": "user", "content": "Hi"}]}
COMPLETION = {"model": "m", "prompt": "Hi"}


def _refused(body: dict, schema: type = ChatCompletionRequest) -> BadRequestError:
    with pytest.raises(BadRequestError) as err:
        check_fields(json.loads(json.dumps(body)), schema, "reject")
    return err.value


@pytest.mark.parametrize(
    "body, param",
    [
        ({**CHAT, "no_such_field": 1}, "no_such_field"),
        ({**CHAT, "best_of": 2}, "best_of"),
        ({**CHAT, "store": True}, "store"),
        ({**CHAT, "reasoning_effort": "high"}, "reasoning_effort"),
        ({**CHAT, "chat_template": "{{ 7 * 7 }}"}, "chat_template"),
        ({**CHAT, "messages": [{"role": "user", "content": "x", "x": 1}]}, "messages.0.x"),
        ({**CHAT, "messages": [{"role": "assistant", "refusal": "no"}]}, "messages.0.refusal"),
        (
            {
                **CHAT,
                "messages": [{"role": "user", "content": [{"type": "text", "text": "", "y": 0}]}],
            },
            "messages.0.content.0.y",
        ),
        ({**CHAT, "stream_options": {"include_usage": True, "z": 1}}, "stream_options.z"),
        (
            {**CHAT, "tools": [{"type": "function", "function": {"name": "f", "w": 1}}]},
            "tools.0.function.w",
        ),
    ],
)
def test_an_unimplemented_field_is_refused_naming_its_path(body, param):
    err = _refused(body)
    assert err.param == param and err.message.startswith(f"{param}:") and err.status == 400


def test_tools_on_completions_are_refused_and_neutral_values_pass():
    assert (
        _refused({**COMPLETION, "tools": [{"type": "function"}]}, CompletionRequest).param
        == "tools"
    )
    body = {**COMPLETION, "best_of": 1, "suffix": "", "tools": [], "store": False, "echo": True}
    check_fields(body, CompletionRequest, "reject")
    assert "best_of" not in body and "echo" in body  # a neutral value never reaches the schema


def test_what_the_openai_client_writes_back_passes():
    # A reply's message appended to the conversation as the client's model_dump gives it.
    reply = {
        "role": "assistant",
        "content": "Hi",
        "refusal": None,
        "annotations": None,
        "audio": None,
        "function_call": None,
        "tool_calls": None,
    }
    check_fields({**CHAT, "messages": [reply]}, ChatCompletionRequest, "reject")


@pytest.mark.parametrize("schema", [ChatCompletionRequest, CompletionRequest])
def test_every_field_of_the_openai_client_is_implemented_or_refused_by_name(schema):
    # A newer client that documents a new field fails here until it is implemented or listed.
    from openai.types import completion_create_params as completion
    from openai.types.chat import completion_create_params as chat

    params = (chat if schema is ChatCompletionRequest else completion).CompletionCreateParamsBase
    documented = {k for c in params.__mro__ for k in typing.get_type_hints(c) if c is not dict}
    assert documented - set(_known(schema)) - set(schema.NEUTRAL) == set()


def test_ignore_drops_and_lists_them_in_a_bounded_ascii_header():
    body = {**CHAT, "a": 1, "b\r\nSet-Cookie: x": 2, "\u00e9" * 500: 3, "best_of": 3}
    body["messages"] = [{"role": "user", "content": "x", "q": 1}]
    ignored = check_fields(body, ChatCompletionRequest, "ignore")
    assert set(body) == {"model", "messages"} and body["messages"][0] == {
        "role": "user",
        "content": "x",
    }
    header = ignored.header()[IGNORED_HEADER]
    assert header.isascii() and "\r" not in header and "\n" not in header and len(header) < 2000
    assert (
        header.startswith("a, b%0D%0ASet-Cookie")
        and "best_of" in header
        and "messages.0.q" in header
    )
    many = check_fields(
        {**CHAT, **{f"k{i}": 0 for i in range(100_000)}}, ChatCompletionRequest, "ignore"
    )
    assert many.count == 100_000 and many.header()[IGNORED_HEADER].endswith(
        f"+{100_000 - MAX_LISTED} more"
    )
    assert Ignored().header() == {}


def test_parsing_under_ignore_validates_what_is_left():
    ignored = Ignored()
    raw = json.dumps({**COMPLETION, "min_tokens": 2, "frobnicate": True}).encode()
    body = _parsed(raw, CompletionRequest, 2048, "ignore", ignored)
    assert body.min_tokens == 2 and ignored.paths == ["frobnicate"]


@pytest.mark.parametrize(
    "schema, body", [(TokenizeRequest, {"prompt": "x"}), (DetokenizeRequest, {"tokens": [1]})]
)
def test_tokenize_bodies_are_strict_too(schema, body):
    assert _refused({**body, "nope": 1}, schema).param == "nope"
