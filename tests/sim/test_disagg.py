"""Prefill/decode disaggregation in the simulator: every request prefills on a prefill replica,
its KV crosses the link in bytes / bandwidth + latency, it decodes on a decode replica without
recomputing its prompt, and its tokens and counts are the colocated fleet's."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from scheduler import SchedulerConfig
from sim import FleetSim, SimConfig, WorkloadConfig, load_profile, synthetic_workload
from sim.__main__ import main as sim_main
from sim.disagg import DecodeSimReplica, DisaggConfig, DisaggSim
from sim.disagg_study import MixConfig, figures, mixed_workload
from sim.kv_copy import LinkConfig
from sim.replica import step_shape

H100 = load_profile("h100")
SCHED = SchedulerConfig(num_gpu_blocks=256, max_model_len=2048, max_num_batched_tokens=256)


def _workload(n: int = 30, seed: int = 0, output_len: tuple[int, int] = (2, 24)):
    return synthetic_workload(
        WorkloadConfig(
            num_requests=n,
            rate=40.0,
            tenants=3,
            system_prompt_len=48,
            question_len=(20, 300),  # past the shared prompt, a full block of its own
            output_len=output_len,
            seed=seed,
        )
    )


def _count_decode_prefills(sim: DisaggSim) -> list[int]:
    """Wrap each decode replica's start_step to count its steps that compute prompt tokens."""
    counts = [0]
    for rep in sim.decode:
        start = rep.start_step

        def counted(now, stretch=1.0, rep=rep, start=start):
            plan = start(now, stretch)
            if plan is not None and step_shape(plan.output, rep.scheduler.requests)[0]:
                counts[0] += 1
            return plan

        rep.start_step = counted  # type: ignore[method-assign]
    return counts


@given(
    seed=st.integers(0, 1000),
    split=st.tuples(st.integers(1, 3), st.integers(1, 3)),
    latency=st.sampled_from([0.0, 0.002]),
)
def test_every_request_finishes_with_its_tokens_and_decodes_without_recompute(seed, split, latency):
    wl = _workload(seed=seed)
    disagg = DisaggConfig(*split, link=LinkConfig(1e9, latency))
    sim = DisaggSim(SimConfig(scheduler=SCHED), H100, disagg)
    prefills = _count_decode_prefills(sim)
    result = sim.run(wl)
    want = {r.request_id: r.output_len for r in wl}
    assert {r.request_id: r.num_output_tokens for r in result.records} == want
    for r in result.records:
        assert r.finish_s is not None and r.first_token_s is not None
        assert len(r.itl_s) == r.output_len - 1  # one gap a token after the first
        if r.output_len > 1:  # prefilled on one pool, decoded on the other
            pre, _, dec = r.replica.partition(">")
            assert pre.startswith("prefill-") and dec.startswith("decode-")
    assert prefills[0] == 0  # a landed request's first step is a one-token decode
    for rep in sim.decode:  # nothing left in a buffer, no block held
        assert not rep.buffer.cpu.slots and not rep.scheduler.loading
        assert rep.scheduler.kv.num_free_blocks == rep.scheduler.kv.pool.num_blocks


def test_the_first_decoded_token_waits_for_the_transfer():
    """One request: its second token comes at least the link's time after its first."""
    wl = _workload(n=1, output_len=(8, 8))
    gaps = {}
    for latency in (0.0, 0.5):
        link = LinkConfig(1e6, latency)
        result = DisaggSim(SimConfig(scheduler=SCHED), H100, DisaggConfig(1, 1, link)).run(wl)
        gaps[latency] = result.records[0].itl_s[0]
    transfer = LinkConfig(1e6, 0.5).seconds(wl[0].prompt_len, H100)
    assert transfer == pytest.approx(0.5 + wl[0].prompt_len * H100.kv_bytes_per_token / 1e6)
    assert gaps[0.5] - gaps[0.0] == pytest.approx(0.5)
    assert gaps[0.0] >= transfer - 0.5


def test_short_prompts_can_prefill_on_the_decode_pool():
    wl = _workload(n=30)
    disagg = DisaggConfig(1, 2, local_prefill_tokens=10_000)  # every prompt is short
    result = DisaggSim(SimConfig(scheduler=SCHED), H100, disagg).run(wl)
    assert all(r.replica.startswith("decode-") for r in result.records)
    assert sum(rep.num_steps for rep in result.replicas[:1]) == 0  # the prefill pool idles


