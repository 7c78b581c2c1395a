"""frontend/images.py: an image part's URL to a bounded RGB image, and the hostile set refused as a
ValueError naming the field; frontend/image_fetch.py against a real HTTP server on 127.0.0.1."""

from __future__ import annotations

import base64
import math
import subprocess
import sys
import threading
import zlib
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from PIL import Image

from frontend.image_headers import MAX_PNG_METADATA_CHUNKS
from frontend.images import (
    ImageInput,
    ImageLimits,
    ImageRefusal,
    data_url_bytes,
    load_image,
    load_images,
)
from tests.frontend.hostile_images import (
    chunk,
    data_url,
    encoded,
    gif_bomb,
    gif_first_frame_bomb,
    png_header_only,
)

FIELD = "messages[0].content[1].image_url.url"
LIMITS = ImageLimits()


def refused(url: str, reason: str, limits: ImageLimits = LIMITS, **kw: object) -> str:
    with pytest.raises(ImageRefusal) as info:
        load_image(url, FIELD, limits, **kw)  # type: ignore[arg-type]
    assert isinstance(info.value, ValueError)
    assert str(info.value).startswith(FIELD + ": "), str(info.value)
    assert info.value.reason == reason, (info.value.reason, str(info.value))
    return str(info.value)


# ---- what is accepted ------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["PNG", "WEBP", "GIF"])
def test_lossless_formats_decode_to_the_same_rgb_pixels(fmt):
    im = Image.new("RGB", (5, 3), (10, 200, 30))
    im.putpixel((4, 2), (255, 255, 255))
    save = {"lossless": True} if fmt == "WEBP" else {}
    out = load_image(data_url(encoded(im, fmt, **save), f"image/{fmt.lower()}"), FIELD, LIMITS)
    assert out.mode == "RGB" and out.size == (5, 3)
    assert out.getpixel((0, 0)) == (10, 200, 30) and out.getpixel((4, 2)) == (255, 255, 255)


def test_jpeg_rgba_and_palette_images_become_rgb():
    jpeg = load_image(
        data_url(encoded(Image.new("RGB", (16, 8), (0, 0, 250)), "JPEG")), FIELD, LIMITS
    )
    assert jpeg.mode == "RGB" and jpeg.size == (16, 8) and jpeg.getpixel((3, 3))[2] > 240
    rgba = encoded(Image.new("RGBA", (2, 2), (1, 2, 3, 0)), "PNG")
    assert load_image(data_url(rgba), FIELD, LIMITS).getpixel((0, 0)) == (1, 2, 3)
    palette = encoded(Image.new("P", (2, 2), 0), "PNG")
    assert load_image(data_url(palette), FIELD, LIMITS).mode == "RGB"


def test_the_content_decides_the_format_not_the_media_type():
    png = encoded(Image.new("RGB", (2, 2), (9, 9, 9)), "PNG")
    assert load_image(data_url(png, "image/jpeg"), FIELD, LIMITS).getpixel((1, 1)) == (9, 9, 9)


def test_an_animated_gif_gives_its_first_frame_and_never_decodes_the_others():
    # 10,000 frames after the second, each claiming 3.6 billion pixels: only frame 0 is read.
    out = load_image(data_url(gif_bomb(10_000), "image/gif"), FIELD, LIMITS)
    assert out.size == (8, 8) and out.getpixel((0, 0)) == (255, 0, 0)


def test_several_images_keep_their_order():
    colours = [(255, 0, 0), (0, 255, 0), (0, 0, 255)]
    parts = [
        ImageInput(
            data_url(encoded(Image.new("RGB", (1, 1), c), "PNG")), f"messages[0].content[{i}]"
        )
        for i, c in enumerate(colours)
    ]
    assert [im.getpixel((0, 0)) for im in load_images(parts, LIMITS)] == colours


# ---- the hostile set: each a ValueError naming the field ------------------------------------
def test_a_gif_whose_first_frame_outgrows_its_screen_is_refused_from_its_header():
    refused(data_url(gif_first_frame_bomb(), "image/gif"), "pixels")


def test_a_decompression_bomb_is_refused_from_its_header():
    bomb = png_header_only(100_000, 100_000)
    assert len(bomb) < 200
    message = refused(data_url(bomb), "pixels")
    assert "max_image_pixels" in message
    # Past this server's bound but short of PIL's own check: the bound here is what refuses.
    refused(data_url(png_header_only(4097, 4096)), "pixels")
    refused(data_url(png_header_only(64, 64)), "pixels", ImageLimits(max_image_pixels=4095))


