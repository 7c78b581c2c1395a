"""Images through the served API: chat `image_url` parts, the Responses API's `input_image`,
Anthropic `image` blocks; decoded and bounded in the ingress (deploy/image_parts.py) before
anything reaches a replica, each refusal a 400 with OpenAI error JSON naming the image's field,
counted in /metrics by reason.

The ingress's side is proven here without Serve first (parsing, naming, bounds, metrics); then
served: images to the text model are a 400 (the shared `tiny` app), and a tiny LLaVA served with
its real processor (`vision_url`) gives transformers' greedy tokens for zero, one and three images
through the official openai client, and answers the hostile set with 400s while it keeps serving.
"""

from __future__ import annotations

import asyncio
import math
import re

import anthropic
import httpx
import pytest
from openai import BadRequestError as OpenAIBadRequest
from openai import OpenAI
from PIL import Image

from cluster.metrics import RequestMetrics
from deploy import metrics_page
from deploy.anthropic_schema import MessagesRequest
from deploy.config import AppConfig
from deploy.errors import BadRequestError
from deploy.image_parts import ServedVision, image_inputs, load_chat_images
from deploy.responses import ResponsesRequest
from deploy.schemas import ChatCompletionRequest
from frontend.images import ImageLimits
from tests.deploy.conftest import TINY, TINY_KEY
from tests.frontend.hostile_images import data_url, encoded, hostile_urls

PNG = data_url(encoded(Image.new("RGB", (8, 6), (200, 10, 10)), "PNG"))
# What each URL of tests/frontend/hostile_images.hostile_urls() is refused for.
HOSTILE_REASONS = [
    "pixels",
    "pixels",
    "pixels",
    "base64",
    "format",
    "corrupt",
    "metadata",
    "metadata",
    "bytes",
]


def chat(*contents: object, role: str = "user") -> ChatCompletionRequest:
    messages = [{"role": role, "content": c} for c in contents]
    return ChatCompletionRequest.model_validate({"model": "m", "messages": messages})


def text(value: str) -> dict:
    return {"type": "text", "text": value}


def image_part(url: str = PNG, **more: object) -> dict:
    return {"type": "image_url", "image_url": {"url": url, **more}}


def served(tokens_per_image: int = 4, **limits: int) -> ServedVision:
    return ServedVision(ImageLimits(**limits), (), lambda width, height: tokens_per_image)


def refused_with(vision: ServedVision | None, request: ChatCompletionRequest) -> BadRequestError:
    metrics = RequestMetrics("m")
    with pytest.raises(BadRequestError) as info:
        asyncio.run(load_chat_images("m", vision, metrics, request))
    assert info.value.status == 400 and info.value.message.startswith(f"{info.value.param}: ")
    return info.value


# ---- the ingress's side, without Serve ---------------------------------------------------------
def test_image_parts_are_found_in_order_and_named_by_their_field():
    request = chat("hi", [text("a"), image_part(), image_part(detail="low")])
    assert [p.field for p in image_inputs(request)] == [
        "messages[1].content[1].image_url.url",
        "messages[1].content[2].image_url.url",
    ]
    assert request.messages[1].text() == "a"


@pytest.mark.parametrize(
    "part",
    [
        {"type": "image_url"},
        {"type": "image_url", "image_url": {"url": PNG}, "text": "x"},
        {"type": "text"},
        {"type": "image_url", "image_url": {"url": PNG, "detail": "ultra"}},
        {"type": "image_url", "image_url": "data:image/png;base64,AA=="},
        {"type": "image", "image": PNG},
    ],
)
def test_malformed_image_parts_are_refused_by_the_schema(part):
    with pytest.raises(ValueError, match="messages"):
        chat([part])


def test_only_user_messages_may_hold_images():
    error = refused_with(served(), chat([image_part()], role="assistant"))
    assert error.param == "messages[0].content[0]" and "only user messages" in error.message


def test_a_text_model_refuses_images_naming_the_first():
    error = refused_with(None, chat("hi", [text("look"), image_part()]))
    assert error.param == "messages[1].content[1].image_url.url"
    assert "takes no images" in error.message and error.code == "image_not_supported"


