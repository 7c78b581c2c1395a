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
from sim.adapters import AdapterMix, AdapterSlots, AdapterSlotsConfig, adapter_name, with_adapters
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


def test_slots_evict_the_least_recently_used_adapter_no_request_uses():
    slots = AdapterSlots(AdapterSlotsConfig(slots=2, load_s=0.5))
    assert slots.admit("a") and slots.admit("b")
    assert slots.take_load_s() == 1.0 and slots.take_load_s() == 0.0
    assert not slots.admit("c")  # both in use: the request waits
    slots.release("a")
    slots.admit("b")  # b is now the most recently used, and a is unused
    slots.release("b")
    slots.release("b")
    assert slots.admit("c")  # evicts a, the least recently used
    assert list(slots.loaded) == ["b", "c"] and slots.evictions == 1 and slots.loads == 3
    slots.arrive("b")
    slots.arrive("a")
    assert (slots.requests, slots.hits) == (2, 1)


@settings(max_examples=50, deadline=None)
@given(ops=st.lists(st.tuples(st.booleans(), st.sampled_from("abcde")), max_size=40))
def test_slots_never_exceed_their_count_nor_evict_an_adapter_in_use(ops):
    slots = AdapterSlots(AdapterSlotsConfig(slots=3))
    for admit, adapter in ops:
        if admit:
            before = set(slots.in_use)
            slots.admit(adapter)
            assert before <= set(slots.loaded)
        elif slots.in_use[adapter]:
            slots.release(adapter)
        assert len(slots.loaded) <= 3 and set(slots.in_use) <= set(slots.loaded)


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
    wl = _workload(adapters=12)
    free = FleetSim(_config("least_loaded", AdapterSlotsConfig(1, 0.0)), load_profile("cpu")).run(
        wl
    )
    paid = FleetSim(_config("least_loaded", AdapterSlotsConfig(1, 0.2)), load_profile("cpu")).run(
        wl
    )
    for result in (free, paid):
        assert all(r.finish_s is not None for r in result.records)
        for rep in result.replicas:
            assert isinstance(rep, LoraSimReplica)
            assert rep.slots.in_use == Counter() and not rep._held
            assert len(rep.slots.loaded) == 1
            assert not rep.scheduler.has_unfinished_requests()
    loads = sum(rep.slots.loads for rep in paid.replicas)
    assert loads > 12
    busy_paid = sum(rep.busy_s for rep in paid.replicas)
    assert busy_paid > sum(rep.busy_s for rep in free.replicas) + 0.2 * loads * 0.5


def test_free_loads_and_ample_slots_change_nothing_for_a_load_only_router():
    """With adapters off, and with loads that cost nothing and never wait, a router blind to
    adapters gives the same run to the bit: the adapter model adds only what it models."""
    wl = _workload()
    plain = FleetSim(_config("least_loaded"), load_profile("cpu")).run(wl)
    free = FleetSim(_config("least_loaded", AdapterSlotsConfig(64, 0.0)), load_profile("cpu")).run(
        wl
    )
    assert _fingerprint(plain) == _fingerprint(free)
    assert [r.busy_s for r in plain.replicas] == [r.busy_s for r in free.replicas]


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
