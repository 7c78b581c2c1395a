"""Every numeric setting of the library is bounded on both sides: a value no deployment reaches is
refused by name when the config is built, never accepted to fail later (a step timeout past ~9.2e9 s
overflows the socket's at the first step; a KV pool of 1e300 GiB sizes a block count nothing can
hold).

The configs are found by reading the library's source, so a setting added tomorrow, in any module,
is held to this too."""

from __future__ import annotations

import importlib
import math
import re
from dataclasses import MISSING, Field, fields, is_dataclass
from pathlib import Path
from typing import Any, get_type_hints

import pytest

from deploy.config import AppConfig
from settings import build, declared_settings, numeric_settings

ROOT = Path(__file__).resolve().parents[2]
LIBRARY = ("settings", "scheduler", "router", "frontend", "engine", "workers", "cluster", "deploy")
LIBRARY += ("sim",)
DECLARES = re.compile(r"=\s*setting\(")


def _modules() -> list[str]:
    """The library modules whose source declares a setting (read, not imported: importing every
    module would load every kernel)."""
    paths = [p for package in LIBRARY for p in sorted((ROOT / package).rglob("*.py"))]
    return [
        ".".join(p.relative_to(ROOT).with_suffix("").parts)
        for p in paths
        if DECLARES.search(p.read_text())
    ]


def _configs() -> list[type]:
    found = []
    for name in _modules():
        module = importlib.import_module(name)
        for value in vars(module).values():
            if isinstance(value, type) and is_dataclass(value) and value.__module__ == name:
                found += [value] if declared_settings(value) else []
    return found


CONFIGS = _configs()
CASES = [(cls, f) for cls in CONFIGS for f in numeric_settings(cls)]


# Good values beside the ones a config requires: what its own checks across fields need.
BESIDE: dict[str, dict[str, Any]] = {"TracingConfig": {"otlp_endpoint": "http://127.0.0.1:4318"}}


def _required(cls: type) -> dict[str, Any]:
    """A good value for each required setting (a section: its defaults), and BESIDE's."""
    hints = get_type_hints(cls)
    sample = {int: 1, float: 1.0, str: "t"}
    out = {
        f.name: {} if is_dataclass(hints[f.name]) else sample[hints[f.name]]
        for f in fields(cls)
        if f.init and f.default is MISSING and f.default_factory is MISSING
    }
    return {**out, **BESIDE.get(cls.__name__, {})}


def _refused(cls: type, name: str, value: Any) -> str:
    with pytest.raises(ValueError) as raised:
        build(cls, {**_required(cls), name: value})
    return str(raised.value)


def test_the_walk_finds_the_whole_tree():
    names = {cls.__name__ for cls in CONFIGS}
    assert {"AppConfig", "EngineConfig", "SchedulerConfig", "RoutingConfig"} <= names
    assert {"AutoscalingArgs", "SimConfig", "WorkloadConfig", "TracingConfig"} <= names
    assert len(CASES) > 150


@pytest.mark.parametrize("cls, f", CASES, ids=[f"{cls.__name__}.{f.name}" for cls, f in CASES])
def test_a_numeric_setting_is_bounded_and_refuses_nonsense_by_name(cls: type, f: Field):
    meta = f.metadata
    assert meta["le"] is not None or meta["lt"] is not None or meta["choices"], "no upper bound"
    assert meta["ge"] is not None or meta["gt"] is not None or meta["choices"], "no lower bound"
    build(cls, _required(cls))  # the values beside the one refused are good
    assert re.match(
        rf"{f.name}: must (fit in 64 bits|be <|be one of)", _refused(cls, f.name, 2**64)
    )
    assert _refused(cls, f.name, math.nan).startswith(f"{f.name}: must be ")
    low = meta["ge"] if meta["ge"] is not None else meta["gt"]
    if low is not None and (low > -1 or (meta["gt"] is not None and low == -1)):
        assert _refused(cls, f.name, -1).startswith(f"{f.name}: must be ")


@pytest.mark.parametrize(
    "args, message",
    [
        ({"step_timeout_s": 2**64}, r"engine\.step_timeout_s: must be <= 604800"),
        ({"engine_stall_timeout_s": 1e300}, r"engine\.engine_stall_timeout_s: must be <= 604800"),
        ({"kv_cache_memory_gb": 1e300}, r"engine\.kv_cache_memory_gb: must be <= 65536"),
        ({"swap_space_gb": 2**64}, r"engine\.swap_space_gb: must be <= 65536"),
        ({"max_num_seqs": 2**62}, r"engine\.scheduler\.max_num_seqs: must be <= 65536"),
        (
            {"router_kwargs": {"unconfirmed_ttl_s": 1e300}},
            r"router_kwargs\.unconfirmed_ttl_s: must be <= 86400",
        ),
        (
            {"autoscaling": {"max_replicas": 2, "target_ongoing_requests": 2**64}},
            r"autoscaling\.target_ongoing_requests: must be <= 1048576",
        ),
    ],
)
def test_deploy_yaml_args_past_a_bound_are_refused_by_path(args: dict[str, Any], message: str):
    with pytest.raises(ValueError, match=rf"^invalid raylm app args: {message}, got "):
        AppConfig.from_args(args)
