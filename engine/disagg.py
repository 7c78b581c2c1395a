"""Prefill/decode disaggregation, engine side: a prefill engine computes a prompt and its first
token and exports the prompt's full blocks by hash; a decode engine receives them through the KV
connector (scheduler/kv_remote.py) and goes on decoding.

- Prefill: the request runs with one output token (`prefill_request`). Right after the step that
  finished it, its prompt blocks are still in the device prefix cache: `PrefillSide.export` reads
  the leading ones still cached (by hash, so never another prompt's KV) and sends them through the
  transport.
- Decode: `DecodeSide.add` tells the connector which blocks arrive through which transfer, then
  adds the request resumed after its first token (as a migrated request is: prompt + emitted
  tokens, the rest of max_tokens, sampling keyed by output position). The scheduler reserves its
  slots and holds it in LOADING_KV while the step copies the blocks in; a block that does not
  arrive intact is recomputed.

Under tensor parallelism each rank sends and receives its own KV heads (workers/kv_ranks.py): the
prefill's rank r sends its shard, the handle carries one per rank, and each decode rank fetches
the shards that hold its heads (its namesake's at the same size; at another size it joins or cuts
heads, workers/kv_reshard.py); a block that fails on any rank is recomputed on all of them (the
runner's `_load_kv`), so the ranks never hold different KV.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, TypeVar

from engine.core import EngineCore
from engine.disagg_reply import decode_request as decode_request  # its home before; tests use it
from engine.executor import LocalExecutor
from scheduler.block_manager import hash_prompt_blocks
from scheduler.kv_remote import RemoteKVConnector
from scheduler.outputs import RequestOutput
from scheduler.request import EngineRequest
from workers import kv_ranks
from workers.kv_transfer import KVPayload, KVReceiver, KVTransport, TransferHandle, read_blocks

logger = logging.getLogger(__name__)

# How long a decode step waits for a transfer before it recomputes instead.
DEFAULT_TRANSFER_TIMEOUT_S = 10.0
# How long the engine waits for its ranks' part of a transfer (a read and a put, a handle).
RANK_CALL_TIMEOUT_S = 60.0

T = TypeVar("T")


class Ranks:
    """The engine's tensor-parallel ranks, for the work each does on its own KV heads
    (workers/kv_ranks.py): the in-process runner, or the Ray workers (through the executor's
    `call_ranks`)."""

    def __init__(self, engine: EngineCore, field_name: str) -> None:
        call = getattr(engine.executor, "call_ranks", None)
        if call is None:
            raise ValueError(f"{field_name}: this executor cannot reach its ranks' KV caches")
        if not engine.config.scheduler.enable_prefix_caching:
            raise ValueError(f"{field_name}: disaggregation needs enable_prefix_caching")
        self.call_ranks: Callable[..., list[Any]] = call
        self.local = isinstance(engine.executor, LocalExecutor)

    def __call__(self, fn: Callable[..., T], *args: Any) -> list[T]:
        """fn(*args, runner) on every rank, by rank."""
        return self.call_ranks(partial(fn, *args), RANK_CALL_TIMEOUT_S)


def prefill_request(request: EngineRequest) -> EngineRequest:
    """The request as the prefill engine runs it: the prompt and one more output token."""
    params = request.sampling_params
    n = len(request.output_token_ids) + 1
    return replace(
        request,
        sampling_params=replace(params, max_tokens=n, min_tokens=min(params.min_tokens, n)),
    )


def needs_decode(request: EngineRequest, output: RequestOutput, max_model_len: int) -> bool:
    """Whether the prefill's (final) output leaves tokens for a decode engine to generate."""
    if output.finish_reason != "length":  # stopped, aborted or failed: that is the answer
        return False
    num_tokens = len(request.prompt_token_ids) + output.num_output_tokens
    return (
        output.num_output_tokens < request.sampling_params.max_tokens and num_tokens < max_model_len
    )


