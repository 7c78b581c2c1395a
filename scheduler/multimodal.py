"""Images in a request, as the scheduler sees them: spans of placeholder tokens keyed by a digest.

The engine expands each image's one placeholder token into the model's image tokens
(engine/multimodal.py) and hands the request `MultiModalInputs`: per image its span (offset and
length in the prompt, the sha256 of its pixels) and its preprocessed pixel arrays as plain bytes.
The scheduler reads only the spans:
- a prefill chunk never ends inside a span (`fit_chunk`): an image's embeddings are spliced whole;
- a step encodes at most `max_num_encoder_tokens` image tokens (`encoder_tokens` counts a chunk's);
- a block that covers image tokens is hashed with the digests of those images (`image_key`), so
  two different images behind the same placeholder ids never share prefix-cache KV.
The pixel arrays travel to the runner once, in NewRequestData (no tensors in the control plane).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

# Library bounds (the served edge may set lower ones): images in one request, bytes of one
# image's preprocessed arrays, and dimensions of one array.
MAX_IMAGES_PER_REQUEST = 256
MAX_IMAGE_ARRAY_BYTES = 256 << 20
MAX_ARRAY_DIMS = 8
# numpy / torch dtype names an array may carry (what image processors output).
ARRAY_DTYPES = ("float32", "float16", "bfloat16", "int64", "int32", "uint8")
_DIGEST = re.compile(r"[0-9a-f]{64}")
_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "uint8": 1}


class ImageLike(Protocol):
    """What the engine needs of an image a sender passes (a PIL.Image.Image is one)."""

    @property
    def mode(self) -> str: ...

    @property
    def size(self) -> tuple[int, int]: ...

    def tobytes(self) -> bytes: ...


@dataclass(frozen=True, slots=True)
class PackedArray:
    """One preprocessed array (pixel values, a grid size) as bytes: cheap to pickle, no torch."""

    shape: tuple[int, ...]
    dtype: str
    data: bytes

    def __post_init__(self) -> None:
        if not (
            isinstance(self.shape, tuple)
            and len(self.shape) <= MAX_ARRAY_DIMS
            and all(_is_int(d) and 0 <= d <= MAX_IMAGE_ARRAY_BYTES for d in self.shape)
        ):
            raise ValueError(f"images: array shape must be a tuple of sizes, got {self.shape!r}")
        if self.dtype not in _ITEMSIZE:
            raise ValueError(
                f"images: array dtype must be one of {ARRAY_DTYPES}, got {self.dtype!r}"
            )
        if len(self.data) != math.prod(self.shape) * _ITEMSIZE[self.dtype]:
            raise ValueError(
                f"images: array of shape {self.shape} {self.dtype} holds {len(self.data)} bytes"
            )


@dataclass(frozen=True, slots=True)
class ImageSpan:
    """An image's tokens in the prompt: [offset, offset + length), and its content digest."""

    offset: int
    length: int
    digest: str  # sha256 hex over mode, size and pixel bytes (engine/multimodal.image_digest)

    def __post_init__(self) -> None:
        if not (_is_int(self.offset) and self.offset >= 0):
            raise ValueError(f"images: span offset must be an integer >= 0, got {self.offset!r}")
        if not (_is_int(self.length) and self.length >= 1):
            raise ValueError(f"images: span length must be an integer >= 1, got {self.length!r}")
        if not isinstance(self.digest, str) or _DIGEST.fullmatch(self.digest) is None:
            raise ValueError("images: digest must be 64 lowercase hex characters")

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass(frozen=True, slots=True)
class ImageInput:
    """One image of a request: where its tokens are, and the arrays its vision tower reads
    (named as the model's HF processor names them: `pixel_values`, `image_grid_thw`)."""

    span: ImageSpan
    arrays: tuple[tuple[str, PackedArray], ...]

    def __post_init__(self) -> None:
        size = sum(len(a.data) for _, a in self.arrays)
        if size > MAX_IMAGE_ARRAY_BYTES:
            raise ValueError(
                f"images: an image's arrays hold {size} bytes, more than {MAX_IMAGE_ARRAY_BYTES}"
            )


