"""CPU decode step of a mixture of experts against a dense model with the same active parameters.

Both models are SmolLM2-135M wide (hidden 576, 9 query heads over 3 KV heads, vocabulary 49,152)
with random weights: the MoE is Mixtral-shaped (8 experts of intermediate 1,536, top-2), the dense
model a Llama with intermediate 2 x 1,536 = 3,072, so one token runs the same number of weights
through its feed-forward. Each step decodes `--batch` requests with contexts of 150-200 tokens
(forward plus logits); the two models alternate round by round in one process, so machine load
hits both alike (bench/ab_steps.py): the step line gives the best and median wall ms and the median
process CPU ms of each and their ratios, with the load average before and after. The expert
figures below it are the best of `--rounds`, set against the best MoE step.

For the MoE step it also reports the expert GEMMs alone (each layer's grouped GEMMs re-run on the
rows that layer saw, through the same packed weights) and so the share of the step spent outside
them: attention, routing, sorting and combining, norms, the LM head.

`--family deepseek` times a DeepSeek-V3-shaped model at the same width instead: multi-head latent
attention (9 heads of qk 64 + 32 and v 64 over a 224-wide latent, so cache rows of 256) and
fine-grained experts (16 of intermediate 768 in 4 groups, top-4 from the 2 best, sigmoid routing
with a correction bias, one shared expert); the dense model's intermediate is chosen so that both
run the same weights per token (the latent projections included). It also prints the KV bytes per
token of both.

`--family glm4_moe` times GLM-4-MoE's layers: the Llama attention of the dense model plus q/k/v
bias and rotary over half of each head, and DeepSeek's expert block at the shapes above (16 experts
of 768, top-4 from the 2 best of 4 groups, sigmoid routing with a correction bias, one shared
expert); the dense model's intermediate is the active experts' 5 x 768.

`--crossover` times instead each expert pair (w13, then w2) of every layer at 1 to 32 rows, through
the small-row kernel and through oneDNN's packed weights in turns (the weights come cold from
memory, as in a step), which is how workers/layers/moe.py's SMALL_ROWS was picked. `--small-rows
N` sets SMALL_ROWS for the run (0: every expert through oneDNN, the path before the kernel).

    python -m bench.moe_step [--family mixtral|deepseek|glm4_moe] [--batch 32] [--layers 8]
        [--rounds 10] [--threads N] [--crossover] [--small-rows N]
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable

import torch
from transformers import DeepseekV3Config, Glm4MoeConfig, LlamaConfig, MixtralConfig

import workers.layers.moe as moe_layer
from bench.ab_steps import Sample, compare, figures, interleave, load, since, start
from workers.kv_cache import KVCache, KVCacheSpec
from workers.layers.attention import AttentionMetadata, select_backend
from workers.layers.backends import cpu_gemm
from workers.layers.linear import linear, pack_cpu_weights
from workers.layers.moe import FusedMoE, expert_linear, route
from workers.models import model_class
from workers.models.deepseek import DeepseekMoE

WIDTH = dict(
    vocab_size=49152,
    hidden_size=576,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    max_position_embeddings=4096,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
)
EXPERT_WIDTH, NUM_EXPERTS, TOP_K = 1536, 8, 2
BLOCK = 16
# Fine-grained experts at SmolLM2's width, for DeepSeek and GLM-4-MoE alike.
GROUPED = dict(
    n_routed_experts=16,
    moe_intermediate_size=768,
    num_experts_per_tok=4,
    n_group=4,
    topk_group=2,
    n_shared_experts=1,
    first_k_dense_replace=0,
    routed_scaling_factor=2.5,
)
# DeepSeek at SmolLM2's width: MLA (cache rows of 224 + 32 = 256) and those experts.
MLA = dict(
    qk_nope_head_dim=64,
    qk_rope_head_dim=32,
    v_head_dim=64,
    kv_lora_rank=224,
    q_lora_rank=None,
    **GROUPED,
)


def build(config) -> torch.nn.Module:
    """The model with random weights (matrices ~ N(0, 0.02), norms 1), packed for CPU."""
    model = model_class(config)(config, max_model_len=4096)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
            else:
                p.fill_(1.0)
    pack_cpu_weights(model)
    return model.requires_grad_(False).eval()


class DecodeStep:
    """A model with its KV cache and one pure-decode batch of `batch` requests."""

    def __init__(self, model: torch.nn.Module, batch: int, seed: int = 7) -> None:
        rng = random.Random(seed)
        lengths = [rng.randint(150, 200) for _ in range(batch)]
        tables, next_block = [], 0
        for n in lengths:
            tables.append(list(range(next_block, next_block + -(-(n + 1) // BLOCK))))
            next_block += len(tables[-1])
        layers = model.attention_layers()
        self.cache = KVCache(
            KVCacheSpec.of(layers, BLOCK, torch.float32), next_block, 0, torch.device("cpu")
        )
        self.cache.bind(layers)
        backend = select_backend(torch.device("cpu"), "torch")
        for layer in layers:
            layer.backend = backend
        self.meta, self.positions = AttentionMetadata.build(
            lengths, [1] * batch, tables, BLOCK, torch.device("cpu")
        )
        backend.prepare(self.meta)
        self.backend = backend
        self.ids = torch.tensor([rng.randrange(3, 40000) for _ in range(batch)])
        self.model = model

    @torch.inference_mode()
    def run(self) -> Sample:
        """One step's wall and CPU time."""
        self.backend.prepare(self.meta)
        t0 = start()
        hidden = self.model(self.ids, self.positions, self.meta)
        self.model.compute_logits(hidden)
        return since(t0)


