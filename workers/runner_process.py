"""How a runner sets up the process it runs in: priority, CPU threads, the allocator, the seed."""

from __future__ import annotations

import ctypes

import torch

from workers.process import set_niceness
from workers.runner_config import RunnerConfig


def tune_process(config: RunnerConfig, device: torch.device) -> None:
    if config.process_niceness is not None:
        set_niceness(config.process_niceness)
    if device.type == "cpu":
        _keep_freed_memory()
        if config.cpu_threads:
            torch.set_num_threads(config.cpu_threads)
    torch.manual_seed(config.seed)


def _keep_freed_memory() -> None:
    """glibc returns large freed blocks to the OS and page-faults them back on the next step;
    activations of a CPU forward are exactly such blocks, so keep them in the heap instead."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: nothing to tune
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    libc.mallopt(m_mmap_threshold, 32 << 20)  # glibc's maximum on 64-bit
    libc.mallopt(m_trim_threshold, 1 << 30)
