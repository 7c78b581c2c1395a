"""Weight updates and sleep of a served replica, addressed to one replica each (as LoRA commands
are, cluster/lora_admin.py: the fleet router routes a command to the replica it names, so the
ingress reaches every replica in turn). The replica runs each on its engine thread between steps
(engine/weights.py)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.weight_modes import IN_FLIGHT, SLEEP_LEVELS

if TYPE_CHECKING:
    from cluster.engine_loop import EngineLoop
    from engine.core import EngineCore

OPS = ("update_weights", "sleep", "wake_up", "status")
MAX_WEIGHTS_PATH_CHARS = 4096


@dataclass(frozen=True, slots=True)
class WeightsCommand:
    """One replica's weights operation: `update_weights` from `path`, `sleep` at `level`,
    `wake_up`, or `status` (its sleep level)."""

    replica: str
    op: str
    path: str = ""
    in_flight: str = "finish"
    level: int = 1
    discard_weights: bool = False

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ValueError(f"op: must be one of {OPS}, got {self.op!r}")
        if self.op == "update_weights" and not 0 < len(self.path) <= MAX_WEIGHTS_PATH_CHARS:
            raise ValueError(f"path: must be 1 to {MAX_WEIGHTS_PATH_CHARS} characters")
        if self.in_flight not in IN_FLIGHT:
            raise ValueError(f"in_flight: must be one of {IN_FLIGHT}, got {self.in_flight!r}")
        if isinstance(self.level, bool) or self.level not in SLEEP_LEVELS:
            raise ValueError(f"level: must be 1 or 2, got {self.level!r}")
        if not isinstance(self.discard_weights, bool):
            raise ValueError("discard_weights: must be true or false")


async def run_command(
    loop: EngineLoop, engine: EngineCore, command: WeightsCommand
) -> dict[str, Any]:
    """Apply the command on the engine thread (an update waits until it has applied: at once, or
    once the requests in flight finish); the replica's state after it."""
    if command.op == "update_weights":
        done = await loop.call(
            lambda _: engine.update_weights(command.path, in_flight=command.in_flight)
        )
        await asyncio.wrap_future(done)
    elif command.op == "sleep":
        await loop.call(lambda _: engine.sleep(command.level, command.discard_weights))
    elif command.op == "wake_up":
        await loop.call(lambda _: engine.wake_up())
    return {
        "sleep_level": engine.sleep_level,
        "weights_discarded": engine.weights.discarded,
        "weight_updates": engine.weights.num_updates,
    }
