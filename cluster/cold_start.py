"""A replica's cold start, phase by phase: from its process's start to its first token.

The phases a replica sees, in order (seconds each):
- `process_and_imports`: the process starts (Ray's worker boot) and imports the replica's code
  (torch and the engine);
- the engine's own (EngineCore.startup): `model_config`, `weights` (build, load, pack),
  `kv_profile` (the profiling forward on CUDA), `kv_allocation` (with CUDA graph capture where it
  runs);
- `ready`: the rest of the constructor, after the engine;
- `first_request`: the constructor's return until the first request arrives (Serve marks the
  replica running and the routers learn of it);
- `first_token`: that request's prefill, until its first token.

What comes before the process (the scale-up decision, placement) only the caller can see:
bench/cold_start.py measures it from the request that woke the deployment.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field

from ray.util.metrics import Histogram

logger = logging.getLogger(__name__)

_BUCKETS = [0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0]


def process_start_time() -> float | None:
    """This process's start, in time.time() seconds (Linux /proc; None elsewhere)."""
    try:
        with open(f"/proc/{os.getpid()}/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


@dataclass(slots=True)
class ColdStart:
    """The phases of one replica's start as they complete; each is logged and exported once."""

    model: str
    replica: str
    started: float = field(default_factory=time.time)  # the constructor's start
    phases: dict[str, float] = field(default_factory=dict)
    marks: dict[str, float] = field(default_factory=dict)  # time.time() at each phase's end
    _metric: Histogram | None = None

    def __post_init__(self) -> None:
        self._metric = Histogram(
            "raylm_cold_start_seconds",
            "A replica's cold start by phase, from its process's start to its first token.",
            boundaries=_BUCKETS,
            tag_keys=("phase", "model", "replica"),
        )
        self._metric.set_default_tags({"model": self.model, "replica": self.replica})
        process = process_start_time()
        if process is not None and process <= self.started:
            self.marks["process_start"] = process
            self.record("process_and_imports", self.started - process, at=self.started)

    def record(self, phase: str, seconds: float, at: float | None = None) -> None:
        self.phases[phase] = seconds
        self.marks[phase] = time.time() if at is None else at
        if self._metric is not None:
            self._metric.observe(max(0.0, seconds), tags={"phase": phase})

    def record_engine(self, startup: dict[str, float]) -> None:
        """The engine's phases, then `ready` for the rest of the constructor up to now."""
        for phase, seconds in startup.items():
            self.record(phase, seconds)
        self.record("ready", max(0.0, time.time() - self.started - sum(startup.values())))
        self.marks["ready"] = time.time()

    def first_request(self) -> None:
        """The first request arrived (later ones change nothing)."""
        if "first_request" not in self.phases and "ready" in self.marks:
            self.record("first_request", time.time() - self.marks["ready"])

    def first_token(self) -> None:
        """A first token is out after the first request arrived (later ones change nothing)."""
        if "first_token" not in self.phases and "first_request" in self.marks:
            self.record("first_token", time.time() - self.marks["first_request"])
            logger.info(
                "cold start of %s: %s",
                self.replica,
                ", ".join(f"{k} {v:.2f}s" for k, v in self.phases.items()),
            )

    def report(self) -> dict[str, dict[str, float]]:
        """What bench/cold_start.py reads: each phase's seconds and end (time.time())."""
        return {"phases": dict(self.phases), "marks": dict(self.marks)}
