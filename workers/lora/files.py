"""An adapter directory's two files read whole, once, with a size cap and a time limit.

Every byte the engine will ever use of an adapter is read here, when the adapter is loaded, and
kept: the files may vanish or change afterwards without touching the adapters already loaded. Only
regular files directly in the adapter directory are read: a FIFO, a device or a symlink that leaves
the directory is refused before a byte is read, so no file can stall or redirect the read. The
read runs on a thread of its own: a hung mount costs the caller `timeout_s`, never its thread.

Error messages name the file by its name in the directory, never by its absolute path (they reach
API callers).
"""

from __future__ import annotations

import hashlib
import os
import stat
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# adapter_config.json is a few hundred bytes; a bigger one is not an adapter config.
MAX_CONFIG_BYTES = 1 << 20
# How long a load may take to read and check an adapter (a hung network mount is refused then).
READ_TIMEOUT_S = 60.0
_CHUNK = 1 << 20

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class AdapterFiles:
    """The bytes of an adapter's config and weights, as read at load."""

    config: bytes
    weights: bytes

    @property
    def digest(self) -> str:
        """sha256 of the content (hex): the adapter's identity beside its name, so a reload of
        other bytes under the same name is another adapter to every cache."""
        h = hashlib.sha256()
        for part in (self.config, self.weights):
            h.update(len(part).to_bytes(8, "little"))
            h.update(part)
        return h.hexdigest()


def read_adapter_files(directory: str, max_weights_bytes: int) -> AdapterFiles:
    """Both files of the (resolved) adapter `directory`; ValueError naming what is wrong."""
    return AdapterFiles(
        read_regular_file(directory, CONFIG_FILE, MAX_CONFIG_BYTES),
        read_regular_file(directory, WEIGHTS_FILE, max_weights_bytes),
    )


def read_regular_file(directory: str, name: str, max_bytes: int) -> bytes:
    """The whole of `directory/name`, a regular file of at most max_bytes that lies in directory
    (a symlink may point within it, not out of it)."""
    real = os.path.realpath(os.path.join(directory, name))
    if os.path.dirname(real) != os.path.realpath(directory):
        raise ValueError(f"lora adapter: {name} links out of the adapter directory")
    try:
        # O_NONBLOCK: opening a FIFO must not wait for a writer; fstat then refuses it.
        fd = os.open(real, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise ValueError(f"lora adapter: cannot read {name}: {exc.strerror}") from None
    try:
        mode = os.fstat(fd)
        if not stat.S_ISREG(mode.st_mode):
            raise ValueError(f"lora adapter: {name} is not a regular file")
        if mode.st_size > max_bytes:
            raise ValueError(f"lora adapter: {name} is larger than {max_bytes} bytes")
        os.set_blocking(fd, True)
        return _read_at_most(fd, name, max_bytes)
    except OSError as exc:
        raise ValueError(f"lora adapter: cannot read {name}: {exc.strerror}") from None
    finally:
        os.close(fd)


def _read_at_most(fd: int, name: str, max_bytes: int) -> bytes:
    """The file to its end; refused when it holds more than max_bytes (it grew since fstat)."""
    chunks, total = [], 0
    while chunk := os.read(fd, _CHUNK):
        total += len(chunk)
        if total > max_bytes:
            raise ValueError(f"lora adapter: {name} is larger than {max_bytes} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def call_with_timeout(fn: Callable[[], T], timeout_s: float, what: str) -> T:
    """fn() on a daemon thread of its own; ValueError when it has not returned in timeout_s. The
    thread is left behind then (a read blocked in the kernel cannot be interrupted), but the
    caller's thread, the engine's, is free."""
    result: list[T] = []
    error: list[BaseException] = []
    done = threading.Event()

    def run() -> None:
        try:
            result.append(fn())
        except BaseException as exc:  # handed to the caller's thread
            error.append(exc)
        finally:
            done.set()

    threading.Thread(target=run, name="raylm-lora-read", daemon=True).start()
    if not done.wait(timeout_s):
        raise ValueError(
            f"{what}: not read within {timeout_s:g} s (a hung mount or a stalled file)"
        )
    if error:
        raise error[0]
    return result[0]
