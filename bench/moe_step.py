"""CPU decode step of a mixture of experts against a dense model with the same active parameters.

Both models are SmolLM2-135M wide (hidden 576, 9 query heads over 3 KV heads, vocabulary 49,152)
with random weights: the MoE is Mixtral-shaped (8 experts of intermediate 1,536, top-2), the dense
model a Llama with intermediate 2 x 1,536 = 3,072, so one token runs the same number of weights
through its feed-forward. Each step decodes `--batch` requests with contexts of 150-200 tokens
(forward plus logits); the two models alternate round by round in one process, so machine load
hits both alike. Figures are medians over rounds.

For the MoE step it also reports the expert GEMMs alone (each layer's grouped GEMMs re-run on the
rows that layer saw, through the same packed weights) and so the share of the step spent outside
them: attention, routing, sorting and combining, norms, the LM head.

    python bench/moe_step.py [--batch 32] [--layers 8] [--rounds 10] [--threads N]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
from transformers import LlamaConfig, MixtralConfig

from workers.kv_cache import KVCache, KVCacheSpec
from workers.layers.attention import AttentionMetadata, select_backend
from workers.layers.linear import linear, pack_cpu_weights
from workers.layers.moe import FusedMoE, route
from workers.models import model_class

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
    def run(self) -> float:
        """One step's wall time in ms."""
        self.backend.prepare(self.meta)
        t0 = time.perf_counter()
        hidden = self.model(self.ids, self.positions, self.meta)
        self.model.compute_logits(hidden)
        return (time.perf_counter() - t0) * 1e3


def capture_moe_inputs(
    step: DecodeStep,
) -> tuple[list[tuple[FusedMoE, torch.Tensor, torch.Tensor]], float]:
    """Each MoE layer with the rows and router logits it saw in one step, and the ms spent in
    the layers' forward (routing, sorting, GEMMs, combining)."""
    seen: list[tuple[FusedMoE, torch.Tensor, torch.Tensor]] = []
    spent = [0.0, 0.0]  # start of the current layer, total

    def before(mod, args) -> None:
        seen.append((mod, args[0], args[1]))
        spent[0] = time.perf_counter()

    def after(mod, args, out) -> None:
        spent[1] += time.perf_counter() - spent[0]

    layers = [m for m in step.model.modules() if isinstance(m, FusedMoE)]
    hooks = [m.register_forward_pre_hook(before) for m in layers]
    hooks += [m.register_forward_hook(after) for m in layers]
    step.run()
    for h in hooks:
        h.remove()
    return seen, spent[1] * 1e3


@torch.inference_mode()
def expert_gemms_ms(seen: list[tuple[FusedMoE, torch.Tensor, torch.Tensor]]) -> float:
    """The grouped expert GEMMs (and the activation between them) of every layer, alone."""
    work = []
    for layer, x, logits in seen:
        _, ids = route(logits, layer.cfg)
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
                h = layer.act(linear(xs[s : s + c], layer.w13[e], packed=layer.packed13[e]))
                linear(h, layer.w2[e], packed=layer.packed2[e])
            s += c
    return (time.perf_counter() - t0) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    moe_config = MixtralConfig(
        **WIDTH,
        num_hidden_layers=args.layers,
        intermediate_size=EXPERT_WIDTH,
        num_local_experts=NUM_EXPERTS,
        num_experts_per_tok=TOP_K,
        sliding_window=None,
    )
    dense_config = LlamaConfig(
        **WIDTH, num_hidden_layers=args.layers, intermediate_size=TOP_K * EXPERT_WIDTH
    )
    moe = DecodeStep(build(moe_config), args.batch)
    dense = DecodeStep(build(dense_config), args.batch)
    for _ in range(3):  # warm-up: oneDNN primitives, the paged kernel, allocator
        moe.run(), dense.run()
    moe_ms, dense_ms, gemm_ms, block_ms = [], [], [], []
    for _ in range(args.rounds):
        moe_ms.append(moe.run())
        dense_ms.append(dense.run())
        seen, spent = capture_moe_inputs(moe)
        block_ms.append(spent)
        gemm_ms.append(expert_gemms_ms(seen))
    m, d, g, b = (statistics.median(x) for x in (moe_ms, dense_ms, gemm_ms, block_ms))
    layer, _, logits = capture_moe_inputs(moe)[0][0]
    experts_hit = int((torch.bincount(route(logits, layer.cfg)[1].reshape(-1)) > 0).sum())
    print(
        f"batch {args.batch}, {args.layers} layers, {torch.get_num_threads()} threads, "
        f"{args.rounds} rounds (median)"
    )
    print(f"dense step (intermediate {TOP_K * EXPERT_WIDTH}): {d:8.2f} ms")
    print(
        f"MoE step ({NUM_EXPERTS} experts x {EXPERT_WIDTH}, top-{TOP_K}): {m:8.2f} ms   "
        f"ratio MoE / dense: {m / d:.2f}x"
    )
    print(
        f"MoE expert GEMMs alone:           {g:8.2f} ms   ({experts_hit} of {NUM_EXPERTS} "
        "experts hit in layer 0)"
    )
    print(
        f"MoE layers (route, sort, GEMMs, combine): {b:8.2f} ms   of which around the GEMMs "
        f"{b - g:.2f} ms"
    )
    print(f"MoE step outside the expert GEMMs: {m - g:8.2f} ms   share {(m - g) / m:.0%}")


if __name__ == "__main__":
    main()
