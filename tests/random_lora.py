"""Random PEFT LoRA adapters for a random checkpoint, written by the `peft` library itself."""

from __future__ import annotations

import torch

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write_random_lora(
    base_dir: str,
    path: str,
    *,
    seed: int,
    rank: int = 8,
    alpha: float = 16.0,
    use_rslora: bool = False,
    targets: list[str] | None = None,
    std: float = 0.1,
) -> str:
    """Draw a LoRA adapter of `rank` over base_dir's model (A and B ~ N(0, std), so it changes the
    greedy tokens) and save it with peft's save_pretrained into `path`."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        use_rslora=use_rslora,
        target_modules=targets or ALL_TARGETS,
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(base, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * std)
    model.save_pretrained(path)
    return path


def peft_model(base_dir: str, adapter_dir: str):
    """transformers' model with the adapter applied by peft, for reference outputs."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    return PeftModel.from_pretrained(base, adapter_dir).eval()
