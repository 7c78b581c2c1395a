"""frontend/image_headers.py: an image's metadata bounds read from its PNG chunk and JPEG segment
headers, over base64 text before it is decoded as over the decoded bytes, with the same verdict
the checks after the decode give."""

from __future__ import annotations

import base64
import struct
import zlib

import pytest
from PIL import Image

from frontend.image_headers import (
    BASE64_HEADERS,
    MAX_PNG_METADATA_CHUNKS,
    metadata_excess,
    over_base64,
    over_bytes,
)
from frontend.images import ImageLimits, ImageRefusal, load_image
from tests.frontend.hostile_images import chunk, data_url, encoded, png_header_only

FIELD = "messages[0].content[1].image_url.url"


def jpeg(**save: object) -> bytes:
    return encoded(Image.effect_noise((16, 16), 40).convert("RGB"), "JPEG", **save)


def with_segments(jpg: bytes, *segments: tuple[int, bytes]) -> bytes:
    """jpg with (marker, payload) segments inserted right after its start of image."""
    extra = b"".join(bytes([0xFF, m]) + struct.pack(">H", len(p) + 2) + p for m, p in segments)
    return jpg[:2] + extra + jpg[2:]


def png_with(extra: bytes) -> bytes:
    """A real 9 x 7 PNG with `extra` chunks after its header chunk."""
    png = encoded(Image.new("RGB", (9, 7), (1, 2, 3)), "PNG")
    return png[:33] + extra + png[33:]  # the signature and IHDR: 8 + 25 bytes


ZTXT = chunk(b"zTXt", b"k\0\0" + zlib.compress(b"a" * 1000))
FILES = {
    "png": png_with(b""),
    "png with 16 text chunks": png_with(ZTXT * MAX_PNG_METADATA_CHUNKS),
    "png with 17 text chunks": png_with(ZTXT * (MAX_PNG_METADATA_CHUNKS + 1)),
    "jpeg": jpeg(),
    "jpeg with 400 KiB of icc": jpeg(icc_profile=b"\1" * (400 << 10)),
    "jpeg with 1.5 MiB of icc": jpeg(icc_profile=b"\1" * (3 << 19)),
    "jpeg with comments past 1 MiB": with_segments(jpeg(), *[(0xFE, b"c" * 65_000)] * 17),
    "gif": encoded(Image.new("RGB", (3, 3)), "GIF"),
}
REFUSED = {"png with 17 text chunks", "jpeg with 1.5 MiB of icc", "jpeg with comments past 1 MiB"}


@pytest.mark.parametrize("name", FILES)
def test_the_walk_over_base64_gives_the_bytes_verdict_and_the_decodes(name):
    raw = FILES[name]
    url = data_url(raw)
    text = url.split(",", 1)[1].encode()
    verdict = metadata_excess(over_base64(text))
    assert verdict == metadata_excess(over_bytes(raw))
    assert (verdict is not None) == (name in REFUSED)
    if name in REFUSED:
        with pytest.raises(ImageRefusal) as info:
            load_image(url, FIELD, ImageLimits())
        assert info.value.reason == "metadata" and str(info.value) == f"{FIELD}: {verdict}"
    else:
        assert load_image(url, FIELD, ImageLimits()).mode == "RGB"


@pytest.mark.parametrize("size", [0, 1, 2, 3, 4, 5, 100])
def test_reads_over_base64_are_the_decoded_bytes_at_any_offset(size):
    raw = bytes(range(256))[:size]
    peek = over_base64(base64.b64encode(raw))
    assert peek.size == size
    for offset in range(size + 3):
        for n in range(6):
            assert peek.read(offset, n) == raw[offset : offset + n], (offset, n)


def test_a_metadata_bomb_is_refused_before_its_payload_is_decoded():
    """The 1.5 MiB ICC JPEG of the hostile set with everything past its first 1.2 MB (1.6 M
    base64 characters) replaced by non-base64: decoding it all would be a `base64` refusal; the
    header walk refuses it for its metadata first, from the segments' lengths."""
    text = base64.b64encode(FILES["jpeg with 1.5 MiB of icc"]).decode()
    spoiled = text[:1_600_000] + "!" * (len(text) - 1_600_000)
    with pytest.raises(ImageRefusal) as info:
        load_image(f"data:image/jpeg;base64,{spoiled}", FIELD, ImageLimits())
    assert info.value.reason == "metadata"
    # A header the walk reads that is not base64 is the `base64` refusal.
    with pytest.raises(ImageRefusal) as info:
        load_image("data:image/jpeg;base64,/9j!" + text[4:], FIELD, ImageLimits())
    assert info.value.reason == "base64"


def test_past_its_header_budget_the_base64_walk_leaves_the_verdict_to_the_bytes():
    """300 empty chunks, then 17 text chunks: the walk over base64 stops after BASE64_HEADERS
    headers without a verdict; the walk over the decoded bytes refuses."""
    raw = png_header_only(4, 4, chunk(b"abCd", b"") * 300 + ZTXT * (MAX_PNG_METADATA_CHUNKS + 1))
    text = base64.b64encode(raw)
    assert BASE64_HEADERS < 300
    assert metadata_excess(over_base64(text), BASE64_HEADERS) is None
    assert metadata_excess(over_base64(text)) == metadata_excess(over_bytes(raw)) is not None
    with pytest.raises(ImageRefusal) as info:
        load_image(data_url(raw), FIELD, ImageLimits())
    assert info.value.reason == "metadata"


def test_broken_headers_end_the_walk_and_pil_says_what_is_wrong():
    # A segment longer than the file, and a segment length below its own two bytes.
    for broken in [b"\xff\xd8\xff\xe2\xff\xf0" + b"\1" * 100, b"\xff\xd8\xff\xe1\x00\x01"]:
        assert metadata_excess(over_bytes(broken)) is None
        with pytest.raises(ImageRefusal) as info:
            load_image(data_url(broken, "image/jpeg"), FIELD, ImageLimits())
        assert info.value.reason in ("corrupt", "format")  # PIL's verdict, not the walk's
