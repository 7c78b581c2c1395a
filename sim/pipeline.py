"""Pipeline stages in the cost model: a stage's step time, the hand-off between stages, and the
steady-decode bubble with one step in flight or one micro-batch per stage (docs/pipeline.md).

A model split into N even stages: each stage reads 1/N of the weights and of each token's KV and
does 1/N of the FLOPs, and pays the step and per-sequence overheads of its own (a stage is a
process that runs every step). A micro-batch crosses N - 1 hand-offs, each `hop_bytes_per_token`
per token over a link. The engine turns a step around (update, schedule, post) in
`turnaround_s` before a request's next token can enter stage 0.

One round is the time for every running request to gain one token. With M micro-batches of
B / M requests each (M = 1: one step at a time; M = N: raylm's micro-batches), a stage works
M x t(B / M) per round, and a micro-batch's token must cross every stage before its next step:

    round = max(M x t(B / M), N x t(B / M) + (N - 1) x hop(B / M) + turnaround)

so each stage's idle fraction is 1 - M x t(B / M) / round. An analytic steady state, not the
event-driven simulator (sim/replica.py runs one step at a time): it says what the bubble costs
and what micro-batches buy before anyone rents two nodes to find out.

A stage that is a tensor-parallel group also pays its all-reduces in t (`TensorParallel`): two per
decoder layer it holds, of the step's tokens' hidden states, as a ring paced by its slowest link
(NVLink inside a node, a NIC once the group spans nodes). `--study tp16` sets TP=16 across two
nodes against TP=8 x PP=2 for the 405B-class profile.

    python -m sim.pipeline [--profile cpu] [--batches 16,64,256] [--stages 2,4] [--study tp16]
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, fields, replace

from sim.cost import CostModel, load_profile

MAX_STAGES = 64  # as workers/pipeline_split.MAX_PIPELINE_STAGES (sim/ imports no workers)
MAX_RANKS = 1024  # tensor-parallel ranks of a group, and GPUs of a node: beyond any deployment
MAX_LAYERS = 4096  # as workers/pipeline_split.MAX_STAGE_LAYERS

# The links (estimates from datasheets, to be replaced by a calibration on two nodes). Between two
# nodes: one 400 Gb/s NIC, 10 us a message; the stages' hand-off and a TP ring's inter-node step
# both cross it. Inside a node: NVLink 4, 450 GB/s each way per H100, 1 us a ring step (NCCL's
# low-latency protocol on a decode step's small messages). Eight GPUs a node.
NIC_BYTES_PER_S, NIC_LATENCY_S = 50e9, 10e-6
NVLINK_BYTES_PER_S, NVLINK_LATENCY_S = 450e9, 1e-6
GPUS_PER_NODE = 8


def _check_figures(obj: object, names: list[str], positive: tuple[str, ...] = ()) -> None:
    """Each named field a finite number >= 0 (> 0 where `positive`), or a ValueError naming it."""
    for name in names:
        value = getattr(obj, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{name}: must be a number, got {value!r}")
        if not 0 <= value < math.inf:
            raise ValueError(f"{name}: must be a finite number >= 0, got {value!r}")
        if name in positive and value <= 0:
            raise ValueError(f"{name}: must be > 0, got {value!r}")


def _check_count(name: str, value: object, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{name}: must be an integer in [{low}, {high}], got {value!r}")


@dataclass(frozen=True, slots=True)
class PipelineShape:
    """N stages and what joins them."""

    stages: int
    hop_bytes_per_token: float = 0.0  # hidden state + residual of one token, between two stages
    link_bytes_per_s: float = 1e30  # the hand-off's bandwidth
    link_latency_s: float = 0.0  # per hand-off
    turnaround_s: float = 0.0  # the engine's update + schedule + post between a step and the next

    def __post_init__(self) -> None:
        _check_count("stages", self.stages, 1, MAX_STAGES)
        _check_figures(self, [f.name for f in fields(self)[1:]], ("link_bytes_per_s",))

    def hop_s(self, tokens: int) -> float:
        """One hand-off of `tokens` tokens' hidden states."""
        return self.link_latency_s + self.hop_bytes_per_token * tokens / self.link_bytes_per_s


