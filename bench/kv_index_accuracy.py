"""How often the fleet router knows a request's prefix-cache hit exactly: the approximate prefix
index (routing's plants corrected by periodic prefix reports) against the exact index kept from
the replicas' KV events (router/kv_events.py), on the same harness.

Harness: two EngineCores (a random two-layer Llama on this process's CPU), each with a device KV
pool of `--pool-share` (0.25) of the workload's working set, so eviction churns; the production
FleetState routes every request with prefix affinity. Workload: an agent trace, `--sessions`
conversations over `--contexts` shared system contexts, `--turns` turns each (the next turn sends
the whole conversation so far, with the answer the engine gave), turns shuffled across sessions.
Requests run one at a time. Each replica's routing stats go to the router through their dict
form, as Serve carries them, after every `--report-every` requests (1: the router has seen every
replica's state before it routes; 4: about one report per second at four requests a second).

For each request: the hit the router predicts on the replica it chose (blocks of the leading
run it believes that replica holds, in its device pool and then its lower tiers, cut where the
scheduler cuts a lookup) against the replica's own count (RequestOutput.num_cached_tokens).

    python bench/kv_index_accuracy.py [--sessions 48] [--turns 4] [--report-every 1 4] \
        [--cpu-tier-share 0.25]

`--served`: the same trace through Ray Serve, two LLMReplicas (KV events published in their routing
stats, once a `--stats-period` s, and with each request's last output, which this process hands to
its router as the ingress does; `--reports-only`: the reports alone) behind this process's
FleetRouter, one request at a time; `--pace` s between requests (0: back to back; a period or more:
each replica's events of the previous request have reached the router). The router's prediction is
read when it chooses (its own FleetState, just after it took in the replicas' latest reports), for
both indexes on the same routing; the actual hit is the stream's num_cached_tokens.

Prints, per index and report period: requests, exact predictions (share), mean |error| in blocks,
and the share of prompt blocks that hit.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

from cluster.kv_event_pub import attach_kv_events, deliver_kv_tail
from engine.config import EngineConfig
from engine.core import EngineCore
from router.config import RoutingConfig
from router.fleet import FleetState
from router.kv_events import TierRun
from router.policies import RouteRequest, expected_runs
from router.stats import MAX_REPORTED_PREFIX_HASHES, RoutingStats
from scheduler import EngineRequest, SamplingParams, hash_prompt_blocks
from scheduler.kv_events import KVEventLog
from tests.random_checkpoint import TINY_SERVED_LLAMA, write_random_checkpoint

BLOCK = 16
ANSWER_TOKENS = 8
VOCAB = 1000  # prompt token ids drawn below it (the model's vocabulary is larger)


@dataclass
class Tally:
    requests: int = 0
    exact: int = 0
    abs_error: int = 0
    hit_blocks: int = 0
    prompt_blocks: int = 0

    def add(self, predicted: int, actual: int, prompt_blocks: int) -> None:
        self.requests += 1
        self.exact += predicted == actual
        self.abs_error += abs(predicted - actual)
        self.hit_blocks += actual
        self.prompt_blocks += prompt_blocks

    def line(self, name: str) -> str:
        return (
            f"{name:<28} requests {self.requests:4d}  exact {self.exact:4d} "
            f"({100 * self.exact / self.requests:6.2f}%)  mean |error| "
            f"{self.abs_error / self.requests:5.2f} blocks  "
            f"hit {self.hit_blocks / self.prompt_blocks:.1%}"
        )


@dataclass
class Session:
    context: int
    history: list[int]


def workload(args: argparse.Namespace, vocab: int) -> tuple[list[list[int]], list[Session], list]:
    """Contexts, sessions, and the shuffled order of (session, user message) turns."""
    rng = random.Random(args.seed)
    tok = lambda n: [rng.randrange(10, vocab) for _ in range(n)]  # noqa: E731
    contexts = [tok(args.context_blocks * BLOCK) for _ in range(args.contexts)]
    sessions = [Session(i % args.contexts, []) for i in range(args.sessions)]
    turns = []
    for t in range(args.turns):
        batch = [(s, tok(rng.randrange(BLOCK, 3 * BLOCK))) for s in range(args.sessions)]
        rng.shuffle(batch)
        turns.extend((t, s, msg) for s, msg in batch)
    return contexts, sessions, turns


def working_set_blocks(args: argparse.Namespace) -> int:
    """Distinct blocks the trace touches: the contexts, and every session's turns (a user message
    of two blocks on average and the answer)."""
    per_turn = (2 * BLOCK + ANSWER_TOKENS) / BLOCK
    return int(args.contexts * args.context_blocks + args.sessions * args.turns * per_turn)


def report(engine: EngineCore, log: KVEventLog | None) -> RoutingStats:
    """What the replica's record_routing_stats sends, through the dict Serve carries."""
    stats = RoutingStats(
        engine.stats(),
        prefix=engine.prefix_report(MAX_REPORTED_PREFIX_HASHES),
        tier_hashes=engine.tier_hashes(MAX_REPORTED_PREFIX_HASHES),
        kv_events=None if log is None else log.report(),
    )
    return RoutingStats.from_dict(stats.to_dict())


