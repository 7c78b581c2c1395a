"""The fleet as one KV cache in the simulator (issue 52): replicas publish the KV events their
block pools record, the router's exact index follows them, a spilled request pulls its prefix from
a peer instead of computing it, and a session's turns keep to their replica unless it is past the
load ceiling. Also the agent workload, and the bounds of the new settings."""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import pytest

from router.config import RoutingConfig
from scheduler import SchedulerConfig
from scheduler.kv_events import DEVICE
from sim.__main__ import main as sim_main
from sim.agents import AgentConfig, agent_workload
from sim.cost import load_profile
from sim.fleet_config import SimConfig
from sim.fleet_kv import FleetKVConfig, KVFleetSim
from sim.fleet_kv_study import prefill_tokens_per_s
from sim.kv_copy import LinkConfig
from sim.metrics import SimResult
from sim.workload import SimRequest

CPU = load_profile("cpu")
SCHED = SchedulerConfig(num_gpu_blocks=256, max_model_len=2048, max_num_batched_tokens=512)
# Two contexts of 32 blocks, each forked 6 ways at once: more forks than the holder takes within
# the load ceiling, so some spill to replicas that do not hold the context.
AGENTS = AgentConfig(
    contexts=2,
    context_len=512,
    forks=6,
    turns=2,
    question_len=(16, 48),
    answer_len=(4, 12),
    think_s=(2.0, 4.0),
    fork_after_s=3.0,
    fork_spread_s=0.2,
    start_spread_s=4.0,
)
WORKLOAD = agent_workload(AGENTS)


def _routing(pulls: bool, **kw: Any) -> RoutingConfig:
    """The study's cost model: the link's figures, and what a replica of the profile prefills."""
    prefill = prefill_tokens_per_s(CPU, SCHED.max_num_batched_tokens)
    settings: dict[str, Any] = dict(
        pull_bytes_per_s=25e9, pull_fixed_s=0.05, prefill_tokens_per_s=prefill
    )
    return RoutingConfig(seed=0, peer_pulls=pulls, **{**settings, **kw})


@dataclass
class Ran:
    sim: KVFleetSim
    result: SimResult


def _run(pulls: bool, events: bool = True, sessions: bool = False, **routing: Any) -> Ran:
    config = SimConfig(num_replicas=4, scheduler=SCHED, routing=_routing(pulls, **routing))
    sim = KVFleetSim(config, CPU, FleetKVConfig(kv_events=events, sessions=sessions))
    return Ran(sim, sim.run(WORKLOAD))


@pytest.fixture(scope="module")
def runs() -> dict[str, Ran]:
    """The agent trace on four replicas: today's router, KV events, + pulls, + sessions."""
    return {
        "today": _run(pulls=False, events=False),
        "events": _run(pulls=False),
        "pulls": _run(pulls=True),
        "sessions": _run(pulls=True, sessions=True),
    }


def test_every_request_finishes(runs: dict[str, Ran]) -> None:
    for name, ran in runs.items():
        assert ran.result.summary()["requests"] == AGENTS.num_requests, name


def test_replicas_publish_their_pools_and_the_index_follows(runs: dict[str, Ran]) -> None:
    """Without events the router's exact index knows nothing; with them it holds, per replica,
    exactly the hashes its device pool holds at the end (the last tail brought the last step)."""
    assert not runs["today"].sim.fleet.kv.replicas()
    sim = runs["events"].sim
    assert sim.fleet.kv.replicas() == set(sim.names)
    for replica in sim.replicas:
        assert sim.fleet.kv.in_sync(replica.name)
        held = sim.fleet.kv.holdings(replica.name)
        device = {h for h, bits in held.items() if bits & DEVICE}
        assert device == set(replica.scheduler.kv.pool.cached)
        assert device  # certain: every replica ran requests


def test_pulls_never_compute_more_prefill_than_recomputing(runs: dict[str, Ran]) -> None:
    recompute, pulls = runs["events"].sim, runs["pulls"].sim
    assert pulls.pulls.pulled > 0  # the trace makes spilled forks pull
    assert pulls.loaded_blocks() > 0
    assert pulls.prefill_tokens() < recompute.prefill_tokens()
    assert recompute.pulls.planned == 0


