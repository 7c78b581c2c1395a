"""The continuous-batching scheduler: pure Python, no torch, no Ray."""

from scheduler.block_hash import extend_block_hashes, hash_block_tokens, hash_prompt_blocks
from scheduler.block_manager import KVCacheManager
from scheduler.config import SchedulerConfig
from scheduler.lora_slots import LoraInUseError, UnknownLoraError
from scheduler.outputs import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    RequestOutput,
    SchedulerOutput,
    SchedulerStats,
    TokenLogprobs,
)
from scheduler.request import EngineRequest, Request, RequestStatus
from scheduler.sampling_params import SamplingParams
from scheduler.scheduler import Scheduler

__all__ = [
    "CachedRequestData",
    "EngineRequest",
    "KVCacheManager",
    "LoraInUseError",
    "ModelRunnerOutput",
    "NewRequestData",
    "Request",
    "RequestOutput",
    "RequestStatus",
    "SamplingParams",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "SchedulerStats",
    "TokenLogprobs",
    "UnknownLoraError",
    "extend_block_hashes",
    "hash_block_tokens",
    "hash_prompt_blocks",
]
