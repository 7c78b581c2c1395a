"""A tiny random Gemma 3 with images, saved with its real processor (written once per module by
the tests that need it).

SmolLM2's tokenizer with Gemma 3's image tokens (`<start_of_image>`, `<image_soft_token>`,
`<end_of_image>`, as the tokenizer's boi/image/eoi tokens) and turn markers; a two-layer Gemma 3
language model of width 64 (head size 32), one sliding-window layer of window 8 and one global
layer, so the window is shorter than every image prompt; a two-layer SigLIP tower of width 32 over
28 px images in 7 px patches, pooled 2x2 to 4 image tokens; a real `Gemma3ImageProcessor` and
`Gemma3Processor`, and a chat template that writes `<start_of_image>` per image part (as Gemma 3's
does).
"""

from __future__ import annotations

from typing import Any

import torch

from tests.workers.vision_checkpoints import VisionCheckpoint, _sharpen

IMAGE_SIZE, PATCH, TOKENS = 28, 7, 4
SLIDING_WINDOW = 8
SPECIALS = {
    "boi_token": "<start_of_image>",
    "image_token": "<image_soft_token>",
    "eoi_token": "<end_of_image>",
}
# Gemma 3's template, shortened: turns, images as <start_of_image>, text trimmed.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<start_of_turn>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] | trim }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}"
    "{{ '<start_of_image>' }}{% elif part['type'] == 'text' %}{{ part['text'] | trim }}"
    "{% endif %}{% endfor %}{% endif %}{{ '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)


def gemma3_tokenizer(base: Any) -> Any:
    """base (SmolLM2's tokenizer) with Gemma 3's image and turn tokens and chat template."""
    from transformers import AutoTokenizer

    # Named special tokens are set at load (what Gemma 3's tokenizer_config.json declares).
    tokenizer = AutoTokenizer.from_pretrained(base.name_or_path, extra_special_tokens=SPECIALS)
    tokenizer.add_tokens(["<start_of_turn>", "<end_of_turn>"], special_tokens=True)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def write_tiny_gemma3(path: str, base_tokenizer: Any, seed: int = 0) -> VisionCheckpoint:
    """The checkpoint and its processor in path; image_token_id is `<image_soft_token>`."""
    from transformers import (
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        Gemma3ImageProcessor,
        Gemma3Processor,
        Gemma3TextConfig,
        SiglipVisionConfig,
    )

    tokenizer = gemma3_tokenizer(base_tokenizer)
    ids = {k: tokenizer.convert_tokens_to_ids(v) for k, v in SPECIALS.items()}
    text = Gemma3TextConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        query_pre_attn_scalar=32,
        sliding_window=SLIDING_WINDOW,
        layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=512,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=0,
        tie_word_embeddings=False,  # a head of its own, drawn wider: sharp greedy choices
    )
    vision = SiglipVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=IMAGE_SIZE,
        patch_size=PATCH,
        vision_use_head=False,
    )
    config = Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=TOKENS,
        boi_token_index=ids["boi_token"],
        eoi_token_index=ids["eoi_token"],
        image_token_index=ids["image_token"],
        tie_word_embeddings=False,
    )
    config.architectures = ["Gemma3ForConditionalGeneration"]
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(config).eval()
    _sharpen(model, seed)
    model.save_pretrained(path)
    images = Gemma3ImageProcessor(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    processor = Gemma3Processor(
        image_processor=images,
        tokenizer=tokenizer,
        image_seq_length=TOKENS,
        chat_template=CHAT_TEMPLATE,
    )
    processor.save_pretrained(path)
    return VisionCheckpoint(path, ids["image_token"], TOKENS, tokenizer)
