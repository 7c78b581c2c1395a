"""StepPipeline: an executor's steps run in order on a thread of their own (async scheduling,
pipeline micro-batches).

The engine thread hands a step over and goes on to schedule the next one, and to turn the previous
one's tokens into outputs, while this step runs; torch releases the GIL in its kernels, and on CUDA
the thread only waits for the device. Steps run strictly one after another, so a step always sees
the KV cache and the sampled tokens that every earlier step left. An executor whose ranks take
steps ahead (PostsSteps: the multi-rank executors) needs no thread: each step is posted at once
and its output collected, in order, on the engine thread when it asks for it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol, TypeVar, runtime_checkable

import torch

from engine.executor import Executor
from scheduler.outputs import ModelRunnerOutput, SchedulerOutput

T = TypeVar("T")


@runtime_checkable
class PostsSteps(Protocol):
    """An executor that can send a step before the previous one is back (its ranks run them in
    order): what lets pipeline stages work on several micro-batches at once."""

    def post_step(self, scheduler_output: SchedulerOutput) -> None: ...

    def collect_step(self) -> ModelRunnerOutput:
        """The oldest posted step's output."""
        ...


class _Posted(Future[ModelRunnerOutput]):
    """A posted step's output, collected on the thread that asks for it (the engine's, which
    waits for it at once): no thread hand-off between the last stage's answer and the engine's
    next post, which is the path stage 0 waits on. Collecting it first collects every step
    posted before it, in order."""

    def __init__(self, pipeline: StepPipeline) -> None:
        super().__init__()
        self._pipeline = pipeline

    def result(self, timeout: float | None = None) -> ModelRunnerOutput:
        self._pipeline._collect_through(self)
        return super().result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self._pipeline._collect_through(self)
        return super().exception(timeout)


class StepPipeline:
    """Runs executor.execute_model on one thread, one step at a time, in submission order. An
    executor that PostsSteps gets each step at once, on the caller's thread, and its outputs are
    collected in order as the caller asks for them: several steps are then in the ranks' hands
    together."""

    def __init__(self, executor: Executor) -> None:
        self.executor = executor
        self._posts = executor if isinstance(executor, PostsSteps) else None
        self._posted: deque[_Posted] = deque()  # posted, not collected yet, oldest first
        self._failure: BaseException | None = None
        self._thread = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="raylm-step", initializer=_same_torch_settings()
        )

    def submit(self, scheduler_output: SchedulerOutput) -> Future[ModelRunnerOutput]:
        """Start the step once the steps before it are done (or, on an executor that posts steps,
        now); its future holds the sampling rank's output."""
        if self._posts is None:
            return self._thread.submit(self._run, self.executor.execute_model, scheduler_output)
        posted = _Posted(self)
        try:
            self._run(self._posts.post_step, scheduler_output)
        except BaseException as exc:
            posted.set_exception(exc)
            return posted
        self._posted.append(posted)
        return posted

    def _collect_through(self, posted: _Posted) -> None:
        """Collect the posted steps' outputs, oldest first, until `posted`'s is in."""
        assert self._posts is not None
        while not posted.done() and self._posted:
            oldest = self._posted.popleft()
            try:
                oldest.set_result(self._run(self._posts.collect_step))
            except BaseException as exc:
                oldest.set_exception(exc)

    def _run(self, call: Callable[..., T], *args: SchedulerOutput) -> T:
        if self._failure is not None:
            # A step after a failed one would read KV that was never written.
            raise RuntimeError(f"an earlier step failed: {self._failure!r}") from self._failure
        try:
            return call(*args)
        except BaseException as exc:
            self._failure = exc
            raise

    def shutdown(self) -> None:
        """Let the step in progress finish, drop those not started, and end the thread."""
        self._thread.shutdown(wait=True, cancel_futures=True)


def _same_torch_settings() -> Callable[[], None]:
    """What the step thread must share with this one: torch's CPU thread count (per thread under
    OpenMP) and the current CUDA device."""
    num_threads = torch.get_num_threads()
    device = torch.cuda.current_device() if torch.cuda.is_initialized() else None

    def apply() -> None:
        torch.set_num_threads(num_threads)
        if device is not None:
            torch.cuda.set_device(device)

    return apply
