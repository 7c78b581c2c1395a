"""KV between engines over torch.distributed point-to-point: gloo on CPU tensors, NCCL on CUDA
tensors (workers/kv_transfer.py's `KVTransport`, beside the Ray object store).

A transfer is a pull from the sending process's outbox over a pair (workers/kv_pairs.py: the
outbox, the pairs and their bounds). The payload's metadata travels in the handle, beside its
hashes. A pull that fails or runs past its timeout reports the transfer missing: the decode engine
recomputes.

Where the pair cannot form, the transport falls back: a host bound to loopback is reachable from
its own machine only, so a receiver on another machine takes the fallback's copy (the object store,
cluster/disagg_transport.py) when the sender was told to make one (`copy_to_fallback`). A sender
whose server cannot start sends through the fallback alone.
"""

from __future__ import annotations

import json
import logging
import math
import time
import uuid
from dataclasses import dataclass, replace

import numpy as np
import torch

from workers.kv_pairs import CollectiveRef, pull, reachable, release, releases_sent, server
from workers.kv_transfer import KVPayload, KVTransport, TransferHandle

__all__ = ["CollectiveRef", "CollectiveTransport", "releases_sent"]

logger = logging.getLogger(__name__)

GiB = 1 << 30
MAX_HOLD_S = 3600.0
MAX_OUTBOX_BYTES = 1 << 40
_tried: set[str] = set()  # keys this process pulled or tried to (their release needs no message)


def _check(name: str, value: object, low: float, high: float) -> None:
    number = value if isinstance(value, int | float) and not isinstance(value, bool) else math.nan
    if not math.isfinite(number) or not low <= number <= high:
        raise ValueError(f"{name}: must be a number in [{low}, {high}], got {value!r}")


@dataclass(frozen=True, slots=True)
class CollectiveTransport:
    """KVTransport over torch.distributed pairs, with a fallback transport (the object store)
    for what cannot go over a pair. Pickles small: each rank's server and pairs are its
    process's."""

    fallback: KVTransport | None = None
    copy_to_fallback: bool = False  # also send through the fallback (receivers on other machines)
    host: str = "127.0.0.1"
    hold_s: float = 300.0
    max_bytes: int = 4 * GiB

    def __post_init__(self) -> None:
        _check("hold_s", self.hold_s, 1e-3, MAX_HOLD_S)
        _check("max_bytes", self.max_bytes, 1, MAX_OUTBOX_BYTES)
        if not isinstance(self.max_bytes, int):
            raise ValueError(f"max_bytes: must be an integer, got {self.max_bytes!r}")
        if not isinstance(self.host, str) or not 0 < len(self.host) <= 255:
            raise ValueError(f"host: must be a host name or address, got {self.host!r}")

    def send(self, payload: KVPayload) -> TransferHandle:
        key, hashes = uuid.uuid4().hex, list(payload.hashes)
        ref = self._offer(key, payload)
        if self.fallback is None or (ref is not None and not self.copy_to_fallback):
            assert ref is not None  # without a fallback, _offer raises instead
            return TransferHandle(key, hashes, [ref])
        backup = self.fallback.send(payload)  # the handle is the fallback's, plus the pair's ref
        refs = backup.ref if ref is None else [replace(ref, fallback_copy=True), *backup.ref]
        return TransferHandle(backup.key, hashes, refs)

    def receive(self, handle: TransferHandle, timeout_s: float) -> KVPayload | None:
        ref, rest = _split(handle)
        if ref is None:
            return None if self.fallback is None else self.fallback.receive(handle, timeout_s)
        start, payload = time.monotonic(), None
        if reachable(ref):
            payload = self._pull(ref, handle.hashes, handle.readers, timeout_s)
        if payload is None and ref.fallback_copy and self.fallback is not None:
            left = max(timeout_s - (time.monotonic() - start), 1e-3)
            return self.fallback.receive(TransferHandle(handle.key, handle.hashes, rest), left)
        return payload

    def release(self, handle: TransferHandle) -> None:
        ref, rest = _split(handle)
        if ref is None:
            if self.fallback is not None:
                self.fallback.release(handle)
            return
        if ref.key in _tried:
            _tried.discard(ref.key)  # pulled (counted there), or failed (dropped by hold_s)
        elif reachable(ref):
            release(ref, handle.readers)
        if ref.fallback_copy and self.fallback is not None:
            self.fallback.release(TransferHandle(handle.key, handle.hashes, rest))
        handle.ref.clear()

    def _offer(self, key: str, payload: KVPayload) -> CollectiveRef | None:
        """Hold the payload in this process's outbox; None (with a fallback) if it cannot."""
        try:
            outbox = server(self.host, self.hold_s, self.max_bytes)
            return outbox.offer(key, _meta(payload), torch.from_numpy(payload.data))
        except (OSError, RuntimeError, ValueError) as exc:
            if self.fallback is None:
                raise
            logger.warning("KV over collectives unavailable (%r); through the fallback", exc)
            return None

    def _pull(
        self, ref: CollectiveRef, hashes: list[int], readers: int, timeout_s: float
    ) -> KVPayload | None:
        _tried.add(ref.key)
        try:
            got = pull(ref, readers, timeout_s, self.max_bytes)
        except Exception as exc:  # a peer that fails or never answers: recompute (or fall back)
            logger.warning("KV pull of %s from %s:%d failed: %r", ref.key, ref.host, ref.port, exc)
            return None
        return None if got is None else _payload(json.loads(ref.meta), hashes, got)


def _split(handle: TransferHandle) -> tuple[CollectiveRef | None, list[object]]:
    """The handle's pair reference (if any) and the fallback's references."""
    if handle.ref and isinstance(handle.ref[0], CollectiveRef):
        return handle.ref[0], list(handle.ref[1:])
    return None, list(handle.ref)


def _meta(payload: KVPayload) -> dict:
    return {
        "crcs": payload.crcs,
        "dtype": payload.dtype,
        "block_shape": list(payload.block_shape),
        "rank": payload.rank,
        "rows": int(payload.data.shape[0]),
    }


def _payload(meta: dict, hashes: list[int], wire: torch.Tensor) -> KVPayload:
    """The payload of the handle's hashes from the pulled bytes and the sender's description."""
    rows = int(meta["rows"])
    data: np.ndarray = wire.cpu().numpy().reshape(rows, -1) if rows else np.empty((0, 0), np.uint8)
    return KVPayload(
        list(hashes),
        [int(c) for c in meta["crcs"]],
        str(meta["dtype"]),
        tuple(int(d) for d in meta["block_shape"]),
        data,
        int(meta["rank"]),
    )
