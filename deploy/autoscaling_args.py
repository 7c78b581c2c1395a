"""Replica autoscaling as the app declares it (deploy.yaml `autoscaling:`): the policy's own
settings (router/autoscaling.py) plus Serve's, and the autoscaling_config Serve is given."""

from __future__ import annotations

import warnings
from dataclasses import asdict, dataclass, fields
from typing import Any

from ray.serve.config import AutoscalingConfig, AutoscalingPolicy

from cluster.autoscaling_policy import POLICY_PATH
from router.autoscaling import MAX_REPLICAS, AutoscalingPolicyConfig
from router.config import MAX_LOAD
from settings import setting

AUTOSCALING_POLICIES = ("ongoing_requests", "llm")


@dataclass(slots=True)
class AutoscalingArgs(AutoscalingPolicyConfig):
    """Replica autoscaling (Serve's autoscaling_config): on ongoing requests per replica (Serve's
    default policy), or on LLM signals (router/autoscaling.py: KV usage, queues, batch and the
    measured latency against `slo`). The bounds, delays, SLO and targets are the policy's own
    declaration (`AutoscalingPolicyConfig`, both policies share its delays); these are the rest."""

    initial_replicas: int | None = setting(
        None, "replicas at start (unset: min_replicas)", ge=0, le=MAX_REPLICAS
    )
    policy: str = setting(
        "ongoing_requests",
        "`ongoing_requests` (Serve's default: `target_ongoing_requests` per replica) or `llm` "
        "(KV-cache usage, waiting requests and queued prompt tokens, the running batch against "
        "max_num_seqs, and the measured TTFT and ITL p90 against `slo`; docs/operations.md)",
        choices=AUTOSCALING_POLICIES,
    )
    target_ongoing_requests: float = setting(
        16.0,
        "ongoing requests per replica that the `ongoing_requests` policy aims at",
        gt=0,
        le=MAX_LOAD,
    )
    look_back_period_s: float = setting(
        30.0, "Serve averages the replicas' figures over this window", gt=0, le=3600
    )
    metrics_interval_s: float = setting(
        10.0, "how often each replica pushes its figures to Serve's controller", gt=0, le=3600
    )

    def serve_config(self, model: str) -> dict[str, Any] | AutoscalingConfig:
        """Serve's autoscaling_config: the `llm` policy's hysteresis is its own (Serve's delays
        0), and Serve builds the policy once from these settings."""
        common = self._common()
        if self.policy == "ongoing_requests":
            return {
                **common,
                "target_ongoing_requests": self.target_ongoing_requests,
                "upscale_delay_s": self.upscale_delay_s,
                "downscale_delay_s": self.downscale_delay_s,
            }
        policy = self._llm(model)
        with warnings.catch_warnings():  # Serve marks metrics_interval_s deprecated
            warnings.simplefilter("ignore", DeprecationWarning)
            return AutoscalingConfig(
                **common, upscale_delay_s=0.0, downscale_delay_s=0.0, policy=policy
            )

    def _common(self) -> dict[str, Any]:
        """The settings Serve reads under either policy."""
        common: dict[str, Any] = {
            "min_replicas": self.min_replicas,
            "max_replicas": self.max_replicas,
            "look_back_period_s": self.look_back_period_s,
            "metrics_interval_s": self.metrics_interval_s,
        }
        if self.initial_replicas is not None:
            common["initial_replicas"] = self.initial_replicas
        return common

    def _llm(self, model: str) -> AutoscalingPolicy:
        """The `llm` policy (cluster/autoscaling_policy.py) with its own settings. Built here, it
        pickles the policy class; from a plain dict Serve's validation would skip that."""
        kwargs = {
            "model": model,
            **{f.name: getattr(self, f.name) for f in fields(AutoscalingPolicyConfig)},
            "slo": asdict(self.slo),
            "targets": asdict(self.targets),
        }
        return AutoscalingPolicy(policy_function=POLICY_PATH, policy_kwargs=kwargs)
