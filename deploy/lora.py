"""LoRA adapters at the HTTP edge: the adapter a request's `model` names, the /v1/models cards, and
the run-time load and unload endpoints (off unless `allow_runtime_lora`), which reach every replica
of the deployment (cluster/lora_admin.py)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from cluster.lora_admin import MAX_LORA_PATH_CHARS, LoraCommand, WrongReplicaError
from deploy.errors import (
    ModelNotFoundError,
    NoReplicasError,
    cause_of,
)
from scheduler.lora_slots import UnknownLoraError
from scheduler.request import MAX_LORA_NAME_CHARS, check_lora_name

logger = logging.getLogger(__name__)

# How long an admin call waits for this ingress's router to learn the replica set (it learns it
# with the first request through the handle).
REPLICA_LIST_WAIT_S = 10.0
MAX_MODEL_NAME_CHARS = 1024
# A key's adapter scope names at most as many adapters as an engine may hold.
MAX_SCOPED_LORAS = 4096


class LoadLoraAdapterRequest(BaseModel):
    """POST /v1/load_lora_adapter, as vLLM's; `model` picks the base model in an app serving
    several (left out: the first)."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = Field(default=None, max_length=MAX_MODEL_NAME_CHARS)
    lora_name: str = Field(max_length=MAX_LORA_NAME_CHARS)
    lora_path: str = Field(min_length=1, max_length=MAX_LORA_PATH_CHARS)


class UnloadLoraAdapterRequest(BaseModel):
    """POST /v1/unload_lora_adapter, as vLLM's; `model` as in LoadLoraAdapterRequest."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = Field(default=None, max_length=MAX_MODEL_NAME_CHARS)
    lora_name: str = Field(max_length=MAX_LORA_NAME_CHARS)


def adapter_of(model: str | None, base_names: Collection[str]) -> str | None:
    """The LoRA adapter a request's `model` selects: None for the base model (or no `model`);
    `<base>:<adapter>` as Ray Serve LLM spells it, or the adapter's own name. A name that can be
    neither is a 404; whether the adapter is loaded is the replica's to say (404 too)."""
    if model is None or model in base_names:
        return None
    base, sep, name = model.rpartition(":")
    if sep and base not in base_names:
        raise _not_found(model, base_names)
    try:
        return check_lora_name(name if sep else model)
    except ValueError:
        raise _not_found(model, base_names) from None


def _not_found(model: str, base_names: Collection[str]) -> ModelNotFoundError:
    served = next(iter(base_names))
    shown = model if len(model) <= 80 else model[:77] + "..."
    return ModelNotFoundError(
        f"The model `{shown}` does not exist; this server serves `{served}` and its LoRA "
        f"adapters, named `{served}:<adapter>` or `<adapter>`.",
        param="model",
        code="model_not_found",
    )


def check_adapter_scope(adapter: str | None, allowed: Collection[str] | None, model: str) -> None:
    """A 404, as for an adapter that does not exist, when a key scoped to the adapters `allowed`
    names another (allowed None: the key may use every adapter; the base model is always
    allowed): a key learns nothing of adapters outside its scope."""
    if adapter is not None and allowed is not None and adapter not in allowed:
        shown = model if len(model) <= 80 else model[:77] + "..."
        raise ModelNotFoundError(
            f"The model `{shown}` does not exist.", param="model", code="model_not_found"
        )


def scoped_cards(
    cards: list[dict[str, Any]], allowed: Collection[str] | None
) -> list[dict[str, Any]]:
    """/v1/models entries a key scoped to the adapters `allowed` sees: the base models, and of the
    adapters (the cards naming a parent) those in its scope."""
    if allowed is None:
        return cards
    return [c for c in cards if "parent" not in c or c["id"] in allowed]


def check_scope_setting(names: object) -> list[str] | None:
    """An api_keys profile's `loras`: None, or a list of at most MAX_SCOPED_LORAS adapter names;
    ValueError naming the field otherwise."""
    if names is None:
        return None
    if not isinstance(names, list) or len(names) > MAX_SCOPED_LORAS:
        raise ValueError(f"loras: must be a list of at most {MAX_SCOPED_LORAS} adapter names")
    return [check_lora_name(n, "loras") for n in names]


def adapter_cards(adapters: list[str], parent: str, created: int) -> list[dict[str, Any]]:
    """/v1/models entries of the loaded adapters, each naming the base model as its parent."""
    return [
        {"id": name, "object": "model", "created": created, "owned_by": "raylm", "parent": parent}
        for name in adapters
    ]


class LoraAdmin:
    """Applies a run-time adapter change to every replica of the deployment, one after another.

    A load that one replica refuses (a bad adapter: 400) is undone on those that took it, so the
    replicas keep one set of adapters. An unload refused by a replica (the adapter is in use)
    leaves the replicas before it without the adapter: the caller retries once its requests end,
    and the retry skips the replicas that no longer have it.
    """

    def __init__(self, handle: Any, replica_ids: Callable[[], set[str]]) -> None:
        self.handle = handle
        self.replica_ids = replica_ids
        self._lock = asyncio.Lock()  # one change at a time from this ingress

    async def load(self, name: str, path: str) -> dict[str, list[str]]:
        """Each replica's adapters after loading `name` from `path` on every one."""
        async with self._lock:
            done: dict[str, list[str]] = {}
            for replica in await self._replicas():
                try:
                    done[replica] = await self._send(LoraCommand(replica, "add", name, path))
                except Exception:
                    await self._undo(list(done), name)
                    raise
            return done

    async def unload(self, name: str) -> dict[str, list[str]]:
        """Each replica's adapters after unloading `name` from every one. A replica that no longer
        has it (an earlier unload refused further on) is skipped, so the caller's retry completes;
        unknown on every replica is the 404."""
        async with self._lock:
            done: dict[str, list[str]] = {}
            unknown: Exception | None = None
            for replica in await self._replicas():
                try:
                    done[replica] = await self._send(LoraCommand(replica, "remove", name))
                except Exception as exc:
                    if not isinstance(cause_of(exc), UnknownLoraError):
                        raise
                    unknown = exc
            if not done and unknown is not None:
                raise unknown
            return done

    async def _undo(self, replicas: list[str], name: str) -> None:
        for replica in replicas:
            try:
                await self._send(LoraCommand(replica, "remove", name))
            except Exception:
                logger.exception("could not undo LoRA %s on replica %s", name, replica)

    async def _send(self, command: LoraCommand) -> list[str]:
        try:
            return await self.handle.lora_command.remote(command)
        except Exception as exc:
            if isinstance(cause_of(exc), WrongReplicaError):  # it went away since it was listed
                raise NoReplicasError(
                    f"Replica {command.replica} went away during the change; retry.",
                    code="replica_gone",
                ) from None
            raise

    async def _replicas(self) -> list[str]:
        deadline = time.monotonic() + REPLICA_LIST_WAIT_S
        while not (ids := self.replica_ids()):
            if time.monotonic() > deadline:
                raise NoReplicasError(
                    "No model replica is known to this ingress yet; retry shortly.",
                    code="no_replicas",
                )
            await asyncio.sleep(0.1)  # the router learns the replica set from Serve
        return sorted(ids)
