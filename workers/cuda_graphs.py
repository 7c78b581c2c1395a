"""CUDA graphs for pure-decode steps: one graph per padded batch size, over persistent inputs.

A decode step of a small model on a fast GPU is bound by kernel launches rather than by memory,
and a graph replays all of the forward's kernels with one launch. Prefill and mixed steps vary
in shape and stay eager. Rows past the real batch write and read a reserved pad block, so they
never touch a request's KV.

Under tensor parallelism the graphs hold the TP collectives: NCCL's all-reduces are enqueued on
the capturing stream and replay with the graph, so a rank replays a whole decode forward from the
broadcast step with one launch and no host round trip per layer. That needs every rank to replay
the same graph at each step: the ranks run the same scheduler output, so they pick the same padded
size when they captured the same sizes, which capture() checks first. gloo's collectives run on
the host and cannot be captured: a gloo group (CPU) never captures.
"""

from __future__ import annotations

import logging
import time

import torch
from torch import nn

from workers.layers.attention import AttentionBackend, AttentionMetadata
from workers.parallel import all_gather, collectives_capturable, collectives_issued

logger = logging.getLogger(__name__)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, 16, 32, then multiples of 32; the last one is the first that holds
    max_num_seqs."""
    sizes: list[int] = []
    size = 1
    while not sizes or sizes[-1] < max_num_seqs:
        sizes.append(size)
        size = size * 2 if size < 32 else size + 32
    return sizes


def decode_graphs_enabled(
    device: torch.device, enforce_eager: bool, backend_capturable: bool
) -> bool:
    """Whether a runner captures decode graphs: on CUDA, unless enforce_eager, with an attention
    backend that can be captured, and with TP collectives that can be (none, or NCCL's)."""
    return (
        device.type == "cuda"
        and not enforce_eager
        and backend_capturable
        and collectives_capturable()
    )


def check_same_sizes(sizes: list[int], device: torch.device) -> None:
    """Raise on every rank unless every TP rank is about to capture the same batch sizes: a rank
    replaying another graph than its peers would wait forever in a collective they never issue.
    One all-gather of a fingerprint; nothing without a group."""
    key = torch.tensor(
        [len(sizes), sizes[0], sizes[-1], sum(sizes)], dtype=torch.long, device=device
    )
    everyone = all_gather(key[None], dim=0)
    if not bool((everyone == key).all()):
        raise RuntimeError(
            "cuda graphs: the tensor-parallel ranks would capture different batch sizes "
            f"(count, first, last, sum per rank: {everyone.tolist()}); every rank needs the same "
            "max_num_seqs"
        )


class DecodeGraphs:
    """Captured decode forwards of `model` and the buffers they read, filled before each replay."""

    def __init__(
        self,
        model: nn.Module,
        backend: AttentionBackend,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        block_size: int,
        pad_block: int,
        device: torch.device,
    ) -> None:
        self.model, self.backend = model, backend
        self.sizes = capture_sizes(max_num_seqs)
        self.block_size, self.pad_block = block_size, pad_block
        n = self.sizes[-1]
        # Device buffers the graphs read: token ids, positions and cache slots (int64, one row
        # each), then sequence lengths and block tables (int32, contiguous, as the attention kernel
        # takes them).
        self.longs = torch.zeros((3, n), dtype=torch.long, device=device)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros((n, max_blocks_per_seq), dtype=torch.int32, device=device)
        # Pinned staging, written on the host and copied in one transfer each.
        self.host_longs = torch.zeros((3, n), dtype=torch.long).pin_memory()
        self.host_seq_lens = torch.zeros(n, dtype=torch.int32).pin_memory()
        self.host_tables = torch.zeros((n, max_blocks_per_seq), dtype=torch.int32).pin_memory()
        self._pad_rows(0, n)
        self.longs.copy_(self.host_longs)
        self.seq_lens.copy_(self.host_seq_lens)
        self.block_tables.copy_(self.host_tables)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.outputs: dict[int, torch.Tensor] = {}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # TP collectives each graph holds (0 without a group): what the log and tests check.
        self.collectives: dict[int, int] = {}
        self.replays = 0

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def _pad_rows(self, start: int, end: int) -> None:
        """Rows [start, end) decode token 0 at position 0 into the pad block."""
        self.host_longs[:2, start:end] = 0
        self.host_longs[2, start:end] = self.pad_block * self.block_size
        self.host_seq_lens[start:end] = 1
        self.host_tables[start:end, 0] = self.pad_block

    def _meta(self, size: int) -> AttentionMetadata:
        meta = AttentionMetadata(
            slot_mapping=self.longs[2, :size],
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size],
            num_decodes=size,
            query_start_loc_cpu=list(range(size + 1)),
            seq_lens_cpu=[1] * size,
            block_size=self.block_size,
        )
        self.backend.prepare(meta)
        return meta

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first, into one memory pool (the inputs are the pad rows).

        Every TP rank calls this at the same time: the warm-up forwards and the captures issue
        the same collectives in the same order on every rank."""
        t0 = time.perf_counter()
        check_same_sizes(self.sizes, self.longs.device)
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            meta = self._meta(size)
            ids, positions = self.longs[0, :size], self.longs[1, :size]
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(
                side
            ):  # compiles kernels and sets up handles outside the capture
                for _ in range(2):
                    self.model(ids, positions, meta)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            issued = collectives_issued()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self.model(ids, positions, meta)
            self.graphs[size] = graph
            self.collectives[size] = collectives_issued() - issued
        torch.cuda.synchronize()
        logger.info(
            "captured %d decode CUDA graphs (batch %d..%d, %d TP collectives each) in %.1fs",
            len(self.sizes),
            self.sizes[0],
            self.sizes[-1],
            self.collectives[self.sizes[0]],
            time.perf_counter() - t0,
        )

    def padded_size(self, num_reqs: int) -> int:
        return next(s for s in self.sizes if s >= num_reqs)

    def run(
        self, input_ids: list[int], positions: list[int], block_tables: list[list[int]]
    ) -> torch.Tensor:
        """Hidden states [len(input_ids), H] of one decode token per request at its position."""
        n = len(input_ids)
        size = self.padded_size(n)
        bs = self.block_size
        slots = [table[p // bs] * bs + p % bs for table, p in zip(block_tables, positions)]
        self.host_longs[:, :n] = torch.tensor([input_ids, positions, slots], dtype=torch.long)
        width = max(len(t) for t in block_tables)
        tables = torch.tensor([t + [0] * (width - len(t)) for t in block_tables], dtype=torch.int32)
        self.host_seq_lens[:n] = torch.tensor(positions, dtype=torch.int32) + 1
        self.host_tables[:n, :width] = tables
        self._pad_rows(n, size)
        # Entries past a row's own blocks may be stale: the kernel reads only ceil(seq_len / bs) of
        # them.
        self.longs[:, :size].copy_(self.host_longs[:, :size], non_blocking=True)
        self.seq_lens[:size].copy_(self.host_seq_lens[:size], non_blocking=True)
        self.block_tables[:size, :width].copy_(self.host_tables[:size, :width], non_blocking=True)
        self.graphs[size].replay()
        self.replays += 1
        return self.outputs[size][:n]
