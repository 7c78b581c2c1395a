"""Finding, converting and loading checkpoints: "default", GGUF files and HF directories."""

from __future__ import annotations

import hashlib
import json
import os

import pytest
import torch

from workers.loader import iterate_weights, safetensors_files
from workers.model_files import (
    DEFAULT_MODEL,
    default_model_path,
    load_tokenizer,
    max_model_len_of,
    resolve_model,
)


def test_default_is_the_embedded_smollm2_gguf():
    path = default_model_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()


def test_gguf_is_converted_once_into_a_directory_keyed_by_its_hash(smollm2_dir):
    digest = hashlib.sha256(default_model_path().read_bytes()).hexdigest()[:24]
    assert digest in os.path.basename(smollm2_dir)
    names = set(os.listdir(smollm2_dir))
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    with open(os.path.join(smollm2_dir, "config.json")) as f:
        config = json.load(f)
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in config  # the stored weights are de-quantised
    weights = os.path.join(smollm2_dir, "model.safetensors")
    mtime = os.stat(weights).st_mtime_ns
    assert resolve_model(DEFAULT_MODEL) == smollm2_dir
    assert os.stat(weights).st_mtime_ns == mtime  # reused, not rewritten


@pytest.mark.slow
def test_converted_tokenizer_matches_the_gguf_tokenizer(smollm2_tokenizer):
    from transformers import AutoTokenizer

    path = default_model_path()
    gguf_tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    for text in [
        "Hello, world!",
        "def f(x):\n    return x ** 2",
        "Ünïcödé — 東京 🚀",
        "  spaces  ",
    ]:
        assert smollm2_tokenizer.encode(text) == gguf_tok.encode(text)
    chat = [{"role": "user", "content": "Hi there"}]
    assert smollm2_tokenizer.apply_chat_template(
        chat, tokenize=False, add_generation_prompt=True
    ) == gguf_tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert load_tokenizer(DEFAULT_MODEL).eos_token == "<|im_end|>"


def test_sharded_checkpoint_is_read_through_its_index(tiny_checkpoint):
    path, hf_model = tiny_checkpoint("qwen2")
    assert os.path.exists(os.path.join(path, "model.safetensors.index.json"))
    files = safetensors_files(path)
    assert len(files) > 1
    names = {name for name, _ in iterate_weights(path, progress=False)}
    assert names == set(hf_model.state_dict()) - {"lm_head.weight"}  # tied head is not stored


def test_bad_paths_raise_value_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        resolve_model(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="no config.json"):
        resolve_model(str(tmp_path))
    text = tmp_path / "weights.bin"
    text.write_text("not a model")
    with pytest.raises(ValueError, match="neither a .gguf file"):
        resolve_model(str(text))
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        safetensors_files(str(tmp_path))


def test_max_model_len_defaults_to_positions_whatever_the_sliding_window():
    """The window is applied in attention, so it no longer caps the context (it once did: a
    512-position Mistral with a 24-token window was served at 24 tokens)."""
    from transformers import MistralConfig

    assert (
        max_model_len_of(MistralConfig(max_position_embeddings=2048, sliding_window=None)) == 2048
    )
    assert max_model_len_of(MistralConfig(max_position_embeddings=512, sliding_window=24)) == 512
    assert (
        max_model_len_of(MistralConfig(max_position_embeddings=32768, sliding_window=4096)) == 8192
    )
    assert (
        max_model_len_of(MistralConfig(max_position_embeddings=131072, sliding_window=None)) == 8192
    )


def test_load_model_rejects_a_checkpoint_missing_tensors(tiny_checkpoint, tmp_path):
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig

    from workers.loader import load_model

    path, _ = tiny_checkpoint("llama")
    state = load_file(safetensors_files(path)[0])
    state.pop("model.layers.1.mlp.down_proj.weight")
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="lacks 1 tensors"):
        load_model(
            str(tmp_path),
            AutoConfig.from_pretrained(path),
            torch.float32,
            torch.device("cpu"),
            progress=False,
        )


def test_mapped_tensors_are_the_files_tensors_whatever_their_dtype_and_alignment(tmp_path):
    from safetensors.torch import load_file, save_file

    from workers.loader import mapped_tensors

    tensors = {
        "a.odd_bytes": torch.arange(7, dtype=torch.uint8),  # leaves the next one unaligned
        "b.f32": torch.randn(3, 5),
        "c.bf16": torch.randn(4, 2).to(torch.bfloat16),
        "d.i64": torch.arange(6, dtype=torch.int64).view(2, 3),
        "e.scalar": torch.tensor(1.5),
        "f.empty": torch.zeros(0, 4),
        "g.f8": torch.randn(8).to(torch.float8_e4m3fn),  # no view: read by safetensors
    }
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path))
    mapped = dict(mapped_tensors(path))
    expected = load_file(str(path))
    assert mapped.keys() == expected.keys()
    for name, tensor in expected.items():
        got = mapped[name]
        assert got.dtype == tensor.dtype and got.shape == tensor.shape, name
        assert torch.equal(got.reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8))
    shard = mapped["b.f32"].narrow(0, 1, 2)  # a rank's rows: a view of the file
    assert torch.equal(shard, expected["b.f32"][1:3])
    mapped["b.f32"].add_(1)  # copy-on-write: the file keeps its values
    assert torch.equal(load_file(str(path))["b.f32"], expected["b.f32"])
