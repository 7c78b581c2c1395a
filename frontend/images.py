"""An image content part's URL to a bounded RGB image: what a vision request sends the model.

Every image a client sends is untrusted: its bounds are checked from what is cheap before what is
dear. The base64 text's length before it is decoded, the bytes after; the pixel count from the
header before a pixel is decoded (a 100,000 x 100,000 PNG of a few hundred bytes is refused
without allocating, whatever PIL's own bomb check would do); PNG metadata chunks and JPEG
metadata segments are counted from their headers (frontend/image_headers.py: a data URL's before
its base64 is decoded) before PIL inflates or keeps them; only an animation's first frame is
decoded. Each refusal is an `ImageRefusal`, a ValueError naming the field
(`messages[0].content[1].image_url.url`) that the served side answers as a 400, with a short
reason the metrics count by.

`http(s)` URLs are fetched (frontend/image_fetch.py) only from the hosts the caller allows.
"""

from __future__ import annotations

import binascii
import io
import struct
import zlib
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

from PIL import Image, UnidentifiedImageError

from frontend.image_headers import (
    BASE64_HEADERS,
    MAX_METADATA_BYTES,
    TOO_MUCH_METADATA,
    Peek,
    is_base64,
    metadata_excess,
    over_base64,
    over_bytes,
)
from settings import check_settings, setting

# What a request may send; the content decides the format, never the URL's media type.
FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
# The longest `data:<media type>;<parameters>,` head a data URL may have.
MAX_DATA_URL_HEAD = 256
_BASE64_PIECE = 256 << 10  # characters, a multiple of 4: a piece decodes in a few ms
# Exceptions PIL's decoders raise on a broken file (struct and zlib errors escape some plugins).
_BROKEN = (OSError, SyntaxError, ValueError, EOFError, struct.error, zlib.error, IndexError)
# (width, height) -> the tokens the served model spends on an image of that size (its engine's
# hook; None where the count is not known, and only the other bounds apply).
ImageTokens = Callable[[int, int], int]


class ImageRefusal(ValueError):
    """An image refused: the message names the field; `reason` is the metrics' label."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(slots=True)
class ImageLimits:
    """The bounds on the images of one request (deploy.yaml: flat keys, or an `images:` section)."""

    max_image_bytes: int = setting(
        20 << 20,
        "bytes of one image, decoded (its base64 text may be 4/3 of it); past it: 400 before the "
        "base64 is decoded",
        ge=1,
        le=1 << 30,
    )
    max_image_pixels: int = setting(
        4096 * 4096,
        "width x height of one image, read from its header before a pixel is decoded (against "
        "decompression bombs); past it: 400",
        ge=1,
        le=1 << 26,  # below PIL's own bomb check (89M), so this bound is always the one that holds
    )
    max_images_per_request: int = setting(
        16, "images over all the messages of one request; past it: 400", ge=1, le=1024
    )
    max_image_tokens_per_request: int = setting(
        32768,
        "tokens the model spends on the images of one request, as its engine counts them from "
        "each image's size; past it: 400 before the image over the bound is decoded",
        ge=1,
        le=1 << 24,
    )
    media_fetch_timeout_s: float = setting(
        10.0,
        "`http(s)` image URLs (`allowed_media_domains`): the connect, each read, and the whole "
        "fetch of one image must end within this",
        gt=0,
        le=300,
    )

    def __post_init__(self) -> None:
        check_settings(self)


@dataclass(frozen=True, slots=True)
class ImageInput:
    """An image part of a request: its URL and the field an error names."""

    url: str
    field: str


def load_images(
    parts: Sequence[ImageInput],
    limits: ImageLimits,
    allowed_domains: Collection[str] = (),
    tokens: ImageTokens | None = None,
) -> list[Image.Image]:
    """Every image of a request, in order, as RGB; the count, each image's bounds and the tokens
    they cost together are checked before the image that would break them is decoded."""
    if len(parts) > limits.max_images_per_request:
        extra = parts[limits.max_images_per_request]
        raise ImageRefusal(
            "count",
            f"{extra.field}: at most {limits.max_images_per_request} images per request, got "
            f"{len(parts)}",
        )
    images: list[Image.Image] = []
    spent = 0
    for part in parts:
        raw = image_bytes(part.url, part.field, limits, allowed_domains)
        with open_image(raw, part.field, limits) as im:
            spent += tokens(*im.size) if tokens is not None else 0
            if spent > limits.max_image_tokens_per_request:
                raise ImageRefusal(
                    "tokens",
                    f"{part.field}: the images up to this one take {spent} image tokens, more "
                    f"than max_image_tokens_per_request={limits.max_image_tokens_per_request}",
                )
            images.append(first_frame_rgb(im, part.field))
    return images


def load_image(
    url: str, field: str, limits: ImageLimits, allowed_domains: Collection[str] = ()
) -> Image.Image:
    """One image part's URL as an RGB image (an ImageRefusal naming `field` if it cannot be)."""
    with open_image(image_bytes(url, field, limits, allowed_domains), field, limits) as im:
        return first_frame_rgb(im, field)


def image_bytes(
    url: str, field: str, limits: ImageLimits, allowed_domains: Collection[str] = ()
) -> bytes:
    """The file a URL holds: a base64 data URL's, or an allowed host's over http(s)."""
    if url[:5].lower() == "data:":
        return data_url_bytes(url, field, limits.max_image_bytes)
    from frontend.image_fetch import fetch  # the http client only where it is asked for

    return fetch(url, field, limits, allowed_domains)


