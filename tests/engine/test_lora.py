"""Multi-LoRA serving end to end on a tiny random Llama: raylm's greedy tokens under each adapter
equal transformers + peft, in mixed batches, under slot pressure, chunked prefill and preemption;
bad adapters are refused by name and the engine keeps serving."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from safetensors.torch import load_file, save_file

from engine.llm import LLM
from scheduler import EngineRequest, LoraInUseError, SamplingParams, UnknownLoraError
from tests.random_checkpoint import random_prompts
from tests.random_lora import peft_model, write_random_lora
from tests.workers.greedy import hf_greedy

pytestmark = pytest.mark.slow

MAX_TOKENS = 10
# name -> how it is drawn: ranks 2 to 16, rsLoRA, attention-only and MLP-only targets.
ADAPTERS = {
    "a0": dict(seed=10, rank=8),
    "a1": dict(seed=11, rank=4, use_rslora=True, targets=["q_proj", "v_proj"]),
    "a2": dict(seed=12, rank=16, alpha=8.0, targets=["gate_proj", "up_proj", "down_proj"]),
    "a3": dict(seed=13, rank=2, targets=["k_proj", "o_proj"]),
}
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def base(tiny_checkpoint):
    return tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def lora_root(base, tmp_path_factory):
    root = tmp_path_factory.mktemp("loras")
    for name, spec in ADAPTERS.items():
        write_random_lora(base[0], str(root / name), **spec)
    return str(root)


@pytest.fixture(scope="module")
def prompts(base):
    return random_prompts(2, 256, 18, 40, seed=21)


@pytest.fixture(scope="module")
def references(base, lora_root, prompts):
    """(adapter or None, prompt index) -> transformers + peft greedy tokens."""
    path, hf_base = base
    refs = {(None, i): hf_greedy(hf_base, p, MAX_TOKENS).token_ids for i, p in enumerate(prompts)}
    for name in ADAPTERS:
        model = peft_model(path, os.path.join(lora_root, name))
        for i, p in enumerate(prompts):
            refs[(name, i)] = hf_greedy(model, p, MAX_TOKENS).token_ids
    return refs


def make_llm(model: str, adapters_dir: str, **kwargs) -> LLM:
    modules = {name: os.path.join(adapters_dir, name) for name in ADAPTERS}
    return LLM(model, device="cpu", load_progress=False, lora_modules=modules, **kwargs)


@pytest.fixture(scope="module")
def llm(base, lora_root):
    """Two slots for four adapters: every mixed batch is under slot pressure."""
    with make_llm(
        base[0], lora_root, num_gpu_blocks=256, max_loras=2, max_cpu_loras=8, lora_root=lora_root
    ) as llm:
        yield llm


def test_each_adapter_alone_matches_transformers_and_peft(llm, prompts, references):
    for name in [None, *ADAPTERS]:
        outs = llm.generate(prompts, GREEDY, use_tqdm=False, lora=name)
        for i, out in enumerate(outs):
            assert out.token_ids == references[(name, i)], (name, i)
    assert all(references[(n, 0)] != references[(None, 0)] for n in ADAPTERS)


def test_a_batch_mixing_four_adapters_and_the_base_model_under_slot_pressure(
    llm, prompts, references
):
    names = [None, *ADAPTERS] * 2
    batch = [p for p in prompts for _ in names]
    loras = names * len(prompts)
    outs = llm.generate(batch, GREEDY, use_tqdm=False, lora=loras)
    for k, out in enumerate(outs):
        assert out.token_ids == references[(loras[k], k // len(names))], (loras[k], k)
    stats = llm.engine.stats()
    assert len(stats.loaded_loras) == 2 and llm.engine.scheduler.loras.num_evictions > 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_chunked_prefill_and_preemption_give_the_same_tokens(
    base, lora_root, prompts, references, mode
):
    with make_llm(
        base[0],
        lora_root,
        num_gpu_blocks=10,  # 12 requests of up to 4 blocks each: preemptions
        num_cpu_blocks=48,
        max_num_batched_tokens=16,  # prompts of 18+ tokens prefill in chunks
        long_prefill_token_threshold=8,
        preemption_mode=mode,
        max_loras=4,
    ) as tight:
        names = [None, "a0", "a1", "a2", "a3", "a0"]
        batch = [p for p in prompts for _ in names]
        loras = names * len(prompts)
        outs = tight.generate(batch, GREEDY, use_tqdm=False, lora=loras)
        for k, out in enumerate(outs):
            assert out.token_ids == references[(loras[k], k // len(names))], (loras[k], k)
        assert tight.engine.stats().num_preemptions > 0


def test_the_same_prompt_under_another_adapter_reuses_no_cached_block(llm):
    prompt = random_prompts(1, 256, 33, 33, seed=99)[0]  # two full blocks, new to the cache
    first = llm.generate([prompt], GREEDY, use_tqdm=False, lora="a3")[0]
    again = llm.generate([prompt], GREEDY, use_tqdm=False, lora="a3")[0]
    other = llm.generate([prompt], GREEDY, use_tqdm=False, lora="a1")[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == 32
    assert other.num_cached_tokens == 0


def test_a_request_resumed_with_its_outputs_goes_on_under_its_adapter(llm, prompts, references):
    """Failover: a request resumed elsewhere with the tokens already emitted (their KV
    recomputed under its adapter) continues as the uninterrupted one did."""
    engine, ref = llm.engine, references[("a0", 0)]
    engine.add_request(
        EngineRequest("resumed", prompts[0], GREEDY, output_token_ids=ref[:4], lora_name="a0")
    )
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        tokens += [t for o in engine.step() if o.request_id == "resumed" for t in o.new_token_ids]
    assert tokens == ref[4:]


def _copy_adapter(lora_root: str, name: str, tmp_path) -> str:
    path = str(tmp_path / name)
    shutil.copytree(os.path.join(lora_root, name), path)
    return path


def test_bad_adapters_are_refused_by_name_and_the_engine_keeps_serving(
    llm, base, lora_root, prompts, references, tmp_path_factory
):
    inside = tmp_path_factory.mktemp("unused")  # not under lora_root
    outside = _copy_adapter(lora_root, "a0", inside)
    with pytest.raises(ValueError, match="outside lora_root"):
        llm.add_lora("outside", outside)

    def bad(name: str) -> str:
        return os.path.join(lora_root, name)

    write_random_lora(base[0], bad("too-big"), seed=1, rank=32)
    with pytest.raises(ValueError, match="rank r=32"):
        llm.add_lora("too-big", bad("too-big"))

    shutil.copytree(bad("a0"), bad("no-module"))
    weights = os.path.join(bad("no-module"), "adapter_model.safetensors")
    tensors = {k.replace("q_proj", "qkv_proj"): v for k, v in load_file(weights).items()}
    save_file(tensors, weights)
    with pytest.raises(ValueError, match="target module 'qkv_proj'"):
        llm.add_lora("no-module", bad("no-module"))

    # Junk is refused by its format, or unread by its size: no adapter of this model at rank
    # max_lora_rank needs 10 MB.
    for junk_name, junk, why in (
        ("garbage", b"not safetensors", "cannot read"),
        ("junk", os.urandom(10 << 20), "adapter_model.safetensors is larger than"),
    ):
        shutil.copytree(bad("a0"), bad(junk_name))
        with open(os.path.join(bad(junk_name), "adapter_model.safetensors"), "wb") as f:
            f.write(junk)
        with pytest.raises(ValueError, match=why):
            llm.add_lora(junk_name, bad(junk_name))
    with pytest.raises(ValueError, match="lora_name"):
        llm.add_lora("a/b", bad("a0"))
    with pytest.raises(ValueError, match="already loaded"):
        llm.add_lora("a0", bad("a0"))
    with pytest.raises(UnknownLoraError):
        llm.generate(prompts, GREEDY, use_tqdm=False, lora="nope")

    assert llm.list_loras() == list(ADAPTERS)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False, lora="a1")
    assert [o.token_ids for o in outs] == [references[("a1", i)] for i in range(len(prompts))]


def test_an_adapter_in_use_is_not_unloaded_and_can_be_loaded_again(
    llm, lora_root, prompts, references
):
    engine = llm.engine
    engine.add_request(EngineRequest("held", prompts[0], GREEDY, lora_name="a2"))
    with pytest.raises(LoraInUseError, match="'a2'"):
        engine.remove_lora("a2")
    engine.abort_requests(["held"])
    engine.step()
    engine.remove_lora("a2")
    assert "a2" not in engine.list_loras()
    with pytest.raises(LookupError):
        engine.remove_lora("a2")
    engine.add_lora("a2", os.path.join(lora_root, "a2"))
    outs = llm.generate(prompts, GREEDY, use_tqdm=False, lora="a2")
    assert [o.token_ids for o in outs] == [references[("a2", i)] for i in range(len(prompts))]


def _generate(llm: LLM, prompt: list[int], lora: str):
    return llm.generate([prompt], GREEDY, use_tqdm=False, lora=lora)[0]


def test_an_adapter_whose_files_vanish_serves_from_what_was_read_at_load(
    llm, lora_root, prompts, references
):
    path = os.path.join(lora_root, "gone")
    shutil.copytree(os.path.join(lora_root, "a1"), path)
    llm.add_lora("gone", path)
    shutil.rmtree(path)  # nothing is read again: not for a slot, not after an eviction
    for _ in range(2):  # a0..a3 in between evict it from both slots
        outs = llm.generate(prompts, GREEDY, use_tqdm=False, lora="gone")
        assert [o.token_ids for o in outs] == [references[("a1", i)] for i in range(len(prompts))]
        llm.generate(prompts, GREEDY, use_tqdm=False, lora=["a0", "a2"])
    llm.remove_lora("gone")


def test_a_name_reloaded_with_other_weights_serves_them_and_reuses_none_of_the_old_kv(
    llm, lora_root
):
    prompt = random_prompts(1, 256, 33, 33, seed=77)[0]  # two full blocks, new to the cache
    path = os.path.join(lora_root, "re")

    def load(source: str) -> None:
        shutil.rmtree(path, ignore_errors=True)
        shutil.copytree(os.path.join(lora_root, source), path)
        llm.add_lora("re", path)

    load("a0")
    first = _generate(llm, prompt, "re")
    assert first.token_ids == _generate(llm, prompt, "a0").token_ids
    assert first.num_cached_tokens == 0 and _generate(llm, prompt, "re").num_cached_tokens == 32
    llm.remove_lora("re")
    load("a2")  # same name, same directory, other bytes
    after = _generate(llm, prompt, "re")
    assert after.token_ids == _generate(llm, prompt, "a2").token_ids
    assert after.num_cached_tokens == 0  # a0's KV is not a2's
    llm.remove_lora("re")
    load("a0")  # a0's bytes again: its identity, and its KV, are the first load's
    assert _generate(llm, prompt, "re").num_cached_tokens == 32
    llm.remove_lora("re")


def test_an_adapter_that_cannot_be_placed_fails_its_requests_alone(
    llm, lora_root, prompts, references
):
    engine = llm.engine
    path = os.path.join(lora_root, "lost")
    shutil.copytree(os.path.join(lora_root, "a3"), path)
    engine.add_lora("lost", path)
    identity = engine.loras.slots.identities["lost"]
    # The ranks lose it (as a rank that failed to copy it to the device would): the scheduler
    # still places it, the workers cannot.
    engine.executor.call_ranks(lambda runner: runner.loras.drop(identity))
    engine.add_request(EngineRequest("lost-0", prompts[0], GREEDY, lora_name="lost"))
    engine.add_request(EngineRequest("a1-0", prompts[0], GREEDY, lora_name="a1"))
    engine.add_request(EngineRequest("base-1", prompts[1], GREEDY))
    tokens: dict[str, list[int]] = {"a1-0": [], "base-1": [], "lost-0": []}
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            if out.finish_reason is not None:
                finished[out.request_id] = out
    assert finished["lost-0"].finish_reason == "error" and tokens["lost-0"] == []
    assert "lora adapter 'lost' could not be placed" in finished["lost-0"].error
    assert tokens["a1-0"] == references[("a1", 0)] and tokens["base-1"] == references[(None, 1)]
    engine.remove_lora("lost")
    engine.add_lora("lost", path)  # handed to the ranks again
    assert _generate(llm, prompts[0], "lost").token_ids == references[("a3", 0)]
    engine.remove_lora("lost")


def test_an_alpha_that_overflows_is_refused_naming_lora_alpha(llm, lora_root):
    path = os.path.join(lora_root, "huge-alpha")
    shutil.copytree(os.path.join(lora_root, "a0"), path)
    config_path = os.path.join(path, "adapter_config.json")
    with open(config_path) as f:
        config = json.load(f)
    with open(config_path, "w") as f:
        json.dump({**config, "lora_alpha": 1e308}, f)
    with pytest.raises(ValueError, match="lora_alpha=1e\\+308"):
        llm.add_lora("huge-alpha", path)
    assert "huge-alpha" not in llm.list_loras()
