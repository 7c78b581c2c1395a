"""Colocated against disaggregated fleets of equal GPU count, on long prompts beside chat.

    python -m sim.disagg_study --gpus 4 --splits 1:3 2:2 3:1 --local 0 1024 [--policy priority]

The workload: chat requests (16 tenants' 256-token system prompts, 32-256-token questions,
128-512-token answers) beside long documents (2-8k-token prompts, 8-32-token answers), Poisson
arrivals. Each fleet prints the chat requests' TTFT and ITL (their inter-token gaps pooled), the
documents' TTFT, and goodput (requests meeting both SLOs per second): a fleet that keeps up serves
the whole load, so fleets are compared at equal goodput.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from dataclasses import dataclass

from scheduler import SchedulerConfig
from sim.cost import load_profile
from sim.disagg import DisaggConfig, DisaggSim
from sim.fleet import FleetSim
from sim.fleet_config import SimConfig
from sim.kv_copy import LinkConfig
from sim.metrics import SimResult, percentile
from sim.workload import SimRequest, WorkloadConfig, synthetic_workload


@dataclass(frozen=True, slots=True)
class MixConfig:
    """Chat and long-document arrivals."""

    seconds: float = 20.0
    chat_rate: float = 20.0
    doc_rate: float = 40.0
    doc_len: tuple[int, int] = (2048, 8192)
    seed: int = 0


_MIX = MixConfig()


def mixed_workload(mix: MixConfig) -> list[SimRequest]:
    """Chat (tenants chat-t*) and documents (tenant doc), merged by arrival."""
    chat = synthetic_workload(_chat(mix))
    docs = synthetic_workload(_documents(mix))
    # Chat first under the priority policy (lower is more urgent); FCFS ignores it.
    merged = sorted(
        [dataclasses.replace(r, tenant="chat-" + r.tenant) for r in chat]
        + [dataclasses.replace(r, tenant="doc", priority=1) for r in docs],
        key=lambda r: r.arrival_s,
    )
    return [dataclasses.replace(r, request_id=f"r{i}") for i, r in enumerate(merged)]


def _chat(mix: MixConfig) -> WorkloadConfig:
    """Sixteen tenants' chats: short questions, long answers."""
    return WorkloadConfig(
        num_requests=int(mix.chat_rate * mix.seconds),
        rate=mix.chat_rate,
        tenants=16,
        question_len=(32, 256),
        output_len=(128, 512),
        seed=mix.seed,
    )


def _documents(mix: MixConfig) -> WorkloadConfig:
    """Long documents without a shared prefix, each asking for a short answer."""
    return WorkloadConfig(
        num_requests=int(mix.doc_rate * mix.seconds),
        rate=mix.doc_rate,
        tenants=1,
        system_prompt_len=0,
        question_len=mix.doc_len,
        output_len=(8, 32),
        seed=mix.seed + 1,
    )


def figures(result: SimResult, slo_ttft_s: float, slo_itl_s: float) -> dict[str, float]:
    """The chat requests' TTFT and pooled ITL percentiles, the documents' TTFT, goodput."""
    done = [r for r in result.records if r.finish_s is not None]
    chat = [r for r in done if r.tenant.startswith("chat")]
    docs = [r for r in done if r.tenant == "doc"]
    gaps = [g for r in chat for g in r.itl_s]
    summary = result.summary(slo_ttft_s, slo_itl_s)
    return {
        "chat_ttft_p50_s": percentile([r.ttft_s for r in chat], 50),
        "chat_ttft_p90_s": percentile([r.ttft_s for r in chat], 90),
        "chat_itl_p50_s": percentile(gaps, 50),
        "chat_itl_p90_s": percentile(gaps, 90),
        "doc_ttft_p90_s": percentile([r.ttft_s for r in docs], 90),
        "goodput_rps": summary["goodput_rps"],
        "done": len(done),
    }


def _split(text: str) -> tuple[int, int]:
    """PREFILL:DECODE replica counts."""
    pre, sep, dec = text.partition(":")
    if not (sep and pre.isdigit() and dec.isdigit() and int(pre) and int(dec)):
        raise argparse.ArgumentTypeError(f"expected PREFILL:DECODE (two counts >= 1), got {text!r}")
    return int(pre), int(dec)


