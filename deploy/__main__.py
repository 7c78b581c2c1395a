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
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError
from ray.serve.schema import ServeDeploySchema

from deploy.app import check_exposure, pinned_fleet
from deploy.check import (
    add_resources,
    app_demand,
    cluster_or_machine,
    placement_problems,
    resources_text,
)
from deploy.fleet_config import FleetConfig
from scheduler.settings import clipped
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
    nodes, where = cluster_or_machine()
    problems, report = [], []
    for app in schema.applications:
        if app.import_path not in BUILDERS:
            report.append(f"app {app.name!r}: {app.import_path} is not raylm's; left to Serve")
            continue
        try:
            fleet = check_app(app.args or {}, schema.http_options.host)
        except ValueError as exc:
            problems.append(f"app {app.name!r}: {exc}")
            continue
        found = placement_problems(fleet, nodes, where)
        problems.extend(f"app {app.name!r}: {p}" for p in found)
        if not found:
            report.append(
                f"app {app.name!r}: ok; it needs {_needs(fleet)}, {where} has "
                f"{resources_text(add_resources(nodes))}"
            )
    return problems, report


def check_app(args: dict[str, Any], host: str | None) -> FleetConfig:
    """The app's settings, its models and its keys, as build_app checks them (ValueError)."""
    fleet = pinned_fleet(FleetConfig.from_args(args))
    for model in fleet.models:
        check_model(model.engine.model)
    check_exposure(host, fleet)
    return fleet


def check_model(model: str) -> None:
    """A local model exists and is one raylm reads (a hub model was fetched by pinning): without
    converting a GGUF file or loading any weight."""
    if model == "default":
        default_model_path()
        return
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return
    resolve_model(model)  # a directory with its config, or a ValueError saying what is wrong


def _needs(fleet: FleetConfig) -> str:
    return resources_text(app_demand(fleet).total)


if __name__ == "__main__":
    sys.exit(main())
