"""Qwen3-Next (gated DeltaNet layers beside gated full attention, MoE with a shared expert): greedy
output equals transformers' greedy generate on the same random checkpoint (fp32), batched under
16-token chunked prefill (cuts inside the prompts, so each linear layer's state crosses steps)
with async scheduling, two state slots reused by three requests and an 8-block pool that preempts
(recompute: the victim's state is dropped and rebuilt). Two gloo ranks give one rank's
logits. Also what a hybrid model refuses, the state store's rules, and that its paged KV covers
its full-attention layers only.

The checkpoint: four layers (DeltaNet, full, DeltaNet, full), a dense first MLP, eight experts
top-2 with a shared expert after it, rotary on a quarter of each 16-wide head, random norms (the
(1 + w) ones are then not the identity) and decay parameters. A token may differ only at a true
near-tie (tests/workers/greedy.py).
"""

from __future__ import annotations

import math

import pytest
import torch

from scheduler import SamplingParams
from tests.random_checkpoint import ModelSpec, write_random_checkpoint
from tests.workers import hybrid_prefix
from tests.workers.greedy import Greedy, assert_greedy_match, hf_greedy
from tests.workers.test_hf_parity import TEXTS

MAX_TOKENS = 8
PARAMS = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
TYPES = ["linear_attention", "full_attention", "linear_attention", "full_attention"]
TINY_QWEN3_NEXT = ModelSpec(
    "Qwen3NextConfig",
    dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        layer_types=TYPES,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        mlp_only_layers=[0],
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    ),
    matrix_std=0.15,
    head_std=0.6,
    vector_std=0.3,
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, smollm2_tokenizer) -> tuple[str, torch.nn.Module]:
    from transformers import AutoModelForCausalLM

    path = str(tmp_path_factory.mktemp("tiny-qwen3-next"))
    write_random_checkpoint(TINY_QWEN3_NEXT, path, seed=48, tokenizer=smollm2_tokenizer)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return path, model


@pytest.fixture(scope="module")
def prompts(smollm2_tokenizer) -> list[list[int]]:
    """A short text and prompts of 45 and 70 tokens (several 16-token chunks)."""
    return [
        smollm2_tokenizer.encode(TEXTS[1]),
        list(range(300, 345)),
        [(7 * i) % 40000 + 100 for i in range(70)],
    ]


@pytest.fixture(scope="module")
def references(checkpoint, prompts) -> list[Greedy]:
    _, hf_model = checkpoint
    return [hf_greedy(hf_model, p, MAX_TOKENS) for p in prompts]


def assert_matches(outs, refs, what: str) -> None:
    for i, (out, ref) in enumerate(zip(outs, refs, strict=True)):
        assert_greedy_match(out.token_ids, ref, f"{what}, prompt {i}")


@pytest.fixture(scope="module")
def engines(checkpoint, llm_factory):
    """tp -> tests/workers/hybrid_prefix.py's engine with async scheduling on tp ranks (16-token
    chunks, 2 state slots, 16 blocks of 8 tokens, 8 state checkpoints)."""
    kwargs = hybrid_prefix.engine_kwargs(checkpoint[0], async_scheduling=True)
    yield from hybrid_prefix.engines(llm_factory, kwargs)


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_chunked_async_few_slots_and_preemption_give_hf_tokens(tp, engines, prompts, references):
    """One engine for every path a step can take: 16-token chunks cut the prompts, the next step
    is scheduled while one runs (async), two slots serve three requests (the third takes a slot
    the first left, zeroed), and 8 blocks of 16 tokens cannot hold the 70- and 45-token requests
    as they grow, so one is preempted, its state dropped, and recomputed from its first token. At
    TP=2 each rank runs its key heads' state and half of the experts."""
    llm = engines(tp)
    engine = llm.engine
    before = engine.stats().num_preemptions
    outs = llm.generate(prompts[::-1], PARAMS, use_tqdm=False)
    assert_matches(outs, references[::-1], f"TP={tp}, chunked, async, two slots, 8 blocks")
    assert engine.stats().num_preemptions > before
    assert engine.scheduler.state_slots.num_slots == 2
    assert engine.scheduler.state_slots.num_free == 2
    # K and V of 2 KV heads of 16 floats (one head a rank at TP=2), on the 2 full-attention
    # layers of 4.
    assert engine.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4 // tp
    load = engine.expert_load()
    assert len(load) == tp and min(load) > 0  # the MoE layers routed every token, on each rank


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_a_prefix_hit_restores_the_state_checkpoint_and_gives_hf_tokens(tp, checkpoint, engines):
    """tests/workers/hybrid_prefix.py: a hit computes only the tokens after its checkpointed
    block, beside a preemption, and a partial hit rounds down to a checkpoint."""
    llm = engines(tp)
    hybrid_prefix.check_prefix_hits(llm, checkpoint[1], MAX_TOKENS)
    from engine.disagg import DecodeSide

    # Transferred blocks would come without the state at their end: refused before any transfer.
    with pytest.raises(ValueError, match="disaggregation: a hybrid model"):
        DecodeSide(llm.engine, transport=None)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [2**64, -1, math.nan, 10**12, True, "8"])
