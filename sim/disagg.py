"""Prefill/decode disaggregation in the simulator: a prefill pool and a decode pool, sized apart.

A request is routed to a prefill replica, which computes its prompt and samples its first token
(streamed to the client at once: the ingress owns emitted tokens). Its prompt's KV then crosses
the link to a decode replica chosen by the same router (load and prefix), taking
`latency_s + prompt tokens * KV bytes per token / bandwidth`; the decode replica queues the request
with its first token as an output, and its production scheduler admits it through the KV
connector's "KV arriving" state (`LOADING_KV`: lookup, load, land, as for the CPU tier), so the
request decodes from its second token on without recomputing its prompt.

What is modelled, and what is not:
- The transfer is pushed to a receive buffer on the decode side; the decode replica holds no
  blocks for a request until it lands (admission reserves them for the whole sequence, as for a
  tier load), and the landing copy runs at `land` (default: the device's own bandwidth).
- The production connector lands whole blocks only; `LandWholePrompt` lands the prompt's partial
  last block too, as a disaggregating transport sends it: the decode replica's first step is a
  one-token decode, not a recompute of up to a block of prompt. (A prompt whose every full block
  the decode replica already caches loads nothing, so the tail is recomputed there.)
- The prefill replica frees the request's blocks at its first token (they stay cached there);
  a real one holds them until the transfer is done, which the pool sizes here do not feel.
- Prompts shorter than `local_prefill_tokens` skip the prefill pool and run whole on a decode
  replica (conditional disaggregation).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from router.policies import RouteRequest
from scheduler import RequestOutput, SchedulerConfig
from scheduler.features import StepFeature
from scheduler.kv_connector import KVConnector, LoadPlan
from scheduler.request import Request
from settings import check_settings, setting
from sim.cost import CostModel
from sim.fleet import FleetSim
from sim.fleet_config import SimConfig
from sim.kv_copy import KVCopyReplica, LinkConfig
from sim.metrics import RequestRecord
from sim.replica import TOKEN, SimReplica
from sim.workload import SimRequest

MAX_POOL_REPLICAS = 1 << 20
MAX_PROMPT_TOKENS = 1 << 24


@dataclass(frozen=True, slots=True)
class DisaggConfig:
    """The two pools and the link between them."""

    prefill_replicas: int = setting(1, "replicas of the prefill pool", ge=1, le=MAX_POOL_REPLICAS)
    decode_replicas: int = setting(1, "replicas of the decode pool", ge=1, le=MAX_POOL_REPLICAS)
    link: LinkConfig = field(default_factory=LinkConfig)  # prefill replica -> decode replica
    # Receive buffer -> the decode replica's device pool (None: the profile's memory bandwidth).
    land: LinkConfig | None = None
    local_prefill_tokens: int = setting(
        0,
        "prompts shorter than this skip the prefill pool (0: none do)",
        ge=0,
        le=MAX_PROMPT_TOKENS,
    )
    prefill_scheduler: SchedulerConfig | None = None  # the prefill replicas' (None: SimConfig's)

    def __post_init__(self) -> None:
        check_settings(self)

    @property
    def num_replicas(self) -> int:
        return self.prefill_replicas + self.decode_replicas


class ReceiveBuffer(KVConnector):
    """KV pushed by prefill replicas, waiting on a decode replica: the production connector, its
    CPU-tier index standing for the buffer, so lookup, load and land run unchanged. A request's
    blocks enter when its transfer lands (`expect`) and leave when it lands on the device or
    finishes (`release`); blocks two requests share are counted, not copied twice."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._refs: Counter[int] = Counter()
        self._by_req: dict[str, list[int]] = {}

    def expect(self, req_id: str, hashes: Sequence[int]) -> None:
        held = []
        for h in hashes:
            if not self._refs[h] and self.cpu.insert(h) is None:
                break  # the buffer is full: the rest is recomputed
            self._refs[h] += 1
            held.append(h)
        self._by_req[req_id] = held

    def release(self, req_id: str) -> None:
        for h in self._by_req.pop(req_id, ()):
            self._refs[h] -= 1
            if not self._refs[h]:
                del self._refs[h]
                if h in self.cpu:
                    self.cpu.remove(h)

    def land(self, req_id: str, failed_blocks: set[int]) -> LoadPlan | None:
        plan = super().land(req_id, failed_blocks)
        self.release(req_id)
        return plan


class LandWholePrompt(StepFeature):
    """The simulator's landing of a handed-on request: its whole prompt (the partial last block
    included), so that its next step decodes its first token's successor."""

    def on_landed(self, req: Request) -> None:
        bs = self.sched.kv.block_size
        last = req.num_tokens - 1  # the first token, sampled by the prefill replica
        if req.num_output_tokens and req.num_computed_tokens >= last // bs * bs:
            req.num_computed_tokens = last


