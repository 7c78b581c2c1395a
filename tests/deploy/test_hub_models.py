"""Hub models (`model: org/name`): resolved from a Hugging Face cache layout without any network,
pinned to their commit when the app is built, served under their id; a missing one fails at build
time (build_app, `python -m deploy check`) saying to download it or set HF_TOKEN.

Nothing here reaches the hub: the subprocess runs with HF_HUB_OFFLINE=1, and in this process a
lookup either names a commit that is cached (no question to ask the hub) or passes offline=True.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from ray.serve.exceptions import RayServeException

from deploy.app import AppConfigError, build_app
from deploy.config import AppConfig
from tests.deploy.conftest import ROOT, delete_app
from workers.hub import TOKENIZER_FILES, WEIGHT_FILES, HubModel, ensure_weights, fetch, snapshot_of
from workers.model_files import resolve_model

COMMIT = "0123456789abcdef0123456789abcdef01234567"
REPO = "acme/tiny-llama"


def write_hub_cache(cache: Path, model_dir: str, repo: str = REPO, commit: str = COMMIT) -> Path:
    """`model_dir`'s files as the hub cache holds a download: snapshots/<commit>, refs/main."""
    repo_dir = cache / ("models--" + repo.replace("/", "--"))
    snapshot = repo_dir / "snapshots" / commit
    shutil.copytree(model_dir, snapshot)
    (repo_dir / "refs").mkdir(parents=True)
    (repo_dir / "refs" / "main").write_text(commit)
    return snapshot


@pytest.fixture(scope="module")
def hub_home(tmp_path_factory, tiny_model_dir) -> Path:
    """An HF_HOME whose hub cache holds the served tiny Llama as acme/tiny-llama."""
    home = tmp_path_factory.mktemp("hf-home")
    write_hub_cache(home / "hub", tiny_model_dir)
    return home


def test_a_hub_id_resolves_from_the_cache_by_branch_offline(hub_home):
    cache = str(hub_home / "hub")
    snapshot = fetch(HubModel(REPO, "main", cache), TOKENIZER_FILES, offline=True)
    assert snapshot == hub_home / "hub" / "models--acme--tiny-llama" / "snapshots" / COMMIT
    assert snapshot_of(snapshot) == HubModel(REPO, COMMIT, cache)
    # A pinned snapshot directory reads as a model directory, its weights already there.
    assert resolve_model(str(snapshot)) == str(snapshot)
    ensure_weights(str(snapshot))
    assert fetch(HubModel(REPO, COMMIT, cache), WEIGHT_FILES) == snapshot  # cached commit: no hub


def test_a_model_the_cache_lacks_says_how_to_get_it(tmp_path):
    with pytest.raises(ValueError) as raised:
        fetch(HubModel("acme/missing", "main", str(tmp_path)), TOKENIZER_FILES, offline=True)
    message = str(raised.value)
    assert message.startswith("model: 'acme/missing' at revision 'main' is neither a local path")
    assert f"(`hf download acme/missing --revision main --cache-dir {tmp_path}`)" in message
    assert "set HF_TOKEN" in message


def test_build_app_pins_a_hub_model_to_its_commit_and_keeps_its_id_as_the_name(hub_home):
    cache = str(hub_home / "hub")
    app = build_app({"model": REPO, "revision": COMMIT, "download_dir": cache, "device": "cpu"})
    fleet = app._bound_deployment.init_args[0]  # what the ingress is built with
    [model] = fleet.models
    assert model.model_name == REPO
    assert model.engine.model == str(
        Path(cache) / "models--acme--tiny-llama" / "snapshots" / COMMIT
    )


def write_listing(cache: Path, repo: str, commit: str, names: list[str]) -> None:
    """The hub's file listing of a commit, as huggingface_hub keeps it in the cache after a
    download (written with its own writer, in its own format)."""
    from huggingface_hub._tree_cache import TreeCacheEntry, write_tree_cache

    folder = cache / ("models--" + repo.replace("/", "--"))
    entries = {name: TreeCacheEntry(size=1, blob_id=f"{i:040x}") for i, name in enumerate(names)}
    write_tree_cache(str(folder), commit, entries)


def test_a_hub_model_without_safetensors_fails_the_build(tmp_path, tiny_model_dir):
    """Listed by the hub with .bin weights only: every replica would fail its load, so the build
    fails, naming it; the same listing with safetensors builds."""
    cache = tmp_path / "hub"
    commit = "f" * 40
    snapshot = write_hub_cache(cache, tiny_model_dir, "acme/bin-only", commit)
    names = sorted(p.name for p in snapshot.iterdir() if p.suffix != ".safetensors")
    write_listing(cache, "acme/bin-only", commit, [*names, "pytorch_model.bin"])
    args = {"model": "acme/bin-only", "revision": commit, "download_dir": str(cache)}
    with pytest.raises(AppConfigError) as raised:
        build_app(args)
    assert str(raised.value) == (
        f"model: 'acme/bin-only' at {commit} has no safetensors weights on the Hugging Face hub "
        "(raylm reads safetensors checkpoints)"
    )
    write_listing(cache, "acme/bin-only", commit, [*names, "model.safetensors"])
    build_app(args)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("revision", 2**64, "revision: must be a string"),
        ("revision", -1, "revision: must be a string"),
        ("revision", float("nan"), "revision: must be a string"),
        ("revision", "x" * 10_000_000, "revision: must have 1 to 256 characters"),
        ("revision", "../../etc", "revision: '../../etc' is not a branch, tag or commit name"),
        ("download_dir", 2**64, "download_dir: must be a string"),
        ("download_dir", -1, "download_dir: must be a string"),
        ("download_dir", float("nan"), "download_dir: must be a string"),
        ("download_dir", "d" * 10_000_000, "download_dir: must be a path of 1 to 4096 characters"),
    ],
)
def test_hub_settings_are_bounded(field, value, message):
    with pytest.raises(ValueError, match=message) as raised:
        AppConfig.from_args({"model": REPO, field: value})
    assert len(str(raised.value)) < 300


