"""The CPU tier on and off, on multi-turn chat whose working set is several times the device pool.

    python -m sim.tier_study --profile cpu --users 64 --turns 3 --blocks 1350

Each user's turn k sends the whole conversation so far: turn k-1's prompt, its answer and a new
question, so a returning turn finds turn k-1's prompt blocks in a cache unless other users' turns
evicted them. Prints TTFT p50 / p90 (all turns, and returning turns only), the device and tier hit
rates and the prompt tokens each fleet computed, for the same workload with the tier off and on.
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass

from scheduler import SchedulerConfig
from settings import check_settings, setting
from sim.cost import load_profile
from sim.fleet import FleetSim
from sim.fleet_config import SimConfig
from sim.kv_copy import LinkConfig
from sim.metrics import SimResult, percentile
from sim.tiers import tier_figures
from sim.turns import check_turn_shape, session
from sim.workload import SimRequest


@dataclass(frozen=True, slots=True)
class ConversationConfig:
    """Users, their turns, and the lengths and pauses of each turn."""

    users: int = setting(64, "users, each holding one conversation", ge=1, le=1 << 20)
    turns: int = setting(3, "turns of each conversation", ge=1, le=1 << 20)
    question_len: tuple[int, int] = (200, 400)
    answer_len: tuple[int, int] = (50, 150)
    think_s: tuple[float, float] = (20.0, 40.0)  # from one turn's arrival to the next
    start_spread_s: float = setting(30.0, "users start uniformly over this window", ge=0, le=1e6)
    seed: int = setting(0, "seed of the draws", ge=0, lt=2**63)

    def __post_init__(self) -> None:
        check_settings(self)
        check_turn_shape(self)

    def working_set_tokens(self, workload: list[SimRequest]) -> int:
        """The users' last prompts: what the caches would hold to miss nothing."""
        last: dict[str, int] = {}
        for r in workload:
            last[r.prefix_group] = max(last.get(r.prefix_group, 0), r.prompt_len)
        return sum(last.values())


def conversations(cfg: ConversationConfig) -> list[SimRequest]:
    """Every user's turns; a turn's whole prompt is its user's token sequence (prefix_group), so
    turn k's prompt begins with turn k-1's."""
    rng = random.Random(cfg.seed)
    out: list[tuple[float, str, int, int, int]] = []
    for u in range(cfg.users):
        turns = session(cfg, rng, 0, rng.uniform(0, cfg.start_spread_s), cfg.turns)
        out += [(x.arrival_s, f"u{u}", k, x.prompt_len, x.answer_len) for k, x in enumerate(turns)]
    out.sort()
    return [
        SimRequest(
            request_id=f"r{i}",
            arrival_s=t,
            prompt_len=prompt,
            output_len=answer,
            prefix_group=user,
            prefix_len=prompt,
            tenant=f"turn{k}",
        )
        for i, (t, user, k, prompt, answer) in enumerate(out)
    ]


def figures(result: SimResult) -> dict[str, float]:
    done = [r for r in result.records if r.finish_s is not None]
    back = [r for r in done if r.tenant != "turn0"]
    tiers = tier_figures(result)
    return {
        "ttft_p50_s": percentile([r.ttft_s for r in done], 50),
        "ttft_p90_s": percentile([r.ttft_s for r in done], 90),
        "returning_ttft_p50_s": percentile([r.ttft_s for r in back], 50),
        "returning_ttft_p90_s": percentile([r.ttft_s for r in back], 90),
        "device_hit_rate": tiers.device_hit_rate,
        "tier_hit_rate": tiers.tier_hit_rate,
        "computed_prompt_tokens": tiers.queried_tokens
        - tiers.device_hit_tokens
        - tiers.tier_hit_tokens,
        "loaded_blocks": tiers.loaded_blocks,
        "copy_s": tiers.copy_s,
        "done": len(done),
    }


