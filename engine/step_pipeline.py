"""StepPipeline: an executor's steps run in order on a thread of their own (async scheduling).

The engine thread hands a step over and goes on to schedule the next one, and to turn the previous
one's tokens into outputs, while this step runs; torch releases the GIL in its kernels, and on CUDA
the thread only waits for the device. Steps run strictly one after another, so a step always sees
the KV cache and the sampled tokens that every earlier step left.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from engine.executor import Executor
from scheduler.outputs import ModelRunnerOutput, SchedulerOutput


class StepPipeline:
    """Runs executor.execute_model on one thread, one step at a time, in submission order."""

    def __init__(self, executor: Executor) -> None:
        self.executor = executor
        self._failure: BaseException | None = None
        self._thread = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="raylm-step", initializer=_same_torch_settings()
        )

    def submit(self, scheduler_output: SchedulerOutput) -> Future[ModelRunnerOutput]:
        """Start the step once the steps before it are done; its future holds rank 0's output."""
        return self._thread.submit(self._run, scheduler_output)

    def _run(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        if self._failure is not None:
            # A step after a failed one would read KV that was never written.
            raise RuntimeError(f"an earlier step failed: {self._failure!r}") from self._failure
        try:
            return self.executor.execute_model(scheduler_output)
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
