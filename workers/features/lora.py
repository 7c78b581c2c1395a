"""LoRA as a runner feature: the step's adapter loads into device slots, and each token's slot set
on the LoRA layers before the forward (workers/lora/manager.py)."""

from __future__ import annotations

from scheduler.outputs import ModelRunnerOutput, SchedulerOutput
from workers.features.base import RunnerContext, RunnerFeature
from workers.lora.manager import LoraManager
from workers.step_state import Batch


class LoraFeature(RunnerFeature):
    def __init__(self, ctx: RunnerContext) -> None:
        cfg = ctx.config
        self.ctx = ctx
        self.manager = LoraManager(
            ctx.model,  # type: ignore[arg-type]  # an nn.Module, seen through CausalLM
            ctx.hf_config,
            cfg.max_loras,
            cfg.max_lora_rank,
            cfg.max_cpu_loras,
            ctx.dtype,
            ctx.device,
        )

    def update(self, out: SchedulerOutput) -> None:
        if out.lora_loads:
            self.manager.load(out.lora_loads)

    def prepare(self, batch: Batch) -> bool:
        """Each token's adapter slot; the captured graphs hold no LoRA path, so a step with an
        adapter runs eagerly."""
        requests = self.ctx.requests
        names = [requests[rid].lora_name for rid in batch.req_ids]
        return self.manager.set_batch(
            self.manager.batch_slots(batch.req_ids, names), batch.query_lens
        )

    def proposed(self, batch: Batch, output: ModelRunnerOutput) -> None:
        """Requests whose adapter could not be placed fail alone (their rows ran as the base
        model; the scheduler finishes them before any of their blocks is cached)."""
        output.failed.update(self.manager.unplaced)
