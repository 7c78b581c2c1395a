"""workers/models/vision_family.py: the image placeholder every vision family reads from its HF
config, and the refusal of pipeline stages each family's constructor makes first."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from transformers import Gemma3Config, LlavaConfig, Qwen2_5_VLConfig

from workers.models.gemma3_vl import Gemma3ForConditionalGeneration
from workers.models.llava import LlavaForConditionalGeneration
from workers.models.qwen2_vl import Qwen2_5_VLForConditionalGeneration
from workers.models.vision_family import config_image_token_id, refuse_pipeline_stages
from workers.pipeline import init_pipeline, reset_pipeline

FAMILIES = [
    (LlavaForConditionalGeneration, LlavaConfig),
    (Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLConfig),
    (Gemma3ForConditionalGeneration, Gemma3Config),
]


@pytest.fixture
def second_of_two_stages() -> Iterator[None]:
    init_pipeline(rank=1, tp_size=1, size=2)
    yield
    reset_pipeline()


@pytest.mark.parametrize("config", [config for _, config in FAMILIES])
def test_each_family_s_config_names_the_placeholder_the_engine_reads(config):
    hf_config = config()
    hf_config.image_token_id = 4321
    assert config_image_token_id(hf_config) == 4321


def test_an_older_config_names_the_placeholder_image_token_index():
    class Older:
        image_token_index = 77

    assert config_image_token_id(Older()) == 77  # type: ignore[arg-type]


def test_one_stage_is_allowed_and_a_stage_of_two_is_refused_naming_the_setting(
    second_of_two_stages,
):
    with pytest.raises(ValueError, match=r"^pipeline_parallel_size: Gemma 3 splices"):
        refuse_pipeline_stages("Gemma 3")
    reset_pipeline()
    refuse_pipeline_stages("Gemma 3")  # one stage: nothing to refuse
