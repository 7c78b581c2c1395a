"""Requests in flight per tenant at one ingress: past the cap, a tenant's next request gets 429.

A request holds its tenant's place from the moment it is admitted (before its body is read, so a
slow body counts) until its answer is ready, or its stream ends or is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from deploy.errors import TooManyRequestsError


@dataclass(slots=True)
class TenantLimiter:
    """Counts each tenant's requests in flight; `limit` None counts without refusing."""

    limit: int | None
    retry_after_s: float
    in_flight: dict[str, int] = field(default_factory=dict)  # tenants with a request in flight

    def admit(self, tenant: str) -> Lease:
        """The tenant's lease on one more request in flight, or TooManyRequestsError."""
        count = self.in_flight.get(tenant, 0)
        if self.limit is not None and count >= self.limit:
            raise TooManyRequestsError(
                f"Too many requests in flight for this API key's tenant (at most {self.limit}); "
                "retry when one has finished.",
                self.retry_after_s,
            )
        self.in_flight[tenant] = count + 1
        return Lease(self, tenant)

    def release(self, tenant: str) -> None:
        left = self.in_flight[tenant] - 1
        if left:
            self.in_flight[tenant] = left
        else:
            del self.in_flight[tenant]


@dataclass(slots=True)
class Lease:
    """One request's place among its tenant's; released once, however often release is called."""

    limiter: TenantLimiter
    tenant: str
    held: bool = True

    def release(self) -> None:
        if self.held:
            self.held = False
            self.limiter.release(self.tenant)

    def hold(self, response: Response) -> Response:
        """`response`, with the lease released now, or, for a stream, when the stream ends."""
        if not isinstance(response, StreamingResponse):
            self.release()
            return response
        return _LeasedStream(response, self)


class _LeasedStream(StreamingResponse):
    """A stream that releases its lease when it ends, fails or is cancelled (a client gone)."""

    def __init__(self, stream: StreamingResponse, lease: Lease) -> None:
        super().__init__(
            stream.body_iterator,
            stream.status_code,
            headers=dict(stream.headers),
            media_type=stream.media_type,
            background=stream.background,
        )
        self.lease = lease

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.lease.release()
