"""How many tokens a replica holds per streamed chunk.

A chunk a replica yields costs CPU in three processes beside the engine: the replica sends it over
Ray, the ingress receives, detokenizes and formats it and hands it to the Serve proxy, which
writes it to the client's socket. On a machine whose cores the engine's threads fill, that CPU
comes out of the step (bench/results/2026-11-29-served-path.md). `stream_interval` bounds the
chunks of one stream; `stream_chunks_per_step` bounds the replica's: with many streams each holds
more tokens, so that the replica sends about that many chunks per step whatever the batch. The
first tokens, a finish and an error are never held (cluster/replica.py, _Stream.chunk).
"""

from __future__ import annotations

import math

from engine.config import MAX_STREAM_INTERVAL


def chunk_tokens(stream_interval: int, chunks_per_step: float | None, num_streams: int) -> int:
    """Tokens per chunk this step: stream_interval, grown so that num_streams streams send about
    chunks_per_step chunks a step (a stream sends one chunk per chunk_tokens steps)."""
    if chunks_per_step is None:
        return stream_interval
    spread = math.ceil(num_streams / chunks_per_step)
    return min(MAX_STREAM_INTERVAL, max(stream_interval, spread))
