"""workers/hub.py without network: hub ids and revisions as the hub spells them, snapshot
directories read back into (repo, commit, cache), and the per-node lock under which one process
fetches a snapshot's weights while the others wait and then find them."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from filelock import FileLock

from tests.random_checkpoint import TINY_TP_LLAMA, write_random_checkpoint
from workers.hub import (
    WEIGHT_FILES,
    HubModel,
    check_revision,
    ensure_weights,
    fetch,
    is_hub_id,
    snapshot_of,
)

COMMIT = "89abcdef0123456789abcdef0123456789abcdef"


@pytest.mark.parametrize(
    "model, hub",
    [
        ("Qwen/Qwen3-8B", True),
        ("meta-llama/Llama-3.1-8B-Instruct", True),
        ("default", False),
        ("/mnt/models/llama", False),
        ("./org/name", False),
        ("org/name/extra", False),
        ("org/../etc", False),
        ("org/na--me", False),  # the hub refuses `--` (the cache's separator)
        ("model.gguf", False),
    ],
)
def test_a_hub_id_is_org_slash_name(model, hub):
    assert is_hub_id(model) is hub


@pytest.mark.parametrize("revision", ["../x", "main/../../x", "-rf", "", "a b", "x" * 257])
def test_a_revision_cannot_climb_out_of_the_cache(revision):
    with pytest.raises(ValueError, match="^revision: "):
        check_revision(revision)
    assert check_revision("refs/pr/1") == "refs/pr/1"


def test_a_snapshot_directory_names_its_repo_commit_and_cache(tmp_path):
    path = tmp_path / "models--acme--tiny" / "snapshots" / COMMIT
    assert snapshot_of(path) == HubModel("acme/tiny", COMMIT, str(tmp_path))
    assert snapshot_of(tmp_path / "models--acme--tiny" / "snapshots" / "main") is None
    assert snapshot_of(tmp_path / "datasets--acme--tiny" / "snapshots" / COMMIT) is None
    assert snapshot_of(tmp_path / "llama") is None


def test_a_rank_waits_for_the_node_lock_and_then_finds_the_weights(tmp_path):
    """Another process of the node holds the lock while it downloads; this rank waits on it and,
    once the weights are there, reads the cache (offline: a wrong turn could not reach the hub)."""
    snapshot = tmp_path / "hub" / "models--acme--tiny" / "snapshots" / COMMIT
    write_random_checkpoint(TINY_TP_LLAMA, str(snapshot))
    weights = sorted(snapshot.glob("*.safetensors"))
    assert weights
    aside = tmp_path / "downloading"
    aside.mkdir()
    for w in weights:
        w.rename(aside / w.name)
    lock = FileLock(str(tmp_path / "hub" / ".locks" / "raylm-models--acme--tiny.lock"))
    (tmp_path / "hub" / ".locks").mkdir()
    errors: list[BaseException] = []

    def rank() -> None:
        try:
            ensure_weights(str(snapshot), offline=True)
        except BaseException as exc:
            errors.append(exc)

    with lock:  # the downloading process
        waiter = threading.Thread(target=rank)
        waiter.start()
        for w in weights:
            (aside / w.name).rename(w)
    waiter.join(timeout=60)
    assert not waiter.is_alive() and errors == []
    assert all(w.is_file() for w in weights)
    # And with the weights gone for good, offline, the error says what to do.
    for w in weights:
        w.unlink()
    with pytest.raises(ValueError, match=r"^model: 'acme/tiny' at revision '89abcdef.*hf download"):
        fetch(HubModel("acme/tiny", COMMIT, str(tmp_path / "hub")), WEIGHT_FILES, offline=True)
    assert Path(snapshot / "config.json").is_file()
