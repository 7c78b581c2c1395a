"""The KV transfer through Ray's object store (workers/kv_transfer.py's KVTransport).

The prefill replica `ray.put`s the payload and owns the object; the handle carries its ObjectRef
inside a list, so that Ray passes it through the ingress to the decode replica by reference (the
decode replica borrows it) instead of fetching it on the way. The decode replica `ray.get`s it
with a timeout; if the prefill replica (the owner) died, the get may fail (the decode replica
recomputes) or still find the node's copy (checked like any payload). The object is freed when
the last handle is dropped. Under tensor parallelism each rank of the prefill replica puts (and
owns) its own shard, and each rank of the decode replica gets its own (workers/kv_ranks.py).
"""

from __future__ import annotations

import logging
import uuid

import ray
from ray.exceptions import GetTimeoutError, RayError

from workers.kv_transfer import KVPayload, TransferHandle

logger = logging.getLogger(__name__)


class ObjectStoreTransport:
    """KVTransport over ray.put / ray.get."""

    def send(self, payload: KVPayload) -> TransferHandle:
        return TransferHandle(uuid.uuid4().hex, list(payload.hashes), [ray.put(payload)])

    def receive(self, handle: TransferHandle, timeout_s: float) -> KVPayload | None:
        if len(handle.ref) != 1 or not isinstance(handle.ref[0], ray.ObjectRef):
            return None
        try:
            payload = ray.get(handle.ref[0], timeout=timeout_s)
        except GetTimeoutError:
            logger.warning("KV transfer %s: not here after %.1f s", handle.key, timeout_s)
            return None
        except RayError as exc:  # the owner (the prefill replica) died, or the object is lost
            logger.warning("KV transfer %s: %r", handle.key, exc)
            return None
        return payload if isinstance(payload, KVPayload) else None

    def release(self, handle: TransferHandle) -> None:
        # Our references to the objects go; each owner frees its own when none is left.
        for part in [handle, *handle.shards]:
            part.ref.clear()
