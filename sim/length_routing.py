"""Routing by predicted remaining tokens against routing by requests in flight (issue 35, "Uses:
Routing"): a fleet of replicas, least-loaded routing, the length evaluation set's requests.

    python -m sim.length_routing [--replicas 4] [--load 0.8] [--requests 3000] [--profile cpu]
        [--set sim/traces/length_eval.jsonl] [--policy least_loaded]

Each replica runs FCFS; its scheduler's own length predictor learns online from the requests it
finishes and sizes its queues for its reports (scheduler/predicted_load.py). Three routers on the
same arrivals: load_signal `requests` (today), `predicted_tokens`, and `predicted_tokens` fed the
true remaining lengths (the oracle: how much a perfect predictor would give). The load is a share of
the fleet's capacity: replicas x one replica's FCFS capacity on the set (sim/length_study.py).
"""

from __future__ import annotations

import argparse
from collections import Counter

from router.config import RoutingConfig
from scheduler import SchedulerConfig
from sim.cost import load_profile
from sim.fleet import FleetSim
from sim.fleet_config import SimConfig
from sim.length_study import (
    MAX_TOKENS,
    SET_MAX_TOKENS,
    Oracle,
    capacity,
    length_workload,
    load_set,
    max_model_len,
    set_workload,
)
from sim.metrics import SimResult, percentile
from sim.workload import SimRequest

SIGNALS = ("requests", "predicted_tokens", "oracle")


def run(
    signal: str,
    workload: list[SimRequest],
    replicas: int,
    profile: str,
    policy: str = "least_loaded",
    blocks: int = 4096,
    max_num_seqs: int = 16,
    per_request: int = 128,
    max_tokens: int = SET_MAX_TOKENS,
) -> SimResult:
    """One fleet on the workload, its router on `signal` (oracle: predicted_tokens on the true
    remaining lengths)."""
    cfg = SimConfig(
        num_replicas=replicas,
        scheduler=SchedulerConfig(
            num_gpu_blocks=blocks,
            max_model_len=max_model_len(max_tokens),
            max_num_seqs=max_num_seqs,
        ),
        routing=RoutingConfig(
            router_policy=policy,
            load_signal="requests" if signal == "requests" else "predicted_tokens",
            predicted_tokens_per_request=per_request,
            seed=0,
        ),
        max_tokens=max_tokens,
        keep_itl=False,
    )
    sim = FleetSim(cfg, load_profile(profile))
    if signal == "oracle":
        for replica in sim.replicas:
            replica.scheduler.own_length_model = Oracle(replica)
    return sim.run(workload)


def figures(result: SimResult) -> dict[str, float]:
    done = [r for r in result.records if r.finish_s is not None]
    e2e = [r.finish_s - r.arrival_s for r in done if r.finish_s is not None]
    served = Counter(r.replica for r in done)
    counts = [served.get(rep.name, 0) for rep in result.replicas]
    busy = [rep.busy_s for rep in result.replicas]
    return {
        "done": len(done),
        "e2e_mean_s": sum(e2e) / len(e2e),
        "e2e_p99_s": percentile(e2e, 99),
        "ttft_p90_s": percentile([r.ttft_s for r in done], 90),
        "served_max_min": max(counts) / max(min(counts), 1),
        "busy_max_min": max(busy) / max(min(busy), 1e-9),
    }


def main(argv: list[str] | None = None) -> None:
    a = _parser().parse_args(argv)
    rows = load_set(a.set)
    max_tokens = MAX_TOKENS if a.synthetic else SET_MAX_TOKENS

    def make(n: int, rate: float, seed: int) -> list[SimRequest]:
        if a.synthetic:
            return length_workload(n, rate, seed)
        return set_workload(rows, n, rate, seed)

    cap = capacity(4096, a.profile, 400, a.max_num_seqs, make, max_tokens)
    print(f"profile {a.profile}, max_num_seqs {a.max_num_seqs}: one replica {cap:.3f} req/s (FCFS)")
    print(
        "| replicas | signal | E2E mean s | E2E p99 s | TTFT p90 s | served max/min |"
        " busy max/min |"
    )
    print("|---|---|---|---|---|---|---|")
    for n in a.replicas:
        wl = make(a.requests, a.load * cap * n, a.seed)
        for signal in a.signals:
            _print_row(n, signal, figures(_run_fleet(a, signal, wl, n, max_tokens)))


def _run_fleet(
    a: argparse.Namespace, signal: str, workload: list[SimRequest], replicas: int, max_tokens: int
) -> SimResult:
    """run() with the command line's fleet settings."""
    return run(
        signal,
        workload,
        replicas,
        a.profile,
        a.policy,
        max_num_seqs=a.max_num_seqs,
        per_request=a.per_request,
        max_tokens=max_tokens,
    )


def _print_row(replicas: int, signal: str, f: dict[str, float]) -> None:
    print(
        f"| {replicas} | {signal} | {f['e2e_mean_s']:.2f} | {f['e2e_p99_s']:.2f} |"
        f" {f['ttft_p90_s']:.2f} | {f['served_max_min']:.2f} | {f['busy_max_min']:.2f} |",
        flush=True,
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m sim.length_routing", description=__doc__)
    parser.add_argument("--replicas", type=int, nargs="+", default=[4])
    parser.add_argument("--load", type=float, default=0.8)
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--profile", default="cpu")
    parser.add_argument("--set", default="sim/traces/length_eval.jsonl")
    parser.add_argument("--policy", default="least_loaded")
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--per-request", type=int, default=128, help="predicted_tokens_per_request")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--synthetic",
        action="store_true",
        help="sim/length_study.py's synthetic workload (outputs 2-1,536 tokens) instead of --set",
    )
    parser.add_argument("--signals", nargs="+", default=list(SIGNALS), choices=SIGNALS)
    return parser


if __name__ == "__main__":
    main()
