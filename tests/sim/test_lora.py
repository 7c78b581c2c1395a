"""LoRA adapters in the simulator: Zipf popularity, LRU slots that never evict an adapter in use,
load time on the next step, nothing changed when adapters are off, exact under coalescing."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.config import RoutingConfig
from scheduler import SchedulerConfig
from sim import FleetSim, SimConfig, WorkloadConfig, load_profile, synthetic_workload
from sim.adapters import AdapterMix, AdapterSlotsConfig, adapter_name, with_adapters
from sim.lora_replica import LoraSimReplica
from sim.lora_study import LoraStudy, format_row


def _workload(n: int = 60, adapters: int = 6, base_share: float = 0.2, seed: int = 0):
    wl = synthetic_workload(
        WorkloadConfig(
            num_requests=n,
            rate=6.0,
            tenants=3,
            system_prompt_len=32,
            question_len=(4, 40),
            output_len=(1, 20),
            seed=seed,
        )
    )
    return with_adapters(wl, AdapterMix(adapters, 1.0, base_share, seed))


def _config(router: str = "prefix_affinity", slots: AdapterSlotsConfig | None = None, **kw):
    return SimConfig(
        num_replicas=3,
        scheduler=SchedulerConfig(
            num_gpu_blocks=80, max_model_len=256, max_num_batched_tokens=128, max_num_seqs=8
        ),
        routing=RoutingConfig(router_policy=router, seed=0),
        adapters=slots,
        **kw,
    )


def _fingerprint(result) -> list[tuple]:
    return [
        (r.request_id, r.replica, r.first_token_s, r.finish_s, r.num_output_tokens, r.cached_tokens)
        for r in result.records
    ]


def test_adapter_popularity_is_zipf_and_seeded():
    wl = _workload(n=2000, adapters=8, base_share=0.25)
    counts = Counter(r.lora_name for r in wl)
    assert 0.2 < counts[""] / len(wl) < 0.3
    ranked = [counts[adapter_name(k)] for k in range(8)]
    assert ranked[0] > 1.6 * ranked[1] > ranked[7]  # 1/k: rank 0 about twice rank 1
    assert wl == _workload(n=2000, adapters=8, base_share=0.25)
    # Only the adapter changes: arrivals, lengths and prompts are the workload's own.
    plain = _workload(n=2000, adapters=1, base_share=1.0)
    assert [dataclasses.replace(r, lora_name="") for r in wl] == plain


@pytest.mark.parametrize(
    "kwargs",
    [
        {"adapters": 0},
        {"adapters": 2**64},
        {"zipf_s": float("nan")},
        {"zipf_s": -1},
        {"base_share": 1.5},
    ],
)
def test_a_bad_adapter_mix_names_its_field(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        AdapterMix(**kwargs)


@pytest.mark.parametrize(
    "kwargs", [{"slots": 0}, {"slots": -1}, {"slots": True}, {"load_s": float("nan")}]
)
def test_bad_slot_settings_name_their_field(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        AdapterSlotsConfig(**kwargs)


def test_under_slot_pressure_every_request_finishes_and_loads_cost_step_time():
    """One slot, 12 adapters: the production scheduler's slots make requests wait, never fail;
    each load the scheduler sends lengthens its step by load_s."""
    wl = _workload(adapters=12)
    runs = [
        FleetSim(_config("least_loaded", AdapterSlotsConfig(1, load_s)), load_profile("cpu")).run(
            wl
        )
        for load_s in (0.0, 0.2)
    ]
    for result in runs:
        assert all(r.finish_s is not None for r in result.records)
        for rep in result.replicas:
            assert isinstance(rep, LoraSimReplica)
            assert len(rep.slots.loaded()) == 1 and not rep.slots.users
            assert not rep.scheduler.has_unfinished_requests()
    free, paid = runs
    loads = sum(rep.slots.num_loads for rep in paid.replicas)
    assert loads > 12 and sum(rep.slots.num_evictions for rep in paid.replicas) == loads - 3
    assert sum(rep.busy_s for rep in paid.replicas) > sum(rep.busy_s for rep in free.replicas)


def test_free_loads_and_ample_slots_change_nothing_for_a_load_only_router():
    """With one adapter for every request, loads that cost nothing and slots that never run out, a
    router blind to adapters gives the run without adapters to the bit: the adapter model adds only
    what it models (a shared system prompt stays shared under one adapter)."""
    plain_wl = _workload(base_share=1.0)
    one = _workload(adapters=1, base_share=0.0)
    plain = FleetSim(_config("least_loaded"), load_profile("cpu")).run(plain_wl)
    free = FleetSim(_config("least_loaded", AdapterSlotsConfig(8, 0.0)), load_profile("cpu")).run(
        one
    )
    assert _fingerprint(plain) == _fingerprint(free)
    assert [r.busy_s for r in plain.replicas] == [r.busy_s for r in free.replicas]
    assert sum(rep.slots.num_loads for rep in free.replicas) == 3


def test_adapters_are_ignored_without_slots():
    """SimConfig.adapters None: a workload naming adapters runs as if it named none."""
    named = FleetSim(_config(), load_profile("cpu")).run(_workload())
    plain = FleetSim(_config(), load_profile("cpu")).run(_workload(base_share=1.0))
    assert _fingerprint(named) == _fingerprint(plain)


def test_a_prompt_under_two_adapters_shares_no_blocks():
    """The simulator hashes a request's blocks under its adapter, as the ingress does: the same
    system prompt under two adapters is cached twice, once per adapter."""
    wl = _workload(n=40, adapters=2, base_share=0.0)
    cfg = dataclasses.replace(_config("round_robin", AdapterSlotsConfig(2, 0.0)), num_replicas=1)
    result = FleetSim(cfg, load_profile("cpu")).run(wl)
    first_hit = {}
    for rec, req in zip(result.records, wl):
        first_hit.setdefault((req.tenant, req.lora_name), rec.cached_tokens)
    assert all(cached == 0 for cached in first_hit.values())
    assert sum(r.cached_tokens for r in result.records) > 0


@pytest.mark.parametrize("router", ["prefix_affinity", "least_loaded"])
def test_coalesced_run_equals_step_by_step_with_adapters(router):
    wl = _workload(adapters=9)
    slots = AdapterSlotsConfig(2, 0.05)
    runs = [
        FleetSim(_config(router, slots, coalesce=c), load_profile("cpu")).run(wl)
        for c in (True, False)
    ]
    assert _fingerprint(runs[0]) == _fingerprint(runs[1])


def test_replicas_report_their_adapters_and_affinity_raises_the_hit_rate():
    study = LoraStudy(seconds=8.0, adapters_per_replica=4, slots=2)
    rows = {label: study.run(4, 1.5, label) for label in ("least_loaded", "adapter_affinity")}
    assert rows["adapter_affinity"]["adapter_hit_rate"] > rows["least_loaded"]["adapter_hit_rate"]
    assert format_row(rows["least_loaded"]).startswith("| 4 | least_loaded |")


@settings(max_examples=20, deadline=None)
@given(
    slots=st.integers(1, 3),
    adapters=st.integers(1, 6),
    base_share=st.sampled_from([0.0, 0.3]),
    router=st.sampled_from(["prefix_affinity", "least_loaded", "round_robin"]),
    seed=st.integers(0, 3),
)
def test_every_request_finishes_whatever_the_slots_and_the_mix(
    slots, adapters, base_share, router, seed
):
    wl = _workload(n=25, adapters=adapters, base_share=base_share, seed=seed)
    result = FleetSim(_config(router, AdapterSlotsConfig(slots, 0.01)), load_profile("cpu")).run(wl)
    assert all(r.finish_s is not None for r in result.records)
    for rep in result.replicas:
        assert len(rep.slots.loaded()) <= slots and not rep.slots.users
