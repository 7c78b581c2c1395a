"""`python -m deploy check deploy.yaml`: validate a Serve config file of raylm apps before anything
starts, printing one line per problem and exiting 1, or one line per app and exiting 0.

Checked: the file against Serve's own schema; each raylm app's every setting (all sections, as
build_app would); its model (a local path, or a hub id pinned to its commit, the tokenizer side
fetched); keys against the HTTP host; and placement (each replica's placement group, and the app in
all with its ingress) against the Ray cluster this shell reaches, or this machine's CPUs and GPUs
when none is running. Environment variables (api_keys_env, HF_TOKEN) are read from this shell: on
a cluster the app is built where `ray start` ran (docs/operations.md#api-keys).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError
from ray.serve.schema import ServeApplicationSchema, ServeDeploySchema

from deploy.app import check_exposure
from deploy.check import (
    Target,
    add_resources,
    app_demand,
    cluster_or_machine,
    nodes_lacking,
    placement_problems,
    resources_text,
)
from deploy.config import AppConfig
from deploy.fleet_config import FleetConfig
from deploy.hub import pinned
from settings import clipped
from workers.model_files import default_model_path, resolve_model

BUILDERS = ("deploy.app:build_app", "deploy.app.build_app")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deploy", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    check = commands.add_parser("check", help="validate a Serve config file of raylm apps")
    check.add_argument("config", help="the Serve config file (deploy.yaml)")
    args = parser.parse_args(argv)
    problems, report = check_file(Path(args.config))
    for line in problems:
        print(f"{args.config}: {line}", file=sys.stderr)
    for line in report:
        print(f"{args.config}: {line}")
    return 1 if problems else 0


def check_file(path: Path) -> tuple[list[str], list[str]]:
    """(problems, what each good app reserves) of a Serve config file."""
    try:
        schema = ServeDeploySchema.model_validate(yaml.safe_load(path.read_text()))
    except (OSError, yaml.YAMLError) as exc:
        return [f"cannot read it: {clipped(str(exc))}"], []
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        return [f"not a Serve config: {where}: {first['msg']}"], []
    problems: list[str] = []
    report: list[str] = []
    with cluster_or_machine() as target:
        for app in schema.applications:
            found, ok = check_application(app, schema.http_options.host, target)
            problems.extend(f"app {app.name!r}: {p}" for p in found)
            report.extend(f"app {app.name!r}: {line}" for line in ok)
    return problems, report


def check_application(
    app: ServeApplicationSchema, host: str | None, target: Target
) -> tuple[list[str], list[str]]:
    """(problems, report lines) of one application of the file."""
    if app.import_path not in BUILDERS:
        return [], [f"{app.import_path} is not raylm's; left to Serve"]
    found, fleet = check_app(app.args or {}, host)
    if fleet is None:
        return found, []
    found += placement_problems(fleet, target.nodes, target.where)
    if target.connected:
        found += cluster_env_problems(fleet, app.runtime_env or {})
    return found, [] if found else [f"ok; {_fit(fleet, target)}"]


def cluster_env_problems(fleet: FleetConfig, runtime_env: dict[str, Any]) -> list[str]:
    """api_keys_env variables that this shell has but some node of the cluster lacks: Serve
    builds the app in a Ray task on any node, with that node's `ray start` environment (and the
    app's runtime_env), never this shell's."""
    given = set((runtime_env.get("env_vars") or {}).keys())
    names = sorted({m.api_keys_env for m in fleet.models if m.api_keys_env} - given)
    if not names:
        return []
    lacking = nodes_lacking(names)
    problems = []
    for name in names:
        nodes = sorted(address for address, unset in lacking.items() if name in unset)
        if nodes:
            problems.append(
                f"api_keys_env: {name} is not set on node(s) {', '.join(nodes)} of the Ray "
                "cluster, where Serve may build the app (its tasks have the environment of `ray "
                "start` there, not this shell's; docs/operations.md#where-api_keys_env-is-read)"
            )
    return problems


def check_app(args: dict[str, Any], host: str | None) -> tuple[list[str], FleetConfig | None]:
    """Problems of the app's settings (then nothing else is checked), its keys and its models, as
    build_app finds them; the app's config where its settings are valid."""
    try:
        fleet = FleetConfig.from_args(args)
    except ValueError as exc:
        return [str(exc)], None
    problems = _problems(lambda: check_exposure(host, fleet))
    for model in fleet.models:
        problems += _problems(lambda: check_model(model))  # noqa: B023 (called at once)
    return problems, fleet


def _problems(check: Callable[[], None]) -> list[str]:
    try:
        check()
    except ValueError as exc:
        return [str(exc)]
    return []


def _fit(fleet: FleetConfig, target: Target) -> str:
    need = app_demand(fleet).total
    have = add_resources(target.nodes)
    return (
        f"it needs {resources_text(need)}, {target.where} has "
        f"{resources_text({k: have.get(k, 0.0) for k in need})}"
    )


def check_model(config: AppConfig) -> None:
    """The model exists and is one raylm reads, without converting a GGUF file or loading any
    weight: a hub model is pinned (its tokenizer side fetched), as build_app does."""
    model = pinned(config).engine.model
    if model == "default":
        default_model_path()
        return
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return
    resolve_model(model)  # a directory with its config, or a ValueError saying what is wrong


if __name__ == "__main__":
    sys.exit(main())
