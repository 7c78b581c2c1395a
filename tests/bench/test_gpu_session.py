"""bench/gpu_session.sh, the one command a GPU session runs: proven here end to end on its cheapest
step (the decode step at the floor, async scheduling off and on) in its CPU smoke mode, where
the packages the GPU machine lacks cannot be imported."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_cpu_smoke_of_the_step_at_the_floor_writes_its_log_and_summary(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable}
    done = subprocess.run(
        ["bash", "bench/gpu_session.sh", "--cpu-smoke", "--only", "1a"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["cpu_smoke"] is True
    commands = {c["id"]: c for c in summary["commands"]}
    assert sorted(commands) == ["1a"], commands  # --only: nothing else ran
    assert commands["1a"]["status"] == "0", (tmp_path / "1-step-floor.log").read_text()
    result = summary["results"]["step_floor"]
    modes = sorted((r["format"], r["async_scheduling"], r["batch"]) for r in result["rows"])
    assert modes == [("bf16", False, 1), ("bf16", True, 1)]
    assert all(r["replay_ms"] is None and r["step_ms"] > 0 for r in result["rows"])  # no graphs
    assert result["tokens_identical_across_async"] == {"bf16": True}
    assert "== summary" in done.stdout
    assert "step_floor: greedy tokens identical async off/on: {'bf16': True}" in done.stdout
    assert (tmp_path / "console.log").read_text().count("== 1a") == 1
