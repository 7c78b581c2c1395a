"""StepPipeline over an executor that posts steps ahead (engine/step_pipeline.py): every posted
step's output is collected in post order, on the thread that asks for it (no thread between the
last stage's answer and the engine's next post), and a failed step fails every later one.

The executor here is the PostsSteps interface's smallest honest implementation: a FIFO of posted
steps whose outputs name the step; the real transports (the step channel, the mp and Ray
executors) are proved in tests/engine/test_pipeline_microbatch.py and tests/cluster/."""

from __future__ import annotations

import threading
from collections import deque

import pytest

from engine.step_pipeline import PostsSteps, StepPipeline
from scheduler.outputs import CachedRequestData, ModelRunnerOutput, SchedulerOutput


class _Ranks:
    """Answers each posted step, in order, with one token: the step's number."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.posted: deque[int] = deque()
        self.count = 0
        self.collected_on: list[str] = []
        self.fail_at = fail_at

    def post_step(self, scheduler_output: SchedulerOutput) -> None:
        self.posted.append(self.count)
        self.count += 1

    def collect_step(self) -> ModelRunnerOutput:
        step = self.posted.popleft()
        self.collected_on.append(threading.current_thread().name)
        if step == self.fail_at:
            raise RuntimeError(f"rank failed in step {step}")
        return ModelRunnerOutput([f"step{step}"], [[step]])

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        raise AssertionError("an executor that posts steps is never asked to run one whole")


def _step() -> SchedulerOutput:
    return SchedulerOutput([], CachedRequestData(), {}, 0)


def test_outputs_come_back_in_post_order_on_the_asking_thread():
    ranks = _Ranks()
    assert isinstance(ranks, PostsSteps)
    pipeline = StepPipeline(ranks)
    try:
        futures = [pipeline.submit(_step()) for _ in range(3)]
        assert ranks.collected_on == []  # nothing collected until asked for
        # Asking for the newest collects the older ones first, in order.
        assert futures[2].result().sampled_token_ids == [[2]]
        assert [f.result().sampled_token_ids for f in futures] == [[[0]], [[1]], [[2]]]
        assert ranks.collected_on == [threading.current_thread().name] * 3
    finally:
        pipeline.shutdown()


def test_a_failed_step_fails_it_and_every_step_after_it():
    ranks = _Ranks(fail_at=1)
    pipeline = StepPipeline(ranks)
    try:
        futures = [pipeline.submit(_step()) for _ in range(3)]
        assert futures[0].result().sampled_token_ids == [[0]]
        with pytest.raises(RuntimeError, match="rank failed in step 1"):
            futures[1].result()
        # Step 2 would read KV that step 1 never wrote: it fails without being collected.
        with pytest.raises(RuntimeError, match="an earlier step failed"):
            futures[2].result()
        assert isinstance(futures[2].exception(), RuntimeError)
        with pytest.raises(RuntimeError, match="an earlier step failed"):
            pipeline.submit(_step()).result()
        assert len(ranks.collected_on) == 2
    finally:
        pipeline.shutdown()
