"""OpenAI's Batch API (`/v1/files`, `/v1/batches`) as a route mixin of the ingress.

Files and batch state live on disk (deploy/batch_store.py, under `batch_dir`, one folder per key:
a key sees only its own, and another's answers 404); each batch runs in this ingress's event loop
(deploy/batch_runner.py). A line takes the ingress's own path: the route of the batch's endpoint
is called with the line's body as its request, under the batch owner's key, so it is
authorized, admitted, validated, capped and answered exactly as that request over HTTP would
be; its `priority` is the least urgent there is, so the engine serves interactive requests first,
and a line answered 429 or 503 waits and is retried. A restarted ingress resumes its unfinished
batches when it starts (the app's startup hook), and every route makes sure it has.

No `from __future__ import annotations`: FastAPI reads the route signatures at run time.
"""

import asyncio
import contextvars
import functools
import json
import logging
import re
import tempfile
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

from fastapi import Request
from fastapi.responses import FileResponse, JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field
from ray import serve
from starlette.datastructures import UploadFile

from deploy.batch_runner import BatchRunner
from deploy.batch_store import (
    ENDPOINTS,
    FILE_PREFIX,
    MAX_FILENAME_CHARS,
    BatchState,
    BatchStore,
    NotFound,
    QuotaExceeded,
    StoreLimits,
    TooLarge,
    check_id,
    owner_of,
    page,
)
from deploy.body import parse_body, read_body
from deploy.errors import (
    BadRequestError,
    NotFoundError,
    PayloadTooLargeError,
    error_body,
    error_response,
)
from deploy.http_app import app
from deploy.request_path import RequestPath
from scheduler.request import MAX_PRIORITY

logger = logging.getLogger(__name__)

# The route that answers each endpoint's lines (methods of the ingress).
ROUTES = {
    "/v1/chat/completions": "chat_completions",
    "/v1/completions": "completions",
    "/v1/embeddings": "embeddings",
    "/v1/responses": "responses",
}
FORM_OVERHEAD = 64 << 10  # a multipart body's boundaries and part headers, beyond the file
MAX_BATCH_BODY = 64 << 10
MAX_LIST = 10_000  # OpenAI's largest `limit` of a file list
MAX_BATCH_LIST = 100
_CONTROL = re.compile(r"[\x00-\x1f\x7f/\\]")


class BatchRequest(BaseModel):
    """POST /v1/batches."""

    model_config = ConfigDict(extra="forbid")

    input_file_id: str = Field(max_length=64)
    endpoint: Literal[ENDPOINTS]  # type: ignore[valid-type]
    completion_window: Literal["24h"]
    metadata: (
        dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]] | None
    ) = Field(default=None, max_length=16)


@dataclass(slots=True)
class BatchService:
    """This ingress's store and the batches it is running."""

    store: BatchStore
    runners: dict[str, BatchRunner] = field(default_factory=dict)
    tasks: set[asyncio.Task] = field(default_factory=set)


def _api_error(exc: Exception) -> Exception:
    """The store's errors as the HTTP layer's."""
    if isinstance(exc, NotFound):
        return NotFoundError(f"No such object: {str(exc)[:64]!r}", code="not_found")
    if isinstance(exc, TooLarge):
        return PayloadTooLargeError(str(exc), param="file")
    if isinstance(exc, QuotaExceeded):
        return BadRequestError(str(exc), param="file", code="storage_quota_exceeded")
    return exc


def _answers_store_errors(
    route: Callable[..., Awaitable[Response]],
) -> Callable[..., Awaitable[Response]]:
    """A files or batches route whose errors (the store's among them) answer as OpenAI error
    JSON; the wrapper keeps the route's name and signature, which FastAPI and Serve read."""

    @functools.wraps(route)
    async def answered(*args: Any, **kwargs: Any) -> Response:
        try:
            return await route(*args, **kwargs)
        except Exception as exc:
            return error_response(_api_error(exc))

    return answered


