"""Issue 48's GPU line: multi-head latent attention (DeepSeek-V3) and a hybrid linear-attention
model (Qwen3-Next's Gated DeltaNet + gated attention) in bf16 on the GPU: greedy parity at
near-ties and one decode-step time each.

Each family is a random-weight checkpoint at SmolLM2-135M's width (bench/moe_step.py's DeepSeek-V3
shape, bench/hybrid_step.py's hybrid; 8 layers), written here in fp32. The reference is Hugging
Face's fp32 greedy decoding on the same device (the raylm fp32 engine's own logprobs if
transformers cannot run the family). Against it, per engine dtype (fp32, bf16), each prompt is
`identical`, `near-tie` (parted first where the reference's two best logprobs are within the tie:
1e-3 in fp32, 0.25 in bf16, as tests/workers/test_cuda.py judges bf16) or `MISMATCH` (a bug).
Then the bf16 engine (CUDA graphs if the family captures them, else eager: reported) times pure
decode steps at each of --batches.

Needs torch and transformers only (no Ray, flash-attn, gguf or FastAPI).

    python bench/families_gpu.py [--families mla hybrid] [--batches 1 32] [--json out.json]
    python bench/families_gpu.py --smoke          # CPU, tiny shapes, end to end
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.hybrid_step import HYBRID, INTERMEDIATE, LAYERS
from bench.moe_step import MLA, WIDTH
from bench.quant_gpu import decode_ms
from bench.step_llm import step_llm
from scheduler import SamplingParams
from tests.random_checkpoint import (
    TINY_DEEPSEEK,
    ModelSpec,
    random_prompts,
    write_random_checkpoint,
)
from tests.workers.greedy import NEAR_TIE, Greedy, from_logprobs, hf_greedy
from tests.workers.test_qwen3_next import TINY_QWEN3_NEXT

BF16_NEAR_TIE = 0.25  # tests/workers/test_cuda.py's tie for bf16 against an fp32 reference
HEAD_STD = 4.0 / WIDTH["hidden_size"] ** 0.5  # logits of a trained model's spread (about 4)

SPECS = {
    "mla": ModelSpec(
        "DeepseekV3Config",
        {**WIDTH, "num_key_value_heads": WIDTH["num_attention_heads"], **MLA}
        | {"num_hidden_layers": LAYERS},
        matrix_std=0.02,
        head_std=HEAD_STD,
    ),
    "hybrid": ModelSpec(
        "Qwen3NextConfig",
        {**WIDTH, **HYBRID, "num_hidden_layers": LAYERS, "intermediate_size": INTERMEDIATE}
        | {"partial_rotary_factor": 0.25},
        matrix_std=0.02,
        head_std=HEAD_STD,
    ),
}
SMOKE_SPECS = {
    "mla": TINY_DEEPSEEK["deepseek_v3"].with_fields(vocab_size=512),
    # The tests' tiny Qwen3-Next with a dense MLP in every layer, as the GPU shape has.
    "hybrid": TINY_QWEN3_NEXT.with_fields(vocab_size=512, mlp_only_layers=[0, 1, 2, 3]),
}


@dataclass(slots=True)
class Engine:
    """One raylm engine's parity against the reference, and (bf16) its step times."""

    dtype: str
    graphs: bool = False
    verdicts: list[str] = field(default_factory=list)  # per prompt
    step_ms: dict[int, float] = field(default_factory=dict)  # batch: mean decode step
    error: str | None = None


@dataclass(slots=True)
class Family:
    name: str
    reference: str = "hf"  # or "raylm fp32" when transformers could not run the family
    engines: list[Engine] = field(default_factory=list)
    error: str | None = None


def verdict(tokens: list[int], ref: Greedy, tie: float) -> str:
    """identical, near-tie (parted first at a near-tie of the reference) or MISMATCH."""
    for i, (a, b) in enumerate(zip(tokens, ref.token_ids)):
        if a != b:
            gap = ref.top2[i][0] - ref.top2[i][1]
            kind = "near-tie" if gap <= tie else "MISMATCH"
            return f"{kind} at token {i} (reference top-2 gap {gap:.4f}, tie {tie})"
    return "identical" if len(tokens) == len(ref.token_ids) else "MISMATCH in length"


def hf_references(path: str, prompts, max_tokens: int, device: str) -> list[Greedy]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    try:
        return [hf_greedy(model, p, max_tokens) for p in prompts]
    finally:
        del model
        _free(device)


