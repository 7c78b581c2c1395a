"""Peer-to-peer prefix pulls, the pure part: whether the replica chosen for a request should pull
the prompt blocks a peer holds beyond its own, and the cost model that says whether moving them
beats computing them.

The router decides *whether there is something to pull*, from what it knows exactly: the peer's
KV events (router/kv_events.py), in sync, never a guess. A `PeerPull` names the peer, the leading
block hashes the peer holds on its device and how many of them the chosen replica is expected to
hold already; it travels with the request (cluster/serve_router.py). The pulling replica decides
*whether the pull pays*, with `PullCost` over its own KV block size, since only it knows how many
bytes a block of its model is (cluster/kv_pull.py). The simulator can run both unchanged.

Only device blocks are pulled: the peer exports them from its device pool between steps. A peer's
CPU-tier blocks would need its tier's slots read on its workers (a later step).

The router remembers the pulls it planned (`PullsInFlight`) until the puller's KV events show the
blocks stored, the pull's timeout passes or its request completes: a later request routed to the
same replica joins the pull in flight instead of moving the same blocks a second time.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from router.kv_events import KVIndex, TierRun

# The most blocks one pull names: a 1M-token prompt at 16 tokens a block (the request's own
# bounds refuse longer prompts first).
MAX_PULL_BLOCKS = 1 << 16
MAX_REPLICA_CHARS = 256
HASH_BOUND = 1 << 128


@dataclass(frozen=True, slots=True)
class PeerPull:
    """Pull blocks first.. of `hashes` (the prompt's leading blocks `peer` holds on its device)
    from `peer`: the chosen replica is expected to hold the first `first` already."""

    peer: str
    hashes: tuple[int, ...]
    first: int = 0

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """ValueError naming the field out of bounds (run again after unpickling: a pull crosses
        processes as a request's keyword argument)."""
        if type(self.peer) is not str or not 0 < len(self.peer) <= MAX_REPLICA_CHARS:
            raise ValueError(f"pull.peer: 1 to {MAX_REPLICA_CHARS} characters, got {self.peer!r}")
        if type(self.hashes) is not tuple or not 0 < len(self.hashes) <= MAX_PULL_BLOCKS:
            raise ValueError(f"pull.hashes: a tuple of 1 to {MAX_PULL_BLOCKS} block hashes")
        if any(type(h) is not int or not 0 <= h < HASH_BOUND for h in self.hashes):
            raise ValueError("pull.hashes: each must be an integer in [0, 2**128)")
        if type(self.first) is not int or not 0 <= self.first < len(self.hashes):
            raise ValueError(
                f"pull.first: an integer in [0, {len(self.hashes)}), got {self.first!r}"
            )

    @property
    def num_blocks(self) -> int:
        """Blocks the pull moves."""
        return len(self.hashes) - self.first


def plan_pull(
    kv: KVIndex,
    hashes: Sequence[int],
    choice: str,
    have: TierRun,
    candidates: Sequence[str],
    min_blocks: int,
) -> PeerPull | None:
    """The pull for a request routed to `choice`, which is expected to hold `have` of its leading
    blocks: from the candidate whose KV events (in sync) show the longest device run, when that
    run exceeds what choice has by at least min_blocks; None otherwise."""
    held = have.blocks
    if len(hashes) - held < min_blocks:
        return None
    peers = [r for r in candidates if r != choice and kv.in_sync(r)]
    if not peers:
        return None
    runs = kv.match(hashes, peers)
    peer = max(peers, key=lambda r: (runs[r].device, r))
    device = min(runs[peer].device, MAX_PULL_BLOCKS)
    if device - held < min_blocks:
        return None
    return PeerPull(peer, tuple(hashes[:device]), held)


@dataclass(frozen=True, slots=True)
class _Planned:
    """A pull the router planned: where it goes and until when it counts as in flight."""

    replica: str
    pull: PeerPull
    expires: float


class PullsInFlight:
    """The pulls the router planned that have not landed, per (puller, moved block hash).

    An entry lasts until the puller's KV events show its blocks on the device (`landed`), its
    request completes or fails (`finish`), or its timeout passes (`expire`): a replica gives up on
    a peer's answer after pull_timeout_s and computes. Bounded: at most `max_blocks_per_replica`
    moved blocks per replica (its oldest pulls are forgotten first), and `remove_replica` drops a
    replica's entries with it.
    """

    def __init__(self, max_blocks_per_replica: int = MAX_PULL_BLOCKS) -> None:
        if type(max_blocks_per_replica) is not int or not 1 <= max_blocks_per_replica <= 1 << 24:
            raise ValueError(
                f"max_blocks_per_replica: an integer in [1, 2**24], got {max_blocks_per_replica!r}"
            )
        self.max_blocks_per_replica = max_blocks_per_replica
        # request id -> its pull, in the order planned (so in expiry order: one timeout for all)
        self._pulls: OrderedDict[str, _Planned] = OrderedDict()
        self._by_replica: dict[str, dict[str, None]] = {}  # replica -> its pulls' ids, oldest 1st
        self._moving: dict[str, dict[int, str]] = {}  # replica -> moved hash -> request id
        self.num_joined = 0  # requests that joined a pull in flight instead of pulling again

    def __len__(self) -> int:
        return len(self._pulls)

    def num_blocks(self, replica: str) -> int:
        """Moved blocks in flight to replica."""
        return len(self._moving.get(replica, ()))

    def record(self, request_id: str, replica: str, pull: PeerPull, expires: float) -> None:
        """request_id's pull to replica is in flight until expires (or landed / finished)."""
        self.finish(request_id)
        moving = self._moving.setdefault(replica, {})
        for h in pull.hashes[pull.first :]:
            moving[h] = request_id
        self._pulls[request_id] = _Planned(replica, pull, expires)
        pulls = self._by_replica.setdefault(replica, {})
        pulls[request_id] = None
        while len(moving) > self.max_blocks_per_replica:
            self.finish(next(iter(pulls)))

    def joinable(
        self, replica: str, hashes: Sequence[int], held: int, now: float
    ) -> PeerPull | None:
        """The pull in flight to replica that moves hashes[held] (the first block replica lacks),
        None if none does. Hashes chain, so it moves the prompt's blocks from there on as far as
        its hashes equal the prompt's."""
        self.expire(now)
        moving = self._moving.get(replica)
        if not moving or held >= len(hashes) or hashes[held] not in moving:
            return None
        return self._pulls[moving[hashes[held]]].pull

    def landed(self, replica: str, device_run: Callable[[Sequence[int]], int]) -> None:
        """Forget replica's pulls whose blocks its KV events show on its device: device_run(hashes)
        is the leading run of hashes they show there."""
        for rid in list(self._by_replica.get(replica, ())):
            pull = self._pulls[rid].pull
            if device_run(pull.hashes) >= len(pull.hashes):
                self.finish(rid)

    def finish(self, request_id: str) -> None:
        """request_id's pull is over (its request completed or failed). Idempotent."""
        planned = self._pulls.pop(request_id, None)
        if planned is None:
            return
        replica, pull = planned.replica, planned.pull
        moving = self._moving[replica]
        for h in pull.hashes[pull.first :]:
            if moving.get(h) == request_id:  # a later pull of the same block keeps its entry
                del moving[h]
        pulls = self._by_replica[replica]
        del pulls[request_id]
        if not pulls:
            del self._by_replica[replica], self._moving[replica]

    def expire(self, now: float) -> None:
        """Forget the pulls whose timeout passed (the oldest first: one timeout for all)."""
        while self._pulls:
            rid, planned = next(iter(self._pulls.items()))
            if planned.expires > now:
                return
            self.finish(rid)

    def remove_replica(self, replica: str) -> None:
        """Forget the pulls to replica and those from it (their blocks will never come)."""
        for rid, planned in list(self._pulls.items()):
            if replica in (planned.replica, planned.pull.peer):
                self.finish(rid)


@dataclass(frozen=True, slots=True)
class PullCommand:
    """What the pulling replica sends its peer (through the deployment's handle, which the fleet
    router sends to exactly `replica`, the peer): send the blocks `pull` names."""

    pull: PeerPull

    @property
    def replica(self) -> str:
        return self.pull.peer


@dataclass(frozen=True, slots=True)
class PullCost:
    """A pull's cost against its prefill's: bytes / bytes_per_s + fixed_s seconds to move the
    blocks, tokens / prefill_tokens_per_s to compute them."""

    bytes_per_s: float
    fixed_s: float
    prefill_tokens_per_s: float

    def pull_s(self, num_bytes: int) -> float:
        return num_bytes / self.bytes_per_s + self.fixed_s

    def prefill_s(self, num_tokens: int) -> float:
        return num_tokens / self.prefill_tokens_per_s

    def pays(self, num_blocks: int, block_size: int, block_bytes: int) -> bool:
        """Whether moving num_blocks blocks of block_bytes beats computing their tokens."""
        return self.pull_s(num_blocks * block_bytes) < self.prefill_s(num_blocks * block_size)
