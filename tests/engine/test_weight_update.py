"""Weight updates and sleep of one engine (engine/weights.py, workers/weight_update.py): new
weights serve what a fresh engine loaded with them serves, a bad checkpoint is refused by name and
the old weights keep serving, requests in flight finish on the old weights or are recomputed on the
new ones, and sleep frees the KV cache (and the weights) and wakes to the same tokens.

Two random tiny Llamas of one shape (seeds 1 and 2) stand for a model before and after a training
step; their greedy tokens differ from the first token on.
"""

from __future__ import annotations

import math
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.asleep import EngineAsleepError
from engine.llm import LLM
from scheduler.request import EngineRequest
from scheduler.sampling_params import SamplingParams
from tests.random_checkpoint import TINY_FAMILIES, write_random_checkpoint
from tests.random_lora import write_random_lora
from workers.distributed import free_port
from workers.weight_transfer import (
    Manifest,
    WeightGroupSpec,
    WeightsRefusedError,
    open_group,
    plan_buckets,
    send_weights,
)

SPEC = TINY_FAMILIES["llama"]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0)
PROMPTS = [list(range(5, 40)), [30, 31, 32], list(range(100, 117))]
KW = dict(device="cpu", load_progress=False, kv_cache_memory_gb=0.05)
HUGE = [2**64, -1, math.nan, 1e308]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("weights")
    a = write_random_checkpoint(SPEC, str(root / "a"), seed=1).path
    b = write_random_checkpoint(SPEC, str(root / "b"), seed=2).path
    return a, b


def tokens(llm: LLM, prompts=PROMPTS, params=GREEDY, lora=None) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False, lora=lora)]


@pytest.fixture(scope="module")
def llm(ckpts):
    """The engine the tests update, built on checkpoint a."""
    with LLM(ckpts[0], **KW) as engine:
        yield engine


@pytest.fixture(scope="module")
def fresh_b(ckpts):
    """An engine built on checkpoint b: what an update to b must serve."""
    with LLM(ckpts[1], **KW) as engine:
        yield engine


@pytest.fixture(scope="module")
def expected(llm, fresh_b) -> dict[str, list[list[int]]]:
    out = {"a": tokens(llm), "b": tokens(fresh_b)}  # llm before any update: fresh on a
    assert out["a"] != out["b"]
    return out


@pytest.fixture
def on_a(llm, ckpts):
    """The shared engine, serving checkpoint a (whatever the test before it left)."""
    llm.update_weights(ckpts[0])
    return llm


def test_an_update_from_a_path_serves_what_a_fresh_engine_of_the_new_weights_does(
    on_a, ckpts, expected
):
    assert tokens(on_a) == expected["a"]
    assert on_a.update_weights(ckpts[1]) == 15  # 2 layers x 7 tensors, the final norm, embed, head
    assert tokens(on_a) == expected["b"]
    file = next(Path(ckpts[0]).glob("*.safetensors"))
    on_a.update_weights(str(file))  # one safetensors file works as a directory does
    assert tokens(on_a) == expected["a"]


def test_an_update_empties_the_prefix_cache(on_a, ckpts):
    prompt = [list(range(200, 260))]
    on_a.generate(prompt, GREEDY, use_tqdm=False)
    assert on_a.generate(prompt, GREEDY, use_tqdm=False)[0].num_cached_tokens > 0
    on_a.update_weights(ckpts[1])
    assert on_a.generate(prompt, GREEDY, use_tqdm=False)[0].num_cached_tokens == 0


def _bad_checkpoint(src: str, dst: Path, change) -> str:
    """src's tensors with `change` applied to the dict, saved as one file in dst."""
    tensors = {}
    for f in Path(src).glob("*.safetensors"):
        tensors.update(load_file(str(f)))
    change(tensors)
    dst.mkdir()
    save_file(tensors, str(dst / "model.safetensors"))
    return str(dst)


NORM = "model.layers.1.post_attention_layernorm.weight"
QPROJ = "model.layers.0.self_attn.q_proj.weight"


def _nan(t):
    t[QPROJ][3, 4] = math.nan


def _inf(t):
    t[NORM][0] = math.inf


