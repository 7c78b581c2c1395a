"""Serve's side of the llm autoscaling policy, without a cluster: Serve's own AutoscalingContext
in, the pure policy's decision out, its state kept in Serve's policy_state beside Serve's keys."""

from __future__ import annotations

from dataclasses import fields

from ray.serve._private.common import DeploymentID, ReplicaID
from ray.serve.config import AutoscalingContext

from cluster.autoscaling_policy import LLMAutoscalingPolicy, signals_from_context
from deploy.autoscaling_args import AutoscalingArgs
from router.autoscaling import AutoscalingPolicyConfig, ReplicaSignals, SignalTargets
from settings import build

DEPLOYMENT = DeploymentID(name="LLMReplica", app_name="app")
REPLICAS = [ReplicaID(unique_id=f"r{i}", deployment_id=DEPLOYMENT) for i in range(3)]


def context(
    reports: dict[ReplicaID, ReplicaSignals], target: int, state: dict, now: float = 1000.0
) -> AutoscalingContext:
    metrics: dict[str, dict[ReplicaID, float]] = {}
    for replica, signals in reports.items():
        for name, value in signals.to_dict().items():
            metrics.setdefault(name, {})[replica] = value
    return AutoscalingContext(
        deployment_id=DEPLOYMENT,
        deployment_name="LLMReplica",
        app_name="app",
        current_num_replicas=len(reports),
        target_num_replicas=target,
        running_replicas=list(reports),
        total_num_requests=0.0,
        total_queued_requests=0.0,
        aggregated_metrics=metrics,
        raw_metrics={},
        capacity_adjusted_min_replicas=1,
        capacity_adjusted_max_replicas=4,
        policy_state=state,
        last_scale_up_time=None,
        last_scale_down_time=None,
        current_time=now,
        config=None,
    )


def test_reports_become_signals_and_a_missing_one_is_left_out():
    full = ReplicaSignals(0.5, 2, 300, 4, 8, 0.2, None, 4096)
    ctx = context({REPLICAS[0]: full, REPLICAS[1]: full}, 2, {})
    del ctx.aggregated_metrics["kv_cache_usage"][REPLICAS[1]]  # its report is partial
    assert signals_from_context(ctx) == [full]


def test_the_policy_scales_on_the_context_and_keeps_serves_state_keys():
    policy = LLMAutoscalingPolicy(
        model="m", min_replicas=1, max_replicas=4, downscale_delay_s=60, slo={"ttft_p90_s": 1}
    )
    hot = ReplicaSignals(0.95, 4, 2000, 8, 8, 0.3, 0.01, 4096)
    replicas, state = policy(context({REPLICAS[0]: hot, REPLICAS[1]: hot}, 2, {"serve_key": 1}))
    assert replicas == 4 and state["serve_key"] == 1 and state["last_scale_up_s"] == 1000.0
    idle = ReplicaSignals(0.0, 0, 0, 0, 8, None, None, 4096)
    # 30 s on, the load's mean has fallen under half the load that asked: the fourth replica,
    # still starting, goes at once ...
    replicas, state = policy(context(dict.fromkeys(REPLICAS, idle), 4, state, now=1030.0))
    assert replicas == 3
    # ... and the three that report wait out the downscale delay.
    replicas, state = policy(context(dict.fromkeys(REPLICAS, idle), 3, state, now=1035.0))
    assert replicas == 3 and state["down_since_s"] == 1035.0


def test_the_apps_autoscaling_args_are_the_policys_config_declared_once():
    """deploy.yaml's `autoscaling:` is the policy's own declaration plus Serve's settings: the same
    defaults (the delays of both policies included), and Serve builds the policy from all of it."""
    args = AutoscalingArgs()
    shared = [f.name for f in fields(AutoscalingPolicyConfig)]
    assert isinstance(args, AutoscalingPolicyConfig)
    assert {n: getattr(args, n) for n in shared} == {
        n: getattr(AutoscalingPolicyConfig(), n) for n in shared
    }
    ongoing = args.serve_config("m")
    assert isinstance(ongoing, dict)
    assert (ongoing["upscale_delay_s"], ongoing["downscale_delay_s"]) == (
        args.upscale_delay_s,
        args.downscale_delay_s,
    )
    llm = build(
        AutoscalingArgs, {"policy": "llm", "max_replicas": 4, "targets": {"kv_cache_usage": 0.5}}
    )
    policy = LLMAutoscalingPolicy(**llm.serve_config("m").policy.policy_kwargs)
    assert policy.config == AutoscalingPolicyConfig(
        max_replicas=4, targets=SignalTargets(kv_cache_usage=0.5)
    )
