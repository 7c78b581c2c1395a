"""The gated delta rule (Gated DeltaNet, Qwen3-Next's linear attention) over a flattened batch.

Each value head keeps a state S [k_dim, v_dim] per request instead of a growing KV cache. A token
with l2-normalised key k, value v, query q, decay g <= 0 and write strength beta in (0, 1) does

    S <- exp(g) S;   S <- S + k (beta (v - S^T k))^T;   o = S^T q / sqrt(k_dim)

(the delta rule: only the part of v the state does not already predict is written). Decode rows
run that recurrence over a batch of state slots; a prefill chunk runs the chunked form (the same
recurrence as a few matmuls per 64 tokens, the UT transform of the DeltaNet paper) from its
request's state, so a prompt cut into chunks ends in the state the whole prompt would have left.
Before the rule, q, k and v pass a short causal depthwise conv (`linear_conv_kernel_dim` taps, SiLU)
whose last `kernel - 1` inputs are the other half of a request's state.

The arithmetic follows transformers' torch fallbacks (`torch_chunk_gated_delta_rule`,
`torch_recurrent_gated_delta_rule`, `causal_conv1d_fn`), in float32 as they are, so that greedy
tokens match (tests/workers/test_gated_delta.py compares them tensor by tensor).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F
from torch import nn

from workers.layers.attention import AttentionMetadata
from workers.layers.linear import ColumnParallelLinear, RowParallelLinear
from workers.layers.param_attrs import set_param_attr
from workers.layers.pieces import Piece, copy_pieces, shares
from workers.layers.quantized import as_float
from workers.parallel import divide, get_tp_rank, get_tp_world_size

CHUNK = 64  # tokens per chunk of the chunked form (transformers' default)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / |x| over the last dim (as the FLA kernels and transformers compute it)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _prepare(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries and keys as the rule reads them: float32, l2-normalised, queries scaled."""
    q, k = l2norm(q.float()), l2norm(k.float())
    return q * q.shape[-1] ** -0.5, k


def recurrent_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row: q, k [B, H, Dk], v [B, H, Dv], g, beta [B, H], state [B, H, Dk, Dv]
    (float32), updated in place (the caller's gathered copy). Returns (out [B, H, Dv] float32,
    the state)."""
    q, k = _prepare(q, k)
    state.mul_(g.float().exp()[..., None, None])
    predicted = (k[..., None, :] @ state).squeeze(-2)  # S^T k
    delta = (v.float() - predicted) * beta.float()[..., None]
    state.add_(k[..., None] * delta[..., None, :])
    return (q[..., None, :] @ state).squeeze(-2), state


def chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A sequence from `state`: q, k [H, L, Dk], v [H, L, Dv], g, beta [H, L], state [H, Dk, Dv]
    (float32). Returns (out [H, L, Dv] float32, the state after the last token)."""
    q, k = _prepare(q, k)
    v, g, beta = v.float(), g.float(), beta.float()
    length = q.shape[1]
    chunk = min(chunk, length)  # a short prefill chunk solves no padded 64 x 64 system
    pad = (chunk - length % chunk) % chunk
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    # [H, chunks, chunk, D]: padded positions have g = beta = 0, so they change nothing.
    q, k, v = (x.reshape(x.shape[0], -1, chunk, x.shape[-1]) for x in (q, k, v))
    g, beta = g.reshape(g.shape[0], -1, chunk), beta.reshape(beta.shape[0], -1, chunk)
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    decay = g.cumsum(dim=-1)  # log of the decay from the chunk's start to each position
    future = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    pairwise = (decay[..., :, None] - decay[..., None, :]).masked_fill(future, float("-inf")).exp()
    # The UT transform: the chunk's delta updates as one unit-lower-triangular solve.
    system = (k_beta @ k.transpose(-1, -2)) * pairwise
    rhs = torch.cat([v_beta, k_beta * decay.exp()[..., None]], dim=-1)  # one solve for both
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    values, k_decayed = solved.split([v.shape[-1], k.shape[-1]], dim=-1)
    inner = (q @ k.transpose(-1, -2)) * pairwise
    q = q * decay.exp()[..., None]
    k = k * (decay[..., -1:] - decay).exp()[..., None]
    chunk_decay = decay[..., -1].exp()[..., None, None]
    out = torch.empty_like(v)
    for i in range(q.shape[1]):  # the sequential scan over chunks
        fresh = values[:, i] - k_decayed[:, i] @ state
        out[:, i] = q[:, i] @ state + inner[:, i] @ fresh
        state = state * chunk_decay[:, i] + k[:, i].transpose(-1, -2) @ fresh
    return out.reshape(out.shape[0], -1, out.shape[-1])[:, :length], state