@dataclass(frozen=True, slots=True)
class TensorParallel:
    """A stage's tensor-parallel group and its all-reduces: two per decoder layer (after the
    attention and after the MLP), each of the step's tokens' hidden states. A ring: 2 (p - 1)
    steps, each moving 1/p of the bytes over every link of the ring at once, so each step is
    paced by the slowest link: NVLink while the group fits a node, the NIC once it spans nodes."""

    ranks: int = 1
    layers: int = 0  # the whole model's decoder layers (a stage holds layers / stages)
    hidden_bytes_per_token: float = 0.0  # one token's hidden state (hidden size x dtype bytes)
    ranks_per_node: int = GPUS_PER_NODE
    nvlink_bytes_per_s: float = NVLINK_BYTES_PER_S  # each way, per GPU
    nvlink_latency_s: float = NVLINK_LATENCY_S  # per ring step
    nic_bytes_per_s: float = NIC_BYTES_PER_S  # what the ring's inter-node step gets
    nic_latency_s: float = NIC_LATENCY_S  # per ring step

    def __post_init__(self) -> None:
        _check_count("ranks", self.ranks, 1, MAX_RANKS)
        _check_count("layers", self.layers, 0, MAX_LAYERS)
        _check_count("ranks_per_node", self.ranks_per_node, 1, MAX_RANKS)
        links = ("nvlink_bytes_per_s", "nic_bytes_per_s")
        figures = ["hidden_bytes_per_token", "nvlink_latency_s", "nic_latency_s", *links]
        _check_figures(self, figures, links)

    @property
    def spans_nodes(self) -> bool:
        return self.ranks > self.ranks_per_node

    def all_reduce_s(self, tokens: int) -> float:
        """One all-reduce of `tokens` tokens' hidden states."""
        p = self.ranks
        if p == 1:
            return 0.0
        if self.spans_nodes:
            bandwidth, latency = self.nic_bytes_per_s, self.nic_latency_s
        else:
            bandwidth, latency = self.nvlink_bytes_per_s, self.nvlink_latency_s
        return 2 * (p - 1) * (latency + self.hidden_bytes_per_token * tokens / p / bandwidth)

    def step_s(self, tokens: int, stages: int) -> float:
        """One stage's all-reduces in a step of `tokens` tokens: two per layer it holds."""
        return 2 * self.layers / stages * self.all_reduce_s(tokens)


NO_TP = TensorParallel()


def stage_cost(cost: CostModel, stages: int) -> CostModel:
    """One of `stages` even stages: 1/stages of the weights, FLOPs and KV per token; the step and
    per-sequence overheads whole (every stage runs every step)."""
    return replace(
        cost,
        name=f"{cost.name} (1 of {stages} stages)",
        num_params=cost.num_params / stages,
        weight_bytes=cost.weight_bytes / stages,
        kv_bytes_per_token=cost.kv_bytes_per_token / stages,
    )


@dataclass(frozen=True, slots=True)
class SteadyDecode:
    """Steady decode of a batch: a round (every request one token), throughput, the bubble."""

    round_s: float
    tokens_per_s: float
    idle_fraction: float  # each stage's (even stages: all the same)


def steady_decode(
    cost: CostModel,
    shape: PipelineShape,
    batch: int,
    context: int,
    micro_batches: int,
    tp: TensorParallel = NO_TP,
) -> SteadyDecode:
    """`batch` requests decoding at `context` tokens each, split into `micro_batches` steps in
    flight (1: one at a time); each stage a `tp` group that pays its all-reduces."""
    if not 1 <= micro_batches <= batch:
        raise ValueError(f"micro_batches: must be in [1, batch={batch}], got {micro_batches}")
    per = math.ceil(batch / micro_batches)
    t = stage_cost(cost, shape.stages).step_time(0, per, per * context, per)
    t += tp.step_s(per, shape.stages)
    busy = micro_batches * t
    through = shape.stages * t + (shape.stages - 1) * shape.hop_s(per) + shape.turnaround_s
    round_s = max(busy, through)
    return SteadyDecode(round_s, batch / round_s, 1 - busy / round_s)


