"""Length-aware scheduling in the simulator: FCFS against SRPT on predicted lengths and SRPT on
true lengths (the oracle bound), at several loads and under KV pressure.

    python -m sim.length_study [--loads 0.5 0.8 0.95] [--requests 1500] [--profile cpu]
    python -m sim.length_study --set sim/traces/length_eval.jsonl [--policies fcfs srpt oracle
        srpt+foresight oracle+foresight]

With --set, requests are drawn (seeded, with replacement) from the length evaluation set: its
prompt and output lengths as the embedded model produced them, its kind as the tenant, max_tokens
256 (the cap the set was generated with). A policy `X+foresight` runs X with admission
`foresight` (scheduler/admission.py) on median estimates, `X+foresight-upper` on the upper
quantile; the oracle's foresight sees the true lengths.

Without --set the workload is synthetic (not the embedded model's answers): four kinds of request,
each a tenant, whose output lengths are log-uniform over ranges that differ by two orders of
magnitude, so the lengths vary widely overall and the cheap features (the tenant here) say
something without saying everything. Every request's max_tokens is the same (2,048), so it
carries no hint: requests end by EOS. One replica, max_num_seqs 16 (or --max-num-seqs): requests
queue once that many run, which is where a queue order matters.
"""

from __future__ import annotations

import argparse
import json
import math
import random
from collections.abc import Callable
from dataclasses import dataclass

from router.config import RoutingConfig
from scheduler import Request, SchedulerConfig
from scheduler.length_prediction import LengthEstimate, LengthPredictor
from scheduler.queues import SRPTQueue
from sim.cost import load_profile
from sim.fleet import FleetSim
from sim.fleet_config import SimConfig
from sim.metrics import SimResult, percentile
from sim.replica import SimReplica
from sim.workload import SimRequest

# kind (tenant): (prompt length range, output length range), lengths log-uniform in the range
KINDS: dict[str, tuple[tuple[int, int], tuple[int, int]]] = {
    "answer": ((16, 256), (2, 24)),  # one word, a number, a yes/no with a reason
    "extract": ((128, 1024), (16, 128)),  # fields pulled out of a document
    "code": ((32, 512), (64, 768)),
    "essay": ((16, 128), (256, 1536)),
}
MAX_TOKENS = 2048
SET_MAX_TOKENS = 256  # the cap the length evaluation set was generated with
MAX_NUM_SEQS = 16


def _log_uniform(rng: random.Random, lo: int, hi: int) -> int:
    return round(math.exp(rng.uniform(math.log(lo), math.log(hi))))


def length_workload(num_requests: int, rate: float, seed: int = 0) -> list[SimRequest]:
    """Poisson arrivals at rate, kinds in equal shares."""
    rng = random.Random(seed)
    t = 0.0
    out = []
    kinds = sorted(KINDS)
    for i in range(num_requests):
        t += rng.expovariate(rate)
        kind = rng.choice(kinds)
        (p_lo, p_hi), (o_lo, o_hi) = KINDS[kind]
        out.append(
            SimRequest(
                f"r{i}",
                t,
                _log_uniform(rng, p_lo, p_hi),
                _log_uniform(rng, o_lo, o_hi),
                tenant=kind,
            )
        )
    return out


def load_set(path: str) -> list[tuple[int, str, int, int]]:
    """(id, kind, prompt length, output length) of each prompt of the length evaluation set."""
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [
        (r["id"], r["kind"], r["prompt_len"], r["output_len"]) for r in rows if "header" not in r
    ]


def set_workload(
    rows: list[tuple[int, str, int, int]], num_requests: int, rate: float, seed: int = 0
) -> list[SimRequest]:
    """Poisson arrivals at rate, each request a prompt of the set drawn uniformly; its id ends in
    the prompt's (r<i>-<set id>), which the probe's estimates are keyed by."""
    rng = random.Random(seed)
    t = 0.0
    out = []
    for i in range(num_requests):
        t += rng.expovariate(rate)
        row, kind, prompt_len, output_len = rng.choice(rows)
        out.append(SimRequest(f"r{i}-{row}", t, prompt_len, output_len, tenant=kind))
    return out