def test_a_state_checkpoint_count_out_of_range_is_refused_naming_it(bad):
    from engine.config import EngineConfig

    with pytest.raises(ValueError, match="num_state_checkpoints"):
        EngineConfig(num_state_checkpoints=bad)


@pytest.mark.slow
@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(preemption_mode="swap", num_cpu_blocks=8), "preemption_mode"),
        (dict(speculative={"method": "ngram", "num_speculative_tokens": 2}), "speculative"),
        (dict(kv_cpu_tier_gb=0.01), "kv_cpu_tier_gb"),
        # 128 slots of state (about 1.4 MB) leave no block of a 1 MB budget: counted, refused.
        (dict(kv_cache_memory_gb=0.001), "kv_cache_memory_gb: the recurrent state"),
    ],
)
def test_what_a_hybrid_model_cannot_run_is_refused_by_name(checkpoint, kwargs, field):
    from engine.llm import LLM

    path, _ = checkpoint
    with pytest.raises(ValueError, match=field):
        LLM(model=path, dtype="float32", device="cpu", load_progress=False, **kwargs)


@pytest.mark.slow
def test_layer_types_are_checked_at_load(checkpoint):
    from transformers import AutoConfig

    from workers.models.qwen3_next import Qwen3NextForCausalLM

    path, _ = checkpoint
    config = AutoConfig.from_pretrained(path)
    for bad in (TYPES[:3], [*TYPES[:3], "mamba"], None):
        config.layer_types = bad
        with pytest.raises(ValueError, match="layer_types"):
            Qwen3NextForCausalLM(config)


def test_state_slots_are_zeroed_at_position_0_and_never_invented_past_it():
    """The store's rules: a slot per request, zeroed when its step starts at 0 (new or
    recomputed), kept otherwise, reused once released; a request that would start past 0 with no
    state fails loudly; slots of requests no longer live (a profiling run's) are reclaimed."""
    from workers.layers.gated_delta import DeltaDims, GatedDeltaNet
    from workers.linear_state import LinearStateStore

    layer = GatedDeltaNet(DeltaDims(16, 1, 2, 4, 4, 3, 1e-6))
    store = LinearStateStore([layer], 2, torch.float32, torch.device("cpu"))
    view = layer.state
    assert view is not None and view.recurrent.shape == (2, 2, 4, 4)
    store.begin_step(["a", "b"], [0, 0], {"a", "b"})
    view.recurrent.fill_(1.0)
    view.conv.fill_(1.0)
    store.begin_step(["b", "a"], [5, 0], {"a", "b"})  # b goes on, a is recomputed
    assert view.slots == [1, 0]
    assert view.recurrent[1].eq(1).all() and view.recurrent[0].eq(0).all()
    assert view.conv[0].eq(0).all()
    with pytest.raises(RuntimeError, match="without a state"):
        store.begin_step(["c"], [3], {"a", "b", "c"})
    store.release("a")
    store.begin_step(["c"], [0], {"b", "c"})
    assert view.slots == [0]
    store.begin_step(["d"], [0], {"d"})  # b and c are gone: their slots come back
    assert set(store.slot_of) == {"d"} and len(store.free) == 1
    with pytest.raises(RuntimeError, match="no free slot"):
        store.begin_step(["e", "f"], [0, 0], {"d", "e", "f"})


