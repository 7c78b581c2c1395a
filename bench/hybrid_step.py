"""CPU step time of a hybrid linear-attention model (Qwen3-Next's layers) against a dense Llama of
about the same size.

Both are SmolLM2-135M wide (hidden 576, vocabulary 49,152, dense SwiGLU MLPs of 1,536 on every
layer) with random weights. The Llama has 8 attention layers of 9 query heads over 3 KV heads of
64. The hybrid repeats (DeltaNet, DeltaNet, DeltaNet, gated full attention) twice: its DeltaNet
layers have 3 key heads and 6 value heads of 64 (about the Llama attention's weights), a 4-tap
conv, and a float32 state per request of 6 x 64 x 64 numbers per layer; its two full-attention
layers carry the only paged KV. The two models alternate round by round in one process, so machine
load hits both alike (bench/ab_steps.py); each line gives the best and median wall ms and the median
process CPU ms of each, their ratios, and the load average before and after.

`--family granite` times Granite-4 hybrid's layers instead: Mamba-2 (9 heads of 64, one group,
a state of 64 per head, 64-token scan chunks) in place of the DeltaNet, attention without rotary.

Steps timed (forward plus logits): decode at batch 1 and `--batch` (contexts 150-200 tokens, the
hybrid's state slots already filled), and one `--prefill`-token prompt from position 0.

    python -m bench.hybrid_step [--family qwen3_next|granite] [--batch 32] [--prefill 512]
        [--rounds 10] [--threads N]
"""

from __future__ import annotations

import argparse
import random

import torch
from transformers import GraniteMoeHybridConfig, LlamaConfig, PretrainedConfig, Qwen3NextConfig

from bench.ab_steps import Sample, compare, interleave, load, since, start
from bench.moe_step import BLOCK, WIDTH, build
from workers.kv_cache import KVCache, KVCacheSpec
from workers.layers.attention import AttentionMetadata, select_backend
from workers.linear_state import STATEFUL, LinearStateStore

LAYERS = 8
INTERMEDIATE = 1536
HYBRID = dict(
    layer_types=["linear_attention"] * 3
    + ["full_attention"]
    + ["linear_attention"] * 3
    + ["full_attention"],
    linear_num_key_heads=3,
    linear_num_value_heads=6,
    linear_key_head_dim=64,
    linear_value_head_dim=64,
    linear_conv_kernel_dim=4,
    mlp_only_layers=list(range(LAYERS)),  # dense MLPs: the token mixers are what differs
)
GRANITE = dict(
    layer_types=HYBRID["layer_types"],
    mamba_n_heads=9,
    mamba_d_head=64,
    mamba_n_groups=1,
    mamba_d_state=64,
    mamba_d_conv=4,
    mamba_expand=1,
    mamba_chunk_size=64,
    num_local_experts=0,  # the shared MLP alone: dense, as the Llama
    shared_intermediate_size=INTERMEDIATE,
)


def hybrid_config(family: str, shape: dict) -> PretrainedConfig:
    if family == "granite":
        return GraniteMoeHybridConfig(**shape, **GRANITE)
    return Qwen3NextConfig(**shape, **HYBRID, partial_rotary_factor=0.25)


class Step:
    """A model, its KV cache (and state slots), and one batch: request i computes query_lens[i]
    tokens from position starts[i]."""

    def __init__(self, model: torch.nn.Module, starts: list[int], query_lens: list[int]) -> None:
        rng = random.Random(7)
        tables, next_block = [], 0
        for s, n in zip(starts, query_lens):
            tables.append(list(range(next_block, next_block + -(-(s + n) // BLOCK))))
            next_block += len(tables[-1])
        layers = model.attention_layers()
        cpu = torch.device("cpu")
        self.cache = KVCache(KVCacheSpec.of(layers, BLOCK, torch.float32), next_block, 0, cpu)
        self.cache.bind(layers)
        self.backend = select_backend(cpu, "torch")
        for layer in layers:
            layer.backend = self.backend
        self.meta, self.positions = AttentionMetadata.build(starts, query_lens, tables, BLOCK, cpu)
        self.ids = torch.tensor([rng.randrange(3, 40000) for _ in range(sum(query_lens))])
        self.req_ids, self.starts = [f"r{i}" for i in range(len(starts))], starts
        delta = [m for m in model.modules() if isinstance(m, STATEFUL)]
        self.store = LinearStateStore(delta, len(starts), torch.float32, cpu) if delta else None
        for rid in self.req_ids if self.store is not None else ():  # running: slots held
            self.store.assign(rid, self.req_ids)
        self.model = model

    @torch.inference_mode()
    def run(self) -> Sample:
        """One step's wall and CPU time (binding the state slots included)."""
        self.backend.prepare(self.meta)
        t0 = start()
        if self.store is not None:
            self.store.begin_step(self.req_ids, self.starts, self.req_ids)
        hidden = self.model(self.ids, self.positions, self.meta)
        self.model.compute_logits(hidden[-1:] if len(self.starts) == 1 else hidden)
        return since(t0)


def num_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=("qwen3_next", "granite"), default="qwen3_next")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prefill", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    shape = {**WIDTH, "num_hidden_layers": LAYERS, "intermediate_size": INTERMEDIATE}
    dense = build(LlamaConfig(**shape))
    hybrid = build(hybrid_config(args.family, shape))
    rng = random.Random(11)
    cases = {
        "decode b1": ([rng.randint(150, 200)], [1]),
        f"decode b{args.batch}": (
            [rng.randint(150, 200) for _ in range(args.batch)],
            [1] * args.batch,
        ),
        f"prefill {args.prefill}": ([0], [args.prefill]),
    }
    print(
        f"{args.family}: {LAYERS} layers, {torch.get_num_threads()} threads, "
        f"{args.rounds} rounds interleaved; "
        f"params dense {num_params(dense) / 1e6:.1f} M, hybrid {num_params(hybrid) / 1e6:.1f} M"
    )
    print(f"before: {load()}")
    for name, (starts, lens) in cases.items():
        steps = Step(dense, starts, lens), Step(hybrid, starts, lens)
        d, h = interleave([steps[0].run, steps[1].run], args.rounds)
        print(compare(name, ("dense", "hybrid"), d, h))
    print(f"after: {load()}")
    kv = [s.cache.spec.block_bytes // BLOCK for s in steps]
    state = steps[1].store.nbytes if steps[1].store is not None else 0
    print(f"KV bytes per token (float32): dense {kv[0]}, hybrid {kv[1]}")
    print(f"hybrid state bytes per request (all linear layers): {state // len(steps[1].starts)}")


if __name__ == "__main__":
    main()
