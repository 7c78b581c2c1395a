"""Images through the served API: chat `image_url` parts, the Responses API's `input_image`,
Anthropic `image` blocks; decoded and bounded in the ingress (deploy/image_parts.py) before
anything reaches a replica, each refusal a 400 with OpenAI error JSON naming the image's field,
counted in /metrics by reason.

The ingress's side is proven here without Serve first (parsing, naming, bounds, metrics); then
served: images to the text model are a 400 (the shared `tiny` app), and a tiny LLaVA, Qwen2.5-VL
and Gemma 3 served with their real processors (`vision_url`, one app) give transformers' greedy
tokens for zero, one and three images through the official openai client; LLaVA answers the
hostile set with 400s while it keeps serving.
"""

from __future__ import annotations

import asyncio
import json
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
from tests.deploy.conftest import TINY, TINY_KEY, wait_for
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


def test_the_replicas_encoder_figures_reach_the_metrics_page():
    from router.stats import RoutingStats
    from scheduler.outputs import SchedulerStats

    stats = SchedulerStats(
        0, 0, 0, 0.0, 0.0, 0, num_images_encoded=3, num_encoder_cache_hits=2, encoder_time_us=1500
    )
    page = metrics_page.render([RequestMetrics("m")], {"r1": RoutingStats(stats)}, 0)
    assert 'raylm_images_encoded_total{replica="r1"} 3.0' in page
    assert 'raylm_encoder_cache_hits_total{replica="r1"} 2.0' in page
    assert 'raylm_encoder_seconds_total{replica="r1"} 0.0015' in page


