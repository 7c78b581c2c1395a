"""Hub models in an app: `model: org/name` (with `revision` and `download_dir`) checked, and
pinned when the app is built.

Pinning fetches the tokenizer side (configs, tokenizer, chat template) where the app is built, so a
model the cache lacks and the hub refuses fails `build_app` (and `python -m deploy check`) with
what to do, never a replica's start. The engine then gets the snapshot directory of the resolved
commit: every replica serves the same files even if the branch moves, and a node that lacks them
fetches exactly that commit (workers/hub.py: the tokenizer side by whoever reads it, the weights by
the loader of each rank, one process per node).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from settings import shown
from workers.hub import (
    TOKENIZER_FILES,
    HubModel,
    check_revision,
    fetch,
    is_hub_id,
    snapshot_of,
    weightless_listing,
)

if TYPE_CHECKING:
    from deploy.config import AppConfig

MAX_PATH_CHARS = 4096  # PATH_MAX on Linux


def hub_model(model: str) -> bool:
    """Whether `model` names a hub repository rather than something on this machine."""
    return is_hub_id(model) and not Path(model).expanduser().exists()


def check_hub_settings(model: str, revision: str | None, download_dir: str | None) -> None:
    """revision and download_dir are well formed, and only set for a hub model (or the snapshot
    directory it was pinned to), where they mean something."""
    if revision is not None:
        check_revision(revision)
    if download_dir is not None and (
        not 0 < len(download_dir) <= MAX_PATH_CHARS or "\0" in download_dir
    ):
        raise ValueError(
            f"download_dir: must be a path of 1 to {MAX_PATH_CHARS} characters without NUL, "
            f"got {shown(download_dir)}"
        )
    for name, value in (("revision", revision), ("download_dir", download_dir)):
        if value is not None and not hub_model(model) and snapshot_of(model) is None:
            raise ValueError(
                f"{name}: only for a Hugging Face hub model (`model: org/name`), model is "
                f"{shown(model)}"
            )


def pinned(config: AppConfig) -> AppConfig:
    """`config` with a hub model's id replaced by the snapshot directory of its resolved commit
    (the tokenizer side fetched, so a missing model fails here); any other config as it is."""
    model = config.engine.model
    if not hub_model(model):
        return config
    hub = HubModel(model, config.revision, config.download_dir)
    snapshot = fetch(hub, TOKENIZER_FILES)
    commit = snapshot_of(snapshot)
    if commit is not None and weightless_listing(commit):  # else every replica fails its load
        raise ValueError(
            f"model: {model!r} at {snapshot.name} has no safetensors weights on the Hugging Face "
            "hub (raylm reads safetensors checkpoints)"
        )
    return replace(
        config,
        served_model_name=config.model_name,  # clients keep asking for `org/name`
        engine=replace(config.engine, model=str(snapshot)),
    )