def conv_prefill(
    x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The causal depthwise conv over one request's chunk: x [L, C], state [C, K - 1] (its last
    inputs before the chunk), weight [C, K], bias [C] or None. Returns (silu(conv) [L, C], the new
    state)."""
    width = weight.shape[1] - 1
    window = torch.cat([state.to(x.dtype), x.t()], dim=1)  # [C, K - 1 + L]
    y = F.conv1d(window[None], weight[:, None, :], bias, groups=weight.shape[0])[0]
    return F.silu(y).t(), window[:, window.shape[1] - width :]


def conv_decode(
    x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row: x [B, C], state [B, C, K - 1], weight [C, K], bias [C] or None.
    Returns (silu(conv) [B, C], the new state)."""
    window = torch.cat([state.to(x.dtype), x[..., None]], dim=-1)  # [B, C, K]
    y = (window * weight).sum(dim=-1)
    return F.silu(y if bias is None else y + bias), window[..., 1:]


class GatedRMSNorm(nn.Module):
    """RMSNorm over each head's output, then times silu(gate) (the output gate z)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        y = x.float()
        y = self.weight * (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)).to(dtype)
        return (y * F.silu(gate.float())).to(dtype)


@dataclass(frozen=True, slots=True)
class DeltaDims:
    """One gated DeltaNet layer's sizes, from the HF config's `linear_*` fields."""

    hidden_size: int
    num_k_heads: int
    num_v_heads: int
    k_dim: int
    v_dim: int
    conv_kernel: int
    eps: float

    def __post_init__(self) -> None:
        for name in ("num_k_heads", "num_v_heads", "k_dim", "v_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 1 << 16:
                raise ValueError(f"linear_{name}: must be an integer in [1, 65536], got {value!r}")
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(
                f"linear_num_value_heads: {self.num_v_heads} is not a multiple of "
                f"linear_num_key_heads {self.num_k_heads}"
            )
        k = self.conv_kernel
        if not isinstance(k, int) or isinstance(k, bool) or not 2 <= k <= 64:
            raise ValueError(f"linear_conv_kernel_dim: must be an integer in [2, 64], got {k!r}")

    @property
    def key_size(self) -> int:
        return self.num_k_heads * self.k_dim

    @property
    def value_size(self) -> int:
        return self.num_v_heads * self.v_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the conv: q, k and v side by side."""
        return 2 * self.key_size + self.value_size

    @property
    def group(self) -> int:
        """Value heads per key head."""
        return self.num_v_heads // self.num_k_heads

    def per_rank(self, tp_size: int) -> DeltaDims:
        """One tensor-parallel rank's share: whole key heads, with their value heads."""
        heads = divide(self.num_k_heads, tp_size, "linear_num_key_heads")
        return replace(self, num_k_heads=heads, num_v_heads=heads * self.group)


