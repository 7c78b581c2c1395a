"""A simulated replica with LoRA adapter slots: the production scheduler's (scheduler/lora_slots.py)
decide admissions and evictions; a step that loads adapters takes the load time longer."""

from __future__ import annotations

from scheduler import SchedulerConfig
from scheduler.lora_slots import LoraSlots
from sim.adapters import AdapterSlotsConfig
from sim.cost import CostModel
from sim.replica import SimReplica, StepPlan


class LoraSimReplica(SimReplica):
    """SimReplica whose scheduler has adapter slots, and whose steps pay for the loads they do."""

    def __init__(
        self,
        name: str,
        config: SchedulerConfig,
        cost: CostModel,
        max_tokens: int,
        adapters: AdapterSlotsConfig,
    ):
        super().__init__(name, config, cost, max_tokens)
        self.load_s = adapters.load_s
        self.scheduler.loras = LoraSlots(adapters.slots)  # as the engine sets max_loras
        self.lora_requests = 0  # requests for an adapter that reached the replica
        self.lora_hits = 0  # those whose adapter held a slot when they arrived

    @property
    def slots(self) -> LoraSlots:
        return self.scheduler.loras

    def arrive(self, lora_name: str | None) -> None:
        if lora_name is not None:
            slots = self.scheduler.loras
            if lora_name not in slots.names():
                slots.register(lora_name, lora_name)  # a simulated adapter has no files
            self.lora_requests += 1
            self.lora_hits += lora_name in slots.slot_of

    def start_step(self, now: float, stretch: float = 1.0) -> StepPlan | None:
        plan = super().start_step(now, stretch)
        if plan is not None and plan.output.lora_loads:
            load = len(plan.output.lora_loads) * self.load_s * stretch
            plan.end_s += load
            self.busy_s += load
        return plan
