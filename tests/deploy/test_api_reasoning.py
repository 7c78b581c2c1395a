"""Reasoning output on a tiny model whose chat template opens a think block: `reasoning_content`
split from the answer in chat (streamed and not) and reasoning items in the Responses API; a
constraint (a choice, a tool) applies to the answer after the block, never to the reasoning."""

from __future__ import annotations

import json

import pytest
from openai import OpenAI

from tests.deploy.conftest import THINK

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "hi"}]
RENDERED = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n"
END = "</think>"
END_ID = 49153  # the second token added to SmolLM2's 49,152
# A bias that makes the random model close its think block after a few tokens, for some seeds.
SAMPLING = {"temperature": 1.0, "logit_bias": {str(END_ID): 8}}


@pytest.fixture(scope="module")
def client(think_url):
    return OpenAI(base_url=think_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def closing(client):
    """(seed, raw text) of a reply that reasons, closes its block and goes on, sampled from the
    raw prompt through /v1/completions."""
    for seed in range(16):
        raw = client.completions.create(
            model=THINK, prompt=RENDERED, max_tokens=16, seed=seed, **SAMPLING
        )
        text = raw.choices[0].text
        if END in text and not text.startswith(END) and text.split(END, 1)[1].strip():
            return seed, text, raw.usage.prompt_tokens
    pytest.fail("no seed closes the think block mid-reply")


def test_chat_splits_reasoning_from_content_whole_and_streamed(client, closing):
    seed, raw, prompt_tokens = closing
    reasoning, content = raw.split(END, 1)
    kwargs = dict(model=THINK, messages=MESSAGES, max_tokens=16, seed=seed, **SAMPLING)
    whole = client.chat.completions.create(**kwargs)
    message = whole.choices[0].message
    assert whole.usage.prompt_tokens == prompt_tokens  # the same prompt as the raw completion
    assert message.reasoning_content == reasoning
    assert message.content == content.lstrip()
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    streamed_reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    assert streamed_reasoning == reasoning
    assert "".join(d.content or "" for d in deltas) == message.content


def test_a_reply_that_never_closes_its_block_is_all_reasoning(client):
    whole = client.chat.completions.create(
        model=THINK, messages=MESSAGES, max_tokens=6, temperature=0
    )
    message = whole.choices[0].message
    assert message.reasoning_content and message.content == ""


def test_a_constraint_applies_after_the_reasoning(client, closing):
    seed, raw, _ = closing
    reasoning = raw.split(END, 1)[0]
    reply = client.chat.completions.create(
        model=THINK,
        messages=MESSAGES,
        max_tokens=40,
        seed=seed,
        extra_body={"guided_choice": ["yes", "no"]},
        **SAMPLING,
    )
    message = reply.choices[0].message
    assert message.reasoning_content == reasoning  # sampled freely, as without the constraint
    assert message.content in ("yes", "no")
    assert reply.choices[0].finish_reason == "stop"


TOOL = {
    "type": "function",
    "name": "lookup",
    "parameters": {
        "type": "object",
        "properties": {"q": {"type": "string", "maxLength": 8}},
        "required": ["q"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def no_whitespace(smollm2_dir):
    """A bias that keeps the random model from filling JSON with whitespace (the grammar allows
    it), so that a call completes within a few tokens."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    ids = [i for i in range(len(tokenizer)) if not tokenizer.decode([i]).strip()]
    return {str(i): -100 for i in ids}


@pytest.mark.parametrize("stream", [False, True])
def test_responses_give_a_reasoning_item_then_the_call(client, no_whitespace, stream):
    for seed in range(16):
        kwargs = dict(
            model=THINK,
            input="hi",
            tools=[TOOL],
            tool_choice="required",
            max_output_tokens=60,
            temperature=1.0,
            extra_body={"seed": seed, "logit_bias": {**no_whitespace, **SAMPLING["logit_bias"]}},
        )
        if stream:
            events = list(client.responses.create(stream=True, **kwargs))
            response = events[-1].response
        else:
            response = client.responses.create(**kwargs)
        if response.output[0].type == "reasoning" and response.output[0].content[0].text:
            break
    else:
        pytest.fail("no seed reasons before its call")
    reasoning, call = response.output
    assert reasoning.status == "completed" and response.status == "completed"
    assert call.type == "function_call" and set(json.loads(call.arguments)) == {"q"}
    assert 2 <= response.usage.output_tokens_details.reasoning_tokens < response.usage.output_tokens
    if stream:
        types = [e.type for e in events]
        assert types.index("response.reasoning_text.done") < types.index(
            "response.function_call_arguments.delta"
        )
        text = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
        assert text == reasoning.content[0].text
