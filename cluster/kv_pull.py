"""Peer-to-peer prefix pulls between the LLMReplicas of one deployment (router_kwargs.peer_pulls).

The fleet router (cluster/serve_router.py) puts a `PeerPull` in a request's keyword arguments
when it sends the request away from a replica that holds more of its prompt (router/peer_pull.py).
The replica that gets it (`ReplicaPulls.start`) weighs the pull with the cost model over its own
KV block size, then asks the peer for the blocks with a `PullCommand` through the deployment's own
handle, which the router in this process sends to exactly that replica (as a LoraCommand). The
peer exports them on its engine thread between steps (engine/peer_pull.py) into the Ray object
store (cluster/disagg_transport.py) and answers the transfer's handle; the request is then added
expecting it, and its step loads the blocks as a disaggregated decode replica loads a prefill's.

A request whose blocks this replica is already asking for (the router joined it to that pull, or
it names the same blocks) does not ask again (cluster/pull_asks.py): it waits for that ask's
answer, then the engine holds it until the first request's blocks land on the device, where it
finds them as a prefix hit (engine/peer_pull.py `JoiningEngine`); if the first pull fails, it
computes its prompt. Either way its tokens are the same.

Whatever goes wrong, the request computes its prompt: a peer that does not answer within
`pull_timeout_s`, fails, is itself, or has evicted the blocks since (it answers None); a
transfer lost or damaged on the way (the step's checks). Nothing stays held: the peer pins
nothing (it copied the blocks out), and the puller's expectation is released with its request.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from ray import serve

from cluster.disagg_transport import ObjectStoreTransport
from cluster.pull_asks import Ask, AsksInFlight
from engine.core import EngineCore
from engine.peer_pull import JoiningEngine, PeerPulls
from router.config import RoutingConfig
from router.peer_pull import PeerPull, PullCommand, PullCost
from scheduler.request import EngineRequest
from workers.kv_transfer import KVTransport, TransferHandle

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class PullCounts:
    """A replica's pulls so far (its stats)."""

    pulled: int = 0  # pulls whose transfer the request went on to load
    declined: int = 0  # the cost model said computing is cheaper
    failed: int = 0  # the peer did not answer in time, failed, or no longer held the blocks
    joined: int = 0  # requests that joined an ask in flight here instead of asking again
    exported: int = 0  # pulls this replica answered as the peer


def deployment_router_config() -> RoutingConfig | None:
    """The router settings of this replica's deployment (the request_router_kwargs its fleet
    routers get, checked by the app's config first); None under Serve's own router, or where the
    replica context carries no deployment config (a replica built outside a deployment)."""
    deployment = getattr(serve.get_replica_context(), "_deployment_config", None)
    router = getattr(deployment, "request_router_config", None)
    if router is None:
        return None
    try:
        return RoutingConfig.from_router_kwargs(router.request_router_kwargs)
    except ValueError:  # another router's settings
        return None


def replica_pulls(engine: EngineCore, replica: str) -> ReplicaPulls | None:
    """The replica's pulls when its deployment turns them on (call before the KV events are
    attached: it installs the connector the events follow); None otherwise, or when this engine
    cannot reach its ranks' KV caches."""
    config = deployment_router_config()
    if config is None or not config.peer_pulls:
        return None
    try:
        return ReplicaPulls(engine, replica, config)
    except ValueError as exc:
        logger.warning("replica %s takes no peer pulls: %s", replica, exc)
        return None