def llama_405b_stage_node() -> CostModel:
    """A 405B-class model on nodes of eight H100s, a stage being a TP=8 group on one node."""
    return llama_405b(GPUS_PER_NODE)


def llama_405b(gpus: int) -> CostModel:
    """A 405B-class model (Llama-3.1-405B: 126 layers, hidden 16,384, 8 KV heads of 128, bf16)
    tensor-parallel over `gpus` H100s: the whole model's figures against their FLOPs and
    bandwidth. Past 8 ranks each KV head is held by gpus / 8 ranks, so the KV bytes a step reads
    grow with them. Throughput figures are datasheet-derived (989 TFLOP/s dense bf16 and
    3.35 TB/s per GPU) at 60% and 80%, and the step overheads are the calibrated H100 profile's:
    an estimate, not a measurement."""
    _check_count("gpus", gpus, 1, MAX_RANKS)
    return CostModel(
        name=f"llama-405b-class, TP={gpus} (derived)",
        num_params=405e9,
        weight_bytes=810e9,
        kv_bytes_per_token=126 * 2 * max(8, gpus) * 128 * 2,
        flops_per_s=0.6 * 989e12 * gpus,
        bytes_per_s=0.8 * 3.35e12 * gpus,
        step_overhead_s=0.004,  # eager stage forward + NCCL launches, assumed
        per_seq_overhead_s=load_profile("h100").per_seq_overhead_s,
    )


# Between two stages: the hidden state and residual of a token in bf16 (2 x 16,384 x 2 bytes) over
# the NIC; the engine's turnaround 1 ms.
NODE_LINK = dict(
    hop_bytes_per_token=2 * 16384 * 2,
    link_bytes_per_s=NIC_BYTES_PER_S,
    link_latency_s=NIC_LATENCY_S,
)


def llama_405b_tp(
    ranks: int,
    nic_bytes_per_s: float = NIC_BYTES_PER_S,
    nic_latency_s: float = NIC_LATENCY_S,
    ranks_per_node: int = GPUS_PER_NODE,
) -> TensorParallel:
    """The 405B-class model's all-reduces over `ranks` ranks (bf16 hidden states of 16,384)."""
    return TensorParallel(
        ranks,
        126,
        16384 * 2,
        ranks_per_node,
        nic_bytes_per_s=nic_bytes_per_s,
        nic_latency_s=nic_latency_s,
    )


def study_rows(
    cost: CostModel, link: dict[str, float], stage_counts: list[int], batches: list[int]
) -> list[str]:
    """One line per (stages, batch): throughput and idle with one step in flight, with the same
    requests in micro-batches, and with `stages` x the requests in micro-batches of `batch` each
    (what a KV pool that holds them allows: each stage holds 1/stages of every token's KV)."""
    rows = []
    for stages in stage_counts:
        shape = PipelineShape(stages, turnaround_s=1e-3, **link)
        for batch in batches:
            one = steady_decode(cost, shape, batch, 1024, 1)
            many = steady_decode(cost, shape, batch, 1024, min(stages, batch))
            full = steady_decode(cost, shape, batch * stages, 1024, stages)
            rows.append(
                f"| {stages} | {batch} | {one.tokens_per_s:,.0f} | {one.idle_fraction:.2f} | "
                f"{many.tokens_per_s:,.0f} | {many.idle_fraction:.2f} | "
                f"{many.tokens_per_s / one.tokens_per_s:.2f} | {full.tokens_per_s:,.0f} | "
                f"{full.tokens_per_s / one.tokens_per_s:.2f} |"
            )
    return rows


