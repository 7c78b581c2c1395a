"""The feature matrix (docs/features.md), one test per cell: two features on together give what
each gives alone, on the tiny random Llama (CPU), greedy.

A cell's engine has both features on; its reference is the plain engine (for LoRA: the plain
engine on the checkpoint with the adapter merged into its weights), running the same requests with
the request-level features (structured output, pooling, prompt logprobs) one at a time. The
workload is a second turn after eviction, so the KV tiers load a prefix back: turn one runs prompt
A, two longer prompts evict it, then A extended runs again. Each feature also shows it was on:
n-gram and draft proposals were made (a model drafting for itself has every proposal accepted,
which holds only if its KV is right after blocks came back from a tier or another engine), the
tiers loaded blocks, the length probe got features, a grammar was obeyed.

Disaggregation cells run the workload's generating requests through a prefill engine and a decode
engine in one process (engine/disagg.py); the TP > 1 cells are in tests/cluster/ (slow) and named
in docs/features.md.
"""

from __future__ import annotations

import itertools
import random
import re
import shutil
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.disagg import DecodeSide, PrefillSide, decode_request, needs_decode, prefill_request
from scheduler import EngineRequest, SamplingParams
from scheduler.outputs import RequestOutput
from scheduler.structured_output import StructuredOutput
from tests.random_lora import peft_model, write_random_lora
from workers.kv_transfer import InProcessTransport
from workers.model_files import load_tokenizer

pytestmark = pytest.mark.slow

# 16 blocks of 16 tokens: the two 200-token prompts evict everything the first turn cached.
POOL = dict(num_gpu_blocks=16, max_model_len=256, max_num_batched_tokens=256)
ENGINE_FEATURES = {
    # One token of suffix: prompt A's greedy outputs repeat tokens of their context by the 9th.
    "ngram": dict(
        speculative={"method": "ngram", "num_tokens": 3, "ngram_min": 1, "min_acceptance_rate": 0}
    ),
    "draft": dict(speculative={"method": "draft", "num_tokens": 3, "min_acceptance_rate": 0.0}),
    "async": dict(async_scheduling=True),
    "tiers": dict(num_cpu_tier_blocks=64),
    "length": dict(policy="srpt"),  # a length-aware policy: the runner extracts features
    "lora": dict(max_loras=1),
}
REQUEST_FEATURES = ("structured", "pooling", "prompt_logprobs")
FEATURES = (*ENGINE_FEATURES, *REQUEST_FEATURES)
ADAPTER = "a0"
REGEX = "(ab|cd){2,8}-[0-9]{1,3}"
MAX_TOKENS = 16

# Cells that are not run here: refused for a physical reason, or proven elsewhere.
ELSEWHERE = {
    ("ngram", "draft"): "one proposer per engine: speculative.method names it",
    ("ngram", "async"): "tests/engine/test_spec_async.py",
    ("draft", "async"): "tests/engine/test_spec_async.py",
    ("structured", "pooling"): "refused: an embedding request samples no text to constrain",
}


def cell_id(pair: tuple[str, str]) -> str:
    return "-".join(pair)


CELLS = [pair for pair in itertools.combinations(FEATURES, 2) if pair not in ELSEWHERE]


@pytest.fixture(scope="module")
def base(tiny_checkpoint) -> str:
    return tiny_checkpoint("llama")[0]


@pytest.fixture(scope="module")
def adapter(base, tmp_path_factory) -> str:
    return write_random_lora(base, str(tmp_path_factory.mktemp("lora") / ADAPTER), seed=10)


@pytest.fixture(scope="module")
def merged(base, adapter, tmp_path_factory) -> str:
    """The base checkpoint with the adapter merged into its weights: LoRA's plain engine."""
    path = tmp_path_factory.mktemp("merged")
    peft_model(base, adapter).merge_and_unload().save_pretrained(str(path))
    for f in Path(base).iterdir():  # the tokenizer's files
        if f.is_file() and not (path / f.name).exists():
            shutil.copy(f, path / f.name)
    return str(path)


