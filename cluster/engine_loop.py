"""EngineLoop: drives EngineCore.step() on a thread of its own and hands each step's outputs to an
event loop.

The event loop never blocks on the model, so a replica's streams, aborts and stats calls stay
responsive while a step runs.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from cluster.errors import EngineFailedError
from scheduler.lora_slots import UnknownLoraError
from scheduler.outputs import RequestOutput, SchedulerStats
from scheduler.request import EngineRequest

logger = logging.getLogger(__name__)

_ADD, _ABORT, _CALL, _STOP = "add", "abort", "call", "stop"


class EngineLoop:
    """Drives EngineCore.step() on one thread; requests and aborts arrive through an inbox."""

    def __init__(
        self,
        engine: Any,
        loop: asyncio.AbstractEventLoop,
        on_step: Callable[[list[RequestOutput], SchedulerStats], None],
        on_error: Callable[[str | None, BaseException], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.engine = engine
        self._clock = clock
        self._loop = loop
        self._on_step = on_step
        self._on_error = on_error
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self.failure: BaseException | None = None
        self._step_started_at: float | None = None  # None between steps
        # The first step compiles the TP broadcast graph and warms the kernels: it may take long
        # without being stuck, so only later steps count as stalls (step_timeout_s bounds it).
        self.warmed_up = False
        self.steps = 0  # steps taken, and the seconds spent inside them (bench/served_path.py)
        self.step_seconds = 0.0
        self._shutdown_engine = False
        self._thread = threading.Thread(target=self._run, name="raylm-engine-loop", daemon=True)
        self._thread.start()

    def add(self, request: EngineRequest) -> None:
        self._inbox.put((_ADD, request))

    def abort(self, request_ids: list[str]) -> None:
        self._inbox.put((_ABORT, request_ids))

    def call(self, fn: Callable[[Any], Any]) -> asyncio.Future:
        """Run fn(engine) on the engine thread between steps; the future resolves on the event
        loop."""
        future = self._loop.create_future()
        self._inbox.put((_CALL, (fn, future)))
        return future

    def stalled_for(self) -> float:
        """Seconds the step in progress has run (0 when idle, between steps, or in the first
        step)."""
        started = self._step_started_at
        return 0.0 if started is None or not self.warmed_up else self._clock() - started

    def stop(self, shutdown_engine: bool = False, wait: bool = True) -> None:
        """End the loop after the step in progress (then release the engine, if asked)."""
        self._shutdown_engine = shutdown_engine
        self._inbox.put((_STOP, None))
        if wait:
            self._thread.join(timeout=30)

    def _run(self) -> None:
        try:
            while self._apply_inbox(block=not self.engine.has_unfinished_requests()):
                if self.engine.has_unfinished_requests():
                    self._step_started_at = started = self._clock()
                    outputs = self.engine.step()
                    self._step_started_at = None
                    self.steps += 1
                    self.step_seconds += self._clock() - started
                    self.warmed_up = True
                    self._publish(outputs)
            if self._shutdown_engine:  # the replica is going away: the workers go with the loop
                self.engine.shutdown()
        except BaseException as exc:
            logger.exception("engine loop failed")
            self.failure = exc
            # Wrapped: a ValueError from deep in the engine must not reach clients as their 400.
            failure = EngineFailedError(f"engine failed: {exc!r}")
            self._loop.call_soon_threadsafe(self._on_error, None, failure)

    def _apply_inbox(self, block: bool) -> bool:
        """Apply queued commands (waiting for one when idle); False once told to stop."""
        try:
            kind, payload = self._inbox.get() if block else self._inbox.get_nowait()
        except queue.Empty:
            return True
        aborted: list[RequestOutput] = []
        while True:
            if kind == _STOP:
                return False
            self._apply(kind, payload, aborted)
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                break
        if aborted:  # freed blocks and shorter queues show up in stats without waiting for a step
            self._publish(aborted)
        return True

    def _apply(self, kind: str, payload: Any, aborted: list[RequestOutput]) -> None:
        """One command: add a request (its own error goes to its caller), run a call, or abort
        requests (their outputs join aborted)."""
        if kind == _ADD:
            try:
                self.engine.add_request(payload)
            except (ValueError, UnknownLoraError) as exc:  # this request's, not the engine's
                self._loop.call_soon_threadsafe(self._on_error, payload.request_id, exc)
        elif kind == _CALL:
            self._resolve(*payload)
        else:
            aborted.extend(self.engine.abort_requests(payload))

    def _resolve(self, fn: Callable[[Any], Any], future: asyncio.Future) -> None:
        try:
            result, error = fn(self.engine), None
        except Exception as exc:
            result, error = None, exc

        def settle() -> None:
            if future.done():
                return
            if error is None:
                future.set_result(result)
            else:
                future.set_exception(error)

        self._loop.call_soon_threadsafe(settle)

    def _publish(self, outputs: list[RequestOutput]) -> None:
        self._loop.call_soon_threadsafe(self._on_step, outputs, self.engine.stats())
