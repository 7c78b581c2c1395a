"""A chat request's images, served: found in its validated messages, refused for a model that
takes none, decoded and bounded on a thread (frontend/images.py) before anything reaches a
replica, and counted in /metrics. The decoded images travel on the EngineRequest
(`EngineRequest.images`), one placeholder token each in the prompt, into the engine's
add-request path (engine/multimodal.py).
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from PIL import Image

from cluster.metrics import RequestMetrics
from deploy.errors import BadRequestError
from deploy.schemas import ChatCompletionRequest, ChatMessage
from frontend.images import ImageInput, ImageLimits, ImageRefusal, ImageTokens, load_images
from scheduler.multimodal import ImageLike

# Room a vision model's request bodies get for their images (base64 text) beyond the text's:
# OpenAI's 50 MB payload bound, rounded up (max_request_body_bytes, when set, is the bound).
IMAGE_BODY_BYTES = 64 << 20
# Distinct image sizes whose token counts are remembered (each costs one processor run).
TOKEN_COUNTS_CACHED = 1024


@dataclass(frozen=True, slots=True)
class ServedVision:
    """What the ingress knows of a vision model's images: the bounds, the hosts it may fetch
    from, and the model's tokens per image size (None: unknown, the other bounds apply)."""

    limits: ImageLimits
    allowed_domains: tuple[str, ...]
    tokens: ImageTokens | None
    placeholder: int | None = None  # the prompt's token per image (None: unknown)

    @classmethod
    def load(
        cls, model_dir: str, limits: ImageLimits, allowed_domains: list[str] | None
    ) -> ServedVision | None:
        """The model's vision side (None for a model that takes no images): its image processor
        counts the tokens of each image size, as the replica's engine will."""
        from engine.multimodal import ImagePreprocessor  # transformers' image processors

        preprocessor = ImagePreprocessor.load(model_dir)
        if preprocessor is None:
            return None
        counter = functools.partial(_tokens_of_size, preprocessor, threading.Lock())
        tokens = functools.lru_cache(TOKEN_COUNTS_CACHED)(counter)
        return cls(limits, tuple(allowed_domains or ()), tokens, preprocessor.placeholder)


def _tokens_of_size(preprocessor: Any, lock: threading.Lock, width: int, height: int) -> int:
    """Tokens an image of this size takes: a blank one through the model's own processor (one
    at a time: requests decode on several threads, and the processor keeps a cache)."""
    blank = Image.new("RGB", (width, height))
    with lock:
        return int(preprocessor.process(blank).num_tokens)


def image_inputs(chat: ChatCompletionRequest) -> list[ImageInput]:
    """The image parts of a chat, in order, each with the field an error names; images only in
    user messages, as OpenAI takes them."""
    return message_images(chat.messages)


def message_images(messages: Sequence[ChatMessage]) -> list[ImageInput]:
    """image_inputs of messages (a chat's, or /tokenize's)."""
    found: list[ImageInput] = []
    for i, message in enumerate(messages):
        content = message.content
        if not isinstance(content, list) or not message.num_images:
            continue
        for j, part in enumerate(content):
            if part.image_url is None:  # a text part
                continue
            field = f"messages[{i}].content[{j}]"
            if message.role != "user":
                raise BadRequestError(
                    f"{field}: only user messages may hold images, not {message.role}",
                    param=field,
                )
            found.append(ImageInput(part.image_url.url, f"{field}.image_url.url"))
    return found


async def load_chat_images(
    name: str, vision: ServedVision | None, metrics: RequestMetrics, chat: ChatCompletionRequest
) -> tuple[tuple[Image.Image, ...], int]:
    """The chat's images decoded off the event loop, and the tokens they add to the prompt
    beyond their one placeholder each; a 400 naming the image's field when one is refused."""
    return await load_message_images(name, vision, metrics, chat.messages)


async def load_message_images(
    name: str, vision: ServedVision | None, metrics: RequestMetrics, messages: Sequence[ChatMessage]
) -> tuple[tuple[Image.Image, ...], int]:
    """load_chat_images of messages (a chat's, or /tokenize's)."""
    parts = message_images(messages)
    if not parts:
        return (), 0
    metrics.record_images(len(parts))
    if vision is None:
        metrics.record_image_refused("model")
        raise BadRequestError(
            f"{parts[0].field}: the model `{name}` takes no images (it is not a vision model)",
            param=parts[0].field,
            code="image_not_supported",
        )
    try:
        images = await asyncio.to_thread(
            load_images, parts, vision.limits, vision.allowed_domains, vision.tokens
        )
    except ImageRefusal as exc:
        metrics.record_image_refused(exc.reason)
        field = str(exc).split(": ", 1)[0]
        raise BadRequestError(str(exc), param=field, code="invalid_image") from None
    return tuple(images), sum(image_token_counts(vision, images)) - len(images)


def image_token_counts(vision: ServedVision | None, images: Sequence[ImageLike]) -> list[int]:
    """The tokens each image takes in the prompt the engine runs (1, its placeholder, where the
    model's counts are unknown)."""
    if vision is None or vision.tokens is None:
        return [1] * len(images)
    return [vision.tokens(*im.size) for im in images]
