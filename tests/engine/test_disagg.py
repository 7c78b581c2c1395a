"""Prefill/decode disaggregation between two engines in one process: the prefill engine computes the
prompt and its first token and sends the prompt's blocks; the decode engine loads them through the
KV connector (LOADING_KV) and decodes the rest. The text equals one colocated engine's, whether the
transfer arrives intact, damaged or not at all, and no block or transfer is left held."""

from __future__ import annotations

import random

import pytest

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.disagg import DecodeSide, PrefillSide, decode_request, needs_decode, prefill_request
from scheduler import EngineRequest, SamplingParams
from scheduler.outputs import RequestOutput
from workers.kv_transfer import InProcessTransport, TransferHandle

BLOCK = 16
POOL = dict(device="cpu", load_progress=False, num_gpu_blocks=48, max_model_len=256)
GREEDY = SamplingParams(max_tokens=8, temperature=0.0)
SEEDED = SamplingParams(max_tokens=8, temperature=0.9, top_p=0.95, seed=1234)


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    built = [EngineCore(EngineConfig.from_kwargs(model=tiny_model_dir, **POOL)) for _ in range(3)]
    yield built
    for engine in built:
        engine.shutdown()


@pytest.fixture(scope="module")
def pair(engines):
    transport = InProcessTransport()
    prefill, decode, _ = engines
    return PrefillSide(prefill, transport), DecodeSide(decode, transport), transport


def drain(engine: EngineCore) -> list[RequestOutput]:
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    return outs


def tokens_of(outs: list[RequestOutput], rid: str) -> list[int]:
    return [t for o in outs if o.request_id == rid for t in o.new_token_ids]


def colocated(engine: EngineCore, request: EngineRequest) -> list[int]:
    engine.add_request(request)
    return tokens_of(drain(engine), request.request_id)


def disaggregated(pair, request: EngineRequest, damage=None) -> tuple[list[int], RequestOutput]:
    """Prefill, then decode; damage(handle) may spoil the transfer in between. Returns the tokens
    and the decode engine's last output."""
    prefill, decode, _ = pair
    prefill.engine.add_request(prefill_request(request))
    outs = drain(prefill.engine)
    first, last = tokens_of(outs, request.request_id), outs[-1]
    assert last.finished
    if not needs_decode(request, last, prefill.engine.max_model_len):
        return first, last
    handle = prefill.export(request)  # right after the step that finished it
    if damage is not None and handle is not None:
        damage(handle)
    decode.add(decode_request(request, first), handle)
    outs = drain(decode.engine)
    return first + tokens_of(outs, request.request_id), outs[-1]


def prompts(seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 2000) for _ in range(n)] for n in lengths]


def assert_nothing_held(engines, transport: InProcessTransport, decode: DecodeSide) -> None:
    for engine in engines:
        assert not engine.has_unfinished_requests()
        assert engine.stats().num_free_blocks == engine.num_gpu_blocks
    assert transport.payloads == {} and decode.receiver.handles == {}
    assert decode.connector.expected == {} and decode.connector.remote == {}
    assert decode.connector.plans == {} and decode.engine.scheduler.loading == {}


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_prefill_then_decode_gives_the_colocated_text_loading_the_prompt_blocks(
    engines, pair, params
):
    loaded_before = pair[1].connector.num_remote_loaded
    # 5: no full block to send; 32: the last prompt token ends a block; 70: a partial last block
    for i, prompt in enumerate(prompts(hash(params.temperature) % 1000, (5, 32, 70))):
        request = EngineRequest(f"{params.temperature}-{i}", prompt, params)
        expected = colocated(engines[2], request)
        got, last = disaggregated(pair, request)
        assert got == expected
        # The decode engine computed only what did not arrive: the last prompt token onwards.
        assert last.num_cached_tokens == (len(prompt) // BLOCK) * BLOCK
    assert pair[1].connector.num_remote_loaded - loaded_before == 2 + 4
    assert_nothing_held(engines, pair[2], pair[1])


def corrupt(transport: InProcessTransport, handle: TransferHandle) -> None:
    transport.payloads[handle.key].data[1, 7] ^= 0xFF  # the second block: its CRC fails


def wrong_prompt(transport: InProcessTransport, handle: TransferHandle) -> None:
    other = transport.payloads[handle.key]
    transport.payloads[handle.key] = type(other)(
        [h ^ 1 for h in other.hashes], other.crcs, other.dtype, other.block_shape, other.data
    )


@pytest.mark.parametrize("how", ["corrupt", "missing", "wrong_hashes"])
def test_a_failed_transfer_is_recomputed_with_the_same_text(engines, pair, how):
    transport = pair[2]
    damage = {
        "corrupt": lambda h: corrupt(transport, h),
        "missing": lambda h: transport.payloads.pop(h.key),
        "wrong_hashes": lambda h: wrong_prompt(transport, h),
    }[how]
    prompt = prompts(sum(map(ord, how)), (60,))[0]
    request = EngineRequest(f"fail-{how}", prompt, SEEDED)
    expected = colocated(engines[2], request)
    failed_before = pair[1].connector.num_remote_failed
    got, last = disaggregated(pair, request, damage)
    assert got == expected
    kept = 1 if how == "corrupt" else 0  # the blocks before the first bad one are kept
    assert last.num_cached_tokens == kept * BLOCK
    assert pair[1].connector.num_remote_failed - failed_before == 3 - kept
    assert_nothing_held(engines, transport, pair[1])


def test_a_request_aborted_while_its_kv_loads_holds_nothing(engines, pair):
    prefill, decode, transport = pair
    request = EngineRequest("aborted", prompts(9, (50,))[0], GREEDY)
    prefill.engine.add_request(prefill_request(request))
    first = tokens_of(drain(prefill.engine), "aborted")
    decode.add(decode_request(request, first), prefill.export(request))
    engine, sched = decode.engine, decode.engine.scheduler
    out = sched.schedule()  # admitted into LOADING_KV, its loads in this step
    assert "aborted" in sched.loading and out.kv_transfers is not None
    engine.abort_requests(["aborted"])  # while the step runs
    sched.update_from_output(out, engine.executor.execute_model(out))
    drain(engine)
    assert_nothing_held(engines, transport, decode)
