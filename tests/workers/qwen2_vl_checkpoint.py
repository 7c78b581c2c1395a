"""A tiny random Qwen2.5-VL checkpoint with its real processor, written for the tests.

Two language-model layers (Qwen2: qkv bias, head_dim 16, M-RoPE sections 2/3/3 of its 8 rotary
pairs), a two-block vision tower 32 wide whose block 1 attends over the whole image and block 0
within 56-pixel windows (2x2 merged groups: an image larger than 56x56 has several windows), and
the real Qwen2VLImageProcessor (14-pixel patches, 2 frames, 2x2 merge): a 56x56 image is 4 tokens,
an 84x112 one 12. The tokenizer is word-level over the vocabulary (`w3` ... `w319`) with Qwen's
vision tokens at 300-303 and ChatML-like turns whose image parts render as
`<|vision_start|><|image_pad|><|vision_end|>`.
"""

from __future__ import annotations

from typing import Any

import torch

from tests.random_checkpoint import BOS_ID, EOS_ID

VOCAB = 320
IMAGE_TOKEN, VIDEO_TOKEN, VISION_START, VISION_END = 300, 301, 302, 303
_SPECIAL = {
    "<|image_pad|>": IMAGE_TOKEN,
    "<|video_pad|>": VIDEO_TOKEN,
    "<|vision_start|>": VISION_START,
    "<|vision_end|>": VISION_END,
}
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] + ': ' }}"
    "{% if message['content'] is string %}{{ message['content'] + ' ' }}{% else %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|> ' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] + ' ' }}{% endif %}"
    "{% endfor %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
)

TINY_QWEN2_VL = {
    "text_config": {
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": [2, 3, 3],
        },
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    "vision_config": {
        "depth": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "out_hidden_size": 64,
        "window_size": 56,
        "fullatt_block_indexes": [1],
    },
    "image_token_id": IMAGE_TOKEN,
    "video_token_id": VIDEO_TOKEN,
    "vision_start_token_id": VISION_START,
    "vision_end_token_id": VISION_END,
    "tie_word_embeddings": False,
}
# As tests/random_checkpoint.py draws its tiny models: sharp logits, greedy decided by margins.
MATRIX_STD, HEAD_STD = 0.15, 0.6


def write_tiny_qwen2_vl(path: str, seed: int = 0) -> torch.nn.Module:
    """The tiny checkpoint and its processor (tokenizer, image processor, chat template) in
    `path`; returns transformers' model of it (float32, eval)."""
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLImageProcessor,
    )

    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(**TINY_QWEN2_VL)).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, MATRIX_STD)
        model.get_output_embeddings().weight.normal_(0.0, HEAD_STD)
    model.save_pretrained(path)
    # Qwen2_5_VLProcessor itself wants a video processor, which needs torchvision (not installed).
    Qwen2VLImageProcessor().save_pretrained(path)
    tokenizer = word_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    return model


def word_tokenizer() -> Any:
    """Whitespace words `w<id>` for every id, Qwen's vision tokens as special tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": BOS_ID, "</s>": EOS_ID}
    vocab.update({f"w{i}": i for i in range(3, VOCAB) if i not in _SPECIAL.values()})
    vocab.update(_SPECIAL)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.add_special_tokens({"additional_special_tokens": list(_SPECIAL)})
    return fast