class ProbeEstimates:
    """SRPT on the hidden-state probe: each set prompt's out-of-fold probe median (from
    `bench/length_accuracy.py --write-oof`), conditioned on what the request has generated."""

    def __init__(self, medians: dict[int, float]):
        self.medians = medians

    def predict_request(self, request: Request) -> LengthEstimate | None:
        total = self.medians.get(int(request.request_id.rsplit("-", 1)[1]))
        if total is None:
            return None
        g = request.num_output_tokens
        if total <= g:  # past the estimate: as many again as it has made
            return LengthEstimate(max(g, 1), 2 * max(g, 1))
        return LengthEstimate(total - g, total - g)

    def observe_request(self, request: Request) -> None:
        pass


class Oracle:
    """The true remaining length (the simulator knows each request's output length)."""

    def __init__(self, replica: SimReplica):
        self.output_len = replica.output_len

    def predict_request(self, request: Request) -> LengthEstimate | None:
        n = self.output_len[request.request_id] - request.num_output_tokens
        return LengthEstimate(n, n)

    def observe_request(self, request: Request) -> None:
        pass


@dataclass(slots=True)
class Recorder:
    """Wraps the learning predictor and records its estimate for each request at arrival."""

    predictor: LengthPredictor
    at_arrival: dict[str, LengthEstimate | None]

    def predict_request(self, request: Request) -> LengthEstimate | None:
        estimate = self.predictor.predict_request(request)
        self.at_arrival.setdefault(request.request_id, estimate)
        return estimate

    def observe_request(self, request: Request) -> None:
        self.predictor.observe_request(request)


def max_model_len(max_tokens: int) -> int:
    """The context a study's replica needs: synthetic, the longest prompt + output is 1,664
    tokens; the evaluation set's, under 512."""
    return 2600 if max_tokens == MAX_TOKENS else 1024


@dataclass(frozen=True, slots=True)
class StudyReplica:
    """The study's one replica: its KV pool and batch bound, the SRPT runs' aging and preemption
    victim, and the requests' max_tokens."""

    num_gpu_blocks: int
    max_num_seqs: int = MAX_NUM_SEQS
    aging: float = 2.0
    victim: str = "lifo"
    max_tokens: int = MAX_TOKENS


def config(policy: str, replica: StudyReplica) -> SimConfig:
    """policy: fcfs, srpt or oracle, optionally +foresight (admission foresight)."""
    base, _, admission = policy.partition("+")  # +foresight, +foresight-upper
    return SimConfig(
        num_replicas=1,
        scheduler=SchedulerConfig(
            num_gpu_blocks=replica.num_gpu_blocks,
            max_model_len=max_model_len(replica.max_tokens),
            max_num_seqs=replica.max_num_seqs,
            policy="fcfs" if base == "fcfs" else "srpt",
            srpt_aging_factor=replica.aging,
            preemption_victim=replica.victim,
            admission="foresight" if admission else "greedy",
            foresight_estimate="upper" if admission.endswith("upper") else "median",
        ),
        routing=RoutingConfig(router_policy="round_robin"),
        max_tokens=replica.max_tokens,
        keep_itl=False,
    )


def run(
    policy: str,
    workload: list[SimRequest],
    replica: StudyReplica,
    profile: str,
    probe: dict[int, float] | None = None,
) -> tuple[SimResult, dict[str, LengthEstimate | None]]:
    """policy: fcfs, srpt (the learning predictor), probe (SRPT on the probe's estimates) or
    oracle (SRPT on true lengths), each optionally +foresight."""
    sim = FleetSim(config(policy, replica), load_profile(profile))
    predictions: dict[str, LengthEstimate | None] = {}
    for sim_replica in sim.replicas:
        queue = sim_replica.scheduler.waiting
        if isinstance(queue, SRPTQueue):
            queue.predictor = _predictor(policy, sim_replica, probe, predictions)
            admission = sim_replica.scheduler.admission
            if admission is not None:  # foresight shares the queue's predictor
                admission.predictor = queue.predictor
    return sim.run(workload), predictions


