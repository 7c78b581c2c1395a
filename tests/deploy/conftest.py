"""Shared fixtures: one Ray cluster and one Serve instance on loopback, the apps started once.

`raylm` is deploy.yaml itself, deployed with the `serve run` CLI exactly as users do (onto this
session's cluster); `tiny` is a random two-layer Llama built here, served through run_app
(serve.run without its one-second status poll) with an API key and a small admission limit (the
overload and auth tests use it).
"""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from workers.distributed import free_port

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

from ray import serve
from ray.serve import Application, RunTarget
from ray.serve.handle import DeploymentHandle

ROOT = Path(__file__).resolve().parents[2]
SMOL = "SmolLM2-135M-Instruct"
TINY = "tiny-llama"
TINY_KEY = "test-key"
# A second tenant's key on `tiny` (TINY_KEY is the app's api_key: tenant "default", admin).
TINY_TENANT_KEY = "test-key-second-tenant"
# The tiny app's Batch API caps (test_batch_api.py).
BATCH_MAX_FILE_BYTES = 1 << 20
BATCH_MAX_LINES = 1000
BATCH_MAX_LINE_BYTES = 64 << 10
BATCH_QUOTA_BYTES = 3 << 20


@pytest.fixture(scope="session")
def http_port(ray_cluster):
    serve.shutdown()  # a Serve instance left by another module may run without HTTP proxies
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    return port


@pytest.fixture(scope="session")
def smol_url(ray_cluster, http_port):
    """deploy.yaml, deployed by `serve run deploy.yaml` (non-blocking) onto this cluster."""
    env = {**os.environ, "RAY_ADDRESS": ray_cluster}
    subprocess.run(
        [str(Path(sys.executable).parent / "serve"), "run", "deploy.yaml", "--non-blocking"],
        cwd=ROOT,
        env=env,
        check=True,
        timeout=300,
        capture_output=True,
    )
    _wait_running("raylm")
    # No serve.delete: a session app lives until ray_cluster's serve.shutdown(), which stops every
    # app at once (three deletes in turn cost ~3 s each at the end of the suite).
    return f"http://127.0.0.1:{http_port}/v1"


def _wait_running(app: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = serve.status().applications.get(app)
        if status is not None and status.status == "RUNNING":
            return
        if status is not None and status.status == "DEPLOY_FAILED":
            raise RuntimeError(f"app {app} failed: {status.message}")
        time.sleep(0.1)  # a bounded poll: Serve deploys the app in other processes
    raise TimeoutError(f"app {app} not running after {timeout}s")


def run_app(app: Application, name: str, route_prefix: str | None) -> DeploymentHandle:
    """serve.run, seeing the app RUNNING within 0.1 s: serve.run rechecks a deploying app once a
    second (Serve's CLIENT_POLLING_INTERVAL_S, not a setting), half a second lost on average per
    deploy. Serve marks the app DEPLOYING before run_many returns, so a redeploy of a running
    app is waited for too."""
    target = RunTarget(app, name=name, route_prefix=route_prefix)
    (handle,) = serve.run_many([target], wait_for_applications_running=False)
    _wait_running(name)
    return handle


@pytest.fixture(scope="session")
def tiny_url(ray_cluster, http_port, tiny_model_dir, tmp_path_factory):
    from deploy.app import build_app

    args = {
        "model": tiny_model_dir,
        "served_model_name": TINY,
        "max_model_len": 256,
        "num_gpu_blocks": 64,
        "kv_cache_memory_gb": 0.1,
        "api_key": TINY_KEY,
        "api_keys": {TINY_TENANT_KEY: {"tenant": "second"}},
        "max_ongoing_requests": 2,
        "max_queued_requests": 2,
        "max_embedding_tokens": 1024,  # test_api_embedding_budget.py
        "allow_weight_updates": True,  # test_api_weights.py
        # test_batch_api.py: this session's own folder, and caps small enough to reach.
        "batch_dir": str(tmp_path_factory.mktemp("batch")),
        "batch_max_file_bytes": BATCH_MAX_FILE_BYTES,
        "batch_max_lines": BATCH_MAX_LINES,
        "batch_max_line_bytes": BATCH_MAX_LINE_BYTES,
        "batch_quota_bytes": BATCH_QUOTA_BYTES,
        "batch_lines_in_flight": 2,
        "replica_num_cpus": 0.5,
        "ingress_num_cpus": 0.25,
    }
    run_app(build_app(args), "tiny", "/tiny")
    return f"http://127.0.0.1:{http_port}/tiny/v1"  # stopped with the others (smol_url)


# A reasoning template: the assistant's turn opens a think block, as Qwen3's thinking templates
# and DeepSeek-R1's do; `<think>` and `</think>` are single (non-special) tokens.
THINK = "tiny-think"
THINK_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
)