def main(argv: list[str] | None = None) -> None:
    a = _parser().parse_args(argv)
    conv = ConversationConfig(
        users=a.users,
        turns=a.turns,
        think_s=(a.think[0], a.think[1]),
        start_spread_s=a.spread,
        seed=a.seed,
    )
    workload = conversations(conv)
    bs = SchedulerConfig().block_size
    working_blocks = -(-conv.working_set_tokens(workload) // bs)
    blocks = a.blocks or max(working_blocks // 4, 8192 // bs)
    tier_blocks = a.tier_blocks or working_blocks
    _print_intro(a, len(workload), working_blocks, blocks, tier_blocks)
    rows = {on: _run_row(a, workload, blocks, tier_blocks if on else 0) for on in (False, True)}
    _print_ratios(rows[False], rows[True])


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sim.tier_study")
    p.add_argument("--profile", default="cpu")
    p.add_argument("--users", type=int, default=64)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--blocks", type=int, default=0, help="device blocks (0: working set / 4)")
    p.add_argument("--tier-blocks", type=int, default=0, help="CPU tier blocks (0: working set)")
    p.add_argument("--bandwidth", type=float, default=LinkConfig().bandwidth_bytes_per_s)
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--think", type=float, nargs=2, default=[20.0, 40.0], help="LO HI seconds")
    p.add_argument("--spread", type=float, default=30.0, help="users start over this many s")
    p.add_argument("--seed", type=int, default=0)
    return p


def _print_intro(
    a: argparse.Namespace, requests: int, working_blocks: int, blocks: int, tier_blocks: int
) -> None:
    print(
        f"profile {load_profile(a.profile).name}, {a.replicas} replica(s), {requests} "
        f"requests ({a.users} users x {a.turns} turns); working set {working_blocks} blocks = "
        f"{working_blocks / blocks:.1f}x the device pool of {blocks}; tier {tier_blocks} blocks "
        f"at {a.bandwidth / 1e9:.0f} GB/s\n"
    )
    print(
        "| tier | TTFT p50 / p90 (s) | returning turns' TTFT p50 / p90 (s) | device hit | tier hit "
        "| prompt tokens computed | blocks loaded | wall (s) |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")


def _run_row(
    a: argparse.Namespace, workload: list[SimRequest], blocks: int, tier_blocks: int
) -> dict[str, float]:
    """One run, without the tier (tier_blocks 0) or with it, printed as a table row."""
    bs = SchedulerConfig().block_size
    sched = SchedulerConfig(
        num_gpu_blocks=blocks, max_model_len=min(8192, blocks * bs), num_cpu_tier_blocks=tier_blocks
    )
    config = SimConfig(num_replicas=a.replicas, scheduler=sched, tier_link=LinkConfig(a.bandwidth))
    t0 = time.perf_counter()
    f = figures(FleetSim(config, load_profile(a.profile)).run(workload))
    print(
        f"| {'on' if tier_blocks else 'off'} | {f['ttft_p50_s']:.3f} / {f['ttft_p90_s']:.3f} "
        f"| {f['returning_ttft_p50_s']:.3f} / {f['returning_ttft_p90_s']:.3f} "
        f"| {f['device_hit_rate']:.1%} | {f['tier_hit_rate']:.1%} "
        f"| {f['computed_prompt_tokens']:,} | {f['loaded_blocks']:,} "
        f"| {time.perf_counter() - t0:.1f} |",
        flush=True,
    )
    return f


def _print_ratios(off: dict[str, float], on_: dict[str, float]) -> None:
    print(
        f"\nwith the tier: TTFT p50 {off['ttft_p50_s'] / on_['ttft_p50_s']:.2f}x lower, p90 "
        f"{off['ttft_p90_s'] / on_['ttft_p90_s']:.2f}x; returning turns p50 "
        f"{off['returning_ttft_p50_s'] / on_['returning_ttft_p50_s']:.2f}x, p90 "
        f"{off['returning_ttft_p90_s'] / on_['returning_ttft_p90_s']:.2f}x; prompt tokens "
        f"computed {off['computed_prompt_tokens'] / max(on_['computed_prompt_tokens'], 1):.2f}x "
        "fewer"
    )


if __name__ == "__main__":
    main()
