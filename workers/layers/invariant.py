"""Batch-invariant mode: a row's result does not depend on the other rows of its step.

Under `batch_invariant` (engine/config.py) a request's tokens and logprobs are bit-identical
whether it runs alone or in any batch, chunked or not, after a prefix hit or a preemption
(docs/batch_invariance.md). Two kernels on the CPU path break that by default:

- a float matmul: oneDNN and MKL pick their blocking (and with it each dot product's summation
  order) by the row count M, and a 1-row call runs a different kernel from a 2-row one. With M
  fixed the blocking is fixed, and a row's output then depends on that row alone, wherever it sits
  in the tile: `in_row_tiles` runs every CPU linear over tiles of exactly ROW_TILE rows.
- prefill attention: SDPA's flash kernel tiles queries and keys by the chunk's lengths. Under the
  mode every query token attends through the paged decode kernel (cpu_paged.py), which sums one
  row at a time over its whole context in position order: a prompt token then gets the same
  reduction as a decode token, chunked or not (backends/torch_ref.py).

The flag is per thread and set by the runner around each step, so two engines in one process
(one invariant, one not) do not change each other's kernels.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

# Rows per matmul under the mode. 32 keeps a 512-token prefill at 16 full tiles and costs a
# batch-1 decode a 32-row product of the weight, which is bound by reading the weight either way.
ROW_TILE = 32

_state = threading.local()


def active() -> bool:
    """Whether this thread runs a batch-invariant step."""
    return getattr(_state, "on", False)


@contextmanager
def batch_invariant(on: bool) -> Iterator[None]:
    """Run the block with the mode `on` (or off) on this thread, restoring the previous value."""
    before = active()
    _state.on = on
    try:
        yield
    finally:
        _state.on = before


def in_row_tiles(x: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """fn (a row-wise product: [M, K] -> [M, N]) over x's rows in tiles of exactly ROW_TILE rows,
    the last padded with zeros (their outputs dropped), so that every call has the same shape."""
    x2 = x.reshape(-1, x.shape[-1])
    rows = x2.shape[0]
    pad = -rows % ROW_TILE
    if pad:
        x2 = torch.cat([x2, x2.new_zeros(pad, x2.shape[1])])
    x2 = x2.contiguous()
    y = torch.cat([fn(x2[i : i + ROW_TILE]) for i in range(0, rows + pad, ROW_TILE)])
    return y[:rows].view(*x.shape[:-1], y.shape[-1])