@pytest.mark.parametrize("seed", [1, 2, 3, 4, 5])
def test_pulls_compute_less_on_other_seeds(seed: int) -> None:
    workload = agent_workload(dataclasses.replace(AGENTS, seed=seed))
    computed = []
    for pulls in (False, True):
        config = SimConfig(num_replicas=4, scheduler=SCHED, routing=_routing(pulls))
        sim = KVFleetSim(config, CPU, FleetKVConfig())
        assert sim.run(workload).summary()["requests"] == len(workload)
        assert (sim.pulls.pulled > 0) == pulls
        computed.append(sim.prefill_tokens())
    assert computed[1] < computed[0]


def test_runs_are_deterministic(runs: dict[str, Ran]) -> None:
    again = _run(pulls=True)
    first = runs["pulls"]
    assert again.sim.prefill_tokens() == first.sim.prefill_tokens()
    assert [r.ttft_s for r in again.result.records] == [r.ttft_s for r in first.result.records]
    assert again.sim.pulls.records == first.sim.pulls.records


def test_a_pulls_blocks_land_before_its_first_token(runs: dict[str, Ran]) -> None:
    """Every pulled request joins its replica's queue when its blocks land; its first token
    comes after, and its prompt's leading blocks are hits there (the pulled ones among them)."""
    sim, result = runs["pulls"].sim, runs["pulls"].result
    records = {r.request_id: r for r in result.records}
    bs = SCHED.block_size
    assert sim.pulls.records
    for pull in sim.pulls.records:
        rec = records[pull.request_id]
        assert pull.peer != pull.replica == rec.replica
        assert pull.asked_s <= pull.landed_s < rec.arrival_s + rec.ttft_s
        assert pull.landed_s - pull.asked_s <= sim.config.routing.pull_timeout_s
        assert rec.cached_tokens >= pull.num_blocks * bs


def test_forks_spilled_to_one_replica_join_the_pull_in_flight_not_move_it_again() -> None:
    """Twelve forks of each context at once: the router plans a pull for the first fork spilled
    to a replica and the next ones join it (router/peer_pull.py PullsInFlight). No block moves
    twice to a replica while a pull of it is on its way there; a joined fork is queued once the
    pulling fork has landed the blocks on the device and finds its whole context there as a
    prefix hit: every block moved is loaded once, none a second time beside the first."""
    agents = dataclasses.replace(AGENTS, forks=12)
    config = SimConfig(num_replicas=4, scheduler=SCHED, routing=_routing(True))
    sim = KVFleetSim(config, CPU, FleetKVConfig())
    records = {r.request_id: r for r in sim.run(agent_workload(agents)).records}
    assert sim.pulls.joined == sim.fleet.pulls.num_joined == 10 and sim.pulls.pulled == 2
    pulls = sim.pulls.records
    for a, b in itertools.combinations(pulls, 2):
        in_flight = a.asked_s <= b.asked_s < a.landed_s
        assert not (a.replica == b.replica and in_flight and set(a.hashes) & set(b.hashes))
    for rid, landed_s in sim.pulls.joins:
        rec = records[rid]
        assert rec.arrival_s + rec.ttft_s > landed_s
        assert rec.cached_tokens >= AGENTS.context_len
    assert sim.loaded_blocks() == sim.pulls.blocks == 2 * AGENTS.context_len // SCHED.block_size
    assert len(sim.fleet.pulls) == 0  # every pull's request completed


def test_a_pull_that_does_not_pay_is_declined() -> None:
    """The replica's cost check: with a prefill faster than the link, every planned pull is
    declined and the fleet computes what recomputing does."""
    slow_link = _run(pulls=True, prefill_tokens_per_s=1e9)
    assert slow_link.sim.pulls.planned > 0
    assert slow_link.sim.pulls.declined == slow_link.sim.pulls.planned
    assert slow_link.sim.pulls.pulled == 0


def _session_replicas(sim: KVFleetSim, result: SimResult) -> dict[str, set[str]]:
    by_id = {r.request_id: r for r in WORKLOAD}
    out: dict[str, set[str]] = defaultdict(set)
    for rec in result.records:
        out[by_id[rec.request_id].session].add(rec.replica)
    return out


def test_sessions_stick_unless_overloaded(runs: dict[str, Ran]) -> None:
    """With a ceiling no replica reaches, every session's turns go to one replica; with a ceiling
    at the least loaded replica's load, load moves some of them."""
    roomy = _run(pulls=True, sessions=True, imbalance_threshold=1e6)
    spread = _session_replicas(roomy.sim, roomy.result)
    assert len(spread) == AGENTS.contexts * (1 + AGENTS.forks)
    assert all(len(replicas) == 1 for replicas in spread.values())
    tight = _run(
        pulls=True,
        sessions=True,
        imbalance_threshold=0.0,
        imbalance_ratio=1.0,
        imbalance_reference="least",
    )
    assert any(len(r) > 1 for r in _session_replicas(tight.sim, tight.result).values())


