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

Prints, per index and report period: requests, exact predictions (share), mean |error| in blocks,
and the share of prompt blocks that hit.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

from cluster.kv_event_pub import attach_kv_events
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
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        write_random_checkpoint(TINY_SERVED_LLAMA, tmp, seed=0)
        print(
            f"working set ~{working_set_blocks(args)} blocks, pool "
            f"{max(int(args.pool_share * working_set_blocks(args)), 64)} blocks per replica, "
            f"CPU tier {int(args.cpu_tier_share * working_set_blocks(args))} blocks"
        )
        for every in args.report_every:
            for events in (False, True):
                name = f"{'events' if events else 'approximate'} (report/{every} req)"
                print(run_pass(args, tmp, events, every).line(name), flush=True)


if __name__ == "__main__":
    main()