def test_a_vision_model_decodes_the_images_and_counts_their_tokens():
    metrics = RequestMetrics("m")
    request = chat([image_part(), text("and"), image_part()])
    images, extra = asyncio.run(load_chat_images("m", served(4), metrics, request))
    assert [im.size for im in images] == [(8, 6), (8, 6)] and images[0].mode == "RGB"
    assert extra == 2 * (4 - 1)  # each placeholder becomes the image's 4 tokens
    assert metrics.images_received == 2 and metrics.images_refused_by == {}


def test_the_hostile_set_is_a_400_naming_the_field_counted_by_reason():
    metrics = RequestMetrics("m")
    for url, reason in zip(hostile_urls(), HOSTILE_REASONS, strict=True):
        request = chat([text("hi"), image_part(PNG), image_part(url)])
        before = metrics.images_refused_by.get(reason, 0)
        with pytest.raises(BadRequestError) as info:
            asyncio.run(load_chat_images("m", served(), metrics, request))
        assert info.value.param == "messages[0].content[2].image_url.url", info.value.message
        assert info.value.code == "invalid_image"
        assert metrics.images_refused_by[reason] == before + 1, info.value.message
    assert metrics.images_received == 18 and sum(metrics.images_refused_by.values()) == 9
    page = metrics_page.render([metrics], {}, 0)
    assert 'raylm_images_total{model="m"} 18' in page
    assert 'raylm_images_refused_total{model="m",reason="pixels"} 3' in page


def test_images_per_request_and_image_tokens_are_bounded_per_request():
    three = chat([image_part()], [image_part(), image_part()])
    error = refused_with(served(max_images_per_request=2), three)
    assert (
        error.param == "messages[1].content[1].image_url.url"
        and "at most 2 images" in error.message
    )
    error = refused_with(served(10, max_image_tokens_per_request=25), three)
    assert (
        error.param == "messages[1].content[1].image_url.url" and "30 image tokens" in error.message
    )


def test_http_urls_are_refused_unless_allowed():
    error = refused_with(served(), chat([image_part("http://127.0.0.1:9/cat.png")]))
    assert "allowed_media_domains" in error.message


def test_responses_input_image_becomes_a_chat_image_part():
    body = {
        "model": "m",
        "input": [
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "what is it?"},
                    {"type": "input_image", "image_url": PNG, "detail": "high"},
                ],
            }
        ],
    }
    request = ResponsesRequest.model_validate(body).as_chat(16)
    assert [p.field for p in image_inputs(request)] == ["messages[0].content[1].image_url.url"]
    assert request.messages[0].content[1].image_url.url == PNG  # type: ignore[index,union-attr]
    file_part = {"type": "input_image", "file_id": "file-1"}
    with pytest.raises(ValueError, match="input"):
        ResponsesRequest.model_validate(
            {**body, "input": [{"role": "user", "content": [file_part]}]}
        )


def test_anthropic_image_blocks_become_chat_image_parts_named_by_their_block():
    source = {"type": "base64", "media_type": "image/png", "data": PNG.split(",", 1)[1]}
    body = {
        "model": "m",
        "max_tokens": 4,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "content": "42"},
                    {"type": "text", "text": "and this?"},
                    {"type": "image", "source": source},
                ],
            }
        ],
    }
    request, names = MessagesRequest.model_validate(body).as_chat(16)
    assert [m.role for m in request.messages] == ["tool", "user"]
    error = refused_with(None, request)
    assert names.renamed(error).param == "messages.0.content.2.source"  # type: ignore[attr-defined]
    images = asyncio.run(load_chat_images("m", served(), RequestMetrics("m"), request))[0]
    assert images[0].getpixel((0, 0)) == (200, 10, 10)
    for bad, path in [
        ({"type": "image", "source": {"type": "base64", "data": "AA=="}}, "source"),
        ({"type": "image", "source": {"type": "file", "file_id": "f"}}, "source.type"),
    ]:
        with pytest.raises(ValueError, match=rf"messages\.0\.content\.0\.{path}"):
            MessagesRequest.model_validate(
                {**body, "messages": [{"role": "user", "content": [bad]}]}
            )


