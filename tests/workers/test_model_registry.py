"""The family registry (workers/models/__init__.py): every architecture it names resolves to the
class of that name, and a family's module is imported only when a checkpoint names it, so a
replica pays for the one family it serves."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from transformers import PretrainedConfig

from workers.models import MODELS, model_class
from workers.models.llama import LlamaForCausalLM


def loaded_after(code: str) -> list[str]:
    """The workers.models.* modules a fresh interpreter holds after running code."""
    probe = f"{code}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=120
    )
    return [m for m in json.loads(out.stdout.splitlines()[-1]) if m.startswith("workers.models.")]


@pytest.mark.parametrize("arch", sorted(MODELS))
def test_each_architecture_resolves_to_its_class(arch):
    cls = model_class(PretrainedConfig(architectures=[arch]))
    assert cls.__name__ == arch
    assert cls.__module__ == f"workers.models.{MODELS[arch]}"
    assert issubclass(cls, LlamaForCausalLM)


def test_a_model_type_without_architectures_resolves_too():
    config = PretrainedConfig()
    config.model_type = "qwen3_moe"
    assert model_class(config).__name__ == "Qwen3MoeForCausalLM"


def test_an_unknown_architecture_is_refused_naming_the_supported_ones():
    unknown = PretrainedConfig(architectures=["NoSuchForCausalLM"])
    refusal = r"architectures: \['NoSuchForCausalLM'\] is not supported.*LlamaForCausalLM"
    with pytest.raises(ValueError, match=refusal):
        model_class(unknown)


def test_a_family_module_is_imported_only_when_a_checkpoint_names_it():
    assert loaded_after("import workers.models") == []
    named = "from transformers import PretrainedConfig\nfrom workers.models import model_class\n"
    phi3 = loaded_after(named + "model_class(PretrainedConfig(architectures=['Phi3ForCausalLM']))")
    # Phi-3 builds on the Llama family's module; no other family is loaded.
    assert set(phi3) == {"workers.models.llama", "workers.models.phi3"}