# Steps of the tensor-parallel check: a 10-token prompt in chunks of 6 and 4, then its decode
# beside a new 5-token prompt (request ids, starts, query lengths, block tables, tokens).
TP_STEPS = [
    (["a"], [0], [6], [[3, 7, 1]], list(range(50, 56))),
    (["a"], [6], [4], [[3, 7, 1]], list(range(56, 60))),
    (["a", "b"], [10, 0], [1, 5], [[3, 7, 1], [2, 9]], [77, 5, 6, 7, 8, 9]),
]


def hybrid_logits(rank: int, world: int, model_dir: str) -> torch.Tensor | None:
    """A gloo_ranks job (and the single-rank reference): TP_STEPS on this rank's shard of the
    model, with its own state slots; rank 0's logits of every step."""
    import torch.distributed as dist
    from transformers import AutoConfig

    from workers.kv_cache import KVCache, KVCacheSpec
    from workers.layers.attention import AttentionMetadata, select_backend
    from workers.layers.gated_delta import GatedDeltaNet
    from workers.linear_state import LinearStateStore
    from workers.loader import load_model
    from workers.parallel import init_tensor_parallel

    if world > 1:
        init_tensor_parallel(rank, world, dist.group.WORLD)
    cpu = torch.device("cpu")
    model = load_model(
        model_dir, AutoConfig.from_pretrained(model_dir), torch.float32, cpu, progress=False
    )
    layers = model.attention_layers()
    KVCache(KVCacheSpec.of(layers, 4, torch.float32), 16, 0, cpu).bind(layers)
    backend = select_backend(cpu, "torch")
    for layer in layers:
        layer.backend = backend
    delta = [m for m in model.modules() if isinstance(m, GatedDeltaNet)]
    store = LinearStateStore(delta, 2, torch.float32, cpu)
    logits = []
    with torch.inference_mode():
        for req_ids, starts, lens, tables, ids in TP_STEPS:
            meta, positions = AttentionMetadata.build(starts, lens, tables, 4, cpu)
            backend.prepare(meta)
            store.begin_step(req_ids, starts, req_ids)
            logits.append(model.compute_logits(model(torch.tensor(ids), positions, meta)))
    return None if logits[0] is None else torch.cat(logits)


@pytest.mark.slow
def test_two_ranks_split_both_mixers_by_head_and_match_one(tmp_path, gloo_ranks):
    """At TP=2 each rank holds one of the two key heads (with its two value heads, its conv
    channels and decay vectors) and two of the four attention heads: rank 0's logits over chunked
    prefill and a mixed decode step equal one rank's."""
    from workers.parallel import reset_tensor_parallel

    path = write_random_checkpoint(
        TINY_QWEN3_NEXT.with_fields(vocab_size=250), str(tmp_path), seed=49
    ).path
    reset_tensor_parallel()
    expected = hybrid_logits(0, 1, path)
    assert expected is not None and expected.shape[0] == 6 + 4 + 1 + 5
    got = gloo_ranks(2).run(hybrid_logits, path)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_a_model_with_only_dense_mlps_reports_no_expert_load():
    """Every layer in mlp_only_layers: no expert block, so the load balance is empty (it failed
    the first engine step with an IndexError)."""
    from transformers import Qwen3NextConfig

    from workers.models.qwen3_next import Qwen3NextForCausalLM

    fields = {**TINY_QWEN3_NEXT.fields, "mlp_only_layers": [0, 1, 2, 3]}
    model = Qwen3NextForCausalLM(Qwen3NextConfig(**fields, vocab_size=64))
    assert model.moe_blocks() == [] and model.expert_rows_per_rank() == []