def predicted_blocks(fleet: FleetState, replica: str, hashes: list[int], events: bool) -> int:
    """The hit the router believes replica gives these (capped) prompt blocks."""
    if events:
        return expected_runs(fleet, hashes, [replica]).get(replica, TierRun()).blocks
    run = fleet.index.match(hashes, [replica])[replica]
    held = fleet.tier_hashes.get(replica, frozenset())
    while run < len(hashes) and hashes[run] in held:
        run += 1
    return run


def run_pass(args: argparse.Namespace, model: str, events: bool, report_every: int) -> Tally:
    pool = max(int(args.pool_share * working_set_blocks(args)), 64)
    tier = int(args.cpu_tier_share * working_set_blocks(args))
    config = EngineConfig.from_kwargs(
        model=model,
        device="cpu",
        load_progress=False,
        block_size=BLOCK,
        num_gpu_blocks=pool,
        **({"num_cpu_tier_blocks": tier} if tier else {}),
    )
    engines = {name: EngineCore(config) for name in ("replica-a", "replica-b")}
    logs = {n: attach_kv_events(e) if events else None for n, e in engines.items()}
    fleet = FleetState(RoutingConfig(router_policy="prefix_affinity"))
    contexts, sessions, turns = workload(args, VOCAB)
    tally, now = Tally(), 0.0
    params = SamplingParams(max_tokens=ANSWER_TOKENS, temperature=0.0, ignore_eos=True)
    for i, (_, s, message) in enumerate(turns):
        session = sessions[s]
        prompt = contexts[session.context] + session.history + message
        hashes = hash_prompt_blocks(prompt, BLOCK)
        capped = hashes[: (len(prompt) - 1) // BLOCK]  # the scheduler leaves the last token
        # Read before choosing: choosing charges the replica, planting the prompt in the index.
        predictions = {name: predicted_blocks(fleet, name, capped, events) for name in engines}
        replica = fleet.choose(RouteRequest(f"r{i}", len(prompt), hashes), engines, now)
        assert replica is not None
        predicted = predictions[replica]
        answer, cached = serve(engines[replica], EngineRequest(f"r{i}", prompt, params))
        tally.add(predicted, cached // BLOCK, len(capped))
        fleet.on_completed(f"r{i}")
        session.history = session.history + message + answer
        now += 0.25
        if (i + 1) % report_every == 0:
            for name, engine in engines.items():
                fleet.on_stats(name, report(engine, logs[name]), now)
    for engine in engines.values():
        engine.shutdown()
    return tally


def serve(engine: EngineCore, request: EngineRequest) -> tuple[list[int], int]:
    """Run one request to its end: its tokens and its prefix-cache hit in tokens."""
    engine.add_request(request)
    tokens: list[int] = []
    cached = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.extend(out.new_token_ids)
            cached = out.num_cached_tokens
    return tokens, cached


def served_pass(args: argparse.Namespace, model: str) -> tuple[Tally, Tally]:
    """(approximate, events) tallies of the trace served by two replicas (see the docstring)."""
    import asyncio

    from ray import serve

    handle = start_served(args, model)
    predictions: dict[str, dict[str, tuple[int, int]]] = {}
    tallies = (Tally(), Tally())
    contexts, sessions, turns = workload(args, VOCAB)
    params = SamplingParams(max_tokens=ANSWER_TOKENS, temperature=0.0, ignore_eos=True)
    for i, (_, s, message) in enumerate(turns):
        session = sessions[s]
        prompt = contexts[session.context] + session.history + message
        request = EngineRequest(
            f"r{i}", prompt, params, block_hashes=hash_prompt_blocks(prompt, BLOCK)
        )
        answer, cached, replica = asyncio.run(
            served_request(handle, request, predictions, not args.reports_only)
        )
        capped = (len(prompt) - 1) // BLOCK
        for tally, predicted in zip(tallies, predictions.pop("last")[replica]):
            tally.add(min(predicted, capped), cached // BLOCK, capped)
        session.history = session.history + message + answer
        time.sleep(args.pace)
    serve.delete("kv_accuracy")
    return tallies


def start_served(args: argparse.Namespace, model: str):
    """Two LLMReplicas of model behind the FleetRouter, on a local Ray; their handle."""
    import asyncio

    import ray
    from ray import serve

    from cluster.replica import LLMReplica
    from deploy.config import AppConfig

    ray.init(include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1")
    serve.start(proxy_location="Disabled")
    pool = max(int(args.pool_share * working_set_blocks(args)), 64)
    config = AppConfig.from_args(
        {
            "model": model,
            "device": "cpu",
            "num_replicas": 2,
            "cpu_threads": 1,
            "block_size": BLOCK,
            "num_gpu_blocks": pool,
            "max_model_len": 512,
            "replica_num_cpus": 1,
            "router": "fleet",
            "router_kwargs": {"router_policy": "prefix_affinity"},
        }
    )
    router = config.request_router_config()
    router["request_routing_stats_period_s"] = args.stats_period
    replica = LLMReplica.options(
        num_replicas=2,
        ray_actor_options=config.replica_actor_options(),
        placement_group_bundles=config.placement_group_bundles(),
        request_router_config=router,
        health_check_timeout_s=120,
    )
    handle = serve.run(replica.bind(config.engine), name="kv_accuracy", route_prefix=None)
    # A one-token request (no full block: no cache effect) makes this process's router.
    warm = handle.options(stream=True).generate.remote(
        EngineRequest("warm", [11], SamplingParams(max_tokens=1))
    )
    asyncio.run(drain(warm))
    return handle


async def drain(stream) -> None:
    async for _ in stream:
        pass


async def served_request(handle, request: EngineRequest, predictions: dict, carry: bool) -> tuple:
    """(answer, cached prompt tokens, replica) of one request, with the router's predictions for
    it recorded when it chooses; carry: hand the KV events its last output carries to the router,
    as the ingress does."""
    answer: list[int] = []
    cached = 0
    router = handle._router._asyncio_router.request_router  # Serve's router of this process
    watch_choices(router.fleet, predictions)
    before = dict(router.fleet.routed)
    async for out in handle.options(stream=True).generate.remote(request):
        answer.extend(out.new_token_ids)
        cached = out.num_cached_tokens
        if carry:
            deliver_kv_tail(out)  # what the ingress does with a last output (deploy/generation.py)
    (replica,) = [r for r, n in router.fleet.routed.items() if n != before.get(r, 0)]
    return answer, cached, replica


def watch_choices(fleet: FleetState, predictions: dict) -> None:
    """Record, as the policy chooses, what each index predicts for each candidate."""
    policy = fleet.policy
    if getattr(policy, "watched", False):
        return
    choose = policy.choose

    def recording(replicas, request, view):
        capped = list(request.block_hashes)
        # Serve's id for the request is not ours; requests go one at a time: the last choice.
        predictions["last"] = {
            r: (
                predicted_blocks(fleet, r, capped, events=False),
                predicted_blocks(fleet, r, capped, events=fleet.kv.in_sync(r)),
            )
            for r in replicas
        }
        return choose(replicas, request, view)

    policy.choose, policy.watched = recording, True


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", type=int, default=6)
    p.add_argument("--context-blocks", type=int, default=12)
    p.add_argument("--sessions", type=int, default=48)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--pool-share", type=float, default=0.25)
    p.add_argument("--cpu-tier-share", type=float, default=0.0)
    p.add_argument("--report-every", type=int, nargs="+", default=[1, 4])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--served", action="store_true", help="through Ray Serve (see above)")
    p.add_argument("--pace", type=float, default=0.0, help="--served: seconds between requests")
    p.add_argument("--stats-period", type=float, default=1.0, help="--served: report period, s")
    p.add_argument(
        "--reports-only",
        action="store_true",
        help="--served: leave the KV events outputs carry unread (the reports alone)",
    )
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        write_random_checkpoint(TINY_SERVED_LLAMA, tmp, seed=0)
        print(
            f"working set ~{working_set_blocks(args)} blocks, pool "
            f"{max(int(args.pool_share * working_set_blocks(args)), 64)} blocks per replica, "
            f"CPU tier {int(args.cpu_tier_share * working_set_blocks(args))} blocks"
        )
        if args.served:
            approximate, router = served_pass(args, tmp)
            label = f"served, pace {args.pace:g} s, reports every {args.stats_period:g} s" + (
                ", reports only" if args.reports_only else ", events with outputs"
            )
            print(approximate.line("approximate index") + f"  ({label})")
            print(router.line("router (events in sync)") + f"  ({label})", flush=True)
            return
        for every in args.report_every:
            for events in (False, True):
                name = f"{'events' if events else 'approximate'} (report/{every} req)"
                print(run_pass(args, tmp, events, every).line(name), flush=True)


if __name__ == "__main__":
    main()
