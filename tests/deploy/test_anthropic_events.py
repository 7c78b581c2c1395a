"""An Anthropic Messages reply built from a choice's deltas, checked against the anthropic
client's own types: each streamed event parses as its type, the blocks open, grow and close in
order, and the message they add up to is the non-streamed one."""

from __future__ import annotations

import json

import pytest
from anthropic.types import Message, RawMessageStreamEvent
from fastapi.responses import JSONResponse
from hypothesis import given
from hypothesis import strategies as st
from pydantic import TypeAdapter

from deploy.anthropic_events import MessageBuilder, anthropic_shaped
from deploy.errors import (
    BadRequestError,
    ContextLengthError,
    ModelNotFoundError,
    RequestTimeoutError,
    TooManyRequestsError,
    error_response,
)
from deploy.generation import ChoiceDelta
from deploy.reply import ReplySplit
from deploy.reply_format import typed_sse
from deploy.tools import SMOLLM2, DeclaredTools
from frontend.detokenizer import StopMatcher
from frontend.reasoning import PARSERS, ReasoningSplitter

EVENTS = TypeAdapter(RawMessageStreamEvent)
CALL = '<tool_call>[{"name": "f", "arguments": {"x": 1}}]</tool_call>'


def _run(
    pieces: list[str],
    finish: str,
    tools: bool = False,
    reasoning: bool = False,
    stops: list[str] | None = None,
) -> tuple[MessageBuilder, list[dict]]:
    split = ReplySplit(
        DeclaredTools(SMOLLM2, frozenset({"f"})) if tools else None,
        ReasoningSplitter(PARSERS["deepseek_r1"], True) if reasoning else None,
    )
    builder = MessageBuilder("m", split, 11, stops)
    events = builder.start()
    for i, text in enumerate(pieces):
        last = i == len(pieces) - 1
        delta = ChoiceDelta(0, 0, text, [7], None, finish if last else None, 11, i + 1, 0)
        events += builder.feed(delta)
    return builder, events


def _typed(events: list[dict]) -> list:
    """Every event but the pings, parsed by the client's types (pings it skips itself)."""
    assert events[1] == {"type": "ping"}
    return [EVENTS.validate_python(e) for e in events if e["type"] != "ping"]


def _accumulated(events: list[dict]) -> dict:
    """The message the events add up to, read as a client reads them."""
    message = dict(events[0]["message"], content=[])
    partial: dict[int, str] = {}
    for e in events[1:]:
        if e["type"] == "content_block_start":
            assert e["index"] == len(message["content"])
            message["content"].append(dict(e["content_block"]))
        elif e["type"] == "content_block_delta":
            block, delta = message["content"][e["index"]], e["delta"]
            if delta["type"] == "input_json_delta":
                partial[e["index"]] = partial.get(e["index"], "") + delta["partial_json"]
            else:
                key = delta["type"].removesuffix("_delta")
                block[key] += delta[key]
        elif e["type"] == "content_block_stop" and e["index"] in partial:
            message["content"][e["index"]]["input"] = json.loads(partial[e["index"]])
        elif e["type"] == "message_delta":
            message.update(e["delta"], usage=e["usage"])
    return message


@pytest.mark.parametrize("cut", [1, 3, 50])
def test_text_streams_as_one_text_block_and_adds_up_to_the_message(cut):
    text = "Hello there, world."
    pieces = [text[i : i + cut] for i in range(0, len(text), cut)]
    builder, events = _run(pieces, "stop")
    typed = _typed(events)
    assert [e.type for e in typed[:2]] == ["message_start", "content_block_start"]
    assert [e.type for e in typed[-3:]] == ["content_block_stop", "message_delta", "message_stop"]
    assert typed[0].message.stop_reason is None and typed[0].message.content == []
    assert typed[0].message.usage.input_tokens == 11
    message = Message.model_validate(builder.message())
    assert [b.type for b in message.content] == ["text"]
    assert message.content[0].text == text
    assert message.stop_reason == "end_turn" and message.stop_sequence is None
    assert message.usage.input_tokens == 11 and message.usage.output_tokens == len(pieces)
    assert _accumulated(events) == builder.message()


@pytest.mark.parametrize("cut", [1, 4, 200])
def test_reasoning_then_a_call_are_a_thinking_and_a_tool_use_block(cut):
    text = "plan it</think>\n" + CALL
    builder, events = _run(
        [text[i : i + cut] for i in range(0, len(text), cut)], "stop", tools=True, reasoning=True
    )
    typed = _typed(events)
    message = Message.model_validate(builder.message())
    assert [b.type for b in message.content] == ["thinking", "tool_use"]
    assert message.content[0].thinking == "plan it"
    call = message.content[1]
    assert call.name == "f" and call.input == {"x": 1} and call.id.startswith("toolu_")
    assert message.stop_reason == "tool_use"
    deltas = [e.delta for e in typed if e.type == "content_block_delta"]
    assert {d.type for d in deltas} == {"thinking_delta", "input_json_delta"}
    # The thinking block closes before the call opens: each index stops once, in order.
    stops = [e.index for e in typed if e.type == "content_block_stop"]
    assert stops == [0, 1]
    assert _accumulated(events) == builder.message()