def capture_moe_inputs(
    step: DecodeStep,
) -> tuple[list[tuple[FusedMoE, torch.Tensor, torch.Tensor]], float]:
    """Each MoE layer's experts with the rows and expert ids they saw in one step, and the ms
    spent in the MoE blocks' forward (routing, sorting, GEMMs, combining; DeepSeek's shared
    expert too)."""
    seen: list[tuple[FusedMoE, torch.Tensor, torch.Tensor]] = []
    spent = [0.0, 0.0]  # start of the current layer, total

    def before(mod, args) -> None:
        spent[0] = time.perf_counter()

    def after(mod, args, out) -> None:
        spent[1] += time.perf_counter() - spent[0]

    gates = {}  # DeepSeek's gate -> its block's experts

    def saw(mod, args, out) -> None:  # a FusedMoE's (x, logits), or DeepSeek's gate's ids
        if isinstance(mod, FusedMoE):
            seen.append((mod, args[0], route(args[1], mod.cfg)[1]))
        else:
            seen.append((gates[mod], args[0], out[1]))

    blocks = [m for m in step.model.modules() if isinstance(m, DeepseekMoE)]
    if not blocks:  # the router logits go into FusedMoE.forward
        blocks = [m for m in step.model.modules() if isinstance(m, FusedMoE)]
    hooks = [m.register_forward_pre_hook(before) for m in blocks]
    hooks += [m.register_forward_hook(after) for m in blocks]
    for block in blocks:
        if isinstance(block, DeepseekMoE):
            gates[block.gate] = block.experts
            hooks.append(block.gate.register_forward_hook(saw))
        else:
            hooks.append(block.register_forward_hook(saw))
    step.run()
    for h in hooks:
        h.remove()
    return seen, spent[1] * 1e3


