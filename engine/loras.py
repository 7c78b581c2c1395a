"""The engine's LoRA registry: adapters are checked here, on the engine's thread, before any request
may name them; the scheduler's LoraSlots then places them and the workers load them."""

from __future__ import annotations

import logging
import time

from transformers import AutoConfig

from engine.config import EngineConfig
from scheduler.lora_slots import LoraSlots
from scheduler.request import check_lora_name
from workers.lora.adapter import ModelShapes, read_adapter, resolve_lora_path

logger = logging.getLogger(__name__)


class EngineLoras:
    """Checks adapters against the base model and registers them with the scheduler's slots."""

    def __init__(self, config: EngineConfig, model_dir: str) -> None:
        self.config = config
        self.model_dir = model_dir
        self.slots = LoraSlots(config.num_lora_slots)  # the scheduler's, once the engine hands it
        self._shapes: ModelShapes | None = None

    def add_configured(self) -> None:
        for name, path in (self.config.lora_modules or {}).items():
            self.add(name, path)

    def add(self, name: str, path: str) -> None:
        check_lora_name(name)
        if not self.slots.enabled:
            raise ValueError("lora_name: LoRA is off on this engine (max_loras is 0)")
        if name in self.slots.paths:
            raise ValueError(f"lora_name: an adapter named {name!r} is already loaded")
        cfg = self.config
        real = resolve_lora_path(path, cfg.lora_root, set((cfg.lora_modules or {}).values()))
        if self._shapes is None:
            self._shapes = ModelShapes.from_hf_config(AutoConfig.from_pretrained(self.model_dir))
        t0 = time.perf_counter()
        adapter = read_adapter(name, real, self._shapes, cfg.max_lora_rank)
        logger.info(
            "LoRA %s (rank %d, %d projections) checked in %.3fs",
            name,
            adapter.rank,
            len(adapter.weights),
            time.perf_counter() - t0,
        )
        self.slots.register(name, real)
