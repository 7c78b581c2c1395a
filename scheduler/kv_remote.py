"""The KV connector with blocks arriving from another engine: prefill/decode disaggregation.

A decode engine is told, before a request is added, which of its prompt's blocks a prefill engine
computed and sent (`expect`: the hashes and the transfer's key). The scheduler then treats them
as one more tier below the device pool: `lookup` continues a request's device and tier hit through
the expected hashes, `load` lists their copies in the step's `KVTransfers.load_remote`, the
request waits in `LOADING_KV` with its slots reserved, and `land` admits it with the blocks that
arrived intact. A block that failed (missing, timed out, a bad checksum) is recomputed from there.

Expectations are per request: `release` drops a request's (the engine calls it when the request
finishes, whether or not it ever loaded: a device hit may have made the transfer unnecessary).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from scheduler.kv_connector import KVConnector, LoadPlan, TierIndex


class RemoteKVConnector(KVConnector):
    """KVConnector (the lower tiers, when sized) plus the blocks that transfers bring in."""

    def __init__(self, num_cpu_blocks: int = 0, num_disk_blocks: int = 0) -> None:
        super().__init__(max(num_cpu_blocks, 1), num_disk_blocks)
        if num_cpu_blocks <= 0:  # no tiers: an index that nothing fills (on_evict is not hooked)
            self.cpu = TierIndex(0)
        # hash -> (transfer key, how many requests expect it)
        self.remote: dict[int, tuple[str, int]] = {}
        # request id -> its transfer's key and the hashes it expects
        self.expected: dict[str, tuple[str, list[int]]] = {}
        # Told a transfer's key when its request is done with it (the receiver frees it).
        self.on_release: Callable[[str], None] | None = None
        self.num_remote_loaded = 0  # blocks landed intact from transfers
        self.num_remote_failed = 0  # blocks whose transfer failed: recomputed

    def expect(self, req_id: str, key: str, hashes: Sequence[int]) -> None:
        """The request's blocks with these hashes arrive through transfer `key`."""
        if req_id in self.expected:
            raise ValueError(f"request_id: {req_id!r} already expects a transfer")
        self.expected[req_id] = (key, list(hashes))
        for h in hashes:  # the newest transfer of a hash serves it (the likeliest to be alive)
            _, n = self.remote.get(h, (key, 0))
            self.remote[h] = (key, n + 1)

    def release(self, req_id: str) -> None:
        """The request no longer needs its transfer (finished, or landed). Idempotent."""
        key, hashes = self.expected.pop(req_id, ("", []))
        if key and self.on_release is not None:
            self.on_release(key)
        for h in hashes:
            entry = self.remote.get(h)
            if entry is None:
                continue
            holder, n = entry
            if n > 1:
                self.remote[h] = (holder, n - 1)
            else:
                del self.remote[h]

    def lookup(self, hashes: Sequence[int]) -> int:
        n = super().lookup(hashes)
        remote = self.remote
        while n < len(hashes) and hashes[n] in remote:
            n += 1
        return n

    def load(self, req_id: str, first: int, hashes: Sequence[int], blocks: Sequence[int]) -> None:
        tiered = super().lookup(hashes)  # the tiers' part comes first, in a row
        super().load(req_id, first, hashes[:tiered], blocks[:tiered])
        self.plans[req_id].hashes = list(hashes)
        self.plans[req_id].blocks = list(blocks)
        step = self._step
        for h, block in zip(hashes[tiered:], blocks[tiered:], strict=True):
            step.load_remote.append((self.remote[h][0], h, block))

    def land(self, req_id: str, failed_blocks: set[int]) -> LoadPlan | None:
        plan_in = self.plans.get(req_id)
        remote = 0 if plan_in is None else sum(h in self.remote for h in plan_in.hashes)
        plan = super().land(req_id, failed_blocks)
        if plan is not None:
            landed = sum(h in self.remote for h in plan.hashes)
            self.num_remote_loaded += landed
            self.num_remote_failed += remote - landed
        self.release(req_id)
        return plan

    def cancel(self, req_id: str) -> None:
        super().cancel(req_id)
        self.release(req_id)

    def _forget(self, block_hash: int) -> None:
        if block_hash in self.remote:  # a transfer that failed is not looked up again
            del self.remote[block_hash]
        else:
            super()._forget(block_hash)
