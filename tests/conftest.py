"""Session fixtures shared across test folders: loaded models are expensive, build each once.

- smollm2_dir / smollm2_tokenizer: the embedded SmolLM2-135M-Instruct, converted once into the
  default cache directory (~/.cache/raylm), so later sessions skip the de-quantisation.
- hf_smollm2: Hugging Face's own model read from the same GGUF file (the reference).
- llm_factory: LLM instances cached by their arguments for the whole session.
- ray_cluster: one loopback Ray instance for the whole session (Serve shut down with it); every
  test that needs Ray or Serve uses it, so Ray starts once.
- tiny_model_dir / long_tiny_model_dir: a random two-layer Llama with SmolLM2's tokenizer and no
  chat
  template, with 256 or 4,096 positions.
- tiny_checkpoint: writes small random Llama / Qwen2 / Qwen3 / Mistral (and one-KV-head Llama)
  checkpoints
  (config.json + safetensors + tokenizer) and returns (directory, Hugging Face model).
"""

from __future__ import annotations

import os
import shutil
import socket

import pytest
import torch

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

# Small KV pools keep several engines within memory; enough for 32 requests of ~200 tokens.
TEST_KV_GB = 0.25


def free_port() -> int:
    """A loopback port nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def ray_cluster() -> str:
    """One loopback Ray instance for the session; yields its GCS address."""
    import ray
    from ray import serve

    started = not ray.is_initialized()
    if started:
        # Logical CPUs: TP=4 CPU bundles and two Serve apps must fit on the 2-core machine.
        ray.init(
            num_cpus=8,
            include_dashboard=False,
            log_to_driver=False,
            _node_ip_address="127.0.0.1",
            _metrics_export_port=free_port(),
            _system_config={"metrics_report_interval_ms": 1000},
        )
    yield ray.get_runtime_context().gcs_address
    if started:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="session")
def smollm2_dir() -> str:
    from workers.model_files import resolve_model

    return resolve_model("default")


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_dir):
    """transformers' model read straight from the GGUF file (its own de-quantisation)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from workers.model_files import default_model_path

    path = default_model_path()
    config = AutoConfig.from_pretrained(smollm2_dir)  # parsing GGUF metadata again costs seconds
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, config=config, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="session")
def llm_factory():
    """make(**kwargs) -> LLM, one instance per distinct kwargs for the whole session."""
    from engine.llm import LLM

    built: dict[tuple, LLM] = {}

    def make(**kwargs) -> LLM:
        kwargs.setdefault("device", "cpu")
        kwargs.setdefault("load_progress", False)
        if "num_gpu_blocks" not in kwargs:
            kwargs.setdefault("kv_cache_memory_gb", TEST_KV_GB)
        key = tuple(sorted(kwargs.items()))
        if key not in built:
            built[key] = LLM(**kwargs)
        return built[key]

    yield make
    for llm in built.values():
        llm.shutdown()


def _write_tiny_llama(out, max_positions: int) -> str:
    """A random 2-layer Llama with SmolLM2's tokenizer, minus its chat template (the fallback
    applies)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from workers.model_files import load_tokenizer

    tokenizer = load_tokenizer("default")
    tokenizer.chat_template = None
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True,
    )
    LlamaForCausalLM(config).save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return str(out)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """The tiny Llama with 256 positions."""
    return _write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), 256)


@pytest.fixture(scope="session")
def long_tiny_model_dir(tmp_path_factory):
    """The tiny Llama with 4,096 positions, for generations that must outlast a watchdog round."""
    return _write_tiny_llama(tmp_path_factory.mktemp("tiny-llama-long"), 4096)


@pytest.fixture(scope="session")
def smollm2_llm(llm_factory):
    return llm_factory(model="default", dtype="float32")


TINY_COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
)
TINY_FAMILIES = {
    # Llama 3 with llama3 rope scaling, untied head, bias-free.
    "llama": (
        "LlamaConfig",
        dict(
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            tie_word_embeddings=False,
        ),
    ),
    # Qwen2: qkv bias, tied embeddings; saved in shards with an index.
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True)),
    # Qwen3: q/k RMSNorm, head_dim not hidden/heads.
    "qwen3": ("Qwen3Config", dict(head_dim=32, tie_word_embeddings=False)),
    "mistral": ("MistralConfig", dict(sliding_window=None, head_dim=16, tie_word_embeddings=False)),
    # One KV head: tensor parallelism must replicate it.
    "llama_mqa": (
        "LlamaConfig",
        dict(num_key_value_heads=1, attention_bias=True, tie_word_embeddings=False),
    ),
}


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory, smollm2_dir, smollm2_tokenizer):
    """family -> (checkpoint directory, the Hugging Face model it was saved from)."""
    import transformers
    from transformers import AutoModelForCausalLM

    made: dict[str, tuple[str, torch.nn.Module]] = {}

    def make(family: str) -> tuple[str, torch.nn.Module]:
        if family in made:
            return made[family]
        config_cls, extra = TINY_FAMILIES[family]
        config = getattr(transformers, config_cls)(
            vocab_size=len(smollm2_tokenizer),
            bos_token_id=1,
            eos_token_id=2,
            **{**TINY_COMMON, **extra},
        )
        torch.manual_seed(sum(map(ord, family)))
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        with torch.no_grad():
            # Random init gives nearly flat logits (ties everywhere); sharpen them so greedy
            # decoding is decided by clear margins, as in a trained model.
            for p in model.parameters():
                if p.dim() == 2:
                    p.normal_(0.0, 0.15)
            model.lm_head.weight.normal_(0.0, 0.6)
        path = tmp_path_factory.mktemp(f"tiny-{family}")
        model.save_pretrained(path, max_shard_size="2MB" if family == "qwen2" else "1GB")
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            if os.path.exists(os.path.join(smollm2_dir, name)):
                shutil.copy(os.path.join(smollm2_dir, name), path / name)
        made[family] = (str(path), model)
        return made[family]

    return make
