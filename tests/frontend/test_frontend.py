"""One frontend for the ingress and the offline LLM: the same prompt ids, one BOS, the same stop
ids."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from tokenizers.processors import TemplateProcessing
from transformers import AutoTokenizer

from deploy.config import AppConfig
from frontend.frontend import Frontend

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Name a colour."},
]
# A Llama-3-style template: it writes the BOS itself, so the tokenizer must not add another.
BOS_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] "
    "}}<|im_end|>\n"
    "{% endfor %}<|im_start|>assistant\n"
)
EXTRA_EOS = 5  # an end-of-turn id only generation_config.json names
BOS = 0  # <|endoftext|>: a special token the template uses nowhere else


@pytest.fixture(scope="module")
def bos_model_dir(tiny_checkpoint, tmp_path_factory) -> str:
    """The tiny Llama with a tokenizer that adds BOS, a BOS-emitting chat template and two EOS
    ids."""
    source, _ = tiny_checkpoint("llama")
    path = tmp_path_factory.mktemp("tiny-bos")
    shutil.copytree(source, path, dirs_exist_ok=True)
    (path / "chat_template.jinja").unlink(missing_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(source)
    bos = tokenizer.convert_ids_to_tokens(BOS)
    tokenizer.bos_token = bos
    tokenizer._tokenizer.post_processor = TemplateProcessing(
        single=f"{bos} $A", special_tokens=[(bos, BOS)]
    )
    tokenizer.chat_template = BOS_TEMPLATE
    tokenizer.save_pretrained(path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, EXTRA_EOS]}))
    return str(path)


def test_a_bos_emitting_template_gets_exactly_one_bos_on_both_paths(bos_model_dir, llm_factory):
    frontend = Frontend.load(bos_model_dir)
    assert frontend.encode_prompt("hello")[0] == BOS  # plain prompts do get the tokenizer's BOS
    served = frontend.encode_chat(MESSAGES)
    assert served.count(BOS) == 1 and served[0] == BOS

    llm = llm_factory(model=bos_model_dir)
    from scheduler import SamplingParams

    offline = llm.chat(MESSAGES, SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)[0]
    assert offline.prompt_token_ids == served


def test_the_same_stop_ids_on_both_paths(bos_model_dir, llm_factory):
    ingress_frontend = Frontend.load(AppConfig.from_args({"model": bos_model_dir}).engine.model)
    llm = llm_factory(model=bos_model_dir)
    assert (
        EXTRA_EOS in ingress_frontend.info.eos_token_ids
        and 2 in ingress_frontend.info.eos_token_ids
    )
    assert llm.engine.eos_token_ids == ingress_frontend.info.eos_token_ids


def test_the_configs_load_no_torch_and_the_frontend_no_model_code():
    configs = (
        "import sys, deploy.config, deploy.settings_doc; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", configs], check=True)
    # transformers' Auto classes bring torch along; the frontend itself needs no model code.
    frontend = (
        "import sys, frontend.frontend; "
        "assert not {'workers.models', 'workers.loader', 'workers.runner'} & set(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", frontend], check=True)
