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
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence

from engine.core import EngineCore
from engine.disagg import DecodeSide, PhaseEngine, Ranks
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
    loop drives it (a PhaseEngine whose decode side loads the transfers named in `handoffs`)."""

    def __init__(self, engine: EngineCore, transport: KVTransport, timeout_s: float) -> None:
        self.source = PeerSource(engine, transport)
        self.sink = DecodeSide(engine, transport, timeout_s)
        self.engine = PhaseEngine(engine, None, self.sink)