def test_hub_settings_refuse_a_model_that_is_not_on_the_hub():
    with pytest.raises(ValueError, match="revision: only for a Hugging Face hub model"):
        AppConfig.from_args({"model": "default", "revision": "main"})


def test_a_bad_config_fails_build_app_as_one_line_serve_reports_as_it_is():
    with pytest.raises(AppConfigError) as raised:
        build_app({"max_num_seq": 8})
    # Serve's build task returns a RayServeException's text without a traceback or a retry.
    assert isinstance(raised.value, RayServeException) and isinstance(raised.value, ValueError)
    message = str(raised.value)
    assert "\n" not in message
    assert "max_num_seq: unknown setting; known: ['max_num_seqs']" in message


@pytest.mark.slow  # a Python that imports Ray, Serve and transformers
def test_offline_the_check_command_and_build_app_resolve_a_cached_id_and_fail_a_missing_one(
    hub_home, tmp_path
):
    config = tmp_path / "deploy.yaml"
    config.write_text(
        "http_options: {host: 127.0.0.1}\n"
        "applications:\n"
        "  - {name: cached, route_prefix: /a, import_path: deploy.app:build_app,\n"
        f"     args: {{model: {REPO}, device: cpu, ingress_num_cpus: 0}}}}\n"
        "  - {name: missing, route_prefix: /b, import_path: deploy.app:build_app,\n"
        "     args: {model: acme/not-downloaded, device: cpu, ingress_num_cpus: 0}}\n"
    )
    env = {**os.environ, "HF_HOME": str(hub_home), "HF_HUB_OFFLINE": "1"}
    env.pop("HF_HUB_CACHE", None)
    # One Python (HF_HUB_OFFLINE is read when huggingface_hub loads): the check command, then
    # build_app of the missing model, which fails before any replica exists.
    script = (
        "import sys\n"
        "from deploy.__main__ import main\n"
        "from deploy.app import AppConfigError, build_app\n"
        "code = main(['check', sys.argv[1]])\n"
        "try:\n"
        "    build_app({'model': 'acme/not-downloaded', 'device': 'cpu'})\n"
        "except AppConfigError as exc:\n"
        "    print('build_app:', exc)\n"
        "sys.exit(code)\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", script, str(config)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 1, run.stderr
    assert f"{config}: app 'cached': ok; it needs {{CPU: 1}}" in run.stdout
    [problem] = [line for line in run.stderr.splitlines() if line.startswith(str(config))]
    assert problem.startswith(
        f"{config}: app 'missing': model: 'acme/not-downloaded' is neither a local path nor in "
        "the Hugging Face cache, and the hub cannot be reached (HF_HUB_OFFLINE, or no network)"
    )
    assert "hf download acme/not-downloaded" in problem and "HF_TOKEN" in problem
    [built] = [line for line in run.stdout.splitlines() if line.startswith("build_app:")]
    assert built == "build_app: " + problem.removeprefix(f"{config}: app 'missing': ")


@pytest.mark.slow
def test_a_hub_model_is_served_under_its_id(ray_cluster, http_port, hub_home, tmp_path):
    """Pinned to a cached commit: the replica reads the snapshot, the ingress its tokenizer, and
    clients name the model by its id."""
    from ray import serve

    args = {
        "model": REPO,
        "revision": COMMIT,
        "download_dir": str(hub_home / "hub"),
        "max_model_len": 256,
        "num_gpu_blocks": 64,
        "kv_cache_memory_gb": 0.1,
        "replica_num_cpus": 0.5,
        "ingress_num_cpus": 0.25,
    }
    serve.run(build_app(args), name="hub", route_prefix="/hub")
    try:
        reply = httpx.post(
            f"http://127.0.0.1:{http_port}/hub/v1/completions",
            json={"model": REPO, "prompt": "hello there", "max_tokens": 4, "temperature": 0},
            timeout=120,
        )
        assert reply.status_code == 200, reply.text
        body = reply.json()
        assert body["model"] == REPO
        assert body["usage"]["completion_tokens"] == 4
        models = httpx.get(f"http://127.0.0.1:{http_port}/hub/v1/models", timeout=30).json()
        assert [m["id"] for m in models["data"]] == [REPO]
    finally:
        delete_app("hub")
