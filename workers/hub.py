"""Models from the Hugging Face hub: a hub id (`org/name`) resolved to a snapshot directory of the
local hub cache, each file downloaded once per node.

huggingface_hub reads its own environment: HF_TOKEN (gated or private models), HF_HOME or
HF_HUB_CACHE (where the cache is), HF_HUB_OFFLINE=1 (the cache alone, no network). A snapshot
directory (`<cache>/models--org--name/snapshots/<commit>`) names its repository, commit and cache,
so the pinned path build_app hands to every replica is all another node needs to fetch the very
same files.

Two sets of files: the tokenizer side (config, tokenizer, chat template: what the ingress and the
engine's ModelInfo read) and the weights (what each worker rank loads, fetched by the loader).
A download holds a file lock in the cache: the first process of a node downloads, the others wait
for it and then find the files.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock

logger = logging.getLogger(__name__)

# What the ingress and ModelInfo read: configs, tokenizers, chat templates (no weights).
TOKENIZER_FILES = ("*.json", "*.txt", "*.model", "*.jinja", "*.tiktoken")
# What a worker loads besides: raylm reads safetensors only (a repo's .bin copies stay behind).
WEIGHT_FILES = (*TOKENIZER_FILES, "*.safetensors")
MAX_REVISION_CHARS = 256
# The hub's own rule for a repo id (huggingface_hub.utils.validate_repo_id): `org/name`.
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/[A-Za-z0-9_.-]{1,96}")
_REVISION = re.compile(r"[A-Za-z0-9_.][A-Za-z0-9_./-]*")
_COMMIT = re.compile(r"[0-9a-f]{40}")


@dataclass(frozen=True, slots=True)
class HubModel:
    """A model repository on the hub, at a revision, in a cache."""

    repo_id: str
    revision: str | None = None  # branch, tag or commit; None: the default branch
    cache_dir: str | None = None  # None: huggingface_hub's (HF_HUB_CACHE, HF_HOME)

    def __post_init__(self) -> None:
        if not is_hub_id(self.repo_id):
            raise ValueError(f"model: {self.repo_id[:80]!r} is not a hub id (`org/name`)")
        if self.revision is not None:
            check_revision(self.revision)


def is_hub_id(model: str) -> bool:
    """`org/name` as the hub spells repositories (no path of this machine is checked here)."""
    return bool(_HUB_ID.fullmatch(model)) and ".." not in model and "--" not in model


def check_revision(revision: str) -> str:
    """A branch, tag or commit name: refs are files of the cache, so no `..` may climb out."""
    if not 1 <= len(revision) <= MAX_REVISION_CHARS:
        raise ValueError(f"revision: must have 1 to {MAX_REVISION_CHARS} characters")
    if not _REVISION.fullmatch(revision) or ".." in revision:
        raise ValueError(
            f"revision: {revision[:80]!r} is not a branch, tag or commit name (letters, digits, "
            "`_`, `.`, `-`, `/`, no `..`)"
        )
    return revision


def snapshot_of(path: str | Path) -> HubModel | None:
    """The repository, commit and cache a hub snapshot directory names, or None for any other
    path."""
    path = Path(path)
    repo, snapshots = path.parent.parent, path.parent
    if snapshots.name != "snapshots" or not _COMMIT.fullmatch(path.name):
        return None
    if not repo.name.startswith("models--"):
        return None
    repo_id = repo.name.removeprefix("models--").replace("--", "/")
    if not is_hub_id(repo_id):
        return None
    return HubModel(repo_id, path.name, str(repo.parent))


def fetch(model: HubModel, patterns: tuple[str, ...], offline: bool = False) -> Path:
    """The snapshot directory of `model` holding the files `patterns` match, downloaded where
    missing (offline, or with HF_HUB_OFFLINE=1: the cache alone). A model the cache lacks and the
    hub refuses is a ValueError that says how to get it."""
    from huggingface_hub import snapshot_download

    cached = _cached(model, patterns)
    if cached is not None:  # a commit never changes: no need to ask the hub, nor to wait
        return cached
    try:
        with _node_lock(model):
            done = _cached(model, patterns)  # another process of this node fetched it
            path = done or snapshot_download(
                model.repo_id,
                revision=model.revision,
                cache_dir=model.cache_dir,
                allow_patterns=list(patterns),
                local_files_only=offline,
            )
    except Exception as exc:
        raise ValueError(unavailable(model, exc)) from None
    if not _has(Path(path), patterns):
        raise ValueError(_incomplete(model, Path(path), offline))
    return Path(path)


def weightless_listing(model: HubModel) -> bool:
    """Whether the hub's file listing of `model`'s commit, kept in the cache by a download, has
    no safetensors file (a repo of .bin files only); False where no listing is cached."""
    try:  # huggingface_hub keeps listings since 1.x; an older one keeps none
        from huggingface_hub import get_cached_repo_tree
        from huggingface_hub.errors import CachedRepoTreeNotFoundError
    except ImportError:
        return False
    try:
        files = get_cached_repo_tree(
            model.repo_id, revision=model.revision, cache_dir=model.cache_dir
        )
    except (CachedRepoTreeNotFoundError, OSError, ValueError):
        return False
    return not any(f.path.endswith(".safetensors") for f in files)


def ensure_weights(model_dir: str, offline: bool = False) -> None:
    """Download the weights of a hub snapshot directory that lacks them (one process of a node
    downloads, the others wait on the lock); any other directory is left as it is."""
    model = snapshot_of(model_dir)
    if model is None or _has_weights(Path(model_dir)):
        return
    logger.info(
        "fetching the weights of %s at %s into %s", model.repo_id, model.revision, model_dir
    )
    fetch(model, WEIGHT_FILES, offline)


def unavailable(model: HubModel, exc: BaseException) -> str:
    """What to do about a model that cannot be had: download it, or set a token."""
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    name, at = model.repo_id, f" at revision {model.revision!r}" if model.revision else ""
    options = (f" --revision {model.revision}" if model.revision else "") + (
        f" --cache-dir {model.cache_dir}" if model.cache_dir else ""
    )
    hint = (
        f"download it into the cache first (`hf download {name}{options}`), or set HF_TOKEN "
        "where the app is built and served if the model is gated or private"
    )
    if isinstance(exc, RevisionNotFoundError):
        return f"revision: {model.revision!r} is not a branch, tag or commit of {name!r}"
    if isinstance(exc, (GatedRepoError, RepositoryNotFoundError)):
        return f"model: {name!r} is not on the Hugging Face hub or needs a token: {hint}"
    if isinstance(exc, (LocalEntryNotFoundError, FileNotFoundError)):
        return (
            f"model: {name!r}{at} is neither a local path nor in the Hugging Face cache, and the "
            f"hub cannot be reached (HF_HUB_OFFLINE, or no network): {hint}"
        )
    return (
        f"model: cannot fetch {name!r}{at} from the Hugging Face hub ({type(exc).__name__}): {hint}"
    )


def _incomplete(model: HubModel, path: Path, offline: bool) -> str:
    """Why a snapshot fetched without error still lacks what raylm reads."""
    from huggingface_hub import constants

    if offline or constants.HF_HUB_OFFLINE:  # a partial snapshot, read from the cache alone
        return unavailable(model, FileNotFoundError(path))
    what = "config.json" if not (path / "config.json").is_file() else "safetensors weights"
    return (
        f"model: {model.repo_id!r} at {model.revision or 'its default branch'} has no {what} on "
        "the Hugging Face hub (raylm reads safetensors checkpoints with their config.json)"
    )


def _hub_cache(model: HubModel) -> Path:
    if model.cache_dir is not None:
        return Path(model.cache_dir).expanduser()
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def _repo_dir(model: HubModel) -> Path:
    return _hub_cache(model) / ("models--" + model.repo_id.replace("/", "--"))


def _node_lock(model: HubModel) -> contextlib.AbstractContextManager[object]:
    """The lock one process of a node downloads under while the others wait; none where the cache
    is read-only (shared storage filled ahead): nothing will be written there by us either."""
    locks = _hub_cache(model) / ".locks"
    try:
        locks.mkdir(parents=True, exist_ok=True)
        path = locks / f"raylm-{_repo_dir(model).name}.lock"
        path.touch(exist_ok=True)
    except OSError:
        return contextlib.nullcontext()
    return FileLock(str(path))


def _cached(model: HubModel, patterns: tuple[str, ...]) -> Path | None:
    """The cached snapshot holding `patterns`, where the revision names a commit (a branch may have
    moved on since it was cached)."""
    if model.revision is None or not _COMMIT.fullmatch(model.revision):
        return None
    path = _repo_dir(model) / "snapshots" / model.revision
    return path if _has(path, patterns) else None


def _has(path: Path, patterns: tuple[str, ...]) -> bool:
    """Whether a snapshot holds the files of `patterns` that raylm needs to read."""
    if not (path / "config.json").is_file():
        return False
    return "*.safetensors" not in patterns or _has_weights(path)


def _has_weights(path: Path) -> bool:
    """Every shard the index names, or at least one safetensors file where there is no index."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return False
        return all((path / shard).is_file() for shard in shards)
    return any(path.glob("*.safetensors"))
