"""The disk tier's files: one block a file under a directory only this engine's rank can read.

- Layout: `<kv_disk_tier_dir>/<engine>/rank<N>/<hash>.kvblock`; the engine and rank directories
  are 0700 and every file 0600 (tenants' KV is as private as their prompts).
- Ownership: each rank directory holds `owner.lock`, its process id, locked (flock) for as long as
  the process lives. A rank starting under the same root removes every sibling rank directory
  whose lock it can take (its owner is gone: crashed or killed) and an engine directory left
  empty, so a crash leaves nothing behind for long. An engine removes its own at a clean stop.
- Integrity: a file is a header (magic, the block's 128-bit hash, the payload length) and the
  block's bytes, followed by an HMAC-SHA256 of both under a random key this process keeps in
  memory only. A checksum anyone can recompute (CRC-32) detects accidents; the HMAC also refuses a
  file someone rewrote, so a forged block is a miss (recomputed), never KV the model trusts.
"""

from __future__ import annotations

import fcntl
import hashlib
import hmac
import logging
import os
import shutil
import struct
from pathlib import Path
from typing import IO

logger = logging.getLogger(__name__)

MAGIC = b"RLKVBLK2"
HEADER = struct.Struct("<8s16sQ")  # magic, hash (little-endian 128 bits), payload bytes
MAC_BYTES = hashlib.sha256().digest_size
OVERHEAD_BYTES = HEADER.size + MAC_BYTES  # per file, besides the block's bytes
SUFFIX = ".kvblock"
LOCK_NAME = "owner.lock"
_PRIVATE_DIR = 0o700
_PRIVATE_FILE = 0o600


class DiskTier:
    """One rank's block files: written, read back and checked, dropped."""

    def __init__(self, engine_dir: str | Path, rank: int, block_nbytes: int) -> None:
        engine = Path(engine_dir)
        engine.parent.parent.mkdir(parents=True, exist_ok=True)
        sweep_orphans(engine.parent)
        self.dir = engine / f"rank{rank}"
        for path in (engine.parent, engine, self.dir):
            _private_dir(path)
        self.block_nbytes = block_nbytes
        self._key = os.urandom(32)  # never written anywhere: a file is trusted by this process only
        self._lock = _claim(self.dir)

    def path(self, block_hash: int) -> Path:
        return self.dir / f"{block_hash:032x}{SUFFIX}"

    def write(self, payload: memoryview, block_hash: int) -> None:
        """Write one block's bytes to its file (whole or not at all); a failure loses the block."""
        header = HEADER.pack(MAGIC, block_hash.to_bytes(16, "little"), payload.nbytes)
        mac = self._mac(header, payload)
        path = self.path(block_hash)
        tmp = path.with_suffix(".tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, _PRIVATE_FILE)
            with os.fdopen(fd, "wb") as f:
                f.write(header)
                f.write(payload)
                f.write(mac)
            os.replace(tmp, path)  # a reader sees the whole file or none
        except OSError as exc:  # a full disk loses the block: a later hit recomputes it
            logger.warning("KV tier: cannot write %s: %r", path.name, exc)
            tmp.unlink(missing_ok=True)

    def read(self, block_hash: int) -> bytearray | None:
        """The file of block_hash as one buffer (header, payload, MAC), or None when it is
        missing or fails a check; the payload starts at HEADER.size."""
        path = self.path(block_hash)
        buf = bytearray(OVERHEAD_BYTES + self.block_nbytes)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
            with os.fdopen(fd, "rb") as f:
                n = f.readinto(buf)
                extra = f.read(1)
        except OSError as exc:
            logger.warning("KV tier: cannot read %s: %r", path.name, exc)
            return None
        if n != len(buf) or extra or not self._intact(buf, block_hash):
            logger.warning("KV tier: %s fails its check; recomputing", path.name)
            return None
        return buf

    def drop(self, block_hash: int) -> None:
        self.path(block_hash).unlink(missing_ok=True)

    def _intact(self, buf: bytearray, block_hash: int) -> bool:
        view = memoryview(buf)
        header, payload = view[: HEADER.size], view[HEADER.size : HEADER.size + self.block_nbytes]
        magic, stored_hash, nbytes = HEADER.unpack_from(buf)
        return (
            magic == MAGIC
            and int.from_bytes(stored_hash, "little") == block_hash
            and nbytes == self.block_nbytes
            and hmac.compare_digest(self._mac(header, payload), view[-MAC_BYTES:])
        )

    def _mac(self, header: bytes | memoryview, payload: memoryview) -> bytes:
        mac = hmac.new(self._key, header, hashlib.sha256)
        mac.update(payload)
        return mac.digest()


def _private_dir(path: Path) -> None:
    """Create path 0700 if missing; one this process created is made 0700 whatever the umask.
    An existing root chosen by the operator is left as it is."""
    try:
        path.mkdir(mode=_PRIVATE_DIR)
    except FileExistsError:
        return
    os.chmod(path, _PRIVATE_DIR)


def _claim(rank_dir: Path) -> IO[str]:
    """Lock the rank directory for this process: the lock file is locked before it gets its name,
    so a sweeper never sees it unlocked while its owner lives."""
    tmp = rank_dir / f".{LOCK_NAME}.{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, _PRIVATE_FILE)
    lock = os.fdopen(fd, "w")
    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    lock.write(f"{os.getpid()}\n")
    lock.flush()
    os.replace(tmp, rank_dir / LOCK_NAME)
    return lock  # held (open) for the life of this process's tier


def sweep_orphans(root: Path) -> list[Path]:
    """Remove the engine directories under root whose owners are gone; those removed. An engine's
    owners are gone when each of its rank directories has a lock file nobody holds, or, for a
    directory of an older release (no lock files), when the process its name starts with
    (`<pid>-...`, engine/core.py) no longer exists."""
    removed: list[Path] = []
    if not root.is_dir():
        return removed
    for engine in root.iterdir():
        if engine.is_dir() and not engine.is_symlink() and _abandoned(engine):
            shutil.rmtree(engine, ignore_errors=True)
            removed.append(engine)
    if removed:
        logger.info("KV tier: removed %d directories left by stopped engines", len(removed))
    return removed


def _abandoned(engine: Path) -> bool:
    ranks = [r for r in engine.glob("rank*") if r.is_dir() and not r.is_symlink()]
    if any((r / LOCK_NAME).exists() for r in ranks):
        return all(_orphaned(r) for r in ranks)
    # No lock anywhere: an engine starting now (its ranks lock before they write a block), or
    # an older release's, which wrote blocks without locks.
    pid = engine.name.split("-", 1)[0]
    wrote = any(any(r.glob(f"*{SUFFIX}")) for r in ranks)
    return wrote and pid.isdigit() and not _alive(int(pid))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):  # another user's process, or no such number
        return True
    return True


def _orphaned(rank_dir: Path) -> bool:
    """Whether the rank directory's owner is gone: its lock file can be locked now."""
    try:
        fd = os.open(rank_dir / LOCK_NAME, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return False
    with os.fdopen(fd) as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False  # held: its owner lives
        return True
