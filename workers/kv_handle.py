"""TransferHandle in a module of its own, torch-free: a prefill replica's reply carries one through
the ingress to a decode replica (engine/disagg_reply.py), and the ingress that unpickles it must not
import the KV machinery (torch, workers/kv_transfer.py) to do so."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class TransferHandle:
    """What travels from the prefill side to the decode side in place of the KV: the transfer's
    key, the hashes it carries, and the transport's own reference (an ObjectRef in a list, so Ray
    passes it by reference; None for the in-process transport)."""

    key: str
    hashes: list[int]
    ref: list[object] = field(default_factory=list)
    # Tensor parallelism: rank r's own handle at shards[r] (its KV heads; same hashes); empty at
    # one rank, where this handle is the rank's.
    shards: list[TransferHandle] = field(default_factory=list)
    # How many receiving ranks fetch this part (several when a decode engine of more ranks splits
    # one sender's heads): a transport that holds the payload for pulls frees it after that many.
    readers: int = 1

    @property
    def parts(self) -> list[TransferHandle]:
        """The sending ranks' handles, by rank."""
        return self.shards or [self]