@dataclass(frozen=True, slots=True)
class PrefillResult:
    """What a prefill hands on: its output (the first token) and the transfer of its blocks (None
    when none were cached or nothing is left to decode)."""

    output: RequestOutput
    handle: TransferHandle | None


class PrefillSide:
    """A prefill engine's end: reads a finished prefill's blocks on every rank and sends them."""

    def __init__(self, engine: EngineCore, transport: KVTransport) -> None:
        self.ranks = Ranks(engine, "disaggregation.prefill")
        self.engine = engine
        self.transport = transport
        self.num_blocks_sent = 0
        self.num_bytes_sent = 0

    def cached_blocks(self, request: EngineRequest) -> tuple[list[int], list[int]]:
        """The hashes and device blocks of the request's prompt blocks still in the device prefix
        cache, leading ones in a row."""
        engine = self.engine
        request = engine.loras.keyed(request)  # its chain is keyed by its adapter's identity
        tokens = list(request.prompt_token_ids) + list(request.output_token_ids)
        hashes = hash_prompt_blocks(
            tokens, engine.config.block_size, lora_name=request.lora_key, salt=request.cache_salt
        )
        blocks = engine.scheduler.kv.pool.cached_run(hashes)
        return hashes[: len(blocks)], blocks

    def payload(self, request: EngineRequest) -> KVPayload | None:
        """The cached blocks as one payload (one in-process rank: the benchmark's split of the
        export into read and send)."""
        executor = self.engine.executor
        hashes, blocks = self.cached_blocks(request)
        if not blocks or not isinstance(executor, LocalExecutor) or executor.runner is None:
            return None
        assert executor.runner.kv_cache is not None
        return read_blocks(executor.runner.kv_cache, hashes, blocks)

    def export(self, request: EngineRequest) -> TransferHandle | None:
        """Send the request's cached prompt blocks from every rank; call on the engine thread
        between steps. None: nothing to send, or a rank failed to (the decode side recomputes)."""
        hashes, blocks = self.cached_blocks(request)
        if not blocks:
            return None
        try:
            sent = self.ranks(kv_ranks.export, self.transport, hashes, blocks)
        except Exception as exc:  # the request goes on without its KV, never fails for it
            logger.warning("KV export of %s failed: %r; not sent", request.request_id, exc)
            return None
        self.num_blocks_sent += len(hashes)
        self.num_bytes_sent += sum(n for _, n in sent)
        if len(sent) == 1:
            return sent[0][0]
        return TransferHandle(uuid.uuid4().hex, hashes, shards=[h for h, _ in sent])

    def release(self, handle: TransferHandle) -> None:
        """Drop a transfer nobody will fetch."""
        for part in handle.shards or [handle]:
            self.transport.release(part)


