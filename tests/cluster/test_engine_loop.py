"""The replica's engine loop: a real EngineCore (tiny random Llama) stepping on its own thread."""

import asyncio
import itertools
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cluster.engine_loop import EngineLoop
from cluster.replica_stream import merge_outputs
from engine.config import EngineConfig
from engine.core import EngineCore
from scheduler import EngineRequest, RequestOutput, SamplingParams

# A replica built outside Serve is collected without its async __del__ (Serve's shutdown hook)
# being awaited: the coroutine never runs, which is the point.
pytestmark = pytest.mark.filterwarnings("ignore:coroutine 'LLMReplica.__del__' was never awaited")


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    core = EngineCore(
        EngineConfig.from_kwargs(
            model=tiny_model_dir,
            max_model_len=256,
            num_gpu_blocks=64,
            kv_cache_memory_gb=0.1,
            load_progress=False,
        )
    )
    yield core
    core.shutdown()


class Collector:
    """What the replica does with the loop's callbacks, reduced to per-request lists."""

    def __init__(self):
        self.outputs: dict[str, list[RequestOutput]] = {}
        self.errors: dict[str | None, BaseException] = {}
        self.stats = None
        self.done: dict[str, asyncio.Event] = {}

    def on_step(self, outputs, stats):
        self.stats = stats
        for out in outputs:
            self.outputs.setdefault(out.request_id, []).append(out)
            if out.finished:
                self.done.setdefault(out.request_id, asyncio.Event()).set()

    def on_error(self, request_id, exc):
        self.errors[request_id] = exc

    async def wait(self, rid):
        await self.done.setdefault(rid, asyncio.Event()).wait()


def _request(rid: str, max_tokens: int = 8) -> EngineRequest:
    return EngineRequest(
        rid, [5, 6, 7, 8, 9] * 4, SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    )


def test_concurrent_requests_stream_to_completion_and_aborts_free_blocks(engine):
    async def go():
        c = Collector()
        loop = EngineLoop(engine, asyncio.get_running_loop(), c.on_step, c.on_error)
        try:
            for i in range(6):
                loop.add(_request(f"r{i}"))
            loop.add(_request("long", max_tokens=200))
            await asyncio.gather(*(c.wait(f"r{i}") for i in range(6)))
            assert all(sum(len(o.new_token_ids) for o in c.outputs[f"r{i}"]) == 8 for i in range(6))
            assert not c.outputs["long"][-1].finished
            loop.abort(["long"])
            await c.wait("long")
            assert c.outputs["long"][-1].finish_reason == "abort"
            # The abort publishes fresh stats on its own, with no step needed.
            assert c.stats.num_running == 0 and c.stats.kv_cache_usage == 0.0
            assert await loop.call(lambda e: e.has_unfinished_requests()) is False
        finally:
            loop.stop()

    asyncio.run(go())


def test_a_rejected_request_errors_alone(engine):
    async def go():
        c = Collector()
        loop = EngineLoop(engine, asyncio.get_running_loop(), c.on_step, c.on_error)
        try:
            loop.add(EngineRequest("too-long", list(range(300)), SamplingParams(max_tokens=1)))
            loop.add(_request("fine", max_tokens=2))
            await c.wait("fine")
            assert isinstance(c.errors["too-long"], ValueError) and "fine" not in c.errors
        finally:
            loop.stop()

    asyncio.run(go())


def test_merged_deltas_keep_every_token_and_the_last_state():
    a = RequestOutput("x", [1, 2], False, None, 3, 2, 0, [[(1, -0.1)], [(2, -0.2)]])
    b = RequestOutput("x", [3], True, "length", 3, 3, 0, [[(3, -0.3)]])
    m = merge_outputs(a, b)
    assert m.new_token_ids == [1, 2, 3] and m.finished and m.finish_reason == "length"
    assert m.num_output_tokens == 3 and [lp[0][0] for lp in m.new_logprobs] == [1, 2, 3]


