"""The Batch API's files and batch state on disk (no Ray, no HTTP).

Layout under the configured `batch_dir`, one folder per owner (a hash of the caller's key, never
the key itself), every folder 0700 and every file 0600:

    <owner>/files/<file-id>.jsonl      the content (uploads, and each batch's output and errors)
    <owner>/files/<file-id>.json       its FileRecord; a file without one is not visible yet
    <owner>/batches/<batch-id>.json    its BatchState, replaced atomically (write, fsync, rename)

A batch's output and error files are written line by line as lines complete; they are the
record of which lines are done (each result's `id` names its input line), so a restarted ingress
answers every line exactly once (deploy/batch_runner.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

FILE_PREFIX = "file-"
BATCH_PREFIX = "batch_"
_ID = re.compile(r"^(file-|batch_)[0-9a-f]{24}$")
FINAL = ("completed", "failed", "expired", "cancelled")
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")
WINDOW_S = 24 * 3600  # completion_window "24h", the one OpenAI offers
MAX_FILENAME_CHARS = 255


class NotFound(LookupError):
    """No such file or batch for this owner (another owner's is not found either)."""


class TooLarge(ValueError):
    """A file past the byte cap (413)."""


class QuotaExceeded(ValueError):
    """The key keeps as many files, or bytes, as it may."""


@dataclass(slots=True)
class StoreLimits:
    max_file_bytes: int
    max_lines: int
    max_line_bytes: int
    quota_bytes: int
    max_files: int


@dataclass(slots=True)
class FileRecord:
    id: str
    bytes: int
    created_at: int
    filename: str
    purpose: str  # batch, batch_output
    created_ns: int = 0  # the listing's order (created_at is whole seconds)

    def as_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "file",
            "bytes": self.bytes,
            "created_at": self.created_at,
            "filename": self.filename,
            "purpose": self.purpose,
            "status": "processed",
            "expires_at": None,
            "status_details": None,
        }


@dataclass(slots=True)
class BatchState:
    id: str
    endpoint: str
    input_file_id: str
    output_file_id: str  # assigned at creation, shown once the batch ends
    error_file_id: str
    created_at: int
    expires_at: int
    status: str = "validating"
    completion_window: str = "24h"
    total: int = 0
    completed: int = 0
    failed: int = 0
    metadata: dict[str, str] | None = None
    errors: list[dict[str, Any]] = field(default_factory=list)  # batch-level (missing input)
    times: dict[str, int] = field(default_factory=dict)  # in_progress_at, completed_at, ...
    created_ns: int = 0  # the listing's order (created_at is whole seconds)

    @property
    def final(self) -> bool:
        return self.status in FINAL

    def mark(self, status: str, now: int | None = None) -> None:
        """Enter `status`, stamping its `<status>_at` (OpenAI's names)."""
        self.status = status
        at = {"finalizing": "finalizing_at", "cancelling": "cancelling_at"}.get(status)
        at = at or {"in_progress": "in_progress_at"}.get(status) or f"{status}_at"
        self.times[at] = int(time.time()) if now is None else now

    def as_openai(self) -> dict[str, Any]:
        ended = self.final
        stamps = ("in_progress", "finalizing", "completed", "failed", "expired", "cancelling")
        return {
            "id": self.id,
            "object": "batch",
            "endpoint": self.endpoint,
            "errors": {"object": "list", "data": self.errors} if self.errors else None,
            "input_file_id": self.input_file_id,
            "completion_window": self.completion_window,
            "status": self.status,
            "output_file_id": self.output_file_id if ended and self.completed else None,
            "error_file_id": self.error_file_id if ended and self.failed else None,
            "created_at": self.created_at,
            **{f"{s}_at": self.times.get(f"{s}_at") for s in stamps},
            "cancelled_at": self.times.get("cancelled_at"),
            "expires_at": self.expires_at,
            "request_counts": {
                "total": self.total,
                "completed": self.completed,
                "failed": self.failed,
            },
            "metadata": self.metadata,
        }


def owner_of(key: str | None) -> str:
    """The folder of a key's files: a hash, so the key is never written to disk."""
    if key is None:
        return "anonymous"
    return hashlib.sha256(key.encode()).hexdigest()[:32]


def new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


def check_id(value: str, prefix: str) -> str:
    """An id of ours, or NotFound: no other string ever reaches a path."""
    if not _ID.match(value) or not value.startswith(prefix):
        raise NotFound(value[:64])
    return value


def count_lines(data: bytes, limits: StoreLimits) -> int:
    """The lines of an upload, within the caps (a ValueError naming `file` when not)."""
    if not data.strip():
        raise ValueError("file: empty; a batch input file holds one JSON request per line")
    lines = data.splitlines()
    while lines and not lines[-1].strip():
        lines.pop()
    if len(lines) > limits.max_lines:
        raise ValueError(f"file: {len(lines)} lines, at most {limits.max_lines}")
    longest = max(len(line) for line in lines)
    if longest > limits.max_line_bytes:
        raise ValueError(f"file: a line of {longest} bytes, at most {limits.max_line_bytes}")
    return len(lines)


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


