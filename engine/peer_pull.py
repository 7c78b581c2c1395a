"""Peer-to-peer prefix pulls, engine side: a replica sends a peer the device blocks it asks for by
hash, and loads the blocks it pulled itself through the KV connector, as a disaggregated decode
engine loads a prefill's (engine/disagg.py, scheduler/kv_remote.py).

- Source (`PeerSource.export`): on the engine thread between steps, the leading run of the asked
  hashes still in the device prefix cache is read on every rank and sent through the transport.
  The read copies the blocks to the host, so nothing stays pinned here: the pool may evict them
  the next step. Blocks evicted since the router saw them are not sent (the run is cut there).
- Puller (`DecodeSide`): the request is added expecting the transfer; the scheduler continues its
  device hit through the blocks that arrive (LOADING_KV), checks each against its hash, layout
  and checksum, and computes the rest. Blocks are keyed by the chained hash, so the KV is exactly
  what the prefill would have computed; a pull that fails, times out or comes back short is
  computed, and `RemoteKVConnector.release` frees the expectation whatever happens.
- Joins (`JoiningEngine`): a request that joined another's pull in flight on this replica (the
  replica names its leader in `joins`) is held back, outside the scheduler, until the leader's
  pull is over: its blocks landed on the device (then the joined request finds them as a prefix
  hit), or it failed, was aborted or the hold timed out (then it computes). Admitted earlier, as
  soon as the blocks reached the receive buffer, it would load a second copy beside the leader's
  in the same step (the simulator measured it: bench/results/2026-11-29-sim-fleet-kv.md).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from engine.core import EngineCore
from engine.disagg import DecodeSide, PhaseEngine, Ranks
from scheduler.kv_remote import RemoteKVConnector
from scheduler.outputs import RequestOutput
from scheduler.request import EngineRequest
from workers import kv_ranks
from workers.kv_transfer import KVTransport, TransferHandle

logger = logging.getLogger(__name__)

SETTING = "router_kwargs.peer_pulls"


class PeerSource:
    """A replica's end as a peer: sends the blocks a puller names."""

    def __init__(self, engine: EngineCore, transport: KVTransport) -> None:
        config = engine.config  # refused as disaggregation refuses them (deploy/disagg_config.py)
        if config.pipeline_parallel_size > 1:
            raise ValueError(
                f"{SETTING}: KV moves rank to rank by tensor-parallel shard; pipeline stages "
                "hold a share of the layers each, which transfers do not lay out yet"
            )
        if config.tensor_parallel_size > 1 and config.step_transport == "compiled_graph":
            raise ValueError(
                f"{SETTING}: each rank sends or receives its own KV shard between steps, which "
                "compiled_graph workers cannot do"
            )
        self.ranks = Ranks(engine, SETTING)
        self.engine = engine
        self.transport = transport
        self.num_exports = 0
        self.num_blocks_sent = 0
        self.num_bytes_sent = 0

    def cached_run(self, hashes: Sequence[int]) -> list[int]:
        """The device blocks of the leading hashes still in the prefix cache, in a row."""
        return self.engine.scheduler.kv.pool.cached_run(hashes)

    def export(self, hashes: Sequence[int], first: int) -> TransferHandle | None:
        """Send blocks first.. of the leading run of `hashes` the device cache still holds; call
        on the engine thread between steps. None: nothing past `first` is held any more, or a
        rank failed to send (the puller computes its prompt)."""
        blocks = self.cached_run(hashes)[first:]
        if not blocks:
            return None
        sent_hashes = list(hashes[first : first + len(blocks)])
        try:
            sent = self.ranks(kv_ranks.export, self.transport, sent_hashes, blocks)
        except Exception as exc:  # the peer's request goes on computing, never fails for it
            logger.warning("peer pull: export of %d blocks failed: %r", len(blocks), exc)
            return None
        self.num_exports += 1
        self.num_blocks_sent += len(blocks)
        self.num_bytes_sent += sum(n for _, n in sent)
        if len(sent) == 1:
            return sent[0][0]
        return TransferHandle(uuid.uuid4().hex, sent_hashes, shards=[h for h, _ in sent])


