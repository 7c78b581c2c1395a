"""What a replica reports to the fleet router: its scheduler's figures, state and prefix report.

A plain dict only on the way through Serve (`record_routing_stats` returns one, and the router reads
it from `RunningReplica.routing_stats`): `to_dict` and `from_dict` are that edge.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, fields
from enum import Enum
from typing import Any, get_type_hints

from scheduler.block_manager import PrefixReport
from scheduler.kv_events import (
    ALL_TIERS,
    MAX_EVENTS_PER_BATCH,
    MAX_WINDOW_EVENTS,
    TIERS,
    KVEventBatch,
    KVEventReport,
    KVSnapshot,
)
from scheduler.outputs import SchedulerStats
from scheduler.predicted_load import PredictedLoad
from scheduler.request import check_lora_identity, check_lora_name

# How often Serve asks each replica for its report (request_routing_stats_period_s); the simulator
# reports at the same period.
ROUTING_STATS_PERIOD_S = 1.0
# Prefix hashes per report: enough to describe the hot prefixes, each report one pickled list of
# 128-bit ints.
MAX_REPORTED_PREFIX_HASHES = 4096


# Adapter names per report: a replica has a few dozen device slots.
MAX_REPORTED_LORAS = 1024
# Block hashes are 128-bit (scheduler.hashing).
_HASH_LIMIT = 1 << 128
_PREFIX_KEYS = (
    "prefix_hashes",
    "prefix_report_id",
    "prefix_base_id",
    "prefix_listed",
    "prefix_unlisted",
)


class ReplicaState(str, Enum):
    """How a replica stands; the router picks only OK replicas."""

    OK = "ok"
    FAILED = "failed"  # its engine loop died
    STALLED = "stalled"  # one engine step has overrun the stall timeout
    DRAINING = "draining"  # shutting down


_STATES = tuple(s.value for s in ReplicaState)


@dataclass(frozen=True, slots=True)
class RoutingStats:
    """One report of a replica to the router."""

    scheduler: SchedulerStats
    state: ReplicaState = ReplicaState.OK
    prefix: PrefixReport | None = None  # None: the engine could not be asked in time
    # Hashes the prefix cache's lower tiers hold (CPU, disk; docs/kv-tiers.md): a hit there saves
    # the prefill too, at the cost of a copy. None: tiers off, or not asked.
    tier_hashes: list[int] | None = None
    # Predicted remaining output tokens of its queues (scheduler/predicted_load.py), for the
    # router's load_signal predicted_tokens. None: not asked (the engine was busy or stopped).
    predicted: PredictedLoad | None = None
    # KV events since the replica's log began, as far as its window reaches, and maybe a snapshot
    # (scheduler/kv_events.py; the router's exact index, router/kv_events.py). None: not sent.
    kv_events: KVEventReport | None = None

    def to_dict(self) -> dict[str, Any]:
        """The report as Serve carries it: flat, plain values."""
        out = {f.name: getattr(self.scheduler, f.name) for f in fields(SchedulerStats)}
        out["loaded_loras"] = list(self.scheduler.loaded_loras)
        out["lora_identities"] = list(self.scheduler.lora_identities)
        out["state"] = self.state.value
        if self.prefix is not None:
            p = self.prefix
            values = (p.hashes, p.report_id, p.base_id, p.listed, p.unlisted)
            out.update(zip(_PREFIX_KEYS, values))
        if self.tier_hashes is not None:
            out["tier_hashes"] = self.tier_hashes
        if self.predicted is not None:
            out["predicted_remaining_tokens"] = self.predicted.tokens
            out["predicted_requests"] = self.predicted.requests
        if self.kv_events is not None:
            out.update(kv_events_to_dict(self.kv_events))
        return out

    @classmethod
    def from_dict(cls, report: Any) -> RoutingStats:
        """Parse what a replica sent; ValueError naming the first field that is missing or wrong."""
        if not isinstance(report, Mapping):
            raise ValueError(f"routing stats: expected a dict, got {type(report).__name__}")
        state = report.get("state", "ok")
        if state not in _STATES:
            raise ValueError(
                f"routing stats field 'state': expected one of {_STATES}, got {_short(state)}"
            )
        prefix = _prefix_report(report)
        tier = None
        if report.get("tier_hashes") is not None:
            tier = _block_hashes(report, "tier_hashes")
        predicted = _predicted_load(report)
        kv = kv_events_from_dict(report) if report.get("kv_batches") is not None else None
        return cls(_scheduler_stats(report), ReplicaState(state), prefix, tier, predicted, kv)


def _prefix_report(report: Mapping[str, Any]) -> PrefixReport | None:
    if report.get("prefix_hashes") is None:
        return None
    base_id = report.get("prefix_base_id")
    return PrefixReport(
        _block_hashes(report, "prefix_hashes"),
        _count(report, "prefix_report_id"),
        None if base_id is None else _count(report, "prefix_base_id"),
        _block_hashes(report, "prefix_listed"),
        _block_hashes(report, "prefix_unlisted"),
    )


def _predicted_load(report: Mapping[str, Any]) -> PredictedLoad | None:
    if report.get("predicted_remaining_tokens") is None:
        return None
    return PredictedLoad(
        _count(report, "predicted_remaining_tokens"), _count(report, "predicted_requests")
    )


_FIELD_TYPES = get_type_hints(SchedulerStats)


def _scheduler_stats(report: Mapping[str, Any]) -> SchedulerStats:
    """SchedulerStats from the report's fields; those with a default there may be absent."""
    values: dict[str, Any] = {}
    for f in fields(SchedulerStats):
        if f.name not in report and f.default is not MISSING:
            continue
        if _FIELD_TYPES[f.name] is int:
            values[f.name] = _count(report, f.name)
        elif _FIELD_TYPES[f.name] == tuple[str, ...]:
            check = check_lora_identity if f.name == "lora_identities" else check_lora_name
            values[f.name] = _names(report, f.name, check)
        else:
            values[f.name] = _figure(report, f.name)
    return SchedulerStats(**values)