def test_invalid_base64_a_text_file_and_bad_data_urls_are_refused():
    refused("data:image/png;base64,not*base64!", "base64")
    refused("data:image/png;base64,QUJDR", "base64")  # a length no padding fixes
    for bad in ("QUJD====", "QU=D", "QUJ\u00e9", "QUJD\n", "===="):
        refused(f"data:image/png;base64,{bad}", "base64")
    refused(data_url(b"this is a text file named cat.png\n"), "format")
    refused(data_url(encoded(Image.new("RGB", (2, 2)), "BMP"), "image/bmp"), "format")
    refused("data:image/png;base64,", "format")
    refused("data:text/plain;base64,aGVsbG8=", "url")
    refused("data:image/png,rawtext", "url")
    refused("data:image/png;base64", "url")


@pytest.mark.parametrize("size", [1, 2, 3, 196_608, 196_609, 3 << 20])
def test_base64_decodes_exactly_across_its_pieces(size):
    raw = bytes(range(256)) * (size // 256) + bytes(size % 256)
    url = "data:image/png;base64," + base64.b64encode(raw).decode()
    assert data_url_bytes(url, FIELD, 4 << 20) == raw


def test_a_truncated_file_is_refused():
    png = encoded(Image.effect_noise((64, 64), 40).convert("RGB"), "PNG")
    assert "truncated" in refused(data_url(png[: len(png) // 2]), "corrupt")
    jpeg = encoded(Image.effect_noise((64, 64), 40).convert("RGB"), "JPEG")
    refused(data_url(jpeg[: len(jpeg) // 2], "image/jpeg"), "corrupt")
    refused(data_url(png[:20]), "corrupt")


def test_huge_metadata_is_refused():
    # Many compressed text chunks (each inflates to nearly 1 MiB): counted before PIL inflates.
    ztxt = chunk(b"zTXt", b"k\0\0" + zlib.compress(b"a" * (1000 << 10)))
    many = png_header_only(4, 4, ztxt * (MAX_PNG_METADATA_CHUNKS + 1))
    assert len(many) < 100_000
    refused(data_url(many), "metadata")
    # One chunk inflating past 1 MiB (PIL's own bound), and an ICC profile of 1.5 MiB.
    refused(
        data_url(png_header_only(4, 4, chunk(b"iCCP", b"p\0\0" + zlib.compress(b"a" * (2 << 20))))),
        "corrupt",
    )
    icc_jpeg = encoded(Image.new("RGB", (4, 4)), "JPEG", icc_profile=b"\1" * (3 << 19))
    refused(data_url(icc_jpeg, "image/jpeg"), "metadata")


def test_bytes_are_bounded_before_and_after_base64():
    png = encoded(Image.effect_noise((64, 64), 40).convert("RGB"), "PNG")
    small = ImageLimits(max_image_bytes=len(png) - 1)
    assert "max_image_bytes" in refused(data_url(png), "bytes", small)
    # A base64 text far past the bound is refused from its length, before a byte is decoded.
    refused(
        "data:image/png;base64," + "A" * (8 << 20), "bytes", ImageLimits(max_image_bytes=1 << 20)
    )
    assert load_image(data_url(png), FIELD, ImageLimits(max_image_bytes=len(png))).size == (64, 64)


def test_images_per_request_and_image_tokens_per_request_are_bounded():
    one = data_url(encoded(Image.new("RGB", (20, 10)), "PNG"))
    parts = [ImageInput(one, f"messages[{i}].content[0].image_url.url") for i in range(3)]
    with pytest.raises(
        ImageRefusal, match=r"^messages\[2\]\.content\[0\]\.image_url\.url: at most 2"
    ):
        load_images(parts, ImageLimits(max_images_per_request=2))
    tokens_seen: list[tuple[int, int]] = []

    def tokens(width: int, height: int) -> int:
        tokens_seen.append((width, height))
        return width * height // 100  # 2 tokens per 20 x 10 image

    with pytest.raises(ImageRefusal) as info:
        load_images(parts, ImageLimits(max_image_tokens_per_request=5), tokens=tokens)
    assert info.value.reason == "tokens"
    assert str(info.value).startswith(
        "messages[2].content[0].image_url.url: the images up to this one take 6"
    )
    assert tokens_seen == [(20, 10)] * 3
    assert len(load_images(parts, ImageLimits(max_image_tokens_per_request=6), tokens=tokens)) == 3


@pytest.mark.parametrize(
    "name",
    [
        "max_image_bytes",
        "max_image_pixels",
        "max_images_per_request",
        "max_image_tokens_per_request",
        "media_fetch_timeout_s",
    ],
)
@pytest.mark.parametrize("value", [2**64, -1, math.nan, 10**30, "big"])
def test_each_limit_refuses_out_of_range_values_naming_itself(name, value):
    with pytest.raises(ValueError, match=f"^{name}: "):
        ImageLimits(**{name: value})


def test_the_hostile_set_does_not_grow_the_process_by_100_mb():
    """In a fresh process (its peak RSS is this set's own): every hostile image refused, and the
    peak resident size grows by less than 100 MB."""
    script = f"""
import resource, sys
sys.path[:0] = {sys.path!r}
from tests.frontend.hostile_images import data_url, gif_bomb, hostile_urls
from frontend.images import ImageLimits, ImageRefusal, load_image
urls = list(hostile_urls())
animated = data_url(gif_bomb(10_000), "image/gif")
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
for url in urls:
    try:
        load_image(url, "f", ImageLimits())
        raise SystemExit("accepted a hostile image")
    except ImageRefusal:
        pass
assert load_image(animated, "f", ImageLimits()).size == (8, 8)
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before, len(urls))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    grown_kb, count = map(int, out.stdout.split())
    assert count == 9
    assert grown_kb < 100 * 1024, f"peak RSS grew by {grown_kb} KiB"


# ---- http(s) URLs -------------------------------------------------------------------------
PNG_BYTES = encoded(Image.new("RGB", (3, 2), (7, 8, 9)), "PNG")


class _Handler(BaseHTTPRequestHandler):
    release = threading.Event()

    def do_GET(self) -> None:
        if self.path == "/ok.png":
            self._send(PNG_BYTES)
        elif self.path == "/same-host-redirect":
            self._redirect(f"http://127.0.0.1:{self.server.server_port}/ok.png")
        elif self.path == "/other-host-redirect":
            self._redirect(f"http://localhost:{self.server.server_port}/ok.png")
        elif self.path == "/endless":
            self.send_response(200)
            self.end_headers()
            try:
                while not self.release.is_set():
                    self.wfile.write(b"\0" * 65536)
            except OSError:  # the client stopped reading: what the test expects
                pass
        elif self.path == "/stall":
            self.send_response(200)
            self.send_header("Content-Length", "100")
            self.end_headers()
            self.release.wait(30)
        else:
            self.send_error(404)

    def _send(self, body: bytes) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _redirect(self, location: str) -> None:
        self.send_response(302)
        self.send_header("Location", location)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_port}"
    _Handler.release.set()
    httpd.shutdown()
    httpd.server_close()


ALLOWED = ["127.0.0.1"]


def test_http_urls_are_refused_unless_the_host_is_allowed(server):
    assert "allowed_media_domains is empty" in refused(f"{server}/ok.png", "url")
    assert "not in this server's allowed_media_domains" in refused(
        f"{server}/ok.png", "url", allowed_domains=["example.com"]
    )
    for url in (
        "file:///etc/passwd",
        "ftp://127.0.0.1/x.png",
        "http://127.0.0.1:99999999/x",
        "http://" + "a" * 9000,
    ):
        refused(url, "url", allowed_domains=ALLOWED)


def test_an_allowed_host_is_fetched_and_same_host_redirects_followed(server):
    assert load_image(f"{server}/ok.png", FIELD, LIMITS, ALLOWED).getpixel((2, 1)) == (7, 8, 9)
    assert load_image(f"{server}/same-host-redirect", FIELD, LIMITS, ALLOWED).size == (3, 2)


def test_fetching_is_bounded(server):
    assert "another host" in refused(
        f"{server}/other-host-redirect", "url", allowed_domains=ALLOWED
    )
    refused(
        f"{server}/endless", "bytes", ImageLimits(max_image_bytes=1 << 20), allowed_domains=ALLOWED
    )
    refused(
        f"{server}/stall", "fetch", ImageLimits(media_fetch_timeout_s=0.3), allowed_domains=ALLOWED
    )
    assert "HTTP 404" in refused(f"{server}/missing.png", "fetch", allowed_domains=ALLOWED)
    refused(
        f"{server}/ok.png",
        "bytes",
        ImageLimits(max_image_bytes=len(PNG_BYTES) - 1),
        allowed_domains=ALLOWED,
    )
