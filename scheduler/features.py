"""Step features: the scheduler's side of a capability that can be switched on.

A feature (speculation, async overlap, the simulator's decode jump, ...) is an object with hooks
the `Scheduler` calls at fixed points of a step; every hook here does nothing, so a feature
overrides only what it needs. The list is built once from config (engine/core.py, sim/) and the
scheduler calls each hook on the features that override it, in list order, so a step with no
features pays nothing for them.

Order matters where two features touch the same output: speculation settles a verify row's
rejected slots from the whole runner output before async overlap drops the rows it no longer
speaks for, so `engine_features` lists speculation first.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from scheduler.outputs import ModelRunnerOutput, RequestOutput, SchedulerOutput
from scheduler.request import Request
from scheduler.step import NO_CAP

if TYPE_CHECKING:
    from scheduler.scheduler import Scheduler
    from scheduler.step import Step


@dataclass(frozen=True, slots=True)
class StepLimits:
    """What the next step may not run: requests held out of it (still in a step in flight) and
    the most requests it runs."""

    held: frozenset[str] = frozenset()
    max_reqs: int = NO_CAP


NO_LIMITS = StepLimits()


def step_limits(hooks: list[Callable[[], StepLimits]]) -> StepLimits:
    """The features' limits together: every request any holds, the smallest cap."""
    if not hooks:
        return NO_LIMITS
    limits = [hook() for hook in hooks]
    held = frozenset().union(*(lim.held for lim in limits))
    return StepLimits(held, min(lim.max_reqs for lim in limits))


class StepFeature:
    """The hooks of a feature, each a no-op. `bind` hands it the scheduler it serves (once)."""

    sched: Scheduler

    def bind(self, sched: Scheduler) -> None:
        self.sched = sched

    def step_limits(self) -> StepLimits:
        """Before a step is scheduled: the requests it must leave out and its request cap."""
        return NO_LIMITS

    def num_spec_tokens(self, req: Request) -> int:
        """Tokens beyond its next one that req's decode runs this step (proposals it verifies)."""
        return 0

    def after_schedule(self, step: Step, out: SchedulerOutput) -> None:
        """The step is decided and `out` built: add to it, note what is now in flight."""

    def before_update(
        self, sched_out: SchedulerOutput, runner_out: ModelRunnerOutput
    ) -> tuple[ModelRunnerOutput, list[RequestOutput]]:
        """Before sampled tokens are appended: the runner output to go on with, and outputs of
        requests this feature answered itself (they come first)."""
        return runner_out, []

    def after_update(self, sched_out: SchedulerOutput, runner_out: ModelRunnerOutput) -> None:
        """After the step's tokens are appended and its finished requests freed."""

    def tokens_in_flight(self) -> dict[str, int]:
        """Tokens per request scheduled in steps after the one being updated (KV not written)."""
        return {}

    def on_landed(self, req: Request) -> None:
        """req's KV load landed: it is running, its loaded blocks computed."""

    def on_preempt(self, req: Request) -> None:
        """req is being preempted (before its blocks are freed or swapped)."""

    def on_finish(self, req: Request) -> None:
        """req is finishing (before its blocks are freed)."""

    def stats(self) -> dict[str, int]:
        """SchedulerStats fields this feature fills."""
        return {}


@dataclass(frozen=True, slots=True)
class StepHooks:
    """Each hook's bound methods on the features that override it, in list order, found once: a
    hook no feature overrides is an empty list and costs a step nothing."""

    step_limits: list[Callable[[], StepLimits]]
    num_spec_tokens: list[Callable[[Request], int]]
    after_schedule: list[Callable[[Step, SchedulerOutput], None]]
    before_update: list[
        Callable[
            [SchedulerOutput, ModelRunnerOutput], tuple[ModelRunnerOutput, list[RequestOutput]]
        ]
    ]
    after_update: list[Callable[[SchedulerOutput, ModelRunnerOutput], None]]
    tokens_in_flight: list[Callable[[], dict[str, int]]]
    on_landed: list[Callable[[Request], None]]
    on_preempt: list[Callable[[Request], None]]
    on_finish: list[Callable[[Request], None]]
    stats: list[Callable[[], dict[str, int]]]

    @classmethod
    def of(cls, features: list[StepFeature]) -> StepHooks:
        return cls(**{name: _overriding(features, name) for name in HOOKS})


# The hooks the scheduler dispatches; a feature is called for those it overrides.
HOOKS = tuple(f.name for f in fields(StepHooks))


def _overriding(features: list[StepFeature], hook: str) -> list[Any]:
    """The bound `hook` methods of the features that override it, in list order."""
    base = getattr(StepFeature, hook)
    return [getattr(f, hook) for f in features if getattr(type(f), hook) is not base]