def _query(request: Request, allowed: tuple[str, ...]) -> dict[str, str]:
    """The query parameters, each named at most once, none beyond `allowed`."""
    items = request.query_params.multi_items()
    for name, _ in items:
        if name not in allowed:
            raise BadRequestError(f"{name[:64]}: unknown query parameter", param=name[:64])
    params = dict(items)
    if len(params) != len(items):
        raise BadRequestError("query: a parameter is given twice", param="query")
    return params


def _limit(params: dict[str, str], default: int, most: int) -> int:
    text = params.get("limit")
    if text is None:
        return default
    if not (text.isascii() and text.isdigit() and len(text) <= 9 and 1 <= int(text) <= most):
        raise BadRequestError(f"limit: an integer in [1, {most}], got {text[:32]!r}", "limit")
    return int(text)


def _after(params: dict[str, str]) -> str | None:
    after = params.get("after")
    if after is not None and len(after) > 64:
        raise BadRequestError("after: an id of at most 64 characters", param="after")
    return after


def _listed(items: list[Any], after: str | None, limit: int) -> JSONResponse:
    shown, more = page(items, after, limit)
    return JSONResponse(
        {
            "object": "list",
            "data": [item.as_openai() for item in shown],
            "first_id": shown[0].id if shown else None,
            "last_id": shown[-1].id if shown else None,
            "has_more": more,
        }
    )


async def _form_fields(request: Request, raw: bytes) -> tuple[str, UploadFile]:
    """The upload's `purpose` and `file`; any other part is a 400 naming it."""
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        body, sent = (b"" if sent else raw), True
        return {"type": "http.request", "body": body, "more_body": False}

    copy = Request(request.scope, receive)
    try:
        form = await copy.form(max_files=1, max_fields=4)
    except Exception as exc:  # malformed multipart, too many parts
        raise BadRequestError(f"file: not a valid multipart upload ({exc})"[:200], "file") from None
    for name in form:
        if name not in ("purpose", "file"):
            raise BadRequestError(f"{name[:64]}: unknown field of a file upload", name[:64])
    purpose, upload = form.get("purpose"), form.get("file")
    if purpose != "batch":
        raise BadRequestError(f"purpose: must be `batch`, got {str(purpose)[:32]!r}", "purpose")
    if not isinstance(upload, UploadFile):
        raise BadRequestError("file: missing; send the JSONL file as the `file` part", "file")
    return purpose, upload


def _filename(upload: UploadFile) -> str:
    return _CONTROL.sub("_", upload.filename or "batch.jsonl")[:MAX_FILENAME_CHARS]