BAD = {
    "missing": (lambda t: t.pop(NORM), NORM),
    "shape": (lambda t: t.update({QPROJ: t[QPROJ][:-1]}), QPROJ),
    "nan": (_nan, QPROJ),
    "inf": (_inf, NORM),
    "unknown": (lambda t: t.update({"model.extra.weight": torch.ones(3)}), "model.extra.weight"),
    "int dtype": (lambda t: t.update({NORM: t[NORM].to(torch.int32)}), NORM),
    "other float": (lambda t: t.update({NORM: t[NORM].half()}), NORM),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_checkpoint_is_refused_by_tensor_name_and_the_old_weights_keep_serving(
    on_a, ckpts, expected, tmp_path, case
):
    change, name = BAD[case]
    bad = _bad_checkpoint(ckpts[1], tmp_path / case, change)
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        on_a.update_weights(bad)
    assert tokens(on_a) == expected["a"]


@pytest.mark.parametrize("path", ["", "x" * 5000, "/nonexistent/raylm", "a\x00b"])
def test_a_path_that_is_no_checkpoint_is_refused(on_a, path):
    with pytest.raises(ValueError, match="path"):
        on_a.update_weights(path)


@pytest.mark.parametrize("in_flight", ["later", "", None, 2**64, -1, math.nan])
def test_in_flight_takes_finish_or_recompute(on_a, ckpts, in_flight):
    with pytest.raises(ValueError, match="in_flight"):
        on_a.update_weights(ckpts[1], in_flight=in_flight)


def test_update_weights_takes_a_path_or_the_group_not_both(on_a, ckpts):
    with pytest.raises(ValueError, match="either"):
        on_a.update_weights(ckpts[1], from_group=True)
    with pytest.raises(ValueError, match="either"):
        on_a.update_weights()
    with pytest.raises(ValueError, match="weight group"):
        on_a.update_weights(from_group=True)  # no group joined


def _run(engine, outputs: dict[str, list[int]], steps: int | None = None) -> None:
    """Step the engine (`steps` times, or until it has nothing left), collecting tokens."""
    n = 0
    while engine.has_unfinished_requests() and (steps is None or n < steps):
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        n += 1


def test_recompute_goes_on_with_the_new_weights_from_the_tokens_already_sampled(
    on_a, ckpts, expected, fresh_b
):
    engine, outputs = on_a.engine, {}
    engine.add_request(EngineRequest("r", PROMPTS[0], GREEDY))
    _run(engine, outputs, steps=4)  # the prompt, then three more tokens
    before = list(outputs["r"])
    assert before == expected["a"][0][: len(before)] and 0 < len(before) < 8
    done = engine.update_weights(ckpts[1], in_flight="recompute")
    assert done.done() and done.result() == 15  # applied at once, between steps
    _run(engine, outputs)
    rest = SamplingParams(max_tokens=8 - len(before), temperature=0.0)
    continued = tokens(fresh_b, [PROMPTS[0] + before], rest)[0]  # b goes on from a's tokens
    assert outputs["r"] == before + continued


def test_recompute_under_async_scheduling_waits_for_the_step_in_flight(ckpts, expected, fresh_b):
    with LLM(ckpts[0], async_scheduling=True, **KW) as llm:
        engine, outputs = llm.engine, {}
        engine.add_request(EngineRequest("r", PROMPTS[0], GREEDY))
        _run(engine, outputs, steps=3)
        assert engine._in_flight is not None  # a step is always scheduled ahead
        done = engine.update_weights(ckpts[1], in_flight="recompute")
        assert not done.done()  # not while a step of the old weights runs
        _run(engine, outputs)
        assert done.result() == 15
    before = expected["a"][0][: len(outputs["r"])]
    k = next(i for i, (x, y) in enumerate(zip(outputs["r"], before + [-1])) if x != y)
    assert 0 < k < 8  # a's tokens, then b's from the step after the update
    rest = SamplingParams(max_tokens=8 - k, temperature=0.0)
    assert outputs["r"][k:] == tokens(fresh_b, [PROMPTS[0] + outputs["r"][:k]], rest)[0]


def test_finish_lets_requests_in_flight_end_on_the_old_weights_and_holds_new_ones(
    on_a, ckpts, expected
):
    engine, outputs = on_a.engine, {}
    engine.add_request(EngineRequest("old", PROMPTS[0], GREEDY))
    _run(engine, outputs, steps=3)
    done = engine.update_weights(ckpts[1], in_flight="finish")
    assert not done.done()
    engine.add_request(EngineRequest("new", PROMPTS[1], GREEDY))  # held until the update
    _run(engine, outputs)
    assert done.result() == 15
    assert outputs["old"] == expected["a"][0]
    assert outputs["new"] == expected["b"][1]


@pytest.mark.parametrize("level,discard", [(1, False), (2, False), (2, True)])
def test_sleep_and_wake_give_the_same_tokens(on_a, ckpts, expected, level, discard):
    on_a.sleep(level, discard_weights=discard)
    assert on_a.engine.sleep_level == level
    assert on_a.engine.executor.runner.kv_cache is None  # the pool is freed
    with pytest.raises(EngineAsleepError, match="asleep"):
        tokens(on_a)
    on_a.wake_up()
    if discard:  # the weights are gone: nothing runs until an update brings them
        with pytest.raises(EngineAsleepError, match="discarded"):
            tokens(on_a)
        on_a.update_weights(ckpts[0])
    assert tokens(on_a) == expected["a"]


def test_an_update_while_asleep_serves_its_weights_after_wake_up(on_a, ckpts, expected):
    on_a.sleep(2)
    on_a.update_weights(ckpts[1])
    on_a.wake_up()
    assert tokens(on_a) == expected["b"]


@pytest.mark.parametrize("level", [0, 3, True, 2**64, -1, math.nan, 1e308, "1"])
def test_sleep_levels_are_one_and_two(on_a, level):
    with pytest.raises(ValueError, match="level"):
        on_a.sleep(level)


def test_sleep_is_refused_with_requests_in_flight_and_wake_up_when_awake(on_a):
    with pytest.raises(ValueError, match="discard_weights"):
        on_a.sleep(1, discard_weights=True)
    with pytest.raises(ValueError, match="not asleep"):
        on_a.wake_up()
    on_a.engine.add_request(EngineRequest("busy", PROMPTS[1], GREEDY))
    try:
        with pytest.raises(ValueError, match="in flight"):
            on_a.sleep(1)
    finally:
        on_a.engine.abort_requests(["busy"])


def test_lora_adapters_stay_loaded_across_an_update(ckpts, tmp_path):
    adapter = write_random_lora(ckpts[0], str(tmp_path / "ad"), seed=5)
    kw = dict(KW, lora_modules={"ad": adapter})
    with LLM(ckpts[1], **kw) as fresh:
        want = tokens(fresh, lora="ad")
    with LLM(ckpts[0], **kw) as engine:
        engine.update_weights(ckpts[1])
        assert engine.list_loras() == ["ad"]
        assert tokens(engine, lora="ad") == want


def test_a_quantized_layer_is_refused_by_name(ckpts):
    with LLM(ckpts[0], quantization="fp8", **KW) as engine:
        before = tokens(engine)
        with pytest.raises(ValueError, match=r"model\.layers\.0\..*quantized"):
            engine.update_weights(ckpts[1])
        with pytest.raises(ValueError, match="quantized"):
            engine.sleep(2)
        assert tokens(engine) == before


@pytest.mark.slow  # converts a GGUF file through transformers
def test_gguf_blocks_kept_quantized_are_refused_by_layer_name(tmp_path):
    """The default path's kind of model: GGUF blocks multiplied as stored (int8 CPU kernels)."""
    from tests.random_kquant import write_tiny_kquant_gguf

    path = str(tmp_path / "tiny-k.gguf")
    write_tiny_kquant_gguf(path)
    kw = dict(KW, quantization="gguf", cache_dir=str(tmp_path / "cache"))
    with LLM(path, **kw) as engine:
        before = tokens(engine, [[5, 6, 7, 8]])
        with pytest.raises(ValueError, match=r"model\.embed_tokens: .*kept quantized"):
            engine.update_weights(engine.engine.model_dir)  # its own (converted) checkpoint
        assert tokens(engine, [[5, 6, 7, 8]]) == before


# ---- the weight group ---------------------------------------------------------------------------
def _checkpoint_tensors(path: str) -> list[tuple[str, torch.Tensor]]:
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    return sorted(tensors.items())


class Trainer(threading.Thread):
    """Rank 0 of a weight group, in a thread of this process: joins, then sends each update."""

    def __init__(self, spec: WeightGroupSpec, updates: list[list[tuple[str, torch.Tensor]]]):
        super().__init__(daemon=True)
        self.spec, self.updates = spec, updates
        self.errors: list[BaseException | None] = []

    def run(self) -> None:
        group = open_group(self.spec, torch.device("cpu"))
        for tensors in self.updates:
            try:
                send_weights(group, tensors, bucket_bytes=40_000)  # several buckets
                self.errors.append(None)
            except WeightsRefusedError as exc:
                self.errors.append(exc)


def test_updates_over_a_gloo_weight_group(on_a, ckpts, expected):
    good = _checkpoint_tensors(ckpts[1])
    nan = [(n, t.clone()) for n, t in good]
    nan[3][1].view(-1)[0] = math.nan
    wrong_shape = [(n, t[:1] if i == 2 else t) for i, (n, t) in enumerate(good)]
    spec = WeightGroupSpec(f"tcp://127.0.0.1:{free_port()}", world_size=2, rank=0, timeout_s=60)
    trainer = Trainer(spec, [good, nan, wrong_shape])
    trainer.start()
    engine = on_a
    engine.init_weight_group(spec.init_method, 2, rank=1, timeout_s=60)
    try:
        assert engine.update_weights(from_group=True) == 15
        assert tokens(engine) == expected["b"]
        with pytest.raises(ValueError, match=f"{nan[3][0]}: holds NaN"):
            engine.update_weights(from_group=True)
        with pytest.raises(ValueError, match=f"{good[2][0]}: shape"):
            engine.update_weights(from_group=True)
        assert tokens(engine) == expected["b"]
    finally:
        engine.destroy_weight_group()
    trainer.join(timeout=60)
    assert trainer.errors[0] is None
    assert "values" in str(trainer.errors[1]) and "manifest" in str(trainer.errors[2])


@pytest.mark.parametrize("value", HUGE + [0, True, "2"])
@pytest.mark.parametrize("field", ["world_size", "rank", "timeout_s"])
def test_weight_group_fields_are_bounded(field, value):
    fields = dict(init_method="tcp://127.0.0.1:29500", world_size=2, rank=1, timeout_s=60.0)
    fields[field] = value
    if field == "rank" and value == 0:
        WeightGroupSpec(**fields)  # the trainer's rank
        return
    with pytest.raises(ValueError, match=field):
        WeightGroupSpec(**fields)


@pytest.mark.parametrize(
    "init_method",
    [
        "",
        "127.0.0.1:29500",
        "http://127.0.0.1:29500",
        "tcp://127.0.0.1",
        "tcp://h:99999",
        "tcp://:1",
        "tcp://h:" + "9" * 30,
        "tcp://" + "h" * 2000 + ":1",
    ],
)
def test_a_weight_group_meets_at_tcp_host_port(init_method):
    with pytest.raises(ValueError, match="init_method"):
        WeightGroupSpec(init_method, 2, 1)


def test_a_manifest_round_trips_and_a_malformed_one_is_refused():
    named = [("a", torch.ones(3, 5)), ("b", torch.zeros(7, dtype=torch.bfloat16))]
    manifest = plan_buckets(named, bucket_bytes=64)
    assert len(manifest.bucket_bytes) == 2  # a's 60 bytes fill the first bucket
    assert Manifest.decode(manifest.encode()) == manifest
    for doc in [
        b"{",
        b'{"tensors": [], "buckets": [-1]}',
        b'{"tensors": [["a", "float32", [2], 0, 0]], "buckets": [4]}',  # 8 bytes in 4
        b'{"tensors": [["a", "int64", [1], 0, 0]], "buckets": [8]}',
        b'{"tensors": [["a", "float32", [1], 0, 0], ["a", "float32", [1], 0, 4]], "buckets": [8]}',
        b'{"tensors": [["a", "float32", [-1], 0, 0]], "buckets": [8]}',
        b'{"tensors": [["a", "float32", [1], 3, 0]], "buckets": [8]}',
        b'{"tensors": [], "buckets": [18446744073709551616]}',
    ]:
        with pytest.raises(ValueError, match="manifest|dtype|bucket|bytes|shape|listed"):
            Manifest.decode(doc)
    with pytest.raises(ValueError, match="bucket_bytes"):
        plan_buckets(named, bucket_bytes=0)
    with pytest.raises(ValueError, match="dtype"):
        plan_buckets([("i", torch.ones(2, dtype=torch.int64))])
