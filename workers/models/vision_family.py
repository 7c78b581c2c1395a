"""What every vision family (llava.py, qwen2_vl.py, gemma3_vl.py) reads the same way beside its
language model: the image placeholder token its composite HF config names, and the refusal of
pipeline stages (the image rows are spliced into the first stage's embeddings, and the stages have
not been taught to carry them)."""

from __future__ import annotations

from transformers import PretrainedConfig

from workers.pipeline import current_stage


def config_image_token_id(hf_config: PretrainedConfig) -> int:
    """The placeholder token: `image_token_id`, or `image_token_index` in older configs."""
    token = getattr(hf_config, "image_token_id", None)
    return int(token if token is not None else hf_config.image_token_index)


def refuse_pipeline_stages(family: str) -> None:
    """A ValueError naming `pipeline_parallel_size` when this process runs one of several
    stages."""
    if current_stage().size > 1:
        raise ValueError(
            f"pipeline_parallel_size: {family} splices image embeddings on the first stage; "
            "pipeline stages are not supported for it yet"
        )
