"""Weight updates and sleep of one engine, applied between steps (the ranks' side:
workers/weight_update.py; the trainer's: workers/weight_transfer.py; docs/rl.md).

An update is staged on every rank (read and checked: nothing replaced yet), then committed on
every rank. Requests in flight either finish on the old weights first (`in_flight="finish"`: new
requests wait, the update applies once the engine drains) or are preempted and recomputed on the
new ones (`"recompute"`: it applies at the next step boundary). Either way the prefix cache and the
KV tiers are emptied: their blocks hold KV of the old weights.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

from engine.asleep import EngineAsleepError
from engine.weight_modes import IN_FLIGHT, SLEEP_LEVELS
from scheduler.preempt import preempt
from scheduler.request import EngineRequest, RequestStatus
from scheduler.step import Step
from workers import weight_update as rank
from workers.weight_transfer import WeightGroupSpec

if TYPE_CHECKING:
    from collections.abc import Callable

    from engine.core import EngineCore

logger = logging.getLogger(__name__)

STAGE_TIMEOUT_S = 3600.0  # reading and checking a large checkpoint on every rank


@dataclass(slots=True)
class PendingUpdate:
    path: str | None  # None: from the weight group
    in_flight: str
    done: Future[int] = field(default_factory=Future)


class EngineWeights:
    """One engine's weight updates and sleep state (EngineCore.weights)."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.pending: PendingUpdate | None = None
        self.held: list[EngineRequest] = []  # arrived while a "finish" update waits
        self.asleep = 0  # the sleep level, 0: awake
        self.discarded = False  # sleep level 2 dropped the weights: an update must follow
        self.group_timeout_s: float | None = None
        self.num_updates = 0

    # ---- what the step loop asks -----------------------------------------------------------------
    def admit(self, request: EngineRequest) -> bool:
        """False when the request is held until the pending update applies; raises while asleep."""
        if self.asleep or self.discarded:
            raise EngineAsleepError(self.why_unavailable())
        if self.pending is not None and self.pending.in_flight == "finish":
            self.held.append(request)
            return False
        return True

    def why_unavailable(self) -> str:
        if self.asleep:
            return f"engine asleep (level {self.asleep}): wake_up first"
        return "engine weights discarded by sleep(level=2, discard_weights=True): update_weights"

    def busy(self) -> bool:
        return self.pending is not None or bool(self.held)

    def holds_launch(self) -> bool:
        """A recompute update waits for the step in flight: no further step is launched."""
        return self.pending is not None and self.pending.in_flight == "recompute"

    def before_step(self) -> None:
        """Apply the pending update if the engine has reached the point it waits for."""
        pending, sched = self.pending, self.core.scheduler
        if pending is None or self.core._in_flight or sched.loading:
            return
        if pending.in_flight == "finish" and sched.has_unfinished_requests():
            return
        if any(r.status == RequestStatus.SWAPPED for r in sched.waiting):
            return  # their KV is on the CPU pool: swapped in (and preempted) before it applies
        self.pending = None
        self._apply(pending)
        held, self.held = self.held, []
        for request in held:
            try:
                self.core.add_request(request)
            except ValueError:  # checked when it arrived; a LoRA removed since is its own error
                logger.warning("request %s could not start after the update", request.request_id)

    # ---- updates -------------------------------------------------------------------------------
    def update(self, path: str | None, in_flight: str) -> Future[int]:
        """Schedule an update (see EngineCore.update_weights)."""
        if in_flight not in IN_FLIGHT:
            raise ValueError(f"in_flight: must be one of {', '.join(IN_FLIGHT)}, got {in_flight!r}")
        stages = getattr(self.core.config, "pipeline_parallel_size", 1)
        if stages != 1:  # a stage's loader holds only its layers: it would fail mid-update
            raise ValueError(f"pipeline_parallel_size: updates take one stage, not {stages}")
        if path is not None:
            rank.weight_files(path)  # a path that is no checkpoint fails now, not at a step
        elif self.group_timeout_s is None:
            raise ValueError("weight group: join one first (init_weight_group)")
        if self.pending is not None:
            raise ValueError("update_weights: another update is pending")
        self.pending = PendingUpdate(path, in_flight)
        pending = self.pending
        self.before_step()  # at once when nothing is in flight
        return pending.done

    def _apply(self, pending: PendingUpdate) -> None:
        try:
            self._stage(pending.path)
        except BaseException as exc:
            self._call(rank.drop_staged)
            pending.done.set_exception(exc)
            return
        if pending.in_flight == "recompute":
            self._recompute_running()
        self.reset_prefix_cache()
        try:
            counts = self._call(rank.commit)
        except BaseException as exc:
            # Some ranks may hold new weights and others old ones: the engine cannot go on.
            self.core.failure = exc
            pending.done.set_exception(exc)
            return
        self.discarded = False
        self.num_updates += 1
        logger.info("weights updated: %d tensors (%s)", counts[0], pending.path or "weight group")
        pending.done.set_result(counts[0])

    def _stage(self, path: str | None) -> None:
        if path is not None:
            self._call(partial(rank.stage_path, path=path), STAGE_TIMEOUT_S)
        else:
            self._call(rank.stage_group, self.group_timeout_s or STAGE_TIMEOUT_S)

    def _recompute_running(self) -> None:
        """Every running request gives its blocks back and recomputes from its first token; the
        runners hear of it through a step that runs nothing else."""
        core = self.core
        sched = core.scheduler
        step = Step(budget=0)
        for request in list(sched.running):
            request.known_to_runner = False  # never swapped: recomputed, resent in full
            preempt(sched, request, step)
        if step.preempted:
            out = step.output(0, set())
            core.executor.execute_model(out)

    def reset_prefix_cache(self) -> None:
        sched = self.core.scheduler
        forgotten = sched.kv.pool.reset_prefix_cache()
        if sched.connector is not None:
            forgotten += sched.connector.reset()
        logger.info("prefix cache emptied: %d blocks forgotten", forgotten)

    # ---- the weight group ------------------------------------------------------------------------
    def join_group(self, spec: WeightGroupSpec) -> None:
        if self.group_timeout_s is not None:
            raise ValueError("weight group: this engine already belongs to one; leave it first")
        self._call(partial(rank.join_group, spec=spec), spec.timeout_s + 60)
        self.group_timeout_s = spec.timeout_s + 60

    def leave_group(self) -> None:
        self._call(rank.leave_group)
        self.group_timeout_s = None

    # ---- sleep ---------------------------------------------------------------------------------
    def sleep(self, level: int, discard_weights: bool) -> None:
        if isinstance(level, bool) or level not in SLEEP_LEVELS:
            raise ValueError(f"level: must be 1 or 2, got {level!r}")
        if not isinstance(discard_weights, bool) or (discard_weights and level != 2):
            raise ValueError("discard_weights: true only with level 2")
        if self.asleep:
            raise ValueError(f"sleep: already asleep at level {self.asleep}")
        if self.core.has_unfinished_requests():
            raise ValueError("sleep: requests are in flight; let them finish or abort them first")
        self._call(partial(rank.sleep, level=level, discard=discard_weights))
        self.reset_prefix_cache()  # the blocks' contents are gone
        self.asleep, self.discarded = level, self.discarded or discard_weights

    def wake_up(self) -> None:
        if not self.asleep:
            raise ValueError("wake_up: the engine is not asleep")
        self._call(rank.wake_up)
        self.asleep = 0

    # ---- every rank ----------------------------------------------------------------------------
    def _call(self, fn: Callable[[Any], Any], timeout_s: float = 600.0) -> list[Any]:
        call_ranks = getattr(self.core.executor, "call_ranks", None)
        if call_ranks is None:
            raise ValueError("weights: this executor cannot run work on its ranks")
        return call_ranks(fn, timeout_s)
