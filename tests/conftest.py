"""Session fixtures shared across test folders: loaded models are expensive, build each once.

- smollm2_dir / smollm2_tokenizer: the embedded SmolLM2-135M-Instruct, converted once into the
  default cache directory (~/.cache/raylm), so later sessions skip the de-quantisation.
- hf_smollm2: Hugging Face's own model read from the same GGUF file (the reference).
- llm_factory: LLM instances cached by their arguments for the whole session.
- ray_cluster: one loopback Ray instance for the whole session (Serve stopped with it); every
  test that needs Ray or Serve uses it, so Ray starts once.
- tiny_model_dir / long_tiny_model_dir: a random two-layer Llama with SmolLM2's tokenizer and no
  chat template, with 256 or 4,096 positions.
- tiny_checkpoint: small random Llama / Qwen2 / Qwen3 / Mistral (and one-KV-head Llama), MoE
  (Mixtral, Qwen2-MoE, Qwen3-MoE) and sliding-window Mistral checkpoints with SmolLM2's tokenizer,
  and the Hugging Face models they hold.

Every random checkpoint is written by tests/random_checkpoint.py.
"""

from __future__ import annotations

import os

import torch

# Without a GPU, Triton kernels can only run in Triton's interpreter, and TRITON_INTERPRET must be
# set before triton is imported (the tests/workers/test_triton_*.py modules; torch._dynamo imports
# triton from many torch paths, and with it triton's own @jit helpers, compiled). Nothing here
# when triton is not installed; nothing on a CUDA machine, where the compiled kernels run.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Serve's routers skip a replica that does not answer a queue-length probe within 0.1 s. A freshly
# started replica on this 2-core machine sometimes misses it for a few probes, and the tests that
# check how a burst splits then see every request on the other replica. Set before Ray starts, so
# the driver's handles and every Serve actor read it. Kept after the replica's constructor stopped
# holding its loop (bench/results/2026-11-29-replica-loop-lag.md): what misses the probe here is
# the machine, not LLMReplica. At 0.1 s, test_serve_router.py's toy StreamingReplica (no engine,
# a few lines of asyncio) missed it too and its burst split 2/14; the probe is answered on a
# thread of Serve's own, and the router's deadline runs on the caller's loop, each waiting for a
# core when the load average is far above 2.
os.environ.setdefault("RAY_SERVE_QUEUE_LENGTH_RESPONSE_DEADLINE_S", "1")

import pytest
from hypothesis import HealthCheck, settings

from tests.random_checkpoint import (
    TINY_FAMILIES,
    TINY_GEMMA,
    TINY_GPT_OSS,
    TINY_MOE_FAMILIES,
    TINY_PHI3,
    TINY_PHI3_LONGROPE,
    TINY_SERVED_LLAMA,
    TINY_SLIDING_MISTRAL,
    write_random_checkpoint,
)
from workers.distributed import free_port

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

# Small KV pools keep several engines within memory; enough for 32 requests of ~200 tokens.
TEST_KV_GB = 0.25

# Hypothesis profiles, picked by HYPOTHESIS_PROFILE (or --hypothesis-profile): "ci", the default,
# bounds every property's examples; "dev" is for the edit-test loop; "thorough" hunts. A test's
# own @settings(max_examples=...) pins its count in every profile. No deadline and no too-slow
# check: on a shared machine they fail on the machine's load, not on the code.
settings.register_profile(
    "ci", max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("dev", settings.get_profile("ci"), max_examples=10)
settings.register_profile("thorough", settings.get_profile("ci"), max_examples=1000)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE") or "ci")

# Tests that start Ray or Serve, or load the embedded SmolLM2 model, reach one of these fixtures;
# a test that loads SmolLM2 by name is marked slow where it is written.
SLOW_FIXTURES = {"ray_cluster", "smollm2_llm", "hf_smollm2"}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark slow every test that reaches a slow fixture, so `-m "not slow"` leaves it out."""
    for item in items:
        if SLOW_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def ray_cluster() -> str:
    """One loopback Ray instance for the session; yields its GCS address."""
    import ray

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
        # No serve.shutdown(): it stops every app gracefully (~5 s); ray.shutdown() stops the
        # cluster this session started, Serve's controller, proxies and replicas with it.
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
    """transformers' model of the embedded GGUF file, its own de-quantisation: smollm2_dir is
    transformers' from_pretrained(gguf_file=...) state dict saved as safetensors
    (workers/model_files.py), read back here in a second instead of de-quantised again."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()


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


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, smollm2_dir):
    """The served tiny Llama with 256 positions."""
    return _served_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), smollm2_dir, 256)


@pytest.fixture(scope="session")
def long_tiny_model_dir(tmp_path_factory, smollm2_dir):
    """The served tiny Llama with 4,096 positions, for generations that outlast a watchdog round."""
    return _served_tiny_llama(tmp_path_factory.mktemp("tiny-llama-long"), smollm2_dir, 4096)


def _served_tiny_llama(path, smollm2_dir: str, max_positions: int) -> str:
    """SmolLM2's tokenizer without its chat template, so the fallback template applies."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    tokenizer.chat_template = None
    spec = TINY_SERVED_LLAMA.with_fields(max_position_embeddings=max_positions)
    return write_random_checkpoint(spec, str(path), tokenizer=tokenizer).path


@pytest.fixture(scope="session")
def smollm2_llm(llm_factory):
    """The embedded SmolLM2 de-quantised to fp32: the path whose numerics transformers shares."""
    return llm_factory(model="default", dtype="float32", quantization="none")


@pytest.fixture(scope="session")
def smollm2_gguf_llm(llm_factory):
    """The embedded SmolLM2 as served by default: its Q4_1 blocks kept, the int8 CPU kernel.
    Prefix caching is off, so what one test ran never changes how another's prompts are laid
    out (the int8 rounding of activations would show it in their logprobs)."""
    return llm_factory(
        model="default", quantization="auto", kv_cache_memory_gb=0.25, enable_prefix_caching=False
    )


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory, smollm2_tokenizer):
    """family (a key of TINY_FAMILIES or TINY_MOE_FAMILIES, "mistral_window" or "phi3") ->
    (checkpoint directory, the Hugging Face model)."""
    from transformers import AutoModelForCausalLM

    made: dict[str, tuple[str, torch.nn.Module]] = {}
    specs = {
        **TINY_FAMILIES,
        **TINY_MOE_FAMILIES,
        "mistral_window": TINY_SLIDING_MISTRAL,
        "phi3": TINY_PHI3,
        "phi3_longrope": TINY_PHI3_LONGROPE,
        **TINY_GEMMA,
        "gpt_oss": TINY_GPT_OSS,
    }

    def make(family: str) -> tuple[str, torch.nn.Module]:
        if family not in made:
            path = str(tmp_path_factory.mktemp(f"tiny-{family}"))
            seed = sum(map(ord, family))
            write_random_checkpoint(specs[family], path, seed=seed, tokenizer=smollm2_tokenizer)
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            made[family] = (path, model)
        return made[family]

    return make
