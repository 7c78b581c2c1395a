"""Adapter affinity: which replicas hold which LoRA adapters, and the preference for them.

Loading an adapter into a replica's device slot costs a read from disk or the CPU cache and may
evict another adapter, so a request for an adapter goes to a replica that already holds it when one
is within the load ceiling of prefix affinity (router/policies.py). An adapter no acceptable replica
holds (a cold one) goes by load, so cold adapters spread over the fleet.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

# Keyed rows as the policies build them: (load, turn, replica).
Keyed = tuple[float, int, str]


class AdapterIndex:
    """Which replicas are believed to hold which adapters in their device slots.

    A replica's report lists its loaded adapters. Routing a request for an adapter to a replica
    plants the adapter there, since the replica will load it: a burst for a cold adapter then
    follows its first member instead of loading the adapter on every replica. A planted adapter
    survives reports that lack it for grace_s (they may have been taken before the request arrived).
    """

    def __init__(self) -> None:
        self._reported: dict[str, frozenset[str]] = {}
        self._planted: dict[str, dict[str, float]] = {}  # replica -> {adapter: when planted}

    def holds(self, replica: str, adapter: str) -> bool:
        return adapter in self._reported.get(replica, ()) or adapter in self._planted.get(
            replica, ()
        )

    def adapters_of(self, replica: str) -> set[str]:
        return set(self._reported.get(replica, ())) | set(self._planted.get(replica, ()))

    def replicas(self) -> set[str]:
        return set(self._reported) | set(self._planted)

    def plant(self, replica: str, adapter: str, now: float) -> None:
        """Routing sent a request for adapter to replica at now."""
        self._planted.setdefault(replica, {})[adapter] = now

    def sync_replica(self, replica: str, loaded: Iterable[str], now: float, grace_s: float) -> None:
        """Apply the replica's report of its loaded adapters; planted adapters it lacks are dropped
        once older than grace_s, and those it lists need no planting any more."""
        reported = frozenset(loaded)
        if reported or replica in self._reported:
            self._reported[replica] = reported
        planted = self._planted.get(replica)
        if not planted:
            return
        cutoff = now - grace_s
        for adapter in [a for a, t in planted.items() if a in reported or t < cutoff]:
            del planted[adapter]
        if not planted:
            del self._planted[replica]

    def remove_replica(self, replica: str) -> None:
        self._reported.pop(replica, None)
        self._planted.pop(replica, None)


def holders_within(eligible: Sequence[Keyed], adapter: str, index: AdapterIndex) -> list[Keyed]:
    """The rows of eligible whose replica holds adapter (empty: the adapter is cold there)."""
    return [k for k in eligible if index.holds(k[2], adapter)]


def routing_lora_key(lora: str | None, identities: Iterable[str]) -> str | None:
    """What an adapter request's prompt is hashed under for prefix affinity: the identity
    (`name@digest`) a replica reports for the adapter, as the replicas' caches key its blocks;
    the name until one does (then only the router's own planted hashes can match)."""
    if lora is None:
        return None
    prefix = f"{lora}@"
    return next((i for i in identities if i.startswith(prefix)), lora)
