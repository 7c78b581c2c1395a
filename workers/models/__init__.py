"""Model classes by the `architectures` name in a Hugging Face config."""

from __future__ import annotations

from transformers import PretrainedConfig

from workers.models.deepseek import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
from workers.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from workers.models.gemma3_vl import Gemma3ForConditionalGeneration
from workers.models.glm4_moe import Glm4MoeForCausalLM
from workers.models.gpt_oss import GptOssForCausalLM
from workers.models.granite_hybrid import GraniteMoeHybridForCausalLM
from workers.models.llama import (
    LlamaForCausalLM,
    MistralForCausalLM,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
)
from workers.models.llava import LlavaForConditionalGeneration
from workers.models.moe import MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM
from workers.models.phi3 import Phi3ForCausalLM
from workers.models.qwen2_vl import Qwen2_5_VLForConditionalGeneration
from workers.models.qwen3_next import Qwen3NextForCausalLM

MODELS: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Gemma3ForConditionalGeneration": Gemma3ForConditionalGeneration,
    "GptOssForCausalLM": GptOssForCausalLM,
    "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
    "Glm4MoeForCausalLM": Glm4MoeForCausalLM,
    "LlavaForConditionalGeneration": LlavaForConditionalGeneration,
    "Qwen3NextForCausalLM": Qwen3NextForCausalLM,
    "GraniteMoeHybridForCausalLM": GraniteMoeHybridForCausalLM,
    "Qwen2_5_VLForConditionalGeneration": Qwen2_5_VLForConditionalGeneration,
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
            return MODELS[arch]
    raise ValueError(
        f"architectures: {archs or config.model_type!r} is not supported "
        f"(supported: {sorted(MODELS)})"
    )
