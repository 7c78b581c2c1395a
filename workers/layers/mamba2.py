"""Mamba-2 (the SSD layer of Granite-4 hybrid) over a flattened batch, with per-request state.

Each head h keeps a state S [head_dim, state_size] per request. A token with input x [head_dim],
step dt > 0 (softplus of its projection plus `dt_bias`), and B, C [state_size] (shared by the
heads of a group) does

    S <- exp(dt A_h) S + dt x B^T;   y = S C + D_h x

Decode rows run that recurrence over a batch of state slots; a prefill chunk runs the chunked SSD
form (`mamba_chunk_size` tokens at a time: the intra-chunk part as masked attention-like sums, the
inter-chunk part as a scan over chunk states) from its request's state. Before it, x, B and C pass
the causal depthwise conv (with bias) shared with the DeltaNet (workers/layers/gated_delta.py),
whose last `kernel - 1` inputs are the other half of the state. The output is gated by silu(z) and
RMS-normed per group, then projected out.

Under tensor parallelism a rank holds whole heads (their z, x and dt rows of in_proj, conv channels,
A, D and dt_bias, norm weights and out_proj columns) and the groups those heads read: G / tp whole
groups, or, when tp ranks split one group's heads (Granite-4.0-H has a single group), that group's
B and C replicated, as vLLM and SGLang do. The gated norm keeps the checkpoint's group size: a
group split across ranks adds up its sum of squares over them (one all-reduce per layer). Each
request's conv and SSM state is then this rank's channels and heads only.

The arithmetic follows transformers' torch fallbacks (`mamba2_chunk_scan`,
`mamba2_selective_state_update`) in float32, so that greedy tokens match
(tests/workers/test_granite_hybrid.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from workers.layers.attention import AttentionMetadata
from workers.layers.gated_delta import (
    ConvWeight,
    DeltaStateView,
    conv_decode,
    conv_prefill,
    head_shard_loader,
)
from workers.layers.linear import RowParallelLinear
from workers.layers.param_attrs import set_param_attr
from workers.layers.pieces import Piece, PieceColumnLinear
from workers.parallel import all_reduce, divide, get_tp_rank, get_tp_world_size


@dataclass(frozen=True, slots=True)
class MambaDims:
    """One Mamba-2 layer's sizes, from the HF config's `mamba_*` fields."""

    hidden_size: int
    num_heads: int
    head_dim: int
    num_groups: int
    state_size: int
    conv_kernel: int
    chunk_size: int
    eps: float
    conv_bias: bool
    proj_bias: bool
    dt_limit: tuple[float, float] = (0.0, math.inf)

    def __post_init__(self) -> None:
        for name in ("num_heads", "head_dim", "num_groups", "state_size", "chunk_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 1 << 16:
                raise ValueError(f"mamba_{name}: must be an integer in [1, 65536], got {value!r}")
        k = self.conv_kernel
        if not isinstance(k, int) or isinstance(k, bool) or not 2 <= k <= 64:
            raise ValueError(f"mamba_d_conv: must be an integer in [2, 64], got {k!r}")
        if self.num_heads % self.num_groups:
            raise ValueError(
                f"mamba_n_groups: {self.num_groups} does not divide mamba_n_heads {self.num_heads}"
            )

    @property
    def intermediate(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the conv: x, B and C side by side."""
        return self.intermediate + 2 * self.num_groups * self.state_size

    def per_rank(self, tp: int, rank: int) -> tuple[MambaDims, int]:
        """One tensor-parallel rank's share and the index of its first group: whole heads, and
        G / tp whole groups, or the one group its heads read when tp ranks split a group."""
        heads = divide(self.num_heads, tp, "mamba_n_heads")
        if self.num_groups % tp == 0:
            groups = self.num_groups // tp
            return replace(self, num_heads=heads, num_groups=groups), rank * groups
        if tp % self.num_groups:  # a rank's heads would span parts of two groups
            raise ValueError(
                f"tensor_parallel_size: {tp} ranks cannot split mamba_n_groups "
                f"{self.num_groups} (one must divide the other)"
            )
        return replace(self, num_heads=heads, num_groups=1), rank // (tp // self.num_groups)


