"""The `llm` autoscaling policy served, against Serve's default (ongoing-requests) policy, over a
compressed day: replica-seconds and SLO attainment from the app's own metrics.

One Serve app per policy, one after the other on the same Ray instance (so they never share the
CPU), each serving the tiny random Llama on CPU with the same bounds, delays, look-back and SLO.
The day is `sim.autoscale.day_workload`'s (a cosine from trough to peak and back, chat by day and
long documents taking a larger share by night), its lengths shrunk to the tiny model's 256
positions and its duration to `--day-s`. Every request is sent at its arrival time, whatever the
replies (an open loop, as users arrive).

Measured, per policy:
- replica-seconds: Serve's replicas of the model, running and starting (what a cloud bills),
  polled about every 0.5 s (`serve.status()`);
- SLO attainment: `raylm_slo_requests_total{slo="met"|"missed"}` from Ray's metrics export (each
  replica judges each finished request against the model's TTFT and ITL SLO);
- the count's changes and its peak, and requests that failed.

    python bench/autoscale_served.py [--day-s 150] [--peak-rate 6] [--max-replicas 3]

Prints figures and ratios and never passes or fails on them. On a shared 2-core machine the
latencies are the machine's load as much as the policy's; read the replica-seconds first.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import re
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx

from sim.autoscale import DayWorkloadConfig, day_workload
from sim.workload import SimRequest

POLICIES = ("llm", "ongoing_requests")


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES))
    p.add_argument("--day-s", type=float, default=150.0, help="the compressed day's length")
    p.add_argument("--peak-rate", type=float, default=3.0, help="requests per second at the peak")
    p.add_argument("--peak-to-trough", type=float, default=6.0)
    p.add_argument("--max-replicas", type=int, default=3)
    p.add_argument("--max-num-seqs", type=int, default=4)
    p.add_argument("--num-gpu-blocks", type=int, default=64, help="KV blocks of 16 per replica")
    p.add_argument(
        "--target-ongoing-requests",
        type=float,
        default=3.0,
        help="Serve's policy: 0.75 x max_num_seqs, the llm policy's batch target",
    )
    p.add_argument("--downscale-delay", type=float, default=10.0, help="both policies")
    p.add_argument("--look-back", type=float, default=2.0, help="Serve's look_back_period_s")
    p.add_argument("--slo-ttft", type=float, default=2.0, help="TTFT p90 SLO, seconds")
    p.add_argument("--slo-itl", type=float, default=0.2, help="ITL p90 SLO, seconds")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def workload(a: argparse.Namespace) -> list[SimRequest]:
    """The simulator's day, its lengths fitted to 256 positions."""
    return day_workload(
        DayWorkloadConfig(
            day_s=a.day_s,
            peak_rate=a.peak_rate,
            peak_to_trough=a.peak_to_trough,
            tenants=8,
            system_prompt_len=16,
            chat_question_len=(4, 32),
            chat_output_len=(8, 32),
            long_prompt_len=(96, 160),
            long_output_len=(32, 64),
            seed=a.seed,
        )
    )


def app_args(a: argparse.Namespace, policy: str, model_dir: str) -> dict:
    autoscaling = {
        "policy": policy,
        "min_replicas": 1,
        "max_replicas": a.max_replicas,
        "upscale_delay_s": 0,
        "downscale_delay_s": a.downscale_delay,
        "metrics_interval_s": 0.5,
        "look_back_period_s": a.look_back,
        "slo": {"ttft_p90_s": a.slo_ttft, "itl_p90_s": a.slo_itl},
    }
    if policy == "ongoing_requests":
        autoscaling["target_ongoing_requests"] = a.target_ongoing_requests
    return {
        "max_model_len": 256,
        "num_gpu_blocks": a.num_gpu_blocks,
        "max_num_seqs": a.max_num_seqs,
        "replica_num_cpus": 0.5,
        "ingress_num_cpus": 0.25,
        "graceful_shutdown_timeout_s": 20,
        "models": [{"name": _model(policy), "model": model_dir, "autoscaling": autoscaling}],
    }


def _model(policy: str) -> str:
    return f"day-{policy.replace('_', '-')}"


@dataclass(slots=True)
class Polls:
    """Serve's replica count of the model polled through the day: (t, running and starting)."""

    samples: list[tuple[float, int]] = field(default_factory=list)

    def replica_seconds(self) -> float:
        return sum((t1 - t0) * n for (t0, n), (t1, _) in itertools.pairwise(self.samples))

    def changes(self) -> int:
        counts = [n for _, n in self.samples]
        return sum(1 for x, y in itertools.pairwise(counts) if x != y)


def _billed(app: str, model: str) -> int:
    from ray import serve

    status = serve.status().applications.get(app)
    deployment = None if status is None else status.deployments.get(f"LLMReplica-{model}")
    states = {} if deployment is None else {str(k): v for k, v in deployment.replica_states.items()}
    return sum(states.get(s, 0) for s in ("RUNNING", "STARTING", "PENDING_MIGRATION"))


def _poll(app: str, model: str, stop: threading.Event, polls: Polls) -> None:
    t0 = time.monotonic()
    while not stop.is_set():
        try:
            polls.samples.append((time.monotonic() - t0, _billed(app, model)))
        except Exception:  # a missed poll is a gap in the figures, not an end
            pass
        time.sleep(0.5)


