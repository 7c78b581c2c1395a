"""The fleet router's settings, declared once (the app passes them as request_router_kwargs)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from scheduler.sampling_params import MAX_TOKENS
from settings import build, check_settings, setting

POLICIES = ("round_robin", "least_loaded", "power_of_two", "prefix_affinity")
IMBALANCE_REFERENCES = ("least", "mean")
LOAD_SIGNALS = ("requests", "predicted_tokens")
# Load units (about one in-flight request each) and factors of load: past the in-flight requests any
# replica takes (AppConfig.max_ongoing_requests, bounded by this too), a larger figure changes no
# choice.
MAX_LOAD = 1 << 20
# How long the router remembers what a replica's reports do not confirm: a day.
MAX_MEMORY_S = 86400
# Routed requests whose outcome the router can still attribute (a few minutes of heavy traffic).


@dataclass(slots=True)
class RoutingConfig:
    """Knobs of the fleet router; the app config passes them, by these names, as
    request_router_kwargs."""

    router_policy: str = setting("prefix_affinity", "how replicas are ranked", choices=POLICIES)
    imbalance_threshold: float = setting(
        4.0,
        "load units (about one in-flight request each) by which the prefix holder may exceed the "
        "reference load (imbalance_reference) before load wins over affinity",
        ge=0,
        le=MAX_LOAD,
    )
    # Under heavy load a few requests of skew cost little next to recomputing a prefix, and a fixed
    # threshold alone would spill every tenant everywhere.
    imbalance_ratio: float = setting(
        1.5,
        "...or by this factor of the reference load, whichever allows more",
        ge=1,
        le=MAX_LOAD,
    )
    # The least loaded of N replicas falls towards idle as N grows, so a ceiling above it spills
    # tenants off their holders ever more often in a larger fleet; the mean does not move with N.
    imbalance_reference: str = setting(
        "mean",
        "the load the ceiling is set above: the least loaded replica's or the fleet's mean",
        choices=IMBALANCE_REFERENCES,
    )
    adapter_affinity: bool = setting(
        True,
        "prefix_affinity sends a LoRA adapter's requests to replicas that hold the adapter, within "
        "the same load ceiling; a cold adapter goes to the least loaded replica",
    )
    min_match_blocks: int = setting(
        1,
        "leading prompt blocks a replica must hold for affinity to count",
        ge=1,
        le=MAX_TOKENS,
    )
    tier_hit_discount: float = setting(
        0.5,
        "prefix_affinity: a prompt block a replica holds only in a lower KV tier (CPU, disk; "
        "docs/kv-tiers.md) counts as this share of a block in its device cache",
        ge=0,
        le=1,
    )
    # Per replica, so that the index grows with the fleet: one global bound squeezed each replica's
    # share as replicas were added (hit rate 44.8% at 10 replicas, 28.9% at 1,000).
    index_blocks_per_replica: int = setting(
        0,
        "prefix-index entries kept per replica, least recently used dropped first (0: the KV "
        "blocks the replica reports it has; 4096 until it reports)",
        ge=0,
        le=1 << 32,
    )
    max_index_blocks: int | None = setting(
        None,
        "optional cap on the prefix index's entries over all replicas, taken from the replica "
        "with the most (unset: the sum of the per-replica bounds)",
        ge=1,
        le=1 << 40,
    )
    tokens_per_request: int = setting(
        2048,
        "in-flight tokens (prompt + max new tokens) that weigh as much as one in-flight request",
        ge=1,
        le=MAX_TOKENS,
    )
    load_signal: str = setting(
        "requests",
        "what a replica's load counts: its requests, or the output tokens its length predictor "
        "says its requests have left (predicted_tokens; requests while it has no estimate)",
        choices=LOAD_SIGNALS,
    )
    predicted_tokens_per_request: int = setting(
        128,
        "load_signal predicted_tokens: predicted remaining tokens that weigh as one request, and "
        "what a request without an estimate counts as",
        ge=1,
        le=1 << 20,
    )
    kv_usage_weight: float = setting(
        1.0, "weight of a replica's KV usage (0-1) in its load", ge=0, le=MAX_LOAD
    )
    # The report may have been taken before the request that planted the entries arrived.
    stats_grace_s: float = setting(
        5.0,
        "prefix-index entries younger than this survive a replica's prefix report that lacks them",
        ge=0,
        le=MAX_MEMORY_S,
    )
    unconfirmed_ttl_s: float = setting(
        30.0,
        "a routing decision Serve never confirmed (request cancelled "
        "before send) stops counting after this",
        gt=0,
        le=MAX_MEMORY_S,
    )
    circuit_breaker_failures: int = setting(
        3,
        "consecutive requests failed by a replica (actor died or unreachable, engine failed) "
        "after which "
        "the router skips that replica (0: never)",
        ge=0,
        le=1_000_000,
    )
    circuit_breaker_cooldown_s: float = setting(
        10.0,
        "a replica's open circuit lets one probe through after this long without a failure; a "
        "success or a fresh `ok` stats report closes it",
        gt=0,
        le=86400,
    )
    seed: int | None = setting(None, "seed of the power_of_two policy's choices", ge=0, lt=2**63)
    # Peer-to-peer prefix pulls (router/peer_pull.py, docs/router.md). The replicas read these
    # too, from the same request_router_kwargs: a replica takes pulls only when they are on.
    peer_pulls: bool = setting(
        False,
        "a replica chosen for load pulls the prompt blocks a peer holds beyond its own (by the "
        "peer's KV events) through the KV transport, when the cost model says that beats the "
        "prefill",
    )
    min_pull_blocks: int = setting(
        4, "peer_pulls: the fewest blocks worth a pull", ge=1, le=1 << 20
    )
    pull_timeout_s: float = setting(
        2.0,
        "peer_pulls: the longest a request waits for the peer's export (and its step for the "
        "blocks) before it computes its prompt instead",
        gt=0,
        le=600,
    )
    pull_bytes_per_s: float = setting(
        1e9, "peer_pulls cost model: KV bytes a second a pull moves", gt=0, le=1e13
    )
    pull_fixed_s: float = setting(
        0.01,
        "peer_pulls cost model: a pull's fixed cost in seconds (the peer's export call, its step "
        "in progress)",
        ge=0,
        le=60,
    )
    prefill_tokens_per_s: float = setting(
        5000.0,
        "peer_pulls cost model: prompt tokens a second the pulling replica prefills",
        gt=0,
        le=1e9,
    )

    def __post_init__(self) -> None:
        check_settings(self)

    @classmethod
    def from_router_kwargs(cls, kwargs: Mapping[str, Any] | None) -> RoutingConfig:
        """Validated config from request_router_kwargs; an unknown key or a bad value raises
        ValueError naming it (`router_kwargs.<key>`)."""
        return build(cls, kwargs, "router_kwargs.")