@pytest.fixture(scope="module")
def engines(base, adapter, merged):
    """make(engine features, merged=False, role="") -> an engine, each built on first use (a
    decode engine is its own: its scheduler takes the remote connector)."""
    made: dict[tuple[frozenset[str], bool, str], EngineCore] = {}

    def make(features: frozenset[str], merged_model: bool = False, role: str = "") -> EngineCore:
        key = (features, merged_model, role)
        if key not in made:
            kwargs: dict = dict(POOL, device="cpu", load_progress=False)
            for f in features:
                kwargs.update(ENGINE_FEATURES[f])
            if "draft" in features:  # the model drafting for itself: every proposal is right
                kwargs["speculative"] = {**kwargs["speculative"], "draft_model": base}
            if "lora" in features:
                kwargs["lora_modules"] = {ADAPTER: adapter}
            model = merged if merged_model else base
            made[key] = EngineCore(EngineConfig.from_kwargs(model=model, **kwargs))
        return made[key]

    yield make
    for engine in made.values():
        engine.shutdown()


@pytest.fixture(scope="module")
def references(engines):
    """features -> the plain engine's results (LoRA: the merged checkpoint's), each request-level
    feature's part from a run with it alone; computed once per kind."""
    done: dict[tuple[bool, frozenset[str]], dict[str, Result]] = {}

    def get(features: set[str]) -> dict[str, Result]:
        asked = frozenset(features & set(REQUEST_FEATURES))
        key = ("lora" in features, asked)
        if key not in done:
            engine = engines(frozenset(), key[0])
            pooling = asked & {"pooling"}
            want = colocated(engine, (asked & {"structured"}) | pooling)
            if "prompt_logprobs" in asked:  # the prompt's entries of unconstrained requests
                alone = colocated(engine, {"prompt_logprobs"} | pooling)
                for rid, r in want.items():
                    r.prompt_logprobs = alone[rid].prompt_logprobs
            done[key] = want
        return done[key]

    return get


@dataclass(slots=True)
class Result:
    tokens: list[int]
    prompt_logprobs: list | None
    pooled: list[float] | None


def turns() -> list[list[list[int]]]:
    """Turn one: a repetitive prompt A (n-gram lookup finds matches); turn two evicts it; turn
    three is A extended (its full blocks come back from a tier)."""
    rng = random.Random(55)
    motif = [rng.randrange(3, 2000) for _ in range(5)]
    a = motif * 20
    others = [[rng.randrange(3, 2000) for _ in range(200)] for _ in range(2)]
    return [[a], others, [a + [5] * 20]]


def requests(turn: int, prompts: list[list[int]], features: set[str]) -> list[EngineRequest]:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    if "structured" in features:
        constraint = StructuredOutput("regex", REGEX)
        params = replace(params, structured=constraint, ignore_eos=False)
    if "prompt_logprobs" in features:
        params = replace(params, prompt_logprobs=2)
    lora = ADAPTER if "lora" in features else None
    out = [EngineRequest(f"t{turn}-{i}", p, params, lora_name=lora) for i, p in enumerate(prompts)]
    if "pooling" in features:
        pooled = SamplingParams(max_tokens=1, temperature=0.0, pooling="mean")
        if "prompt_logprobs" in features:
            pooled = replace(pooled, prompt_logprobs=2)
        out += [
            EngineRequest(f"t{turn}-e{i}", p, pooled, lora_name=lora) for i, p in enumerate(prompts)
        ]
    return out


def drain(engine: EngineCore) -> list[RequestOutput]:
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    return outs


def collect(outs: list[RequestOutput], results: dict[str, Result]) -> None:
    for o in outs:
        r = results.setdefault(o.request_id, Result([], None, None))
        assert o.error is None, (o.request_id, o.error)
        r.tokens += o.new_token_ids
        r.prompt_logprobs = o.prompt_logprobs or r.prompt_logprobs
        r.pooled = o.pooled or r.pooled


