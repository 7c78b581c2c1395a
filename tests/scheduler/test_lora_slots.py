"""LoRA adapter slots in the scheduler: admission waits for a slot, never evicts an adapter in use,
and the prefix cache is keyed by adapter."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from scheduler import EngineRequest, Request, SamplingParams, Scheduler, SchedulerConfig
from scheduler.block_hash import hash_block_tokens, hash_prompt_blocks
from scheduler.lora_slots import LoraInUseError, LoraSlots, UnknownLoraError
from tests.scheduler.contract_runner import ContractRunner


def make(max_loras: int, adapters: int, **overrides) -> tuple[Scheduler, ContractRunner]:
    cfg = SchedulerConfig(
        **{
            "max_num_batched_tokens": 256,
            "max_num_seqs": 64,
            "block_size": 16,
            "num_gpu_blocks": 512,
            "max_model_len": 1024,
            **overrides,
        }
    )
    s = Scheduler(cfg)
    s.loras = LoraSlots(max_loras)
    for i in range(adapters):
        s.loras.register(f"a{i}", f"/adapters/a{i}")
    return s, ContractRunner(cfg.block_size, cfg.num_gpu_blocks, cfg.cpu_blocks)


def lora_req(rid: str, lora: str | None, n: int = 40, max_tokens: int = 6) -> Request:
    prompt = [100 + i for i in range(n)]
    return Request(
        EngineRequest(rid, prompt, SamplingParams(max_tokens=max_tokens), lora_name=lora)
    )


@pytest.mark.parametrize("bad", ["", "a" * 65, "a/b", "ü", "a b", 7, None.__class__])
def test_a_bad_lora_name_is_refused_naming_the_field(bad):
    with pytest.raises(ValueError, match="lora_name"):
        EngineRequest("r", [1], lora_name=bad)


def test_base_hashes_are_unchanged_and_each_adapter_has_its_own_chain():
    tokens = list(range(64))
    base = hash_prompt_blocks(tokens, 16)
    assert base == hash_prompt_blocks(tokens, 16, lora_name=None)
    assert base[0] == hash_block_tokens(None, tokens[:16])
    x, y = hash_prompt_blocks(tokens, 16, lora_name="x"), hash_prompt_blocks(tokens, 16, None, "y")
    assert x[0] == hash_block_tokens(None, tokens[:16], "x")
    assert not set(base) & set(x) and not set(x) & set(y)


def test_the_same_prompt_under_two_adapters_never_shares_blocks():
    s, r = make(max_loras=2, adapters=2)
    s.add_request(lora_req("x1", "a0", n=64))
    s.add_request(lora_req("b1", None, n=64))
    while s.has_unfinished_requests():
        out = s.schedule()
        s.update_from_output(out, r.execute(out))
    # Cached now under a0 and under the base model; a1 and a0 again look them up.
    s.add_request(lora_req("y", "a1", n=64))
    s.add_request(lora_req("x2", "a0", n=64))
    s.add_request(lora_req("b2", None, n=64))
    out = s.schedule()
    assert {n.req_id: n.num_computed_tokens for n in out.scheduled_new_reqs} == {
        "y": 0,
        "x2": 48,
        "b2": 48,
    }
    tables = {n.req_id: set(n.block_ids) for n in out.scheduled_new_reqs}
    assert not tables["y"] & tables["x2"] and not tables["x2"] & tables["b2"]


def test_more_adapters_than_slots_all_finish_with_their_adapter():
    s, r = make(max_loras=2, adapters=5)
    names = [f"a{i % 5}" for i in range(12)] + [None, None]
    for i, name in enumerate(names):
        s.add_request(lora_req(f"r{i}", name))
    slot_of: dict[int, str] = {}  # what the workers hold, from the loads they were sent
    adapter_of = {f"r{i}": name for i, name in enumerate(names)}
    seen: dict[str, str | None] = {}
    finished = set()
    for _ in range(1000):
        if not s.has_unfinished_requests():
            break
        out = s.schedule()
        for slot, (name, path) in out.lora_loads.items():
            assert path == f"/adapters/{name}"
            slot_of[slot] = name
        for new in out.scheduled_new_reqs:
            seen[new.req_id] = new.lora_name
        # Every running request's adapter is in a slot (never evicted under it), within bounds.
        live = {adapter_of[q.request_id] for q in s.running} - {None}
        assert live <= set(slot_of.values()) and len(slot_of) <= 2
        for o in s.update_from_output(out, r.execute(out)):
            if o.finished:
                finished.add(o.request_id)
    assert finished == set(adapter_of)
    assert seen == adapter_of
    assert s.loras.num_evictions >= 3 and not s.loras.users
    assert len(s.stats().loaded_loras) == 2


def test_unknown_and_in_use_adapters_are_refused():
    slots = LoraSlots(2)
    slots.register("a", "/a")
    with pytest.raises(ValueError, match="already"):
        slots.register("a", "/b")
    with pytest.raises(UnknownLoraError):
        slots.check("b")
    with pytest.raises(LookupError):
        slots.unregister("b", 0)
    with pytest.raises(LoraInUseError, match="'a'"):
        slots.unregister("a", 1)
    assert slots.acquire("a") and slots.loaded() == ("a",)
    slots.release("a")
    slots.unregister("a", 0)
    assert slots.loaded() == () and slots.names() == []
    with pytest.raises(ValueError, match="max_loras"):
        LoraSlots(0).register("a", "/a")


@given(
    max_loras=st.integers(1, 4),
    ops=st.lists(st.tuples(st.booleans(), st.integers(0, 6)), max_size=60),
)
def test_slots_never_evict_an_adapter_in_use_and_stay_in_bounds(max_loras, ops):
    slots = LoraSlots(max_loras)
    for i in range(7):
        slots.register(f"a{i}", f"/a{i}")
    held: list[str] = []
    for take, i in ops:
        name = f"a{i}"
        if take:
            before = dict(slots.slot_of)
            if slots.acquire(name):
                held.append(name)
            else:  # only when every slot's adapter is in use
                assert len(before) == max_loras and all(slots.users[n] for n in before)
        elif name in held:
            held.remove(name)
            slots.release(name)
        assert len(slots.slot_of) <= max_loras
        assert set(held) <= set(slots.slot_of)  # no adapter in use ever lost its slot
        assert sorted(slots.slot_of.values()) == sorted(slots.lru)
        assert all(0 <= s < max_loras for s in slots.slot_of.values())
        assert sum(slots.users.values()) == len(held)


def test_an_unknown_adapter_error_keeps_its_message_across_a_pickle():
    """Ray pickles a replica's error to the ingress: the name is said once."""
    import pickle

    error = pickle.loads(pickle.dumps(UnknownLoraError("nope")))
    assert str(error) == "lora_name: no LoRA adapter named 'nope' is loaded"
    assert error.name == "nope"


@pytest.mark.parametrize(
    "identity", [2**64, -1, float("nan"), "a@" + "0" * 10_000, "b@00", "", "@00"]
)
def test_a_lora_identity_that_is_not_its_names_is_refused_naming_it(identity):
    with pytest.raises(ValueError, match="lora_identity"):
        EngineRequest(
            "r", [1, 2], SamplingParams(max_tokens=4), lora_name="a", lora_identity=identity
        )
    with pytest.raises(ValueError, match="lora_identity"):  # the base model has no identity
        EngineRequest("r", [1, 2], SamplingParams(max_tokens=4), lora_identity="a@00")


def test_the_prefix_chain_is_keyed_by_the_identity_once_set():
    params = SamplingParams(max_tokens=4)
    named = EngineRequest("r", list(range(8)), params, lora_name="a")
    old = EngineRequest("r", list(range(8)), params, lora_name="a", lora_identity="a@00")
    new = EngineRequest("r", list(range(8)), params, lora_name="a", lora_identity="a@01")
    assert named.lora_key == "a" and old.lora_key == "a@00"
    chains = {
        tuple(hash_prompt_blocks(r.prompt_token_ids, 4, lora_name=r.lora_key))
        for r in (named, old, new)
    }
    assert len(chains) == 3
