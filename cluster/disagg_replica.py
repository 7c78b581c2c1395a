"""A replica's part in a disaggregated model: prefill or decode (engine/disagg.py over the
transport `kv_transport` picks: the Ray object store, cluster/disagg_transport.py, or
torch.distributed pairs, workers/kv_collective.py, with the object store as their fallback).

A prefill replica answers `LLMReplica.prefill(request)`: it runs the request to its first token
and replies with that token and the handle of the prompt blocks it sent. A decode replica's
`generate(request, handoff)` takes the request resumed after that token, with the handle, and
loads the blocks instead of computing them.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

import ray

from cluster.disagg_transport import ObjectStoreTransport
from cluster.kv_transports import KV_TRANSPORTS
from engine.core import EngineCore
from engine.disagg import DecodeSide, PhaseEngine, PrefillSide, needs_decode
from engine.disagg_reply import PrefillReply
from scheduler.outputs import RequestOutput
from scheduler.request import EngineRequest
from settings import shown
from workers.kv_collective import CollectiveTransport
from workers.kv_transfer import KVTransport

PHASES = ("prefill", "decode")
# Where a payload's bytes are: read_blocks stages every payload in host memory (a numpy array,
# where the checksums are taken), whatever the engine's device, so today a pair would move them
# over gloo, never NCCL.
PAYLOAD_DEVICE = "cpu"


@dataclass(frozen=True, slots=True)
class DisaggPhase:
    """Which phase a replica runs, how long its decode steps wait for a transfer, and how the KV
    moves (`KV_TRANSPORTS`)."""

    role: str
    transfer_timeout_s: float = 10.0
    kv_transport: str = "auto"

    def __post_init__(self) -> None:
        if self.role not in PHASES:
            raise ValueError(f"role: one of {PHASES}, got {self.role!r}")
        _check_choice(self.kv_transport)


def phase_engine(engine: EngineCore, phase: DisaggPhase | None) -> PhaseEngine | None:
    """The engine as its phase drives it (None: a replica of a colocated model)."""
    if phase is None:
        return None
    transport = kv_transport(phase.kv_transport)
    if phase.role == "prefill":
        return PhaseEngine(engine, PrefillSide(engine, transport), None)
    return PhaseEngine(engine, None, DecodeSide(engine, transport, phase.transfer_timeout_s))


def transport_choice(choice: str, payload_device: str, machines: int) -> str:
    """What `choice` means for payloads on `payload_device` in a cluster of `machines` machines:
    "object_store" or "collective"."""
    _check_choice(choice)
    if choice != "auto":
        return choice
    # bench/results/2026-11-29-kv-collectives.md: on one machine the store's get maps the sender's
    # shared memory while a gloo pair sends every byte over loopback TCP; the store's round trip
    # was the faster in 3 of 4 host-memory cases (16 and 64 blocks, batched or one by one), its
    # receive in all. Across machines the pairs (on loopback) cannot connect, so each transfer
    # would be paid twice (the offer and the store's copy). NCCL pairs between CUDA tensors on one
    # machine are what the pairs are for (not measured: no GPU run yet).
    on_cuda = payload_device.split(":")[0] == "cuda"
    return "collective" if on_cuda and machines == 1 else "object_store"


def kv_transport(
    choice: str = "auto", payload_device: str = PAYLOAD_DEVICE, machines: int | None = None
) -> KVTransport:
    """The replica's transport for `choice` (`KV_TRANSPORTS`); machines: the live machines of
    the Ray cluster (None: asked of Ray). Collective pairs listen on loopback, so on a cluster of
    several machines each transfer is also put in the object store, for a decode replica on
    another machine."""
    if machines is None:
        machines = len({n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]})
    if transport_choice(choice, payload_device, machines) == "object_store":
        return ObjectStoreTransport()
    return CollectiveTransport(ObjectStoreTransport(), copy_to_fallback=machines > 1)


def _check_choice(choice: object) -> None:
    if choice not in KV_TRANSPORTS:
        raise ValueError(f"kv_transport: one of {list(KV_TRANSPORTS)}, got {shown(choice)}")


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
    whole = _merged(outs)
    return PrefillReply(whole.new_token_ids, whole, continues, handle)


def _merged(outs: list[RequestOutput]) -> RequestOutput:
    """A prefill's outputs as one: the last, with every token and log-probability."""
    tokens = [t for out in outs for t in out.new_token_ids]
    logprobs = None
    if any(out.new_logprobs is not None for out in outs):
        logprobs = [lp for out in outs for lp in out.new_logprobs or []]
    prompt_logprobs = next((o.prompt_logprobs for o in outs if o.prompt_logprobs), None)
    return replace(
        outs[-1], new_token_ids=tokens, new_logprobs=logprobs, prompt_logprobs=prompt_logprobs
    )