def colocated(engine: EngineCore, features: set[str]) -> dict[str, Result]:
    results: dict[str, Result] = {}
    for turn, prompts in enumerate(turns()):
        for request in requests(turn, prompts, features):
            engine.add_request(request)
        collect(drain(engine), results)
    return results


def disaggregated(prefill: PrefillSide, decode: DecodeSide, features: set[str]) -> dict:
    """Each request prefilled on one engine, its blocks sent, then decoded on the other."""
    results: dict[str, Result] = {}
    for turn, prompts in enumerate(turns()):
        for request in requests(turn, prompts, features):
            prefill.engine.add_request(prefill_request(request))
            outs = drain(prefill.engine)
            collect(outs, results)
            if needs_decode(request, outs[-1], prefill.engine.max_model_len):
                first = list(results[request.request_id].tokens)
                decode.add(decode_request(request, first), prefill.export(request))
                collect(drain(decode.engine), results)
    return results


def assert_same(got: dict[str, Result], want: dict[str, Result]) -> None:
    assert got.keys() == want.keys()
    for rid, w in want.items():
        g = got[rid]
        assert g.tokens == w.tokens, rid
        if w.prompt_logprobs is not None:
            assert g.prompt_logprobs is not None, rid
            assert [[t for t, _ in e] for e in g.prompt_logprobs] == [
                [t for t, _ in e] for e in w.prompt_logprobs
            ], rid
            for ge, we in zip(g.prompt_logprobs, w.prompt_logprobs):
                assert [v for _, v in ge] == pytest.approx([v for _, v in we], abs=1e-3), rid
        if w.pooled is not None:
            assert g.pooled == pytest.approx(w.pooled, abs=1e-4), rid


# What the regex allows so far: a generation cut by max_tokens may stop inside it.
PREFIX = r"(ab|cd){0,8}(a|c)?|(ab|cd){2,8}-[0-9]{0,3}"


def assert_on(
    engine: EngineCore, features: set[str], got: dict[str, Result], before, model: str
) -> None:
    """Each feature of the cell did its work."""
    stats = engine.stats()
    proposed = stats.num_spec_proposed_tokens - before.num_spec_proposed_tokens
    accepted = stats.num_spec_accepted_tokens - before.num_spec_accepted_tokens
    # A self-draft proposes the unmasked argmax, which this regex never allows on this model: every
    # proposal is cut to the grammar before verification (workers/features/structured.py).
    if features & {"ngram", "draft"} and not {"draft", "structured"} <= features:
        assert proposed > 0
    if "draft" in features and not features & {"structured", "lora"}:
        assert accepted == proposed  # the draft's KV was right, loaded blocks included
    if "tiers" in features and "prompt_logprobs" not in features:  # those compute the prompt
        assert stats.num_tier_loaded_blocks > before.num_tier_loaded_blocks
    if "length" in features:
        assert any(r.length_feature is not None for r in engine.scheduler.requests.values())
    if "structured" in features:
        tokenizer = load_tokenizer(model)
        texts = [
            tokenizer.decode(r.tokens, skip_special_tokens=True)
            for rid, r in got.items()
            if "-e" not in rid
        ]
        assert texts and all(re.fullmatch(PREFIX, t) for t in texts), texts


@pytest.mark.parametrize("pair", CELLS, ids=cell_id)
def test_two_features_together_give_what_each_gives_alone(engines, references, base, pair):
    features = set(pair)
    engine = engines(frozenset(features & set(ENGINE_FEATURES)))
    before = engine.stats()
    got = colocated(engine, features)
    assert_same(got, references(features))
    assert_on(engine, features, got, before, base)
    assert engine.stats().num_free_blocks == POOL["num_gpu_blocks"]


