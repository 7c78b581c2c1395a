"""Images fetched over http(s), from the hosts an operator names in `allowed_media_domains` only.

Fetching a URL a client chose is a server-side request forgery risk (it reaches what the server
reaches), so it is off unless hosts are named, and then bounded: no proxy from the environment,
a timeout on the connect and on each read and a deadline on the whole, a byte cap counted as the
body streams in (reading stops past it), and redirects followed only within the same host. The
caller runs it off any event loop (it blocks).
"""

from __future__ import annotations

import http.client
import time
import urllib.error
import urllib.request
from collections.abc import Collection
from typing import Any
from urllib.parse import urlsplit

from frontend.images import ImageLimits, ImageRefusal

MAX_URL_CHARS = 8192
MAX_REDIRECTS = 3
_CHUNK = 64 << 10


def fetch(url: str, field: str, limits: ImageLimits, allowed_domains: Collection[str]) -> bytes:
    """The body at `url` (http or https, an allowed host), at most max_image_bytes of it."""
    host = allowed_host(url, field, allowed_domains)
    opener = urllib.request.build_opener(
        urllib.request.ProxyHandler({}), _SameHostRedirects(field, host)
    )
    request = urllib.request.Request(url, headers={"Accept": "image/*", "User-Agent": "raylm"})
    timeout = limits.media_fetch_timeout_s
    deadline = time.monotonic() + timeout
    try:
        with opener.open(request, timeout=timeout) as response:
            return _read_capped(response, field, limits.max_image_bytes, deadline)
    except ImageRefusal:
        raise
    except urllib.error.HTTPError as exc:
        raise ImageRefusal("fetch", f"{field}: the image's host answered HTTP {exc.code}") from None
    except (OSError, http.client.HTTPException, ValueError) as exc:  # URLError and timeouts too
        reason = getattr(exc, "reason", exc)
        raise ImageRefusal(
            "fetch", f"{field}: the image could not be fetched ({str(reason)[:120]})"
        ) from None


def allowed_host(url: str, field: str, allowed_domains: Collection[str]) -> str:
    """The URL's host once the URL is http(s) and the host is allowed, else an ImageRefusal."""
    if not allowed_domains:
        raise ImageRefusal(
            "url",
            f"{field}: images must be sent as data URLs (data:image/png;base64,...); this server "
            "fetches no image URLs (allowed_media_domains is empty)",
        )
    if len(url) > MAX_URL_CHARS:
        raise ImageRefusal("url", f"{field}: an image URL has at most {MAX_URL_CHARS} characters")
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - a port that is no number raises here
    except ValueError:
        raise ImageRefusal("url", f"{field}: the image URL is malformed") from None
    host = (parts.hostname or "").rstrip(".")
    if parts.scheme.lower() not in ("http", "https"):
        raise ImageRefusal("url", f"{field}: an image URL is a data: URL or http(s)")
    if host not in allowed_domains:
        raise ImageRefusal(
            "url", f"{field}: the host {host[:64]!r} is not in this server's allowed_media_domains"
        )
    return host


def _read_capped(response: Any, field: str, max_bytes: int, deadline: float) -> bytes:
    """The body, read a buffer at a time (read1: no waiting for a full chunk from a slow
    sender) until it ends, passes max_bytes or the deadline."""
    declared = response.headers.get("Content-Length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise ImageRefusal("bytes", f"{field}: the image has more than {max_bytes} bytes")
    chunks, size = [], 0
    while chunk := response.read1(_CHUNK):
        size += len(chunk)
        if size > max_bytes:
            raise ImageRefusal(
                "bytes", f"{field}: the image has more than max_image_bytes={max_bytes} bytes"
            )
        if time.monotonic() > deadline:
            raise ImageRefusal("fetch", f"{field}: the image did not arrive in time")
        chunks.append(chunk)
    return b"".join(chunks)


class _SameHostRedirects(urllib.request.HTTPRedirectHandler):
    """Follows a few redirects within the URL's host; one to another host is refused."""

    max_redirections = MAX_REDIRECTS

    def __init__(self, field: str, host: str) -> None:
        self.field, self.host = field, host

    def redirect_request(
        self, req: Any, fp: Any, code: int, msg: str, headers: Any, newurl: str
    ) -> urllib.request.Request | None:
        target = urlsplit(newurl)
        if target.scheme not in ("http", "https") or (target.hostname or "") != self.host:
            raise ImageRefusal("url", f"{self.field}: the image's host redirected to another host")
        return super().redirect_request(req, fp, code, msg, headers, newurl)
