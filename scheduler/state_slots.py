"""Recurrent-state slots: per-request state beyond the paged KV (a hybrid model's conv and
delta/SSM state, workers/linear_state.py), allocated by the scheduler like blocks.

A hybrid model's state does not grow with the sequence: each running request holds one fixed-size
slot of every linear-attention layer. The scheduler takes a slot when it admits a request and gives
it back when the request leaves the running batch (finished, aborted, preempted). A request that
finds no free slot waits at the head of the queue, as one that finds no blocks does; it is never
failed. A preempted request's state is dropped with its blocks: it recomputes from its first token
(swapping a state slot to the CPU is not done; the engine refuses swap preemption for such models).

The workers keep their slots by request id (workers/linear_state.py) and size them from the same
count, so a step never holds more requests than slots on either side. `num_slots` 0: the model has
no recurrent state and every request may run.

With prefix caching, checkpoints of the state at block boundaries (scheduler/state_checkpoints.py)
travel to the workers as `StateCopies`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_STATE_SLOTS = 1 << 16


@dataclass(slots=True)
class StateSlots:
    """A fixed pool of `num_slots` slots; which request holds which."""

    num_slots: int
    slot_of: dict[str, int] = field(default_factory=dict)
    free: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        n = self.num_slots
        if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= MAX_STATE_SLOTS:
            raise ValueError(
                f"num_state_slots: must be an integer in [0, {MAX_STATE_SLOTS}], got {n!r}"
            )
        self.free = list(range(n - 1, -1, -1))  # pop() hands out slot 0 first

    @property
    def enabled(self) -> bool:
        return self.num_slots > 0

    @property
    def num_free(self) -> int:
        return len(self.free) if self.enabled else 0

    def acquire(self, req_id: str) -> bool:
        """Give req_id a slot (True), or say it must wait (False). Always True when disabled."""
        if not self.enabled:
            return True
        if req_id in self.slot_of:
            raise RuntimeError(f"state slots: {req_id!r} already holds slot {self.slot_of[req_id]}")
        if not self.free:
            return False
        self.slot_of[req_id] = self.free.pop()
        return True

    def release(self, req_id: str) -> None:
        """req_id left the running batch; a request holding no slot (waiting, or with slots off)
        is ignored."""
        slot = self.slot_of.pop(req_id, None)
        if slot is not None:
            self.free.append(slot)


@dataclass(slots=True)
class StateCopies:
    """One step's recurrent-state copies, by checkpoint number (0-based)."""

    # request id -> the checkpoint its step starts from (its prefix hit ends there)
    restore: dict[str, int] = field(default_factory=dict)
    # request id -> (tokens of its row after which its state is saved, the checkpoint)
    save: dict[str, tuple[int, int]] = field(default_factory=dict)
