"""Mixture-of-experts feed-forward: a router picks top-k experts per token, each a SwiGLU MLP.

One interface for every family (`MoEConfig` says how routing works; `FusedMoE` holds the experts)
and two ways to split the experts over a tensor-parallel group of n ranks:

- tensor-parallel (default): every rank holds a 1/n slice of every expert's intermediate dimension;
- expert-parallel (`expert_parallel: true`): every rank holds whole experts, a contiguous range of
  about num_experts / n of them (uneven counts are allowed).

Either way the router is replicated, so every rank sees every token and the same routing: dispatch
needs no communication, each rank computes its own share of each token's output, and one all-reduce
sums the shares (the same all-reduce a row-parallel MLP ends with).

The expert computation is grouped: the (token, slot) pairs are sorted by expert once, then each
local expert runs one GEMM pair over its contiguous rows. Python loops over experts, never over
tokens. On CPU each expert's matrices are packed for oneDNN once after loading, as the dense linears
are (workers/layers/linear.py); an expert with at most SMALL_ROWS float32 rows (a decode step's
few) runs the small-row kernel instead (workers/layers/backends/cpu_gemm.py: it streams the weight
as stored once for all the rows, where oneDNN read it at about half that speed). On CUDA with
Triton, plain SwiGLU experts without biases run as the fused-MoE kernel instead
(workers/layers/backends/triton_moe.py: two grouped GEMM launches over blocks of pairs sorted by
expert); everything else keeps the torch path.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from torch import nn

from workers.layers import fused, invariant
from workers.layers.activation import ClampedSwiGLU, SiluAndMul
from workers.layers.backends import cpu_gemm
from workers.layers.linear import CpuPackedWeight, cpu_pack, linear
from workers.parallel import all_reduce, divide, get_expert_parallel, get_tp_rank, get_tp_world_size

ACTIVATIONS = ("silu", "clamped_swiglu")
SCORING = ("softmax", "topk_softmax")
# Most rows an expert runs through the small-row CPU kernel; more go to oneDNN's packed GEMM. One
# thread, DeepSeek's expert shapes (bench/moe_step.py --crossover): the kernel takes 0.6-0.85x
# oneDNN's time up to 10 rows, 0.9-0.98x at 11-24, 1.0x from 28. 0 turns the kernel off.
SMALL_ROWS = 24


@dataclass(frozen=True, slots=True)
class MoEConfig:
    """How a family routes tokens to experts.

    scoring "softmax": softmax over all experts, then top-k (Mixtral, Qwen MoE); "topk_softmax":
    top-k of the logits, then softmax over those k. renormalize scales the k weights to sum to 1.
    activation "clamped_swiglu" is gpt-oss's (swiglu_alpha, swiglu_limit); bias: every expert
    matrix has a bias (gpt-oss).
    """

    num_experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int  # per expert
    renormalize: bool
    activation: str = "silu"
    scoring: str = "softmax"
    bias: bool = False
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0

    def __post_init__(self) -> None:
        if self.num_experts < 1:
            raise ValueError(f"num_experts: must be at least 1, got {self.num_experts}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok: must be in [1, num_experts={self.num_experts}], "
                f"got {self.top_k}"
            )
        if self.intermediate_size < 1:
            raise ValueError(
                f"moe_intermediate_size: must be at least 1, got {self.intermediate_size}"
            )
        if self.activation not in ACTIVATIONS:
            raise ValueError(
                f"hidden_act: {self.activation!r} is not supported for experts "
                f"(supported: {list(ACTIVATIONS)})"
            )
        if self.activation == "clamped_swiglu":
            for name in ("swiglu_alpha", "swiglu_limit"):
                value = getattr(self, name)
                if not (isinstance(value, int | float) and 0 < value < float("inf")):
                    raise ValueError(f"{name}: must be a positive number, got {value!r}")
        if self.scoring not in SCORING:
            raise ValueError(f"scoring: must be one of {list(SCORING)}, got {self.scoring!r}")


def route(logits: torch.Tensor, cfg: MoEConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token, the k chosen experts and their weights (float32): ([T, k] weights, [T, k] ids)."""
    if cfg.scoring == "softmax":
        weights, ids = logits.float().softmax(-1).topk(cfg.top_k, dim=-1)
    else:
        top, ids = logits.float().topk(cfg.top_k, dim=-1)
        weights = top.softmax(-1)
    if cfg.renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights, ids


def expert_range(num_experts: int, rank: int, world: int) -> tuple[int, int]:
    """[first, end) of the experts rank holds under expert parallelism: contiguous, sizes differ by
    at most one."""
    return rank * num_experts // world, (rank + 1) * num_experts // world


