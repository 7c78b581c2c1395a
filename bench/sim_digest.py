"""Digests of the simulator's results: one hash per study fleet over every request record, the ITL
tally and every replica's steps, busy time and preemptions. A change that must not move the
simulator's results (a refactor of the scheduler or the router) leaves every digest as it was.

    python bench/sim_digest.py [--sizes 10 300] [--seconds 121] [--routing-replicas 8]

Prints one line per fleet: the digest, then the figures it covers. Floats are hashed by their
exact binary value (float.hex), so a digest changes with the last bit of any figure.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
from pathlib import Path

# Run as a script from anywhere (the GPU machine has the tree, not an install).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from router.config import POLICIES
from sim.cost import load_profile
from sim.fleet import FleetSim
from sim.metrics import SimResult
from sim.studies import FLEET_PROFILE, chat_config, chat_workload, fleet_config, fleet_workload


def _exact(value: object) -> str:
    return value.hex() if isinstance(value, float) else repr(value)


def digest(result: SimResult) -> str:
    """A 16-hex-digit digest of everything a study reads from a run."""
    h = hashlib.sha256()
    for r in result.records:
        fields = (
            r.request_id,
            r.replica,
            r.arrival_s,
            r.first_token_s,
            r.last_token_s,
            r.finish_s,
            r.num_output_tokens,
            r.cached_tokens,
            r.finish_reason,
            r.itl_p90_s,
            *r.itl_s,
        )
        h.update("|".join(map(_exact, fields)).encode())
    h.update(repr(sorted(result.itl_tally.items())).encode())
    for rep in result.replicas:
        h.update(
            f"{rep.name}|{rep.num_steps}|{_exact(rep.busy_s)}|{rep.scheduler.num_preemptions}".encode()
        )
    return h.hexdigest()[:16]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python bench/sim_digest.py")
    parser.add_argument(
        "--sizes", type=int, nargs="+", default=[10, 300], help="scale-study fleet sizes"
    )
    parser.add_argument(
        "--seconds", type=float, default=121.0, help="simulated seconds of each scale run"
    )
    parser.add_argument(
        "--rate", type=float, default=0.347, help="scale study: requests/s per replica"
    )
    parser.add_argument(
        "--routing-replicas", type=int, default=8, help="routing-study fleet (every policy)"
    )
    a = parser.parse_args(argv)
    profile = load_profile(FLEET_PROFILE)
    for n in a.sizes:
        t0 = time.perf_counter()
        result = FleetSim(chat_config(n), profile).run(
            chat_workload(n, a.seconds, a.rate), until_s=a.seconds
        )
        s = result.summary()
        print(
            f"scale   {n:5d} replicas {a.seconds:.0f} s: {digest(result)}  ({s['requests']} done, "
            f"{s['steps']} steps, "
            f"{result.jumped_steps} jumped, hit {s['hit_rate']:.4f}; "
            f"{time.perf_counter() - t0:.1f} s wall)",
            flush=True,
        )
    for policy in POLICIES:
        n = a.routing_replicas
        result = FleetSim(fleet_config(n, policy), profile).run(
            fleet_workload(n, 120.0, 2.0), until_s=120.0
        )
        s = result.summary()
        print(
            f"routing {n:5d} replicas {policy:16s}: {digest(result)}  ({s['requests']} done, "
            f"hit {s['hit_rate']:.4f}, ttft p90 {s['ttft_p90_s']:.4f})",
            flush=True,
        )


if __name__ == "__main__":
    main()
