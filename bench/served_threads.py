"""deploy.yaml's app with the replica's bundle at N CPUs (its torch threads follow), under
`bench/serve_bench.py`'s client at concurrency 8 with 158-token prompts (the load GuideLLM put on
`make serve`).

    python bench/served_threads.py 1    # the old default: one CPU, one torch thread
    python bench/served_threads.py 2    # deploy.yaml now: both cores of a 2-core machine
"""

import os
import subprocess
import sys

import yaml

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
import ray
from ray import serve

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from deploy.app import build_app

cpus = float(sys.argv[1])
with open("deploy.yaml") as f:
    args = yaml.safe_load(f)["applications"][0]["args"]
args.update(replica_num_cpus=cpus, ingress_num_cpus=0.0 if cpus >= 2 else 0.5)
ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
serve.start(http_options={"host": "127.0.0.1", "port": 8011})
serve.run(build_app(args), name="raylm", route_prefix="/")
subprocess.run(
    [
        sys.executable,
        "bench/serve_bench.py",
        "--base-url",
        "http://127.0.0.1:8011/v1",
        "--model",
        "SmolLM2-135M-Instruct",
        "--num-prompts",
        "32",
        "--max-concurrency",
        "8",
        "--input-len",
        "158",
        "--output-len",
        "64",
        "--vocab-size",
        "49152",
        "--json",
        f"/tmp/threads{int(cpus)}.json",
    ],
    check=True,
)
serve.shutdown()
ray.shutdown()
