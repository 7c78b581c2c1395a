"""The scheduler's side of images: the vision tower's counts summed over steps, for the stats
(`/metrics`). Listed by the engine for a vision model only."""

from __future__ import annotations

from scheduler.features import StepFeature
from scheduler.outputs import ModelRunnerOutput, SchedulerOutput


class ImageCounters(StepFeature):
    """Images encoded, encoder-cache hits and encoder time since the engine started."""

    def __init__(self) -> None:
        self.encoded = 0
        self.cache_hits = 0
        self.encoder_us = 0

    def after_update(self, sched_out: SchedulerOutput, runner_out: ModelRunnerOutput) -> None:
        step = runner_out.image_stats
        if step is not None:
            self.encoded += step.encoded
            self.cache_hits += step.cache_hits
            self.encoder_us += step.encoder_us

    def stats(self) -> dict[str, int]:
        return {
            "num_images_encoded": self.encoded,
            "num_encoder_cache_hits": self.cache_hits,
            "encoder_time_us": self.encoder_us,
        }
