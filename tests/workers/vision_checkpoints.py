"""Tiny random vision-language checkpoints with their real processors (LLaVA here; other
families may add theirs). Written once per session by the tests that need them.

The LLaVA checkpoint: SmolLM2's tokenizer with an `<image>` token added, a two-layer Llama of
width 64, a two-layer CLIP tower of width 32 over 28 px images in 14 px patches (4 image tokens
per image), a real `CLIPImageProcessor` and `LlavaProcessor`, and a chat template that renders
`{"type": "image"}` parts as `<image>` (as llava-hf's does).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

IMAGE_TOKEN = "<image>"
LLAVA_IMAGE_SIZE = 28
LLAVA_PATCH = 14
# What llava-hf's template does, over ChatML-free turns: images first, then the text.
LLAVA_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'].upper() + ': ' }}"
    "{% if message['content'] is string %}{{ message['content'] + ' ' }}{% else %}"
    "{% for part in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>\n' }}{% endfor %}"
    "{% for part in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ part['text'] + ' ' }}{% endfor %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)


@dataclass(frozen=True, slots=True)
class VisionCheckpoint:
    path: str
    image_token_id: int
    tokens_per_image: int
    tokenizer: Any  # with the image token


def write_tiny_llava(
    path: str,
    tokenizer: Any,
    seed: int = 0,
    *,
    image_size: int = LLAVA_IMAGE_SIZE,
    vision_width: int = 32,
    vision_layers: int = 2,
    max_positions: int = 512,
    tower: str = "clip",
) -> VisionCheckpoint:
    """A tiny random LLaVA with sharp logits (greedy choices decided by clear margins) saved with
    its processor into path. The tower's image size, width and depth may grow (a benchmark's
    encoder cost); patches stay 14 px. tower "siglip": SigLIP's tower and image processor, every
    row kept (no class token: strategy "full"), as SigLIP LLaVAs are configured."""
    import transformers
    from transformers import LlamaConfig, LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor

    tokenizer = copy.deepcopy(tokenizer)  # the session's tokenizer stays as it was
    tokenizer.add_tokens([IMAGE_TOKEN], special_tokens=True)
    tokenizer.chat_template = LLAVA_CHAT_TEMPLATE
    image_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    text = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    siglip = tower == "siglip"
    vision = getattr(transformers, "SiglipVisionConfig" if siglip else "CLIPVisionConfig")(
        hidden_size=vision_width,
        intermediate_size=2 * vision_width,
        num_hidden_layers=vision_layers,
        num_attention_heads=2,
        image_size=image_size,
        patch_size=LLAVA_PATCH,
    )
    tokens = (image_size // LLAVA_PATCH) ** 2  # CLIP's class row dropped; SigLIP has none
    config = LlavaConfig(
        text_config=text,
        vision_config=vision,
        image_token_index=image_id,
        image_seq_length=tokens,
        vision_feature_layer=-2,
        vision_feature_select_strategy="full" if siglip else "default",
        tie_word_embeddings=False,
    )
    config.architectures = ["LlavaForConditionalGeneration"]
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).eval()
    _sharpen(model, seed)
    model.save_pretrained(path)
    square = {"height": image_size, "width": image_size}
    if siglip:
        images = transformers.SiglipImageProcessor(size=square)
    else:
        images = transformers.CLIPImageProcessor(
            size={"shortest_edge": image_size}, crop_size=square
        )
    processor = LlavaProcessor(
        image_processor=images,
        tokenizer=tokenizer,
        patch_size=LLAVA_PATCH,
        vision_feature_select_strategy=config.vision_feature_select_strategy,
        num_additional_image_tokens=0 if siglip else 1,
        chat_template=LLAVA_CHAT_TEMPLATE,
    )
    processor.save_pretrained(path)
    return VisionCheckpoint(path, image_id, tokens, tokenizer)


def _sharpen(model: torch.nn.Module, seed: int) -> None:
    """Redraw the weights as tests/random_checkpoint.py does for the text families: matrices
    N(0, 0.15), the LM head N(0, 0.6), so greedy tokens are far from ties."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2:
                std = 0.6 if name.endswith("lm_head.weight") else 0.15
                p.copy_(torch.randn(p.shape, generator=gen) * std)


def random_image(seed: int, size: tuple[int, int] = (40, 32)) -> Any:
    """A PIL RGB image of random pixels (width, height), the same for the same seed."""
    from PIL import Image

    pixels = np.random.RandomState(seed).randint(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(pixels)
