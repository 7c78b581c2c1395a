"""LoRA adapter slots: which adapters hold the device's `max_loras` slots, and who uses them.

The scheduler asks for a slot when it admits a request under an adapter and gives it back when the
request leaves the running batch (finished, preempted, swapped out). An adapter keeps its slot
while unused, so the next request for it is warm; when a new adapter needs a slot and none is free,
the least recently used slot whose adapter no running request uses is taken. When every slot's
adapter is in use the request waits (acquire returns None); it is never failed.

Loads travel to the workers in the step's SchedulerOutput (`lora_loads`: slot -> (name, identity)),
so every tensor-parallel rank fills the same slot in the same step, before that step's forward. An
identity is `name@digest` of the adapter's bytes (engine/loras.py): the workers fill a slot from the
checked tensors they keep under it.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass, field

from scheduler.request import check_lora_name


class UnknownLoraError(LookupError):
    """A request or an unload names an adapter the engine does not have (HTTP 404)."""

    def __init__(self, name: str) -> None:
        super().__init__(f"lora_name: no LoRA adapter named {name!r} is loaded")
        self.name = name

    def __reduce__(self) -> tuple[type[UnknownLoraError], tuple[str]]:
        # Rebuilt from its name, not its message (crossing Ray would name the message).
        return (UnknownLoraError, (self.name,))


class LoraInUseError(ValueError):
    """remove_lora of an adapter that waiting or running requests still use: refused, never
    waited for (the caller retries once they finish)."""


@dataclass(slots=True)
class LoraSlots:
    """The registered adapters (name -> identity) and the device slots they occupy."""

    max_loras: int
    identities: dict[str, str] = field(default_factory=dict)
    slot_of: dict[str, int] = field(default_factory=dict)
    # Slots in least-recently-used order (oldest first): slot -> adapter name.
    lru: OrderedDict[int, str] = field(default_factory=OrderedDict)
    users: Counter[str] = field(default_factory=Counter)  # running requests per adapter
    pending: dict[int, tuple[str, str]] = field(default_factory=dict)  # loads not yet sent
    num_loads: int = 0
    num_evictions: int = 0

    def __post_init__(self) -> None:
        if self.max_loras < 0:
            raise ValueError(f"max_loras: must be >= 0, got {self.max_loras}")

    @property
    def enabled(self) -> bool:
        return self.max_loras > 0

    # ---- the registry --------------------------------------------------------------------------
    def register(self, name: str, identity: str) -> None:
        check_lora_name(name)
        if not self.enabled:
            raise ValueError("lora_name: LoRA is off on this engine (max_loras is 0)")
        if name in self.identities:
            raise ValueError(f"lora_name: an adapter named {name!r} is already loaded")
        self.identities[name] = identity

    def unregister(self, name: str, num_requests: int) -> None:
        """Forget an adapter; num_requests: the live requests under it (refused unless 0)."""
        if name not in self.identities:
            raise UnknownLoraError(name)
        if num_requests:
            raise LoraInUseError(
                f"lora_name: adapter {name!r} is used by {num_requests} unfinished requests; "
                "unload it once they finish"
            )
        del self.identities[name]
        slot = self.slot_of.pop(name, None)
        if slot is not None:
            del self.lru[slot]
            self.pending.pop(slot, None)

    def check(self, name: str | None) -> None:
        """UnknownLoraError unless name is None (the base model) or a registered adapter."""
        if name is not None and name not in self.identities:
            raise UnknownLoraError(name)

    def names(self) -> list[str]:
        return list(self.identities)

    def loaded(self) -> tuple[str, ...]:
        """The adapters in device slots, least recently used first."""
        return tuple(self.lru.values())

    # ---- slots ---------------------------------------------------------------------------------
    def acquire(self, name: str | None) -> bool:
        """Give a running request's adapter a slot (True), or say it must wait (False). The base
        model (None) always runs."""
        if name is None:
            return True
        slot = self.slot_of.get(name)
        if slot is None:
            slot = self._free_slot()
            if slot is None:
                return False
            self.slot_of[name] = slot
            self.pending[slot] = (name, self.identities[name])
            self.num_loads += 1
        self.lru[slot] = name
        self.lru.move_to_end(slot)
        self.users[name] += 1
        return True

    def release(self, name: str | None) -> None:
        """A request under `name` left the running batch."""
        if name is None:
            return
        left = self.users[name] - 1
        if left < 0:
            raise RuntimeError(f"lora slots: {name!r} released more often than acquired")
        if left:
            self.users[name] = left
        else:
            del self.users[name]

    def _free_slot(self) -> int | None:
        """An empty slot, else the least recently used one whose adapter nobody runs."""
        if len(self.lru) < self.max_loras:
            used = set(self.lru)
            return next(s for s in range(self.max_loras) if s not in used)
        for slot, old in self.lru.items():
            if not self.users[old]:
                del self.lru[slot]
                del self.slot_of[old]
                self.num_evictions += 1
                return slot
        return None

    def take_loads(self) -> dict[int, tuple[str, str]]:
        """The loads to send with this step (slot -> (name, identity)); forgotten once taken."""
        loads, self.pending = self.pending, {}
        return loads
