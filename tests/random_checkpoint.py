"""Random-weight checkpoints of real model shapes, written on the machine that runs them.

The GPU machine has no hub access and no room for real weights, so the CUDA tests and
bench/gpu_bench.py write config.json + safetensors + a word-level tokenizer that covers the whole
vocabulary (every id decodes) into a directory, then load it through the normal code paths.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

# Published shapes (random weights): Llama 3.2 1B (GQA 32/8), Qwen3 0.6B (q/k norm, head_dim 128),
# SmolLM2-135M.
SHAPES: dict[str, tuple[str, dict]] = {
    "llama3-1b": (
        "LlamaConfig",
        dict(
            vocab_size=128256,
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=64,
            max_position_embeddings=131072,
            rms_norm_eps=1e-5,
            tie_word_embeddings=True,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 32.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        ),
    ),
    "qwen3-0.6b": (
        "Qwen3Config",
        dict(
            vocab_size=151936,
            hidden_size=1024,
            intermediate_size=3072,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            max_position_embeddings=40960,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        ),
    ),
    # SmolLM2-135M (the embedded default model): what `sim calibrate --random-shape` times on a GPU.
    "smollm2-135m": (
        "LlamaConfig",
        dict(
            vocab_size=49152,
            hidden_size=576,
            intermediate_size=1536,
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
            head_dim=64,
            max_position_embeddings=8192,
            rms_norm_eps=1e-5,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
        ),
    ),
}
EOS_ID = 2


@dataclass(frozen=True, slots=True)
class RandomCheckpoint:
    """Where a random checkpoint lives and what it is."""

    path: str
    shape: str
    vocab_size: int


def write_random_checkpoint(
    shape: str, path: str, seed: int = 0, logit_scale: float = 4.0
) -> RandomCheckpoint:
    """Write the `shape` model with random weights (bf16 on disk) and a tokenizer into `path`.

    Default initialisation gives nearly flat logits; the LM head is rescaled so that logits have
    a standard deviation of about `logit_scale`, as in a trained model, and greedy choices are
    decided by clear margins rather than rounding.
    """
    import transformers
    from transformers import AutoModelForCausalLM

    config_cls, fields = SHAPES[shape]
    config = getattr(transformers, config_cls)(bos_token_id=1, eos_token_id=EOS_ID, **fields)
    torch.manual_seed(seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        head = model.get_output_embeddings().weight
        head.normal_(0.0, logit_scale / config.hidden_size**0.5)
    model.save_pretrained(path)
    write_word_tokenizer(path, config.vocab_size)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return RandomCheckpoint(path, shape, config.vocab_size)


def write_word_tokenizer(path: str, vocab_size: int) -> None:
    """A whitespace word-level tokenizer whose vocabulary is exactly the model's ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": EOS_ID}
    vocab.update({f"w{i}": i for i in range(3, vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.save_pretrained(path)
    os.makedirs(path, exist_ok=True)


def random_prompts(
    num: int, vocab_size: int, min_len: int, max_len: int, seed: int = 0
) -> list[list[int]]:
    """`num` prompts of random token ids (specials excluded), lengths uniform in [min_len,
    max_len]."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (num,), generator=gen).tolist()
    return [torch.randint(3, vocab_size, (n,), generator=gen).tolist() for n in lengths]
