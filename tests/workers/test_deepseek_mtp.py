"""DeepSeek-V3's multi-token-prediction layer as the proposer (`speculative.method: mtp`,
workers/mtp.py): on a tiny random V3 whose checkpoint carries an MTP layer, speculative decoding
gives exactly plain decoding's greedy tokens (16-token chunks, three prompts batched), proposals
were made, verified and some accepted; the acceptance rate is printed (random weights: low is
expected). The MTP layer's tensors are the checkpoint's last decoder layer's, perturbed, under
`model.layers.{num_hidden_layers}.`, plus its own norms, projection, embedding and head."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from scheduler import SamplingParams
from tests.random_checkpoint import TINY_DEEPSEEK, write_random_checkpoint

MAX_TOKENS = 12
PARAMS = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def add_mtp_layer(path: str, seed: int) -> None:
    """Append one MTP layer to the single-file checkpoint at `path` and declare it."""
    config_file = Path(path, "config.json")
    config = json.loads(config_file.read_text())
    n, hidden = config["num_hidden_layers"], config["hidden_size"]
    (weights_file,) = Path(path).glob("*.safetensors")
    tensors = load_file(weights_file)
    gen = torch.Generator().manual_seed(seed)
    last = f"model.layers.{n - 1}."
    for name, t in list(tensors.items()):
        if name.startswith(last):
            noise = torch.randn(t.shape, generator=gen) * 0.1 * t.float().std().nan_to_num(0.1)
            tensors[f"model.layers.{n}." + name[len(last) :]] = (t.float() + noise).to(t.dtype)
    mtp = f"model.layers.{n}."
    vocab = tensors["model.embed_tokens.weight"].shape[0]
    own = {
        "enorm.weight": 1 + 0.2 * torch.randn(hidden, generator=gen),
        "hnorm.weight": 1 + 0.2 * torch.randn(hidden, generator=gen),
        "eh_proj.weight": 0.1 * torch.randn(hidden, 2 * hidden, generator=gen),
        "embed_tokens.weight": tensors["model.embed_tokens.weight"].clone(),
        "shared_head.norm.weight": tensors["model.norm.weight"].clone(),
        "shared_head.head.weight": 0.6 * torch.randn(vocab, hidden, generator=gen),
    }
    tensors.update({mtp + k: v.contiguous() for k, v in own.items()})
    save_file(tensors, weights_file, metadata={"format": "pt"})
    config["num_nextn_predict_layers"] = 1
    config_file.write_text(json.dumps(config))


@pytest.fixture(scope="module")
def v3_with_mtp(tmp_path_factory, smollm2_tokenizer) -> str:
    path = str(tmp_path_factory.mktemp("tiny-v3-mtp"))
    spec = TINY_DEEPSEEK["deepseek_v3"]
    write_random_checkpoint(
        spec, path, seed=sum(map(ord, "deepseek_v3")), tokenizer=smollm2_tokenizer
    )
    add_mtp_layer(path, seed=3)
    return path


def _common(path: str) -> dict:
    return dict(model=path, dtype="float32", max_num_batched_tokens=16, max_model_len=256)


@pytest.fixture(scope="module")
def mtp_llm(v3_with_mtp):
    """The engine that speculates with the MTP layer: 3 tokens a step, never paused."""
    from engine.llm import LLM

    spec = {"method": "mtp", "num_tokens": 3, "min_acceptance_rate": 0.0}
    llm = LLM(
        **_common(v3_with_mtp),
        speculative=spec,
        device="cpu",
        load_progress=False,
        kv_cache_memory_gb=0.05,
    )
    yield llm
    llm.shutdown()


@pytest.mark.slow
def test_mtp_proposals_keep_plain_decodings_tokens(
    v3_with_mtp, mtp_llm, llm_factory, smollm2_tokenizer
):
    from tests.workers.test_hf_parity import TEXTS

    prompts = [
        smollm2_tokenizer.encode(TEXTS[1]),
        list(range(300, 345)),
        [(7 * i) % 40000 + 100 for i in range(70)],
    ]
    plain = llm_factory(**_common(v3_with_mtp)).generate(prompts, PARAMS, use_tqdm=False)
    outs = mtp_llm.generate(prompts, PARAMS, use_tqdm=False)
    stats = mtp_llm.engine.stats()
    for i, (a, b) in enumerate(zip(outs, plain, strict=True)):
        assert a.token_ids == b.token_ids, f"prompt {i}: MTP speculation changed the tokens"
    proposed, accepted = stats.num_spec_proposed_tokens, stats.num_spec_accepted_tokens
    assert proposed > 0 and stats.num_spec_verify_rows > 0
    print(f"MTP acceptance on random weights: {accepted}/{proposed} = {accepted / proposed:.3f}")


def test_mtp_needs_a_checkpoint_with_mtp_layers(tmp_path, smollm2_tokenizer):
    from transformers import AutoConfig

    from workers.models.deepseek_mtp import DeepseekMTP, num_mtp_layers

    path = str(tmp_path)
    write_random_checkpoint(TINY_DEEPSEEK["deepseek_v3"], path, tokenizer=smollm2_tokenizer)
    config = AutoConfig.from_pretrained(path)
    config.num_nextn_predict_layers = 0
    with pytest.raises(ValueError, match="num_nextn_predict_layers >= 1"):
        DeepseekMTP(config)
    for bad in (2**64, -1, math.nan, 10**12):
        config.num_nextn_predict_layers = bad
        with pytest.raises(ValueError, match="num_nextn_predict_layers"):
            num_mtp_layers(config)


def _hf_mtp(path: str, tmp: Path):
    """transformers' one-layer DeepSeek-V3 holding the MTP layer's block, norm and head: run on
    inputs_embeds, it is the MTP layer after eh_proj."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from workers.models.deepseek_mtp import mtp_weights

    config = AutoConfig.from_pretrained(path)
    n = config.num_hidden_layers
    (weights_file,) = Path(path).glob("*.safetensors")
    tensors = dict(mtp_weights(load_file(weights_file).items(), n))
    own = {k: tensors.pop(k) for k in ("enorm.weight", "hnorm.weight", "eh_proj.weight")}
    config.first_k_dense_replace = int(n < config.first_k_dense_replace)
    config.num_hidden_layers, config.num_nextn_predict_layers = 1, 0
    config.save_pretrained(tmp)
    save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
    return AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval(), own, config