def expert_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: torch.Tensor | None
) -> torch.Tensor:
    """x @ weight^T + bias for one expert's rows: the small-row kernel for a few float32 CPU rows,
    else `linear` (through oneDNN's packed copy where there is one). Under batch invariance every
    row count keeps `linear`, whose row tiles fix the summation order."""
    small = x.shape[0] <= SMALL_ROWS and x.is_cpu and x.dtype == weight.dtype == torch.float32
    if small and not invariant.active() and cpu_gemm.available():
        return cpu_gemm.small_linear(x, weight, bias)
    return linear(x, weight, bias, packed=packed)


class ReplicatedLinear(CpuPackedWeight):
    """y = x W^T, the whole matrix on every rank (routers and gates: small, and every rank needs
    every output)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, packed=self.packed)


class FusedMoE(CpuPackedWeight):
    """The experts of one layer: w13 [E_local, 2 * I_local, H] (gate rows, then up rows) and
    w2 [E_local, H, I_local]; forward(x, router_logits) returns the routed sum, all-reduced.

    As a CpuPackedWeight it is packed by pack_cpu_weights: every local expert's two matrices."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_world_size()
        self.expert_parallel = get_expert_parallel() and self.tp_size > 1
        if self.expert_parallel:
            if cfg.num_experts < self.tp_size:
                raise ValueError(
                    f"num_experts: {cfg.num_experts} experts cannot give each of "
                    f"tensor_parallel_size={self.tp_size} expert-parallel ranks one"
                )
            self.first, end = expert_range(cfg.num_experts, self.tp_rank, self.tp_size)
            self.inter = cfg.intermediate_size
        else:
            self.first, end = 0, cfg.num_experts
            self.inter = divide(cfg.intermediate_size, self.tp_size, "moe_intermediate_size")
        self.num_local = end - self.first
        h = cfg.hidden_size
        self.w13 = nn.Parameter(torch.empty(self.num_local, 2 * self.inter, h), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(self.num_local, h, self.inter), requires_grad=False)
        self.w13_bias: nn.Parameter | None = None
        self.w2_bias: nn.Parameter | None = None
        if cfg.bias:
            self.w13_bias = nn.Parameter(
                torch.empty(self.num_local, 2 * self.inter), requires_grad=False
            )
            self.w2_bias = nn.Parameter(torch.empty(self.num_local, h), requires_grad=False)
        # The all-reduce sums every rank's share: under tensor parallelism one rank adds the down
        # bias; under expert parallelism the expert's owner does.
        self.adds_down_bias = self.expert_parallel or self.tp_rank == 0
        self.act: nn.Module = (
            ClampedSwiGLU(cfg.swiglu_alpha, cfg.swiglu_limit)
            if cfg.activation == "clamped_swiglu"
            else SiluAndMul()
        )
        # The Triton kernel computes silu(gate) * up with no biases (not gpt-oss's experts).
        self.fits_triton = cfg.activation == "silu" and not cfg.bias
        self.packed13: list[torch.Tensor | None] = [None] * self.num_local
        self.packed2: list[torch.Tensor | None] = [None] * self.num_local
        # Rows (token, expert pairs) each rank of the group computed in the last forward.
        self.rows_per_rank: list[int] = [0] * self.tp_size

    def pack_weight(self) -> bool:
        self.packed13 = [cpu_pack(w) for w in self.w13]
        self.packed2 = [cpu_pack(w) for w in self.w2]
        return all(p is not None for p in self.packed13 + self.packed2)

    def load_expert(self, expert: int, part: str, tensor: torch.Tensor) -> bool:
        """Copy one checkpoint matrix of one expert ("gate" or "up" [I, H], "down" [H, I]) into
        this rank's share; False if this rank does not hold the expert."""
        local = expert - self.first
        if not 0 <= expert < self.cfg.num_experts:
            raise ValueError(f"weights: expert {expert} >= num_experts={self.cfg.num_experts}")
        if not 0 <= local < self.num_local:
            return False
        shard = 0 if self.expert_parallel else self.tp_rank
        if part == "down":
            self._copy(self.w2[local], tensor.narrow(1, shard * self.inter, self.inter), part)
        elif part in ("gate", "up"):
            rows = self.w13[local].narrow(0, 0 if part == "gate" else self.inter, self.inter)
            self._copy(rows, tensor.narrow(0, shard * self.inter, self.inter), part)
        elif part == "down_bias" and self.w2_bias is not None:
            self._copy(self.w2_bias[local], tensor, part)
        elif part in ("gate_bias", "up_bias") and self.w13_bias is not None:
            rows = self.w13_bias[local].narrow(
                0, 0 if part == "gate_bias" else self.inter, self.inter
            )
            self._copy(rows, tensor.narrow(0, shard * self.inter, self.inter), part)
        else:
            raise ValueError(
                f"part: must be 'gate', 'up' or 'down' (or their '_bias' with bias), got {part!r}"
            )
        return True

    def load_fused(self, name: str, tensor: torch.Tensor) -> None:
        """Every expert at once from a 3-D checkpoint tensor: gate_up_proj [E, 2I, H] (gate rows,
        then up rows) or down_proj [E, H, I]."""
        if tensor.shape[0] != self.cfg.num_experts:
            raise ValueError(
                f"{name}: has {tensor.shape[0]} experts, num_experts={self.cfg.num_experts}"
            )
        full = self.cfg.intermediate_size
        mine = tensor.narrow(0, self.first, self.num_local)
        for local in range(self.num_local):
            if name.endswith("down_proj"):
                self.load_expert(self.first + local, "down", mine[local])
            else:
                self.load_expert(self.first + local, "gate", mine[local].narrow(0, 0, full))
                self.load_expert(self.first + local, "up", mine[local].narrow(0, full, full))

    @staticmethod
    def _copy(param: torch.Tensor, loaded: torch.Tensor, part: str) -> None:
        if param.shape != loaded.shape:
            raise ValueError(
                f"experts.{part}: checkpoint shard has shape {tuple(loaded.shape)}, "
                f"expected {tuple(param.shape)}"
            )
        param.copy_(loaded)

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        weights, ids = route(router_logits, self.cfg)
        return all_reduce(self.experts(x, weights, ids))

    def experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """This rank's share of sum_j weights[t, j] * expert_{ids[t, j]}(x[t]), without the
        all-reduce.

        Pairs are sorted by expert (stably, so a token's rows keep their order), every local
        expert runs over its contiguous rows, and each token's k results are summed in slot order
        (the same order whatever the batch)."""
        kernel = fused.triton_moe(x) if self.fits_triton else None
        if kernel is not None:
            self._count_kernel_rows(ids)
            return kernel.fused_experts(x, self.w13, self.w2, weights, ids, first=self.first)
        t, k = ids.shape
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.cfg.num_experts).tolist()  # one host sync
        self._count_rows(counts)
        starts = [0, *itertools.accumulate(counts)]
        lo, hi = starts[self.first], starts[self.first + self.num_local]
        mine = order[lo:hi]
        xs = x.index_select(0, mine // k)
        # Every pair is written below when this rank holds every expert; else others' stay zero.
        out = x.new_empty(t * k, x.shape[1]) if hi - lo == t * k else x.new_zeros(t * k, x.shape[1])
        parts = []  # each expert's rows, in order: one cat rather than a copy per expert
        for local in range(self.num_local):
            s, e = starts[self.first + local] - lo, starts[self.first + local + 1] - lo
            if s == e:
                continue
            b13 = None if self.w13_bias is None else self.w13_bias[local]
            b2 = None if self.w2_bias is None or not self.adds_down_bias else self.w2_bias[local]
            h = self.act(expert_linear(xs[s:e], self.w13[local], b13, self.packed13[local]))
            parts.append(expert_linear(h, self.w2[local], b2, self.packed2[local]))
        ys = torch.cat(parts) if parts else xs  # xs: no rows here
        scale = weights.reshape(-1).index_select(0, mine).to(x.dtype)
        out.index_copy_(0, mine, ys.mul_(scale[:, None]))
        return out.view(t, k, -1).sum(1)

    def _count_kernel_rows(self, ids: torch.Tensor) -> None:
        """rows_per_rank without the torch path's counts: under tensor parallelism every rank
        computes every pair (no host sync); under expert parallelism one sync counts them."""
        if not self.expert_parallel:
            self.rows_per_rank = [ids.numel()] * self.tp_size
            return
        self._count_rows(torch.bincount(ids.reshape(-1), minlength=self.cfg.num_experts).tolist())

    def _count_rows(self, counts: list[int]) -> None:
        if not self.expert_parallel:
            self.rows_per_rank = [sum(counts)] * self.tp_size
            return
        e = self.cfg.num_experts
        self.rows_per_rank = [
            sum(counts[slice(*expert_range(e, r, self.tp_size))]) for r in range(self.tp_size)
        ]