def test_disaggregation_takes_long_prompts_off_the_decoding_replicas():
    """The study's workload, cut short: colocated chat requests wait through prefill steps between
    their tokens; on a decode pool, only the handoff's gap can be that long."""
    wl = mixed_workload(MixConfig(seconds=1.0, chat_rate=20, doc_rate=40))
    sched = SchedulerConfig(num_gpu_blocks=4096, max_model_len=16384)
    prefill_step = H100.prefill_step_overhead_s
    colo = FleetSim(SimConfig(num_replicas=4, scheduler=sched), H100).run(wl)
    split = DisaggSim(SimConfig(scheduler=sched), H100, DisaggConfig(3, 1)).run(wl)
    for result in (colo, split):
        assert figures(result, 1.0, 0.05)["done"] == len(wl)
    chat = [r for r in colo.records if r.tenant.startswith("chat")]
    assert max(g for r in chat for g in r.itl_s) > prefill_step
    chat = [r for r in split.records if r.tenant.startswith("chat")]
    assert max(g for r in chat for g in r.itl_s[1:]) < prefill_step


@pytest.mark.parametrize(
    "field, kwargs",
    [
        ("prefill_replicas", {"prefill_replicas": 0}),
        ("decode_replicas", {"decode_replicas": 2**64}),
        ("decode_replicas", {"decode_replicas": 1.5}),
        ("local_prefill_tokens", {"local_prefill_tokens": -1}),
    ],
)
def test_bad_pool_settings_name_their_field(field, kwargs):
    with pytest.raises(ValueError, match=field):
        DisaggConfig(**kwargs)


@pytest.mark.parametrize(
    "field, kwargs",
    [
        ("bandwidth_bytes_per_s", {"bandwidth_bytes_per_s": 0.0}),
        ("bandwidth_bytes_per_s", {"bandwidth_bytes_per_s": math.nan}),
        ("bandwidth_bytes_per_s", {"bandwidth_bytes_per_s": math.inf}),
        ("latency_s", {"latency_s": -1.0}),
        ("latency_s", {"latency_s": math.nan}),
        ("kv_bytes_per_token", {"kv_bytes_per_token": -1.0}),
    ],
)
def test_bad_link_settings_name_their_field(field, kwargs):
    with pytest.raises(ValueError, match=field):
        LinkConfig(**kwargs)


def test_decode_replicas_hold_a_receive_buffer():
    sim = DisaggSim(SimConfig(scheduler=SCHED), H100, DisaggConfig(2, 3))
    assert [r.name for r in sim.replicas] == [
        "prefill-0",
        "prefill-1",
        "decode-0",
        "decode-1",
        "decode-2",
    ]
    assert all(isinstance(r, DecodeSimReplica) for r in sim.decode)


def test_plan_sizes_both_pools(capsys):
    sim_main(
        [
            "plan",
            "--disagg",
            "--profile",
            "h100",
            "--requests",
            "60",
            "--rate",
            "30",
            "--question-len",
            "32,256",
            "--output-len",
            "16,64",
            "--slo-ttft",
            "0.2",
            "--slo-itl",
            "0.01",
            "--max-replicas",
            "8",
        ]
    )
    out = capsys.readouterr().out
    assert "prefill +" in out and "decode replicas" in out


def test_plan_refuses_a_bad_link(capsys):
    with pytest.raises(SystemExit) as exc:
        sim_main(["plan", "--disagg", "--requests", "1", "--link-bandwidth", "nan"])
    assert exc.value.code == 2 and "bandwidth_bytes_per_s" in capsys.readouterr().err


def test_the_study_compares_equal_gpu_counts(capsys):
    from sim.disagg_study import main as study_main

    study_main(["--gpus", "2", "--splits", "1:1", "--local", "0", "--seconds", "0.5"])
    out = capsys.readouterr().out
    assert "| colocated 2 |" in out and "| disagg 1:1 |" in out
    with pytest.raises(SystemExit) as exc:
        study_main(["--splits", "3"])
    assert exc.value.code == 2 and "PREFILL:DECODE" in capsys.readouterr().err


@given(seed=st.integers(0, 1000))
def test_coalesced_and_jumped_runs_equal_step_by_step_ones(seed):
    """The decode replicas' k-step jumps and back-to-back steps change nothing a record holds."""
    wl = _workload(n=30, seed=seed, output_len=(2, 60))

    def fingerprint(coalesce: bool):
        config = SimConfig(scheduler=SCHED, coalesce=coalesce)
        result = DisaggSim(config, H100, DisaggConfig(2, 2)).run(wl)
        return [
            (r.request_id, r.replica, r.first_token_s, r.finish_s, tuple(r.itl_s))
            for r in result.records
        ]

    assert fingerprint(True) == fingerprint(False)
