"""Model classes by the `architectures` name in a Hugging Face config.

A family's module is imported when a checkpoint names it, never before: each pulls in its layers
and some of them transformers' modeling code (seconds of a replica's cold start), and a replica
serves one family."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from workers.models.llama import LlamaForCausalLM

# architecture -> the module of workers/models/ that defines the class of that name.
MODELS: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "llama",
    "Qwen3ForCausalLM": "llama",
    "Phi3ForCausalLM": "phi3",
    "MixtralForCausalLM": "moe",
    "Qwen2MoeForCausalLM": "moe",
    "Qwen3MoeForCausalLM": "moe",
    "Gemma2ForCausalLM": "gemma",
    "Gemma3ForCausalLM": "gemma",
    "Gemma3ForConditionalGeneration": "gemma3_vl",
    "GptOssForCausalLM": "gpt_oss",
    "DeepseekV2ForCausalLM": "deepseek",
    "DeepseekV3ForCausalLM": "deepseek",
    "Glm4MoeForCausalLM": "glm4_moe",
    "LlavaForConditionalGeneration": "llava",
    "Qwen3NextForCausalLM": "qwen3_next",
    "GraniteMoeHybridForCausalLM": "granite_hybrid",
    "Qwen2_5_VLForConditionalGeneration": "qwen2_vl",
}

# Configs converted from GGUF carry a model_type but sometimes no architectures list.
_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gemma3": "Gemma3ForConditionalGeneration",
    "gpt_oss": "GptOssForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "kimi_k2": "DeepseekV3ForCausalLM",  # Kimi-K2: DeepSeek-V3's architecture
    "glm4_moe": "Glm4MoeForCausalLM",
    "llava": "LlavaForConditionalGeneration",
    "qwen3_next": "Qwen3NextForCausalLM",
    "granitemoehybrid": "GraniteMoeHybridForCausalLM",
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
}


def model_class(config: PretrainedConfig) -> type[LlamaForCausalLM]:
    """The model class for a config, or a ValueError listing what is supported."""
    archs = list(getattr(config, "architectures", None) or [])
    if not archs and getattr(config, "model_type", None) in _BY_MODEL_TYPE:
        archs = [_BY_MODEL_TYPE[config.model_type]]
    for arch in archs:
        if arch in MODELS:
            module = importlib.import_module(f"{__name__}.{MODELS[arch]}")
            return getattr(module, arch)
    raise ValueError(
        f"architectures: {archs or config.model_type!r} is not supported "
        f"(supported: {sorted(MODELS)})"
    )
