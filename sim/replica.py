"""One simulated replica: the production Scheduler (with the multi-step decode of sim/jump.py as
one of its step features) and a stand-in runner timed by the cost model."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from router.stats import MAX_REPORTED_PREFIX_HASHES, RoutingStats
from scheduler import (
    EngineRequest,
    ModelRunnerOutput,
    Request,
    RequestOutput,
    SamplingParams,
    SchedulerConfig,
    SchedulerOutput,
)
from scheduler.features import StepFeature
from sim.cost import CostModel
from sim.jump import DecodeJump, sim_scheduler

EOS = 0
TOKEN = 1


@dataclass(slots=True)
class StepPlan:
    """A scheduled step in flight: what the scheduler decided and when it completes."""

    output: SchedulerOutput
    end_s: float


@dataclass(slots=True)
class Cruise:
    """A planned run of pure-decode steps, applied in one jump when it ends or is interrupted.

    Only its last step may finish requests, so until it ends the replica changes nothing the rest
    of the fleet sees; an arrival routed to the replica applies the steps ended by then and the one
    running, whose effects nothing observes before it ends (the last step runs as a single step).
    """

    start_s: float
    ends: list[float]  # end time of each step, summed step by step as single steps would
    durations: list[float]
    applied: int = 0  # leading steps already applied to the scheduler and the records

    @property
    def end_s(self) -> float:
        return self.ends[-1]


@dataclass(slots=True)
class AppliedStep:
    """The running step of an interrupted cruise, applied ahead of its end: ending it only frees the
    replica."""

    end_s: float


@functools.lru_cache(maxsize=4096)
def _greedy(max_tokens: int) -> SamplingParams:
    """Greedy sampling params of this length, validated once and shared by every replica (never
    mutated)."""
    return SamplingParams(max_tokens=max_tokens, temperature=0.0)


def step_shape(out: SchedulerOutput, requests: dict[str, Request]) -> tuple[int, int, int, int]:
    """(prefill tokens, decode tokens, KV tokens read, prefill attention pairs) of a scheduled step.

    Called after schedule(), which has already advanced num_computed_tokens. A request computing
    one token past its prompt is a decode; anything else (prompt chunks, recompute) is prefill, and
    its n tokens after `start` cached ones attend to n * start + n * (n + 1) / 2 (query, key) pairs.
    `sim calibrate` counts the steps it times with this same function.
    """
    prefill = decode = kv_read = pairs = 0
    for rid, n in out.num_scheduled_tokens.items():
        req = requests[rid]
        start = req.num_computed_tokens - n
        kv_read += start
        if n == 1 and start >= req.num_prompt_tokens:
            decode += 1
        else:
            prefill += n
            pairs += n * start + n * (n + 1) // 2
    return prefill, decode, kv_read, pairs


class SimReplica:
    """A real Scheduler whose steps take the cost model's time and sample EOS at the output
    length."""

    def __init__(self, name: str, config: SchedulerConfig, cost: CostModel, max_tokens: int = 0):
        self.name = name
        self.max_tokens = max_tokens  # 0: each request's output length
        # The production scheduler with the multi-step decode (sim/jump.py) among its features.
        self.decode_jump = DecodeJump()
        self.scheduler = sim_scheduler(config, [*self.step_features(), self.decode_jump])
        self.cost = cost
        self.output_len: dict[str, int] = {}
        self.in_flight: StepPlan | Cruise | AppliedStep | None = None
        self.num_steps = 0
        self.busy_s = 0.0

    def step_features(self) -> list[StepFeature]:
        """The scheduler's features besides the jump (a subclass's capability: speculation, the
        landing of a handed-on prompt); called once, first thing in __init__."""
        return []

    def arrive(self, lora_name: str | None) -> None:
        """Called first by add, before the request is queued: nothing here (LoraSimReplica counts
        whether the request's adapter already holds a slot)."""

    def add(
        self,
        request_id: str,
        prompt: list[int],
        output_len: int,
        tenant: str,
        priority: int,
        now: float,
        block_hashes: list[int] | None = None,
        lora_name: str | None = None,
        output_token_ids: list[int] | None = None,
    ) -> None:
        """Queue a request; block_hashes, the prompt's full-block hashes if the router computed
        them (under lora_name, its adapter: None for the base model); output_token_ids, outputs
        sampled elsewhere (a request handed on by a prefill replica, sim/disagg.py)."""
        self.arrive(lora_name)
        self.output_len[request_id] = output_len
        params = _greedy(max(output_len, self.max_tokens))
        # The scheduler extends the hash chain from what it is given (the same hash, so the same
        # keys).
        self.scheduler.add_request(
            Request(
                EngineRequest(
                    request_id,
                    prompt,
                    params,
                    eos_token_ids=(EOS,),
                    priority=priority,
                    tenant=tenant,
                    block_hashes=block_hashes or [],
                    output_token_ids=output_token_ids or [],
                    lora_name=lora_name,
                ),
                arrival_time=now,
            )
        )

    def plan_cruise(self, now: float, horizon_s: float, min_steps: int = 2) -> Cruise | None:
        """Plan pure-decode steps that sample no EOS, up to the one running at horizon_s (None if
        under min_steps)."""
        sched = self.scheduler
        running = sched.running
        if not running:
            return None
        # The step sampling a request's last token finishes it: the cruise ends with the first such.
        limit = min(self.output_len[r.request_id] - len(r.output_token_ids) for r in running)
        limit = self.decode_jump.max_decode_jump(limit) if limit >= min_steps else 0
        if limit < min_steps:
            return None
        n = len(running)
        kv_read = sum(r.num_computed_tokens for r in running)
        # As start_step counts them: a request computing its last prompt token is prefill (step 1
        # only).
        prefill = sum(1 for r in running if r.num_computed_tokens < r.num_prompt_tokens)
        pairs = sum(
            r.num_computed_tokens + 1
            for r in running
            if r.num_computed_tokens < r.num_prompt_tokens
        )
        ends: list[float] = []
        durations: list[float] = []
        start = now  # of the pure-decode steps
        if prefill:  # timed as the single step would be; the steps after it decode only
            d = self.cost.step_time(prefill, n - prefill, kv_read, n, pairs)
            start = now + d
            ends.append(start)
            durations.append(d)
            kv_read += n
        if not prefill or start <= horizon_s:  # the step running at the horizon is the last
            self.cost.decode_steps(n, kv_read, start, limit - len(ends), horizon_s, ends, durations)
        if len(ends) < min_steps:
            return None
        self.in_flight = Cruise(now, ends, durations)
        return self.in_flight

    def jump(self, upto: int) -> list[RequestOutput]:
        """Apply the cruise in flight's steps not yet applied, up to step `upto`, all at once."""
        cruise = self.in_flight
        assert isinstance(cruise, Cruise) and cruise.applied < upto <= len(cruise.ends)
        num_steps = upto - cruise.applied
        tokens = [TOKEN] * num_steps  # one list for all that run on: advance_decode only reads it
        last = [*tokens[1:], EOS]  # and one for those whose output length the last step reaches
        output_len = self.output_len
        outputs = self.decode_jump.advance_decode(
            {
                r.request_id: last
                if output_len[r.request_id] - len(r.output_token_ids) == num_steps
                else tokens
                for r in self.scheduler.running
            }
        )
        self._forget_finished(outputs)
        for d in cruise.durations[cruise.applied : upto]:
            self.busy_s += d
        self.num_steps += num_steps
        cruise.applied = upto
        return outputs

    def step_singly(self) -> StepPlan:
        """Run the cruise in flight's next step as a single step, timed as the cruise planned it."""
        cruise = self.in_flight
        assert isinstance(cruise, Cruise) and cruise.applied < len(cruise.ends)
        out = self.scheduler.schedule()
        self.busy_s += cruise.durations[cruise.applied]
        self.num_steps += 1
        self.in_flight = StepPlan(out, cruise.ends[cruise.applied])
        return self.in_flight

    def start_step(self, now: float, stretch: float = 1.0) -> StepPlan | None:
        """Schedule the next step (None if nothing to run) and time it (times stretch: shared
        cores)."""
        out = self.scheduler.schedule()
        if out.is_empty and out.kv_transfers is None:  # a step may only copy KV (a landing)
            return None
        duration = self.step_seconds(out)
        if stretch != 1.0:
            duration *= stretch
        self.in_flight = StepPlan(out, now + duration)
        self.num_steps += 1
        self.busy_s += duration
        return self.in_flight

    def step_seconds(self, out: SchedulerOutput) -> float:
        """How long the scheduled step takes: the cost model's time of its shape (sim/kv_copy.py
        adds the step's KV copies)."""
        prefill, decode, kv_read, pairs = step_shape(out, self.scheduler.requests)
        return self.cost.step_time(prefill, decode, kv_read, len(out.num_scheduled_tokens), pairs)

    def finish_step(self) -> list[RequestOutput]:
        """Sample for every request whose scheduled tokens reach its end; apply to the scheduler."""
        plan, self.in_flight = self.in_flight, None
        assert isinstance(plan, StepPlan)
        requests = self.scheduler.requests
        req_ids: list[str] = []
        sampled: list[list[int]] = []
        for rid in plan.output.num_scheduled_tokens:
            req = requests.get(rid)
            req_ids.append(rid)
            if req is None or req.num_computed_tokens < req.num_tokens:
                sampled.append([])  # partial prefill: nothing sampled
            else:
                last = req.num_output_tokens + 1 >= self.output_len[rid]
                sampled.append([EOS if last else TOKEN])
        outputs = self.scheduler.update_from_output(
            plan.output, ModelRunnerOutput(req_ids, sampled)
        )
        self._forget_finished(outputs)
        return outputs

    def _forget_finished(self, outputs: list[RequestOutput]) -> None:
        for o in outputs:
            if o.finished:
                del self.output_len[o.request_id]

    def routing_stats(self, max_hashes: int = MAX_REPORTED_PREFIX_HASHES) -> RoutingStats:
        """What a production replica reports to the router (cluster/replica.py): queue lengths, KV
        usage and the pool's prefix report."""
        return RoutingStats(
            self.scheduler.stats(),
            prefix=self.scheduler.kv.pool.prefix_report(max_hashes),
            predicted=self.scheduler.predicted_load(),
        )