@dataclass(frozen=True, slots=True)
class MultiModalInputs:
    """A request's images in prompt order (their spans sorted, disjoint)."""

    images: tuple[ImageInput, ...]

    @property
    def spans(self) -> tuple[ImageSpan, ...]:
        return tuple(image.span for image in self.images)

    def check(self, num_prompt_tokens: int) -> None:
        """ValueError unless there are 1..MAX_IMAGES_PER_REQUEST images whose spans are sorted,
        disjoint and inside the prompt."""
        if not 1 <= len(self.images) <= MAX_IMAGES_PER_REQUEST:
            raise ValueError(
                f"images: 1 to {MAX_IMAGES_PER_REQUEST} images per request, got {len(self.images)}"
            )
        end = 0
        for span in self.spans:
            if span.offset < end or span.end > num_prompt_tokens:
                raise ValueError(
                    f"images: span [{span.offset}, {span.end}) overlaps another or leaves the "
                    f"{num_prompt_tokens}-token prompt"
                )
            end = span.end


def fit_chunk(spans: Sequence[ImageSpan], start: int, n: int) -> int:
    """The longest chunk of at most n tokens from `start` that does not end inside an image:
    n, or cut back to the start of the image it would cut (0 when that image starts at or before
    `start`: it must wait for a step with room for the rest of it)."""
    end = start + n
    for span in spans:
        if span.offset >= end:
            break
        if span.end > end:  # the chunk ends inside this span
            return max(span.offset - start, 0)
    return n


def encoder_tokens(spans: Sequence[ImageSpan], start: int, n: int) -> int:
    """Image tokens the vision tower encodes for a chunk [start, start + n): each image the chunk
    touches counts whole (its encoder runs over all of it, or its cached output is read)."""
    end = start + n
    return sum(s.length for s in spans if s.offset < end and s.end > start)


def image_key(spans: Sequence[ImageSpan], start: int, end: int) -> bytes:
    """What a prefix-cache block over tokens [start, end) is keyed by beyond its token ids: the
    digests of the images it covers (empty for a block of text alone)."""
    return b"".join(
        b"img:" + bytes.fromhex(s.digest) for s in spans if s.offset < end and s.end > start
    )


def expand_placeholders(
    ids: Sequence[int], placeholder: int, counts: Sequence[int]
) -> tuple[list[int], list[int]]:
    """ids with the i-th placeholder repeated counts[i] times (as many placeholders as counts),
    and where each run starts: the prompt the engine runs (and /tokenize shows)."""
    out: list[int] = []
    offsets: list[int] = []
    pending = iter(counts)
    for token in ids:
        if token != placeholder:
            out.append(token)
            continue
        offsets.append(len(out))
        out.extend([placeholder] * next(pending))
    return out, offsets


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def fit_images(spans: Sequence[ImageSpan], start: int, n: int, encoder_budget: int) -> int:
    """The chunk [start, start + n) cut so that it ends outside every image (fit_chunk) and the
    images it touches fit the step's remaining encoder budget (it then ends before the first
    image that does not fit; 0 when that image starts at or before `start`)."""
    n = fit_chunk(spans, start, n)
    end, left = start + n, encoder_budget
    for span in spans:
        if span.offset >= end:
            break
        if span.end <= start:
            continue
        if span.length > left:
            return max(span.offset - start, 0)
        left -= span.length
    return n


def check_spans_fit(spans: Sequence[ImageSpan], limit: int, why: str) -> None:
    """ValueError naming `images` when an image takes more tokens than one step can hold (`limit`,
    the smallest of the step's caps, named by `why`): it could never be scheduled."""
    for span in spans:
        if span.length > limit:
            raise ValueError(
                f"images: an image of {span.length} tokens exceeds {why}={limit}, the most one "
                "step encodes"
            )


@dataclass(slots=True)
class ImageStepStats:
    """What the vision tower did in one step (ModelRunnerOutput.image_stats): images encoded,
    images read from the encoder cache, and the tower's time in microseconds."""

    encoded: int = 0
    cache_hits: int = 0
    encoder_us: int = 0
