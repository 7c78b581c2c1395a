"""LoRA settings of EngineConfig: bounded, named in every error, off unless asked for."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig


@pytest.mark.parametrize(
    "field, value",
    [
        ("max_loras", -1),
        ("max_loras", 2**64),
        ("max_loras", 257),
        ("max_lora_rank", 0),
        ("max_lora_rank", 257),
        ("max_cpu_loras", 0),
        ("lora_modules", {"bad name": "/x"}),
        ("lora_modules", {"a": ""}),
        ("lora_modules", "a=/x"),
        ("lora_root", 7),
    ],
)
def test_bad_lora_settings_are_refused_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**{field: value})


def test_lora_is_off_unless_asked_for():
    assert EngineConfig().num_lora_slots == 0
    assert EngineConfig(lora_root="/x").num_lora_slots == 4
    assert EngineConfig(lora_modules={"a": "/a"}, max_loras=2).num_cpu_loras == 4
    with pytest.raises(ValueError, match="max_loras"):
        EngineConfig(lora_modules={"a": "/a"}, max_loras=0)
    with pytest.raises(ValueError, match="max_cpu_loras"):
        EngineConfig(max_loras=4, max_cpu_loras=2)


def test_the_engine_keys_an_adapter_request_by_the_identity_it_loaded():
    """Whatever identity and hashes a sender put on a request, the engine sets the loaded
    adapter's identity and leaves the chain for the scheduler to hash under it."""
    from engine.loras import EngineLoras
    from scheduler import EngineRequest, SamplingParams, UnknownLoraError

    loras = EngineLoras(EngineConfig(max_loras=1), model_dir="unused")
    loras.slots.register("a", "a@00")
    params = SamplingParams(max_tokens=4)
    forged = EngineRequest(
        "r", [1, 2], params, block_hashes=[7, 8], lora_name="a", lora_identity="a@ff"
    )
    keyed = loras.keyed(forged)
    assert keyed.lora_identity == "a@00" and keyed.lora_key == "a@00" and keyed.block_hashes == []
    base = EngineRequest("b", [1, 2], params, block_hashes=[7])
    assert loras.keyed(base) is base
    with pytest.raises(UnknownLoraError):
        loras.keyed(EngineRequest("u", [1, 2], params, lora_name="nope"))