def _field(report: Mapping[str, Any], key: str) -> Any:
    if key not in report:
        raise ValueError(f"routing stats field {key!r}: missing")
    return report[key]


def _count(report: Mapping[str, Any], key: str) -> int:
    value = _field(report, key)
    if type(value) is not int or value < 0:
        raise ValueError(
            f"routing stats field {key!r}: expected an integer >= 0, got {_short(value)}"
        )
    return value


def _figure(report: Mapping[str, Any], key: str) -> float:
    value = _field(report, key)
    if type(value) not in (int, float) or not math.isfinite(value) or value < 0:
        raise ValueError(
            f"routing stats field {key!r}: expected a number >= 0, got {_short(value)}"
        )
    return float(value)


def _names(report: Mapping[str, Any], key: str, check: Callable[[object], str]) -> tuple[str, ...]:
    value = _field(report, key)
    if type(value) not in (list, tuple) or len(value) > MAX_REPORTED_LORAS:
        raise ValueError(
            f"routing stats field {key!r}: expected a list of at most {MAX_REPORTED_LORAS} adapter "
            f"names, got {_short(value)}"
        )
    for name in value:
        try:
            check(name)
        except ValueError as e:
            raise ValueError(f"routing stats field {key!r}: {e}") from None
    return tuple(value)


def _block_hashes(report: Mapping[str, Any], key: str) -> list[int]:
    value = _field(report, key)
    # C-level passes: every report of every replica carries a few thousand hashes.
    if type(value) is not list or (
        value and (set(map(type, value)) != {int} or min(value) < 0 or max(value) >= _HASH_LIMIT)
    ):
        raise ValueError(
            f"routing stats field {key!r}: expected a list of block hashes (integers in "
            f"[0, 2**128)), got {_short(value)}"
        )
    return value


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


