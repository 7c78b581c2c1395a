"""A GGUF file's tensor directory and data, read without building its metadata values.

gguf-py's reader turns every metadata value into numpy views, the tokenizer's ~100,000 strings
included: about 4 s of every replica start on the embedded model, for two values we use (the
architecture and the data alignment). This walks the metadata once with `struct`, keeps those two,
and maps the tensors' bytes from the file as gguf-py does (uint8 [rows, bytes per row] for block
types, the element type's array for F32, F16 and BF16 (as raw 16-bit words), in the file's
reversed dimension order).
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
# metadata value type -> struct format of one value (8: string, 9: array, handled apart)
_SCALARS = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}
_STRING, _ARRAY = 8, 9
_FLOAT_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}


@dataclass(frozen=True, slots=True)
class GGUFTensor:
    """One tensor of the file: its GGUF name, type and dimensions (innermost first, as stored)."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray  # a read-only view of the mapped file


@dataclass(frozen=True, slots=True)
class GGUFFile:
    architecture: str
    tensors: list[GGUFTensor]


class _Cursor:
    def __init__(self, buf: memoryview, path: str) -> None:
        self.buf, self.at, self.path = buf, 0, path

    def take(self, fmt: str) -> int | float | bool:
        try:
            (value,) = struct.unpack_from("<" + fmt, self.buf, self.at)
        except struct.error as exc:
            raise ValueError(f"model: {self.path!r} ends inside its GGUF header") from exc
        self.at += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = int(self.take("Q"))
        if self.at + n > len(self.buf):
            raise ValueError(f"model: {self.path!r} ends inside its GGUF header")
        text = bytes(self.buf[self.at : self.at + n]).decode("utf-8", errors="replace")
        self.at += n
        return text

    def value(self, kind: int) -> object:
        """One metadata value; arrays are skipped (None), none of ours is one."""
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = int(self.take("I")), int(self.take("Q"))
            if item in _SCALARS:
                self.at += struct.calcsize(_SCALARS[item]) * count
            else:
                for _ in range(count):
                    self.value(item)
            return None
        if kind not in _SCALARS:
            raise ValueError(f"model: {self.path!r} has a metadata value of unknown type {kind}")
        return self.take(_SCALARS[kind])


def read_gguf(path: str) -> GGUFFile:
    """The file's architecture and tensors, their data mapped read-only."""
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    cur = _Cursor(mapped.data, path)
    if bytes(mapped[:4]) != _MAGIC:
        raise ValueError(f"model: {path!r} is not a GGUF file")
    cur.at = 4
    version = int(cur.take("I"))
    if version < 2:
        raise ValueError(f"model: {path!r} is GGUF version {version}; versions 2 and 3 are read")
    num_tensors, num_fields = int(cur.take("Q")), int(cur.take("Q"))
    wanted: dict[str, object] = {}
    for _ in range(num_fields):
        key = cur.string()
        value = cur.value(int(cur.take("I")))
        if key in ("general.architecture", "general.alignment"):
            wanted[key] = value
    infos = []
    for _ in range(num_tensors):
        name = cur.string()
        dims = tuple(int(cur.take("Q")) for _ in range(int(cur.take("I"))))
        kind = int(cur.take("I"))
        try:
            qtype = GGMLQuantizationType(kind)
        except ValueError:
            raise ValueError(f"model: GGUF tensor {name!r} has unknown type {kind}") from None
        infos.append((name, qtype, dims, int(cur.take("Q"))))
    alignment = int(wanted.get("general.alignment", _DEFAULT_ALIGNMENT))  # type: ignore[call-overload]
    start = -(-cur.at // alignment) * alignment
    tensors = [
        GGUFTensor(name, kind, dims, _view(mapped, start + offset, kind, dims, name, path))
        for name, kind, dims, offset in infos
    ]
    return GGUFFile(str(wanted.get("general.architecture", "")), tensors)


def _view(
    mapped: np.ndarray,
    at: int,
    kind: GGMLQuantizationType,
    dims: tuple[int, ...],
    name: str,
    path: str,
) -> np.ndarray:
    shape = tuple(reversed(dims))
    if kind.name in _FLOAT_DTYPES:
        dtype = np.dtype(_FLOAT_DTYPES[kind.name])
        nbytes = math.prod(shape) * dtype.itemsize  # Python ints: a forged size cannot wrap
    else:
        block, size = GGML_QUANT_SIZES[kind]
        if not dims or dims[0] % block:
            raise ValueError(f"model: GGUF tensor {name!r} rows are not whole {kind.name} blocks")
        shape = (*shape[:-1], dims[0] // block * size)
        dtype = np.dtype(np.uint8)
        nbytes = math.prod(shape)
    if at + nbytes > mapped.shape[0]:
        raise ValueError(f"model: GGUF tensor {name!r} runs past the end of {path!r}")
    return mapped[at : at + nbytes].view(dtype).reshape(shape)