def write_think_model(path: str, smollm2_dir: str) -> str:
    """The tiny served Llama with SmolLM2's tokenizer, the think markers and THINK_TEMPLATE."""
    from transformers import AutoTokenizer

    from tests.random_checkpoint import TINY_SERVED_LLAMA, write_random_checkpoint

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    tokenizer.add_tokens(["<think>", "</think>"])
    tokenizer.chat_template = THINK_TEMPLATE
    return write_random_checkpoint(TINY_SERVED_LLAMA, path, tokenizer=tokenizer).path


@pytest.fixture(scope="session")
def think_url(ray_cluster, http_port, tmp_path_factory, smollm2_dir):
    """A reasoning app: the think model under the qwen3 reasoning parser, no key."""
    from deploy.app import build_app

    args = {
        "model": write_think_model(str(tmp_path_factory.mktemp("think")), smollm2_dir),
        "served_model_name": THINK,
        "max_model_len": 256,
        "num_gpu_blocks": 64,
        "kv_cache_memory_gb": 0.1,
        "reasoning_parser": "qwen3",
        "replica_num_cpus": 0.5,
        "ingress_num_cpus": 0.25,
    }
    run_app(build_app(args), "think", "/think")
    return f"http://127.0.0.1:{http_port}/think/v1"  # stopped with the others (smol_url)


# A tiny LLaVA (tests/workers/vision_checkpoints.py), a tiny Qwen2.5-VL
# (tests/workers/qwen2_vl_checkpoint.py) and a tiny Gemma 3 (tests/workers/gemma3_checkpoint.py)
# with their real processors, three models of one app (one ingress) served with a low image count
# cap (tests/deploy/test_images_api.py reaches them).
VISION = "tiny-llava"
VISION_QWEN = "tiny-qwen2-vl"
VISION_GEMMA = "tiny-gemma3"
VISION_MAX_IMAGES = 4
VISION_MAX_IMAGE_BYTES = 4 << 20


@pytest.fixture(scope="session")
def vision_model_dir(tmp_path_factory, smollm2_dir) -> str:
    from transformers import AutoTokenizer

    from tests.workers.vision_checkpoints import write_tiny_llava

    path = str(tmp_path_factory.mktemp("tiny-llava"))
    return write_tiny_llava(path, AutoTokenizer.from_pretrained(smollm2_dir)).path


@pytest.fixture(scope="session")
def qwen_vl_model_dir(tmp_path_factory) -> str:
    from tests.workers.qwen2_vl_checkpoint import write_tiny_qwen2_vl

    path = str(tmp_path_factory.mktemp("tiny-qwen2-vl"))
    write_tiny_qwen2_vl(path, seed=1)
    return path


@pytest.fixture(scope="session")
def gemma3_model_dir(tmp_path_factory, smollm2_tokenizer) -> str:
    from tests.workers.gemma3_checkpoint import write_tiny_gemma3

    path = str(tmp_path_factory.mktemp("tiny-gemma3"))
    return write_tiny_gemma3(path, smollm2_tokenizer, seed=1).path


@pytest.fixture(scope="session")
def vision_url(ray_cluster, http_port, vision_model_dir, qwen_vl_model_dir, gemma3_model_dir):
    """A vision app: the tiny LLaVA, the tiny Qwen2.5-VL and the tiny Gemma 3, no key."""
    from deploy.app import build_app

    args = {
        "models": [
            {"name": VISION, "model": vision_model_dir},
            {"name": VISION_QWEN, "model": qwen_vl_model_dir},
            {"name": VISION_GEMMA, "model": gemma3_model_dir},
        ],
        "max_model_len": 256,
        "num_gpu_blocks": 64,
        "kv_cache_memory_gb": 0.1,
        "max_images_per_request": VISION_MAX_IMAGES,
        "max_image_bytes": VISION_MAX_IMAGE_BYTES,
        "replica_num_cpus": 0.5,
        "ingress_num_cpus": 0.25,
    }
    run_app(build_app(args), "vision", "/vision")
    return f"http://127.0.0.1:{http_port}/vision/v1"  # stopped with the others (smol_url)


def delete_app(name: str) -> None:
    """Delete a module's app without waiting for it to stop: Serve stops its replicas and ingress
    in the background (each waits out its graceful-shutdown loop, ~3-5 s), and no later test
    uses the app's name, its route or its actors."""
    serve.delete(name, _blocking=False)


def replica_stats(app: str) -> dict:
    """The scheduler figures of the app's (single) LLMReplica."""
    return (
        serve.get_deployment_handle("LLMReplica", app_name=app).stats.remote().result(timeout_s=30)
    )


def wait_for(predicate, timeout: float = 30.0, interval: float = 0.1):
    """Poll predicate until it holds or timeout passes (what it reads changes in other processes);
    its last value."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)