async def _send(
    client: httpx.AsyncClient, model: str, r: SimRequest, t0: float, out: list[str]
) -> None:
    await asyncio.sleep(max(0.0, r.arrival_s - (time.monotonic() - t0)))
    words = max(1, r.prompt_len - 1)
    body = {
        "model": model,
        "prompt": f"{r.tenant} " + "word " * words,
        "max_tokens": r.output_len,
        "ignore_eos": True,
        "temperature": 0.0,
    }
    try:
        reply = await client.post("/completions", json=body)
        out.append("ok" if reply.status_code == 200 else f"http {reply.status_code}")
    except Exception as exc:  # counted and shown, the day goes on
        out.append(type(exc).__name__)


async def _day(url: str, model: str, requests: list[SimRequest]) -> list[str]:
    out: list[str] = []
    limits = httpx.Limits(max_connections=512)
    async with httpx.AsyncClient(base_url=f"{url}/v1", timeout=300, limits=limits) as client:
        t0 = time.monotonic()
        await asyncio.gather(*(_send(client, model, r, t0, out) for r in requests))
    return out


def _slo_counts(metrics_port: int, model: str) -> tuple[float, float]:
    page = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10)
    text = page.read().decode()
    counts = {"met": 0.0, "missed": 0.0}
    for labels, value in re.findall(r"^ray_raylm_slo_requests_total\{([^}]*)\} (\S+)$", text, re.M):
        if f'model="{model}"' in labels:
            outcome = re.search(r'slo="(\w+)"', labels)
            if outcome is not None and outcome.group(1) in counts:
                counts[outcome.group(1)] += float(value)
    return counts["met"], counts["missed"]


def run_policy(a: argparse.Namespace, policy: str, model_dir: str, port: int, mport: int) -> dict:
    from ray import serve

    from deploy.app import build_app

    app, model = f"day-{policy}", _model(policy)
    serve.run(build_app(app_args(a, policy, model_dir)), name=app, route_prefix=f"/{app}")
    url = f"http://127.0.0.1:{port}/{app}"
    try:
        deadline = time.monotonic() + 300
        while _billed(app, model) != 1 and time.monotonic() < deadline:
            time.sleep(0.5)
        requests = workload(a)
        polls, stop = Polls(), threading.Event()
        poller = threading.Thread(target=_poll, args=(app, model, stop, polls))
        poller.start()
        t0 = time.monotonic()
        outcomes = asyncio.run(_day(url, model, requests))
        wall = time.monotonic() - t0
        stop.set()
        poller.join()
        time.sleep(4)  # Ray's export reports every second; let the last counts land
        met, missed = _slo_counts(mport, model)
    finally:
        serve.delete(app)
    return {
        "policy": policy,
        "requests": len(requests),
        "failed": dict(Counter(o for o in outcomes if o != "ok")),
        "wall_s": wall,
        "replica_s": polls.replica_seconds(),
        "peak": max((n for _, n in polls.samples), default=0),
        "changes": polls.changes(),
        "met": met,
        "missed": missed,
    }


def _tiny_model(path: str) -> str:
    from transformers import AutoTokenizer

    from tests.random_checkpoint import TINY_SERVED_LLAMA, write_random_checkpoint
    from workers.model_files import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(resolve_model("default"))
    tokenizer.chat_template = None
    spec = TINY_SERVED_LLAMA.with_fields(max_position_embeddings=256)
    return write_random_checkpoint(spec, path, tokenizer=tokenizer).path


def main(argv: list[str] | None = None) -> None:
    a = _args(argv)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray
    from ray import serve

    from workers.distributed import free_port

    requests = workload(a)
    print(
        f"# a {a.day_s:g} s day, {len(requests)} requests, peak {a.peak_rate:g} req/s, "
        f"peak:trough {a.peak_to_trough:g}; tiny random Llama on CPU, 1-{a.max_replicas} "
        f"replicas, max_num_seqs {a.max_num_seqs}, {a.num_gpu_blocks} KV blocks; SLO TTFT "
        f"{a.slo_ttft:g} s, ITL p90 {a.slo_itl:g} s; upscale/downscale delay 0/"
        f"{a.downscale_delay:g} s, look-back {a.look_back:g} s; Serve's policy at "
        f"target_ongoing_requests {a.target_ongoing_requests:g}",
        flush=True,
    )
    mport = free_port()
    ray.init(
        num_cpus=8,
        include_dashboard=False,
        log_to_driver=False,
        _node_ip_address="127.0.0.1",
        _metrics_export_port=mport,
        _system_config={"metrics_report_interval_ms": 1000},
    )
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = _tiny_model(tmp)
        for policy in a.policies:
            rows.append(run_policy(a, policy, model_dir, port, mport))
            print("done:", rows[-1], flush=True)
    serve.shutdown()
    ray.shutdown()
    report(rows)


def report(rows: list[dict]) -> None:
    print(
        "\n| policy | requests | failed | wall (s) | replica-seconds | peak | changes | SLO met | "
        "missed | attainment |\n| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: "
        "| ---: |"
    )
    for r in rows:
        judged = r["met"] + r["missed"]
        share = f"{r['met'] / judged:.2%}" if judged else "n/a"
        print(
            f"| {r['policy']} | {r['requests']} | {r['failed'] or 0} | {r['wall_s']:.0f} | "
            f"{r['replica_s']:.0f} | {r['peak']} | {r['changes']} | {r['met']:.0f} | "
            f"{r['missed']:.0f} | {share} |"
        )
    by = {r["policy"]: r for r in rows}
    if len(by) == 2 and by["ongoing_requests"]["replica_s"]:
        ratio = by["llm"]["replica_s"] / by["ongoing_requests"]["replica_s"]
        print(f"\nllm / ongoing_requests replica-seconds: {ratio:.2f}")


if __name__ == "__main__":
    main()