def tp16_study_rows(
    batches: list[int],
    nic_bytes_per_s: float,
    nic_latency_s: float = NIC_LATENCY_S,
    ranks_per_node: int = GPUS_PER_NODE,
) -> list[str]:
    """One line per batch: TP=16 across two nodes (one step in flight) against TP=8 x PP=2 (a
    micro-batch per stage): step time, its all-reduces, throughput. 16 GPUs either way; the NIC
    figures are the TP ring's inter-node step's and the stages' hand-off's."""
    rows = []
    link = {**NODE_LINK, "link_latency_s": nic_latency_s}
    tp16 = llama_405b_tp(16, nic_bytes_per_s, nic_latency_s, ranks_per_node)
    tp8 = llama_405b_tp(8, nic_bytes_per_s, nic_latency_s)
    for batch in batches:
        one = steady_decode(llama_405b(16), PipelineShape(1), batch, 1024, 1, tp16)
        micro = min(2, batch)
        pp = steady_decode(
            llama_405b(8), PipelineShape(2, turnaround_s=1e-3, **link), batch, 1024, micro, tp8
        )
        half = math.ceil(batch / micro)
        stage = stage_cost(llama_405b(8), 2).step_time(0, half, half * 1024, half)
        stage += tp8.step_s(half, 2)
        # TP16 runs one step at a time: the engine's 1 ms turnaround between its steps.
        tp16_tok_s = batch / (one.round_s + 1e-3)
        rows.append(
            f"| {batch} | {one.round_s * 1e3:.1f} | {tp16.step_s(batch, 1) * 1e3:.1f} | "
            f"{tp16_tok_s:,.0f} | {stage * 1e3:.1f} | {tp8.step_s(half, 2) * 1e3:.1f} | "
            f"{pp.round_s * 1e3:.1f} | {pp.idle_fraction:.2f} | {pp.tokens_per_s:,.0f} | "
            f"{pp.tokens_per_s / tp16_tok_s:.2f} |"
        )
    return rows


def print_tp16_study(batches: list[int], nic_latency_s: float) -> None:
    for nics in (1, 8):  # one ring on one NIC; NCCL's one ring per NIC on eight
        print(
            f"405B-class on 2 nodes of 8 H100s, context 1,024: the TP ring's inter-node step on "
            f"{nics} x 400 Gb/s, {nic_latency_s * 1e6:g} us a message"
        )
        print(TP16_HEADER)
        for row in tp16_study_rows(batches, nics * NIC_BYTES_PER_S, nic_latency_s):
            print(row)
    print(
        "The same 16 GPUs in one NVLink domain (TP=16's ring on NVLink; the stages' hop on the NIC)"
    )
    print(TP16_HEADER)
    for row in tp16_study_rows(batches, NIC_BYTES_PER_S, nic_latency_s, ranks_per_node=16):
        print(row)


TP16_HEADER = (
    "| requests | TP16 step ms | all-reduce ms | TP16 tok/s | TP8xPP2 stage step ms | "
    "all-reduce ms | round ms | idle | TP8xPP2 tok/s | PP/TP16 |\n"
    "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", default=None, help="sim/profiles name (default: 405B-class)")
    parser.add_argument("--batches", default="16,64,256")
    parser.add_argument("--stages", default="2,4")
    parser.add_argument("--study", choices=("stages", "tp16"), default="stages")
    parser.add_argument(
        "--nic-latency-us", type=float, default=NIC_LATENCY_S * 1e6, help="per message, tp16"
    )
    args = parser.parse_args()
    batches = [int(n) for n in args.batches.split(",")]
    if args.study == "tp16":
        print_tp16_study(batches, args.nic_latency_us * 1e-6)
        return
    cost = load_profile(args.profile) if args.profile else llama_405b_stage_node()
    # A CPU profile's stages are processes on one machine: loopback, no NIC.
    link = NODE_LINK if args.profile is None else {}
    print(f"profile: {cost.name}; context 1,024 tokens per request; link {link or 'none'}")
    print(
        "| stages | requests | tok/s, 1 in flight | idle | tok/s, micro-batches | idle | x | "
        "tok/s, stages x requests in micro-batches | x |"
    )
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    stages = [int(n) for n in args.stages.split(",")]
    for row in study_rows(cost, link, stages, [int(n) for n in args.batches.split(",")]):
        print(row)


if __name__ == "__main__":
    main()
