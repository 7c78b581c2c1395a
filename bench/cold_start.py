"""Cold start: from the scale-up decision to the first token, by phase.

Deploys the embedded model (deploy.yaml's settings) autoscaled from zero replicas, then, --runs
times: waits until the deployment is at zero, sends one streamed request, and times its first
token. The scale-up decision is read from Serve's controller log (its "Upscaling ... from 0"
line); the wait from the request to it is shown apart (Serve 2.60 skips the upscale delay from
zero, but the decision still waits for a handle's metrics push). The replica reports its own
phases (cluster/cold_start.py); between the decision and its process lie the placement group and
the actor's worker process.

  python bench/cold_start.py                 # the embedded SmolLM2 on CPU, 3 cold starts
  python bench/cold_start.py --runs 1 --model /path/to/hf-dir --device cuda
  python bench/cold_start.py --offline       # the replica's own phases in fresh processes, no
                                             # Ray: imports, engine build, first token

Prints a table by phase (seconds) per run; timings are printed, never asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from datetime import datetime
from pathlib import Path

import httpx
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

APP = "coldstart"
DEPLOYMENT = "LLMReplica"
# The replica's phases in the order they happen (cluster/cold_start.py).
REPLICA_PHASES = (
    "process_and_imports",
    "model_config",
    "weights",
    "kv_profile",
    "kv_allocation",
    "ready",
    "first_request",
    "first_token",
)


def app_args(model: str | None, device: str | None) -> dict:
    """deploy.yaml's args, autoscaled from zero with a short idle delay."""
    spec = yaml.safe_load((Path(__file__).resolve().parents[1] / "deploy.yaml").read_text())
    args = dict(spec["applications"][0]["args"])
    args.pop("num_replicas", None)
    if model is not None:
        args["model"] = model
        args.pop("served_model_name", None)
    if device is not None:
        args["device"] = device
    args["autoscaling"] = {
        "min_replicas": 0,
        "initial_replicas": 0,
        "max_replicas": 1,
        "upscale_delay_s": 0,
        "downscale_delay_s": 1,
    }
    args["graceful_shutdown_timeout_s"] = 1
    return args


def running_replicas() -> int:
    from ray import serve

    status = serve.status().applications[APP].deployments[DEPLOYMENT]
    return sum(n for state, n in status.replica_states.items() if str(state).endswith("RUNNING"))


# After the last replica stops, the ingress's handle learns it through a long poll; a request sent
# before that finds a replica listed, skips Serve's immediate scale-from-zero push and waits for
# the periodic one (up to 10 s). An app idle long enough to scale to zero is past that window.
HANDLE_CATCH_UP_S = 3.0


