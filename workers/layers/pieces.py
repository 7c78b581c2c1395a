"""Checkpoint tensors whose rows are several pieces side by side (a Mamba-2 in_proj's z, x, B, C
and dt; a conv's x, B and C channels; Granite's fused gate and up), cut per tensor-parallel rank
piece by piece: a contiguous cut of the whole tensor would hand one rank all of z and another all
of dt. A rank's part of a piece is usually its 1/tp share, but may be a replicated one (every rank
of a Mamba-2 layer with one group keeps that group's B and C whole)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from workers.layers.linear import ColumnParallelLinear, _copy
from workers.layers.quantized import load_target
from workers.parallel import divide, get_tp_world_size


@dataclass(frozen=True, slots=True)
class Piece:
    """One piece of a checkpoint tensor's rows: `size` rows in the checkpoint, of which this rank
    keeps `length` from `start`."""

    size: int
    start: int
    length: int

    def __post_init__(self) -> None:
        if not 0 <= self.start <= self.start + self.length <= self.size:
            raise ValueError(f"piece: rows [{self.start}, +{self.length}) outside {self.size}")


def shares(sizes: list[int], rank: int, tp: int, field: str = "output_size") -> list[Piece]:
    """Each piece cut into tp equal contiguous shares: rank's. A size tp does not divide is a
    ValueError naming `field` and tensor_parallel_size."""
    return [Piece(n, rank * (n // tp), divide(n, tp, field)) for n in sizes]


def copy_pieces(param: torch.Tensor, loaded: torch.Tensor, pieces: list[Piece], name: str) -> None:
    """This rank's rows of each piece of `loaded` (along dim 0) into param's rows, in order."""
    size = sum(p.size for p in pieces)
    if loaded.shape[0] != size:
        raise ValueError(f"{name}: checkpoint tensor has {loaded.shape[0]} rows, expected {size}")
    target = load_target(param, loaded)
    src = dst = 0
    for p in pieces:
        _copy(target.narrow(0, dst, p.length), loaded.narrow(0, src + p.start, p.length), name)
        src, dst = src + p.size, dst + p.length


class PieceColumnLinear(ColumnParallelLinear):
    """A column-parallel linear whose output rows are `pieces` side by side in one checkpoint
    tensor (weight and bias alike): each rank holds its part of every piece."""

    def __init__(self, input_size: int, pieces: list[Piece], bias: bool = False) -> None:
        super().__init__(input_size, get_tp_world_size() * sum(p.length for p in pieces), bias)
        self.pieces = pieces

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | str | None = None
    ) -> None:
        copy_pieces(param, loaded, self.pieces, "PieceColumnLinear")