def make_engine(path: str, dtype: str, args, eager: bool = False):
    return step_llm(
        path,
        device=args.device,
        dtype=dtype,
        batch=max(args.batches),
        request_tokens=args.context + args.steps + 64,
        budget=max(2048, args.context),
        spare_blocks=64,
        enforce_eager=eager,
    )


def run_engine(path: str, dtype: str, prompts, refs, args, vocab: int) -> tuple[Engine, list]:
    """Parity (and step times in bf16) on one engine; CUDA graphs first, eager if they fail."""
    result = Engine(dtype)
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True, logprobs=2)
    for eager in (False, True):
        try:
            llm = make_engine(path, dtype, args, eager)
        except Exception:  # reported, then the next mode is tried
            result.error = traceback.format_exc(limit=3)
            continue
        try:
            result.graphs = llm.engine.executor.runner.graphs is not None
            outs = llm.generate(prompts, params, use_tqdm=False)
            tie = NEAR_TIE if dtype == "float32" else BF16_NEAR_TIE
            own = [from_logprobs(o.token_ids, o.logprobs) for o in outs]
            result.verdicts = [verdict(o.token_ids, r, tie) for o, r in zip(outs, refs or own)]
            if dtype != "float32":
                for b in args.batches:
                    result.step_ms[b] = decode_ms(
                        llm, vocab, b, args.context, args.steps, args.device
                    )
            result.error = None
            return result, own
        except Exception:
            result.error = traceback.format_exc(limit=3)
        finally:
            llm.shutdown()
            del llm
            _free(args.device)
    return result, []


def run_family(name: str, spec: ModelSpec, args) -> Family:
    family = Family(name)
    with tempfile.TemporaryDirectory() as root:
        t = time.perf_counter()
        ckpt = write_random_checkpoint(spec, root, device=args.device)
        print(f"{name}: checkpoint written in {time.perf_counter() - t:.1f} s", flush=True)
        prompts = random_prompts(args.prompts, ckpt.vocab_size, 16, 64, seed=48)
        try:
            refs = hf_references(root, prompts, args.tokens, args.device)
        except Exception as e:  # the raylm fp32 engine becomes the reference
            print(f"{name}: HF reference failed ({type(e).__name__}: {e}); raylm fp32 instead")
            family.reference, refs = "raylm fp32", None
        for dtype in args.dtypes:
            engine, own = run_engine(root, dtype, prompts, refs, args, ckpt.vocab_size)
            if refs is None and dtype == "float32" and own:
                refs = own
            family.engines.append(engine)
            report(name, engine)
    return family


def report(name: str, e: Engine) -> None:
    mode = "graphs" if e.graphs else "eager"
    if e.error:
        print(f"{name} {e.dtype}: FAILED\n{e.error}", flush=True)
        return
    same = sum(v == "identical" for v in e.verdicts)
    bad = sum(v.startswith("MISMATCH") for v in e.verdicts)
    steps = ", ".join(f"batch {b} {ms:.3f} ms" for b, ms in e.step_ms.items())
    print(
        f"{name} {e.dtype} ({mode}): {same}/{len(e.verdicts)} identical, {bad} mismatches"
        f"{'; step ' + steps if steps else ''}",
        flush=True,
    )
    for i, v in enumerate(e.verdicts):
        if v != "identical":
            print(f"    prompt {i}: {v}")


def _free(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny shapes")
    parser.add_argument("--families", nargs="+", default=["mla", "hybrid"], choices=list(SPECS))
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 32])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    specs = SPECS
    if args.smoke:
        args.device, specs, args.batches, args.prompts = "cpu", SMOKE_SPECS, [1, 4], 3
        args.tokens, args.context, args.steps = 6, 32, 3
    elif not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --smoke on CPU")
    else:
        args.device = "cuda"
    families = []
    for name in args.families:
        try:
            families.append(run_family(name, specs[name], args))
        except Exception:  # the next family still runs
            families.append(Family(name, error=traceback.format_exc(limit=3)))
            print(f"{name}: FAILED\n{families[-1].error}", flush=True)
        if args.json:  # after each family: a run cut by its timeout keeps the ones before
            Path(args.json).write_text(json.dumps([asdict(f) for f in families], indent=1))


if __name__ == "__main__":
    main()
