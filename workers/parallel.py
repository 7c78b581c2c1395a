"""Tensor-parallel process-group state and collectives (no-ops at world size 1)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(slots=True)
class ParallelState:
    """Who this process is within the tensor-parallel group."""

    rank: int = 0
    world_size: int = 1
    group: dist.ProcessGroup | None = None
    # MoE layers hold whole experts per rank instead of a slice of every expert (EngineConfig's
    # expert_parallel); read by the layers when they are built, like the rank.
    expert_parallel: bool = False
    # Collectives issued through `group` so far (all_reduce, all_gather, gather): lets the decode
    # graphs log, and tests check, that a captured forward holds its collectives.
    collectives: int = 0


_state = ParallelState()


def init_tensor_parallel(
    rank: int, world_size: int, group: dist.ProcessGroup | None = None
) -> None:
    """Record this process's place in the tensor-parallel group (the group must already exist)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank: must be in [0, {world_size}), got {rank}")
    if world_size > 1 and group is None and not dist.is_initialized():
        raise ValueError("group: world_size > 1 needs an initialised torch.distributed group")
    _state.rank, _state.world_size, _state.group = rank, world_size, group


def reset_tensor_parallel() -> None:
    """Back to a single process (rank 0 of 1), experts split as in tensor parallelism."""
    init_tensor_parallel(0, 1, None)
    _state.expert_parallel = False


@contextmanager
def single_rank() -> Iterator[None]:
    """Inside: this process is rank 0 of 1, whatever its tensor-parallel group. A model built and
    run here is held whole and calls no collectives (rank 0's draft model, workers/draft.py)."""
    global _state
    saved, _state = _state, ParallelState()
    try:
        yield
    finally:
        _state = saved


def set_expert_parallel(enabled: bool) -> None:
    """Whether MoE layers built from now on split experts across ranks (True) or split each
    expert's intermediate dimension (False)."""
    _state.expert_parallel = enabled


def get_expert_parallel() -> bool:
    return _state.expert_parallel


def get_tp_rank() -> int:
    return _state.rank


def get_tp_world_size() -> int:
    return _state.world_size


def collectives_capturable() -> bool:
    """Whether the TP collectives can run inside a CUDA graph: there are none (no group), or they
    are NCCL's, which torch enqueues on the capturing stream (NCCL >= 2.9.6). gloo's run on the
    host, so a graph captured over them would replay without them."""
    group = _state.group
    return group is None or dist.get_backend(group) == "nccl"


def collectives_issued() -> int:
    """How many collectives this process has issued through the TP group."""
    return _state.collectives


def divide(numerator: int, denominator: int, field: str) -> int:
    """Exact division, or a ValueError naming the dimension that does not split."""
    if numerator % denominator:
        raise ValueError(
            f"{field}: {numerator} is not divisible by tensor_parallel_size={denominator}"
        )
    return numerator // denominator


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum over ranks, in place (no-op without a process group)."""
    if _state.group is not None:
        _state.collectives += 1
        dist.all_reduce(x, group=_state.group)
    return x


def all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's x along dim."""
    if _state.group is None:
        return x
    _state.collectives += 1
    parts = [torch.empty_like(x) for _ in range(_state.world_size)]
    dist.all_gather(parts, x.contiguous(), group=_state.group)
    return torch.cat(parts, dim=dim)


def gather(x: torch.Tensor, dim: int = -1, dst: int = 0) -> torch.Tensor | None:
    """Concatenate every rank's x along dim on rank dst; other ranks get None."""
    if _state.group is None:
        return x
    _state.collectives += 1
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(_state.world_size)] if _state.rank == dst else None
    dst_global = dist.get_global_rank(_state.group, dst) if _state.group is not None else dst
    dist.gather(x, parts, dst=dst_global, group=_state.group)
    return torch.cat(parts, dim=dim) if parts is not None else None