@pytest.mark.slow
@torch.inference_mode()
def test_the_first_proposal_is_the_mtp_layers_prediction(v3_with_mtp, mtp_llm, tmp_path):
    """After a 12-token prompt's prefill, the proposal's first token is the argmax of the MTP
    layer computed whole by transformers' modules: position i fed the model's final hidden state
    h_i and the next token t_{i+1} (the last one the token just sampled)."""
    from transformers import AutoModelForCausalLM

    from scheduler import EngineRequest
    from scheduler.features_spec import SpecDecoding

    prompt = [(37 * i) % 40000 + 200 for i in range(12)]
    engine = mtp_llm.engine
    engine.add_request(EngineRequest("mtp-ref", prompt, PARAMS))
    (out,) = [o for o in engine.step() if o.request_id == "mtp-ref"]
    (spec,) = [f for f in engine.scheduler.features if isinstance(f, SpecDecoding)]
    proposal = spec._proposals["mtp-ref"]
    engine.abort_requests(["mtp-ref"])

    main = AutoModelForCausalLM.from_pretrained(v3_with_mtp, dtype=torch.float32).eval()
    tokens = prompt + out.new_token_ids[:1]
    h = main.model(torch.tensor([prompt])).last_hidden_state[0]  # after the final norm
    mtp, own, config = _hf_mtp(v3_with_mtp, tmp_path)
    eps = config.rms_norm_eps

    def rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    e = mtp.model.embed_tokens(torch.tensor(tokens[1:]))
    e[0] = 0  # position 0's embedding is masked, as vLLM's DeepSeekMTP does
    x = torch.cat([rms(e, own["enorm.weight"]), rms(h, own["hnorm.weight"])], -1)
    x = x @ own["eh_proj.weight"].t()
    logits = mtp(inputs_embeds=x[None], position_ids=torch.arange(len(prompt))[None]).logits
    assert proposal and proposal[0] == int(logits[0, -1].argmax())
