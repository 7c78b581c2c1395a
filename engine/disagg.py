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

Both sides need one in-process worker (tensor_parallel_size 1): the blocks are read and written
where the engine thread runs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from engine.core import EngineCore
from engine.executor import LocalExecutor
from scheduler.block_manager import hash_prompt_blocks
from scheduler.kv_remote import RemoteKVConnector
from scheduler.outputs import RequestOutput
from scheduler.request import EngineRequest
from workers.kv_cache import KVCache
from workers.kv_transfer import KVPayload, KVReceiver, KVTransport, TransferHandle, read_blocks

# How long a decode step waits for a transfer before it recomputes instead.
DEFAULT_TRANSFER_TIMEOUT_S = 10.0


def _local_cache(engine: EngineCore, field_name: str) -> tuple[LocalExecutor, KVCache]:
    executor = engine.executor
    runner = getattr(executor, "runner", None)
    if not isinstance(executor, LocalExecutor) or runner is None or runner.kv_cache is None:
        raise ValueError(
            f"{field_name}: disaggregation needs tensor_parallel_size 1 (one in-process worker)"
        )
    return executor, runner.kv_cache


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


def decode_request(request: EngineRequest, first: list[int]) -> EngineRequest:
    """The request as the decode engine runs it: resumed after the prefill's tokens."""
    return replace(request, output_token_ids=list(request.output_token_ids) + list(first))


@dataclass(frozen=True, slots=True)
class PrefillResult:
    """What a prefill hands on: its output (the first token) and the transfer of its blocks (None
    when none were cached or nothing is left to decode)."""

    output: RequestOutput
    handle: TransferHandle | None


class PrefillSide:
    """A prefill engine's end: reads a finished prefill's blocks and sends them."""

    def __init__(self, engine: EngineCore, transport: KVTransport) -> None:
        _local_cache(engine, "disaggregation.prefill")
        if not engine.config.scheduler.enable_prefix_caching:
            raise ValueError("disaggregation: the prefill engine needs enable_prefix_caching")
        self.engine = engine
        self.transport = transport
        self.num_blocks_sent = 0
        self.num_bytes_sent = 0

    def payload(self, request: EngineRequest) -> KVPayload | None:
        """The request's prompt blocks still in the device prefix cache, leading ones in a row;
        call on the engine thread between steps."""
        engine = self.engine
        tokens = list(request.prompt_token_ids) + list(request.output_token_ids)
        hashes = hash_prompt_blocks(tokens, engine.config.block_size, lora_name=request.lora_name)
        cached = engine.scheduler.kv.pool.cached
        blocks = []
        for h in hashes:
            block = cached.get(h)
            if block is None:
                break
            blocks.append(block)
        if not blocks:
            return None
        _, cache = _local_cache(engine, "disaggregation.prefill")
        return read_blocks(cache, hashes[: len(blocks)], blocks)

    def export(self, request: EngineRequest) -> TransferHandle | None:
        payload = self.payload(request)
        if payload is None:
            return None
        self.num_blocks_sent += len(payload.hashes)
        self.num_bytes_sent += payload.nbytes
        return self.transport.send(payload)


class DecodeSide:
    """A decode engine's end: the remote connector in its scheduler, the receiver in its runner."""

    def __init__(
        self,
        engine: EngineCore,
        transport: KVTransport,
        timeout_s: float = DEFAULT_TRANSFER_TIMEOUT_S,
    ) -> None:
        executor, _ = _local_cache(engine, "disaggregation.decode")
        sched = engine.scheduler
        if not sched.config.enable_prefix_caching:
            raise ValueError("disaggregation: the decode engine needs enable_prefix_caching")
        self.engine = engine
        self.receiver = KVReceiver(transport, timeout_s)
        assert executor.runner is not None
        executor.runner.kv_receiver = self.receiver
        self.connector = RemoteKVConnector(
            sched.config.cpu_tier_blocks, sched.config.disk_tier_blocks
        )
        self.connector.on_release = self.receiver.forget
        sched.use_connector(self.connector)

    def add(self, request: EngineRequest, handle: TransferHandle | None) -> None:
        """Queue a request resumed after its prefill, whose blocks come through `handle`; call on
        the engine thread. ValueError (nothing kept) if the engine refuses it."""
        rid = request.request_id
        if handle is not None and handle.hashes:
            self.receiver.expect(handle)
            self.connector.expect(rid, handle.key, handle.hashes)
        try:
            self.engine.add_request(request)
        except BaseException:
            self.connector.release(rid)
            raise


@dataclass(frozen=True, slots=True)
class PrefillReply:
    """What a prefill replica answers: the tokens it sampled (the first), its last output, whether
    a decode replica goes on from there, and the transfer of the prompt's blocks (None: nothing
    was sent; the decode replica computes the prompt)."""

    token_ids: list[int]
    output: RequestOutput
    continues: bool
    handle: TransferHandle | None


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
                self.prefill.transport.release(handle)
        return self.engine.abort_requests(request_ids)

    def __getattr__(self, name: str) -> object:
        return getattr(self.engine, name)
