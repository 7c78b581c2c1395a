"""One choice of a disaggregated model: its prefill on a prefill replica, then its decode on a
decode replica, as one stream of RequestOutputs (what a colocated replica's generate streams).

Both calls go through the fleet router of their deployment: the prefill replica and then the
decode replica are each chosen by load and by the prompt prefix they already hold. A prefill that
fails with its replica (dead, failed, draining) is not a lost request: the decode replica computes
the prompt itself. A transfer that fails is the decode replica's to recompute.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from ray.exceptions import ActorUnavailableError, RayActorError

from cluster.errors import EngineFailedError, ReplicaDrainingError
from cluster.tracing import TraceContext
from engine.disagg_reply import PrefillReply, decode_request
from scheduler.outputs import RequestOutput
from scheduler.request import EngineRequest

logger = logging.getLogger(__name__)

_PREFILL_LOST = (RayActorError, ActorUnavailableError, EngineFailedError, ReplicaDrainingError)


class DisaggResponse:
    """Prefill, then decode; iterates like a streaming DeploymentResponse and cancels like one."""

    def __init__(
        self, prefill: Any, decode: Any, request: EngineRequest, trace: TraceContext | None = None
    ) -> None:
        self.prefill = prefill
        self.decode = decode
        self.request = request
        # A traced request's context: both replicas' spans go under its attempt.
        self.trace = trace
        self._decoding: Any = None

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._outputs()

    async def _outputs(self) -> AsyncIterator[RequestOutput]:
        request = self.request
        reply = await self._prefill()
        handle = None
        if reply is not None:
            out = reply.output
            final = not reply.continues and out.finish_reason != "abort"
            yield replace(out, finished=final, finish_reason=out.finish_reason if final else None)
            if final:
                return
            request = decode_request(request, reply.token_ids)
            handle = reply.handle
        self._decoding = self.decode.options(stream=True).generate.remote(
            request, handle, self.trace
        )
        async for out in self._decoding:
            yield out

    async def _prefill(self) -> PrefillReply | None:
        try:
            reply: PrefillReply = await self.prefill.prefill.remote(self.request, self.trace)
        except _PREFILL_LOST as exc:
            logger.warning(
                "request %s: its prefill replica failed (%s); the decode replica computes the "
                "prompt",
                self.request.request_id,
                type(exc).__name__,
            )
            return None
        return reply

    def cancel(self) -> None:
        if self._decoding is not None:
            self._decoding.cancel()
