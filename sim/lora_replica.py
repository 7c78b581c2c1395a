"""A simulated replica with LoRA adapter slots (sim/adapters.py): a request for an adapter waits
for a slot, and the step after a load takes the load time longer."""

from __future__ import annotations

import dataclasses
from collections import deque
from dataclasses import dataclass

from router.stats import MAX_REPORTED_PREFIX_HASHES, RoutingStats
from scheduler import RequestOutput, SchedulerConfig
from sim.adapters import AdapterSlots, AdapterSlotsConfig
from sim.cost import CostModel
from sim.replica import Cruise, SimReplica, StepPlan


@dataclass(slots=True)
class _Held:
    """A request waiting for its adapter's slot: add()'s arguments."""

    request_id: str
    prompt: list[int]
    output_len: int
    tenant: str
    priority: int
    arrival_s: float
    block_hashes: list[int] | None
    lora_name: str


class LoraSimReplica(SimReplica):
    """SimReplica whose requests for an adapter enter the scheduler once the adapter has a slot."""

    def __init__(
        self,
        name: str,
        config: SchedulerConfig,
        cost: CostModel,
        max_tokens: int,
        adapters: AdapterSlotsConfig,
    ):
        super().__init__(name, config, cost, max_tokens)
        self.slots = AdapterSlots(adapters)
        self._adapter_of: dict[str, str] = {}  # admitted, unfinished requests' adapters
        self._held: deque[_Held] = deque()  # first come, first served

    def add(
        self,
        request_id: str,
        prompt: list[int],
        output_len: int,
        tenant: str,
        priority: int,
        now: float,
        block_hashes: list[int] | None = None,
        lora_name: str = "",
    ) -> None:
        held = _Held(request_id, prompt, output_len, tenant, priority, now, block_hashes, lora_name)
        if not lora_name:
            self._enter(held)
            return
        self.slots.arrive(lora_name)
        # With requests held, no slot is free: only a loaded adapter's request gets in (it need not
        # queue behind requests for adapters that wait for a slot, as in the engine's scheduler).
        if self.slots.admit(lora_name):
            self._adapter_of[request_id] = lora_name
            self._enter(held)
        else:
            self._held.append(held)

    def _enter(self, h: _Held) -> None:
        super().add(
            h.request_id,
            h.prompt,
            h.output_len,
            h.tenant,
            h.priority,
            h.arrival_s,
            h.block_hashes,
            h.lora_name,
        )

    def _forget_finished(self, outputs: list[RequestOutput]) -> None:
        super()._forget_finished(outputs)
        for o in outputs:
            if o.finished and o.request_id in self._adapter_of:
                self.slots.release(self._adapter_of.pop(o.request_id))
        if self._held:
            self._admit_held()

    def _admit_held(self) -> None:
        """Admit held requests, first come first served, whose adapter now gets a slot."""
        still: deque[_Held] = deque()
        for held in self._held:
            if self.slots.admit(held.lora_name):
                self._adapter_of[held.request_id] = held.lora_name
                self._enter(held)
            else:
                still.append(held)
        self._held = still

    def plan_cruise(self, now: float, horizon_s: float, min_steps: int = 2) -> Cruise | None:
        if self.slots.load_due_s:
            return None  # the next step loads an adapter: start_step times it
        return super().plan_cruise(now, horizon_s, min_steps)

    def start_step(self, now: float, stretch: float = 1.0) -> StepPlan | None:
        plan = super().start_step(now, stretch)
        if plan is not None and self.slots.load_due_s:
            load = self.slots.take_load_s() * stretch
            plan.end_s += load
            self.busy_s += load
        return plan

    def routing_stats(self, max_hashes: int = MAX_REPORTED_PREFIX_HASHES) -> RoutingStats:
        """The base report, listing the adapters in the slots."""
        stats = super().routing_stats(max_hashes)
        loaded = tuple(self.slots.loaded)
        return dataclasses.replace(
            stats, scheduler=dataclasses.replace(stats.scheduler, loaded_loras=loaded)
        )