def _predictor(
    policy: str,
    replica: SimReplica,
    probe: dict[int, float] | None,
    predictions: dict[str, LengthEstimate | None],
) -> Oracle | ProbeEstimates | Recorder:
    """The SRPT queue's length source of a policy; the learning predictor's estimates are
    recorded in predictions."""
    if policy.startswith("oracle"):
        return Oracle(replica)
    if policy.startswith("probe"):
        return ProbeEstimates(probe or {})
    return Recorder(LengthPredictor(), predictions)


def figures(result: SimResult, slo_ttft_s: float) -> dict[str, float]:
    done = [r for r in result.records if r.finish_s is not None]
    e2e = [r.finish_s - r.arrival_s for r in done if r.finish_s is not None]
    ttft = [r.ttft_s for r in done]
    span = max(r.finish_s for r in done if r.finish_s is not None) - min(r.arrival_s for r in done)
    return {
        "done": len(done),
        "e2e_mean_s": sum(e2e) / len(e2e),
        "e2e_p99_s": percentile(e2e, 99),
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "longest_wait_s": max(ttft),
        "preemptions": sum(rep.scheduler.num_preemptions for rep in result.replicas),
        "goodput_rps": sum(1 for t in ttft if t <= slo_ttft_s) / span,
    }


def capacity(
    num_gpu_blocks: int,
    profile: str,
    requests: int,
    max_num_seqs: int,
    make: Callable[[int, float, int], list[SimRequest]],
    max_tokens: int = MAX_TOKENS,
) -> float:
    """Completions per second of one replica under FCFS with every request queued at once."""
    wl = make(requests, 1000.0, 99)
    replica = StudyReplica(num_gpu_blocks, max_num_seqs, max_tokens=max_tokens)
    result, _ = run("fcfs", wl, replica, profile)
    finishes = [r.finish_s for r in result.records if r.finish_s is not None]
    return len(finishes) / max(finishes)


def kendall_tau(xs: list[float], ys: list[float]) -> float:
    """Kendall's tau-b over all pairs (O(n^2): a few thousand requests)."""
    concordant = discordant = tx = ty = 0
    n = len(xs)
    for i in range(n):
        for j in range(i + 1, n):
            dx, dy = xs[i] - xs[j], ys[i] - ys[j]
            if dx == 0 and dy == 0:
                continue
            if dx == 0:
                tx += 1
            elif dy == 0:
                ty += 1
            elif (dx > 0) == (dy > 0):
                concordant += 1
            else:
                discordant += 1
    denom = math.sqrt((concordant + discordant + tx) * (concordant + discordant + ty))
    return (concordant - discordant) / denom if denom else 0.0


def accuracy(workload: list[SimRequest], predictions: dict[str, LengthEstimate | None]) -> None:
    """The predictor's estimates at arrival against the true lengths, beside cheap baselines (the
    baselines see every length in hindsight, the predictor only those finished before)."""
    warm = [r for r in workload if predictions.get(r.request_id) is not None]
    true = [float(r.output_len) for r in warm]
    est = [predictions[r.request_id] for r in warm]
    upper = [e.upper for e in est if e is not None]
    rows = {
        "predictor (median)": [e.median for e in est if e is not None],
        "prompt length only": [float(r.prompt_len) for r in warm],
        **_hindsight(workload, warm),
    }
    print(f"  accuracy on {len(warm)} requests predicted at arrival (of {len(workload)}):")
    for name, values in rows.items():
        tau = kendall_tau(values, true)
        mae = sum(abs(math.log(max(v, 1)) - math.log(t)) for v, t in zip(values, true)) / len(true)
        print(f"    {name:28s} tau {tau:+.3f}  MAE(log len) {mae:.3f}")
    exceeded = sum(1 for u, t in zip(upper, true) if t > u) / len(true)
    print(f"    upper quantile (0.9) exceeded by {exceeded:.1%} of requests")