class BatchRoutes(RequestPath):
    """Files, batches, and the lines of each batch run through the ingress's own routes."""

    _batch_service: BatchService | None = None

    def _batches(self) -> BatchService:
        """The store, created on first use; unfinished batches are resumed then."""
        if self._batch_service is None:
            c = self.config
            root = c.batch_dir or str(Path(tempfile.gettempdir()) / "raylm-batch")
            limits = StoreLimits(
                c.batch_max_file_bytes,
                c.batch_max_lines,
                c.batch_max_line_bytes,
                c.batch_quota_bytes,
                c.batch_max_files,
            )
            self._batch_service = BatchService(BatchStore(root, limits))
            for owner, state in self._batch_service.store.unfinished():
                logger.info("resuming batch %s (%s)", state.id, state.status)
                self._start_batch(owner, state.id)
        return self._batch_service

    def _owner(self, request: Request) -> tuple[str, BatchService]:
        return owner_of(self._authorize(request).key), self._batches()

    def _start_batch(self, owner: str, batch_id: str) -> None:
        service = self._batch_service
        assert service is not None
        key = self._key_of(owner)

        async def send(url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
            return await self._send_line(key, url, body)

        runner = BatchRunner(
            service.store, owner, batch_id, send, self.config.batch_lines_in_flight
        )
        service.runners[batch_id] = runner
        # A context of its own: the lines are not part of the request that created the batch
        # (Serve's request context would tie every line's replica call to that finished request).
        loop = asyncio.get_running_loop()
        task = contextvars.Context().run(loop.create_task, runner.run())
        service.tasks.add(task)
        task.add_done_callback(service.tasks.discard)
        task.add_done_callback(lambda t: _log_failure(t, batch_id))

    def _key_of(self, owner: str) -> str | None:
        """The key whose folder this is (None: no key, or one since removed: its lines get the
        keyless caller's answer)."""
        return next((k for k in self.table.keys if owner_of(k) == owner), None)

    async def _send_line(
        self, key: str | None, url: str, body: dict[str, Any]
    ) -> tuple[int, dict[str, Any]]:
        """One line through its endpoint's route, as the owner's request at the least urgent
        priority."""
        if body.get("stream"):
            return 400, error_body(
                "invalid_request_error", "stream: a batch line is answered whole", "stream"
            )
        raw = json.dumps({**body, "priority": MAX_PRIORITY}).encode()
        response = await getattr(self, ROUTES[url])(_line_request(url, raw, key))
        return response.status_code, await _json_of(response)

    # ---- files ---------------------------------------------------------------------------------
    @app.post("/v1/files")
    @_answers_store_errors
    async def create_file(self, request: Request) -> Response:
        owner, service = self._owner(request)
        limit = service.store.limits.max_file_bytes
        if not request.headers.get("content-type", "").startswith("multipart/form-data"):
            raise BadRequestError("file: upload as multipart/form-data", param="file")
        raw = await read_body(request, limit + FORM_OVERHEAD, self.config.request_body_timeout_s)
        _, upload = await _form_fields(request, raw)
        data = await upload.read(limit + 1)
        record = await asyncio.to_thread(
            service.store.add_file, owner, _filename(upload), "batch", data
        )
        return JSONResponse(record.as_openai())

    @app.get("/v1/files")
    @_answers_store_errors
    async def list_files(self, request: Request) -> Response:
        owner, service = self._owner(request)
        params = _query(request, ("purpose", "limit", "after", "order"))
        if params.get("order", "desc") not in ("asc", "desc"):
            raise BadRequestError("order: `asc` or `desc`", param="order")
        files = await asyncio.to_thread(service.store.list_files, owner)
        if "purpose" in params:
            files = [f for f in files if f.purpose == params["purpose"]]
        if params.get("order", "desc") == "desc":
            files.reverse()
        return _listed(files, _after(params), _limit(params, MAX_LIST, MAX_LIST))

    @app.get("/v1/files/{file_id}")
    @_answers_store_errors
    async def retrieve_file(self, request: Request, file_id: str) -> Response:
        owner, service = self._owner(request)
        return JSONResponse(service.store.get_file(owner, file_id).as_openai())

    @app.delete("/v1/files/{file_id}")
    @_answers_store_errors
    async def delete_file(self, request: Request, file_id: str) -> Response:
        owner, service = self._owner(request)
        await asyncio.to_thread(service.store.delete_file, owner, file_id)
        return JSONResponse({"id": file_id, "object": "file", "deleted": True})

    @app.get("/v1/files/{file_id}/content")
    @_answers_store_errors
    async def file_content(self, request: Request, file_id: str) -> Response:
        owner, service = self._owner(request)
        service.store.get_file(owner, file_id)
        path = service.store.content_path(owner, file_id)
        return FileResponse(path, media_type="application/jsonl")

    # ---- batches -------------------------------------------------------------------------------
    @app.post("/v1/batches")
    @_answers_store_errors
    async def create_batch(self, request: Request) -> Response:
        owner, service = self._owner(request)
        raw = await read_body(request, MAX_BATCH_BODY, self.config.request_body_timeout_s)
        body = await parse_body(raw, BatchRequest, self.config.max_messages)
        record = service.store.get_file(owner, check_id(body.input_file_id, FILE_PREFIX))
        if record.purpose != "batch":
            raise BadRequestError("input_file_id: not a `batch` file", "input_file_id")
        state = await asyncio.to_thread(
            service.store.new_batch, owner, body.endpoint, record.id, body.metadata
        )
        self._start_batch(owner, state.id)
        return JSONResponse(state.as_openai())

    @app.get("/v1/batches")
    @_answers_store_errors
    async def list_batches(self, request: Request) -> Response:
        owner, service = self._owner(request)
        params = _query(request, ("limit", "after"))
        batches = await asyncio.to_thread(service.store.list_batches, owner)
        return _listed(batches, _after(params), _limit(params, 20, MAX_BATCH_LIST))

    @app.get("/v1/batches/{batch_id}")
    @_answers_store_errors
    async def retrieve_batch(self, request: Request, batch_id: str) -> Response:
        owner, service = self._owner(request)
        return JSONResponse(service.store.get_batch(owner, batch_id).as_openai())

    @app.post("/v1/batches/{batch_id}/cancel")
    @_answers_store_errors
    async def cancel_batch(self, request: Request, batch_id: str) -> Response:
        owner, service = self._owner(request)
        state = await asyncio.to_thread(self._mark_cancelling, service, owner, batch_id)
        runner = service.runners.get(state.id)
        if runner is not None:
            runner.cancel()
        return JSONResponse(state.as_openai())

    def _mark_cancelling(self, service: BatchService, owner: str, batch_id: str) -> BatchState:
        """`cancelling` on disk (the runner, here or on another replica, ends it as cancelled)."""
        state = service.store.get_batch(owner, batch_id)
        if not state.final and state.status != "cancelling":
            state.mark("cancelling")
            service.store.save_batch(owner, state)
        return state


def _line_request(url: str, raw: bytes, key: str | None) -> Request:
    """A batch line as the HTTP request its route reads."""
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        body, sent = (b"" if sent else raw), True
        return {"type": "http.request", "body": body, "more_body": False}

    return Request(_line_scope(url, raw, key), receive)


def _line_scope(url: str, raw: bytes, key: str | None) -> dict[str, Any]:
    """The ASGI scope of a batch line's request: a local POST of JSON, with the batch's key."""
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]
    if key is not None:
        headers.append((b"authorization", f"Bearer {key}".encode()))
    return {
        "type": "http",
        "method": "POST",
        "path": url,
        "raw_path": url.encode(),
        "query_string": b"",
        "headers": headers,
        "client": ("127.0.0.1", 0),
        "server": ("127.0.0.1", 0),
        "scheme": "http",
        "http_version": "1.1",
    }


async def _json_of(response: Response) -> dict[str, Any]:
    if hasattr(response, "body_iterator"):  # a stream: not asked for, but read whole if sent
        chunks = [c if isinstance(c, bytes) else c.encode() async for c in response.body_iterator]
        return {"stream": b"".join(chunks).decode(errors="replace")}
    return json.loads(bytes(response.body))


def _log_failure(task: asyncio.Task, batch_id: str) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.error("batch %s stopped", batch_id, exc_info=task.exception())


_STARTING: set[asyncio.Task] = set()


async def _resume_on_start() -> None:
    """The app's startup hook: once Serve hands over the ingress, resume its batches."""
    task = asyncio.get_running_loop().create_task(_resume_when_ready())
    _STARTING.add(task)
    task.add_done_callback(_STARTING.discard)


async def _resume_when_ready() -> None:
    for _ in range(3000):  # bounded: 300 s for the replica to finish starting
        try:
            ingress = serve.get_replica_context().servable_object
        except Exception:  # not under Serve (the app used directly): nothing to resume
            return
        if ingress is not None:
            ingress._batches()  # type: ignore[attr-defined]
            return
        await asyncio.sleep(0.1)


app.router.add_event_handler("startup", _resume_on_start)