class ManualClock:
    """A clock that moves only when the test moves it."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_step_that_does_not_return_shows_as_a_stall(engine, monkeypatch):
    entered, release = threading.Event(), threading.Event()
    execute = engine.executor.execute_model

    def blocking_step(out):  # fault injection: the forward pass hangs until released
        entered.set()
        release.wait(timeout=30)
        return execute(out)

    async def hang_next_step() -> None:
        await asyncio.to_thread(entered.wait, 30)
        entered.clear()

    async def go():
        c = Collector()
        clock = ManualClock()
        loop = EngineLoop(engine, asyncio.get_running_loop(), c.on_step, c.on_error, clock=clock)
        monkeypatch.setattr(engine.executor, "execute_model", blocking_step)
        try:
            assert loop.stalled_for() == 0.0
            # The first step (graph compile, warm-up) may be slow without being a stall.
            loop.add(_request("warm", max_tokens=1))
            await hang_next_step()
            clock.now = 60.0
            assert loop.stalled_for() == 0.0
            release.set()
            await asyncio.wait_for(c.wait("warm"), 30)
            release.clear()

            loop.add(_request("hangs", max_tokens=2))
            await hang_next_step()
            clock.now += 7.5
            assert loop.stalled_for() == 7.5  # LLMReplica.check_health compares it to its timeout
            release.set()
            await asyncio.wait_for(c.wait("hangs"), 30)
            assert loop.stalled_for() == 0.0
        finally:
            release.set()
            loop.stop()

    asyncio.run(go())


async def _replica_on(engine, model_dir: str, monkeypatch, **settings):
    """An LLMReplica built outside Serve around the module's engine (its config from `settings`)."""
    from types import SimpleNamespace

    from cluster import replica as replica_module

    monkeypatch.setattr(replica_module, "build_engine", lambda config: engine)
    monkeypatch.setattr(
        replica_module.serve, "get_replica_context", lambda: SimpleNamespace(replica_tag="t#1")
    )
    config = EngineConfig.from_kwargs(
        model=model_dir,
        max_model_len=256,
        num_gpu_blocks=64,
        kv_cache_memory_gb=0.1,
        load_progress=False,
        **settings,
    )
    replica = object.__new__(replica_module.LLMReplica.func_or_class)
    await replica.__init__(config)
    return replica


def test_stream_interval_sends_the_first_token_at_once_then_chunks_of_that_many(
    engine, tiny_model_dir, ray_cluster, monkeypatch
):
    """stream_interval 4: a 14-token greedy answer arrives as 1 + 4 + 4 + 4 + 1 tokens, the same
    tokens as with interval 1 (which sends every step's token on its own)."""
    from scheduler.request import EngineRequest

    async def deltas(interval: int) -> list[list[int]]:
        replica = await _replica_on(engine, tiny_model_dir, monkeypatch, stream_interval=interval)
        params = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)
        try:
            return [
                out.new_token_ids
                async for out in replica.generate(
                    EngineRequest(f"i{interval}", [5, 6, 7, 8, 9] * 4, params)
                )
            ]
        finally:
            replica._loop_thread.stop()

    every_token, chunked = asyncio.run(deltas(1)), asyncio.run(deltas(4))
    sizes = [len(d) for d in chunked]
    assert sizes[0] % 4 == 1 and all(n >= 4 for n in sizes[1:-1]), sizes
    assert len(sizes) >= 2 and sum(sizes) == 14, sizes  # the last token is never held back alone
    assert len(sizes) <= 5  # [1, 4, 4, 4, 1] unless the consumer lagged and deltas merged
    assert list(itertools.chain(*chunked)) == list(itertools.chain(*every_token))


def _greedy(max_tokens: int, stop: list[str] | None = None) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, stop=stop or [])


async def _collect(replica, rid: str, prompt: list[int], params) -> list[RequestOutput]:
    from scheduler.request import EngineRequest

    return [out async for out in replica.generate(EngineRequest(rid, prompt, params))]


