"""Speculative decoding on and off in the simulator, at batch 1, 8 and 32.

    python -m sim.spec_study --profiles cpu h100 --batches 1 8 32 --accept-rate 0.825
    python -m sim.spec_study --accept-probs 0.17,0.14,0.12,0.1,0.47

One replica gets a batch of requests at once (128-token prompts, `--output-len` tokens each) and
decodes them plain, with speculation at the engine's defaults
(SpecPolicy: no speculation in a batch over `max_batch_size`, nor for a request whose acceptance
fell under `min_acceptance_rate`), and with `max_batch_size` raised to the largest batch. Prints
output tokens/s, the time per output token after the first (TPOT), the p90 gap between a request's
token emissions (ITL: a verify step emits several tokens at once), and the acceptance observed.
"""

from __future__ import annotations

import argparse
import time

from scheduler import SchedulerConfig
from scheduler.speculative import SpeculativeConfig
from sim.cost import load_profile
from sim.fleet import FleetSim
from sim.fleet_config import SimConfig
from sim.metrics import RequestRecord, percentile
from sim.speculation import AcceptanceConfig, SpecSimConfig
from sim.workload import SimRequest


def batch(size: int, prompt_len: int = 128, output_len: int = 96) -> list[SimRequest]:
    return [SimRequest(f"r{i}", 0.0, prompt_len, output_len) for i in range(size)]


def run(profile: str, size: int, spec: SpecSimConfig | None, output_len: int) -> dict[str, float]:
    sched = SchedulerConfig(num_gpu_blocks=4096, max_model_len=4096)
    sim = FleetSim(SimConfig(num_replicas=1, scheduler=sched, spec=spec), load_profile(profile))
    result = sim.run(batch(size, output_len=output_len))
    done = result.records
    tokens = sum(r.num_output_tokens for r in done)
    end = max(r.finish_s or 0.0 for r in done)
    tpot = _tpots(done)
    stats = sim.replicas[0].scheduler.stats()
    proposed, accepted = stats.num_spec_proposed_tokens, stats.num_spec_accepted_tokens
    rows = stats.num_spec_verify_rows
    return {
        "tok_s": tokens / end if end > 0 else 0.0,
        "tpot_s": sum(tpot) / len(tpot) if tpot else 0.0,
        "itl_p90_s": percentile([g for r in done for g in r.itl_s], 90),
        "acceptance": accepted / proposed if proposed else 0.0,
        "mean_accepted": accepted / rows if rows else 0.0,
    }


def _tpots(done: list[RequestRecord]) -> list[float]:
    """Each request's time per output token after its first (those with more than one)."""
    return [
        (r.finish_s - r.first_token_s) / (r.num_output_tokens - 1)
        for r in done
        if r.finish_s is not None and r.first_token_s is not None and r.num_output_tokens > 1
    ]


def main(argv: list[str] | None = None) -> None:
    a = _parser().parse_args(argv)
    k = a.num_tokens
    acceptance = _acceptance(a)
    print(
        f"k = {k}, acceptance P(accepted length 0..{k}) = "
        f"{', '.join(f'{x / sum(acceptance.probs):.3f}' for x in acceptance.probs[: k + 1])}"
        f" (mean accepted {acceptance.mean_accepted(k):.2f}); {a.output_len} tokens a request\n"
    )
    print(
        "| profile | batch | engine | tokens/s | speedup | TPOT (ms) | ITL p90 (ms) | acceptance "
        "| mean accepted length | wall (s) |"
    )
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    engines = _engines(k, max(a.batches), acceptance)
    for profile in a.profiles:
        for size in a.batches:
            _print_rows(a, profile, size, engines)


def _acceptance(a: argparse.Namespace) -> AcceptanceConfig:
    """--accept-probs as given, else --accept-rate per proposed token."""
    if a.accept_probs:
        return AcceptanceConfig(tuple(float(x) for x in a.accept_probs.split(",")), a.seed)
    return AcceptanceConfig.per_token(a.accept_rate, a.num_tokens, a.seed)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sim.spec_study")
    p.add_argument("--profiles", nargs="+", default=["cpu", "h100"])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--num-tokens", type=int, default=SpeculativeConfig().num_tokens)
    p.add_argument(
        "--accept-rate",
        type=float,
        default=0.825,
        help="each proposed token accepted with this probability until the first rejection",
    )
    p.add_argument("--accept-probs", help="P(accepted length = 0..k), comma-separated")
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument(
        "--graphs-profiles",
        nargs="*",
        default=["h100"],
        help="profiles of CUDA-graph engines: also price verify steps as graph replays",
    )
    p.add_argument("--seed", type=int, default=0)
    return p


_Engine = tuple[str, SpecSimConfig | None, bool]  # (name, speculation, verify graphs)


def _engines(k: int, max_batch: int, acceptance: AcceptanceConfig) -> list[_Engine]:
    """Plain decoding, then speculation by default, up to the largest batch, and with graphs."""
    wide = SpeculativeConfig(num_tokens=k, max_batch_size=max_batch)
    return [
        ("plain", None, False),
        ("spec (defaults)", SpecSimConfig(SpeculativeConfig(num_tokens=k), acceptance), False),
        (f"spec, max_batch_size {max_batch}", SpecSimConfig(wide, acceptance), False),
        (
            f"spec, max_batch_size {max_batch}, verify graphs",
            SpecSimConfig(wide, acceptance, True),
            True,
        ),
    ]


def _print_rows(a: argparse.Namespace, profile: str, size: int, engines: list[_Engine]) -> None:
    """One table row per engine at this profile and batch, speedups against plain decoding."""
    base = 0.0
    for name, spec, graphs in engines:
        if graphs and profile not in a.graphs_profiles:
            continue
        t0 = time.perf_counter()
        f = run(profile, size, spec, a.output_len)
        base = base or f["tok_s"]
        print(
            f"| {profile} | {size} | {name} | {f['tok_s']:.1f} | "
            f"{f['tok_s'] / base:.2f}x | {f['tpot_s'] * 1e3:.2f} | "
            f"{f['itl_p90_s'] * 1e3:.2f} | {f['acceptance']:.2f} | "
            f"{f['mean_accepted']:.2f} | {time.perf_counter() - t0:.1f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