IMAGE_SETTINGS = [
    "max_image_bytes",
    "max_image_pixels",
    "max_images_per_request",
    "max_image_tokens_per_request",
    "media_fetch_timeout_s",
]


@pytest.mark.parametrize("name", IMAGE_SETTINGS)
@pytest.mark.parametrize("value", [2**64, -1, math.nan, 10**30, "x" * 100_000])
def test_image_settings_are_bounded_at_the_edge(name, value):
    with pytest.raises(ValueError, match=f"images.{name}: "):
        AppConfig.from_args({name: value})


@pytest.mark.parametrize(
    "value",
    [
        ["a.example:8080"],
        ["http://a.example"],
        "a.example",
        [2**64],
        [math.nan],
        ["a"] * 65,
        ["a" * 300],
    ],
)
def test_allowed_media_domains_is_bounded_at_the_edge(value):
    with pytest.raises(ValueError, match="allowed_media_domains: "):
        AppConfig.from_args({"allowed_media_domains": value})


def test_image_settings_nest_into_their_section():
    config = AppConfig.from_args(
        {"max_images_per_request": 3, "allowed_media_domains": ["Images.Example."]}
    )
    assert config.images.max_images_per_request == 3
    assert config.allowed_media_domains == ["images.example"]


# ---- served: the text model takes no images ----------------------------------------------------
@pytest.fixture(scope="module")
def tiny_openai(tiny_url):
    return OpenAI(base_url=tiny_url, api_key=TINY_KEY, max_retries=0, timeout=120)


@pytest.mark.slow
def test_images_to_the_text_model_are_a_400_on_every_api(tiny_url, tiny_openai):
    content = [{"type": "text", "text": "What is it?"}, image_part()]
    with pytest.raises(OpenAIBadRequest) as info:
        tiny_openai.chat.completions.create(
            model=TINY, messages=[{"role": "user", "content": content}], max_tokens=2
        )
    error = info.value.body
    assert error["param"] == "messages[0].content[1].image_url.url"  # type: ignore[index]
    assert "takes no images" in error["message"]  # type: ignore[index]
    with pytest.raises(OpenAIBadRequest) as info:
        tiny_openai.responses.create(
            model=TINY,
            input=[
                {
                    "role": "user",
                    "content": [{"type": "input_image", "image_url": PNG, "detail": "auto"}],
                }
            ],
        )
    assert info.value.body["param"] == "input[0].content[0].image_url.url"  # type: ignore[index]
    client = anthropic.Anthropic(
        base_url=tiny_url.removesuffix("/v1"), api_key=TINY_KEY, max_retries=0, timeout=120
    )
    source = {"type": "base64", "media_type": "image/png", "data": PNG.split(",", 1)[1]}
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(
            model=TINY,
            max_tokens=2,
            messages=[{"role": "user", "content": [{"type": "image", "source": source}]}],
        )
    assert info.value.body["error"]["message"].startswith("messages.0.content.0.source: ")


@pytest.mark.slow
def test_the_hostile_set_to_the_text_model_is_a_400_never_a_5xx(tiny_url):
    auth = {"authorization": f"Bearer {TINY_KEY}"}
    with httpx.Client(base_url=tiny_url, headers=auth, timeout=120) as client:
        for url in hostile_urls():
            body = {
                "model": TINY,
                "max_tokens": 1,
                "messages": [{"role": "user", "content": [image_part(url)]}],
            }
            r = client.post("/chat/completions", json=body)
            assert r.status_code in (400, 413), r.text[:300]
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        page = client.get(tiny_url.removesuffix("/v1") + "/metrics").text
    refused = re.search(
        r'^raylm_images_refused_total\{model="tiny-llama",reason="model"\} (\d+)', page, re.M
    )
    assert refused is not None and int(refused[1]) >= 8, page[-2000:]
