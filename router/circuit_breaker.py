"""Per-replica circuit breaker of the fleet router: repeated failures take a replica out of routing.

Pure logic on an injected clock: router.fleet.FleetState consults it. How each request ended reaches
it through cluster/outcomes.py.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Circuit:
    failures: int = 0  # consecutive, since the last success
    opened_at: float | None = None  # last failure while open; None while closed
    probe_at: float | None = None  # when the last half-open probe was let through


class CircuitBreaker:
    """Opens for a replica after `threshold` consecutive failures; the router then skips it.

    After `cooldown_s` without a new failure the circuit is half-open: one probe request per
    cool-down may go there, and a success (a request that finished there, or a fresh `ok` stats
    report) closes it. A failure while open restarts the cool-down. threshold 0 disables breaking.
    While closed, a request that finishes there resets the count; a stats report does not (a
    replica can report `ok` and still fail every request).
    """

    def __init__(self, threshold: int, cooldown_s: float) -> None:
        self.threshold = threshold
        self.cooldown_s = cooldown_s
        self._circuits: dict[str, _Circuit] = {}

    def record_failure(self, replica: str, now: float) -> bool:
        """Count a failure attributed to replica; True if this one opened its circuit."""
        if self.threshold == 0:
            return False
        circuit = self._circuits.setdefault(replica, _Circuit())
        circuit.failures += 1
        if circuit.opened_at is not None:
            circuit.opened_at = now
            return False
        if circuit.failures < self.threshold:
            return False
        circuit.opened_at = now
        logger.warning(
            "circuit of replica %s opened after %d consecutive failures; skipped for %.1f s",
            replica,
            circuit.failures,
            self.cooldown_s,
        )
        return True

    def record_success(self, replica: str, now: float) -> None:
        """A request finished on replica: its failures were not consecutive; a half-open circuit
        closes."""
        circuit = self._circuits.get(replica)
        if circuit is not None and self._cooled_down(circuit, now):
            self._close(replica, circuit)

    def record_healthy_report(self, replica: str, now: float) -> None:
        """replica sent a fresh `ok` stats report: an open circuit whose cool-down has passed
        closes."""
        circuit = self._circuits.get(replica)
        if (
            circuit is not None
            and circuit.opened_at is not None
            and self._cooled_down(circuit, now)
        ):
            self._close(replica, circuit)

    def _cooled_down(self, circuit: _Circuit, now: float) -> bool:
        # Within the cool-down a success may predate the failures that opened the circuit: outcomes
        # and reports reach the router late.
        return circuit.opened_at is None or now - circuit.opened_at >= self.cooldown_s

    def _close(self, replica: str, circuit: _Circuit) -> None:
        if circuit.opened_at is not None:
            logger.info("circuit of replica %s closed", replica)
        del self._circuits[replica]

    def allows(self, replica: str, now: float) -> bool:
        """Whether the router may pick replica now: closed, or half-open with no probe this
        cool-down."""
        circuit = self._circuits.get(replica)
        if circuit is None or circuit.opened_at is None:
            return True
        return (
            now - max(circuit.opened_at, circuit.probe_at or circuit.opened_at) >= self.cooldown_s
        )

    def on_picked(self, replica: str, now: float) -> None:
        """The router sent a request to replica: if its circuit is half-open, that was the probe."""
        circuit = self._circuits.get(replica)
        if circuit is not None and circuit.opened_at is not None:
            circuit.probe_at = now

    def any_open(self) -> bool:
        """Whether some circuit is open (else every replica is allowed, and callers may skip
        asking)."""
        return any(c.opened_at is not None for c in self._circuits.values())

    def is_open(self, replica: str) -> bool:
        circuit = self._circuits.get(replica)
        return circuit is not None and circuit.opened_at is not None

    def forget(self, replica: str) -> None:
        self._circuits.pop(replica, None)

    def replicas(self) -> set[str]:
        return set(self._circuits)
