"""`ray up` end to end on this machine: Ray's local node provider over SSH to a loopback node
(loopback_node.py), through the launcher's file sync, setup and start commands, to `serve deploy`
of a small app, an answer over HTTP, the fixed metrics port scraped, and `ray down`.

The cluster takes from ray_config.yaml what a cloud node would: its head start command (every
fixed port swapped for a free one), its rsync excludes (over a copy of this checkout, which
other processes may be writing to, plus a development machine's local state that must stay
behind) and its secrets file (~/.raylm/cluster.env,
here holding the app's API keys, which must reach the app's build through `ray start`'s
environment). Its setup commands put this checkout's .venv on the node's PATH instead of
installing torch again.

`make test-cluster-launch` runs it (RAYLM_CLUSTER_LAUNCH=1), and there anything missing fails it;
everywhere else it is skipped with that reason. Why it is not part of `make test`:
docs/development.md#the-cluster-launcher-end-to-end.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests.cluster_launch import loopback_node
from workers.distributed import free_port

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = yaml.safe_load((ROOT / "ray_config.yaml").read_text())
SHIPPED_HEAD = SHIPPED["head_start_ray_commands"][-1]
PORT_FLAG = re.compile(r"(--[a-z-]*port)=\d+")
VENV_BIN = Path(sys.executable).parent
MODEL = "tiny-llama"
KEY = "k-launch"
CLUSTER_ENV = """RAYLM_API_KEYS='{"k-launch": {"tenant": "launch", "max_priority": 0}}'\n"""
AUTH = {"authorization": f"Bearer {KEY}"}
# What a development machine has beside the checkout and no node may receive.
LOCAL_STATE = (
    ".venv/pyvenv.cfg",
    ".git/HEAD",
    "deploy/__pycache__/app.cpython-311.pyc",
    "raylm.egg-info/PKG-INFO",
    ".hypothesis/examples/0",
    ".pytest_cache/README.md",
)
# Ray's ports beyond those ray_config.yaml fixes: each defaults to one fixed number that another
# Ray on this machine may hold.
MORE_PORTS = (
    "--dashboard-port",
    "--ray-client-server-port",
    "--node-manager-port",
    "--dashboard-agent-listen-port",
    "--dashboard-agent-grpc-port",
    "--runtime-env-agent-port",
)
NODE_ENV = """\
export PATH={venv_bin}:$PATH
export PYTHONPATH=$HOME/raylm
export RAY_TMPDIR={root}/node-tmp
export RAY_AUTH_MODE=disabled
export RAY_USAGE_STATS_ENABLED=0
"""

pytestmark = [
    pytest.mark.cluster_launch,
    pytest.mark.slow,
    pytest.mark.skipif(
        os.environ.get("RAYLM_CLUSTER_LAUNCH") != "1",
        reason="needs root, sshd and a few minutes: run by `make test-cluster-launch`",
    ),
]


@pytest.fixture
def node():
    loopback_node.require_tools()
    # Short: Ray's socket paths under RAY_TMPDIR must stay under 108 characters.
    root = Path(tempfile.mkdtemp(prefix="rl-", dir="/tmp"))
    started = None
    try:
        started = loopback_node.start(root)
        yield started
    finally:
        if started is not None:
            loopback_node.stop(started)
        shutil.rmtree(root, ignore_errors=True)


def test_ray_up_serves_an_answer_and_ray_down_stops_it(node, tiny_model_dir):
    ports = _ports()
    config = _write_cluster(node, ports, tiny_model_dir)

    _ray(node, "up", "-y", "--no-config-cache", "--disable-usage-stats", str(config))
    # The excludes held: nothing of the development machine's own state reached the node.
    synced = node.home / "raylm"
    assert (synced / "deploy" / "app.py").is_file()
    assert [name for name in LOCAL_STATE if (synced / name).exists()] == []

    assert (node.home / ".raylm" / "cluster.env").read_text() == CLUSTER_ENV
    dashboard = f"http://127.0.0.1:{ports['--dashboard-port']}"
    _ray(node, "exec", str(config), f"serve deploy ~/serve/tiny.yaml -a {dashboard}")
    _wait_running(dashboard)
    _assert_answers(ports["http"])
    _assert_metrics_scraped(ports["--metrics-export-port"], ports["http"])

    _ray(node, "down", "-y", str(config))
    _wait_closed(ports["--port"])


def _ports() -> dict[str, int]:
    """A distinct free port for each flag of the shipped head command, the others and Serve."""
    names = [*PORT_FLAG.findall(SHIPPED_HEAD), *MORE_PORTS, "http"]
    ports: dict[str, int] = {}
    while len(ports) < len(names):
        port = free_port()
        if port not in ports.values():
            ports[names[len(ports)]] = port
    return ports


def _head_start(ports: dict[str, int]) -> str:
    """ray_config.yaml's head start command, its fixed ports swapped for this test's."""
    command = PORT_FLAG.sub(lambda m: f"{m[1]}={ports[m[1]]}", SHIPPED_HEAD)
    extra = " ".join(f"{flag}={ports[flag]}" for flag in MORE_PORTS)
    return f"{command} {extra} --node-ip-address=127.0.0.1 --num-cpus=2"


def _write_cluster(node: loopback_node.LoopbackNode, ports: dict[str, int], model: str) -> Path:
    env = node.root / "node_env.sh"
    env.write_text(NODE_ENV.format(venv_bin=VENV_BIN, root=node.root))
    serve_dir = node.root / "serve"
    serve_dir.mkdir()
    secrets = node.root / "secrets"
    secrets.mkdir(mode=0o700)
    (secrets / "cluster.env").write_text(CLUSTER_ENV)
    (serve_dir / "tiny.yaml").write_text(yaml.safe_dump(_serve_config(ports["http"], model)))
    # The node imports raylm from the synced copy, not from this checkout: a setup command says so.
    check_import = (
        'python -c "import os, deploy; assert deploy.__file__.startswith('
        "os.path.expanduser('~/raylm/')), deploy.__file__\""
    )
    cluster = {
        "cluster_name": node.user,
        "provider": {"type": "local", "head_ip": "127.0.0.1", "worker_ips": []},
        "auth": {
            "ssh_user": node.user,
            "ssh_private_key": str(node.key),
            "ssh_proxy_command": node.proxy_command,
        },
        "file_mounts": {
            "~/raylm": str(_checkout_copy(node.root / "checkout")),
            "~/serve": str(serve_dir),
            "~/.raylm": str(secrets),
        },
        "rsync_exclude": SHIPPED["rsync_exclude"],
        "rsync_filter": SHIPPED["rsync_filter"],
        "setup_commands": [f"echo 'source {env}' >> ~/.bashrc", check_import],
        "head_start_ray_commands": ["ray stop", _head_start(ports)],
        "worker_start_ray_commands": [],
    }
    path = node.root / "cluster.yaml"
    path.write_text(yaml.safe_dump(cluster))
    return path


def _checkout_copy(dest: Path) -> Path:
    """This checkout as a user has it (tracked and untracked files, not the ignored ones), and
    LOCAL_STATE. A copy: the launcher hashes every file under a mount before it syncs, and the
    shared working tree's caches change under it."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
        timeout=60,
    ).stdout
    for name in filter(None, listed.split(b"\0")):
        source = ROOT / os.fsdecode(name)
        if source.is_file():  # a file another process deleted since the listing is skipped
            (dest / os.fsdecode(name)).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / os.fsdecode(name))
    for name in LOCAL_STATE:
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        (dest / name).write_text("local state\n")
    return dest