def test_stop_strings_are_the_ingress_business_the_replica_streams_tokens(
    engine, tiny_model_dir, ray_cluster, monkeypatch
):
    """The replica knows token-level stops only: a stop string its text contains changes nothing
    there (the ingress's frontend cuts the text and cancels the stream)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompt = [5, 6, 7, 8, 9] * 4

    async def go():
        replica = await _replica_on(engine, tiny_model_dir, monkeypatch)
        try:
            plain = await _collect(replica, "plain", prompt, _greedy(24))
            text = tokenizer.decode([t for o in plain for t in o.new_token_ids])
            stop = next(
                text[i : i + 2] for i in range(len(text) // 3, len(text)) if text[i : i + 2].strip()
            )
            stopped = await _collect(replica, "stop", prompt, _greedy(24, [stop]))
        finally:
            replica._loop_thread.stop()
        return plain, stopped

    plain, stopped = asyncio.run(go())
    tokens = [[t for o in outs for t in o.new_token_ids] for outs in (plain, stopped)]
    assert tokens[0] == tokens[1] and len(tokens[0]) == 24
    assert stopped[-1].finish_reason == plain[-1].finish_reason == "length"


@settings(max_examples=200, deadline=None)
@given(
    steps=st.lists(st.tuples(st.integers(0, 5), st.booleans()), min_size=1, max_size=30),
    interval=st.integers(1, 8),
)
def test_a_hand_back_carries_every_token_the_ingress_has_not_received(steps, interval):
    """Whatever was chunked (stream_interval), queued and read before it: the hand-back is one
    last "abort" output whose tokens are exactly those the consumer has not received yet."""
    from cluster.replica_stream import ReplicaStream

    async def go() -> list[RequestOutput]:
        stream, received, produced = ReplicaStream("r"), [], 0
        for count, read in steps:
            tokens = list(range(produced, produced + count))
            produced += count
            out = RequestOutput("r", tokens, False, None, 3, produced)
            if (chunk := stream.chunk(out, interval)) is not None:
                stream.queue.put_nowait(chunk)
            if read and not stream.queue.empty():
                received.append(await stream.next())
        stream.hand_back()
        while not received or not received[-1].finished:
            received.append(await stream.next())
        return received

    received = asyncio.run(go())
    produced = sum(count for count, _ in steps)
    assert list(itertools.chain.from_iterable(o.new_token_ids for o in received)) == list(
        range(produced)
    )
    assert received[-1].finish_reason == "abort"
    assert not any(o.finished for o in received[:-1])


def test_shutdown_hands_back_what_each_stream_holds_and_refuses_new_requests(
    tiny_model_dir, ray_cluster, monkeypatch
):
    """stream_interval 256 holds every token after the first. shutdown() (what Serve's __del__
    hook awaits) ends each stream with an "abort" carrying the tokens it held, the same tokens an
    undisturbed run makes; the replica then refuses requests, and a second shutdown is a
    no-op."""
    from cluster.errors import ReplicaDrainingError

    own_engine = EngineCore(  # shutdown releases the engine: not the module's
        EngineConfig.from_kwargs(
            model=tiny_model_dir,
            max_model_len=256,
            num_gpu_blocks=64,
            kv_cache_memory_gb=0.1,
            load_progress=False,
        )
    )
    prompts = {"a": [5, 6, 7, 8, 9] * 4, "b": [9, 8, 7, 6, 5] * 4}

    async def go():
        from scheduler.request import EngineRequest

        replica = await _replica_on(own_engine, tiny_model_dir, monkeypatch, stream_interval=256)
        undisturbed = {}
        for rid, p in prompts.items():
            outs = await _collect(replica, rid, p, _greedy(200))
            undisturbed[rid] = [t for o in outs for t in o.new_token_ids]
        streams = {
            rid: replica.generate(EngineRequest(f"{rid}-2", p, _greedy(200)))
            for rid, p in prompts.items()
        }
        firsts = {rid: await anext(s) for rid, s in streams.items()}  # the first token: at once
        held = {}
        for _ in range(2000):
            held = {rid: s.held for rid, s in replica._streams.items() if s.held is not None}
            if len(held) == 2 and all(len(h.new_token_ids) >= 3 for h in held.values()):
                break
            await asyncio.sleep(0.005)
        held_tokens = {rid[:1]: list(h.new_token_ids) for rid, h in held.items()}
        assert await replica.shutdown() == {"replica": "t#1", "handed_back": 2}
        rest = {}
        for rid, stream in streams.items():
            rest[rid] = [o async for o in stream]
        with pytest.raises(ReplicaDrainingError):
            await _collect(replica, "late", prompts["a"], _greedy(4))
        assert await replica.shutdown() == {"replica": "t#1", "handed_back": 0}
        replica._loop_thread.stop(shutdown_engine=True)  # waits for the engine thread's end
        return undisturbed, firsts, held_tokens, rest

    undisturbed, firsts, held, rest = asyncio.run(go())
    for rid in prompts:
        [last] = rest[rid]
        assert last.finished and last.finish_reason == "abort"
        assert len(held[rid]) >= 3 and last.new_token_ids == held[rid]
        tokens = firsts[rid].new_token_ids + last.new_token_ids
        assert tokens == undisturbed[rid][: len(tokens)]


def test_the_engine_is_built_on_a_thread_that_has_ended_when_it_returns():
    # torch's OpenMP pool of the thread that loaded the model must be gone before the engine thread
    # steps (two pools throttle libgomp's spin-waiting): the building thread has exited.
    from cluster.engine_build import on_passing_thread

    seen: list[threading.Thread] = []
    result = on_passing_thread(lambda: seen.append(threading.current_thread()) or 42)
    assert result == 42 and seen[0] is not threading.current_thread() and not seen[0].is_alive()
    with pytest.raises(ValueError, match="model"):
        on_passing_thread(lambda: (_ for _ in ()).throw(ValueError("model: bad")))


@settings(max_examples=200, deadline=None)
@given(steps=st.lists(st.integers(0, 5), min_size=1, max_size=30), interval=st.integers(1, 8))
def test_stream_chunks_keep_every_token_and_hold_only_below_the_interval(steps, interval):
    """Whatever the steps' token counts: the chunks concatenate to every token, the last one
    finishes, and only the first tokens and the finish go out in a chunk shorter than the
    interval."""
    from cluster.replica_stream import ReplicaStream

    stream, sent, produced = ReplicaStream("r"), [], 0
    for i, count in enumerate(steps):
        tokens = list(range(produced, produced + count))
        produced += count
        last = i == len(steps) - 1
        out = RequestOutput("r", tokens, last, "length" if last else None, 3, produced)
        if (chunk := stream.chunk(out, interval)) is not None:
            sent.append(chunk)
    assert list(itertools.chain.from_iterable(c.new_token_ids for c in sent)) == list(
        range(produced)
    )
    assert sent[-1].finished and all(not c.finished for c in sent[:-1])
    first = next((i for i, c in enumerate(sent) if c.new_token_ids), len(sent))
    assert all(len(c.new_token_ids) >= interval for c in sent[first + 1 : -1])
