"""The engine's LoRA registry: an adapter is read whole and checked off the engine's thread
(`prepare`, with a size cap and a time limit), then registered between steps (`register`): its
checked tensors go to every rank, which keeps them, so its files may vanish or change afterwards.
The scheduler's LoraSlots then places adapters by name and identity (name@digest), and a request's
prefix-cache chain is keyed by the identity: other weights under a reused name never meet the old
weights' KV."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from typing import Any

import torch
from transformers import AutoConfig

from engine.config import EngineConfig
from scheduler.lora_slots import LoraSlots
from scheduler.request import EngineRequest, check_lora_name
from workers.lora.adapter import LoraAdapter, ModelShapes, read_adapter, resolve_lora_path
from workers.lora.files import READ_TIMEOUT_S, call_with_timeout

logger = logging.getLogger(__name__)

# Runs fn(runner) on every rank of the engine (Executor.call_ranks).
CallRanks = Callable[[Callable[[Any], Any]], list[Any]]


class EngineLoras:
    """Checks adapters against the base model and registers them with the scheduler's slots."""

    def __init__(
        self,
        config: EngineConfig,
        model_dir: str,
        call_ranks: CallRanks | None = None,
        dtype: torch.dtype = torch.float32,
        timeout_s: float = READ_TIMEOUT_S,
    ) -> None:
        self.config = config
        self.model_dir = model_dir
        self.slots = LoraSlots(config.num_lora_slots)  # the scheduler's, once the engine hands it
        self.call_ranks = call_ranks
        self.dtype, self.timeout_s = dtype, timeout_s
        self._shapes: ModelShapes | None = None
        self._shapes_lock = threading.Lock()  # prepare runs on callers' threads

    def add_configured(self) -> None:
        for name, path in (self.config.lora_modules or {}).items():
            self.add(name, path)

    def add(self, name: str, path: str) -> None:
        """prepare, then register (on the caller's thread: the offline LLM, a test)."""
        self.register(self.prepare(name, path))

    def prepare(self, name: str, path: str) -> LoraAdapter:
        """Read and check the adapter at `path` as `name`; safe on any thread, and the place a
        server calls off the engine's thread. ValueError naming what is wrong, or the timeout."""
        self._check_new(name)
        t0 = time.perf_counter()
        adapter = call_with_timeout(lambda: self._read(name, path), self.timeout_s, "lora_path")
        logger.info(
            "LoRA %s (rank %d, %d projections, %s) checked in %.3fs",
            name,
            adapter.rank,
            len(adapter.weights),
            adapter.identity,
            time.perf_counter() - t0,
        )
        return adapter

    def register(self, adapter: LoraAdapter) -> None:
        """Hand a prepared adapter to every rank and make it nameable; between steps (the engine's
        thread). A rank that refuses leaves none holding it."""
        self._check_new(adapter.name)
        if len(self.slots.identities) >= self.config.num_cpu_loras:
            raise ValueError(
                f"max_cpu_loras: {self.config.num_cpu_loras} adapters are loaded already; unload "
                "one first"
            )
        if self.call_ranks is None:
            raise ValueError("lora_name: this engine's executor cannot hand adapters to its ranks")
        try:
            self.call_ranks(partial(_keep, adapter))
        except Exception:
            self._drop(adapter.identity)
            raise
        self.slots.register(adapter.name, adapter.identity)

    def remove(self, name: str, num_requests: int) -> None:
        """Forget an adapter that no unfinished request uses (LoraInUseError otherwise)."""
        identity = self.slots.identities.get(name)
        self.slots.unregister(name, num_requests)
        if identity is not None:
            self._drop(identity)

    def keyed(self, request: EngineRequest) -> EngineRequest:
        """The request with its adapter's identity set, and the hashes its sender computed (which
        know only the name) left for the scheduler to compute under it; UnknownLoraError for a
        name not loaded."""
        name = request.lora_name
        self.slots.check(name)
        if name is None:
            return request
        return replace(request, lora_identity=self.slots.identities[name], block_hashes=[])

    def _check_new(self, name: str) -> None:
        check_lora_name(name)
        if not self.slots.enabled:
            raise ValueError("lora_name: LoRA is off on this engine (max_loras is 0)")
        if name in self.slots.identities:
            raise ValueError(f"lora_name: an adapter named {name!r} is already loaded")

    def _read(self, name: str, path: str) -> LoraAdapter:
        cfg = self.config
        real = resolve_lora_path(path, cfg.lora_root, set((cfg.lora_modules or {}).values()))
        return read_adapter(name, real, self._model_shapes(), cfg.max_lora_rank, self.dtype)

    def _model_shapes(self) -> ModelShapes:
        with self._shapes_lock:
            if self._shapes is None:
                hf_config = AutoConfig.from_pretrained(self.model_dir)
                self._shapes = ModelShapes.from_hf_config(hf_config)
            return self._shapes

    def _drop(self, identity: str) -> None:
        if self.call_ranks is None:  # nothing was handed over
            return
        try:
            self.call_ranks(partial(_drop, identity))
        except Exception:  # a dead rank fails the next step anyway
            logger.exception("LoRA %s: a rank could not drop it", identity)


def _keep(adapter: LoraAdapter, runner: Any) -> None:
    """On a rank: hold the checked adapter (its LoraManager exists whenever max_loras is set)."""
    runner.loras.keep(adapter)


def _drop(identity: str, runner: Any) -> None:
    runner.loras.drop(identity)