class PeerPulls:
    """Both ends of a replica's pulls: the source its peers pull from, and the engine as its
    loop drives it (a PhaseEngine whose decode side loads the transfers named in `handoffs`,
    behind the JoiningEngine that holds the requests named in `joins`)."""

    def __init__(self, engine: EngineCore, transport: KVTransport, timeout_s: float) -> None:
        self.source = PeerSource(engine, transport)
        self.sink = DecodeSide(engine, transport, timeout_s)
        self.engine = JoiningEngine(
            PhaseEngine(engine, None, self.sink), self.sink.connector, timeout_s
        )


@dataclass(slots=True)
class _Held:
    """A joined request held back until its leader's pull is over, or until `deadline`."""

    request: EngineRequest
    leader: str
    deadline: float


class JoiningEngine:
    """The PhaseEngine that loads a replica's pulls, in the shape the replica's engine loop drives
    (add_request, step, abort_requests, has_unfinished_requests; everything else is the phase
    engine's), holding back the requests named in `joins` while their leader still pulls. Call
    on the engine thread, except `pulling` (a membership test, safe from the event loop)."""

    def __init__(
        self,
        phase: PhaseEngine,
        connector: RemoteKVConnector,
        timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.phase = phase
        self.connector = connector
        self.timeout_s = timeout_s
        self.clock = clock
        # request id -> the request whose pull it joined; set by the replica before it adds it
        self.joins: dict[str, str] = {}
        self.held: dict[str, _Held] = {}  # at most one per request in flight on the replica
        self.num_held = 0  # joined requests that waited for their leader's blocks

    def pulling(self, leader: str) -> bool:
        """Whether leader's pull is still on its way: its transfer not yet added, or expected and
        not landed (the connector forgets it when it lands, fails or its request ends)."""
        return leader in self.phase.handoffs or leader in self.connector.expected

    def add_request(self, request: EngineRequest) -> None:
        rid = request.request_id
        leader = self.joins.pop(rid, None)
        if leader is not None and leader != rid and self.pulling(leader):
            self.held[rid] = _Held(request, leader, self.clock() + self.timeout_s)
            self.num_held += 1
            return
        self.phase.add_request(request)

    def step(self) -> list[RequestOutput]:
        return self.phase.step() + self._release()

    def has_unfinished_requests(self) -> bool:
        return bool(self.held) or self.phase.engine.has_unfinished_requests()

    def abort_requests(self, request_ids: list[str]) -> list[RequestOutput]:
        outputs = []
        for rid in request_ids:
            self.joins.pop(rid, None)
            held = self.held.pop(rid, None)
            if held is not None:
                n = len(held.request.prompt_token_ids)
                outputs.append(RequestOutput(rid, [], True, "abort", num_prompt_tokens=n))
        outputs += self.phase.abort_requests(request_ids)
        return outputs + self._release()  # an aborted leader's joined requests go on computing

    def _release(self) -> list[RequestOutput]:
        """Add the held requests whose leader's pull is over (or whose hold timed out); the
        error outputs of those the engine refuses (a request's own error, never the engine's)."""
        if not self.held:
            return []
        now, errors = self.clock(), []
        for rid, held in list(self.held.items()):
            if self.pulling(held.leader) and held.deadline > now:
                continue
            del self.held[rid]
            try:
                self.phase.add_request(held.request)
            except (ValueError, LookupError) as exc:  # as the engine loop's add (UnknownLoraError)
                n = len(held.request.prompt_token_ids)
                errors.append(RequestOutput(rid, [], True, "error", n, error=str(exc)))
        return errors

    def __getattr__(self, name: str) -> object:
        return getattr(self.phase, name)