# Batches per report: a window of MAX_WINDOW_EVENTS events holds at most as many non-empty batches
# (an overflowed one is empty: counted here too).
MAX_REPORTED_BATCHES = MAX_WINDOW_EVENTS + 1
# Hashes per snapshot tier: the router's per-replica entry bound (router/kv_events.py).
MAX_SNAPSHOT_HASHES = 1 << 22
# An event's code on the wire: kind * 8 + tier bit (plain ints, checked in one C-level pass).
_EVENT_CODES = frozenset(kind * 8 + tier for kind in (0, 1) for tier in TIERS)


def kv_events_to_dict(report: KVEventReport) -> dict[str, Any]:
    """A KV event report as flat lists: each batch [seq, overflowed, codes, hashes]."""
    batches = [
        [b.seq, b.overflowed, [k * 8 + t for k, t, _ in b.events], [h for *_, h in b.events]]
        for b in report.batches
    ]
    out: dict[str, Any] = {"kv_batches": batches, "kv_seq": report.seq}
    snap = report.snapshot
    if snap is not None:
        out["kv_snapshot"] = [snap.seq, snap.device, snap.cpu, snap.disk]
    return out


def kv_events_from_dict(report: Mapping[str, Any]) -> KVEventReport:
    """The KV event report a replica sent; ValueError naming the field that is wrong."""
    raw = _field(report, "kv_batches")
    if type(raw) is not list or len(raw) > MAX_REPORTED_BATCHES:
        raise ValueError(
            f"routing stats field 'kv_batches': expected a list of at most {MAX_REPORTED_BATCHES} "
            f"batches, got {_short(raw)}"
        )
    batches = [_kv_batch(b) for b in raw]
    snapshot = None
    if report.get("kv_snapshot") is not None:
        snapshot = _kv_snapshot(report["kv_snapshot"])
    seq = _count(report, "kv_seq")
    if seq >= 1 << 63:
        raise ValueError(
            f"routing stats field 'kv_seq': expected an integer below 2**63, got {seq}"
        )
    return KVEventReport(batches, snapshot, seq)


def _kv_batch(raw: Any) -> KVEventBatch:
    key = "kv_batches"
    if type(raw) is not list or len(raw) != 4:
        raise ValueError(
            f"routing stats field {key!r}: a batch is [seq, overflowed, codes, hashes]"
        )
    seq, overflowed, codes, hashes = raw
    if type(seq) is not int or not 1 <= seq < 1 << 63 or type(overflowed) is not bool:
        raise ValueError(f"routing stats field {key!r}: bad batch header {_short(raw[:2])}")
    if (
        type(codes) is not list
        or len(codes) > MAX_EVENTS_PER_BATCH
        or not _EVENT_CODES.issuperset(codes)
        or set(map(type, codes)) - {int}
    ):
        raise ValueError(f"routing stats field {key!r}: bad event codes {_short(codes)}")
    hashes = _block_hashes({key: hashes}, key)
    if len(hashes) != len(codes):
        raise ValueError(f"routing stats field {key!r}: {len(codes)} codes, {len(hashes)} hashes")
    events = [(c >> 3, c & ALL_TIERS, h) for c, h in zip(codes, hashes)]
    return KVEventBatch(seq, events, overflowed)


def _kv_snapshot(raw: Any) -> KVSnapshot:
    key = "kv_snapshot"
    if (
        type(raw) is not list
        or len(raw) != 4
        or type(raw[0]) is not int
        or not 0 <= raw[0] < 1 << 63
    ):
        raise ValueError(
            f"routing stats field {key!r}: expected [seq, device, cpu, disk], got {_short(raw)}"
        )
    tiers = []
    for hashes in raw[1:]:
        if type(hashes) is list and len(hashes) > MAX_SNAPSHOT_HASHES:
            raise ValueError(
                f"routing stats field {key!r}: more than {MAX_SNAPSHOT_HASHES} hashes in a tier"
            )
        tiers.append(_block_hashes({key: hashes}, key))
    return KVSnapshot(raw[0], *tiers)