def _serve_config(http_port: int, model: str) -> dict:
    args = {
        "model": model,
        "served_model_name": MODEL,
        "device": "cpu",
        "max_model_len": 256,
        "num_gpu_blocks": 64,
        "kv_cache_memory_gb": 0.1,
        "replica_num_cpus": 0.5,
        "ingress_num_cpus": 0.25,
        "api_keys_env": "RAYLM_API_KEYS",  # read where Serve builds the app, on the node
    }
    app = {"name": "raylm", "route_prefix": "/", "import_path": "deploy.app:build_app"}
    app["args"] = args
    return {"http_options": {"host": "127.0.0.1", "port": http_port}, "applications": [app]}


def _ray(node: loopback_node.LoopbackNode, *args: str) -> str:
    """The ray CLI as a user runs it; the launcher's own state under the test's temp dir."""
    env = {
        **os.environ,
        "RAY_TMPDIR": str(node.root / "launcher-tmp"),
        "RAY_AUTH_MODE": "disabled",
        "RAY_USAGE_STATS_ENABLED": "0",
    }
    done = subprocess.run(
        [str(VENV_BIN / "ray"), *args], env=env, capture_output=True, text=True, timeout=900
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"ray {args[0]} exited {done.returncode}:\n{output[-20000:]}"
    return output


def _wait_running(dashboard: str, timeout: float = 600) -> None:
    """Serve's status through the dashboard's REST API, as `serve status` reads it."""
    deadline = time.monotonic() + timeout
    status: dict = {}
    while time.monotonic() < deadline:
        reply = httpx.get(f"{dashboard}/api/serve/applications/", timeout=30)
        status = reply.json().get("applications", {}).get("raylm", {})
        if status.get("status") == "RUNNING":
            return
        assert status.get("status") != "DEPLOY_FAILED", status.get("message")
        time.sleep(1)  # a bounded poll: the app is built and started in other processes
    raise TimeoutError(f"app not running after {timeout}s: {status}")


def _assert_answers(http_port: int) -> None:
    """An answer for the key from the node's secrets file; none without a key."""
    url = f"http://127.0.0.1:{http_port}/v1/completions"
    request = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 8, "seed": 0}
    assert httpx.post(url, json=request, timeout=120).status_code == 401
    reply = httpx.post(url, json=request, headers=AUTH, timeout=120)
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["model"] == MODEL and body["object"] == "text_completion"
    assert isinstance(body["choices"][0]["text"], str)
    assert 1 <= body["usage"]["completion_tokens"] <= 8
    assert body["usage"]["prompt_tokens"] > 0


def _assert_metrics_scraped(metrics_port: int, http_port: int, timeout: float = 120) -> None:
    """What deploy/prometheus.yml scrapes: the node's fixed metrics port and the ingress page."""
    deadline = time.monotonic() + timeout
    page = ""
    while "ray_raylm_num_requests_waiting" not in page and time.monotonic() < deadline:
        time.sleep(1)  # a bounded poll: the replica's metrics reach the port on Ray's report cycle
        page = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=30).text
    assert "ray_raylm_num_requests_waiting" in page
    ingress = httpx.get(f"http://127.0.0.1:{http_port}/metrics", headers=AUTH, timeout=30)
    assert ingress.status_code == 200 and "raylm_" in ingress.text


def _wait_closed(port: int, timeout: float = 120) -> None:
    """`ray down` stopped the head: its GCS port no longer accepts connections."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
        except OSError:
            return
        time.sleep(1)  # a bounded poll: the processes exit after `ray stop` returns
    raise AssertionError(f"the head's GCS still listens on {port} after ray down")
