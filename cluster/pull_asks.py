"""The peer pulls a replica has asked for, by the block hashes they move (cluster/kv_pull.py).

A request whose blocks are already being asked for on this replica (the router joined it to that
pull, or it simply names the same blocks) does not ask the peer again: it waits for the first
ask's answer and, when the transfer came, is held by the engine until the first request's blocks
land on the device (engine/peer_pull.py `JoiningEngine`).

An ask is remembered from the moment it is sent until its answer fails, or until twice the pull
timeout has passed (one timeout for the answer, one for the transfer it names). Bounded: at most
`max_blocks` moved hashes in all; the oldest asks are forgotten first, and a request that finds
no ask asks the peer itself, which is always correct.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from router.peer_pull import MAX_PULL_BLOCKS, PeerPull
from workers.kv_transfer import TransferHandle


@dataclass(slots=True)
class Ask:
    """One ask in flight: the request that sent it, its pull, the peer's answer (a transfer, or
    None: failed, timed out or cancelled) and when it is forgotten."""

    leader: str
    pull: PeerPull
    answer: asyncio.Future[TransferHandle | None]
    expires: float


class AsksInFlight:
    """A replica's asks in flight, by moved block hash; use on the replica's event loop."""

    def __init__(
        self,
        timeout_s: float,
        max_blocks: int = MAX_PULL_BLOCKS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if type(max_blocks) is not int or not 1 <= max_blocks <= MAX_PULL_BLOCKS:
            raise ValueError(
                f"max_blocks: an integer in [1, {MAX_PULL_BLOCKS}], got {max_blocks!r}"
            )
        self.timeout_s = timeout_s
        self.max_blocks = max_blocks
        self.clock = clock
        self._asks: OrderedDict[str, Ask] = OrderedDict()  # leader -> its ask, oldest first
        self._by_hash: dict[int, Ask] = {}  # moved hash -> the newest ask moving it

    def __len__(self) -> int:
        return len(self._asks)

    @property
    def num_blocks(self) -> int:
        return len(self._by_hash)

    def find(self, pull: PeerPull) -> Ask | None:
        """The ask in flight that moves every block `pull` moves (hashes chain: its first and its
        last), None if none does."""
        self.expire()
        ask = self._by_hash.get(pull.hashes[pull.first])
        if ask is None or self._by_hash.get(pull.hashes[-1]) is not ask:
            return None
        return ask

    def open(self, leader: str, pull: PeerPull) -> Ask:
        """Remember leader's ask for pull, answered through the returned Ask's future."""
        self.close(leader)
        answer = asyncio.get_running_loop().create_future()
        ask = Ask(leader, pull, answer, self.clock() + 2 * self.timeout_s)
        self._asks[leader] = ask
        for h in pull.hashes[pull.first :]:
            self._by_hash[h] = ask
        while len(self._by_hash) > self.max_blocks:
            self.close(next(iter(self._asks)))
        return ask

    def close(self, leader: str) -> None:
        """Forget leader's ask (its waiters keep its future). Idempotent."""
        ask = self._asks.pop(leader, None)
        if ask is None:
            return
        if not ask.answer.done():  # forgotten before its answer: those waiting compute
            ask.answer.set_result(None)
        for h in ask.pull.hashes[ask.pull.first :]:
            if self._by_hash.get(h) is ask:  # a newer ask of the same block keeps its entry
                del self._by_hash[h]

    def expire(self) -> None:
        """Forget the asks past their time (the oldest first: one timeout for all)."""
        now = self.clock()
        while self._asks:
            leader, ask = next(iter(self._asks.items()))
            if ask.expires > now:
                return
            self.close(leader)
