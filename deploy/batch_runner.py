"""Runs one batch's lines with bounded concurrency, writing each result as it completes (no Ray).

A line is sent through `send(url, body)`, the ingress's own request path (deploy/batch_routes.py
passes the route of the batch's endpoint at the least urgent priority); the runner knows nothing
of HTTP. Each result is appended, fsynced, to the batch's output file (2xx) or error file (any
other status, or a malformed line) in OpenAI's batch output shape; its `id` names the input line,
so the files themselves record which lines are done. A runner started again on the same batch
(a restarted ingress) skips those lines: every line is answered exactly once. An flock on the
batch keeps two processes sharing `batch_dir` from running it at once.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import logging
import os
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deploy.batch_store import BatchState, BatchStore, NotFound

logger = logging.getLogger(__name__)

# The ingress's answer to one line: (HTTP status, JSON body).
Send = Callable[[str, dict[str, Any]], Awaitable[tuple[int, dict[str, Any]]]]
RETRY_STATUSES = (429, 503)  # the tenant is at its limit, or the model is busy: wait, retry
MAX_CUSTOM_ID_CHARS = 512
LINE_KEYS = {"custom_id", "method", "url", "body"}


@dataclass(slots=True)
class Line:
    index: int
    custom_id: str | None
    body: dict[str, Any] | None
    error: str | None  # why the line is malformed


def parse_line(raw: bytes, index: int, endpoint: str) -> Line:
    """One input line; a malformed one carries the reason (it becomes an error-file line)."""
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):
        return Line(index, None, None, "the line is not valid JSON")
    if not isinstance(data, dict):
        return Line(index, None, None, "the line must be a JSON object")
    cid = data.get("custom_id")
    if not isinstance(cid, str) or not 1 <= len(cid) <= MAX_CUSTOM_ID_CHARS:
        return Line(index, None, None, f"custom_id: a string of 1 to {MAX_CUSTOM_ID_CHARS} chars")
    if unknown := sorted(set(data) - LINE_KEYS):
        return Line(index, cid, None, f"{unknown[0][:64]}: unknown field of a batch line")
    if data.get("method") != "POST":
        return Line(index, cid, None, "method: must be POST")
    if data.get("url") != endpoint:
        return Line(index, cid, None, f"url: must be the batch's endpoint {endpoint}")
    if not isinstance(data.get("body"), dict):
        return Line(index, cid, None, "body: must be a JSON object")
    return Line(index, cid, data["body"], None)


def result_line(batch_id: str, line: Line, status: int | None, body: Any, error: Any) -> bytes:
    """OpenAI's batch output line; `id` ends with the input line's index."""
    response = None
    if status is not None:
        response = {"status_code": status, "request_id": secrets.token_hex(12), "body": body}
    row = {
        "id": f"batch_req_{batch_id.removeprefix('batch_')}_{line.index}",
        "custom_id": line.custom_id,
        "response": response,
        "error": error,
    }
    return (json.dumps(row) + "\n").encode()


def done_lines(path: Path) -> set[int]:
    """The input lines a result file answers; a torn last line (a crash mid-write) is cut off."""
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        with open(path, "r+b") as f:
            f.truncate(data.rfind(b"\n") + 1)
        data = data[: data.rfind(b"\n") + 1]
    return {int(json.loads(row)["id"].rsplit("_", 1)[1]) for row in data.splitlines()}


def _append(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


class BatchRunner:
    """One batch's lines, `in_flight` at a time, until done, cancelled or expired."""

    def __init__(
        self,
        store: BatchStore,
        owner: str,
        batch_id: str,
        send: Send,
        in_flight: int,
        retry_s: float = 0.5,
    ) -> None:
        self.store, self.owner, self.batch_id = store, owner, batch_id
        self.send, self.in_flight, self.retry_s = send, in_flight, retry_s
        self._write_lock = asyncio.Lock()
        self._cancelled = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()

    def cancel(self) -> None:
        """Stop taking lines and abandon those in flight (they are not written)."""
        self._cancelled.set()
        for task in self._tasks:
            task.cancel()

    async def run(self) -> BatchState | None:
        """Run (or resume) the batch; None when another process holds it."""
        lock_path = self.store.root / self.owner / "batches" / f"{self.batch_id}.lock"
        fd = os.open(lock_path, os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        try:
            return await self._run()
        finally:
            os.close(fd)  # releases the flock

    async def _run(self) -> BatchState:
        state = self.store.get_batch(self.owner, self.batch_id)
        if state.final:
            return state
        try:
            path = self.store.content_path(self.owner, state.input_file_id)
            lines = (await asyncio.to_thread(path.read_bytes)).splitlines()
        except (FileNotFoundError, NotFound):
            return await self._fail(state, "the input file was deleted before the batch ran")
        while lines and not lines[-1].strip():
            lines.pop()
        done = await asyncio.to_thread(self._done, state)
        state.total = len(lines)
        if state.status == "validating":
            state.mark("in_progress")
        await self._save(state)
        await self._run_lines(state, [(i, raw) for i, raw in enumerate(lines) if i not in done])
        return await self._finish(state)

    def _done(self, state: BatchState) -> set[int]:
        out = done_lines(self.store.content_path(self.owner, state.output_file_id))
        err = done_lines(self.store.content_path(self.owner, state.error_file_id))
        state.completed, state.failed = len(out), len(err)
        return out | err

    async def _run_lines(self, state: BatchState, todo: list[tuple[int, bytes]]) -> None:
        slots = asyncio.Semaphore(self.in_flight)
        for index, raw in todo:
            await slots.acquire()
            if await self._stopping(state):
                slots.release()
                break
            line = parse_line(raw, index, state.endpoint)
            task = asyncio.create_task(self._answer(state, line))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            task.add_done_callback(lambda _: slots.release())
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _stopping(self, state: BatchState) -> bool:
        """Cancelled here or by another ingress replica (the state on disk), or past its window."""
        if not self._cancelled.is_set():
            on_disk = await asyncio.to_thread(self.store.get_batch, self.owner, self.batch_id)
            if on_disk.status == "cancelling":
                self._cancelled.set()
        return self._cancelled.is_set() or time.time() > state.expires_at

    async def _answer(self, state: BatchState, line: Line) -> None:
        if line.error is not None:
            error = {"code": "invalid_request", "message": line.error}
            return await self._record(state, line, None, None, error)
        assert line.body is not None
        delay = self.retry_s
        while True:
            try:
                status, body = await self.send(state.endpoint, line.body)
            except Exception as exc:  # the route maps errors itself; this is a bug, on one line
                logger.exception("batch %s line %d failed", state.id, line.index)
                status, body = 500, {"error": {"message": type(exc).__name__}}
            if status not in RETRY_STATUSES or self._cancelled.is_set():
                break
            await asyncio.sleep(delay)  # waits for capacity: a batch never adds to an overload
            delay = min(delay * 2, 10.0)
        await self._record(state, line, status, body, None)

    async def _record(
        self, state: BatchState, line: Line, status: int | None, body: Any, error: Any
    ) -> None:
        ok = status is not None and 200 <= status < 300
        file_id = state.output_file_id if ok else state.error_file_id
        data = result_line(state.id, line, status, body, error)
        # Shielded: a cancel after the answer still writes it, so the counts match the files.
        await asyncio.shield(self._write(state, file_id, data, ok))

    async def _write(self, state: BatchState, file_id: str, data: bytes, ok: bool) -> None:
        async with self._write_lock:
            await asyncio.to_thread(_append, self.store.content_path(self.owner, file_id), data)
            if ok:
                state.completed += 1
            else:
                state.failed += 1
            await self._save(state)

    async def _save(self, state: BatchState) -> None:
        await asyncio.to_thread(self._save_unless_cancelled, state)

    def _save_unless_cancelled(self, state: BatchState) -> None:
        """Save, keeping a `cancelling` another replica wrote."""
        on_disk = self.store.get_batch(self.owner, self.batch_id)
        if on_disk.status == "cancelling" and not state.final:
            state.status, state.times = on_disk.status, {**state.times, **on_disk.times}
        self.store.save_batch(self.owner, state)

    async def _finish(self, state: BatchState) -> BatchState:
        async with self._write_lock:
            await asyncio.to_thread(self._done, state)  # the counts, from the files
            if self._cancelled.is_set():
                state.mark("cancelled")
            elif state.completed + state.failed < state.total:
                state.mark("expired")
            else:
                state.mark("finalizing")
                state.mark("completed")
            await asyncio.to_thread(self._publish, state)
            await asyncio.to_thread(self.store.save_batch, self.owner, state)
        return state

    def _publish(self, state: BatchState) -> None:
        for file_id, count, name in (
            (state.output_file_id, state.completed, "output"),
            (state.error_file_id, state.failed, "errors"),
        ):
            if count:
                self.store.publish(self.owner, file_id, f"{state.id}_{name}.jsonl")
            else:
                self.store.content_path(self.owner, file_id).unlink(missing_ok=True)

    async def _fail(self, state: BatchState, message: str) -> BatchState:
        state.errors = [{"code": "missing_input_file", "message": message, "line": None}]
        state.mark("failed")
        await asyncio.to_thread(self._publish, state)
        await asyncio.to_thread(self.store.save_batch, self.owner, state)
        return state
