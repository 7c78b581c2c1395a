"""An image's metadata bounded from its headers: PNG chunks and JPEG segments walked by their
length fields alone, over the decoded bytes or over base64 text not yet decoded (a few bytes of it
decoded per header). A data URL carrying a metadata bomb (a 1.5 MiB ICC profile in a 2 MB JPEG)
is refused after a few dozen headers instead of after decoding its whole payload, which holds the
GIL the ingress's event loop needs for its streams (bench/image_neighbour.py).

A walk only finds what the checks after the decode (frontend/images.py: this walk over the bytes,
then PIL's own reading of the metadata) would refuse as well; a header it cannot read ends the
walk without a verdict, and the decode and PIL judge the file.
"""

from __future__ import annotations

import binascii
import itertools
import string
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass

# Metadata (ICC profiles, text chunks, EXIF) one image may carry, and PNG metadata chunks: PIL
# inflates each compressed chunk to up to 1 MiB, so their number bounds what they can cost.
MAX_METADATA_BYTES = 1 << 20
MAX_PNG_METADATA_CHUNKS = 16
TOO_MUCH_METADATA = f"the image carries more than {MAX_METADATA_BYTES} metadata bytes"
# Headers walked over base64 text before it is decoded: past this many, the decoded bytes are
# walked in full (a real image's metadata comes in far fewer).
BASE64_HEADERS = 256
BASE64_ALPHABET = (string.ascii_letters + string.digits + "+/").encode()
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_PNG_METADATA = {b"tEXt", b"zTXt", b"iTXt", b"iCCP", b"eXIf"}
_JPEG_START = b"\xff\xd8"
# JPEG markers without a length field (TEM, RSTn, SOI, EOI), and the start of scan (after it the
# entropy-coded data: PIL reads no metadata past it).
_JPEG_STANDALONE = {0x01, *range(0xD0, 0xDA)}
_JPEG_SCAN = 0xDA


@dataclass(frozen=True, slots=True)
class Peek:
    """A file's bytes read by range: `read(offset, n)` gives up to n bytes at offset."""

    read: Callable[[int, int], bytes]
    size: int


def over_bytes(raw: bytes) -> Peek:
    return Peek(lambda offset, n: raw[offset : offset + n], len(raw))


def over_base64(text: bytes) -> Peek:
    """The file that base64 `text` decodes to, each read decoding only the groups of 4 characters
    that hold it (binascii.Error where those are not valid base64)."""
    padding = text[-2:].count(b"=")
    size = len(text) // 4 * 3 - padding if len(text) % 4 == 0 else 0

    def read(offset: int, n: int) -> bytes:
        start = offset // 3 * 4
        stop = min(len(text), -(-(offset + n) // 3) * 4)
        return _decoded(text[start:stop])[offset % 3 : offset % 3 + n]

    return Peek(read, size)


def is_base64(text: bytes) -> bool:
    """Strict base64: whole groups of 4 from the alphabet, at most two `=` and only at the end
    (checked in one C pass: bytes.translate)."""
    body = text.rstrip(b"=")
    return (
        len(text) % 4 == 0
        and len(text) - len(body) <= 2
        and not body.translate(None, BASE64_ALPHABET)
    )


def _decoded(group: bytes) -> bytes:
    if not is_base64(group):
        raise binascii.Error("not base64")
    return binascii.a2b_base64(group)


def metadata_excess(peek: Peek, max_headers: int | None = None) -> str | None:
    """What in the file's headers breaks the metadata bounds (None: nothing, within the first
    `max_headers` headers when given)."""
    head = peek.read(0, len(PNG_SIGNATURE))
    steps = itertools.count() if max_headers is None else range(max_headers)
    if head == PNG_SIGNATURE:
        return _png_excess(peek, steps)
    if head.startswith(_JPEG_START):
        return _jpeg_excess(peek, steps)
    return None


def _png_excess(peek: Peek, steps: Iterable[int]) -> str | None:
    """Metadata chunks counted before the pixels and after (PIL reads both)."""
    count, offset = 0, len(PNG_SIGNATURE)
    for _ in steps:
        head = peek.read(offset, 8)
        if len(head) < 8:
            return None
        length, kind = struct.unpack(">I4s", head)
        count += kind in _PNG_METADATA
        if count > MAX_PNG_METADATA_CHUNKS:
            return f"the PNG has more than {MAX_PNG_METADATA_CHUNKS} metadata chunks"
        offset += 12 + length
    return None


def _jpeg_excess(peek: Peek, steps: Iterable[int]) -> str | None:
    """The application segments' and comments' bytes up to the scan: PIL keeps each of them
    whole (`applist`), so their sum is at most what it would count."""
    total, offset = 0, len(_JPEG_START)
    for _ in steps:
        head = peek.read(offset, 4)
        if len(head) < 4 or head[0] != 0xFF or head[1] == _JPEG_SCAN:
            return None
        marker, length = head[1], int.from_bytes(head[2:], "big")
        if marker == 0xFF:  # a fill byte before the marker
            offset += 1
            continue
        if marker in _JPEG_STANDALONE:
            offset += 2
            continue
        if length < 2 or offset + 2 + length > peek.size:
            return None  # broken: PIL says how
        total += length - 2 if 0xE0 <= marker <= 0xEF or marker == 0xFE else 0
        if total > MAX_METADATA_BYTES:
            return TOO_MUCH_METADATA
        offset += 2 + length
    return None
