"""The hostile image set, as bytes and data URLs: shared by tests/frontend/test_images.py, the
served tests (tests/deploy/test_images_api.py) and bench/image_neighbour.py."""

from __future__ import annotations

import base64
import io
import struct
import zlib
from collections.abc import Iterator

from PIL import Image


def encoded(im: Image.Image, fmt: str, **save: object) -> bytes:
    buf = io.BytesIO()
    im.save(buf, fmt, **save)
    return buf.getvalue()


def data_url(raw: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64,{base64.b64encode(raw).decode()}"


def chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png_header_only(width: int, height: int, extra: bytes = b"") -> bytes:
    """A valid PNG signature and IHDR claiming width x height, one tiny IDAT: a few hundred
    bytes."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\0" * 16)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + extra
        + chunk(b"IDAT", idat)
        + chunk(b"IEND", b"")
    )


def gif_bomb(frames: int) -> bytes:
    """A real 2-frame GIF (red, then blue) followed by `frames` more frames that each claim
    60,000 x 60,000 pixels and hold no valid data: decoding any of them would fail or explode."""
    first = Image.new("RGB", (8, 8), (255, 0, 0))
    gif = encoded(
        first, "GIF", save_all=True, append_images=[Image.new("RGB", (8, 8), (0, 0, 255))]
    )
    bomb_frame = b"\x2c" + struct.pack("<HHHH", 0, 0, 60000, 60000) + b"\x00" + b"\x02\x01\x00\x00"
    assert gif.endswith(b"\x3b")
    return gif[:-1] + bomb_frame * frames + b"\x3b"


def gif_first_frame_bomb() -> bytes:
    """A GIF whose logical screen is 8 x 8 and whose first frame claims 60,000 x 60,000."""
    gif = gif_bomb(0)
    at = gif.index(b"\x2c")  # the first image descriptor
    return gif[: at + 5] + struct.pack("<HH", 60000, 60000) + gif[at + 9 :]


def hostile_urls(max_image_bytes: int = 20 << 20) -> Iterator[str]:
    """The hostile set, as data URLs (also sent over HTTP by tests/deploy and bench/); the last is
    base64 text just past what `max_image_bytes` allows."""
    yield data_url(png_header_only(100_000, 100_000))
    yield data_url(png_header_only(5000, 5000))  # past this server's bound, short of PIL's
    yield data_url(gif_first_frame_bomb(), "image/gif")
    yield "data:image/png;base64,%%%%"
    yield data_url(b"not an image at all, just text named .png")
    png = encoded(Image.effect_noise((256, 256), 40).convert("RGB"), "PNG")
    yield data_url(png[: len(png) // 2])
    yield data_url(
        png_header_only(4, 4, chunk(b"zTXt", b"k\0\0" + zlib.compress(b"a" * (1000 << 10))) * 17)
    )
    yield data_url(
        encoded(Image.new("RGB", (4, 4)), "JPEG", icc_profile=b"\1" * (3 << 19)), "image/jpeg"
    )
    yield "data:image/png;base64," + "A" * (4 * -(-max_image_bytes // 3) + 4)
