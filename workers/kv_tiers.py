"""The KV connector, worker side: the lower tiers of the prefix cache and the copies to and from
them (scheduler/kv_connector.py decides every copy; this file only carries them out).

- CPU tier: one host tensor of whole blocks, block-major ([slots, layers, parts, block_size, heads,
  head_dim]; parts is K and V, or MLA's one latent row: KVCacheSpec.kv_parts) so one slot is one
  contiguous run of bytes; pinned on CUDA.
- Disk tier: one file per block under this engine's own directory, rank by rank, private to the
  rank and authenticated by a key it holds in memory (workers/kv_disk.py); a file that does not
  match what is asked for (missing, short, another hash or layout, a bad or forged MAC) fails its
  load, and the scheduler recomputes the block instead.

Within a step: demote (CPU -> disk) and save (device -> CPU) run first, before the swap copies and
the forward can overwrite what they read; loads (CPU or disk -> device) run after. On CUDA the
loads from the CPU tier are issued on a side stream: the requests they feed are not in this step's
batch, so the copies overlap the forward, and the next step waits for them before it starts. On
CPU every copy is a synchronous memcpy inside the step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from scheduler.kv_connector import KVTransfers
from workers.kv_cache import GiB, KVCache, KVCacheSpec
from workers.kv_disk import HEADER, OVERHEAD_BYTES, DiskTier

logger = logging.getLogger(__name__)

HEADER_BYTES = OVERHEAD_BYTES  # per block file, besides the block's bytes


@dataclass(frozen=True, slots=True)
class KVTierConfig:
    """The lower tiers of one rank (plain values: travels to Ray workers in RunnerConfig)."""

    num_cpu_blocks: int
    num_disk_blocks: int = 0
    disk_dir: str | None = None  # this engine's own directory; each rank writes under rank<N>/

    def __post_init__(self) -> None:
        if self.num_cpu_blocks < 1:
            raise ValueError(f"num_cpu_tier_blocks: must be >= 1, got {self.num_cpu_blocks}")
        if self.num_disk_blocks and not self.disk_dir:
            raise ValueError("kv_disk_tier_dir: the disk tier needs a directory")


def disk_tier_blocks(spec: KVCacheSpec, num_gb: float) -> int:
    """Block files (header included) that fit num_gb GiB."""
    return max(int(num_gb * GiB // (spec.block_bytes + HEADER_BYTES)), 0)


class KVTiers:
    """One rank's CPU and disk tiers, bound to its device KV pool."""

    def __init__(self, cache: KVCache, config: KVTierConfig, rank: int = 0) -> None:
        spec = cache.spec
        self.cache = cache
        self.device = cache.gpu.device
        # The device pool's layout, block-major: K and V, or one latent row (kv_parts 1) a layer.
        shape = (spec.num_layers, spec.kv_parts, spec.block_size, spec.num_kv_heads, spec.head_dim)
        self.block_shape = shape
        self.cpu = torch.zeros(
            (config.num_cpu_blocks, *shape),
            dtype=spec.storage_dtype,  # FP8 KV: its uint8 codes, copied as bytes
            pin_memory=self.device.type == "cuda",
        )
        self.block_nbytes = self.cpu[0].numel() * self.cpu.element_size()
        self.slot_hash: list[int | None] = [None] * config.num_cpu_blocks
        self.disk: DiskTier | None = None
        self.dir: Path | None = None
        if config.num_disk_blocks:
            assert config.disk_dir is not None
            self.disk = DiskTier(config.disk_dir, rank, self.block_nbytes)
            self.dir = self.disk.dir
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._loads_done: torch.cuda.Event | None = None
        logger.info(
            "KV tiers: %d CPU blocks (%.2f GiB), %d disk blocks in %s",
            config.num_cpu_blocks,
            config.num_cpu_blocks * self.block_nbytes / GiB,
            config.num_disk_blocks,
            self.dir,
        )

    # ---- the step ------------------------------------------------------------------------------
    def wait_for_loads(self) -> None:
        """The previous step's loads are in the device pool before this step touches it."""
        if self._loads_done is not None:
            torch.cuda.current_stream(self.device).wait_event(self._loads_done)
            self._loads_done = None

    def save(self, t: KVTransfers) -> None:
        """Demote CPU blocks to disk, then copy evicted device blocks into their CPU slots (or
        straight to disk)."""
        for slot, block_hash in t.demote:
            if self.slot_hash[slot] == block_hash:
                self._write_file(self.cpu[slot], block_hash)
            else:
                logger.warning("KV tier: CPU slot %d does not hold %032x", slot, block_hash)
        for block, block_hash in t.save_disk:
            self._write_file(self.cache.gpu[:, :, block].to("cpu"), block_hash)
        if t.save and self.device.type == "cpu":  # one strided memcpy a block
            gpu = self.cache.gpu
            for block, slot, _ in t.save:
                self.cpu[slot].copy_(gpu[:, :, block])
        elif t.save:  # one gather on the device, one copy to the host
            blocks = torch.tensor([b for b, _, _ in t.save], dtype=torch.long, device=self.device)
            slots = torch.tensor([s for _, s, _ in t.save], dtype=torch.long)
            # [layers, parts, n, ...] -> [n, layers, parts, ...]
            self.cpu[slots] = self.cache.gpu[:, :, blocks].movedim(2, 0).to("cpu")
        for _, slot, block_hash in t.save:
            self.slot_hash[slot] = block_hash

    def load(self, t: KVTransfers) -> list[int]:
        """Copy blocks into their device slots; the device blocks whose load failed its check."""
        failed: list[int] = []
        good = []
        for slot, block, block_hash in t.load_cpu:
            if self.slot_hash[slot] == block_hash:
                good.append((self.cpu[slot], block))
            else:  # the slot holds another block: never hand out KV that is not the hash's
                logger.warning("KV tier: CPU slot %d does not hold %032x", slot, block_hash)
                failed.append(block)
        for block_hash, block in t.load_disk:
            data = self._read_file(block_hash)
            if data is None:
                failed.append(block)
            else:
                good.append((data, block))
        self._copy_in(good)
        if self.disk is not None:
            for block_hash in t.drop_disk:
                self.disk.drop(block_hash)
        return failed

    def _copy_in(self, blocks: list[tuple[torch.Tensor, int]]) -> None:
        if not blocks:
            return
        gpu = self.cache.gpu
        if self._stream is None:
            for data, block in blocks:
                gpu[:, :, block] = data
            return
        # The copies must follow this step's saves and swaps (same blocks), and precede the next
        # step's forward: a side stream ordered after the compute stream, waited on next step.
        compute = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(compute)
        with torch.cuda.stream(self._stream):
            for data, block in blocks:
                gpu[:, :, block].copy_(data, non_blocking=True)
            self._loads_done = torch.cuda.Event()
            self._loads_done.record(self._stream)
        # Host sources stay valid: a CPU slot is rewritten only by a later step's save, after
        # wait_for_loads; a disk block's pinned buffer is held by the caching host allocator until
        # the copy that reads it is done.

    # ---- disk ----------------------------------------------------------------------------------
    def _write_file(self, block: torch.Tensor, block_hash: int) -> None:
        """Write one block ([layers, parts, block_size, heads, head_dim], on the host) to a file."""
        if self.disk is not None:
            payload = block.contiguous().view(-1).view(torch.uint8).numpy()
            self.disk.write(payload.data, block_hash)  # the array's buffer, as a memoryview

    def _read_file(self, block_hash: int) -> torch.Tensor | None:
        """The block stored for block_hash, or None when its file is missing or fails a check."""
        buf = self.disk.read(block_hash) if self.disk is not None else None
        if buf is None:
            return None
        data = torch.frombuffer(buf, dtype=torch.uint8, offset=HEADER.size, count=self.block_nbytes)
        block = data.view(self.cpu.dtype).view(self.block_shape)
        return block.pin_memory() if self._stream is not None else block
