"""Serve's custom autoscaling policy for a model's LLMReplica deployment: router.autoscaling.decide
on the signals replicas record.

Each replica returns its `ReplicaSignals` from `record_autoscaling_stats`; Serve averages them over
`look_back_period_s` and hands the controller an AutoscalingContext. `LLMAutoscalingPolicy` (a
class, so that Serve builds it once with the app's settings as policy_kwargs) turns the context
into the pure policy's inputs, keeps the policy's state in Serve's policy_state, and counts each
change of the replica count by its reason for the dashboards. Serve's own upscale and downscale
delays are set to 0 for this policy (deploy/config.py): the hysteresis is the policy's. A replica
that Serve removes drains: Serve waits for its requests, and past graceful_shutdown_timeout_s the
ingress resumes them elsewhere, so no request is lost.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING, Any

from ray.util.metrics import Counter, Gauge

from router.autoscaling import (
    AutoscalingPolicyConfig,
    AutoscalingState,
    ReplicaSignals,
    decide,
)
from settings import build

if TYPE_CHECKING:
    from ray.serve.config import AutoscalingContext

logger = logging.getLogger(__name__)

# Where deploy/config.py points Serve (module:attribute).
POLICY_PATH = "cluster.autoscaling_policy:LLMAutoscalingPolicy"
_SIGNAL_NAMES = tuple(f.name for f in dataclasses.fields(ReplicaSignals))


class AutoscalingMetrics:
    """What the controller exports per model: the replica count it runs and aims at, and each
    change of the target count by its reason."""

    def __init__(self, model: str) -> None:
        tags = {"model": model}
        self.replicas = Gauge(
            "raylm_autoscaling_replicas", "Running replicas of the model.", tag_keys=("model",)
        )
        self.target = Gauge(
            "raylm_autoscaling_target_replicas",
            "Replicas the autoscaling policy asks for (starting ones included).",
            tag_keys=("model",),
        )
        self.decisions = Counter(
            "raylm_autoscaling_decisions_total",
            "Changes of the model's replica count, by the policy's reason.",
            tag_keys=("model", "reason", "direction"),
        )
        for metric in (self.replicas, self.target, self.decisions):
            metric.set_default_tags(tags)

    def record(self, running: int, before: int, after: int, reason: str) -> None:
        self.replicas.set(running)
        self.target.set(after)
        if after != before:
            direction = "up" if after > before else "down"
            self.decisions.inc(1, tags={"reason": reason, "direction": direction})


def signals_from_context(ctx: AutoscalingContext) -> list[ReplicaSignals]:
    """One ReplicaSignals per running replica that has reported every signal (a replica still
    starting, or one whose report failed, is left out)."""
    metrics = ctx.aggregated_metrics or {}
    out = []
    for replica in ctx.running_replicas:
        report = {
            name: metrics[name][replica]
            for name in _SIGNAL_NAMES
            if replica in metrics.get(name, {})
        }
        if len(report) < len(_SIGNAL_NAMES):
            continue
        try:
            out.append(ReplicaSignals.from_dict(report))
        except ValueError:
            logger.warning("replica %s: bad autoscaling report %s", replica, report, exc_info=True)
    return out


class LLMAutoscalingPolicy:
    """Serve calls the instance with an AutoscalingContext and gets (replicas, policy_state)."""

    def __init__(self, model: str = "", **settings: Any) -> None:
        self.model = model
        self.config = build(AutoscalingPolicyConfig, settings, "autoscaling.")
        self._metrics: AutoscalingMetrics | None = None

    def __call__(self, ctx: AutoscalingContext) -> tuple[int, dict[str, Any]]:
        config = self.config
        lo, hi = ctx.capacity_adjusted_min_replicas, ctx.capacity_adjusted_max_replicas
        if (lo, hi) != (config.min_replicas, config.max_replicas) and lo <= hi and hi >= 1:
            config = dataclasses.replace(config, min_replicas=lo, max_replicas=hi)
        state = AutoscalingState.from_dict(ctx.policy_state)
        now = ctx.current_time if ctx.current_time is not None else time.time()
        current = ctx.target_num_replicas
        decision = decide(signals_from_context(ctx), current, config, state, now)
        if decision.replicas != current:
            logger.info(
                "autoscaling %s: %d -> %d replicas (%s)",
                self.model or ctx.deployment_name,
                current,
                decision.replicas,
                decision.reason,
            )
        if self._metrics is None:
            self._metrics = AutoscalingMetrics(self.model or ctx.deployment_name)
        self._metrics.record(ctx.current_num_replicas, current, decision.replicas, decision.reason)
        return decision.replicas, {**ctx.policy_state, **decision.state.to_dict()}