def test_agent_workload_shares_contexts_and_turns() -> None:
    """A fork's turn begins with its previous turn's prompt; forks of a context share its tokens
    and nothing past them; contexts share nothing."""
    assert len(WORKLOAD) == AGENTS.num_requests
    assert agent_workload(AGENTS) == WORKLOAD
    assert agent_workload(AgentConfig(contexts=2, seed=1)) != agent_workload(
        AgentConfig(contexts=2)
    )
    tokens = {r.request_id: r.prompt_token_ids(i) for i, r in enumerate(WORKLOAD)}
    turns: dict[str, list[SimRequest]] = defaultdict(list)
    for r in WORKLOAD:
        turns[r.session].append(r)
    n = AGENTS.context_len
    for its in turns.values():
        for prev, nxt in itertools.pairwise(its):
            assert nxt.prompt_len > prev.prompt_len + prev.output_len
            assert tokens[nxt.request_id][: prev.prompt_len] == tokens[prev.request_id]
    firsts = [its[0] for its in turns.values()]
    for a in firsts:
        for b in firsts:
            same = a.context_group == b.context_group
            assert (tokens[a.request_id][:n] == tokens[b.request_id][:n]) == same
            if a is not b:
                assert tokens[a.request_id][n] != tokens[b.request_id][n]


@pytest.mark.parametrize("context_len", [2**64, -1, 10**30])
def test_a_context_length_out_of_range_is_clamped(context_len: int) -> None:
    """A request's context never reaches past its shared prefix nor below nothing."""
    base = SimRequest("r", 0.0, 64, 1, "g", 48, context_group="c", context_len=32)
    req = SimRequest("r", 0.0, 64, 1, "g", 48, context_group="c", context_len=context_len)
    assert req.shared_context_len == (0 if context_len < 0 else 48)
    tokens = req.prompt_token_ids(0)
    assert len(tokens) == 64
    assert tokens[48:] == base.prompt_token_ids(0)[48:]  # the unique suffix
    if context_len < 0:  # the group's own tokens throughout
        assert tokens[:48] == SimRequest("r", 0.0, 64, 1, "g", 48).prompt_token_ids(0)[:48]


@pytest.mark.parametrize("bad", [2**64, -1, math.nan, 10**30])
@pytest.mark.parametrize(
    "name",
    [
        "contexts",
        "context_len",
        "forks",
        "turns",
        "fork_after_s",
        "fork_spread_s",
        "start_spread_s",
    ],
)
def test_agent_settings_are_bounded(name: str, bad: float) -> None:
    with pytest.raises(ValueError, match=name):
        AgentConfig(**{name: bad})  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [2**64, -1, math.nan, 10**30])
def test_agent_ranges_are_bounded(bad: float) -> None:
    with pytest.raises(ValueError, match="question_len"):
        AgentConfig(question_len=(1, bad))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="think_s"):
        AgentConfig(think_s=(0.0, bad))


def test_fleet_kv_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="kv_events"):
        FleetKVConfig(kv_events=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="pull_link"):
        FleetKVConfig(pull_link={"latency_s": 1})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="latency_s"):
        LinkConfig(latency_s=math.nan)
    with pytest.raises(ValueError, match="peer_pulls"):
        KVFleetSim(SimConfig(routing=_routing(True)), CPU, FleetKVConfig(kv_events=False))


@pytest.mark.parametrize(
    "args",
    [
        ["--replicas", str(2**64)],
        ["--replicas", "-1"],
        ["--contexts-per-replica", "nan"],
        ["--contexts-per-replica", "1e30"],
        ["--jobs", "0"],
        ["--forks", "-1"],
        ["--link-latency", "nan"],
    ],
)
def test_agents_command_refuses_bad_arguments(
    args: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        sim_main(
            ["agents", "--replicas", "2", *args] if args[0] != "--replicas" else ["agents", *args]
        )
    assert exit_.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_agents_command_prints_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    sim_main(
        [
            "agents",
            "--replicas",
            "2",
            "--modes",
            "events",
            "pulls",
            "--context-len",
            "256",
            "--forks",
            "4",
            "--turns",
            "1",
            "--start-spread",
            "1",
            "--blocks",
            "128",
        ]
    )
    out = capsys.readouterr().out
    assert "| 2 | events |" in out and "| 2 | pulls |" in out
    assert "2 replicas: TTFT p90 recomputing (events) / pulling (pulls):" in out
