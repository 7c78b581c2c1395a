"""The OpenAI API, driven by the official openai client against real Ray Serve on loopback."""

import asyncio

import pytest
from openai import AsyncOpenAI, OpenAI

from tests.deploy.conftest import SMOL, TINY, TINY_KEY

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def client(smol_url):
    return OpenAI(base_url=smol_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tiny(tiny_url):
    return OpenAI(base_url=tiny_url, api_key=TINY_KEY, max_retries=0, timeout=120)


def test_models_lists_the_served_model_with_its_context(client):
    models = client.models.list().data
    assert [m.id for m in models] == [SMOL]
    assert models[0].model_extra["max_model_len"] == 2048


def test_greedy_completion_is_sensible_and_counts_its_tokens(client):
    r = client.completions.create(
        model=SMOL, prompt="The capital of France is", max_tokens=8, temperature=0, logprobs=0
    )
    choice = r.choices[0]
    assert "Paris" in choice.text
    assert r.usage.completion_tokens == len(choice.logprobs.tokens) <= 8
    assert r.usage.prompt_tokens == 5
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert "".join(choice.logprobs.tokens) == choice.text


def test_max_tokens_caps_the_completion_with_finish_reason_length(client):
    r = client.completions.create(
        model=SMOL,
        prompt="Count: one, two, three,",
        max_tokens=5,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 5


def test_streamed_completion_equals_the_non_streamed_one(client):
    kwargs = dict(model=SMOL, prompt="Once upon a time", max_tokens=12, temperature=0)
    full = client.completions.create(**kwargs).choices[0].text
    chunks = list(
        client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full
    assert chunks[-2].choices[0].finish_reason in ("length", "stop")
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens <= 12
    assert sum(1 for c in chunks if c.choices and c.choices[0].text) > 1  # really streamed


def test_continuous_usage_stats_put_the_running_usage_in_every_chunk(client):
    """vLLM's stream_options.continuous_usage_stats (GuideLLM sends it): each chunk's usage
    counts the tokens streamed so far, and the last chunk's equals the final usage."""
    stream = client.completions.create(
        model=SMOL,
        prompt="Count: one, two, three,",
        max_tokens=9,
        temperature=0,
        logprobs=0,
        stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    final = chunks[-1]
    assert final.choices == [] and final.usage.completion_tokens == 9
    streamed = 0
    for c in chunks[:-1]:
        streamed += len(c.choices[0].logprobs.tokens) if c.choices[0].logprobs else 0
        assert c.usage.completion_tokens == streamed, (c.usage, streamed)
        assert c.usage.prompt_tokens == final.usage.prompt_tokens > 0
        assert c.usage.total_tokens == c.usage.prompt_tokens + streamed
    assert streamed == 9 and len(chunks) > 2


def test_chat_completion_uses_the_chat_template(client):
    r = client.chat.completions.create(
        model=SMOL,
        messages=[{"role": "user", "content": "What is 2+2?"}],
        max_completion_tokens=16,
        temperature=0,
    )
    msg = r.choices[0].message
    assert msg.role == "assistant" and msg.content
    assert "<|im_start|>" not in msg.content
    assert r.usage.prompt_tokens > 20  # the system prompt of SmolLM2's template is in there


def test_streamed_chat_with_usage_matches_the_tokens_streamed(client):
    stream = client.chat.completions.create(
        model=SMOL,
        messages=[{"role": "user", "content": "Tell me a story."}],
        max_tokens=10,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    tokens = [
        t
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.content
    ]
    assert chunks[-1].usage.completion_tokens == len(tokens) == 10
    assert all(len(t.top_logprobs) == 2 for t in tokens)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "".join(t.token for t in tokens)


def test_stop_string_cuts_the_text_and_reports_stop(client):
    kwargs = dict(model=SMOL, prompt="1, 2, 3, 4, 5,", max_tokens=30, temperature=0)
    free = client.completions.create(**kwargs).choices[0].text
    assert " 7" in free
    r = client.completions.create(**kwargs, stop=[" 7"])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == free[: free.index(" 7")]
    streamed = list(client.completions.create(**kwargs, stop=" 7", stream=True))
    assert "".join(c.choices[0].text for c in streamed) == r.choices[0].text
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_n_choices_and_seed(client):
    kwargs = dict(
        model=SMOL,
        prompt="My favourite colour is",
        max_tokens=8,
        temperature=1.0,
        n=3,
        seed=1234,
        logprobs=0,
    )
    a = client.completions.create(**kwargs)
    b = client.completions.create(**kwargs)
    assert sorted(c.index for c in a.choices) == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # same seed, same samples
    assert len({c.text for c in a.choices}) > 1  # each choice its own sample
    single = client.completions.create(**{**kwargs, "n": 1})
    assert (
        a.usage.prompt_tokens == single.usage.prompt_tokens
    )  # the prompt counted once for n choices
    assert a.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in a.choices)


def test_sixteen_concurrent_streams(smol_url):
    async def one(client, i):
        text, usage = "", None
        stream = await client.chat.completions.create(
            model=SMOL,
            messages=[{"role": "user", "content": f"Give me fact number {i}."}],
            max_tokens=12,
            temperature=0.7,
            seed=i,
            stream=True,
            stream_options={"include_usage": True},
        )
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
            if chunk.usage:
                usage = chunk.usage
        return text, usage

    async def go():
        client = AsyncOpenAI(base_url=smol_url, api_key="unused", max_retries=0, timeout=300)
        return await asyncio.gather(*(one(client, i) for i in range(16)))

    results = asyncio.run(go())
    assert len(results) == 16
    assert all(text and 1 <= usage.completion_tokens <= 12 for text, usage in results)


def test_tiny_random_model_serves_completions_and_chat(tiny):
    assert [m.id for m in tiny.models.list().data] == [TINY]
    r = tiny.completions.create(
        model=TINY,
        prompt="hello world",
        max_tokens=7,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert r.usage.completion_tokens == 7 and r.choices[0].finish_reason == "length"
    chat = list(
        tiny.chat.completions.create(
            model=TINY,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert chat[-1].usage.completion_tokens == 6
    # No chat template in the tokenizer: the ChatML fallback renders the conversation.
    assert chat[-1].usage.prompt_tokens >= 6