class ReplicaPulls:
    """One replica's pulls: those its requests make, and those its peers make of it."""

    def __init__(
        self,
        engine: EngineCore,
        replica: str,
        config: RoutingConfig,
        transport: KVTransport | None = None,
        ask: Callable[[PullCommand], Awaitable[Any]] | None = None,
    ) -> None:
        """transport and ask: how blocks travel and how a peer is asked for them (default: the
        Ray object store and this deployment's Serve handle; tests pass an in-process peer)."""
        transport = transport if transport is not None else ObjectStoreTransport()
        self.pulls = PeerPulls(engine, transport, config.pull_timeout_s)
        self.asks = AsksInFlight(config.pull_timeout_s)
        self._ask_peer = ask if ask is not None else self._ask_through_serve
        self.replica = replica
        self.timeout_s = config.pull_timeout_s
        self.cost = PullCost(
            config.pull_bytes_per_s, config.pull_fixed_s, config.prefill_tokens_per_s
        )
        self.block_size = engine.config.block_size
        self.block_bytes = engine.kv_bytes_per_token * self.block_size
        self.counts = PullCounts()
        self._peers: Any = None  # this deployment's handle, made on the first pull

    @property
    def engine(self) -> JoiningEngine:
        """The engine as the replica's loop drives it: requests named in its `handoffs` load
        their pulled blocks, those named in its `joins` wait for another's."""
        return self.pulls.engine

    async def start(self, request: EngineRequest, pull: PeerPull) -> bool:
        """Pull the blocks for request, or join the ask in flight here that moves them, before
        it is added; whether it will get them that way (else it computes its prompt)."""
        try:
            pull.check()  # unpickled without its constructor's checks
        except ValueError as exc:
            logger.warning("request %s: ignoring its pull: %s", request.request_id, exc)
            return False
        if pull.peer == self.replica:
            return False
        if not self.cost.pays(pull.num_blocks, self.block_size, self.block_bytes):
            self.counts.declined += 1
            return False
        ask = self.asks.find(pull)
        if ask is not None:
            return await self._join(request, ask)
        return await self._lead(request, pull)

    async def _lead(self, request: EngineRequest, pull: PeerPull) -> bool:
        """Ask the peer, those who join meanwhile waiting for the answer."""
        rid = request.request_id
        ask = self.asks.open(rid, pull)
        handle = None
        try:
            handle = await self._ask(pull)
            if handle is not None:  # named before the joined are woken: they find it pulling
                self.engine.phase.handoffs[rid] = handle
        finally:  # cancelled too: those waiting compute
            if not ask.answer.done():
                ask.answer.set_result(handle)
            if handle is None:
                self.asks.close(rid)
        if handle is None:
            self.counts.failed += 1
            return False
        self.counts.pulled += 1
        return True

    async def _join(self, request: EngineRequest, ask: Ask) -> bool:
        """Wait for ask's answer (shielded: this request's cancellation leaves it to the others);
        with a transfer, the engine holds the request until the leader's blocks land."""
        try:
            handle = await asyncio.wait_for(asyncio.shield(ask.answer), self.timeout_s)
        except asyncio.TimeoutError:
            handle = None
        if handle is None:
            self.counts.failed += 1
            return False
        self.engine.joins[request.request_id] = ask.leader
        self.counts.joined += 1
        return True

    async def _ask(self, pull: PeerPull) -> TransferHandle | None:
        """The peer's transfer of the blocks; None when it does not come within the timeout."""
        try:
            handle = await asyncio.wait_for(self._ask_peer(PullCommand(pull)), self.timeout_s)
        except Exception as exc:  # timed out, the peer died or refused, no handle: compute
            logger.warning("pull from %s failed: %r; computing instead", pull.peer, exc)
            return None
        return handle if isinstance(handle, TransferHandle) and handle.hashes else None

    async def _ask_through_serve(self, command: PullCommand) -> Any:
        """Ask the peer through this deployment's handle (the fleet router sends the command to
        exactly the peer); a timeout cancels the call."""
        response = self._handle().pull_command.remote(command)
        try:
            return await response
        except BaseException:
            response.cancel()
            raise

    def _handle(self) -> Any:
        if self._peers is None:
            context = serve.get_replica_context()
            self._peers = serve.get_deployment_handle(context.deployment, context.app_name)
        return self._peers

    def export(self, command: PullCommand) -> TransferHandle | None:
        """Send a peer the blocks it pulls; call on the engine thread between steps."""
        handle = self.pulls.source.export(command.pull.hashes, command.pull.first)
        self.counts.exported += handle is not None
        return handle

    def stats(self) -> dict[str, int]:
        source = self.pulls.source
        return {
            "peer_pulls": self.counts.pulled,
            "peer_pulls_declined": self.counts.declined,
            "peer_pulls_failed": self.counts.failed,
            "peer_pulls_joined": self.counts.joined,
            "peer_pulls_held": self.engine.num_held,
            "peer_pulls_exported": self.counts.exported,
            "peer_pull_blocks_received": self.pulls.sink.connector.num_remote_loaded,
            "peer_pull_blocks_recomputed": self.pulls.sink.connector.num_remote_failed,
            "peer_pull_bytes_sent": source.num_bytes_sent,
        }