@pytest.fixture(scope="module")
def phases(engines):
    """feature -> (prefill side, decode side), both engines running the feature."""
    made: dict[str, tuple[PrefillSide, DecodeSide]] = {}

    def make(feature: str) -> tuple[PrefillSide, DecodeSide]:
        if feature not in made:
            on = frozenset({feature} & set(ENGINE_FEATURES))
            transport = InProcessTransport()
            made[feature] = (
                PrefillSide(engines(on), transport),
                DecodeSide(engines(on, role="decode"), transport),
            )
        return made[feature]

    return make


@pytest.mark.parametrize("feature", FEATURES)
def test_disaggregation_with_a_feature_gives_the_colocated_results(
    phases, references, base, feature
):
    """Both phases run the feature; a draft model on the decode side has every proposal
    accepted, so its KV over the transferred blocks was recomputed right."""
    prefill, decode = phases(feature)
    before = decode.engine.stats()
    received = decode.connector.num_remote_loaded
    got = disaggregated(prefill, decode, {feature})
    assert_same(got, references({feature}))
    assert_on(decode.engine, {feature} - {"tiers", "length"}, got, before, base)
    assert decode.connector.num_remote_loaded > received


# Tensor parallelism (two gloo ranks on Ray, CPU): one engine per row with several features on at
# once, each request-level feature run through it; the single-process plain engine's results.
TP_ROWS = {"tiers-draft": {"tiers", "draft"}, "ngram-length": {"ngram", "length"}}


@pytest.mark.parametrize("row", TP_ROWS)
def test_tensor_parallel_with_features_gives_the_single_process_results(
    ray_cluster, base, references, row
):
    """Each rank saves and loads its own KV heads to the tiers; the draft runs whole on rank 0
    and recomputes its KV over the loaded blocks; proposals reach both ranks in the step."""
    from cluster.ray_executor import ray_executor

    features = TP_ROWS[row]
    kwargs: dict = dict(POOL, device="cpu", load_progress=False, tensor_parallel_size=2)
    for f in features:
        kwargs.update(ENGINE_FEATURES[f])
    if "draft" in features:
        kwargs["speculative"] = {**kwargs["speculative"], "draft_model": base}
    engine = EngineCore(EngineConfig.from_kwargs(model=base, **kwargs), ray_executor)
    try:
        for asked in ({"structured"}, {"prompt_logprobs", "pooling"}):
            before = engine.stats()
            got = colocated(engine, asked)
            assert_same(got, references(asked))
            assert_on(engine, features | asked, got, before, base)
        assert engine.stats().num_free_blocks == POOL["num_gpu_blocks"]
    finally:
        engine.shutdown()


# Pipeline stages (two gloo stages on Ray, CPU): one engine per row, each request-level feature run
# through it; refused features are checked where they are refused (tests/workers/
# test_pipeline_split.py).
PP_ROWS = {"async-length": {"async", "length"}}


@pytest.mark.parametrize("row", PP_ROWS)
def test_pipeline_stages_with_features_give_the_single_process_results(
    ray_cluster, base, references, row
):
    """The last stage samples, masks, pools and computes prompt logprobs and length features;
    its output reaches rank 0. Async scheduling runs without overlap."""
    from cluster.ray_executor import ray_executor

    features = PP_ROWS[row]
    kwargs: dict = dict(POOL, device="cpu", load_progress=False, pipeline_parallel_size=2)
    for f in features:
        kwargs.update(ENGINE_FEATURES[f])
    engine = EngineCore(EngineConfig.from_kwargs(model=base, **kwargs), ray_executor)
    try:
        for asked in ({"structured"}, {"prompt_logprobs", "pooling"}):
            before = engine.stats()
            got = colocated(engine, asked)
            assert_same(got, references(asked))
            assert_on(engine, features | asked, got, before, base)
        assert engine.stats().num_free_blocks == POOL["num_gpu_blocks"]
    finally:
        engine.shutdown()