@pytest.mark.slow
def test_the_served_vision_side_is_the_models_own(tiny_model_dir, vision_model_dir):
    """A text model has none; LLaVA's counts each image size's tokens with its own processor."""
    from tests.workers.vision_checkpoints import LLAVA_IMAGE_SIZE, LLAVA_PATCH

    limits = ImageLimits()
    assert ServedVision.load(tiny_model_dir, limits, None) is None
    vision = ServedVision.load(vision_model_dir, limits, ["images.example"])
    assert vision is not None and vision.allowed_domains == ("images.example",)
    assert vision.tokens is not None
    per_image = (LLAVA_IMAGE_SIZE // LLAVA_PATCH) ** 2
    assert vision.tokens(40, 32) == vision.tokens(1000, 20) == per_image


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


def test_tokenize_repeats_each_placeholder_for_its_images_tokens():
    """/tokenize shows the ids the engine runs: the i-th placeholder (9) repeated for the i-th
    image's tokens, counted from its size; a rendered chat whose placeholders and images differ
    in number is a 400; a model whose counts are unknown keeps its ids."""
    from deploy.tokenize import with_image_tokens

    vision = ServedVision(ImageLimits(), (), lambda width, height: width // 10, placeholder=9)
    images = [Image.new("RGB", (30, 5)), Image.new("RGB", (20, 5))]
    assert with_image_tokens([1, 9, 2, 9, 3], vision, images) == [1, 9, 9, 9, 2, 9, 9, 3]
    with pytest.raises(BadRequestError, match="2 images for 1 image placeholders") as info:
        with_image_tokens([1, 9, 2], vision, images)
    assert info.value.status == 400 and info.value.param == "messages"
    unknown = ServedVision(ImageLimits(), (), None)
    assert with_image_tokens([1, 9, 2, 9], unknown, images) == [1, 9, 2, 9]


def test_a_multi_megabyte_image_body_parses_whole_and_bad_json_is_a_400():
    """deploy/body.py parses with pydantic-core's parser (a 5.6 MB base64 image costs the event
    loop well under a millisecond instead of tens): the image's URL arrives whole; invalid JSON,
    a lone surrogate escape and deep nesting are 400s."""
    from deploy.body import parse_body

    url = "data:image/png;base64," + "A" * (5 << 20)
    raw = json.dumps({"model": "m", "messages": [user([image_part(url), text("hi")])]})
    request = asyncio.run(parse_body(raw.encode(), ChatCompletionRequest, 16))
    assert [p.url for p in image_inputs(request)] == [url]
    lone_surrogate = b'{"model": "m", "messages": [{"role": "user", "content": "\\ud800"}]}'
    for bad in [lone_surrogate, b"[" * 10_000, b"{"]:
        with pytest.raises(BadRequestError, match="not valid JSON") as info:
            asyncio.run(parse_body(bad, ChatCompletionRequest, 16))
        assert info.value.status == 400


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


# ---- served: a tiny LLaVA with its real processor -----------------------------------------------
QUESTION = "What is in this picture?"


@pytest.fixture(scope="module")
def llava(vision_model_dir):
    """transformers' LLaVA and processor of the served checkpoint: the reference."""
    import torch
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    hf = LlavaForConditionalGeneration.from_pretrained(vision_model_dir, dtype=torch.float32)
    return hf.eval(), AutoProcessor.from_pretrained(vision_model_dir)


def hf_greedy_text(
    llava, images: list[Image.Image], max_tokens: int, lead: list[dict] | None = None
) -> str:
    """transformers' greedy reply to one user turn of `lead` parts, `images` then QUESTION."""
    import torch

    hf, processor = llava
    parts = [*(lead or []), *({"type": "image"} for _ in images), text(QUESTION)]
    prompt = processor.apply_chat_template(
        [{"role": "user", "content": parts}], add_generation_prompt=True
    )
    inputs = processor(
        text=prompt, images=images or None, return_tensors="pt", add_special_tokens=False
    )
    with torch.no_grad():
        out = hf.generate(**inputs, max_new_tokens=max_tokens, do_sample=False)
    new = out[0, inputs["input_ids"].shape[1] :]
    return processor.tokenizer.decode(new, skip_special_tokens=True)


def png_url(image: Image.Image) -> str:
    return data_url(encoded(image, "PNG"))


@pytest.fixture(scope="module")
def vision_openai(vision_url):
    return OpenAI(base_url=vision_url, api_key="unused", max_retries=0, timeout=300)


@pytest.mark.slow
def test_llava_served_gives_transformers_greedy_tokens_for_0_1_and_3_images(vision_openai, llava):
    """Three image counts and a text-only request at once (one batch on the replica), each
    image sent as a PNG data URL through the official client."""
    from concurrent.futures import ThreadPoolExecutor

    from tests.deploy.conftest import VISION
    from tests.workers.vision_checkpoints import random_image

    cases = [[], [random_image(1)], [random_image(2), random_image(3, (20, 50)), random_image(4)]]

    def ask(images: list[Image.Image]) -> str:
        content = [image_part(png_url(im)) for im in images] + [text(QUESTION)]
        reply = vision_openai.chat.completions.create(
            model=VISION,
            messages=[{"role": "user", "content": content}],
            max_tokens=8,
            temperature=0,
        )
        return reply.choices[0].message.content or ""

    with ThreadPoolExecutor(len(cases)) as pool:
        served = list(pool.map(ask, cases))
    expected = [hf_greedy_text(llava, images, 8) for images in cases]
    assert served == expected
    assert len({*expected}) == len(expected)  # the images change the reply: they reached the model


@pytest.mark.slow
def test_llava_served_reads_a_repeated_image_from_the_encoder_cache(
    vision_url, vision_openai, llava
):
    """The same image in a prompt whose first block differs (no prefix-cache hit covers the
    image): the tower's output comes from the encoder cache, counted on /metrics, and the reply
    is transformers' own."""
    from tests.deploy.conftest import VISION
    from tests.workers.vision_checkpoints import random_image

    image = random_image(7)

    def ask(lead: list[dict]) -> str:
        content = [*lead, image_part(png_url(image)), text(QUESTION)]
        reply = vision_openai.chat.completions.create(
            model=VISION, messages=[user(content)], max_tokens=6, temperature=0
        )
        return reply.choices[0].message.content or ""

    def hits() -> float:
        page = httpx.get(vision_url.removesuffix("/v1") + "/metrics", timeout=60).text
        found = re.findall(r'^raylm_encoder_cache_hits_total\{replica="[^"]*"\} (\S+)', page, re.M)
        return sum(float(v) for v in found)

    assert ask([]) == hf_greedy_text(llava, [image], 6)
    before = hits()
    lead = [text("Look again, closely:")]
    assert ask(lead) == hf_greedy_text(llava, [image], 6, lead)

    # The router learns each replica's figures as it routes (every second): a request per look.
    def counted() -> bool:
        ask([])
        return hits() > before

    assert wait_for(counted, timeout=60, interval=0.5)


@pytest.mark.slow
def test_llava_served_answers_the_hostile_set_with_400s_and_keeps_serving(
    vision_url, vision_openai
):
    from tests.deploy.conftest import VISION, VISION_MAX_IMAGE_BYTES, VISION_MAX_IMAGES
    from tests.deploy.test_hostile_bodies import _ingress, _replica_process

    llava_replica = _replica_process("vision", f"LLMReplica-{VISION}")
    processes = {"ingress": _ingress("vision").pid, "replica": llava_replica.pid}
    peaks = {name: _peak_rss_kb(pid) for name, pid in processes.items()}
    hostile = hostile_urls(VISION_MAX_IMAGE_BYTES)
    with httpx.Client(base_url=vision_url, timeout=120) as client:
        for url, reason in zip(hostile, HOSTILE_REASONS, strict=True):
            body = {"model": VISION, "max_tokens": 1, "messages": [chat_turn(url)]}
            r = client.post("/chat/completions", json=body)
            assert r.status_code == 400, (reason, r.status_code, r.text[:300])
            error = r.json()["error"]
            assert error["param"] == "messages[0].content[1].image_url.url", error
            assert error["type"] == "invalid_request_error" and error["code"] == "invalid_image"
        too_many = [image_part(PNG)] * (VISION_MAX_IMAGES + 1)
        r = client.post(
            "/chat/completions",
            json={"model": VISION, "messages": [{"role": "user", "content": too_many}]},
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == (
            f"messages[0].content[{VISION_MAX_IMAGES}].image_url.url"
        )
        page = client.get(vision_url.removesuffix("/v1") + "/metrics").text
    # Neither the ingress that decodes nor the replica the images never reach grows by 100 MB.
    grown = {name: _peak_rss_kb(pid) - peaks[name] for name, pid in processes.items()}
    assert max(grown.values()) < 100 * 1024, f"peak RSS growth in KiB: {grown}"
    for reason in set(HOSTILE_REASONS):
        count = HOSTILE_REASONS.count(reason)
        line = f'raylm_images_refused_total{{model="{VISION}",reason="{reason}"}} {count}'
        assert line in page, page[-1500:]
    reply = vision_openai.chat.completions.create(
        model=VISION, messages=[chat_turn(PNG)], max_tokens=2, temperature=0
    )
    assert reply.choices[0].finish_reason == "length"
    # A client's own `<image>` text is text, never a placeholder without its image.
    typed = [text("<image> <image> what are these?"), image_part(PNG)]
    reply = vision_openai.chat.completions.create(
        model=VISION, messages=[user(typed)], max_tokens=2, temperature=0
    )
    assert reply.choices[0].finish_reason == "length"


@pytest.mark.slow
def test_qwen2_vl_served_gives_transformers_greedy_tokens_for_0_1_and_3_images(
    vision_openai, qwen_vl_model_dir
):
    """The app's second model: dynamic-resolution images (4 and 12 tokens, M-RoPE positions)
    sent as PNG data URLs at once, beside a text-only request; each reply is transformers'
    greedy continuation of the same chat."""
    from concurrent.futures import ThreadPoolExecutor

    import torch
    from transformers import AutoImageProcessor, AutoTokenizer
    from transformers import Qwen2_5_VLForConditionalGeneration as HFQwen

    from tests.deploy.conftest import VISION_QWEN
    from tests.engine.test_qwen2_vl_engine import MAX_TOKENS, hf_greedy, image

    path = qwen_vl_model_dir
    cases = [
        [],
        [image(1, (56, 56))],
        [image(2, (56, 56)), image(3, (112, 84)), image(2, (56, 56))],
    ]
    words = [text("w7 w42 w99")]

    def ask(images: list[Image.Image]) -> str:
        content = [*(image_part(png_url(im)) for im in images), *words]
        reply = vision_openai.chat.completions.create(
            model=VISION_QWEN,
            messages=[user(content)],
            max_tokens=MAX_TOKENS,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        return reply.choices[0].message.content or ""

    with ThreadPoolExecutor(len(cases)) as pool:
        served = list(pool.map(ask, cases))
    tokenizer = AutoTokenizer.from_pretrained(path)
    hf = HFQwen.from_pretrained(path, dtype=torch.float32).eval()
    processor = AutoImageProcessor.from_pretrained(path)
    expected = []
    for images in cases:
        parts = [*({"type": "image"} for _ in images), *words]
        rendered = tokenizer.apply_chat_template(
            [user(parts)], add_generation_prompt=True, tokenize=False
        )
        ids = tokenizer.encode(rendered, add_special_tokens=False)
        tokens = hf_greedy(hf, processor, ids, images).token_ids
        expected.append(tokenizer.decode(tokens, skip_special_tokens=True))
    # The word tokenizer's stream puts a space before the first word; the whole decode does not.
    assert [reply.lstrip() for reply in served] == expected
    assert len({*expected}) == len(expected)  # the images reached the model


@pytest.mark.slow
def test_gemma3_served_gives_transformers_greedy_tokens_for_0_1_and_3_images(
    vision_openai, gemma3_model_dir
):
    """The app's third model: Gemma 3's chat template writes `<start_of_image>` per image part,
    the ingress rewrites it as Gemma3Processor does (one soft token, the engine repeats it), and
    the soft tokens of one image attend to each other both ways. Three image counts and a
    text-only request sent at once (one batch on the replica); each reply is transformers'
    greedy continuation of the processor's own prompt."""
    from concurrent.futures import ThreadPoolExecutor

    import torch
    from transformers import AutoProcessor, Gemma3ForConditionalGeneration

    from tests.deploy.conftest import VISION_GEMMA
    from tests.engine.test_gemma3_engine import GREEDY, Gemma3
    from tests.workers.vision_checkpoints import random_image

    cases = [
        [],
        [random_image(1)],
        [random_image(2), random_image(3, (64, 48)), random_image(4)],
        [],
    ]
    questions = [QUESTION, QUESTION, QUESTION, "Tell me a story about a small cat."]

    def ask(case: int) -> str:
        content = [*(image_part(png_url(im)) for im in cases[case]), text(questions[case])]
        reply = vision_openai.chat.completions.create(
            model=VISION_GEMMA,
            messages=[user(content)],
            max_tokens=GREEDY.max_tokens,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        return reply.choices[0].message.content or ""

    with ThreadPoolExecutor(len(cases)) as pool:
        served = list(pool.map(ask, range(len(cases))))
    path = gemma3_model_dir
    hf = Gemma3ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    gemma3 = Gemma3(path, hf, AutoProcessor.from_pretrained(path))
    expected = []
    for images, question in zip(cases, questions, strict=True):
        parts = [*({"type": "image"} for _ in images), text(question)]
        prompt = gemma3.processor.apply_chat_template([user(parts)], add_generation_prompt=True)
        tokens = gemma3.greedy(prompt, images)
        expected.append(gemma3.processor.tokenizer.decode(tokens, skip_special_tokens=True))
    assert served == expected
    assert len({*expected}) == len(expected)  # the images reached the model


@pytest.mark.slow
def test_llava_served_tokenize_and_count_tokens_count_each_images_tokens(vision_url, llava):
    """/tokenize with image parts gives LlavaProcessor's ids (each `<image>` repeated for the
    image); the Messages API's count_tokens and a reply's usage count the same tokens."""
    from tests.deploy.conftest import VISION
    from tests.workers.vision_checkpoints import random_image

    _, processor = llava
    images = [random_image(31), random_image(32, (20, 50))]
    parts = [*({"type": "image"} for _ in images), text(QUESTION)]
    prompt = processor.apply_chat_template([user(parts)], add_generation_prompt=True)
    expected = processor(text=prompt, images=images, add_special_tokens=False)["input_ids"][0]
    content = [*(image_part(png_url(im)) for im in images), text(QUESTION)]
    root = vision_url.removesuffix("/v1")
    body = {"model": VISION, "messages": [user(content)], "add_generation_prompt": True}
    r = httpx.post(f"{root}/tokenize", json=body, timeout=120)
    assert r.status_code == 200, r.text[:300]
    assert r.json()["tokens"] == list(expected) and r.json()["count"] == len(expected) > 8
    blocks = [
        *(
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64}}
            for b64 in (png_url(im).split(",", 1)[1] for im in images)
        ),
        {"type": "text", "text": QUESTION},
    ]
    claude = anthropic.Anthropic(base_url=root, api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": blocks}]
    counted = claude.messages.count_tokens(model=VISION, messages=messages)  # type: ignore[arg-type]
    assert counted.input_tokens == len(expected)
    reply = claude.messages.create(model=VISION, messages=messages, max_tokens=1)  # type: ignore[arg-type]
    assert reply.usage.input_tokens == len(expected)


def chat_turn(url: str) -> dict:
    return user([text(QUESTION), image_part(url)])


def user(content: list[dict]) -> dict:
    return {"role": "user", "content": content}


def _peak_rss_kb(pid: int) -> int:
    """VmHWM: the process's peak resident set, from /proc."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    raise AssertionError("no VmHWM in /proc status")
