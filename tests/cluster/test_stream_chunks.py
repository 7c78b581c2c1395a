"""A replica's chunks per step: stream_interval per stream, stream_chunks_per_step across them."""

import itertools

import pytest

from cluster.replica_stream import ReplicaStream
from cluster.stream_chunks import chunk_tokens
from deploy.config import AppConfig
from engine.config import MAX_STREAM_INTERVAL, EngineConfig
from scheduler import RequestOutput


def test_chunk_tokens_grow_with_the_streams_past_the_interval():
    assert chunk_tokens(4, None, 32) == 4  # unset: stream_interval alone
    assert chunk_tokens(4, 0.5, 1) == 4  # few streams: stream_interval still bounds
    assert chunk_tokens(4, 0.5, 2) == 4
    assert chunk_tokens(4, 0.5, 8) == 16  # 8 streams, one chunk each per 16 steps
    assert chunk_tokens(4, 2.0, 9) == 5  # rounded up: never more chunks than asked
    assert chunk_tokens(4, 0.01, 10_000) == MAX_STREAM_INTERVAL


def _decode(num_streams: int, num_tokens: int, interval: int, per_step: float | None):
    """num_streams streams decoding one token a step together, chunked as the replica's _on_step
    chunks them; each stream's chunks."""
    streams = [ReplicaStream(f"r{i}") for i in range(num_streams)]
    sent: list[list[RequestOutput]] = [[] for _ in streams]
    for n in range(1, num_tokens + 1):
        tokens = chunk_tokens(interval, per_step, len(streams))
        for stream, out in zip(streams, sent):
            done = n == num_tokens
            delta = RequestOutput(stream.request_id, [n - 1], done, "length" if done else None)
            if (chunk := stream.chunk(delta, tokens)) is not None:
                out.append(chunk)
    return sent


def test_eight_streams_send_half_a_chunk_a_step_with_every_token():
    """deploy.yaml's 4 and 0.5 at concurrency 8, 64 tokens each: the first token at once, then
    16 a chunk, the finish with the rest: 5 chunks a stream (40 in 64 steps) where stream_interval
    alone sends 17 (136), and every token arrives in order."""
    sent = _decode(8, 64, 4, 0.5)
    for chunks in sent:
        assert [len(c.new_token_ids) for c in chunks] == [1, 16, 16, 16, 15]
        assert list(itertools.chain.from_iterable(c.new_token_ids for c in chunks)) == list(
            range(64)
        )
        assert chunks[-1].finished and not any(c.finished for c in chunks[:-1])
    assert sum(len(chunks) for chunks in _decode(8, 64, 4, None)) == 8 * 17


def test_one_stream_keeps_stream_interval():
    (chunks,) = _decode(1, 64, 4, 0.5)
    assert [len(c.new_token_ids) for c in chunks] == [1] + [4] * 15 + [3]


@pytest.mark.parametrize("value", [2**64, -1, float("nan"), 1e300, 0, float("inf")])
def test_stream_chunks_per_step_is_bounded_at_the_edge_and_in_the_library(value):
    with pytest.raises(ValueError, match="stream_chunks_per_step"):
        AppConfig.from_args({"model": "default", "stream_chunks_per_step": value})
    with pytest.raises(ValueError, match="stream_chunks_per_step"):
        EngineConfig.from_kwargs(model="default", stream_chunks_per_step=value)
