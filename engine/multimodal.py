"""The engine's image input: a request's images preprocessed and its placeholders expanded.

A sender (the offline LLM, the served replica) puts PIL images on `EngineRequest.images` beside
prompt token ids that hold one placeholder token per image. `ImagePreprocessor.expand` (called by
EngineCore.add_request, on the engine's thread, never on an event loop) runs the checkpoint's HF
image processor over each image, replaces its placeholder with the model's number of image tokens
and hands the request `MultiModalInputs` (scheduler/multimodal.py): per image its span, its
content digest and its pixel arrays as bytes. What a family decides (which token is the
placeholder, how many tokens an image takes) comes from its model class (`VisionFamily`).
"""

from __future__ import annotations

import hashlib
import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

import numpy as np
from PIL import Image
from transformers import AutoConfig, PretrainedConfig

from frontend.images import ImageLimits, load_image
from scheduler.multimodal import (
    ImageInput,
    ImageLike,
    ImageSpan,
    MultiModalInputs,
    PackedArray,
    expand_placeholders,
)
from scheduler.request import EngineRequest
from workers.models import model_class
from workers.models.vision_family import config_image_token_id

logger = logging.getLogger(__name__)

# Preprocessed images kept by digest, so a conversation's next turn skips the processor.
PROCESSED_CACHE_BYTES = 64 << 20


class VisionFamily(Protocol):
    """What a vision-language model class tells the engine (workers/models/llava.py)."""

    @classmethod
    def num_image_tokens(cls, hf_config: PretrainedConfig, arrays: dict[str, np.ndarray]) -> int:
        """Tokens one image takes in the prompt, from its preprocessed arrays."""
        ...


def image_digest(image: ImageLike) -> str:
    """sha256 over the image's mode, size and pixel bytes: equal pixels, equal digest."""
    width, height = image.size
    h = hashlib.sha256(f"{image.mode}|{width}x{height}|".encode())
    h.update(image.tobytes())
    return h.hexdigest()


@dataclass(frozen=True, slots=True)
class ProcessedImage:
    """One image after the processor: its digest, its token count, its arrays."""

    digest: str
    num_tokens: int
    arrays: tuple[tuple[str, PackedArray], ...]

    @property
    def nbytes(self) -> int:
        return sum(len(a.data) for _, a in self.arrays)


class ImagePreprocessor:
    """A vision model's image processor (loaded once) and its placeholder expansion."""

    def __init__(self, processor: Any, hf_config: PretrainedConfig, family: VisionFamily) -> None:
        self.processor = processor
        self.hf_config = hf_config
        self.family = family
        self.placeholder = config_image_token_id(hf_config)  # every family's, from its config
        self._cache: OrderedDict[str, ProcessedImage] = OrderedDict()
        self._cache_bytes = 0

    @classmethod
    def load(cls, model_dir: str) -> ImagePreprocessor | None:
        """The preprocessor of the model in model_dir; None for a model without a vision tower."""
        hf_config = AutoConfig.from_pretrained(model_dir)
        family = model_class(hf_config)
        if not hasattr(family, "num_image_tokens"):
            return None
        # Here, not at the top: transformers' image processors import its modeling code and torch's
        # distributed tensors (a second of every replica's start), which a text model never runs.
        from transformers import AutoImageProcessor

        processor = AutoImageProcessor.from_pretrained(model_dir)
        return cls(processor, hf_config, family)  # type: ignore[arg-type]  # checked above

    def expand(self, request: EngineRequest) -> EngineRequest:
        """request with its images processed and placeholders expanded (ValueError naming
        `images` or `prompt_token_ids` when they do not match)."""
        if request.mm_inputs is not None:
            raise ValueError("mm_inputs: set by the engine; send the images in `images`")
        ids, images = request.prompt_token_ids, request.images
        found = sum(1 for t in ids if t == self.placeholder)
        if found != len(images):
            raise ValueError(
                f"images: {len(images)} images for {found} image placeholder tokens "
                f"(id {self.placeholder}) in prompt_token_ids"
            )
        if not images:
            return request
        processed = [self.process(image) for image in images]
        expanded, inputs = _expand(ids, self.placeholder, processed)
        return replace(request, prompt_token_ids=expanded, images=(), mm_inputs=inputs)

    def process(self, image: ImageLike) -> ProcessedImage:
        """One image through the HF processor (or from the cache of recent ones)."""
        digest = image_digest(image)
        hit = self._cache.get(digest)
        if hit is not None:
            self._cache.move_to_end(digest)
            return hit
        try:
            out = self.processor(images=[image], return_tensors="np")
        except Exception as exc:  # the processor's own complaint about this image
            raise ValueError(f"images: the image processor refused an image: {exc}") from exc
        arrays = {k: np.ascontiguousarray(v) for k, v in out.items() if isinstance(v, np.ndarray)}
        num_tokens = self.family.num_image_tokens(self.hf_config, arrays)
        packed = tuple((k, pack(v)) for k, v in arrays.items())
        done = ProcessedImage(digest, num_tokens, packed)
        self._remember(done)
        return done

    def _remember(self, image: ProcessedImage) -> None:
        self._cache[image.digest] = image
        self._cache_bytes += image.nbytes
        while self._cache_bytes > PROCESSED_CACHE_BYTES and self._cache:
            _, old = self._cache.popitem(last=False)
            self._cache_bytes -= old.nbytes


