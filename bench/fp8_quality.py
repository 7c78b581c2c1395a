"""FP8 on the fly against bf16 on a random Llama shape: mean KL per token and top-1 agreement.

Hugging Face's Llama in bf16 is the reference; the FP8 model is the same model with every
decoder linear (not the LM head) replaced by raylm's FP8Weight (per-channel or per-tensor weight
scales, dynamic per-token activation scales: the numerics `quantization: fp8` serves). Both read
the same 32 random prompts, teacher-forced; every position's next-token distribution counts. For
scale, the same figures for bf16 itself against the model computed in float32.

    python bench/fp8_quality.py      # the reduced 1B-like shape below, CPU, about 2 minutes
    python bench/fp8_quality.py --device cuda --shape llama3-1b
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.random_checkpoint import SHAPES, random_prompts
from workers.layers.fp8 import FP8Weight, quantize_weight

# Llama 3.2 1B's proportions (GQA 4:1, MLP 4x, head_dim 64) at a quarter of the width and depth.
REDUCED = dict(
    vocab_size=16384,
    hidden_size=512,
    intermediate_size=2048,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=2048,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)


class FP8Linear(nn.Module):
    def __init__(self, linear: nn.Linear, per_tensor: bool) -> None:
        super().__init__()
        self.w: FP8Weight = quantize_weight(linear.weight.data.float(), per_tensor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w.matmul(x)


def build(shape: str, device: str):
    from transformers import AutoModelForCausalLM, LlamaConfig

    fields = REDUCED if shape == "reduced" else SHAPES[shape].fields
    config = LlamaConfig(**fields)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        # Every linear ~ N(0, 1 / fan_in), so each block moves the residual stream as much as a
        # trained one does (transformers' std 0.02 leaves the embedding to decide every logit);
        # an untied head with logits of standard deviation about 4, as in a trained model.
        for m in model.model.layers.modules():
            if isinstance(m, nn.Linear):
                m.weight.normal_(0.0, m.in_features**-0.5)
        model.model.embed_tokens.weight.normal_(0.0, 1.0)
        model.get_output_embeddings().weight.normal_(0.0, 4.0 / config.hidden_size**0.5)
    return model


def quantize(model, per_tensor: bool) -> int:
    count = 0
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear):
                    setattr(parent, name, FP8Linear(child, per_tensor))
                    count += 1
    return count


@torch.inference_mode()
def logprobs(model, prompts: list[list[int]], device: str) -> list[torch.Tensor]:
    return [
        model(torch.tensor([p], device=device)).logits[0].float().log_softmax(-1) for p in prompts
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="reduced", choices=["reduced", *SHAPES])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--length", type=int, default=32)
    args = parser.parse_args()
    model = build(args.shape, args.device)
    vocab = model.config.vocab_size
    prompts = random_prompts(args.prompts, vocab, args.length, args.length, seed=1)
    ref = logprobs(model, prompts, args.device)
    print(f"shape {args.shape}, {args.prompts} prompts x {args.length} tokens, {args.device}")
    report("bf16 vs float32", logprobs(model.float(), prompts, args.device), ref)
    for per_tensor in (False, True):
        fp8 = build(args.shape, args.device)
        n = quantize(fp8, per_tensor)
        scales = "per-tensor" if per_tensor else "per-channel"
        report(f"FP8 {scales} ({n} linears) vs bf16", ref, logprobs(fp8, prompts, args.device))


def report(what: str, ref: list[torch.Tensor], got: list[torch.Tensor]) -> None:
    """Mean KL(ref || got) per token and top-1 agreement."""
    kl = torch.cat([(r.exp() * (r - g)).sum(-1) for r, g in zip(ref, got, strict=True)])
    top1 = torch.cat([r.argmax(-1) == g.argmax(-1) for r, g in zip(ref, got, strict=True)])
    print(
        f"{what}: mean KL {kl.mean().item():.5f} nats/token (p99 {kl.quantile(0.99).item():.5f}), "
        f"top-1 agreement {top1.float().mean():.4f} over {top1.numel()} tokens"
    )


if __name__ == "__main__":
    main()
