"""Engine, executors and the offline LLM API; Ray Serve replica and router.

`from cluster import LLM` works as usual; the heavy modules (torch, transformers) load on first
use, so processes that only need cluster.serve_router or cluster.protocol stay light.
"""
from __future__ import annotations

import importlib
from typing import Any

_LAZY = {"LLM": "cluster.llm", "GenerationOutput": "cluster.llm", "EngineConfig": "cluster.config",
         "EngineCore": "cluster.engine"}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'cluster' has no attribute {name!r}")
