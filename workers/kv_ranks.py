"""A KV transfer's work on one tensor-parallel rank: what the engine runs on each of its ranks
(engine/disagg.py, through `Executor.call_ranks` or directly on an in-process runner).

Each rank holds its own KV heads of every block, so each rank sends and receives its own shard:
the prefill engine's rank r reads its blocks and sends them as one payload; a decode engine's rank
receives the shards that hold its heads (workers/kv_reshard.py: at the same tensor-parallel size
the handle's `shards[r]`, at another size the shards it cuts its heads from) into its own pool.
The functions are module-level so that they travel to Ray workers by reference (functools.partial
of them pickles).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from workers.features.kv_loads import KVLoadsFeature
from workers.kv_reshard import plan, readers, total_kv_heads
from workers.kv_transfer import Expected, KVReceiver, KVTransport, TransferHandle, read_blocks
from workers.parallel import get_tp_rank, get_tp_world_size

if TYPE_CHECKING:
    from workers.runner import ModelRunner


def export(
    transport: KVTransport, hashes: list[int], blocks: list[int], runner: ModelRunner
) -> tuple[TransferHandle, int]:
    """Send this rank's shard of the device blocks (prefill side): its handle and bytes."""
    if runner.kv_cache is None:
        raise RuntimeError("kv export: the runner has no KV cache yet")
    payload = read_blocks(runner.kv_cache, hashes, blocks, get_tp_rank())
    return transport.send(payload), payload.nbytes


def start_receiver(transport: KVTransport, timeout_s: float, runner: ModelRunner) -> None:
    """Make this rank a decode rank: its step's `load_remote` copies come through `transport`."""
    runner.kv_receiver = KVReceiver(transport, timeout_s, get_tp_rank())


def expect(handle: TransferHandle, runner: ModelRunner) -> bool:
    """Fetch the shards of `handle` that hold this rank's KV heads, for its loads; False if the
    heads do not split between the two sizes (the blocks are then recomputed)."""
    feature = runner.feature(KVLoadsFeature)
    if feature is None:
        return False
    heads = total_kv_heads(feature.ctx.hf_config)
    src_tp, dst_tp = len(handle.parts), get_tp_world_size()
    try:
        slices = plan(heads, src_tp, dst_tp, get_tp_rank())
    except ValueError:
        return False
    parts = [
        replace(handle.parts[s.src_rank], readers=readers(heads, src_tp, dst_tp, s.src_rank))
        for s in slices
    ]
    _receiver(runner).expect_parts(handle.key, Expected(parts, slices))
    return True


def forget(key: str, runner: ModelRunner) -> None:
    """Release the transfer `key` if this rank still holds it (it never loaded)."""
    _receiver(runner).forget(key)


def received(runner: ModelRunner) -> tuple[int, float]:
    """(bytes copied in, seconds spent loading) on this rank, cumulative."""
    receiver = _receiver(runner)
    return receiver.num_bytes, receiver.load_s


def _receiver(runner: ModelRunner) -> KVReceiver:
    if runner.kv_receiver is None:
        raise RuntimeError("kv transfer: this rank receives no KV transfers (start_receiver)")
    return runner.kv_receiver
