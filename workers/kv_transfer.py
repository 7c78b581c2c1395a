"""KV blocks between engines (prefill/decode disaggregation), worker side: what a transfer carries,
the transport interface, and the decode side's receiver that copies arriving blocks into device
slots (scheduler/kv_remote.py decides which; this file carries the copies out).

A transfer is one prefill's full prompt blocks: their 128-bit hashes, a CRC-32 of each block's
bytes, and the bytes themselves on the host, block-major ([blocks, layers, K/V, block_size, heads,
head_dim]) so one block is one contiguous run. The receiver checks each block it copies against
the hash it asked for, the layout of its own pool and the checksum; a block that fails (or a
transfer that is missing or times out) is reported as failed, and the scheduler recomputes the
request from there: never wrong KV.

Transports are adapters behind `KVTransport`: `InProcessTransport` here (two engines in one
process: the tests), the Ray object store in cluster/disagg_transport.py; a torch.distributed
(NCCL) channel would be a third.

Under tensor parallelism each rank holds its own KV heads of every block: rank r of the prefill
engine sends its shard as a payload of its own, and rank r of the decode engine (same
tensor-parallel size) receives that one (workers/kv_ranks.py); the transfer's handle carries one
handle per rank.
"""

from __future__ import annotations

import logging
import time
import uuid
import zlib
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from workers.kv_cache import KVCache

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class KVPayload:
    """One prefill's blocks on the host: data[i] is the block of hashes[i], checked by crcs[i]."""

    hashes: list[int]
    crcs: list[int]
    dtype: str  # torch dtype name, e.g. "float32"
    block_shape: tuple[int, ...]  # [layers, 2, block_size, heads, head_dim]
    data: np.ndarray  # uint8 [blocks, block bytes]: Ray's object store reads it without a copy
    rank: int = 0  # the tensor-parallel rank whose KV heads these are

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)


@dataclass(frozen=True, slots=True)
class TransferHandle:
    """What travels from the prefill side to the decode side in place of the KV: the transfer's
    key, the hashes it carries, and the transport's own reference (an ObjectRef in a list, so Ray
    passes it by reference; None for the in-process transport)."""

    key: str
    hashes: list[int]
    ref: list[object] = field(default_factory=list)
    # Tensor parallelism: rank r's own handle at shards[r] (its KV heads; same hashes); empty at
    # one rank, where this handle is the rank's.
    shards: list[TransferHandle] = field(default_factory=list)

    def shard(self, rank: int, world_size: int) -> TransferHandle | None:
        """This rank's part of the transfer; None if it was sent by a different number of ranks
        (then the rank recomputes)."""
        if world_size == 1 and not self.shards:
            return self
        return self.shards[rank] if len(self.shards) == world_size else None


class KVTransport(Protocol):
    """Moves one payload from a prefill engine to a decode engine."""

    def send(self, payload: KVPayload) -> TransferHandle:
        """Make the payload fetchable (prefill side)."""
        ...

    def receive(self, handle: TransferHandle, timeout_s: float) -> KVPayload | None:
        """The payload, or None when it is gone or does not come within timeout_s (decode side)."""
        ...

    def release(self, handle: TransferHandle) -> None:
        """The decode side is done with it."""
        ...


class InProcessTransport:
    """Both engines in one process: payloads in a dict (tests, and the benchmark's floor)."""

    def __init__(self) -> None:
        self.payloads: dict[str, KVPayload] = {}

    def send(self, payload: KVPayload) -> TransferHandle:
        key = uuid.uuid4().hex
        self.payloads[key] = payload
        return TransferHandle(key, list(payload.hashes))

    def receive(self, handle: TransferHandle, timeout_s: float) -> KVPayload | None:
        return self.payloads.get(handle.key)

    def release(self, handle: TransferHandle) -> None:
        self.payloads.pop(handle.key, None)


def block_crc(block: np.ndarray) -> int:
    return zlib.crc32(block.data)