class BatchStore:
    """Files and batch state under one root, per owner."""

    def __init__(self, root: str | Path, limits: StoreLimits) -> None:
        self.root = Path(root)
        self.limits = limits
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)

    def _dir(self, owner: str, kind: str) -> Path:
        path = self.root / owner / kind
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        return path

    # ---- files ---------------------------------------------------------------------------------
    def add_file(self, owner: str, filename: str, purpose: str, data: bytes) -> FileRecord:
        """Store an upload after its caps and the owner's quota are checked."""
        if len(data) > self.limits.max_file_bytes:
            raise TooLarge(f"file: {len(data)} bytes, at most {self.limits.max_file_bytes}")
        count_lines(data, self.limits)
        self.reserve(owner, len(data))
        now = time.time_ns()
        record = FileRecord(new_id(FILE_PREFIX), len(data), now // 10**9, filename, purpose, now)
        _write_atomic(self.content_path(owner, record.id), data)
        self._save_file(owner, record)
        return record

    def reserve(self, owner: str, num_bytes: int) -> None:
        """Room for one more file of num_bytes in the owner's quota, or a ValueError."""
        records = self.list_files(owner)
        used = sum(r.bytes for r in records)
        if len(records) + 1 > self.limits.max_files:
            raise QuotaExceeded(
                f"file: the key keeps {len(records)} files, at most {self.limits.max_files}; "
                "delete some first"
            )
        if used + num_bytes > self.limits.quota_bytes:
            raise QuotaExceeded(
                f"file: {used} bytes stored + {num_bytes} exceeds the key's quota of "
                f"{self.limits.quota_bytes} bytes; delete files first"
            )

    def _save_file(self, owner: str, record: FileRecord) -> None:
        meta = self._dir(owner, "files") / f"{record.id}.json"
        _write_atomic(meta, json.dumps(asdict(record)).encode())

    def content_path(self, owner: str, file_id: str) -> Path:
        return self._dir(owner, "files") / f"{check_id(file_id, FILE_PREFIX)}.jsonl"

    def get_file(self, owner: str, file_id: str) -> FileRecord:
        meta = self._dir(owner, "files") / f"{check_id(file_id, FILE_PREFIX)}.json"
        try:
            return FileRecord(**json.loads(meta.read_bytes()))
        except FileNotFoundError:
            raise NotFound(file_id) from None

    def list_files(self, owner: str) -> list[FileRecord]:
        """The owner's visible files, oldest first."""
        records = [
            FileRecord(**json.loads(p.read_bytes()))
            for p in self._dir(owner, "files").glob("file-*.json")
        ]
        return sorted(records, key=lambda r: (r.created_ns, r.id))

    def delete_file(self, owner: str, file_id: str) -> None:
        self.get_file(owner, file_id)
        (self._dir(owner, "files") / f"{file_id}.json").unlink(missing_ok=True)
        self.content_path(owner, file_id).unlink(missing_ok=True)

    def publish(self, owner: str, file_id: str, filename: str) -> FileRecord:
        """Make a batch's output (or error) file visible, counted in the owner's quota."""
        size = self.content_path(owner, file_id).stat().st_size
        now = time.time_ns()
        record = FileRecord(file_id, size, now // 10**9, filename, "batch_output", now)
        self._save_file(owner, record)
        return record

    # ---- batches -------------------------------------------------------------------------------
    def new_batch(self, owner: str, endpoint: str, input_file_id: str, metadata: Any) -> BatchState:
        now_ns = time.time_ns()
        now = now_ns // 10**9
        state = BatchState(
            id=new_id(BATCH_PREFIX),
            endpoint=endpoint,
            input_file_id=input_file_id,
            output_file_id=new_id(FILE_PREFIX),
            error_file_id=new_id(FILE_PREFIX),
            created_at=now,
            expires_at=now + WINDOW_S,
            metadata=metadata,
            created_ns=now_ns,
        )
        for file_id in (state.output_file_id, state.error_file_id):
            fd = os.open(self.content_path(owner, file_id), os.O_CREAT | os.O_WRONLY, 0o600)
            os.close(fd)
        self.save_batch(owner, state)
        return state

    def save_batch(self, owner: str, state: BatchState) -> None:
        path = self._dir(owner, "batches") / f"{state.id}.json"
        _write_atomic(path, json.dumps(asdict(state)).encode())

    def get_batch(self, owner: str, batch_id: str) -> BatchState:
        path = self._dir(owner, "batches") / f"{check_id(batch_id, BATCH_PREFIX)}.json"
        try:
            return _batch_of(json.loads(path.read_bytes()))
        except FileNotFoundError:
            raise NotFound(batch_id) from None

    def list_batches(self, owner: str) -> list[BatchState]:
        """The owner's batches, newest first (OpenAI's order)."""
        states = [
            _batch_of(json.loads(p.read_bytes()))
            for p in self._dir(owner, "batches").glob("batch_*.json")
        ]
        return sorted(states, key=lambda s: (s.created_ns, s.id), reverse=True)

    def unfinished(self) -> list[tuple[str, BatchState]]:
        """Every owner's batches that have not ended: what a restarted ingress resumes."""
        found = []
        for owner_dir in sorted(p for p in self.root.iterdir() if p.is_dir()):
            for state in self.list_batches(owner_dir.name):
                if not state.final:
                    found.append((owner_dir.name, state))
        return found


def _batch_of(data: dict[str, Any]) -> BatchState:
    known = {f.name for f in fields(BatchState)}
    return BatchState(**{k: v for k, v in data.items() if k in known})


def page(items: list[Any], after: str | None, limit: int) -> tuple[list[Any], bool]:
    """OpenAI's cursor pagination: the items after the one whose id is `after`, at most `limit`,
    and whether more follow."""
    if after is not None:
        ids = [item.id for item in items]
        items = items[ids.index(after) + 1 :] if after in ids else []
    return items[:limit], len(items) > limit
