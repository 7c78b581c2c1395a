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
process: the tests), torch.distributed point-to-point in workers/kv_collective.py (gloo on CPU,
NCCL on CUDA), the Ray object store in cluster/disagg_transport.py.

Under tensor parallelism each rank holds its own KV heads of every block: rank r of the prefill
engine sends its shard as a payload of its own, and the transfer's handle carries one handle per
rank. A decode rank reads the shards that hold its heads (workers/kv_reshard.py): at the same
tensor-parallel size its namesake's, at another size one or several, cut and joined per layer.
"""

from __future__ import annotations

import logging
import math
import time
import uuid
import zlib
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from workers.kv_cache import KVCache
from workers.kv_handle import TransferHandle
from workers.kv_reshard import HeadSlice, join

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


@dataclass(frozen=True, slots=True)
class Expected:
    """A transfer as one receiving rank takes it: the sending ranks' handles it fetches and, for
    each, the heads of that shard that are this rank's (joined in order). No slices: one part,
    the whole shard of the receiving rank's namesake (both engines at one tensor-parallel size)."""

    parts: list[TransferHandle]
    slices: list[HeadSlice] = field(default_factory=list)

    def __post_init__(self) -> None:
        if len(self.parts) != max(len(self.slices), 1):
            raise ValueError(f"parts: {len(self.parts)} handles for {len(self.slices)} slices")


class KVReceiver:
    """The decode side's end of the transports: the handles of expected transfers, and the copies
    of a step's `load_remote` into the device pool."""

    def __init__(self, transport: KVTransport, timeout_s: float, rank: int = 0) -> None:
        self.transport = transport
        self.timeout_s = timeout_s
        self.rank = rank  # this receiver's tensor-parallel rank: it takes that rank's payloads
        self.handles: dict[str, Expected] = {}
        self.num_bytes = 0  # received and copied in, cumulative
        self.load_s = 0.0  # seconds in load (fetches, checks and copies), cumulative

    def expect(self, handle: TransferHandle, key: str | None = None) -> None:
        """Fetch `handle` (the KV heads of this rank's namesake, at the same tensor-parallel size)
        for the loads of transfer `key` (default: the handle's own key)."""
        self.expect_parts(key or handle.key, Expected([handle]))

    def expect_parts(self, key: str, expected: Expected) -> None:
        """Fetch these sending ranks' shards, and join their heads, for the loads of `key`."""
        self.handles[key] = expected

    def forget(self, key: str) -> None:
        expected = self.handles.pop(key, None)
        for part in expected.parts if expected is not None else []:
            self.transport.release(part)

    def load(self, cache: KVCache, loads: list[tuple[str, int, int]]) -> list[int]:
        """Copy each (key, hash, device block) in; the device blocks that failed."""
        start = time.perf_counter()
        try:
            return self._load(cache, loads)
        finally:
            self.load_s += time.perf_counter() - start

    def _load(self, cache: KVCache, loads: list[tuple[str, int, int]]) -> list[int]:
        failed: list[int] = []
        fetched: dict[str, tuple[list[KVPayload | None], list[HeadSlice]]] = {}
        for key, block_hash, block in loads:
            if key not in fetched:
                fetched[key] = self._fetch(key, cache)
                self.forget(key)  # one fetch a transfer: the payloads are ours now
            data = self._joined(cache, *fetched[key], block_hash)
            if data is None:
                failed.append(block)
                continue
            cache.gpu[:, :, block] = data.to(cache.gpu.device, non_blocking=False)
            self.num_bytes += data.numel() * data.element_size()
        return failed

    def _fetch(self, key: str, cache: KVCache) -> tuple[list[KVPayload | None], list[HeadSlice]]:
        """Every part's payload (None where it failed), all within one timeout, and its heads."""
        whole = [HeadSlice(self.rank, 0, cache.gpu.shape[4])]
        expected = self.handles.get(key)
        if expected is None:
            logger.warning("KV transfer %s: no handle (forgotten, or never expected)", key)
            return [None], whole
        slices = expected.slices or whole
        deadline = time.monotonic() + self.timeout_s
        payloads: dict[int, KVPayload | None] = {}
        for part, piece in zip(expected.parts, slices, strict=True):
            if piece.src_rank not in payloads:
                left = max(deadline - time.monotonic(), 1e-3)
                payloads[piece.src_rank] = self._receive(key, part, left)
        return [payloads[s.src_rank] for s in slices], slices

    def _receive(self, key: str, handle: TransferHandle, timeout_s: float) -> KVPayload | None:
        try:
            payload = self.transport.receive(handle, timeout_s)
        except Exception as exc:  # a transport that fails loses the transfer, never the engine
            logger.warning("KV transfer %s failed: %r; recomputing", key, exc)
            return None
        if payload is None:
            logger.warning("KV transfer %s is missing or timed out; recomputing", key)
        return payload

    @staticmethod
    def _joined(
        cache: KVCache,
        payloads: list[KVPayload | None],
        slices: list[HeadSlice],
        block_hash: int,
    ) -> torch.Tensor | None:
        """The block of block_hash for this rank's pool, its heads cut from each part and joined
        (every layer); None if any part fails a check."""
        parts = []
        for payload, piece in zip(payloads, slices, strict=True):
            part = KVReceiver._block(cache, payload, block_hash, piece)
            if part is None:
                return None
            parts.append(part)
        data = join(parts, slices)
        gpu = cache.gpu
        if tuple(data.shape) != (gpu.shape[0], gpu.shape[1], *gpu.shape[3:]):
            logger.warning("KV transfer: block %032x has another layout; recomputing", block_hash)
            return None
        return data

    @staticmethod
    def _block(
        cache: KVCache, payload: KVPayload | None, block_hash: int, piece: HeadSlice
    ) -> torch.Tensor | None:
        """The payload's block for block_hash as a tensor of its sender's layout (this pool's, but
        for the heads), None if it fails a check."""
        if payload is None:
            return None
        gpu = cache.gpu
        try:
            i = payload.hashes.index(block_hash)
        except ValueError:
            return None
        shape = tuple(payload.block_shape)
        row = payload.data[i] if i < len(payload.data) else None
        if (
            row is None
            or payload.rank != piece.src_rank
            or payload.dtype != str(gpu.dtype).removeprefix("torch.")
            or len(shape) != 5
            or shape[:3] != (gpu.shape[0], gpu.shape[1], gpu.shape[3])
            or shape[4] != gpu.shape[5]
            or not 0 <= piece.start < piece.stop <= shape[3]
            or row.nbytes != math.prod(shape) * gpu.element_size()
            or i >= len(payload.crcs)
            or block_crc(row) != payload.crcs[i]
        ):
            logger.warning("KV transfer: block %032x fails its check; recomputing", block_hash)
            return None
        return torch.from_numpy(row.copy()).view(gpu.dtype).view(shape)