def read_blocks(cache: KVCache, hashes: list[int], blocks: list[int], rank: int = 0) -> KVPayload:
    """Copy device blocks (this rank's KV heads) to the host as a payload (prefill side)."""
    gpu = cache.gpu
    index = torch.tensor(blocks, dtype=torch.long, device=gpu.device)
    # [layers, 2, n, ...] -> [n, layers, 2, ...], one gather and one copy to the host
    host = gpu[:, :, index].movedim(2, 0).contiguous().to("cpu")
    data = host.view(len(blocks), -1).view(torch.uint8).numpy()
    return KVPayload(
        list(hashes),
        [block_crc(row) for row in data],
        str(gpu.dtype).removeprefix("torch."),
        tuple(host.shape[1:]),
        data,
        rank,
    )


class KVReceiver:
    """The decode side's end of the transports: the handles of expected transfers, and the copies
    of a step's `load_remote` into the device pool."""

    def __init__(self, transport: KVTransport, timeout_s: float, rank: int = 0) -> None:
        self.transport = transport
        self.timeout_s = timeout_s
        self.rank = rank  # this receiver's tensor-parallel rank: it takes that rank's payloads
        self.handles: dict[str, TransferHandle] = {}
        self.num_bytes = 0  # received and copied in, cumulative
        self.load_s = 0.0  # seconds in load (fetches, checks and copies), cumulative

    def expect(self, handle: TransferHandle, key: str | None = None) -> None:
        """Fetch `handle` for the loads of transfer `key` (default: the handle's own key)."""
        self.handles[key or handle.key] = handle

    def forget(self, key: str) -> None:
        handle = self.handles.pop(key, None)
        if handle is not None:
            self.transport.release(handle)

    def load(self, cache: KVCache, loads: list[tuple[str, int, int]]) -> list[int]:
        """Copy each (key, hash, device block) in; the device blocks that failed."""
        start = time.perf_counter()
        try:
            return self._load(cache, loads)
        finally:
            self.load_s += time.perf_counter() - start

    def _load(self, cache: KVCache, loads: list[tuple[str, int, int]]) -> list[int]:
        failed: list[int] = []
        payloads: dict[str, KVPayload | None] = {}
        for key, block_hash, block in loads:
            if key not in payloads:
                payloads[key] = self._fetch(key)
                self.forget(key)  # one fetch a transfer: the payload is ours now
            data = self._block(cache, payloads[key], block_hash, self.rank)
            if data is None:
                failed.append(block)
                continue
            cache.gpu[:, :, block] = data.to(cache.gpu.device, non_blocking=False)
            self.num_bytes += data.numel() * data.element_size()
        return failed

    def _fetch(self, key: str) -> KVPayload | None:
        handle = self.handles.get(key)
        if handle is None:
            logger.warning("KV transfer %s: no handle (forgotten, or never expected)", key)
            return None
        try:
            payload = self.transport.receive(handle, self.timeout_s)
        except Exception as exc:  # a transport that fails loses the transfer, never the engine
            logger.warning("KV transfer %s failed: %r; recomputing", key, exc)
            return None
        if payload is None:
            logger.warning("KV transfer %s is missing or timed out; recomputing", key)
        return payload

    @staticmethod
    def _block(
        cache: KVCache, payload: KVPayload | None, block_hash: int, rank: int = 0
    ) -> torch.Tensor | None:
        """The payload's block for block_hash as a tensor of the pool's layout, None if it fails a
        check."""
        if payload is None:
            return None
        gpu = cache.gpu
        shape = (gpu.shape[0], gpu.shape[1], *gpu.shape[3:])
        try:
            i = payload.hashes.index(block_hash)
        except ValueError:
            return None
        row = payload.data[i] if i < len(payload.data) else None
        if (
            row is None
            or payload.rank != rank
            or payload.dtype != str(gpu.dtype).removeprefix("torch.")
            or tuple(payload.block_shape) != shape
            or row.nbytes != gpu[:, :, 0].numel() * gpu.element_size()
            or i >= len(payload.crcs)
            or block_crc(row) != payload.crcs[i]
        ):
            logger.warning("KV transfer: block %032x fails its check; recomputing", block_hash)
            return None
        return torch.from_numpy(row.copy()).view(gpu.dtype).view(shape)