def data_url_bytes(url: str, field: str, max_bytes: int) -> bytes:
    """The bytes of `data:image/<type>;base64,<data>`: the text's length and the file's metadata
    headers are checked before the base64 is decoded, the bytes after."""
    comma = url.find(",", 0, MAX_DATA_URL_HEAD)  # no copy of the payload before its check
    media = url[5 : max(comma, 5)].lower().split(";")
    if comma < 0 or not media[0].startswith("image/") or "base64" not in media[1:]:
        raise ImageRefusal(
            "url", f"{field}: a data URL must be data:image/<type>;base64,<data> (or http(s))"
        )
    size = len(url) - comma - 1
    if size > 4 * -(-max_bytes // 3):
        raise ImageRefusal("bytes", _too_large(field, f"~{size * 3 // 4}", max_bytes))
    text = _ascii(url[comma + 1 :])
    try:
        _refuse_metadata(over_base64(text), field, BASE64_HEADERS)
    except binascii.Error:
        raise ImageRefusal("base64", f"{field}: the data URL's base64 is invalid") from None
    raw = _b64decode(text, field)
    if not raw:
        raise ImageRefusal("format", f"{field}: the image is empty")
    if len(raw) > max_bytes:
        raise ImageRefusal("bytes", _too_large(field, str(len(raw)), max_bytes))
    return raw


def _ascii(text: str) -> bytes:
    try:
        return text.encode("ascii")
    except UnicodeEncodeError:
        return b"!"  # not base64


def _b64decode(data: bytes, field: str) -> bytes:
    """Strict base64 (`is_base64`), decoded in pieces. binascii holds the GIL while it decodes:
    in pieces of a few milliseconds each, the ingress's event loop (its streams) runs between
    them, as it cannot during one 4 MB call."""
    if not is_base64(data):
        raise ImageRefusal("base64", f"{field}: the data URL's base64 is invalid")
    try:
        pieces = range(0, len(data), _BASE64_PIECE)
        return b"".join(binascii.a2b_base64(data[i : i + _BASE64_PIECE]) for i in pieces)
    except binascii.Error:
        raise ImageRefusal("base64", f"{field}: the data URL's base64 is invalid") from None


def _too_large(field: str, size: str, max_bytes: int) -> str:
    return f"{field}: the image has {size} bytes, more than max_image_bytes={max_bytes}"


def open_image(raw: bytes, field: str, limits: ImageLimits) -> Image.Image:
    """The image, its header read and its pixel count and metadata checked; no pixel decoded."""
    _refuse_metadata(over_bytes(raw), field)
    try:
        im = Image.open(io.BytesIO(raw), formats=FORMATS)
    except UnidentifiedImageError:
        raise ImageRefusal("format", f"{field}: not a PNG, JPEG, WebP or GIF image") from None
    except Image.DecompressionBombError:  # PIL's check, far past ours: the same refusal
        raise ImageRefusal("pixels", f"{field}: {_pixels_text(limits)}") from None
    except _BROKEN as exc:
        raise _broken(field, exc) from None
    width, height = im.size
    if width * height > limits.max_image_pixels or not width or not height:
        im.close()
        raise ImageRefusal(
            "pixels", f"{field}: the image is {width} x {height}; {_pixels_text(limits)}"
        )
    if _metadata_bytes(im) > MAX_METADATA_BYTES:
        im.close()
        raise ImageRefusal("metadata", f"{field}: {TOO_MUCH_METADATA}")
    return im


def _pixels_text(limits: ImageLimits) -> str:
    return f"at most max_image_pixels={limits.max_image_pixels} pixels (width x height)"


def first_frame_rgb(im: Image.Image, field: str) -> Image.Image:
    """The first frame (an animation's others are never decoded) as RGB."""
    try:
        im.seek(0)
        return im.convert("RGB")
    except _BROKEN as exc:
        raise _broken(field, exc) from None


def _broken(field: str, exc: BaseException) -> ImageRefusal:
    # PIL's words ("image file is truncated") say what is wrong; the type says nothing to a client.
    detail = str(exc).split("\n", 1)[0][:120]
    return ImageRefusal("corrupt", f"{field}: the image is truncated or corrupt ({detail})")


def _metadata_bytes(im: Image.Image) -> int:
    """Bytes of what PIL read besides pixels: ICC profile, text, EXIF, JPEG app segments."""
    values = list(im.info.values()) + [data for _, data in getattr(im, "applist", [])]
    return sum(len(v) for v in values if isinstance(v, (bytes, str)))


def _refuse_metadata(peek: Peek, field: str, max_headers: int | None = None) -> None:
    """Metadata bounds read from the headers (frontend/image_headers.py), before PIL inflates or
    keeps any of it."""
    excess = metadata_excess(peek, max_headers)
    if excess is not None:
        raise ImageRefusal("metadata", f"{field}: {excess}")


@dataclass(frozen=True, slots=True)
class ImageText:
    """What a chat template writes per image (`written`) and the text the prompt carries instead
    before it is tokenized (`sent`, holding the model's one placeholder token)."""

    written: str
    sent: str

    def apply(self, rendered: str) -> str:
        return rendered.replace(self.written, self.sent)


def image_text(tokenizer: Any) -> ImageText | None:
    """Gemma 3's image text, from a tokenizer that names its boi, image and eoi tokens (None for
    any other): its template writes `<start_of_image>`, and the prompt carries what transformers'
    Gemma3Processor puts there, `\\n\\n<start_of_image><image_soft_token>...<end_of_image>\\n\\n`,
    with one soft token (the engine repeats it per image row). Rewritten as text, before
    tokenizing, so the newlines around an image merge with their neighbours as the processor's
    do."""
    names = ("boi_token", "image_token", "eoi_token")
    boi, soft, eoi = (getattr(tokenizer, name, None) for name in names)
    if not all(isinstance(t, str) and t for t in (boi, soft, eoi)):
        return None
    return ImageText(str(boi), f"\n\n{boi}{soft}{eoi}\n\n")
