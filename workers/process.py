"""Process-wide scheduling priority of an engine or ingress process (no torch: the ingress uses it
too)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)

# Linux's range of nice values; lower runs first.
MIN_NICE, MAX_NICE = -20, 19


def renice_threads(pid: int | None, nice: int, proc: Path = Path("/proc")) -> int:
    """Every thread of process `pid` (None: this one) at `nice`; the number of threads.

    Linux keeps a nice value per thread and a new thread inherits its creator's, so every existing
    thread is set. Raises PermissionError where lowering it needs CAP_SYS_NICE, another OSError
    when the process is gone (or there is no procfs).
    """
    thread_ids = [
        int(tid) for tid in os.listdir(proc / ("self" if pid is None else str(pid)) / "task")
    ]
    for tid in thread_ids:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
        except ProcessLookupError:  # the thread ended meanwhile
            continue
    return len(thread_ids)


def set_niceness(nice: int) -> None:
    """Run every thread of this process at `nice`, and so the threads they start later.

    Ray starts worker processes at nice 15, so an engine there yields the CPU to every process of
    the node at the default 0: the HTTP client, the raylet, other jobs. Lowering the value needs
    CAP_SYS_NICE; without it the process keeps its priority and a warning says so.
    """
    if not MIN_NICE <= nice <= MAX_NICE:
        raise ValueError(f"process_niceness: must be in [{MIN_NICE}, {MAX_NICE}], got {nice!r}")
    try:
        count = _renice_self(nice)
    except PermissionError:
        logger.warning(
            "process_niceness: cannot set nice %d (needs CAP_SYS_NICE); the process stays at %d",
            nice,
            os.getpriority(os.PRIO_PROCESS, 0),
        )
        return
    logger.info("process niceness set to %d (%d threads)", nice, count)


def _renice_self(nice: int) -> int:
    try:
        return renice_threads(None, nice)
    except PermissionError:
        raise
    except OSError:  # no procfs: the whole process is one priority there
        os.setpriority(os.PRIO_PROCESS, 0, nice)
        return 1
