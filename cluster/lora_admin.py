"""Run-time LoRA adapter changes addressed to one replica each.

The ingress sends a LoraCommand to every replica of the deployment: the fleet router
(cluster/serve_router.py) routes a command to the replica it names instead of ranking replicas, so
one handle reaches each replica in turn. A replica that is not the one named refuses the command
(the named one died between the ingress listing replicas and the call).
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduler.request import check_lora_name

OPS = ("add", "remove")
MAX_LORA_PATH_CHARS = 4096


class WrongReplicaError(RuntimeError):
    """A command reached a replica other than the one it names."""


@dataclass(frozen=True, slots=True)
class LoraCommand:
    """Add (load) or remove (unload) adapter `name` on replica `replica`."""

    replica: str
    op: str
    name: str
    path: str = ""

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ValueError(f"op: must be one of {OPS}, got {self.op!r}")
        check_lora_name(self.name)
        if self.op == "add" and not 0 < len(self.path) <= MAX_LORA_PATH_CHARS:
            raise ValueError(f"lora_path: must be 1 to {MAX_LORA_PATH_CHARS} characters")