def _expand(
    ids: list[int], placeholder: int, images: list[ProcessedImage]
) -> tuple[list[int], MultiModalInputs]:
    """ids with the i-th placeholder repeated images[i].num_tokens times, and the spans."""
    out, offsets = expand_placeholders(ids, placeholder, [im.num_tokens for im in images])
    inputs = tuple(
        ImageInput(ImageSpan(offset, image.num_tokens, image.digest), image.arrays)
        for offset, image in zip(offsets, images)
    )
    return out, MultiModalInputs(inputs)


def pack(array: np.ndarray) -> PackedArray:
    """A numpy array as a PackedArray (float64 narrowed to float32: towers run in float)."""
    if array.dtype == np.float64:
        array = array.astype(np.float32)
    return PackedArray(tuple(int(d) for d in array.shape), str(array.dtype), array.tobytes())


def chat_images(messages: Sequence[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[Any]]:
    """An offline chat's messages as the template reads them, and their images in order.

    Image parts (`{"type": "image_url", "image_url": {"url": "data:..."}}`, or
    `{"type": "image_pil", "image_pil": <PIL image>}`) become `{"type": "image"}`, which the
    model's chat template writes as its placeholder; data URLs are decoded and bounded by
    frontend/images.py, as the served side decodes them."""
    out: list[dict[str, Any]] = []
    images: list[Any] = []
    for i, message in enumerate(messages):
        content = message.get("content")
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                image = _image_of(part, f"messages[{i}].content[{j}]")
                if image is not None:
                    images.append(image)
                    part = {"type": "image"}
                parts.append(part)
            message = {**message, "content": parts}
        out.append(message)
    return out, images


def _image_of(part: Any, field: str) -> Any:
    """The image a content part carries (None for a text part); ValueError naming the field."""
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "image_pil":
        image = part.get("image_pil")
        if not isinstance(image, Image.Image):
            raise ValueError(f"{field}.image_pil: must be a PIL image")
        return image.convert("RGB") if image.mode != "RGB" else image
    if kind == "image_url":
        url = (part.get("image_url") or {}).get("url")
        if not isinstance(url, str):
            raise ValueError(f"{field}.image_url.url: must be a string")
        return load_image(url, f"{field}.image_url.url", ImageLimits())
    if kind == "image":
        raise ValueError(f"{field}: an image part needs its image (image_url or image_pil)")
    return None


# What LLM.generate takes beside text and token ids (vLLM's shape).
PROMPT_KEYS = frozenset({"prompt", "prompt_token_ids", "multi_modal_data"})


def prompt_with_images(prompt: dict[str, Any]) -> tuple[str | list[int], tuple[Any, ...]]:
    """`{"prompt": text | "prompt_token_ids": ids, "multi_modal_data": {"image": img | [img]}}`
    as (text or ids, images); ValueError naming the key that is wrong."""
    unknown = set(prompt) - PROMPT_KEYS
    if unknown:
        raise ValueError(f"prompt: unknown keys {sorted(map(str, unknown))}")
    if ("prompt" in prompt) == ("prompt_token_ids" in prompt):
        raise ValueError("prompt: give exactly one of `prompt` and `prompt_token_ids`")
    body = prompt.get("prompt", prompt.get("prompt_token_ids"))
    if not (isinstance(body, str) or (isinstance(body, list) and _all_ints(body))):
        raise ValueError("prompt: `prompt` must be text, `prompt_token_ids` a list of integers")
    data = prompt.get("multi_modal_data") or {}
    if not isinstance(data, dict) or set(data) - {"image"}:
        raise ValueError("multi_modal_data: only {'image': image or [images]} is supported")
    images = data.get("image", [])
    images = list(images) if isinstance(images, (list, tuple)) else [images]
    for i, image in enumerate(images):
        if not isinstance(image, Image.Image):
            raise ValueError(f"multi_modal_data.image[{i}]: must be a PIL image")
    return body, tuple(image.convert("RGB") if image.mode != "RGB" else image for image in images)


def _all_ints(values: list[Any]) -> bool:
    return all(isinstance(v, int) and not isinstance(v, bool) for v in values)
