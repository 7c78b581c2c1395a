"""A replica's part in a disaggregated model: prefill or decode (engine/disagg.py over
torch.distributed pairs, workers/kv_collective.py, with the Ray object store as the fallback,
cluster/disagg_transport.py).

A prefill replica answers `LLMReplica.prefill(request)`: it runs the request to its first token
and replies with that token and the handle of the prompt blocks its ranks hold for pulls. A
decode replica's `generate(request, handoff)` takes the request resumed after that token, with the
handle, and loads the blocks instead of computing them.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

import ray

from cluster.disagg_transport import ObjectStoreTransport
from engine.core import EngineCore
from engine.disagg import DecodeSide, PhaseEngine, PrefillReply, PrefillSide, needs_decode
from scheduler.outputs import RequestOutput
from scheduler.request import EngineRequest
from workers.kv_collective import CollectiveTransport

PHASES = ("prefill", "decode")


@dataclass(frozen=True, slots=True)
class DisaggPhase:
    """Which phase a replica runs, and how long its decode steps wait for a transfer."""

    role: str
    transfer_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if self.role not in PHASES:
            raise ValueError(f"role: one of {PHASES}, got {self.role!r}")


def phase_engine(engine: EngineCore, phase: DisaggPhase | None) -> PhaseEngine | None:
    """The engine as its phase drives it (None: a replica of a colocated model)."""
    if phase is None:
        return None
    transport = kv_transport()
    if phase.role == "prefill":
        return PhaseEngine(engine, PrefillSide(engine, transport), None)
    return PhaseEngine(engine, None, DecodeSide(engine, transport, phase.transfer_timeout_s))


def kv_transport() -> CollectiveTransport:
    """Pulls over torch.distributed pairs between the replicas' ranks, through the object store
    where a pair cannot form. The pairs listen on loopback, so on a cluster of several machines
    each transfer is also put in the object store, for a decode replica on another machine."""
    machines = {n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}
    return CollectiveTransport(ObjectStoreTransport(), copy_to_fallback=len(machines) > 1)


def phase_stats(phase: PhaseEngine | None) -> dict[str, int]:
    """The KV transfers' figures of a replica's phase (empty for a colocated replica)."""
    if phase is None:
        return {}
    if phase.prefill is not None:
        sent = phase.prefill
        return {"kv_blocks_sent": sent.num_blocks_sent, "kv_bytes_sent": sent.num_bytes_sent}
    assert phase.decode is not None
    connector = phase.decode.connector
    return {
        "kv_blocks_received": connector.num_remote_loaded,
        "kv_blocks_recomputed": connector.num_remote_failed,
        "kv_bytes_received": phase.decode.received()[0],  # summed over the ranks
    }


async def prefill_on(
    phase: PhaseEngine, request: EngineRequest, stream: AsyncIterator[RequestOutput]
) -> PrefillReply:
    """Run the request's prefill through the replica's stream and collect the reply."""
    rid = request.request_id
    phase.prefills[rid] = request  # before the stream's first step adds it
    outs: list[RequestOutput] = []
    handle = None
    try:
        async for out in stream:
            outs.append(out)
    finally:
        phase.prefills.pop(rid, None)
        handle = phase.exports.pop(rid, None)
    last = outs[-1]
    continues = needs_decode(request, last, phase.engine.max_model_len)
    if handle is not None and not continues:
        assert phase.prefill is not None
        phase.prefill.release(handle)
        handle = None
    tokens = [t for out in outs for t in out.new_token_ids]
    logprobs = None
    if any(out.new_logprobs is not None for out in outs):
        logprobs = [lp for out in outs for lp in out.new_logprobs or []]
    prompt_logprobs = next((o.prompt_logprobs for o in outs if o.prompt_logprobs), None)
    whole = replace(
        last, new_token_ids=tokens, new_logprobs=logprobs, prompt_logprobs=prompt_logprobs
    )
    return PrefillReply(tokens, whole, continues, handle)