def wait_for_zero(timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while running_replicas() and time.monotonic() < deadline:
        time.sleep(0.2)  # a bounded poll: the controller scales down in its own process
    time.sleep(HANDLE_CATCH_UP_S)


def first_token(url: str, model: str) -> tuple[float, float]:
    """(send time, first-token time) of one streamed request, both time.time()."""
    body = {"model": model, "prompt": "Hello", "max_tokens": 2, "stream": True}
    sent = time.time()
    with httpx.stream("POST", f"{url}/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and '"text"' in line:
                return sent, time.time()
    raise RuntimeError("the stream ended without a token")


_UPSCALE = re.compile(
    r"^INFO (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*Upscaling Deployment\(name='"
    + DEPLOYMENT
    + r"', app='"
    + APP
    + r"'\) from 0 to"
)


def decision_time(after: float) -> float | None:
    """When Serve's controller decided to scale up from zero (its log line), the first decision
    at or after `after` (time.time())."""
    import ray

    logs = Path(ray._private.worker._global_node.get_session_dir_path()) / "logs" / "serve"
    times = []
    for path in logs.glob("controller_*.log"):
        for line in path.read_text(errors="replace").splitlines():
            match = _UPSCALE.match(line)
            if match:
                stamp = datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
                times.append(stamp)
    later = [t for t in times if t >= after - 0.5]  # the log's clock is read to the millisecond
    return min(later) if later else None


def one_run(url: str, model: str) -> dict[str, float]:
    from ray import serve

    wait_for_zero()
    sent, first = first_token(url, model)
    handle = serve.get_deployment_handle(DEPLOYMENT, app_name=APP)
    report = handle.cold_start_report.remote().result(timeout_s=60)
    phases, marks = report["phases"], report["marks"]
    decided = decision_time(sent)
    nan = float("nan")
    row = {"request_to_first_token": first - sent}
    row["decision_wait"] = decided - sent if decided is not None else nan
    row["total_from_decision"] = first - decided if decided is not None else nan
    start = marks.get("process_start")
    # Between the decision and the process: the placement group and the actor's worker process
    # (negative where Ray handed the actor a worker process it had started before).
    row["placement_and_process_start"] = (
        start - decided if start is not None and decided is not None else nan
    )
    row.update({p: phases.get(p, float("nan")) for p in REPLICA_PHASES})
    row["stream_to_client"] = first - marks.get("first_token", first)
    return row


def print_table(rows: list[dict[str, float]]) -> None:
    names = [
        "decision_wait",
        "placement_and_process_start",
        *REPLICA_PHASES,
        "stream_to_client",
        "total_from_decision",
        "request_to_first_token",
    ]
    head = "| phase | " + " | ".join(f"run {i + 1}" for i in range(len(rows))) + " |"
    print(head)
    print("| --- |" + " --- |" * len(rows))
    for name in names:
        print(f"| {name} | " + " | ".join(f"{r.get(name, float('nan')):.2f}" for r in rows) + " |")


def offline_child(model: str | None, device: str | None) -> None:
    """In a fresh process: what a replica does from its imports to its first token, timed, as
    JSON on stdout (no Ray, no Serve: the replica's own share of a cold start)."""
    from cluster.cold_start import process_start_time

    started = time.time()
    import cluster.replica  # noqa: F401 - what Serve imports to build the replica
    from deploy.config import AppConfig
    from engine.core import EngineCore
    from scheduler.request import EngineRequest
    from scheduler.sampling_params import SamplingParams

    row = {}
    process = process_start_time()
    row["process_and_imports"] = time.time() - (process if process is not None else started)
    engine = EngineCore(AppConfig.from_args(app_args(model, device)).engine)
    row.update(engine.startup)
    arrival = time.time()
    params = SamplingParams(max_tokens=2, temperature=0.0)
    engine.add_request(EngineRequest("cold", [1, 2, 3, 4], params))
    while not any(o.new_token_ids for o in engine.step()):
        pass
    row["first_token"] = time.time() - arrival
    row["total"] = time.time() - (process if process is not None else started)
    print(json.dumps(row))


def offline(runs: int, model: str | None, device: str | None) -> list[dict[str, float]]:
    import subprocess

    rows = []
    for i in range(runs):
        command = [sys.executable, __file__, "--offline-child"]
        command += ["--model", model] if model else []
        command += ["--device", device] if device else []
        out = subprocess.run(command, capture_output=True, text=True, check=True, timeout=600)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(f"run {i + 1}: first token {rows[-1]['total']:.2f} s after exec", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--model", default=None, help="an HF directory (default: deploy.yaml's)")
    parser.add_argument("--device", default=None)
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument("--offline", action="store_true", help="no Ray: the replica's phases")
    parser.add_argument("--offline-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.offline_child:
        offline_child(args.model, args.device)
        return
    if args.offline:
        rows = offline(args.runs, args.model, args.device)
        names = ["process_and_imports", *REPLICA_PHASES[1:5], "first_token", "total"]
        print("| phase | " + " | ".join(f"run {i + 1}" for i in range(len(rows))) + " |")
        print("| --- |" + " --- |" * len(rows))
        for name in names:
            print(f"| {name} | " + " | ".join(f"{r.get(name, 0.0):.2f}" for r in rows) + " |")
        if args.json is not None:
            args.json.write_text(json.dumps(rows, indent=1))
        return
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray
    from ray import serve

    from deploy.app import build_app
    from deploy.config import AppConfig
    from workers.distributed import free_port

    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    config = app_args(args.model, args.device)
    model = AppConfig.from_args(config).model_name
    serve.run(build_app(config), name=APP, route_prefix="/")
    url = f"http://127.0.0.1:{port}/v1"
    rows = []
    try:
        for i in range(args.runs):
            rows.append(one_run(url, model))
            total = rows[-1]["total_from_decision"]
            print(f"run {i + 1}: first token {total:.2f} s after the decision", flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
    print_table(rows)
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
