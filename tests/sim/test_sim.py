"""The fleet simulator: deterministic, conserving, fork-free, exact under coalescing, strict on
input."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import router.fleet
import router.policies
import scheduler
from router.config import RoutingConfig
from scheduler import SchedulerConfig
from sim import FleetSim, SimConfig, WorkloadConfig, load_profile, load_trace, synthetic_workload
from sim import fleet as sim_fleet
from sim import replica as sim_replica

ROOT = Path(__file__).resolve().parents[2]


def _run(
    policy: str = "prefix_affinity",
    coalesce: bool = True,
    seed: int = 0,
    n: int = 80,
    blocks: int = 60,
    fair: bool = False,
    output_len: tuple[int, int] = (1, 24),
    rate: float = 4.0,
    profile: str = "cpu",
):
    wl = synthetic_workload(
        WorkloadConfig(
            num_requests=n,
            rate=rate,
            tenants=5,
            system_prompt_len=64,
            question_len=(4, 40),
            output_len=output_len,
            seed=seed,
        )
    )
    sched = SchedulerConfig(
        num_gpu_blocks=blocks,
        max_model_len=256,
        max_num_batched_tokens=128,
        max_num_seqs=8,
        policy="fair" if fair else "fcfs",
    )
    cfg = SimConfig(
        num_replicas=3,
        scheduler=sched,
        routing=RoutingConfig(router_policy=policy, seed=seed),
        coalesce=coalesce,
    )
    sim = FleetSim(cfg, load_profile(profile))
    return wl, sim.run(wl)


def _fingerprint(result) -> list[tuple]:
    return [
        (
            r.request_id,
            r.replica,
            r.first_token_s,
            r.finish_s,
            r.num_output_tokens,
            r.cached_tokens,
            tuple(r.itl_s),
        )
        for r in result.records
    ]


def test_same_seed_same_result_and_other_seed_differs():
    assert _fingerprint(_run(seed=1)[1]) == _fingerprint(_run(seed=1)[1])
    assert _fingerprint(_run(seed=1)[1]) != _fingerprint(_run(seed=2)[1])


def test_a_run_collects_garbage_rarely_and_leaves_the_collector_as_it_found_it():
    """Young collections are rare while a run is in progress (they took a quarter of a
    1,000-replica run's wall time); the threshold and the frozen set come back, also after a
    failure."""
    import gc

    threshold = gc.get_threshold()
    seen: list[tuple] = []
    wl = synthetic_workload(WorkloadConfig(num_requests=5, rate=4.0, tenants=1, seed=0))
    FleetSim(
        SimConfig(num_replicas=2),
        load_profile("cpu"),
        on_step=lambda replica, now: seen.append((gc.get_threshold()[0], gc.get_freeze_count())),
    ).run(wl)
    assert seen and all(
        young == sim_fleet.RUN_GC_THRESHOLD and frozen > 0 for young, frozen in seen
    )
    assert gc.get_threshold() == threshold and gc.get_freeze_count() == 0

    def fail(replica, now):
        raise RuntimeError("injected")

    with pytest.raises(RuntimeError, match="injected"):
        FleetSim(SimConfig(num_replicas=2), load_profile("cpu"), on_step=fail).run(wl)
    assert gc.get_threshold() == threshold and gc.get_freeze_count() == 0


@pytest.mark.parametrize(
    "policy", ["round_robin", "least_loaded", "power_of_two", "prefix_affinity"]
)
def test_every_request_finishes_with_its_length_and_no_block_leaks(policy):
    wl, result = _run(policy, blocks=40)  # tight pool: preemptions happen
    by_id = {r.request_id: r for r in wl}
    for rec in result.records:
        assert rec.finish_s is not None, rec.request_id
        assert rec.num_output_tokens == by_id[rec.request_id].output_len
        assert rec.finish_reason in ("stop", "length")
    for rep in result.replicas:
        assert not rep.scheduler.has_unfinished_requests()
        assert rep.scheduler.kv.num_free_blocks == rep.scheduler.config.num_gpu_blocks
        assert rep.output_len == {}


@pytest.mark.parametrize("policy,fair", [("prefix_affinity", False), ("round_robin", True)])
def test_coalesced_run_equals_step_by_step(policy, fair):
    _, coalesced = _run(policy, coalesce=True, fair=fair)
    _, stepwise = _run(policy, coalesce=False, fair=fair)
    assert _fingerprint(coalesced) == _fingerprint(stepwise)
    assert coalesced.summary() == stepwise.summary()
    assert coalesced.coalesced_steps > 0 and stepwise.coalesced_steps == 0
    assert coalesced.jumped_steps > 0 and stepwise.jumped_steps == 0


@pytest.mark.parametrize(
    "profile,rate,output_len,blocks,fair",
    [
        ("cpu", 4.0, (1, 24), 60, False),
        (
            "cpu",
            2.0,
            (40, 150),
            60,
            True,
        ),  # long decodes, a tight pool: jumps stop at block shortages
        (
            "h100",
            400.0,
            (20, 150),
            200,
            False,
        ),  # sub-ms steps: stretches of hundreds between arrivals
    ],
)
def test_k_step_jumps_equal_step_by_step(profile, rate, output_len, blocks, fair):
    """Jumped stretches make the scheduler decisions, step counts and token times of single
    steps."""
    kw = dict(profile=profile, rate=rate, output_len=output_len, blocks=blocks, fair=fair, n=60)
    _, jumped = _run(coalesce=True, **kw)
    _, stepwise = _run(coalesce=False, **kw)
    assert jumped.jumped_steps > 0
    assert _fingerprint(jumped) == _fingerprint(stepwise)  # finish times, TTFTs, outputs, every ITL
    assert [(r.num_steps, r.busy_s) for r in jumped.replicas] == [
        (r.num_steps, r.busy_s) for r in stepwise.replicas
    ]
    assert [r.scheduler.num_preemptions for r in jumped.replicas] == [
        r.scheduler.num_preemptions for r in stepwise.replicas
    ]
    assert jumped.summary() == stepwise.summary()


def test_sim_uses_the_production_classes():
    """The replicas' scheduler is the production one, the multi-step decode (sim/jump.py) among
    its features."""
    assert sim_replica.Request is scheduler.Request
    assert sim_fleet.FleetState is router.fleet.FleetState
    assert sim_fleet.RouteRequest is router.policies.RouteRequest
    _, result = _run(n=5)
    assert all(type(r.scheduler) is scheduler.Scheduler for r in result.replicas)
    assert all(r.scheduler.features == [r.decode_jump] for r in result.replicas)


def test_sim_imports_neither_torch_nor_ray():
    code = (
        "import sys, sim, sim.fleet, sim.__main__; "
        "bad = [m for m in ('torch', 'ray') if m in sys.modules]; print(bad); sys.exit(1 if bad "
        "else 0)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize(
    "line,message",
    [
        ('{"arrival_s": 0, "prompt_len": 5}', "field 'output_len': missing"),
        (
            '{"arrival_s": 0, "prompt_len": "5", "output_len": 2}',
            "field 'prompt_len': expected int",
        ),
        ('{"arrival_s": -1, "prompt_len": 5, "output_len": 2}', "field 'arrival_s'"),
        (
            '{"arrival_s": 0, "prompt_len": 5, "output_len": 2, "colour": 1}',
            "field 'colour': unknown",
        ),
        ('{"arrival_s": 0, "prompt_len": 5, "output_len": 0}', "field 'output_len'"),
        (
            '{"arrival_s": 0, "prompt_len": 5, "output_len": 2, "prefix_len": 9}',
            "field 'prefix_len'",
        ),
        ("[1, 2]", "expected a JSON object"),
        ('{"arrival_s": 0,', "invalid JSON"),
    ],
)
def test_bad_trace_line_names_line_and_field(tmp_path, line, message):
    path = tmp_path / "trace.jsonl"
    path.write_text('{"arrival_s": 0.5, "prompt_len": 5, "output_len": 2}\n\n' + line + "\n")
    with pytest.raises(ValueError, match="trace line 3") as err:
        load_trace(path)
    assert message in str(err.value)


def test_trace_replay_runs(tmp_path):
    path = tmp_path / "trace.jsonl"
    rows = [
        {
            "arrival_s": 0.1 * i,
            "prompt_len": 40,
            "output_len": 3,
            "prefix_group": "g",
            "prefix_len": 32,
            "tenant": "a",
            "priority": 0,
        }
        for i in range(6)
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    result = FleetSim(SimConfig(num_replicas=1), load_profile("cpu")).run(load_trace(path))
    assert [r.num_output_tokens for r in result.records] == [3] * 6
    assert sum(r.cached_tokens for r in result.records) > 0  # the shared prefix is a cache hit


def test_bad_profile_and_config_name_the_field(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(
        json.dumps(
            {
                "name": "x",
                "flops_per_s": 1.0,
                "bytes_per_s": 1.0,
                "num_params": 1,
                "weight_bytes": 1,
                "kv_bytes_per_token": 1,
                "speed": 3,
            }
        )
    )
    with pytest.raises(ValueError, match="'speed'"):
        load_profile(str(path))
    path.write_text(json.dumps({"name": "x", "flops_per_s": "fast"}))
    with pytest.raises(ValueError, match="'flops_per_s'"):
        load_profile(str(path))
    with pytest.raises(ValueError, match="num_replicas"):
        SimConfig(num_replicas=0)
    with pytest.raises(ValueError, match="rate"):
        WorkloadConfig(rate=float("nan"))
    for bad in (-1, -0.001, float("nan"), float("inf"), 2.0**64, 1e6):
        with pytest.raises(ValueError, match="serving_overhead_s"):
            SimConfig(serving_overhead_s=bad)


def test_serving_overhead_delays_routing_and_adds_to_ttft_and_latency():
    """The Serve stack's own time comes before the router: an idle fleet's TTFT grows by exactly
    it."""
    from sim import SimRequest

    workload = [SimRequest("a", 1.0, prompt_len=40, output_len=8)]
    bare, served = (
        FleetSim(SimConfig(num_replicas=1, serving_overhead_s=overhead), load_profile("cpu")).run(
            workload
        )
        for overhead in (0.0, 0.0132)
    )
    (b,), (s,) = bare.records, served.records
    assert s.ttft_s == pytest.approx(b.ttft_s + 0.0132)
    assert s.finish_s - s.arrival_s == pytest.approx(b.finish_s - b.arrival_s + 0.0132)
    assert s.itl_s == pytest.approx(b.itl_s)


def test_plan_picks_the_smallest_fleet_meeting_the_slos(capsys):
    from sim.__main__ import main

    main(
        [
            "plan",
            "--requests",
            "200",
            "--rate",
            "12",
            "--slo-ttft",
            "1.0",
            "--slo-itl",
            "0.5",
            "--max-replicas",
            "8",
        ]
    )
    out = capsys.readouterr().out
    picked = int(out.split("plan: ")[1].split()[0])
    rows = [line.split("|") for line in out.splitlines() if line.startswith("| prefix_affinity")]
    by_n = {int(r[2]): (float(r[6]), float(r[7])) for r in rows}
    assert by_n[picked][0] <= 1.0 and by_n[picked][1] <= 0.5
    assert all(t > 1.0 or i > 0.5 for n, (t, i) in by_n.items() if n < picked)
    assert picked - 1 in by_n or picked == 1  # the count below was tried and failed


def test_cli_bad_trace_exits_with_the_line(tmp_path, capsys):
    from sim.__main__ import main

    path = tmp_path / "t.jsonl"
    path.write_text('{"arrival_s": 0, "prompt_len": 4}\n')
    with pytest.raises(SystemExit) as exc:
        main(["run", "--trace", str(path)])
    assert exc.value.code == 2
    assert "trace line 1, field 'output_len': missing" in capsys.readouterr().err


def test_prompt_hashes_cached_per_prefix_group_equal_the_scheduler_hash():
    from scheduler import hash_prompt_blocks

    wl = synthetic_workload(
        WorkloadConfig(num_requests=40, tenants=3, system_prompt_len=40, question_len=(1, 30))
    )
    sim = FleetSim(SimConfig(num_replicas=1), load_profile("cpu"))
    for i, req in enumerate(wl):
        prompt = req.prompt_token_ids(i)
        assert sim._hashes(req, prompt, None) == hash_prompt_blocks(prompt, 16)
        assert sim._hashes(req, prompt, "x") == hash_prompt_blocks(prompt, 16, lora_name="x")


def test_run_until_stops_at_that_simulated_second_with_the_same_history():
    wl = synthetic_workload(
        WorkloadConfig(num_requests=80, rate=8.0, tenants=4, system_prompt_len=32, seed=3)
    )
    cfg = SimConfig(
        num_replicas=2, scheduler=SchedulerConfig(num_gpu_blocks=120, max_model_len=256)
    )
    full = FleetSim(cfg, load_profile("cpu")).run(wl)
    cut = FleetSim(cfg, load_profile("cpu")).run(wl, until_s=5.0)
    assert cut.end_s == 5.0
    done = [r for r in full.records if r.finish_s <= 5.0]
    assert done and len(done) < len(wl)
    assert _fingerprint(SimpleNamespace(records=done)) == _fingerprint(
        SimpleNamespace(records=[r for r in cut.records if r.finish_s is not None])
    )


def test_the_fleet_itl_tally_counts_exactly_the_finished_requests_gaps():
    """Gaps are tallied as they happen (a jump's shared gaps once for all its requests), and a run
    cut short takes back those of the requests it leaves in flight."""
    from collections import Counter

    wl = synthetic_workload(
        WorkloadConfig(
            num_requests=120, rate=6.0, tenants=4, system_prompt_len=32, output_len=(8, 120), seed=5
        )
    )
    cfg = SimConfig(
        num_replicas=2, scheduler=SchedulerConfig(num_gpu_blocks=200, max_model_len=512)
    )
    for until in (math.inf, 9.0):
        result = FleetSim(cfg, load_profile("cpu")).run(wl, until_s=until)
        finished = [r for r in result.records if r.finish_s is not None]
        assert result.jumped_steps and 0 < len(finished) <= len(wl)
        assert len(finished) < len(wl) or until == math.inf
        expected = Counter(int(gap * 1e5) for r in finished for gap in r.itl_s)
        assert result.itl_tally == expected


def test_vtc_counter_gap_between_backlogged_tenants_stays_within_the_bound():
    from sim.studies import CounterGap, vtc_gap_bound

    wl = synthetic_workload(
        WorkloadConfig(
            num_requests=300,
            rate=8.0,
            tenants=5,
            tenant_weights=[8, 1, 1, 1, 1],
            system_prompt_len=0,
            question_len=(16, 96),
            output_len=(4, 32),
            seed=2,
        )
    )
    sched = SchedulerConfig(num_gpu_blocks=256, max_model_len=256, policy="fair", max_num_seqs=8)
    gap = CounterGap()
    result = FleetSim(
        SimConfig(num_replicas=1, scheduler=sched), load_profile("cpu"), on_step=gap
    ).run(wl)
    assert result.replicas[0].scheduler.num_preemptions == 0  # the bound assumes none
    assert gap.samples > 100  # tenants stayed backlogged together for most of the run
    assert (
        0
        < gap.max_gap
        <= vtc_gap_bound(sched, wl, gap.max_running_per_tenant)
        <= vtc_gap_bound(sched, wl)
    )


def test_arrival_exactly_at_a_step_end_of_a_cruise_matches_step_by_step():
    """Arrivals come before step ends of the same instant: a cruise cut there keeps that step."""
    from sim import SimRequest

    ends: list[float] = []
    long_one = SimRequest("long", 0.0, prompt_len=40, output_len=200)
    cfg = SimConfig(
        num_replicas=1,
        scheduler=SchedulerConfig(num_gpu_blocks=64, max_model_len=512),
        coalesce=False,
    )
    FleetSim(cfg, load_profile("h100"), on_step=lambda _, now: ends.append(now)).run([long_one])
    at = ends[len(ends) // 3]  # the exact float end of a step in the middle of a decode stretch
    workload = [long_one, SimRequest("late", at, prompt_len=20, output_len=5)]
    jumped, stepwise = (
        FleetSim(dataclasses.replace(cfg, coalesce=c), load_profile("h100")).run(workload)
        for c in (True, False)
    )
    assert _fingerprint(jumped) == _fingerprint(stepwise)
    assert jumped.jumped_steps > 0


class _ReportLog(router.fleet.FleetState):
    """The production router, noting every report it is handed (replica, instant, report)."""

    def __init__(self, config: RoutingConfig) -> None:
        super().__init__(config)
        self.log: list[tuple] = []

    def on_stats(self, replica, stats, now):
        figures = stats.scheduler
        self.log.append(
            (
                replica,
                now,
                figures.num_waiting,
                figures.num_running,
                figures.kv_cache_usage,
                tuple(stats.prefix.hashes),
            )
        )
        super().on_stats(replica, stats, now)


def test_a_busy_replica_reports_once_its_running_step_ends_in_cruises_as_step_by_step():
    """Long decodes cruise across many stats takes; every report the router receives, and when,
    matches step-by-step simulation, and a report comes after the step running at its take."""
    wl = synthetic_workload(
        WorkloadConfig(
            num_requests=40,
            rate=1.0,
            tenants=3,
            system_prompt_len=64,
            question_len=(4, 40),
            output_len=(60, 200),
            seed=3,
        )
    )
    logs = []
    for coalesce in (True, False):
        cfg = SimConfig(
            num_replicas=3,
            scheduler=SchedulerConfig(num_gpu_blocks=200, max_model_len=512),
            routing=RoutingConfig(router_policy="prefix_affinity"),
            coalesce=coalesce,
            stats_period_s=0.3,
            stats_delay_s=0.0,
        )
        sim = FleetSim(cfg, load_profile("cpu"))
        sim.fleet = _ReportLog(cfg.routing)
        result = sim.run(wl)
        logs.append((sim.fleet.log, _fingerprint(result), result.jumped_steps))
    (cruised, cruised_fp, jumped), (stepwise, stepwise_fp, _) = logs
    assert jumped > 0
    assert cruised == stepwise and cruised_fp == stepwise_fp
    # No delivery delay: an idle replica's report arrives at its take, a busy one's when its step
    # ends.
    takes = sorted({when for _, when, *_ in stepwise})
    late = [
        when
        for _, when, *_ in stepwise
        if min(abs(when - k * 0.3) for k in range(int(when / 0.3) + 2)) > 1e-9
    ]
    assert late and len(late) < len(stepwise), (len(late), len(stepwise), takes[:5])


def test_cohosted_replicas_share_cores_while_both_are_busy():
    """One core for two one-core replicas: while both run, each step takes twice the profile's
    time."""
    from sim import HostConfig, SimRequest

    sched = SchedulerConfig(num_gpu_blocks=64, max_model_len=256)
    cfg = SimConfig(
        num_replicas=2, scheduler=sched, routing=RoutingConfig(router_policy="round_robin")
    )
    one = [SimRequest("a", 0.0, prompt_len=40, output_len=12)]
    two = one + [SimRequest("b", 0.0, prompt_len=40, output_len=12)]
    alone = FleetSim(cfg, load_profile("cpu")).run(one)
    shared = dataclasses.replace(
        cfg, host=HostConfig(replicas_per_host=2, cores=1.0, cores_per_replica=1.0)
    )
    both = FleetSim(shared, load_profile("cpu")).run(two)
    assert {r.replica for r in both.records} == {"replica-0", "replica-1"}
    for rec in both.records:
        assert rec.finish_s == pytest.approx(2 * alone.records[0].finish_s)
    # Separate hosts (one replica per host), or enough cores: no stretch.
    for host in (
        HostConfig(replicas_per_host=1, cores=1.0),
        HostConfig(replicas_per_host=2, cores=2.0),
    ):
        apart = FleetSim(dataclasses.replace(cfg, host=host), load_profile("cpu")).run(two)
        assert [r.finish_s for r in apart.records] == [alone.records[0].finish_s] * 2


@pytest.mark.parametrize("background", [0.0, 0.5])
def test_cohosted_coalesced_run_equals_step_by_step(background):
    from sim import HostConfig

    wl = synthetic_workload(
        WorkloadConfig(
            num_requests=60,
            rate=4.0,
            tenants=5,
            system_prompt_len=64,
            question_len=(4, 40),
            output_len=(1, 40),
            seed=4,
        )
    )
    sched = SchedulerConfig(
        num_gpu_blocks=60, max_model_len=256, max_num_batched_tokens=128, max_num_seqs=8
    )
    host = HostConfig(
        replicas_per_host=2, cores=2.0, cores_per_replica=1.0, background_cores=background
    )
    runs = [
        FleetSim(
            SimConfig(
                num_replicas=3,
                scheduler=sched,
                host=host,
                coalesce=c,
                routing=RoutingConfig(router_policy="least_loaded"),
            ),
            load_profile("cpu"),
        ).run(wl)
        for c in (True, False)
    ]
    assert _fingerprint(runs[0]) == _fingerprint(runs[1])
    assert runs[0].coalesced_steps > 0 and runs[0].jumped_steps == 0


def test_bad_host_config_names_the_field():
    from sim import HostConfig

    with pytest.raises(ValueError, match="replicas_per_host"):
        HostConfig(replicas_per_host=0)
    with pytest.raises(ValueError, match="background_cores"):
        HostConfig(cores=2.0, background_cores=2.0)
    assert HostConfig(replicas_per_host=2, cores=2.0, background_cores=0.5).stretch(
        2
    ) == pytest.approx(2 / 1.5)


@pytest.mark.parametrize("field", ["cores", "cores_per_replica", "background_cores"])
@pytest.mark.parametrize("value", [-1.0, float("nan"), float("inf")])
def test_hostile_host_config_values_name_the_field(field, value):
    from sim import HostConfig

    with pytest.raises(ValueError, match=field):
        HostConfig(**{"cores": 4.0, field: value})


def test_host_config_takes_counts_up_to_its_bound_and_refuses_the_rest():
    from sim import HostConfig
    from sim.fleet_config import MAX_HOST_CORES

    assert HostConfig(replicas_per_host=MAX_HOST_CORES, cores=MAX_HOST_CORES).stretch(3) == 1.0
    for bad in (-1, 0, 2.5, True, float("nan"), MAX_HOST_CORES + 1, 2**63 - 1, 2**64):
        with pytest.raises(ValueError, match="replicas_per_host"):
            HostConfig(replicas_per_host=bad)


@pytest.mark.parametrize(
    "field", ["step_overhead_s", "prefill_step_overhead_s", "prefill_pair_s", "bytes_per_s"]
)
@pytest.mark.parametrize("value", [-1.0, float("nan"), float("inf")])
def test_hostile_cost_model_values_name_the_field(field, value):
    base = dataclasses.asdict(load_profile("cpu"))
    with pytest.raises(ValueError, match=field):
        type(load_profile("cpu"))(**{**base, field: value})


@settings(max_examples=200, deadline=None)
@given(
    profile=st.sampled_from(["cpu", "h100"]),
    seqs=st.integers(1, 300),
    kv=st.integers(0, 10**6),
    steps=st.integers(0, 50),
    start=st.floats(0, 1e5),
    horizon=st.floats(0, 2e5),
    memory_scale=st.sampled_from([1e-3, 1.0, 1e3]),
)
def test_decode_steps_times_each_step_as_step_time_does_to_the_bit(
    profile, seqs, kv, steps, start, horizon, memory_scale
):
    """A cruise's step times are the single steps' (memory_scale moves the roofline's knee)."""
    cost = dataclasses.replace(
        load_profile(profile), bytes_per_s=load_profile(profile).bytes_per_s * memory_scale
    )
    ends: list[float] = []
    durations: list[float] = []
    cost.decode_steps(seqs, kv, start, steps, horizon, ends, durations)
    expected_ends, expected, t = [], [], start
    for i in range(steps):
        d = cost.step_time(0, seqs, kv + i * seqs, seqs)
        t += d
        expected_ends.append(t)
        expected.append(d)
        if t > horizon:
            break
    assert (ends, durations) == (expected_ends, expected)


def test_requests_arriving_at_one_instant_are_scheduled_together():
    """As an engine handed a batch: the first step prefills all of them, so all get their first
    token at once."""
    from sim import SimRequest

    wl = [SimRequest(f"r{i}", 0.0, prompt_len=20 + i, output_len=3) for i in range(4)]
    result = FleetSim(SimConfig(num_replicas=1), load_profile("cpu")).run(wl)
    assert len({r.first_token_s for r in result.records}) == 1
    assert result.replicas[0].num_steps == 3


def _bench_module(name: str):
    """A bench/ script loaded as a module (bench/ is a folder of scripts, not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[name]
    return module


def test_validation_workloads_are_the_benchmarks_own():
    """The offline trace holds the bench's totals; the router workload redraws the bench's
    arrivals."""
    validate = _bench_module("sim_validate")
    prompts, outputs = validate.offline_lengths()
    assert (len(prompts), sum(prompts), sum(outputs)) == (64, 7326, 4385)
    theirs = _bench_module("router_bench").Workload().build(16)
    ours = validate.router_bench_workload()
    assert [(round(t, 12), r.tenant, len(r.prompt_token_ids)) for t, r in theirs] == [
        (round(r.arrival_s, 12), r.tenant, r.prompt_len) for r in ours
    ]


def test_capacity_is_what_an_overloaded_replica_completes_and_refuses_an_underload():
    """The studies' load unit: completions per replica-second while every queue stays non-empty."""
    from sim.studies import capacity, fleet_config, fleet_workload

    cap = capacity(
        fleet_workload, fleet_config, overload_rate=64.0, replicas=2, seconds=40.0, warmup_s=10.0
    )
    assert 0 < cap < 64.0
    # Twice the overload completes no more (within a request per replica-second): it is the ceiling.
    assert capacity(
        fleet_workload, fleet_config, overload_rate=128.0, replicas=2, seconds=40.0, warmup_s=10.0
    ) == pytest.approx(cap, abs=1.0)
    with pytest.raises(ValueError, match="overload_rate"):
        capacity(
            fleet_workload, fleet_config, overload_rate=0.5, replicas=2, seconds=40.0, warmup_s=10.0
        )


def test_the_floor_study_times_replicas_that_only_decode_and_report():
    """Its premise holds through the window (every replica keeps its requests decoding, none queued
    or finished), and a window that outlasts the requests is refused, not timed. (How fast it runs
    is the study's figure, never a test's.)"""
    from sim.studies import TARGET_US_PER_REPLICA_S, scale_floor

    assert (
        pytest.approx(250.0) == TARGET_US_PER_REPLICA_S
    )  # 15 wall minutes for 3.6 million replica-seconds
    (row,) = scale_floor((4,), running=2, seconds=3.0, warmup_s=1.0)
    assert row["replicas"] == 4 and row["us_per_replica_s"] > 0  # the window was timed
    assert row["budget_share"] == pytest.approx(row["us_per_replica_s"] / 250.0)
    # Every replica stepped through the whole run of 5 simulated s (a 2-request step takes ~30 ms).
    assert row["min_replica_steps"] > 5.0 / 0.1
    with pytest.raises(ValueError, match="seconds: .* requests finished"):
        scale_floor((2,), running=2, seconds=200.0, warmup_s=1.0)