class DecodeSide:
    """A decode engine's end: the remote connector in its scheduler, a receiver on each rank."""

    def __init__(
        self,
        engine: EngineCore,
        transport: KVTransport,
        timeout_s: float = DEFAULT_TRANSFER_TIMEOUT_S,
    ) -> None:
        if engine.num_state_slots:  # transferred blocks come without the state at their end
            raise ValueError(
                "disaggregation: a hybrid model's decode engine cannot start from transferred KV "
                "(its linear layers' recurrent state does not travel with the blocks)"
            )
        self.ranks = Ranks(engine, "disaggregation.decode")
        sched = engine.scheduler
        self.engine = engine
        self.ranks(kv_ranks.start_receiver, transport, timeout_s)
        # The transfers the ranks hold for requests not yet landed (each rank forgets a transfer
        # once it fetched it; the rest are forgotten when their request is released).
        self.pending: set[str] = set()
        self.connector = RemoteKVConnector(
            sched.config.cpu_tier_blocks, sched.config.disk_tier_blocks
        )
        self.connector.on_release = self.forget
        sched.use_connector(self.connector)

    @property
    def receiver(self) -> KVReceiver | None:
        """The in-process rank's receiver (one rank), None under Ray."""
        runner = getattr(self.engine.executor, "runner", None)
        return runner.kv_receiver if self.ranks.local and runner is not None else None

    def add(self, request: EngineRequest, handle: TransferHandle | None) -> None:
        """Queue a request resumed after its prefill, whose blocks come through `handle`; call on
        the engine thread. ValueError (nothing kept) if the engine refuses it."""
        rid = request.request_id
        if handle is not None and handle.hashes and self._expect(handle):
            try:
                self.connector.expect(rid, handle.key, handle.hashes)
            except BaseException:  # the id expects another transfer already: keep that one
                self.forget(handle.key)
                raise
        try:
            self.engine.add_request(request)
        except BaseException:
            self.connector.release(rid)
            raise

    def _expect(self, handle: TransferHandle) -> bool:
        """Tell every rank which shard to fetch; False (the prompt is computed here) if a rank
        has none or cannot be told."""
        self.pending.add(handle.key)
        try:
            told = self.ranks(kv_ranks.expect, handle)
        except Exception as exc:
            logger.warning("KV transfer %s: ranks not told (%r); recomputing", handle.key, exc)
            told = []
        if told and all(told):
            return True
        self.forget(handle.key)
        return False

    def forget(self, key: str) -> None:
        """The transfer's request is done with it: every rank lets it go."""
        if key not in self.pending:
            return
        self.pending.discard(key)
        try:
            self.ranks(kv_ranks.forget, key)
        except Exception as exc:  # a dead rank fails the next step; nothing else to free here
            logger.warning("KV transfer %s: ranks not told to forget it (%r)", key, exc)

    def received(self) -> tuple[int, float]:
        """(bytes copied in, seconds the slowest rank spent loading), over the ranks."""
        figures = self.ranks(kv_ranks.received)
        return sum(b for b, _ in figures), max(s for _, s in figures)


class PhaseEngine:
    """An EngineCore as one phase of a disaggregated model, in the shape the replica's engine loop
    drives (add_request, step; everything else is the engine's). Call on the engine thread.

    Prefill: a request named in `prefills` first (by the replica) runs as its prefill, and right
    after the step that finishes it its blocks are exported into `exports`. Decode: a request
    whose handle is in `handoffs` is added expecting that transfer. Other requests run as on any
    replica.
    """

    def __init__(
        self, engine: EngineCore, prefill: PrefillSide | None, decode: DecodeSide | None
    ) -> None:
        self.engine = engine
        self.prefill = prefill
        self.decode = decode
        self.prefills: dict[str, EngineRequest] = {}  # request id -> the request as asked
        self.exports: dict[str, TransferHandle | None] = {}
        self.handoffs: dict[str, TransferHandle] = {}

    def add_request(self, request: EngineRequest) -> None:
        rid = request.request_id
        if rid in self.prefills:
            self.engine.add_request(prefill_request(request))
        elif self.decode is not None:
            self.decode.add(request, self.handoffs.pop(rid, None))
        else:
            self.engine.add_request(request)

    def step(self) -> list[RequestOutput]:
        outputs = self.engine.step()
        if self.prefill is not None and self.prefills:
            for out in outputs:
                if out.finished and out.request_id in self.prefills:
                    self._export(self.prefills.pop(out.request_id), out)
        return outputs

    def _export(self, request: EngineRequest, out: RequestOutput) -> None:
        assert self.prefill is not None
        if needs_decode(request, out, self.engine.max_model_len):
            self.exports[request.request_id] = self.prefill.export(request)

    def abort_requests(self, request_ids: list[str]) -> list[RequestOutput]:
        for rid in request_ids:
            self.prefills.pop(rid, None)
            self.handoffs.pop(rid, None)
            handle = self.exports.pop(rid, None)
            if handle is not None and self.prefill is not None:
                self.prefill.release(handle)
        return self.engine.abort_requests(request_ids)

    def __getattr__(self, name: str) -> object:
        return getattr(self.engine, name)
