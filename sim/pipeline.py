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

    python -m sim.pipeline [--profile cpu] [--batches 16,64,256] [--stages 2,4]
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, fields, replace

from sim.cost import CostModel, load_profile

MAX_STAGES = 64  # as workers/pipeline_split.MAX_PIPELINE_STAGES (sim/ imports no workers)


@dataclass(frozen=True, slots=True)
class PipelineShape:
    """N stages and what joins them."""

    stages: int
    hop_bytes_per_token: float = 0.0  # hidden state + residual of one token, between two stages
    link_bytes_per_s: float = 1e30  # the hand-off's bandwidth
    link_latency_s: float = 0.0  # per hand-off
    turnaround_s: float = 0.0  # the engine's update + schedule + post between a step and the next

    def __post_init__(self) -> None:
        if isinstance(self.stages, bool) or not isinstance(self.stages, int):
            raise ValueError(f"stages: must be an integer, got {self.stages!r}")
        if not 1 <= self.stages <= MAX_STAGES:
            raise ValueError(f"stages: must be in [1, {MAX_STAGES}], got {self.stages}")
        for f in fields(self)[1:]:
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{f.name}: must be a number, got {value!r}")
            if not 0 <= value < math.inf:
                raise ValueError(f"{f.name}: must be a finite number >= 0, got {value!r}")
        if self.link_bytes_per_s <= 0:
            raise ValueError(f"link_bytes_per_s: must be > 0, got {self.link_bytes_per_s!r}")

    def hop_s(self, tokens: int) -> float:
        """One hand-off of `tokens` tokens' hidden states."""
        return self.link_latency_s + self.hop_bytes_per_token * tokens / self.link_bytes_per_s


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
    cost: CostModel, shape: PipelineShape, batch: int, context: int, micro_batches: int
) -> SteadyDecode:
    """`batch` requests decoding at `context` tokens each, split into `micro_batches` steps in
    flight (1: one at a time)."""
    if not 1 <= micro_batches <= batch:
        raise ValueError(f"micro_batches: must be in [1, batch={batch}], got {micro_batches}")
    per = math.ceil(batch / micro_batches)
    t = stage_cost(cost, shape.stages).step_time(0, per, per * context, per)
    busy = micro_batches * t
    through = shape.stages * t + (shape.stages - 1) * shape.hop_s(per) + shape.turnaround_s
    round_s = max(busy, through)
    return SteadyDecode(round_s, batch / round_s, 1 - busy / round_s)


def llama_405b_stage_node() -> CostModel:
    """A 405B-class model (Llama-3.1-405B: 126 layers, 8 KV heads of 128, bf16) on nodes of
    eight H100s: the whole model's figures against one node's FLOPs and bandwidth (a stage is a
    TP=8 group on one node). Throughput figures are datasheet-derived (989 TFLOP/s dense bf16 and
    3.35 TB/s per GPU) at 60% and 80%, and the step overheads are the calibrated H100 profile's:
    an estimate, not a measurement."""
    gpus = 8
    return CostModel(
        name="llama-405b-class, TP=8 per node (derived)",
        num_params=405e9,
        weight_bytes=810e9,
        kv_bytes_per_token=126 * 2 * 8 * 128 * 2,
        flops_per_s=0.6 * 989e12 * gpus,
        bytes_per_s=0.8 * 3.35e12 * gpus,
        step_overhead_s=0.004,  # eager stage forward + NCCL launches, assumed
        per_seq_overhead_s=load_profile("h100").per_seq_overhead_s,
    )


# Between two nodes: the hidden state and residual of a token in bf16 (2 x 16,384 x 2 bytes) over
# a 400 Gb/s NIC with 10 us per message; the engine's turnaround 1 ms.
NODE_LINK = dict(hop_bytes_per_token=2 * 16384 * 2, link_bytes_per_s=50e9, link_latency_s=10e-6)


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", default=None, help="sim/profiles name (default: 405B-class)")
    parser.add_argument("--batches", default="16,64,256")
    parser.add_argument("--stages", default="2,4")
    args = parser.parse_args()
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
