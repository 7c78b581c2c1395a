"""The LoRA routing study: adapter-affinity routing against load-only routing.

    python -m sim.lora_study [--sizes 8 64] [--seconds 60] [--slots 4] [--load-s 0.05]

Every request names one of `adapters_per_replica` x N adapters, drawn from a Zipf(s) popularity;
prompts share no prefix, so the only locality to exploit is the adapter. Each replica holds
`slots` adapters (the production scheduler's slots: a request whose adapter cannot get one waits),
and a step that loads an adapter takes `load_s` longer (sim/adapters.py). The load is set at half
of a replica's capacity, measured without adapters. Prints one row per router and size: the share
of requests whose adapter was loaded on their replica when they arrived (the hit rate), loads per
replica-minute, TTFT and goodput.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

from router.config import RoutingConfig
from scheduler import SchedulerConfig
from sim.adapters import AdapterMix, AdapterSlotsConfig, with_adapters
from sim.cost import load_profile
from sim.fleet import FleetSim
from sim.fleet_config import SimConfig
from sim.lora_replica import LoraSimReplica
from sim.studies import FLEET_PROFILE, capacity
from sim.workload import SimRequest, WorkloadConfig, synthetic_workload

# (label, router_policy, adapter_affinity)
ROUTERS = (
    ("least_loaded", "least_loaded", False),
    ("power_of_two", "power_of_two", False),
    ("adapter_affinity", "prefix_affinity", True),
)


@dataclass(frozen=True, slots=True)
class LoraStudy:
    """The study's workload and fleet, per replica so that every size sees the same problem."""

    seconds: float = 60.0
    adapters_per_replica: int = 4
    zipf_s: float = 1.0
    slots: int = 4
    load_s: float = 0.05
    question_len: tuple[int, int] = (128, 384)
    output_len: tuple[int, int] = (16, 64)

    def workload(self, n: int, rate_per_replica: float, adapters: bool = True) -> list[SimRequest]:
        base = synthetic_workload(
            WorkloadConfig(
                num_requests=int(rate_per_replica * n * self.seconds),
                rate=rate_per_replica * n,
                tenants=1,
                system_prompt_len=0,
                question_len=self.question_len,
                output_len=self.output_len,
                seed=0,
            )
        )
        if not adapters:
            return base
        return with_adapters(base, AdapterMix(self.adapters_per_replica * n, self.zipf_s))

    def config(
        self, n: int, router: str, adapter_affinity: bool, adapters: bool = True
    ) -> SimConfig:
        return SimConfig(
            num_replicas=n,
            scheduler=SchedulerConfig(num_gpu_blocks=1024, max_model_len=1024),
            routing=RoutingConfig(router_policy=router, adapter_affinity=adapter_affinity, seed=0),
            adapters=AdapterSlotsConfig(self.slots, self.load_s) if adapters else None,
            keep_itl=False,
        )

    def capacity(self) -> float:
        """A replica's requests/s without adapters (least loaded routing)."""
        return capacity(
            lambda n, seconds, rate: LoraStudy(seconds=seconds).workload(n, rate, adapters=False),
            lambda n: self.config(n, "least_loaded", False, adapters=False),
            overload_rate=64.0,
            seconds=120.0,
            warmup_s=30.0,
        )

    def run(self, n: int, rate_per_replica: float, label: str) -> dict[str, float | str]:
        _, router, affinity = next(r for r in ROUTERS if r[0] == label)
        result = FleetSim(self.config(n, router, affinity), load_profile(FLEET_PROFILE)).run(
            self.workload(n, rate_per_replica)
        )
        replicas = [r for r in result.replicas if isinstance(r, LoraSimReplica)]
        summary = result.summary(slo_ttft_s=1.0, slo_itl_s=0.5)
        requests = sum(r.lora_requests for r in replicas)
        return {
            "router": label,
            "replicas": n,
            "adapter_hit_rate": sum(r.lora_hits for r in replicas) / max(1, requests),
            "loads_per_replica_min": sum(r.slots.num_loads for r in replicas)
            / n
            / (self.seconds / 60),
            "evictions": sum(r.slots.num_evictions for r in replicas),
            "ttft_p50_s": summary["ttft_p50_s"],
            "ttft_p90_s": summary["ttft_p90_s"],
            "goodput_rps": summary["goodput_rps"],
            "offered_rps": rate_per_replica * n,
        }


def format_row(row: dict[str, float | str]) -> str:
    return (
        f"| {row['replicas']} | {row['router']} | {row['adapter_hit_rate']:.1%} | "
        f"{row['loads_per_replica_min']:.1f} | {row['ttft_p50_s']:.3f} / {row['ttft_p90_s']:.3f} | "
        f"{row['goodput_rps']:.1f} of {row['offered_rps']:.1f} |"
    )


HEADER = (
    "| replicas | router | adapter hit rate | loads per replica-minute | TTFT p50 / p90 (s) "
    "| goodput of offered (req/s) |\n| ---: | --- | ---: | ---: | ---: | ---: |"
)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m sim.lora_study", description=__doc__)
    parser.add_argument("--sizes", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--seconds", type=float, default=60.0, help="simulated seconds of arrivals")
    parser.add_argument("--adapters-per-replica", type=int, default=4)
    parser.add_argument("--zipf-s", type=float, default=1.0)
    parser.add_argument("--slots", type=int, default=4, help="adapter slots per replica")
    parser.add_argument("--load-s", type=float, default=0.05, help="seconds per adapter load")
    parser.add_argument("--load", type=float, default=0.5, help="share of a replica's capacity")
    a = parser.parse_args(argv)
    study = LoraStudy(a.seconds, a.adapters_per_replica, a.zipf_s, a.slots, a.load_s)
    t0 = time.perf_counter()
    cap = study.capacity()
    rate = cap * a.load
    print(
        f"capacity without adapters {cap:.2f} req/s per replica; load {rate:.2f} req/s per replica;"
        f" {study}",
        flush=True,
    )
    print(HEADER)
    for n in a.sizes:
        for label, *_ in ROUTERS:
            print(format_row(study.run(n, rate, label)), flush=True)
    print(f"({time.perf_counter() - t0:.0f} s wall)")


if __name__ == "__main__":
    main()
