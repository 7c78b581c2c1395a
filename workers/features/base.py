"""The runner side of a feature: hooks around one step, each a no-op unless the feature needs it.

A step runs them in this order, every feature in the order `workers/features/build.py` lists them:
1. `start` for each new (or resent) request, `finish` for each finished one, then `update` with the
   whole SchedulerOutput once the runner has applied its diffs;
2. `before_copies` (before the swap copies), `after_copies` (after them: loads into the pool);
3. `before_forward` (work that overlaps the forward), `prepare` (inside the forward: LoRA slots;
   True when the step must run eagerly), `after_forward` (hidden states: pooling, prompt
   logprobs, length features);
4. `before_sample` (rank 0: logits masks), `after_sample` (rank 0, rows that sampled:
   verification, appended tokens, attachments to the output);
5. `propose` (proposals, then filters of them), `proposed` (the step's final proposals).

The runner never asks which features exist: a capability is switched on by being in the list.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
from transformers import PretrainedConfig

from scheduler.outputs import ModelRunnerOutput, NewRequestData, SchedulerOutput
from workers.kv_cache import KVCache, KVCacheSpec
from workers.layers.attention import Attention, AttentionMetadata
from workers.runner_config import RunnerConfig
from workers.sampler import SamplingState
from workers.step_state import Batch, RequestState


class CausalLM(Protocol):
    """What the runner and its features call on a model (workers/models/)."""

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None: ...

    def attention_layers(self) -> list[Attention]: ...


@dataclass(slots=True)
class RunnerContext:
    """What features share with the runner: built once, before the features."""

    config: RunnerConfig
    model: CausalLM
    hf_config: PretrainedConfig  # the model's transformers config
    device: torch.device
    dtype: torch.dtype
    is_driver: bool  # rank 0: the rank that samples
    requests: dict[str, RequestState]  # the runner's own dict (never replaced)


@dataclass(slots=True)
class SampleStep:
    """What one step samples, as the features before sampling leave it: per logits row, its
    batch row and sampling state (one per sampling request, more for a verify row)."""

    logits: torch.Tensor
    rows: list[int]
    states: list[SamplingState]
    unmasked: torch.Tensor | None = None  # before masks (logprobs read these)
    failed: dict[str, str] = field(default_factory=dict)


class RunnerFeature:
    """Base of the runner's features: every hook a no-op."""

    def share_blocks(self, blocks: int, target: KVCacheSpec) -> int:
        """Of `blocks` device blocks' memory, the block ids left once this feature has its part."""
        return blocks

    def init_kv_cache(self, cache: KVCache, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        pass

    def start(self, new: NewRequestData, state: RequestState) -> None:
        """A request arrives in full; raising fails that request alone."""

    def finish(self, req_id: str) -> None:
        """A request is done: drop what is held for it."""

    def update(self, out: SchedulerOutput) -> None:
        """The step's schedule, once the runner has applied its diffs."""

    def schedule(self, out: SchedulerOutput) -> SchedulerOutput:
        """The step as this runner runs it: `out`, or a copy this feature changed (async
        speculation fills draft slots, workers/spec_async.py). Never changes `out` itself."""
        return out

    def before_copies(self, out: SchedulerOutput) -> None:
        pass

    def after_copies(self, out: SchedulerOutput) -> list[int]:
        """Copies into the device pool; the device blocks that failed to load."""
        return []

    def before_forward(self, batch: Batch) -> None:
        pass

    def prepare(self, batch: Batch) -> bool:
        """Set up the forward's inputs; True when the step cannot replay the decode graphs."""
        return False

    def after_forward(self, batch: Batch, hidden: torch.Tensor, offsets: list[int]) -> None:
        pass

    def before_sample(self, batch: Batch, step: SampleStep) -> None:
        pass

    def after_sample(self, batch: Batch, output: ModelRunnerOutput) -> None:
        pass

    def propose(self, batch: Batch, output: ModelRunnerOutput) -> None:
        pass

    def proposed(self, batch: Batch, output: ModelRunnerOutput) -> None:
        pass
