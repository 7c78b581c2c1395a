"""Shared fixtures for cluster tests: tiny random Llama checkpoints (Ray and the tiny served model
come from
tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path

import pytest


def write_tiny_llama(
    directory: Path,
    *,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    hidden: int = 64,
    layers: int = 2,
    vocab: int = 250,
    seed: int = 0,
) -> Path:
    """A random-weight LlamaForCausalLM saved as an HF directory (config.json + safetensors)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # larger weights than the default init: logits far apart, greedy stable
        for p in model.parameters():
            p.normal_(0.0, 0.15)
    model.save_pretrained(directory, safe_serialization=True)
    return directory


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    """4 attention heads, 2 KV heads: TP=2 splits KV heads, TP=4 replicates them."""
    return str(write_tiny_llama(tmp_path_factory.mktemp("tiny-llama")))