def _hindsight(workload: list[SimRequest], warm: list[SimRequest]) -> dict[str, list[float]]:
    """The baselines that know every length: each warm request's tenant mean, the median."""
    by_tenant: dict[str, list[int]] = {}
    for r in workload:
        by_tenant.setdefault(r.tenant, []).append(r.output_len)
    tenant_mean = [sum(by_tenant[r.tenant]) / len(by_tenant[r.tenant]) for r in warm]
    overall = sorted(r.output_len for r in workload)
    global_median = float(overall[len(overall) // 2])
    return {
        "per-tenant mean (hindsight)": tenant_mean,
        "global median (hindsight)": [global_median] * len(warm),
    }


def main(argv: list[str] | None = None) -> None:
    a = _parser().parse_args(argv)
    make: Callable[[int, float, int], list[SimRequest]] = length_workload
    max_tokens = MAX_TOKENS
    if a.set:
        rows = load_set(a.set)
        max_tokens = SET_MAX_TOKENS

        def make(n: int, rate: float, seed: int) -> list[SimRequest]:
            return set_workload(rows, n, rate, seed)

    probe = None
    if any(p.startswith("probe") for p in a.policies):
        with open(a.probe_estimates) as fp:
            probe = {int(k): float(v) for k, v in json.load(fp).items()}
    for blocks in a.pools or (a.blocks, a.tight_blocks):
        _study_pool(a, blocks, make, max_tokens, probe)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m sim.length_study", description=__doc__)
    parser.add_argument("--loads", type=float, nargs="+", default=[0.5, 0.8, 0.95])
    parser.add_argument("--requests", type=int, default=1500)
    parser.add_argument("--profile", default="cpu")
    parser.add_argument("--blocks", type=int, default=4096, help="KV blocks (no pressure)")
    parser.add_argument("--tight-blocks", type=int, default=400, help="KV blocks (pressure)")
    parser.add_argument("--slo-ttft", type=float, default=5.0, help="goodput: TTFT at most this")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-num-seqs", type=int, default=MAX_NUM_SEQS)
    parser.add_argument("--aging", type=float, default=2.0, help="srpt_aging_factor")
    parser.add_argument(
        "--victim", default="lifo", help="preemption_victim of the SRPT runs (FCFS keeps lifo)"
    )
    parser.add_argument("--pools", type=int, nargs="+", help="KV pools to run (default: both)")
    parser.add_argument("--set", help="draw requests from this length evaluation set (JSONL)")
    parser.add_argument(
        "--policies",
        nargs="+",
        default=["fcfs", "srpt", "oracle"],
        help="fcfs, srpt, probe, oracle, each optionally +foresight",
    )
    parser.add_argument(
        "--probe-estimates",
        default="sim/traces/length_eval_probe.json",
        help="the probe's out-of-fold medians by set id (policy probe)",
    )
    return parser


def _study_pool(
    a: argparse.Namespace,
    blocks: int,
    make: Callable[[int, float, int], list[SimRequest]],
    max_tokens: int,
    probe: dict[int, float] | None,
) -> None:
    """Each load of one KV pool, each policy at each load, printed as it completes."""
    cap = capacity(blocks, a.profile, 400, a.max_num_seqs, make, max_tokens)
    print(
        f"profile {a.profile}, {blocks} KV blocks, max_num_seqs {a.max_num_seqs}, aging"
        f" {a.aging}: capacity {cap:.3f} req/s (FCFS)"
    )
    for load in a.loads:
        wl = make(a.requests, load * cap, a.seed)
        print(f" load {load:.0%} ({load * cap:.3f} req/s, {a.requests} requests):")
        for policy in a.policies:
            victim = "lifo" if policy.startswith("fcfs") else a.victim
            replica = StudyReplica(blocks, a.max_num_seqs, a.aging, victim, max_tokens)
            result, predictions = run(policy, wl, replica, a.profile, probe)
            _print_policy(policy, figures(result, a.slo_ttft))
            # The predictor's accuracy once: the first load of the unpressured pool.
            if policy == "srpt" and blocks == a.blocks and load == a.loads[0]:
                accuracy(wl, predictions)


def _print_policy(policy: str, f: dict[str, float]) -> None:
    print(
        f"  {policy:16s} E2E mean {f['e2e_mean_s']:8.2f} p99 {f['e2e_p99_s']:8.2f} s;"
        f" TTFT p50 {f['ttft_p50_s']:7.2f} p99 {f['ttft_p99_s']:8.2f} s; longest wait"
        f" {f['longest_wait_s']:8.2f} s; preemptions {f['preemptions']:5d}; goodput"
        f" {f['goodput_rps']:.3f} req/s; done {f['done']}",
        flush=True,
    )


if __name__ == "__main__":
    main()
