"""Cold start: from the scale-up decision to the first token, by phase.

Deploys the embedded model (deploy.yaml's settings) autoscaled from zero replicas, then, --runs
times: waits until the deployment is at zero, sends one streamed request, and times its first
token. Serve decides to scale up from zero as soon as a caller queues a request (its cold-start
path skips the upscale delay), so the request's send time stands for the decision. The replica
reports its own phases (cluster/cold_start.py); what lies before its process, placement and
Serve's start of the actor, is the rest.

  python bench/cold_start.py                 # the embedded SmolLM2 on CPU, 3 cold starts
  python bench/cold_start.py --runs 1 --model /path/to/hf-dir --device cuda

Prints a table by phase (seconds) per run; timings are printed, never asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
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


def one_run(url: str, model: str) -> dict[str, float]:
    from ray import serve

    wait_for_zero()
    sent, first = first_token(url, model)
    handle = serve.get_deployment_handle(DEPLOYMENT, app_name=APP)
    report = handle.cold_start_report.remote().result(timeout_s=60)
    phases, marks = report["phases"], report["marks"]
    row = {"total": first - sent}
    start = marks.get("process_start")
    # Before the process: Serve's decision, the placement group, the actor's worker process.
    row["decision_placement_process"] = (start - sent) if start is not None else float("nan")
    row.update({p: phases.get(p, float("nan")) for p in REPLICA_PHASES})
    row["stream_to_client"] = first - marks.get("first_token", first)
    return row


def print_table(rows: list[dict[str, float]]) -> None:
    names = ["decision_placement_process", *REPLICA_PHASES, "stream_to_client", "total"]
    head = "| phase | " + " | ".join(f"run {i + 1}" for i in range(len(rows))) + " |"
    print(head)
    print("| --- |" + " --- |" * len(rows))
    for name in names:
        print(f"| {name} | " + " | ".join(f"{r.get(name, float('nan')):.2f}" for r in rows) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--model", default=None, help="an HF directory (default: deploy.yaml's)")
    parser.add_argument("--device", default=None)
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
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
            total = rows[-1]["total"]
            print(f"run {i + 1}: first token {total:.2f} s after the request", flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
    print_table(rows)
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