class DecodeSimReplica(KVCopyReplica):
    """A decode replica: a receive buffer in front of its production scheduler's admission."""

    def __init__(
        self, name: str, config: SchedulerConfig, cost: CostModel, max_tokens: int, land: LinkConfig
    ):
        super().__init__(name, config, cost, max_tokens, land)
        self.buffer = ReceiveBuffer(2 * (config.num_gpu_blocks or 1))
        self.scheduler.connector = self.buffer  # no tier: nothing wires the pool's evictions to it

    def step_features(self) -> list[StepFeature]:
        return [LandWholePrompt()]

    def _forget_finished(self, outputs: list[RequestOutput]) -> None:
        for o in outputs:
            if o.finished:
                self.buffer.release(o.request_id)
        super()._forget_finished(outputs)


@dataclass(slots=True)
class _Handoff:
    """A request between its prefill and its decode replica."""

    req: SimRequest
    prompt: list[int]
    hashes: list[int]
    prefill: str = ""
    decode: str = ""


class DisaggSim(FleetSim):
    """FleetSim with a prefill pool and a decode pool (see the module doc); one router (the
    production FleetState) ranks each pool's replicas for the request's phase."""

    def __init__(self, config: SimConfig, cost: CostModel, disagg: DisaggConfig):
        if config.adapters is not None or config.host.shared:
            raise ValueError("disagg: not with LoRA adapters or shared hosts in this simulator")
        super().__init__(dataclasses.replace(config, num_replicas=disagg.num_replicas), cost)
        self.disagg = disagg
        land = disagg.land or LinkConfig(bandwidth_bytes_per_s=cost.bytes_per_s)
        prefill_cfg = disagg.prefill_scheduler or config.scheduler
        prefill_cfg = SimConfig(scheduler=prefill_cfg).scheduler  # the simulator's pool defaults
        self.prefill = [
            SimReplica(f"prefill-{i}", prefill_cfg, cost, config.max_tokens)
            for i in range(disagg.prefill_replicas)
        ]
        self.decode = [
            DecodeSimReplica(f"decode-{i}", config.scheduler, cost, config.max_tokens, land)
            for i in range(disagg.decode_replicas)
        ]
        self.replicas = [*self.prefill, *self.decode]
        self.names = tuple(r.name for r in self.replicas)
        self._by_name = {r.name: r for r in self.replicas}
        self._index = {r.name: i for i, r in enumerate(self.replicas)}
        self.prefill_names = tuple(r.name for r in self.prefill)
        self.decode_names = tuple(r.name for r in self.decode)
        self._handoffs: dict[str, _Handoff] = {}
        self.transfer_s: list[float] = []  # each handoff's time on the link

    def _arrive(
        self, i: int, req: SimRequest, now: float, records: dict[str, RequestRecord]
    ) -> None:
        prompt = req.prompt_token_ids(i)
        hashes = self._hashes(req, prompt, None)
        local = req.prompt_len < self.disagg.local_prefill_tokens
        pool = self.decode_names if local else self.prefill_names
        route = RouteRequest(req.request_id, req.prompt_len + req.output_len, hashes)
        name = self.fleet.choose(route, pool, now)
        assert name is not None
        self.fleet.on_routed(route, name, now)
        replica = self._by_name[name]
        self._before_add(replica, now, records)
        records[req.request_id].replica = name
        output_len = req.output_len
        if not local and output_len > 1:  # the prefill replica samples the first token only
            self._handoffs[req.request_id] = _Handoff(req, prompt, hashes, name)
            output_len = 1
        replica.add(req.request_id, prompt, output_len, req.tenant, req.priority, now, hashes)
        self._after_add(replica, now)

    def _on_finished(
        self, replica: SimReplica, rec: RequestRecord, out: RequestOutput, now: float
    ) -> int:
        handoff = self._handoffs.pop(out.request_id, None)
        if handoff is None:  # a decode replica's, or a local prefill's: the request is done
            return super()._on_finished(replica, rec, out, now)
        self.fleet.on_completed(out.request_id)  # the prefill replica's load ends here
        req = handoff.req
        route = RouteRequest(req.request_id, req.prompt_len + req.output_len, handoff.hashes)
        name = self.fleet.choose(route, self.decode_names, now)
        assert name is not None
        self.fleet.on_routed(route, name, now)
        handoff.decode = name
        seconds = self.disagg.link.seconds(req.prompt_len, self.cost)
        self.transfer_s.append(seconds)
        self._timer(now + seconds, lambda t, records: self._land(handoff, t, records))
        return 0

    def _land(self, handoff: _Handoff, now: float, records: dict[str, RequestRecord]) -> None:
        """The prompt's KV reached the decode replica's buffer: the request joins its queue."""
        replica = self._by_name[handoff.decode]
        assert isinstance(replica, DecodeSimReplica)
        req = handoff.req
        self._before_add(replica, now, records)
        records[req.request_id].replica = f"{handoff.prefill}>{handoff.decode}"
        replica.buffer.expect(req.request_id, handoff.hashes)
        replica.add(
            req.request_id,
            handoff.prompt,
            req.output_len,
            req.tenant,
            req.priority,
            now,
            handoff.hashes,
            output_token_ids=[TOKEN],
        )
        self._after_add(replica, now)
