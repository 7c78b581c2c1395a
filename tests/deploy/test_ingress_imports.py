"""The ingress imports only what the ingress runs: building the app (deploy.app) and an ingress
replica (deploy.ingress) load no model family, no transformers modeling code and no project module
that imports torch, and a prefill replica's reply (a PrefillReply carrying a TransferHandle)
unpickles there without the engine. Each of those cost seconds of every ingress replica's cold
start (bench/results/2026-11-29-import-cost.md). torch itself still loads: transformers' config
classes import it, and the ingress reads the model's config."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys

import pytest

from engine.disagg_reply import PrefillReply
from scheduler.outputs import RequestOutput
from workers.kv_handle import TransferHandle

# Runs in a fresh interpreter: records which module asked for each torch module, imports the
# app's builder, unpickles the reply given as hex on argv, and prints what it saw.
PROBE = """
import builtins, json, pickle, sys
asked = set()
real_import = builtins.__import__
def recording_import(name, globals=None, *args, **kwargs):
    if name.split(".")[0] == "torch":
        asked.add((globals or {}).get("__name__", "?"))
    return real_import(name, globals, *args, **kwargs)
builtins.__import__ = recording_import
import deploy.app
reply = pickle.loads(bytes.fromhex(sys.argv[1]))
print(json.dumps({
    "torch_importers": sorted(asked),
    "modules": sorted(sys.modules),
    "reply": [reply.token_ids, reply.handle.key, reply.handle.hashes],
}))
"""
PROJECT = ("settings", "scheduler", "router", "frontend", "engine", "workers", "cluster", "deploy")


@pytest.fixture(scope="module")
def ingress_process() -> dict:
    output = RequestOutput("r1", [7], finished=True, finish_reason="length", num_prompt_tokens=3)
    reply = PrefillReply([7], output, continues=True, handle=TransferHandle("k1", [11, 12]))
    out = subprocess.run(
        [sys.executable, "-c", PROBE, pickle.dumps(reply).hex()],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    return json.loads(out.stdout.splitlines()[-1])


def test_the_ingress_loads_no_project_module_that_imports_torch(ingress_process):
    importers = ingress_process["torch_importers"]
    assert [m for m in importers if m.split(".")[0] in PROJECT] == []
    assert any(m.startswith("transformers") for m in importers)  # the probe sees imports at all


def test_the_ingress_loads_no_engine_model_family_or_modeling_code(ingress_process):
    modules = set(ingress_process["modules"])
    assert {"deploy.app", "deploy.ingress", "engine.disagg_reply"} <= modules
    for heavy in ("engine.core", "workers.runner", "workers.kv_transfer", "cluster.replica"):
        assert heavy not in modules
    assert [m for m in modules if m.startswith("workers.models.")] == []
    assert "transformers.modeling_utils" not in modules


def test_a_prefill_reply_unpickles_in_the_ingress_without_the_engine(ingress_process):
    assert ingress_process["reply"] == [[7], "k1", [11, 12]]
