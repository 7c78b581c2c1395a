"""Greedy output equals Hugging Face transformers' greedy generate on the same weights.

SmolLM2 is the embedded GGUF file as transformers de-quantises it (both sides read the same
conversion; raylm's kept-block path is held to this fp32 path in test_quantized.py);
the tiny checkpoints are written by Hugging Face and read back through our HF-directory loader.
A token may differ only at a true near-tie (see tests/workers/greedy.py).
"""

from __future__ import annotations

import pytest
import torch

from scheduler import SamplingParams
from tests.workers.greedy import assert_greedy_match, hf_greedy

pytestmark = pytest.mark.slow

MAX_TOKENS = 32
CHATS = [
    "What is the capital of France?",
    "Write a haiku about the ocean.",
    "Explain recursion to a five-year-old.",
    "List three prime numbers greater than 50.",
]
TEXTS = [
    "def fibonacci(n):\n    ",
    "The quick brown fox",
    "1, 2, 3, 5, 8, 13,",
    "Once upon a time in a small village by the sea, there lived an old fisherman who",
]


def chat_ids(tokenizer, content: str) -> list[int]:
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
    )
    return tokenizer.encode(text, add_special_tokens=False)


def test_smollm2_greedy_matches_hf_generate(smollm2_llm, hf_smollm2, smollm2_tokenizer):
    """Two chat-templated and two raw prompts, short and long, batched on our side; each of
    Hugging Face's 32-token generations runs alone (~1 s a prompt on CPU), so no more than that."""
    prompts = [chat_ids(smollm2_tokenizer, c) for c in CHATS[1::2]] + [
        smollm2_tokenizer.encode(t) for t in TEXTS[::3]
    ]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    outs = smollm2_llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        ref = hf_greedy(hf_smollm2, prompt, MAX_TOKENS)
        assert_greedy_match(out.token_ids, ref, smollm2_tokenizer.decode(prompt)[-40:])


def test_smollm2_weights_equal_transformers_dequantisation(smollm2_llm, hf_smollm2):
    ours = smollm2_llm.engine.executor.runner.model
    theirs = hf_smollm2.state_dict()
    layer = ours.model.layers[3]

    def held(linear: torch.nn.Module, width: int) -> torch.Tensor:
        """The weight a CPU linear multiplies by (its packed copy, the only one kept), read back
        exactly: identity rows times W^T."""
        with torch.no_grad():
            return linear(torch.eye(width)).t()

    q, k, v = held(layer.self_attn.qkv_proj, 576).split([576, 192, 192])
    assert torch.equal(q, theirs["model.layers.3.self_attn.q_proj.weight"])
    assert torch.equal(k, theirs["model.layers.3.self_attn.k_proj.weight"])
    assert torch.equal(v, theirs["model.layers.3.self_attn.v_proj.weight"])
    gate, up = held(layer.mlp.gate_up_proj, 576).chunk(2)
    assert torch.equal(gate, theirs["model.layers.3.mlp.gate_proj.weight"])
    assert torch.equal(up, theirs["model.layers.3.mlp.up_proj.weight"])
    assert torch.equal(ours.model.embed_tokens.weight, theirs["model.embed_tokens.weight"])
    assert ours.lm_head.weight is ours.model.embed_tokens.weight  # tied


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
def test_tiny_checkpoint_greedy_matches_hf_generate(
    family, tiny_checkpoint, llm_factory, smollm2_tokenizer
):
    path, hf_model = tiny_checkpoint(family)
    llm = llm_factory(model=path, dtype="float32")
    prompts = [smollm2_tokenizer.encode(t) for t in TEXTS[:3]] + [
        chat_ids(smollm2_tokenizer, CHATS[0])
    ]
    outs = llm.generate(
        prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True), use_tqdm=False
    )
    for prompt, out in zip(prompts, outs):
        assert_greedy_match(
            out.token_ids, hf_greedy(hf_model, prompt, 24), f"{family}: {prompt[:5]}"
        )


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_tiny_checkpoint_logits_close_to_hf(family, tiny_checkpoint, llm_factory):
    """The first token's full logprob row (returned as top-20) agrees with Hugging Face's."""
    path, hf_model = tiny_checkpoint(family)
    llm = llm_factory(model=path, dtype="float32")
    prompt = list(range(300, 340))
    out = llm.generate(
        [prompt], SamplingParams(max_tokens=1, temperature=0.0, logprobs=20), use_tqdm=False
    )[0]
    with torch.inference_mode():
        ref = hf_model(torch.tensor([prompt])).logits[0, -1].log_softmax(-1)
    for token, logprob in out.logprobs[0][1:]:
        assert logprob == pytest.approx(ref[token].item(), abs=1e-4)
