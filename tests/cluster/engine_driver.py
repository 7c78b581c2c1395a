"""Drives Scheduler + an executor step by step, as EngineCore does, and collects greedy tokens."""

from __future__ import annotations

from scheduler import EngineRequest, Request, SamplingParams, Scheduler, SchedulerConfig


def greedy_tokens(
    executor,
    config: SchedulerConfig,
    prompts: list[list[int]],
    max_tokens: int,
    prefix: str = "req",
    scheduler: Scheduler | None = None,
) -> tuple[dict[str, list[int]], Scheduler]:
    """Run prompts to max_tokens greedy tokens each; returns tokens by request id and the
    scheduler (a Scheduler of config unless one is given)."""
    scheduler = scheduler or Scheduler(config)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        scheduler.add_request(Request(EngineRequest(f"{prefix}-{i}", prompt, params)))
    tokens: dict[str, list[int]] = {f"{prefix}-{i}": [] for i in range(len(prompts))}
    while scheduler.has_unfinished_requests():
        step = scheduler.schedule()
        for out in scheduler.update_from_output(step, executor.execute_model(step)):
            tokens[out.request_id].extend(out.new_token_ids)
    return tokens, scheduler