def main(argv: list[str] | None = None) -> None:
    a = _parser().parse_args(argv)
    cost = load_profile(a.profile)
    workload = mixed_workload(MixConfig(a.seconds, a.chat_rate, a.doc_rate))
    print(
        f"profile {cost.name}, {a.gpus} GPUs, {len(workload)} requests: chat {a.chat_rate}/s, "
        f"documents {a.doc_rate}/s, {a.seconds:.0f} s; link {a.bandwidth / 1e9:.0f} GB/s + "
        f"{a.latency * 1e3:.1f} ms; queue order {a.policy}; SLO TTFT {a.slo_ttft} s, ITL p90 "
        f"{a.slo_itl} s\n"
    )
    print(
        "| fleet | chat TTFT p50 / p90 (ms) | chat ITL p50 / p90 (ms) | doc TTFT p90 (ms) "
        "| goodput (req/s) | ITL p90 vs colocated | TTFT p90 vs colocated | wall (s) |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    base: dict[str, float] = {}
    for name, cfg, pools in _fleets(a):
        t0 = time.perf_counter()
        sim = FleetSim(cfg, cost) if pools is None else DisaggSim(cfg, cost, pools)
        f = figures(sim.run(workload), a.slo_ttft, a.slo_itl)
        base = base or f
        _print_row(name, f, base, time.perf_counter() - t0)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sim.disagg_study")
    p.add_argument("--profile", default="h100")
    p.add_argument("--gpus", type=int, default=4)
    p.add_argument(
        "--splits", type=_split, nargs="+", default=[(1, 3), (2, 2), (3, 1)], help="PREFILL:DECODE"
    )
    p.add_argument(
        "--local",
        type=int,
        nargs="+",
        default=[0, 1024],
        help="local_prefill_tokens values (prompts shorter prefill on the decode replica)",
    )
    p.add_argument("--seconds", type=float, default=_MIX.seconds)
    p.add_argument("--chat-rate", type=float, default=_MIX.chat_rate)
    p.add_argument("--doc-rate", type=float, default=_MIX.doc_rate)
    p.add_argument("--blocks", type=int, default=8192, help="KV blocks per replica")
    p.add_argument(
        "--policy",
        choices=("fcfs", "priority"),
        default="fcfs",
        help="every replica's queue order; priority: chat before documents",
    )
    p.add_argument("--bandwidth", type=float, default=25e9, help="link bytes/s")
    p.add_argument("--latency", type=float, default=1e-3, help="link latency, seconds")
    p.add_argument("--slo-ttft", type=float, default=1.0)
    p.add_argument("--slo-itl", type=float, default=0.05)
    return p


def _fleets(a: argparse.Namespace) -> list[tuple[str, SimConfig, DisaggConfig | None]]:
    """The colocated fleet, then each split at each local-prefill threshold, on the same GPUs."""
    sched = SchedulerConfig(num_gpu_blocks=a.blocks, max_model_len=16384, policy=a.policy)
    link = LinkConfig(a.bandwidth, a.latency)
    runs: list[tuple[str, SimConfig, DisaggConfig | None]] = [
        (f"colocated {a.gpus}", SimConfig(num_replicas=a.gpus, scheduler=sched), None)
    ]
    for local in a.local:
        for pre, dec in a.splits:
            name = f"disagg {pre}:{dec}" + (f", local < {local}" if local else "")
            runs.append(
                (name, SimConfig(scheduler=sched), DisaggConfig(pre, dec, link, None, local))
            )
    return runs


def _print_row(name: str, f: dict[str, float], base: dict[str, float], wall_s: float) -> None:
    cols = ("chat_ttft_p50_s", "chat_ttft_p90_s", "chat_itl_p50_s", "chat_itl_p90_s")
    ms = {c: f[c] * 1e3 for c in cols}
    print(
        f"| {name} | {ms['chat_ttft_p50_s']:.1f} / {ms['chat_ttft_p90_s']:.1f} "
        f"| {ms['chat_itl_p50_s']:.2f} / {ms['chat_itl_p90_s']:.2f} "
        f"| {f['doc_ttft_p90_s'] * 1e3:.1f} | {f['goodput_rps']:.1f} "
        f"| {base['chat_itl_p90_s'] / f['chat_itl_p90_s']:.2f}x lower "
        f"| {f['chat_ttft_p90_s'] / base['chat_ttft_p90_s'] - 1:+.0%} "
        f"| {wall_s:.1f} |",
        flush=True,
    )


if __name__ == "__main__":
    main()