def ssd_step(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    d: torch.Tensor,
    state: torch.Tensor,
) -> torch.Tensor:
    """One token per row: x [B, H, P], dt [B, H] (discretised), a, d [H], b, c [B, G, N] (a
    group's heads are consecutive), state [B, H, P, N] float32, contiguous, updated in place.
    Returns y [B, H, P] float32.

    The heads of a group share B and C, so each row and group is one [R P, N] block of the state:
    the outer-product add is one batched rank-1 update into it and the read-out one matrix-vector
    product, with no B or C repeated per head and no temporary of the state's size."""
    rows, heads, p, n = state.shape
    groups = b.shape[1]
    blocks = state.view(rows * groups, heads // groups * p, n)
    x, dt = x.float(), dt.float()
    state.mul_(torch.exp(dt * a.float())[..., None, None])
    xdt = (x * dt[..., None]).reshape(rows * groups, -1, 1)
    blocks.baddbmm_(xdt, b.float().reshape(rows * groups, 1, n))
    # y^T = C^T S^T: the same products as S C (summed in another order: float32 rounding), but
    # the batched matrix-vector product over this layout ran ~6x slower on one CPU thread.
    y = torch.bmm(c.float().reshape(rows * groups, 1, n), blocks.transpose(1, 2))
    y = y.view(rows, heads, p)
    return y + d.float()[:, None] * x


def segment_sum(x: torch.Tensor) -> torch.Tensor:
    """[..., T] -> [..., T, T]: entry (i, j) sums x over (j, i] for j <= i, -inf above the
    diagonal (transformers' stable form: cumsum of a masked copy)."""
    t = x.shape[-1]
    x = x[..., None].expand(*x.shape, t)
    below = torch.tril(torch.ones(t, t, dtype=torch.bool, device=x.device), diagonal=-1)
    sums = torch.cumsum(x.masked_fill(~below, 0), dim=-2)
    upto = torch.tril(torch.ones(t, t, dtype=torch.bool, device=x.device), diagonal=0)
    return sums.masked_fill(~upto, -torch.inf)


def ssd_chunked(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    d: torch.Tensor,
    state: torch.Tensor,
    chunk: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A sequence from `state`: x [L, H, P], dt [L, H] (discretised), a, d [H], b, c [L, H, N],
    state [H, P, N] float32. Returns (y [L, H, P] float32, the state after the last token)."""
    length = x.shape[0]
    x, b, c = x.float(), b.float(), c.float()
    skip = d.float()[:, None] * x
    chunk = min(chunk, length)
    pad = (chunk - length % chunk) % chunk
    x = F.pad(x * dt.float()[..., None], (0, 0, 0, 0, 0, pad))
    adt = F.pad(a.float() * dt.float(), (0, 0, 0, pad))
    b, c = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (b, c))
    x, b, c = (t.reshape(-1, chunk, *t.shape[1:]) for t in (x, b, c))  # [chunks, l, H, .]
    adt = adt.reshape(-1, chunk, adt.shape[-1]).permute(2, 0, 1)  # [H, chunks, l]
    cum = torch.cumsum(adt, dim=-1)
    # Within each chunk: masked scores C_l . B_s, decayed from s to l.
    scores = torch.einsum("clhn,cshn->clsh", c, b) * torch.exp(segment_sum(adt)).permute(1, 2, 3, 0)
    y_diag = torch.einsum("clsh,cshp->clhp", scores, x)
    # Each chunk's own contribution to the state at its end, then the scan over chunks.
    b_decay = b * torch.exp(cum[..., -1:] - cum).permute(1, 2, 0)[..., None]
    states = torch.cat([state[None], torch.einsum("clhn,clhp->chpn", b_decay, x)])
    decay_chunk = torch.exp(segment_sum(F.pad(cum[..., -1], (1, 0))))  # [H, to, from]
    states = torch.einsum("hij,jhpn->ihpn", decay_chunk, states)
    starts, final = states[:-1], states[-1]
    y_off = torch.einsum("clhn,chpn->clhp", c, starts) * torch.exp(cum).permute(1, 2, 0)[..., None]
    y = (y_diag + y_off).reshape(-1, *y_diag.shape[2:])[:length]
    return y + skip, final


class GroupRMSNormGated(nn.Module):
    """y * silu(gate), RMS-normed within groups of `group_size` channels, times the weight.

    A rank holds `dim` channels: whole groups, or part of one (`group`, of `groups` in all), whose
    sum of squares the ranks sharing it add up: each rank's partial sum goes in its group's
    column of a [T, groups] tensor, which one all-reduce completes."""

    def __init__(
        self, dim: int, group_size: int, eps: float, group: int = 0, groups: int = 1
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.group_size, self.eps, self.group, self.groups = group_size, eps, group, groups

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        y = x.float() * F.silu(gate.float())
        if self.group_size <= y.shape[-1]:
            g = y.view(*y.shape[:-1], -1, self.group_size)
            g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
            return self.weight * g.view(y.shape).to(dtype)
        sums = y.new_zeros(y.shape[0], self.groups)
        sums[:, self.group] = y.pow(2).sum(-1)
        variance = all_reduce(sums)[:, self.group, None] / self.group_size
        return self.weight * (y * torch.rsqrt(variance + self.eps)).to(dtype)


class Mamba2Mixer(nn.Module):
    """Granite-4 hybrid's Mamba-2 token mixer (the checkpoint's `mamba.*`). `state` is bound by the
    runner's state feature (workers/linear_state.py) before each forward. Under tensor parallelism
    the in_proj rows (z, x, B, C and dt side by side in the checkpoint) and the conv channels (x,
    B, C) are cut piece by piece to this rank's heads and groups (the module docstring)."""

    def __init__(self, full: MambaDims) -> None:
        super().__init__()
        tp, rank = get_tp_world_size(), get_tp_rank()
        m, first_group = full.per_rank(tp, rank)  # every size below is this rank's
        self.m = m
        heads = Piece(full.intermediate, rank * m.intermediate, m.intermediate)
        gn = m.num_groups * m.state_size
        bc = Piece(full.num_groups * full.state_size, first_group * m.state_size, gn)
        dt = Piece(full.num_heads, rank * m.num_heads, m.num_heads)
        self.in_proj = PieceColumnLinear(m.hidden_size, [heads, heads, bc, bc, dt], m.proj_bias)
        self.conv1d = ConvWeight([heads, bc, bc], m.conv_kernel, m.conv_bias)
        self.dt_bias = nn.Parameter(torch.ones(m.num_heads), requires_grad=False)
        self.A_log = nn.Parameter(torch.zeros(m.num_heads), requires_grad=False)
        self.D = nn.Parameter(torch.ones(m.num_heads), requires_grad=False)
        group_size = full.intermediate // full.num_groups
        self.norm = GroupRMSNormGated(
            m.intermediate, group_size, m.eps, first_group, full.num_groups
        )
        for vector in (self.dt_bias, self.A_log, self.D, self.norm.weight):
            set_param_attr(vector, "weight_loader", head_shard_loader(rank))
        self.out_proj = RowParallelLinear(full.intermediate, m.hidden_size, m.proj_bias)
        self.state: DeltaStateView | None = None

    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """One request's (conv state, SSM state) shapes on this rank."""
        m = self.m
        return (m.conv_dim, m.conv_kernel - 1), (m.num_heads, m.head_dim, m.state_size)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        if self.state is None:
            raise RuntimeError("Mamba2Mixer: no state bound (workers/linear_state.py)")
        m = self.m
        gate, xbc, dt = self.in_proj(x).split([m.intermediate, m.conv_dim, m.num_heads], dim=-1)
        dt = F.softplus(dt + self.dt_bias)
        y = torch.empty(x.shape[0], m.num_heads, m.head_dim, dtype=torch.float32, device=x.device)
        nd = meta.num_decodes
        if nd:
            y[:nd] = self._decode(xbc[:nd], dt[:nd], self.state.slots[:nd])

        def run(lo: int, hi: int, slot: int) -> None:
            y[lo:hi] = self._prefill(xbc[lo:hi], dt[lo:hi], slot)

        self.state.run_rows(meta, run)
        out = self.norm(y.reshape(x.shape[0], -1).to(x.dtype), gate)
        return self.out_proj(out)

    def _split(self, xbc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The conv's output as x [T, H, P] and B, C repeated to the heads [T, H, N]."""
        m, t = self.m, xbc.shape[0]
        gn = m.num_groups * m.state_size
        xs, b, c = xbc.split([m.intermediate, gn, gn], dim=-1)
        r = m.num_heads // m.num_groups
        b, c = (v.reshape(t, m.num_groups, m.state_size).repeat_interleave(r, 1) for v in (b, c))
        return xs.reshape(t, m.num_heads, m.head_dim), b, c

    def _decode(self, xbc: torch.Tensor, dt: torch.Tensor, slots: list[int]) -> torch.Tensor:
        state = self.state
        assert state is not None
        m, rows = self.m, state.decode_rows(len(slots))
        taps = self.conv1d
        xbc, conv = conv_decode(xbc, rows.conv, taps.weight[:, 0], taps.bias)
        rows.conv.copy_(conv)
        gn = m.num_groups * m.state_size
        xs, b, c = xbc.split([m.intermediate, gn, gn], dim=-1)
        b, c = (v.reshape(-1, m.num_groups, m.state_size) for v in (b, c))
        xs = xs.reshape(-1, m.num_heads, m.head_dim)
        a = -torch.exp(self.A_log.float())
        y = ssd_step(xs, dt, a, b, c, self.D, rows.recurrent)  # in place
        state.write_back(rows)
        return y

    def _prefill(self, xbc: torch.Tensor, dt: torch.Tensor, slot: int) -> torch.Tensor:
        state = self.state
        assert state is not None
        taps = self.conv1d
        xbc, state.conv[slot] = conv_prefill(xbc, state.conv[slot], taps.weight[:, 0], taps.bias)
        xs, b, c = self._split(xbc)
        lo, hi = self.m.dt_limit
        dt = dt.clamp(min=lo, max=hi)  # the chunked path clamps, as transformers' does
        a = -torch.exp(self.A_log.float())
        y, state.recurrent[slot] = ssd_chunked(
            xs, dt, a, b, c, self.D, state.recurrent[slot], self.m.chunk_size
        )
        return y