class ConvWeight(nn.Module):
    """The depthwise conv's taps [C, 1, K] (and bias), named as the checkpoint's `conv1d`: a rank
    keeps its heads' channels of each input the checkpoint lays side by side (q, k and v here;
    Mamba-2's x, B and C), `pieces` (workers/layers/pieces.py)."""

    def __init__(self, pieces: list[Piece], kernel: int, bias: bool = False) -> None:
        super().__init__()
        channels = sum(p.length for p in pieces)
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(channels), requires_grad=False) if bias else None
        self.pieces = pieces
        for param in (self.weight, self.bias):
            if param is not None:
                set_param_attr(param, "weight_loader", self.load)

    def load(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        copy_pieces(param, as_float(loaded), self.pieces, "conv1d")


def head_shard_loader(rank: int) -> Callable[..., None]:
    """A loader for a vector cut by head (A_log, dt_bias; Mamba-2's D and norm weight): this
    rank's heads."""

    def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        n = param.shape[0]
        _copy_exact(param, as_float(loaded).narrow(0, rank * n, n), "per-head vector")

    return load


def _copy_exact(param: nn.Parameter, value: torch.Tensor, name: str) -> None:
    if param.shape != value.shape:
        raise ValueError(
            f"{name}: checkpoint shard has shape {tuple(value.shape)}, "
            f"expected {tuple(param.shape)}"
        )
    param.data.copy_(value)


@dataclass(frozen=True, slots=True)
class SlotRows:
    """Some batch rows' state: conv [B, C, K - 1] and recurrent [B, ...], and the slot index they
    were gathered from (None when they are views of the store)."""

    conv: torch.Tensor
    recurrent: torch.Tensor
    index: torch.Tensor | None


@dataclass(slots=True)
class DeltaStateView:
    """What a stateful layer (this DeltaNet, workers/layers/mamba2.py's mixer) reads and writes
    of the state store in one step (workers/linear_state.py): its conv [slots, C, K - 1] and
    recurrent [slots, ...] tensors, the step's slot per batch row (a request's first step finds
    its slot zeroed, or restored from a checkpoint), and the rows whose state is saved to a
    checkpoint slot part-way: batch row -> (tokens of the row, the checkpoint's slot)."""

    conv: torch.Tensor
    recurrent: torch.Tensor
    slots: list[int]
    saves: dict[int, tuple[int, int]] = field(default_factory=dict)

    def copy(self, src: int, dst: int) -> None:
        self.conv[dst] = self.conv[src]
        self.recurrent[dst] = self.recurrent[src]

    def decode_rows(self, num: int) -> SlotRows:
        """The first `num` rows' (the decode rows') conv and recurrent state, to update in place:
        views of the store when their slots are consecutive (the usual case: no copy), else
        gathered copies that `write_back` scatters (one gather, one scatter a step)."""
        slots = self.slots[:num]
        first = slots[0]
        if slots == list(range(first, first + num)):
            end = first + num
            return SlotRows(self.conv[first:end], self.recurrent[first:end], None)
        index = torch.tensor(slots, dtype=torch.long, device=self.conv.device)
        return SlotRows(self.conv[index], self.recurrent[index], index)

    def write_back(self, rows: SlotRows) -> None:
        """Scatter gathered rows back to their slots (views were updated in place already)."""
        if rows.index is not None:
            self.conv.index_copy_(0, rows.index, rows.conv)
            self.recurrent.index_copy_(0, rows.index, rows.recurrent)

    def run_rows(self, meta: AttentionMetadata, run: Callable[[int, int, int], None]) -> None:
        """The step's rows after `run` (lo, hi, slot) over each prefill row's tokens (decode rows
        ran before): a row with a save runs in two parts, its state copied out between them (a
        prompt split there leaves the same state as one run whole)."""
        starts, slots = meta.query_start_loc_cpu, self.slots
        for row, (_, checkpoint) in self.saves.items():
            if row < meta.num_decodes:  # a one-token row: its state after that token
                self.copy(slots[row], checkpoint)
        for row in range(meta.num_decodes, meta.num_reqs):
            lo, hi = starts[row], starts[row + 1]
            save = self.saves.get(row)
            if save is not None:
                run(lo, lo + save[0], slots[row])
                self.copy(slots[row], save[1])
                lo += save[0]
            if lo < hi:
                run(lo, hi, slots[row])


class GatedDeltaNet(nn.Module):
    """Qwen3-Next's linear-attention token mixer: projections, conv, gated delta rule, gated norm.

    `state` is bound by the runner's state feature (workers/linear_state.py) before each forward.
    Under tensor parallelism a rank holds whole key heads and their value heads: the projections'
    rows are grouped by key head in the checkpoint, so a contiguous split is one; the conv's
    channels (q, k, v of all heads side by side) and the per-head vectors are cut by ConvWeight
    and head_shard_loader; out_proj sums the ranks' heads."""

    def __init__(self, full: DeltaDims) -> None:
        super().__init__()
        tp, rank = get_tp_world_size(), get_tp_rank()
        self.d = d = full.per_rank(tp)  # every size below is this rank's
        qkvz = 2 * d.key_size + 2 * d.value_size
        self.in_proj_qkvz = ColumnParallelLinear(d.hidden_size, tp * qkvz)
        self.in_proj_ba = ColumnParallelLinear(d.hidden_size, tp * 2 * d.num_v_heads)
        conv = [tp * d.key_size, tp * d.key_size, tp * d.value_size]
        self.conv1d = ConvWeight(shares(conv, rank, tp), d.conv_kernel)
        self.dt_bias = nn.Parameter(torch.ones(d.num_v_heads), requires_grad=False)
        self.A_log = nn.Parameter(torch.zeros(d.num_v_heads), requires_grad=False)
        for vector in (self.dt_bias, self.A_log):
            set_param_attr(vector, "weight_loader", head_shard_loader(rank))
        self.norm = GatedRMSNorm(d.v_dim, d.eps)
        self.out_proj = RowParallelLinear(tp * d.value_size, d.hidden_size)
        self.state: DeltaStateView | None = None

    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """One request's (conv state, recurrent state) shapes on this rank."""
        d = self.d
        return (d.conv_dim, d.conv_kernel - 1), (d.num_v_heads, d.k_dim, d.v_dim)

    def split(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(conv input [T, C], z [T, Hv, Dv], b [T, Hv], a [T, Hv]) from the projections, whose
        rows are grouped by key head as the checkpoint lays them out."""
        d, t = self.d, x.shape[0]
        qkvz = self.in_proj_qkvz(x).view(t, d.num_k_heads, -1)
        r = d.group
        q, k, v, z = qkvz.split([d.k_dim, d.k_dim, r * d.v_dim, r * d.v_dim], dim=-1)
        b, a = self.in_proj_ba(x).view(t, d.num_k_heads, 2 * r).split([r, r], dim=-1)
        mixed = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=-1)
        return mixed, z.reshape(t, -1, d.v_dim), b.reshape(t, -1), a.reshape(t, -1)

    def heads(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The conv's output as q, k (repeated to the value heads) and v: [T, Hv, D] each."""
        d, t = self.d, mixed.shape[0]
        q, k, v = mixed.split([d.key_size, d.key_size, d.value_size], dim=-1)
        q = q.reshape(t, d.num_k_heads, d.k_dim).repeat_interleave(d.group, dim=1)
        k = k.reshape(t, d.num_k_heads, d.k_dim).repeat_interleave(d.group, dim=1)
        return q, k, v.reshape(t, d.num_v_heads, d.v_dim)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        if self.state is None:
            raise RuntimeError("GatedDeltaNet: no state bound (workers/linear_state.py)")
        mixed, z, b, a = self.split(x)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        out = torch.empty(
            x.shape[0], self.d.num_v_heads, self.d.v_dim, dtype=torch.float32, device=x.device
        )
        nd = meta.num_decodes
        if nd:
            out[:nd] = self._decode(mixed[:nd], g[:nd], beta[:nd], self.state.slots[:nd])

        def run(lo: int, hi: int, slot: int) -> None:
            out[lo:hi] = self._prefill(mixed[lo:hi], g[lo:hi], beta[lo:hi], slot)

        self.state.run_rows(meta, run)
        y = self.norm(out.to(x.dtype).reshape(-1, self.d.v_dim), z.reshape(-1, self.d.v_dim))
        return self.out_proj(y.reshape(x.shape[0], -1))

    def _decode(
        self, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, slots: list[int]
    ) -> torch.Tensor:
        state = self.state
        assert state is not None
        rows = state.decode_rows(len(slots))
        mixed, conv = conv_decode(mixed, rows.conv, self.conv1d.weight[:, 0])
        rows.conv.copy_(conv)
        q, k, v = self.heads(mixed)
        out, _ = recurrent_step(q, k, v, g, beta, rows.recurrent)  # in place
        state.write_back(rows)
        return out

    def _prefill(
        self, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, slot: int
    ) -> torch.Tensor:
        state = self.state
        assert state is not None
        weight = self.conv1d.weight[:, 0]
        mixed, state.conv[slot] = conv_prefill(mixed, state.conv[slot], weight)
        q, k, v = (t.transpose(0, 1) for t in self.heads(mixed))
        out, state.recurrent[slot] = chunked(q, k, v, g.t(), beta.t(), state.recurrent[slot])
        return out.transpose(0, 1)