@torch.inference_mode()
def expert_gemms_ms(seen: list[tuple[FusedMoE, torch.Tensor, torch.Tensor]]) -> float:
    """The grouped expert GEMMs (and the activation between them) of every layer, alone."""
    work = []
    for layer, x, ids in seen:
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=layer.cfg.num_experts).tolist()
        xs = x.index_select(0, order // ids.shape[1])
        work.append((layer, xs, counts))
    t0 = time.perf_counter()
    for layer, xs, counts in work:
        s = 0
        for e, c in enumerate(counts):
            if c:
                h = layer.act(expert_linear(xs[s : s + c], layer.w13[e], None, layer.packed13[e]))
                expert_linear(h, layer.w2[e], None, layer.packed2[e])
            s += c
    return (time.perf_counter() - t0) * 1e3


def expert_pairs(layers: list[FusedMoE], rows: int, small: bool) -> Callable[[], Sample]:
    """One pass of `rows` rows through every expert's w13, activation and w2 of every layer, by
    the small-row kernel or by oneDNN's packed weights."""
    x = torch.randn(rows, layers[0].cfg.hidden_size)

    def lin(x: torch.Tensor, w: torch.Tensor, packed: torch.Tensor | None) -> torch.Tensor:
        return cpu_gemm.small_linear(x, w) if small else linear(x, w, packed=packed)

    @torch.inference_mode()
    def run() -> Sample:
        t0 = start()
        for layer in layers:
            for e in range(layer.num_local):
                h = layer.act(lin(x, layer.w13[e], layer.packed13[e]))
                lin(h, layer.w2[e], layer.packed2[e])
        return since(t0)

    return run


def crossover(model: torch.nn.Module, rounds: int) -> None:
    """Per row count, the expert pairs' ms per layer by each path (median CPU) and their ratio."""
    layers = [m for m in model.modules() if isinstance(m, FusedMoE)]
    print(f"expert pairs of {len(layers)} layers x {layers[0].num_local} experts, ms a layer:")
    for rows in (*range(1, 25), 28, 32):
        runs = [expert_pairs(layers, rows, small) for small in (False, True)]
        one, small = (figures(s)[2] / len(layers) for s in interleave(runs, rounds, warmup=1))
        ratio = small / one
        print(f"  rows {rows:2d}: oneDNN {one:7.3f}  small-row {small:7.3f}  ratio {ratio:.2f}x")


def configs(family: str, layers: int) -> tuple[object, LlamaConfig, str]:
    """(MoE config, dense config of the same active weights per token, what the MoE is)."""
    if family == "mixtral":
        moe = MixtralConfig(
            **WIDTH,
            num_hidden_layers=layers,
            intermediate_size=EXPERT_WIDTH,
            num_local_experts=NUM_EXPERTS,
            num_experts_per_tok=TOP_K,
            sliding_window=None,
        )
        dense = LlamaConfig(
            **WIDTH, num_hidden_layers=layers, intermediate_size=TOP_K * EXPERT_WIDTH
        )
        return moe, dense, f"{NUM_EXPERTS} experts x {EXPERT_WIDTH}, top-{TOP_K}"
    active = (MLA["num_experts_per_tok"] + MLA["n_shared_experts"]) * MLA["moe_intermediate_size"]
    experts = (
        f"{MLA['n_routed_experts']} experts x {MLA['moe_intermediate_size']}, "
        f"top-{MLA['num_experts_per_tok']} + {MLA['n_shared_experts']} shared"
    )
    if family == "glm4_moe":
        glm = {k: v for k, v in WIDTH.items() if k != "head_dim"}  # GLM derives it: 576 / 9
        moe = Glm4MoeConfig(
            **glm, **GROUPED, num_hidden_layers=layers, attention_bias=True, norm_topk_prob=True
        )
        dense = LlamaConfig(**WIDTH, num_hidden_layers=layers, intermediate_size=active)
        return moe, dense, f"GLM attention (rotary on half of each head) + {experts}"
    h, heads = WIDTH["hidden_size"], WIDTH["num_attention_heads"]
    mla_attention = h * heads * (MLA["qk_nope_head_dim"] + MLA["qk_rope_head_dim"])  # q_proj
    mla_attention += h * (MLA["kv_lora_rank"] + MLA["qk_rope_head_dim"])  # kv_a_proj_with_mqa
    mla_attention += MLA["kv_lora_rank"] * heads * (MLA["qk_nope_head_dim"] + MLA["v_head_dim"])
    mla_attention += heads * MLA["v_head_dim"] * h  # o_proj
    d = WIDTH["head_dim"]
    dense_attention = 2 * h * heads * d + 2 * h * WIDTH["num_key_value_heads"] * d
    inter = active + round((mla_attention - dense_attention) / (3 * h))
    moe = DeepseekV3Config(
        **{**WIDTH, "num_key_value_heads": heads}, **MLA, num_hidden_layers=layers
    )
    dense = LlamaConfig(**WIDTH, num_hidden_layers=layers, intermediate_size=inter)
    return moe, dense, f"MLA + {experts}"


def expert_figures(moe: DecodeStep, rounds: int) -> tuple[float, float]:
    """The best over rounds of (the expert GEMMs alone, the MoE blocks' forward) in ms."""
    gemm_ms, block_ms = [], []
    for _ in range(rounds):
        seen, spent = capture_moe_inputs(moe)
        block_ms.append(spent)
        gemm_ms.append(expert_gemms_ms(seen))
    return min(gemm_ms), min(block_ms)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=("mixtral", "deepseek", "glm4_moe"), default="mixtral")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--crossover", action="store_true")
    parser.add_argument("--small-rows", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.small_rows is not None:
        if not 0 <= args.small_rows <= 4096:
            raise ValueError(f"--small-rows: must be in [0, 4096], got {args.small_rows}")
        moe_layer.SMALL_ROWS = args.small_rows
    moe_config, dense_config, what = configs(args.family, args.layers)
    if args.crossover:
        print(f"{args.family}: {torch.get_num_threads()} threads, {load()}")
        crossover(build(moe_config), args.rounds)
        print(f"after: {load()}")
        return
    moe = DecodeStep(build(moe_config), args.batch)
    dense = DecodeStep(build(dense_config), args.batch)
    print(
        f"{args.family}: batch {args.batch}, {args.layers} layers, "
        f"{torch.get_num_threads()} threads, {args.rounds} rounds interleaved"
    )
    print(f"before: {load()}; experts of at most {moe_layer.SMALL_ROWS} rows: small-row kernel")
    print(f"dense: intermediate {dense_config.intermediate_size}; MoE: {what}")
    d, mo = interleave([dense.run, moe.run], args.rounds, warmup=3)
    print(compare(f"decode b{args.batch}", ("dense", "MoE"), d, mo))
    print(f"after: {load()}")
    m = figures(mo)[0]  # the best step, beside the best expert figures
    g, b = expert_figures(moe, args.rounds)
    layer, _, ids = capture_moe_inputs(moe)[0][0]
    experts_hit = int((torch.bincount(ids.reshape(-1)) > 0).sum())
    print(
        f"MoE expert GEMMs alone:           {g:8.2f} ms   ({experts_hit} of "
        f"{layer.cfg.num_experts} experts hit in layer 0)"
    )
    print(
        f"MoE layers (route, sort, GEMMs, combine): {b:8.2f} ms   of which around the GEMMs "
        f"{b - g:.2f} ms"
    )
    print(f"MoE step outside the expert GEMMs: {m - g:8.2f} ms   share {(m - g) / m:.0%}")
    moe_kv, dense_kv = (s.cache.spec.block_bytes // BLOCK for s in (moe, dense))
    print(f"KV bytes per token (float32): MoE {moe_kv}, dense {dense_kv}")


if __name__ == "__main__":
    main()
