"""The Responses output built from a choice's deltas, checked against the openai client's own
types: each streamed event is a valid event of its type, in order, numbered, and the response
holds the reasoning, the message and the calls."""

from __future__ import annotations

import json

import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from deploy.generation import ChoiceDelta
from deploy.reply import ReplySplit
from deploy.responses import ResponsesRequest
from deploy.responses_events import ResponseBuilder
from deploy.tools import SMOLLM2, DeclaredTools
from frontend.reasoning import PARSERS, ReasoningSplitter

EVENTS = TypeAdapter(ResponseStreamEvent)
CALL = '<tool_call>[{"name": "f", "arguments": {"x": 1}}]</tool_call>'


def _run(pieces: list[str], finish: str, tools: bool, reasoning: bool) -> ResponseBuilder:
    body = ResponsesRequest.model_validate({"model": "m", "input": "hi"})
    split = ReplySplit(
        DeclaredTools(SMOLLM2, frozenset({"f"})) if tools else None,
        ReasoningSplitter(PARSERS["deepseek_r1"], True) if reasoning else None,
    )
    builder = ResponseBuilder(body, "m", split, (lambda ids: 2) if reasoning else None)
    events = builder.start()
    for i, text in enumerate(pieces):
        last = i == len(pieces) - 1
        delta = ChoiceDelta(0, 0, text, [7], None, finish if last else None, 3, len(pieces), 0)
        events += builder.feed(delta)
    builder.events = events  # type: ignore[attr-defined]
    return builder


def _types(builder: ResponseBuilder) -> list[str]:
    return [e["type"] for e in builder.events]  # type: ignore[attr-defined]


@pytest.mark.parametrize("cut", [1, 3, 7])
def test_reasoning_then_a_call_in_order_as_the_clients_types(cut):
    text = "plan it</think>\n" + CALL
    pieces = [text[i : i + cut] for i in range(0, len(text), cut)]
    builder = _run(pieces, "stop", tools=True, reasoning=True)
    events = builder.events  # type: ignore[attr-defined]
    for event in events:
        EVENTS.validate_python(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    types = _types(builder)
    assert types[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert types[-8:] == [
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    response = Response.model_validate(events[-1]["response"])
    reasoning, call = response.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == "plan it"
    assert call.type == "function_call" and json.loads(call.arguments) == {"x": 1}
    assert response.usage.output_tokens_details.reasoning_tokens == 2
    assert response.status == "completed"


def test_text_cut_by_the_token_limit_is_an_incomplete_message():
    builder = _run(["Hello", " there"], "length", tools=False, reasoning=False)
    for event in builder.events:  # type: ignore[attr-defined]
        EVENTS.validate_python(event)
    response = Response.model_validate(builder.response())
    assert response.output_text == "Hello there"
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert _types(builder)[-1] == "response.incomplete"


def test_an_empty_reply_is_an_empty_message():
    builder = _run([""], "stop", tools=False, reasoning=False)
    response = Response.model_validate(builder.response())
    assert response.output_text == "" and response.output[0].type == "message"