def test_text_then_a_call_keeps_the_text_block_first():
    builder, _ = _run(["Let me check. ", "no call here"], "stop", tools=True)
    assert builder.message()["content"] == [{"type": "text", "text": "Let me check. no call here"}]
    assert builder.message()["stop_reason"] == "end_turn"


def test_max_tokens_is_the_stop_reason_of_a_cut_reply():
    builder, events = _run(["abc", "def"], "length")
    assert builder.message()["stop_reason"] == "max_tokens"
    assert events[-2]["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert events[-2]["usage"] == {"input_tokens": 11, "output_tokens": 2}


def test_an_empty_reply_has_no_blocks():
    builder, events = _run([""], "stop")
    assert builder.message()["content"] == []
    assert [e["type"] for e in events] == [
        "message_start",
        "ping",
        "message_delta",
        "message_stop",
    ]
    _typed(events)


@given(
    before=st.text(alphabet="ab \n", max_size=30),
    stop=st.sampled_from(["STOP", "S", "ab!", "\n\n"]),
    after=st.text(alphabet="xyz", max_size=10),
    cuts=st.lists(st.integers(1, 6), min_size=1, max_size=20),
)
def test_the_stop_sequence_is_named_and_cut_however_the_text_was_split(before, stop, after, cuts):
    """The request keeps the matched stop string (include_stop_str_in_output); the stop matcher
    sends all of it in the last delta, where the builder cuts and names it."""
    stops = ["STOP", "S", "ab!", "\n\n"]
    text = before + stop + after
    matcher = StopMatcher(stops, include_stop=True)
    pieces, pos, i = [], 0, 0
    while pos < len(text) and not matcher.stopped:
        step = cuts[i % len(cuts)]
        pieces.append(matcher.feed(text[pos : pos + step], final=pos + step >= len(text)))
        pos, i = pos + step, i + 1
    assert matcher.stopped
    expected = StopMatcher(stops)
    expected.feed(text, final=True)
    builder, _ = _run(pieces, "stop", stops=stops)
    message = builder.message()
    body = "".join(b["text"] for b in message["content"])
    assert body == expected.text
    assert message["stop_reason"] == "stop_sequence"
    assert body + message["stop_sequence"] == matcher.text


def test_a_reply_stopped_by_the_model_names_no_stop_sequence():
    builder, _ = _run(["the end"], "stop", stops=["STOP"])
    assert builder.message()["stop_reason"] == "end_turn"
    assert builder.message()["stop_sequence"] is None


@pytest.mark.parametrize(
    "exc, status, kind",
    [
        (
            BadRequestError("max_tokens: must be >= 1", param="max_tokens"),
            400,
            "invalid_request_error",
        ),
        (ModelNotFoundError("The model `x` does not exist"), 404, "not_found_error"),
        (ContextLengthError(256, 10, 1000), 400, "invalid_request_error"),
        (RequestTimeoutError("too slow"), 408, "timeout_error"),
        (TooManyRequestsError("too many", 2.5), 429, "rate_limit_error"),
        (RuntimeError("secret detail"), 500, "api_error"),
    ],
)
def test_errors_answer_in_anthropics_shape_with_their_status(exc, status, kind):
    response = anthropic_shaped(error_response(exc))
    assert response.status_code == status
    body = json.loads(bytes(response.body))
    assert body["type"] == "error" and body["error"]["type"] == kind
    assert set(body["error"]) == {"type", "message"}
    param = json.loads(bytes(error_response(exc).body))["error"]["param"]
    if param is not None:  # Anthropic's errors have no param: the message names it
        assert body["error"]["message"].startswith(param + ":")
    if status == 429:
        assert response.headers["retry-after"] == "3"
    if status == 500:  # an internal error's text stays inside
        assert "secret" not in body["error"]["message"]
    event = MessageBuilder("m", ReplySplit(None), 1).error(exc)  # mid-stream: the same shape
    assert event["type"] == "error" and event["error"]["type"] == kind
    assert (
        event["error"]["message"].split(" (incident")[0]
        == body["error"]["message"].split(" (incident")[0]
    )


def test_a_successful_response_is_not_reshaped():
    ok = JSONResponse({"error": "not an error"}, status_code=200)
    assert anthropic_shaped(ok) is ok


def test_events_are_sent_with_their_type_as_the_event_name():
    assert typed_sse({"type": "ping"}) == b'event: ping\ndata: {"type":"ping"}\n\n'
