"""How late a served replica answers: its event loop's lag and Serve's queue-length probe.

Serve's routers skip a replica whose `get_num_ongoing_requests` probe does not answer within
RAY_SERVE_QUEUE_LENGTH_RESPONSE_DEADLINE_S (0.1 s). Starts deploy.yaml's app (Serve on 127.0.0.1,
this process's own Ray cluster, the deadline left at Serve's default), then from the moment the
replica reports ready:

  probe RTT   a separate actor (another process, as a router is) calls the replica actor's
              get_num_ongoing_requests every 50 ms and times each answer; "missed": over 0.1 s
  loop lag    the replica's own sampler (cluster/loop_lag.py): how late its event loop wakes a
              50 ms timer, max and p99 over the first 60 s of its life and over the last 60 s

with `--concurrency` streamed completions kept in flight from the first second (a fresh replica
is routed a burst at once) for `--seconds` per phase: phase 1 is the replica's first 60 s,
phase 2 the steady state after it. Prints each phase's figures and the load average beside them.

  python bench/replica_loop_lag.py                      # concurrency 8, 60 s + 60 s
  python bench/replica_loop_lag.py --py-spy /tmp/spy    # + py-spy --gil of the replica's first 20 s
  python bench/replica_loop_lag.py --asyncio-debug      # + asyncio's slow-callback log in each
                                                        #   worker's log (worker-*.err)
Timings are printed, never asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import ray

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

from bench.served_path import app_args, make_prompts, one_stream

APP = "bench"
PROBE_PERIOD_S = 0.05
DEADLINE_S = 0.1  # Serve's default RAY_SERVE_QUEUE_LENGTH_RESPONSE_DEADLINE_S


@ray.remote(num_cpus=0)
class Prober:
    """Times the replica's queue-length probe as a router in another process sees it."""

    def __init__(self) -> None:
        self.rtts: list[tuple[float, float]] = []  # (seconds since start, round trip)
        self.running = False

    async def run(self, replica_name: str, seconds: float) -> None:
        replica = ray.get_actor(replica_name, namespace="serve")
        start = time.monotonic()
        while time.monotonic() - start < seconds:
            sent = time.monotonic()
            await replica.get_num_ongoing_requests.remote()
            self.rtts.append((sent - start, time.monotonic() - sent))
            await asyncio.sleep(max(0.0, PROBE_PERIOD_S - (time.monotonic() - sent)))

    def samples(self) -> list[tuple[float, float]]:
        return self.rtts


def replica_actor_name() -> str:
    names = ray.util.list_named_actors(all_namespaces=True)
    return next(a["name"] for a in names if f"{APP}#LLMReplica" in a["name"])


async def keep_busy(url: str, model: str, prompts: list[list[int]], c: int, seconds: float) -> int:
    """`c` streams in flight until `seconds` have passed; the tokens they made."""
    import httpx

    deadline = time.monotonic() + seconds

    async def worker(i: int) -> int:
        made, k = 0, i
        while time.monotonic() < deadline:
            stream = await one_stream(client, url, model, prompts[k % len(prompts)], 64)
            made, k = made + stream.num_tokens, k + c
        return made

    limits = httpx.Limits(max_connections=c + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0), limits=limits) as client:
        return sum(await asyncio.gather(*(worker(i) for i in range(c))))


def probe_summary(rtts: list[float]) -> str:
    if not rtts:
        return "no probes"
    ranked = sorted(rtts)
    p99 = ranked[min(len(ranked) - 1, int(0.99 * len(ranked)))]
    missed = sum(r > DEADLINE_S for r in ranked)
    return (
        f"probe RTT p50 {1000 * statistics.median(ranked):.1f} ms, p99 {1000 * p99:.1f}, "
        f"max {1000 * ranked[-1]:.1f} ms; {missed}/{len(ranked)} over {1000 * DEADLINE_S:.0f} ms"
    )


def lag_summary(lag: dict) -> str:
    return f"loop lag p99 {lag['p99_ms']:.1f} ms, max {lag['max_ms']:.1f} ms ({lag['samples']})"


def start_spy(spy_dir: str, seconds: int) -> subprocess.Popen:
    from bench.serve_bench import _our_raylets

    pid = next(
        p.pid
        for p in _our_raylets()[0].children(recursive=True)
        if f"ServeReplica:{APP}:LLMReplica" in " ".join(p.cmdline())
    )
    out = Path(spy_dir) / "replica-first.txt"
    Path(spy_dir).mkdir(parents=True, exist_ok=True)
    cmd = [str(Path(sys.executable).parent / "py-spy"), "record", "--pid", str(pid)]
    cmd += ["--duration", str(seconds), "--rate", "250", "--format", "raw", "--threads"]
    cmd += ["--gil", "-o", str(out)]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def run_phases(a: argparse.Namespace, url: str, model: str, handle) -> dict:
    prober = Prober.remote()
    ray.get(prober.samples.remote())  # started before the clock runs
    probing = prober.run.remote(replica_actor_name(), 2 * a.seconds)
    spy = start_spy(a.py_spy, 20) if a.py_spy else None
    prompts = make_prompts(49152, 32, a.input_len, 7)
    figures = {}
    for phase in ("first", "steady"):
        began = time.monotonic()
        tokens = asyncio.run(keep_busy(url, model, prompts, a.concurrency, a.seconds))
        elapsed = time.monotonic() - began
        figures[phase] = {"tok_s": tokens / elapsed, "load": os.getloadavg()[0]}
        figures[phase]["loop_lag"] = handle.stats.remote().result()["loop_lag"]
    ray.get(probing)
    rtts = ray.get(prober.samples.remote())
    figures["first"]["probe"] = [r for t, r in rtts if t < a.seconds]
    figures["steady"]["probe"] = [r for t, r in rtts if t >= a.seconds]
    figures["first"]["loop_lag"] = figures["first"]["loop_lag"]["first_60s"]
    figures["steady"]["loop_lag"] = figures["steady"]["loop_lag"]["last_60s"]
    if spy is not None:
        spy.wait(timeout=120)
    return figures


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--seconds", type=float, default=60.0, help="per phase")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--py-spy", default=None, help="folder for a py-spy --gil profile")
    p.add_argument(
        "--asyncio-debug",
        action="store_true",
        help="every Ray worker's loops in debug mode: callbacks over 0.1 s are logged",
    )
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    from ray import serve

    from deploy.app import build_app
    from workers.distributed import free_port

    os.environ.pop("RAY_SERVE_QUEUE_LENGTH_RESPONSE_DEADLINE_S", None)  # Serve's default
    env = {"env_vars": {"PYTHONASYNCIODEBUG": "1"}} if a.asyncio_debug else None
    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env=env,
    )
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    args = app_args()
    try:
        serve.run(build_app(args), name=APP, route_prefix="/")
        handle = serve.get_deployment_handle("LLMReplica", APP)
        figures = run_phases(a, f"http://127.0.0.1:{port}/v1", args["served_model_name"], handle)
    finally:
        serve.shutdown()
        ray.shutdown()
    for phase, f in figures.items():
        print(
            f"{phase:6s} c={a.concurrency}: {lag_summary(f['loop_lag'])}; "
            f"{probe_summary(f['probe'])}; {f['tok_s']:.0f} tok/s; load average {f['load']:.2f}",
            flush=True,
        )
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "figures": figures}, indent=2))


if __name__ == "__main__":
    main()
